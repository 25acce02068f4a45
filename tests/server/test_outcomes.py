"""Outcomes from the driver: ``PUT /admin/rollouts/{id}/outcome``, kept in the store.

On both store kinds: accepted while the rollout is open and after it is sealed, a later outcome
replaces the earlier one in the manifest and every one is kept in `RolloutInfo.outcome_history`,
across proxy restarts; trainers get it on `Trajectory`. And every refusal, as the user sees it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.core.outcomes import MAX_OUTCOME_BYTES, MAX_OUTCOMES
from capture_proxy.read.reader import open_store
from capture_proxy.schemas.outcome import RolloutOutcome
from capture_proxy.schemas.records import RolloutInfo, RolloutState
from capture_proxy.sinks.base import StoreError
from capture_proxy.sinks.memory import MemorySink
from capture_proxy.sinks.registry import open_sink
from tests.support.proxy_harness import Proxy, chat_body, start_proxy, stop_proxy, user

TOKEN = "admin-secret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
ADMIN_JSON = {**ADMIN, "Content-Type": "application/json"}


def _url(kind: str, tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}" if kind == "sqlite" else f"parquet:///{tmp_path}/ds"


async def _proxy(tmp_path: Path, url: str) -> Proxy:
    return await start_proxy(tmp_path, sink=open_sink(url), admin_token=TOKEN)


async def _put(p: Proxy, rollout: str, body: Any) -> dict[str, Any]:
    resp = await p.client.put(f"/admin/rollouts/{rollout}/outcome", json=body, headers=ADMIN)
    assert resp.status == 200, await resp.text()
    answer: dict[str, Any] = await resp.json()
    return answer


async def _put_raw(p: Proxy, rollout: str, raw: bytes) -> tuple[int, dict[str, Any]]:
    resp = await p.client.put(f"/admin/rollouts/{rollout}/outcome", data=raw, headers=ADMIN_JSON)
    return resp.status, await resp.json()


async def _manifest(p: Proxy, rollout: str) -> dict[str, Any]:
    resp = await p.client.get(f"/admin/rollouts/{rollout}/manifest", headers=ADMIN)
    assert resp.status == 200, await resp.text()
    manifest: dict[str, Any] = await resp.json()
    return manifest


async def _call(p: Proxy, rollout: str, text: str) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    resp = await p.chat(chat_body(user(text), tools=[tool]), rollout=rollout)
    assert resp.headers["X-Capture-Status"] == "staged", await resp.text()


def _without_time(outcome: dict[str, Any]) -> dict[str, Any]:
    assert outcome["at_ms"] > 0
    return {k: v for k, v in outcome.items() if k != "at_ms"}


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_outcomes_open_and_sealed_are_kept_across_restarts(tmp_path: Path, kind: str) -> None:
    url = _url(kind, tmp_path)
    first = await _proxy(tmp_path, url)
    try:
        created = await first.client.post(
            "/admin/rollouts", json={"rollout_id": "ep", "metadata": {"task": 7}}, headers=ADMIN
        )
        assert created.status == 201
        await _call(first, "ep", "hello")
        answer = await _put(first, "ep", {"reward": 0.5, "group_id": "g-1"})
        assert answer["state"] == "open"
        assert answer["revisions"] == 1
        assert _without_time(answer["outcome"]) == {
            "reward": 0.5,
            "group_id": "g-1",
            "metadata": None,
        }
        assert _without_time((await _manifest(first, "ep"))["outcome"])["reward"] == 0.5
        sealed = await first.client.post("/admin/rollouts/ep/seal", headers=ADMIN)
        assert (await sealed.json())["outcome"]["group_id"] == "g-1"  # the seal kept it
        # The judge grades after the episode: a sealed rollout takes its outcome too.
        graded = {"reward": {"correct": 1, "format": 0.25}, "group_id": "g-1", "metadata": {"j": 2}}
        answer = await _put(first, "ep", graded)
        assert (answer["state"], answer["revisions"]) == ("sealed", 2)
    finally:
        await stop_proxy(first)

    second = await _proxy(tmp_path, url)
    try:
        manifest = await _manifest(second, "ep")
        assert manifest["state"] == "sealed"
        assert _without_time(manifest["outcome"]) == {
            "reward": {"correct": 1.0, "format": 0.25},
            "group_id": "g-1",
            "metadata": {"j": 2},
        }
        answer = await _put(second, "ep", {"reward": 0.0, "metadata": {"regraded": True}})
        assert answer["revisions"] == 3
    finally:
        await stop_proxy(second)

    store = open_store(url)
    try:
        info = store.rollout_info("ep")
        assert dict(info.metadata) == {"task": 7}  # the driver's metadata, as it was sent
        assert info.state is RolloutState.SEALED
        assert [(o.reward, o.group_id) for o in info.outcome_history] == [
            (0.5, "g-1"),
            ({"correct": 1.0, "format": 0.25}, "g-1"),
            (0.0, None),  # a later outcome replaces the whole earlier one
        ]
        traj = store.trajectory("ep")
        assert (traj.reward, traj.reward_components, traj.group_id) == (0.0, None, None)
        store.verify()
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_an_open_rollouts_outcome_survives_a_restart_and_its_seal(
    tmp_path: Path, kind: str
) -> None:
    url = _url(kind, tmp_path)
    first = await _proxy(tmp_path, url)
    try:
        await _call(first, "ep", "hello")  # created by its first call, not by the driver
        await _put(first, "ep", {"reward": {"pass": 1.0}, "group_id": "g-9"})
    finally:
        await stop_proxy(first)
    second = await _proxy(tmp_path, url)
    try:
        await _call(second, "ep", "again")  # resumes the rollout from the store
        sealed = await second.client.post("/admin/rollouts/ep/seal", headers=ADMIN)
        assert sealed.status == 200
        assert (await sealed.json())["outcome"]["reward"] == {"pass": 1.0}
    finally:
        await stop_proxy(second)
    store = open_store(url)
    try:
        assert len(store.rollout_info("ep").outcome_history) == 1
        traj = store.trajectory("ep")
        assert (traj.reward, traj.reward_components, traj.group_id) == (None, {"pass": 1.0}, "g-9")
        assert traj.to_dict()["reward_components"] == {"pass": 1.0}
    finally:
        store.close()


async def test_outcomes_sent_at_once_are_all_kept(tmp_path: Path) -> None:
    p = await start_proxy(tmp_path, admin_token=TOKEN)
    try:
        await _call(p, "open-ep", "hello")
        await _call(p, "sealed-ep", "hello")
        assert (await p.client.post("/admin/rollouts/sealed-ep/seal", headers=ADMIN)).status == 200
        for rollout in ("open-ep", "sealed-ep"):
            answers = await asyncio.gather(*(_put(p, rollout, {"reward": i}) for i in range(8)))
            assert sorted(a["revisions"] for a in answers) == list(range(1, 9))
        src = p.source()
        for rollout in ("open-ep", "sealed-ep"):
            rewards = [o.scalar_reward or 0.0 for o in src.rollout_info(rollout).outcome_history]
            assert sorted(rewards) == [float(i) for i in range(8)], rollout
        assert src.rollout_info("sealed-ep").state is RolloutState.SEALED
        assert src.rollout_info("open-ep").state is RolloutState.OPEN
    finally:
        await stop_proxy(p)


def _error(message: str, param: str, code: str) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }


T, V = "invalid_type", "invalid_value"
#: body -> (the message, whose path after " at " is also `param`; the code)
REFUSED = {
    "reward-str": (b'{"reward": "1"}', "Expected `float | object | null`, got `str` at reward", T),
    "reward-bool": (
        b'{"reward": true}',
        "Expected `float | object | null`, got `bool` at reward",
        T,
    ),
    "component-str": (
        b'{"reward": {"ok": 1, "style": "good"}}',
        "Expected `float`, got `str` at reward.style",
        T,
    ),
    "reward-empty-object": (
        b'{"reward": {}}',
        "Expected an object with one reward at least at reward",
        V,
    ),
    "nan": (b'{"reward": NaN}', "Expected a finite number, got `NaN` at reward", V),
    "infinity": (
        b'{"reward": {"ok": Infinity}}',
        "Expected a finite number, got `Infinity` at reward.ok",
        V,
    ),
    "past-float64": (
        b'{"reward": -1e400}',
        "Expected a finite number, got `-Infinity` at reward",
        V,
    ),
    "nan-in-metadata": (
        b'{"group_id": "g", "metadata": {"scores": [1.0, NaN]}}',
        "Expected a finite number, got `NaN` at metadata.scores[1]",
        V,
    ),
    "group-int": (b'{"group_id": 3}', "Expected `str | null`, got `int` at group_id", T),
    "group-empty": (b'{"group_id": ""}', "Expected `str` of length >= 1 at group_id", V),
    "metadata-list": (
        b'{"metadata": [1]}',
        "Expected `object | null`, got `array` at metadata",
        T,
    ),
}


@pytest.mark.parametrize(("raw", "message", "code"), REFUSED.values(), ids=REFUSED.keys())
async def test_a_bad_outcome_is_a_422_naming_the_field(
    make_proxy: Any, raw: bytes, message: str, code: str
) -> None:
    p = await make_proxy(admin_token=TOKEN)
    await _call(p, "ep", "hello")
    status, body = await _put_raw(p, "ep", raw)
    assert (status, body) == (422, _error(message, message.rsplit(" at ", 1)[1], code))
    assert p.source().rollout_info("ep").outcome_history == ()  # nothing was kept


async def test_an_unknown_key_is_named_with_the_fields_allowed(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    await _call(p, "ep", "hello")
    status, body = await _put_raw(p, "ep", b'{"rewards": 1}')
    assert (status, body) == (
        422,
        _error(
            "Unknown field `rewards` at the top level of the request body; "
            "allowed fields: reward, group_id, metadata",
            "rewards",
            "unknown_field",
        ),
    )


@pytest.mark.parametrize("raw", [b"", b"{}", b'{"reward": null, "metadata": null}'])
async def test_an_outcome_that_says_nothing_is_refused(make_proxy: Any, raw: bytes) -> None:
    p = await make_proxy(admin_token=TOKEN)
    await _call(p, "ep", "hello")
    status, body = await _put_raw(p, "ep", raw)
    assert (status, body) == (
        422,
        _error(
            "An outcome needs one of `reward`, `group_id`, `metadata` at the top level of the "
            "request body; a later outcome replaces the whole earlier one",
            "",
            "empty_outcome",
        ),
    )


async def test_a_body_that_is_not_json_is_still_a_400(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    await _call(p, "ep", "hello")
    status, body = await _put_raw(p, "ep", b'{"reward": ')
    assert status == 400
    assert body["error"]["code"] == "invalid_json"


async def test_an_unknown_rollout_is_a_404(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    status, body = await _put_raw(p, "nobody", b'{"reward": 1}')
    assert status == 404
    assert body["error"]["code"] == "unknown_rollout"
    assert body["error"]["message"] == "no rollout nobody"
    assert "nobody" not in p.source().rollouts()  # an outcome creates no rollout


async def test_the_outcome_route_needs_the_admin_token(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    await _call(p, "ep", "hello")
    resp = await p.client.put("/admin/rollouts/ep/outcome", json={"reward": 1})
    assert resp.status == 401
    assert (await resp.json())["error"]["code"] == "admin_token"


async def test_an_outcome_too_large_is_a_413(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    await _call(p, "ep", "hello")
    raw = b'{"metadata": {"note": "' + b"x" * MAX_OUTCOME_BYTES + b'"}}'
    status, body = await _put_raw(p, "ep", raw)
    assert status == 413
    assert body["error"]["code"] == "outcome_too_large"
    assert f"at most {MAX_OUTCOME_BYTES} bytes" in body["error"]["message"]


async def test_past_the_most_outcomes_kept_a_put_is_a_409_and_nothing_changes(
    make_proxy: Any,
) -> None:
    p = await make_proxy(admin_token=TOKEN, sink=MemorySink())
    await _call(p, "ep", "hello")
    for i in range(MAX_OUTCOMES):
        await _put(p, "ep", {"reward": i})
    status, body = await _put_raw(p, "ep", b'{"reward": -1}')
    assert status == 409
    assert body["error"]["code"] == "outcome_history_full"
    assert f"already has {MAX_OUTCOMES} outcomes" in body["error"]["message"]
    outcome = (await _manifest(p, "ep"))["outcome"]
    assert outcome["reward"] == MAX_OUTCOMES - 1


async def test_reserved_metadata_keys_are_refused_when_creating_a_rollout(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    resp = await p.client.post(
        "/admin/rollouts",
        json={"rollout_id": "ep", "metadata": {"capture_proxy_outcome_history": []}},
        headers=ADMIN,
    )
    assert resp.status == 422
    error = (await resp.json())["error"]
    assert error["param"] == "metadata.capture_proxy_outcome_history"
    assert error["code"] == "reserved_metadata_key"
    assert "ep" not in p.source().rollouts()


class _HeadersDown(MemorySink):
    """A store that takes rollout headers until `down` is set."""

    down = False

    async def put_rollout(self, info: RolloutInfo) -> None:
        if self.down:
            raise StoreError("the store is read-only")
        await super().put_rollout(info)


async def test_an_outcome_the_store_cannot_keep_is_503_and_not_kept(tmp_path: Path) -> None:
    sink = _HeadersDown()
    p = await start_proxy(tmp_path, sink=sink, admin_token=TOKEN)
    try:
        await _call(p, "ep", "hello")
        await _put(p, "ep", {"reward": 1})
        sink.down = True
        resp = await p.client.put("/admin/rollouts/ep/outcome", json={"reward": 2}, headers=ADMIN)
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        error = (await resp.json())["error"]
        assert error["code"] == "outcome_not_stored"
        assert "the store is read-only" in error["message"]
        assert "nothing was changed" in error["message"]
        sink.down = False
        assert (await _manifest(p, "ep"))["outcome"]["reward"] == 1.0
        assert [o.reward for o in sink.rollout_info("ep").outcome_history] == [1.0]
        # The next write carries the history the store holds, not the outcome it refused.
        await p.client.post("/admin/rollouts/ep/seal", headers=ADMIN)
        assert sink.rollout_info("ep").outcome_history == (
            RolloutOutcome(1.0, at_ms=sink.rollout_info("ep").outcome_history[0].at_ms),
        )
    finally:
        await stop_proxy(p)
