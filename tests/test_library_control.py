"""The driver's side of the control API through `CaptureClient`: the weight version, through the
code ``PUT /admin/weight-version`` runs (stored first, checked, pushed to vLLM), and no other way
to set it; a rollout's outcome, through the code ``PUT /admin/rollouts/{id}/outcome`` runs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from capture_proxy.errors import ProxyError
from capture_proxy.library import CaptureClient
from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import CallStatus, RolloutInfo
from capture_proxy.sinks.base import PROXY_STATE_ROLLOUT, StoreError
from capture_proxy.sinks.memory import MemorySink
from capture_proxy.sinks.registry import open_sink, open_source
from capture_proxy.testing.fake_vllm import FakeVLLM, Turn
from tests.support.proxy_harness import chat_body, user


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeVLLM, str]]:
    fake = FakeVLLM(dev_mode=True)
    server = TestServer(fake.app())
    await server.start_server()
    try:
        yield fake, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'lib.db'}"


def _versions(tmp_path: Path, rollout: str) -> list[int]:
    source = open_source(_url(tmp_path))
    try:
        return [r.weight_version for r in source.calls(rollout)]
    finally:
        source.close_reader()


async def test_set_weight_version_stores_stamps_and_pushes_it(
    tmp_path: Path, fake: tuple[FakeVLLM, str]
) -> None:
    upstream, base = fake
    upstream.push(Turn("a"), Turn("b"), Turn("c"))
    client = CaptureClient(open_sink(_url(tmp_path)), upstream=base)
    try:
        assert (await client.chat("ep", chat_body(user("hi")))).status is CallStatus.STAGED
        answer = await client.set_weight_version(3)
        assert answer == {"weight_version": 3, "engine": "updated"}
        assert upstream.weight_version == "3"
        assert client.weight_version == 3
        await client.chat("ep", chat_body(user("hi")))
    finally:
        await client.close()
    assert _versions(tmp_path, "ep") == [0, 3]
    # A client opened later on the store stamps the version set: it was stored, not just held.
    again = CaptureClient(open_sink(_url(tmp_path)), upstream=base)
    try:
        await again.chat("ep2", chat_body(user("hi")))
        assert again.weight_version == 3
    finally:
        await again.close()
    assert _versions(tmp_path, "ep2") == [3]


async def test_assigning_the_weight_version_is_refused_naming_the_setter(tmp_path: Path) -> None:
    client = CaptureClient(open_sink(_url(tmp_path)))
    try:
        with pytest.raises(AttributeError, match=r"await set_weight_version\(version\)"):
            client.weight_version = 5
        with pytest.raises(AttributeError, match="read-only"):
            client.capture.weight_version = 5
        assert client.weight_version == 0
        # Without an upstream there is no engine to push to: stored and stamped all the same.
        assert await client.set_weight_version(2) == {"weight_version": 2, "engine": "not_served"}
    finally:
        await client.close()


@pytest.mark.parametrize("bad", [-1, True, "3", 2.0])
async def test_a_bad_weight_version_is_422_and_changes_nothing(
    tmp_path: Path, fake: tuple[FakeVLLM, str], bad: object
) -> None:
    upstream, base = fake
    client = CaptureClient(open_sink(_url(tmp_path)), upstream=base)
    try:
        await client.set_weight_version(1)
        with pytest.raises(ProxyError) as refused:
            await client.set_weight_version(bad)  # type: ignore[arg-type]
        assert (refused.value.status, refused.value.param) == (422, "weight_version")
        assert refused.value.message == (
            f"the weight version must be an integer of 0 or more, got {bad!r}"
        )
        assert client.weight_version == 1
        assert upstream.weight_version == "1"  # nothing pushed
    finally:
        await client.close()


class _HeaderDown(MemorySink):
    """A store that refuses rollout headers (and so the weight version)."""

    async def put_rollout(self, info: RolloutInfo) -> None:
        raise StoreError("the store is read-only")


async def test_a_version_the_store_cannot_keep_is_503_and_not_pushed(
    fake: tuple[FakeVLLM, str],
) -> None:
    upstream, base = fake
    sink = _HeaderDown()
    client = CaptureClient(sink, upstream=base)
    try:
        with pytest.raises(ProxyError) as refused:
            await client.set_weight_version(4)
        assert (refused.value.status, refused.value.code) == (503, "weight_version_not_stored")
        assert "the store is read-only" in refused.value.message
        assert "still stamped 0" in refused.value.message
        assert (client.weight_version, upstream.weight_version) == (0, "default")
        assert PROXY_STATE_ROLLOUT not in sink.rollouts()
    finally:
        await client.close()


async def test_put_outcome_stores_it_on_open_and_sealed_rollouts(
    tmp_path: Path, fake: tuple[FakeVLLM, str]
) -> None:
    upstream, base = fake
    upstream.push(Turn("a"))
    client = CaptureClient(open_sink(_url(tmp_path)), upstream=base)
    try:
        await client.chat("ep", chat_body(user("hi")))
        first = await client.put_outcome("ep", {"reward": 0.5, "group_id": "g1"})
        assert first["rollout_id"] == "ep"
        assert (first["state"], first["revisions"]) == ("open", 1)
        assert (first["outcome"]["reward"], first["outcome"]["group_id"]) == (0.5, "g1")
        await client.seal("ep")
        # JSON bytes, as the route takes them; the judge's second word replaces the first.
        again = await client.put_outcome("ep", b'{"reward": {"pass": 1, "style": 0.25}}')
        assert (again["state"], again["revisions"]) == ("sealed", 2)
    finally:
        await client.close()
    # A client started later knows the rollout only from the store: the outcome goes there too.
    later = CaptureClient(open_sink(_url(tmp_path)))
    try:
        assert (await later.put_outcome("ep", {"reward": 1.0, "group_id": "g1"}))["revisions"] == 3
    finally:
        await later.close()
    with open_store(_url(tmp_path)) as store:
        info = store.rollout_info("ep")
        assert [o.scalar_reward for o in info.outcome_history] == [0.5, None, 1.0]
        traj = store.trajectory("ep")
        assert (traj.reward, traj.group_id) == (1.0, "g1")


@pytest.mark.parametrize(
    ("body", "status", "code", "param", "says"),
    [
        ({"reward": float("nan")}, 422, None, "reward", "reward"),
        ({"reward": {"pass": "yes"}}, 422, "invalid_type", "reward.pass", "at reward.pass"),
        ({}, 422, "empty_outcome", "", "An outcome needs one of"),
        ({"reward": 1, "score": 2}, 422, None, "score", "score"),
        ({"group_id": ""}, 422, None, "group_id", "group_id"),
        (b"not json", 400, "invalid_json", None, "not valid JSON"),
        ({"metadata": {"note": "x" * 70_000}}, 413, "outcome_too_large", None, "at most 65536"),
    ],
)
async def test_a_bad_outcome_is_refused_as_the_route_refuses_it(
    tmp_path: Path,
    body: bytes | dict[str, Any],
    status: int,
    code: str | None,
    param: str | None,
    says: str,
) -> None:
    client = CaptureClient(open_sink(_url(tmp_path)))
    try:
        # The body is checked before the rollout is looked up, as on the route.
        with pytest.raises(ProxyError) as refused:
            await client.put_outcome("nope", body)
        e = refused.value
        assert e.status == status
        assert code is None or e.code == code
        assert e.param == param
        assert says in e.message
    finally:
        await client.close()


async def test_an_unknown_rollout_is_404_and_a_value_json_cannot_hold_a_type_error(
    tmp_path: Path,
) -> None:
    client = CaptureClient(open_sink(_url(tmp_path)))
    try:
        with pytest.raises(ProxyError) as refused:
            await client.put_outcome("nope", {"reward": 1.0})
        assert (refused.value.status, refused.value.code) == (404, "unknown_rollout")
        assert refused.value.message == "no rollout nope"
        with pytest.raises(TypeError, match="datetime is not JSON serializable"):
            await client.put_outcome("nope", {"metadata": {"at": datetime.now(UTC)}})
    finally:
        await client.close()
