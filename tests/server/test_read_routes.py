"""Reading a proxy's store from another host: ``open_store("http://HOST:PORT", token=T)`` against
a real served proxy (the client is synchronous, so it runs on a thread beside the event loop)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp.test_utils import TestServer

from capture_proxy.read.reader import open_store
from capture_proxy.server.app import create_admin_app
from capture_proxy.server.settings import SettingsError, load_settings
from capture_proxy.sinks.base import StoreError
from capture_proxy.sinks.registry import open_sink
from capture_proxy.sinks.remote import StoreAccessDenied
from tests.support.proxy_harness import Proxy, ProxyFactory, chat_body, user

T = TypeVar("T")

ADMIN_TOKEN = "admin-token-for-reads-0123"
READER_TOKEN = "reader-token-for-reads-4567"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
READER = {"Authorization": f"Bearer {READER_TOKEN}"}
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8
IMAGE = {
    "role": "user",
    "content": [
        {"type": "text", "text": "what is in it?"},
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()},
        },
    ],
}


async def off_loop(fn: Callable[[], T]) -> T:
    """Run the synchronous client on a thread: the proxy's event loop keeps serving."""
    return await asyncio.to_thread(fn)


def url_of(p: Proxy) -> str:
    return str(p.client.make_url("")).rstrip("/")


async def episode(p: Proxy, rollout: str = "ep-1") -> dict[str, Any]:
    """A sealed three-turn rollout with an image; its final manifest."""
    created = await p.client.post("/admin/rollouts", json={"rollout_id": rollout}, headers=ADMIN)
    assert created.status == 201
    messages: list[dict[str, Any]] = [IMAGE]
    for turn in range(3):
        resp = await p.chat(chat_body(*messages, max_tokens=12), rollout=rollout)
        assert resp.headers["X-Capture-Status"] == "staged"
        answer = (await resp.json())["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": answer}, user(f"and then {turn}?")]
    refused = await p.chat({"model": "policy", "messages": "not a list"}, rollout=rollout)
    assert refused.headers["X-Capture-Status"] == "rejected"  # a ledger entry to read back
    sealed = await p.client.post(f"/admin/rollouts/{rollout}/seal", headers=ADMIN)
    assert sealed.status == 200
    manifest: dict[str, Any] = await sealed.json()
    return manifest


@pytest.fixture(params=["sqlite", "parquet"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def served(make_proxy: ProxyFactory, tmp_path: Path, kind: str, **settings: Any) -> Proxy:
    store = (
        f"sqlite:///{tmp_path / 'served.db'}" if kind == "sqlite" else f"parquet:///{tmp_path}/pq"
    )
    return await make_proxy(
        sink=open_sink(store), admin_token=ADMIN_TOKEN, reader_token=READER_TOKEN, **settings
    )


async def test_a_remote_store_reads_like_the_local_one(
    make_proxy: ProxyFactory, tmp_path: Path, store_kind: str
) -> None:
    p = await served(make_proxy, tmp_path, store_kind)
    manifest = await episode(p)
    coords = [c["coords"] for c in manifest["calls"] if c["status"] == "staged"]

    def read() -> None:
        with open_store(p.sink.url) as local, open_store(url_of(p), token=READER_TOKEN) as remote:
            assert remote.url == url_of(p)
            assert remote.rollouts() == local.rollouts() == ["ep-1"]
            assert remote.rollout_info("ep-1") == local.rollout_info("ep-1")
            (failure,) = remote.failures("ep-1")
            assert remote.failures("ep-1") == local.failures("ep-1")
            assert failure.status == "rejected"
            here, there = local.calls("ep-1"), remote.calls("ep-1")
            assert [r.digest for r in there] == [r.digest for r in here]
            assert [r.prompt_token_ids for r in there] == [r.prompt_token_ids for r in here]
            assert [r.completion_logprobs for r in there] == [r.completion_logprobs for r in here]
            assert [r.request for r in there] == [r.request for r in here]
            assert there[0].attachments[0].data == PNG
            # A later call of the session travels as a tail of its parent's tokens: rebuilt whole.
            assert there[2].parent_call_id == there[1].call_id
            # fetch by the manifest's coordinates checks the digests the driver was given.
            fetched = remote.fetch(coords)
            assert [r.call_id for r in fetched] == [c["staging_key"] for c in coords]
            assert (
                remote.coords([c["staging_key"] for c in coords])[0].digest == coords[0]["digest"]
            )
            traj, local_traj = remote.trajectory("ep-1"), local.trajectory("ep-1")
            assert traj.token_ids == local_traj.token_ids
            assert traj.loss_mask == local_traj.loss_mask
            assert [t.rollout_id for t in remote.iter_trajectories()] == ["ep-1"]
            assert remote.status("ep-1") == local.status("ep-1")
            assert remote.source.orphaned() == local.source.orphaned() == set()
            assert remote.source.summaries("ep-1") == local.source.summaries("ep-1")
            assert remote.source.unreferenced_attachments() == []
            remote.verify()  # every key fetched and verified over the network
            # The store head, claim files included (a Parquet dataset's), as the store has it.
            assert remote.store_head() == local.store_head()
            remote.verify(expected_store_head=local.store_head().token())

    await off_loop(read)


async def test_open_rollouts_need_include_open_remotely_too(make_proxy: ProxyFactory) -> None:
    p = await make_proxy(admin_token=ADMIN_TOKEN, reader_token=READER_TOKEN)
    resp = await p.chat(chat_body(user("hi")), rollout="still-open")
    assert resp.headers["X-Capture-Status"] == "staged"

    def read() -> None:
        with open_store(url_of(p), token=READER_TOKEN) as remote:
            from capture_proxy.read.status import RolloutExcluded

            with pytest.raises(RolloutExcluded, match="include_open=True"):
                remote.calls("still-open")
            assert len(remote.calls("still-open", include_open=True)) == 1
            assert list(remote.iter_trajectories()) == []

    await off_loop(read)


async def test_the_admin_token_reads_too(make_proxy: ProxyFactory) -> None:
    p = await make_proxy(admin_token=ADMIN_TOKEN)
    await p.chat(chat_body(user("hi")), rollout="r1")

    def read() -> list[str]:
        with open_store(url_of(p), token=ADMIN_TOKEN) as remote:
            return remote.rollouts()

    assert await off_loop(read) == ["r1"]


@pytest.mark.parametrize("token", [None, "wrong-token-wrong-token", READER_TOKEN[:-1]])
async def test_without_a_valid_token_the_client_raises_a_clear_error(
    make_proxy: ProxyFactory, token: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CAPTURE_PROXY_READER_TOKEN", raising=False)
    p = await make_proxy(admin_token=ADMIN_TOKEN, reader_token=READER_TOKEN)
    with pytest.raises(StoreAccessDenied) as caught:
        await off_loop(lambda: open_store(url_of(p), token=token))
    assert caught.value.status == 401
    message = str(caught.value)
    assert url_of(p) in message
    assert ("no token was given" if token is None else "not valid") in message
    assert "--reader-token" in message
    raw = await p.client.get("/admin/store/rollouts")
    assert raw.status == 401
    assert (await raw.json())["error"]["code"] == "reader_token"


async def test_the_token_comes_from_the_environment_when_not_given(
    make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = await make_proxy(admin_token=ADMIN_TOKEN, reader_token=READER_TOKEN)
    monkeypatch.setenv("CAPTURE_PROXY_READER_TOKEN", READER_TOKEN)

    def read() -> list[str]:
        with open_store(url_of(p)) as remote:
            return remote.rollouts()

    assert await off_loop(read) == []


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/admin/rollouts", {}),
        ("GET", "/admin/rollouts/r1/manifest", None),
        ("POST", "/admin/rollouts/r1/seal", None),
        ("PUT", "/admin/weight-version", {"weight_version": 3}),
    ],
)
async def test_the_reader_token_cannot_use_the_control_routes(
    make_proxy: ProxyFactory, method: str, path: str, body: Any
) -> None:
    p = await make_proxy(admin_token=ADMIN_TOKEN, reader_token=READER_TOKEN)
    resp = await p.client.request(method, path, json=body, headers=READER)
    assert resp.status == 403
    error = (await resp.json())["error"]
    assert error["code"] == "reader_token_read_only"
    assert "admin token" in error["message"]
    assert p.state.capture.weight_version == 0
    assert "r1" not in p.state.capture.rollouts


async def test_reads_are_served_on_the_admin_port(make_proxy: ProxyFactory) -> None:
    p = await make_proxy(admin_token=ADMIN_TOKEN, reader_token=READER_TOKEN, admin_port=1)
    await p.chat(chat_body(user("hi")), rollout="r1")
    # The main port, the one sandboxes reach, has no store routes at all.
    assert (await p.client.get("/admin/store", headers=READER)).status == 404
    admin = TestServer(create_admin_app(p.client.app))
    await admin.start_server()
    try:
        url = str(admin.make_url("")).rstrip("/")

        def read() -> int:
            with open_store(url, token=READER_TOKEN) as remote:
                return len(remote.calls("r1", include_open=True))

        assert await off_loop(read) == 1
        with pytest.raises(StoreError, match="its --admin-port is elsewhere"):
            await off_loop(lambda: open_store(url_of(p), token=READER_TOKEN))
    finally:
        await admin.close()


async def test_unknown_rollouts_and_keys_are_key_errors(make_proxy: ProxyFactory) -> None:
    p = await make_proxy(admin_token=ADMIN_TOKEN, reader_token=READER_TOKEN)
    resp = await p.chat(chat_body(user("hi")), rollout="r1")
    call_id = resp.headers["X-Capture-Call-Id"]

    def read() -> None:
        with open_store(url_of(p), token=READER_TOKEN) as remote:
            with pytest.raises(KeyError) as unknown:
                remote.rollout_info("nope")
            assert unknown.value.args == ("nope",)
            with pytest.raises(KeyError):
                remote.calls("nope")
            with pytest.raises(KeyError) as missing:
                remote.fetch([call_id, "no-such-call"])
            assert missing.value.args == ("no-such-call",)
            with pytest.raises(KeyError) as no_coords:
                remote.coords(["no-such-call"])
            assert no_coords.value.args == ("no-such-call",)
            # Past the first batch the answer has begun: the miss arrives as an error frame.
            keys = [call_id] * 40 + ["late-miss"]
            with pytest.raises(KeyError) as late:
                remote.fetch(keys)
            assert late.value.args == ("late-miss",)
            assert [r.call_id for r in remote.fetch([call_id])] == [call_id]  # still usable

    await off_loop(read)


async def test_a_proxy_without_the_control_api_says_how_to_turn_it_on(
    make_proxy: ProxyFactory,
) -> None:
    p = await make_proxy()
    with pytest.raises(StoreError, match="--admin-token"):
        await off_loop(lambda: open_store(url_of(p), token=READER_TOKEN))


async def test_bad_query_values_and_bodies_are_refused(make_proxy: ProxyFactory) -> None:
    p = await make_proxy(admin_token=ADMIN_TOKEN, reader_token=READER_TOKEN)
    flag = await p.client.get(
        "/admin/store/rollouts/r1/calls?include_orphaned=maybe", headers=READER
    )
    assert flag.status == 422
    assert (await flag.json())["error"]["param"] == "include_orphaned"
    body = await p.client.post("/admin/store/fetch", json={"keys": "r1"}, headers=READER)
    assert body.status == 422
    too_many = await p.client.post(
        "/admin/store/fetch", json={"keys": ["k"] * 10_001}, headers=READER
    )
    assert too_many.status == 422


def test_nothing_listens_there_is_a_store_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StoreError, match="cannot read the store of the proxy"):
        open_store(f"http://127.0.0.1:{port}", token=READER_TOKEN)


def test_a_token_in_the_url_is_refused() -> None:
    with pytest.raises(StoreError, match="never in the URL"):
        open_store(f"http://reader:{READER_TOKEN}@127.0.0.1:1")


def test_a_token_for_a_local_store_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="a token is for stores read through a proxy"):
        open_store(f"sqlite:///{tmp_path / 'x.db'}", token=READER_TOKEN)


def test_a_remote_store_cannot_be_written() -> None:
    from capture_proxy.sinks.base import UnsupportedStoreOperation

    with pytest.raises(UnsupportedStoreOperation, match="read-only"):
        open_sink("http://127.0.0.1:8100")


# -- the reader token's settings --------------------------------------------------------------


@pytest.mark.parametrize("token", ["short-token", "changeme-changeme-1", "a" * 40])
def test_weak_reader_tokens_are_refused_at_start(token: str) -> None:
    with pytest.raises(SettingsError, match="--reader-token"):
        load_settings(
            environ={
                "CAPTURE_PROXY_ADMIN_TOKEN": ADMIN_TOKEN,
                "CAPTURE_PROXY_READER_TOKEN": token,
            }
        )


def test_the_reader_token_needs_the_control_api_and_a_token_of_its_own() -> None:
    with pytest.raises(SettingsError, match="needs --admin-token"):
        load_settings(environ={"CAPTURE_PROXY_READER_TOKEN": READER_TOKEN})
    with pytest.raises(SettingsError, match="is the admin token"):
        load_settings(
            environ={
                "CAPTURE_PROXY_ADMIN_TOKEN": ADMIN_TOKEN,
                "CAPTURE_PROXY_READER_TOKEN": ADMIN_TOKEN,
            }
        )


def test_the_reader_token_is_read_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "reader"
    path.write_text(READER_TOKEN + "\n")
    admin = {"CAPTURE_PROXY_ADMIN_TOKEN": ADMIN_TOKEN}
    settings = load_settings(environ={**admin, "CAPTURE_PROXY_READER_TOKEN_FILE": str(path)})
    assert settings.reader_token == READER_TOKEN
    assert settings.public()["reader_token"] == "***"
    with pytest.raises(SettingsError, match="reader-token-file"):
        load_settings(environ={**admin, "CAPTURE_PROXY_READER_TOKEN_FILE": str(tmp_path / "no")})
    both = {
        **admin,
        "CAPTURE_PROXY_READER_TOKEN_FILE": str(path),
        "CAPTURE_PROXY_READER_TOKEN": READER_TOKEN,
    }
    with pytest.raises(SettingsError, match="--reader-token are both set"):
        load_settings(environ=both)
