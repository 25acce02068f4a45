"""The rollout driver's side of the loop: the proxy's control API and vLLM's weight reload.

Standard library only (``urllib``): a driver needs no framework to create rollouts, seal them,
grade them, and swap the policy's weights under a pause.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

__all__ = ["ControlAPI", "reload_vllm_weights"]


def _request(
    url: str, method: str, body: Any = None, token: str = "", timeout: float = 120
) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:2000]
        raise RuntimeError(f"{method} {url} answered {e.code}: {detail}") from None
    answer: dict[str, Any] = json.loads(raw) if raw.strip() else {}
    return answer


class ControlAPI:
    """The proxy's control API (docs/contract.md#control-api-for-rollout-drivers)."""

    def __init__(self, proxy_url: str, admin_token: str) -> None:
        self.url = proxy_url.rstrip("/")
        self.token = admin_token

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        return _request(f"{self.url}{path}", method, body, self.token)

    def create_rollout(self, rollout_id: str, *, token_in: bool = True) -> dict[str, Any]:
        """A new rollout whose calls go token-in: ``{rollout_id, base_url, api_key, ...}``."""
        body = {"rollout_id": rollout_id, "token_in": token_in}
        return self._call("POST", "/admin/rollouts", body)

    def seal(self, rollout_id: str) -> dict[str, Any]:
        """Seal the rollout (its in-flight calls finish first); its final manifest."""
        return self._call("POST", f"/admin/rollouts/{rollout_id}/seal")

    def grade(self, rollout_id: str, reward: float, group_id: str) -> dict[str, Any]:
        """The grader's outcome: the reward and the GRPO group (the rollouts of one prompt)."""
        body = {"reward": reward, "group_id": group_id}
        return self._call("PUT", f"/admin/rollouts/{rollout_id}/outcome", body)

    def set_weight_version(self, version: int) -> dict[str, Any]:
        return self._call("PUT", "/admin/weight-version", {"weight_version": version})

    def pause(self) -> dict[str, Any]:
        """Stop admitting calls and pause vLLM (which also drops its prefix cache)."""
        return self._call("POST", "/admin/weights/pause")

    def resume(self, version: int) -> dict[str, Any]:
        """Stamp `version` on later calls, tell vLLM, resume vLLM, admit calls again."""
        return self._call("POST", "/admin/weights/resume", {"weight_version": version})


def reload_vllm_weights(vllm_url: str, weights_dir: str) -> None:
    """Have vLLM 0.32 load the weights in `weights_dir` (a HF model folder) in place.

    vLLM serves no "load from disk" route of its own; with ``VLLM_SERVER_DEV_MODE=1`` its
    ``POST /collective_rpc`` calls a worker method by name, and the workers'
    ``reload_weights(weights_path=...)`` reloads every layer from that folder's safetensors
    (vllm/v1/worker/gpu_worker.py, which the CPU worker inherits). Call it while paused.
    """
    body = {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}}
    _request(f"{vllm_url.rstrip('/')}/collective_rpc", "POST", body, timeout=300)
