"""Token-in around the flow: the setting, the per-rollout choice, readiness, the 503 and 409
without vLLM's scale-out routes, and the metrics hook. The flow itself is tested apart."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pytest

from capture_proxy.core.token_in import EXTENDED, NEW_SEGMENT, TokenInReport
from capture_proxy.schemas.records import CallStatus
from capture_proxy.server.settings import SettingsError, add_arguments, load_settings
from capture_proxy.testing.fake_vllm import FakeVLLM
from tests.support.proxy_harness import chat_body, start_proxy, stop_proxy, user
from tests.upstream.test_upstream_restart import restart

TOKEN = "admin-secret-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_token_in_is_off_by_default_and_set_by_flag_environment_or_toml(tmp_path: Path) -> None:
    assert load_settings(environ={}).token_in == "off"
    assert load_settings(_parse("--token-in", "on"), environ={}).token_in == "on"
    assert load_settings(environ={"CAPTURE_PROXY_TOKEN_IN": "on"}).token_in == "on"
    config = tmp_path / "proxy.toml"
    config.write_text('token_in = "on"\n')
    assert load_settings(environ={"CAPTURE_PROXY_CONFIG": str(config)}).token_in == "on"


def test_a_bad_token_in_value_names_the_choices(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"CAPTURE_PROXY_TOKEN_IN must be one of off, on"):
        load_settings(environ={"CAPTURE_PROXY_TOKEN_IN": "true"})
    config = tmp_path / "proxy.toml"
    config.write_text("token_in = true\n")
    with pytest.raises(SettingsError, match=r"token_in in .* must be a str"):
        load_settings(environ={"CAPTURE_PROXY_CONFIG": str(config)})
    with pytest.raises(SystemExit):  # argparse: "invalid choice: 'yes' (choose from off, on)"
        _parse("--token-in", "yes")


async def _create(p: Any, **body: Any) -> Any:
    return await p.client.post("/admin/rollouts", json=body, headers=ADMIN)


async def _manifest(p: Any, rollout_id: str) -> dict[str, Any]:
    resp = await p.client.get(f"/admin/rollouts/{rollout_id}/manifest", headers=ADMIN)
    assert resp.status == 200
    return dict(await resp.json())


async def test_a_rollout_chooses_token_in_and_keeps_it_across_a_restart(tmp_path: Path) -> None:
    fake = FakeVLLM(scale_out=True)
    first = await start_proxy(tmp_path, fake=fake, admin_token=TOKEN)
    try:
        for rollout_id, choice in (("yes", True), ("no", False), ("default", None)):
            resp = await _create(first, rollout_id=rollout_id, token_in=choice)
            assert resp.status == 201
            assert (await resp.json())["token_in"] is choice
        absent = await _create(first, rollout_id="absent")
        assert (await absent.json())["token_in"] is None
        m = await _manifest(first, "yes")
        assert (m["token_in"], m["goes_token_in"]) == (True, True)
        m = await _manifest(first, "default")
        assert (m["token_in"], m["goes_token_in"]) == (None, False)  # --token-in off
    finally:
        await stop_proxy(first)
    # A new process with --token-in on: each rollout's own choice wins, from its event log.
    second = await start_proxy(tmp_path, admin_token=TOKEN, token_in="on")
    try:
        got = {r: await _manifest(second, r) for r in ("yes", "no", "default", "absent")}
        assert {r: (m["token_in"], m["goes_token_in"]) for r, m in got.items()} == {
            "yes": (True, True),
            "no": (False, False),
            "default": (None, True),
            "absent": (None, True),
        }
        # Resolved from the store by a call (this upstream lacks the scale-out routes): the
        # rollout that chose off is served plainly, the one that chose on is refused.
        plain = await second.chat(chat_body(user("a")), rollout="no")
        assert plain.headers["X-Capture-Status"] == "staged"
        assert second.state.capture.rollouts["no"].token_in is False
        refused = await second.chat(chat_body(user("a")), rollout="yes")
        assert (await refused.json())["error"]["code"] == "scale_out_disabled"
        assert second.state.capture.rollouts["yes"].token_in is True
        events = second.source().events("yes")
        assert [(e.kind, dict(e.body)) for e in events][:2] == [
            ("token_in", {"token_in": True}),
            (
                "ledger",
                {
                    "status": "rejected",
                    "reason": "scale_out_disabled",
                    "message": ANY,
                    "http_status": 503,
                },
            ),
        ]
        assert second.source().events("default") == []  # no choice, no event
    finally:
        await stop_proxy(second)


@pytest.mark.parametrize("value", ["yes", 1, 0, "true", [], {}])
async def test_a_token_in_that_is_not_a_boolean_is_a_422_naming_the_field(
    make_proxy: Any, value: Any
) -> None:
    p = await make_proxy(admin_token=TOKEN)
    resp = await _create(p, rollout_id="bad", token_in=value)
    assert resp.status == 422
    error = (await resp.json())["error"]
    assert error["param"] == "token_in"
    assert "token_in" in error["message"]
    assert (await p.client.get("/admin/rollouts/bad/manifest", headers=ADMIN)).status == 404


async def test_readyz_fails_naming_the_vllm_flag_when_token_in_is_on_without_the_routes(
    make_proxy: Any,
) -> None:
    p = await make_proxy(fake=FakeVLLM(scale_out=False), token_in="on")
    resp = await p.client.get("/readyz")
    assert resp.status == 503
    [problem] = (await resp.json())["problems"]
    assert "--enable-scale-out" in problem
    assert "token-in" in problem

    served = await make_proxy(fake=FakeVLLM(scale_out=True), token_in="on")
    assert (await served.client.get("/readyz")).status == 200
    off = await make_proxy(fake=FakeVLLM(scale_out=False))  # token-in off: no need of the routes
    assert (await off.client.get("/readyz")).status == 200


async def test_readyz_fails_when_a_live_rollout_asks_for_token_in_without_the_routes(
    make_proxy: Any,
) -> None:
    p = await make_proxy(fake=FakeVLLM(scale_out=False), admin_token=TOKEN)
    assert (await p.client.get("/readyz")).status == 200
    assert (await _create(p, rollout_id="ti", token_in=True)).status == 201  # not known yet
    resp = await p.client.get("/readyz")
    assert resp.status == 503
    assert "--enable-scale-out" in (await resp.json())["problems"][0]


async def test_a_token_in_call_without_the_routes_is_a_503_naming_the_flag(
    make_proxy: Any,
) -> None:
    fake = FakeVLLM(scale_out=False)
    p = await make_proxy(fake=fake, token_in="on")
    for stream in (False, True):
        resp = await p.chat(chat_body(user("hi"), stream=stream))
        assert resp.status == 503
        assert resp.headers["X-Capture-Status"] == "rejected"
        error = (await resp.json())["error"]
        assert error["code"] == "scale_out_disabled"
        assert "--enable-scale-out" in error["message"]
        assert "--token-in off" in error["message"]
    assert fake.requests == []  # nothing reached the chat route
    assert p.calls() == []
    ledger = p.failures()
    assert [(f.status, f.reason, f.http_status) for f in ledger] == [
        (CallStatus.REJECTED, "scale_out_disabled", 503)
    ] * 2


async def test_a_rollout_choosing_token_in_off_is_served_while_the_routes_are_missing(
    make_proxy: Any,
) -> None:
    p = await make_proxy(fake=FakeVLLM(scale_out=False), token_in="on", admin_token=TOKEN)
    assert (await _create(p, rollout_id="plain", token_in=False)).status == 201
    resp = await p.chat(chat_body(user("hi")), rollout="plain")
    assert resp.headers["X-Capture-Status"] == "staged"


async def test_a_rollout_asking_for_token_in_is_a_409_once_the_routes_are_known_missing(
    make_proxy: Any,
) -> None:
    p = await make_proxy(fake=FakeVLLM(scale_out=False), admin_token=TOKEN)
    await p.chat(chat_body(user("hi")))  # first contact: the probe render answers 403
    assert p.state.upstream.known.scale_out is False
    resp = await _create(p, rollout_id="ti", token_in=True)
    assert resp.status == 409
    error = (await resp.json())["error"]
    assert (error["code"], error["param"]) == ("scale_out_disabled", "token_in")
    assert "--enable-scale-out" in error["message"]
    assert (await p.client.get("/admin/rollouts/ti/manifest", headers=ADMIN)).status == 404
    assert (await _create(p, rollout_id="plain", token_in=False)).status == 201


async def test_the_routes_are_checked_again_for_a_new_upstream_process(make_proxy: Any) -> None:
    p = await make_proxy(fake=FakeVLLM(scale_out=False), token_in="on")
    assert (await p.client.get("/readyz")).status == 503
    assert (await p.chat(chat_body(user("hi")))).status == 503
    # vLLM restarted with --enable-scale-out: the routes known missing are asked for again
    # (at most every retry interval), by the next call and by /readyz alike.
    await restart(p, FakeVLLM(scale_out=True))
    p.state.upstream.known.retry_seconds = 0.0
    assert (await p.client.get("/readyz")).status == 200
    assert p.state.upstream.known.scale_out is True
    await restart(p, FakeVLLM(scale_out=False))
    assert (await p.chat(chat_body(user("hi")))).status == 503
    await restart(p, FakeVLLM(scale_out=True))
    resp = await p.chat(chat_body(user("hi")))
    # The call goes on (the plain path until the token-in flow is wired).
    assert resp.headers["X-Capture-Status"] == "staged"


async def test_token_in_reports_are_counted_in_metrics(make_proxy: Any) -> None:
    p = await make_proxy()
    pipeline = p.state.pipeline
    pipeline.report_token_in(TokenInReport("r1", "c1", NEW_SEGMENT, "no_prior", None))
    pipeline.report_token_in(TokenInReport("r1", "c2", EXTENDED, plain_divergence=812))
    pipeline.report_token_in(TokenInReport("r1", "c3", EXTENDED, plain_divergence=None))
    text = await (await p.client.get("/metrics")).text()
    assert 'capture_proxy_token_in_calls_total{reason="no_prior",result="new_segment"} 1.0' in text
    assert 'capture_proxy_token_in_calls_total{reason="",result="extended"} 2.0' in text
    assert "capture_proxy_token_in_plain_divergence_total 1.0" in text
