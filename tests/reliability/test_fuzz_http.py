"""Hostile input from sandboxes, and broken answers from the upstream (issue: reliability, 3-4).

A sandbox runs model-written code, so anything may arrive: random JSON shapes, wrong types, huge
numbers, deep nesting, invalid UTF-8, invalid base64, random bytes, oversized bodies, path and
header tricks. Whatever arrives, the proxy answers below 500, keeps running (``/healthz``), stays
within bounded memory, and every refused call is in its rollout's ledger (docs/contract.md).

Hypothesis drives the random parts against one proxy (and fake vLLM) per module; hostile bytes
that an HTTP client library refuses to send go through a raw socket.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import CallStatus
from capture_proxy.testing.fake_vllm import FakeVLLM, Fault, Turn
from tests.support import ROOT
from tests.support.proxy_harness import Proxy, chat_body, start_proxy, stop_proxy, user
from tests.support.reliability_workers import rss_mb

LIMIT = 256 * 1024  # --max-body-bytes for this module: big enough for images, small to exceed
ROLLOUT = "fuzz"
FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,  # a fixed run in CI; failures print the example to reproduce it
)


@dataclass
class Live:
    """One proxy on its own event loop, driven from synchronous (Hypothesis) tests."""

    runner: asyncio.Runner
    proxy: Proxy
    folder: Path
    #: call id -> X-Capture-Status of every chat call sent (checked against the store at the end)
    sent: dict[str, str] = field(default_factory=dict)

    def run(self, coro: Any) -> Any:
        return self.runner.run(coro)

    @property
    def port(self) -> int:
        port = self.proxy.client.port
        assert port is not None
        return port


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    folder = tmp_path_factory.mktemp("fuzz")
    runner = asyncio.Runner()
    proxy = runner.run(
        start_proxy(folder, max_body_bytes=LIMIT, min_free_disk_mb=0, admin_token="admin")
    )
    state = Live(runner, proxy, folder)
    try:
        yield state
    finally:
        runner.run(stop_proxy(proxy))
        runner.close()
    # Once stopped: refusals folded into one entry (core.refusal_folds) are written by then.
    check_ledger(state)


def check_ledger(live: Live) -> None:
    """Every call answered with a call id is in the store: staged ones as records, the others
    (rejected before forwarding, or an upstream error) in the rollout's ledger."""
    with open_store(live.proxy.store_url) as store:
        staged = {
            r.call_id
            for r in store.calls(
                ROLLOUT, include_orphaned=True, include_open=True, include_poisoned=True
            )
        }
        failed = {f.call_id: f.status for f in store.failures(ROLLOUT)}
    for call_id, status in live.sent.items():
        if status in ("staged", "pending"):
            assert call_id in staged or call_id in failed, call_id
        else:
            assert failed.get(call_id) == CallStatus(status), (call_id, status)


async def _post(live: Live, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, str]:
    resp = await live.proxy.client.post(
        f"/r/{ROLLOUT}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    await resp.read()  # a stream included: the whole answer
    call_id = resp.headers.get("X-Capture-Call-Id")
    status = resp.headers.get("X-Capture-Status", "")
    if resp.status >= 400:
        assert call_id, f"{resp.status} without a call id: nothing in the ledger"
    if call_id:
        live.sent[call_id] = status
    return resp.status, call_id or ""


def send(live: Live, body: bytes, headers: dict[str, str] | None = None) -> int:
    """POST a chat body to the fuzz rollout; its HTTP status, which must be below 500."""
    return send_for_id(live, body, headers)[0]


def send_for_id(live: Live, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, str]:
    status, call_id = live.run(_post(live, body, headers))
    assert status < 500, (status, body[:300])
    return status, call_id


def healthy(live: Live) -> bool:
    async def get() -> int:
        return (await live.proxy.client.get("/healthz")).status

    return bool(live.run(get()) == 200)


# -- random JSON: shapes, types, numbers ----------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=24),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=12,
)

TOP_KEYS = [
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "stream", "stream_options", "tools", "tool_choice", "logprobs",
    "top_logprobs", "response_format", "reasoning_effort", "n", "user", "metadata", "logit_bias",
    "presence_penalty", "parallel_tool_calls", "chat_template_kwargs", "structured_outputs",
    "include_reasoning", "return_token_ids", "prompt_logprobs", "extra_body", "x",
]  # fmt: skip
MESSAGE_KEYS = [
    "role", "content", "name", "tool_calls", "tool_call_id", "reasoning", "reasoning_content", "x"
]  # fmt: skip
PART_TYPES = ["text", "image_url", "input_audio", "video_url", "", "x"]


@st.composite
def mutated_bodies(draw: st.DrawFn) -> Any:
    """A valid small chat body with one to three places replaced by random JSON."""
    message: dict[str, Any] = user("hello there")
    messages = [message]
    top: dict[str, Any] = {"model": "policy", "messages": messages, "max_tokens": 8}
    for _ in range(draw(st.integers(1, 3))):
        value = draw(json_values)
        where = draw(st.sampled_from(["top", "message", "part", "second_message"]))
        if where == "top":
            top[draw(st.sampled_from(TOP_KEYS))] = value
        elif where == "message":
            message[draw(st.sampled_from(MESSAGE_KEYS))] = value
        elif where == "part":
            kind = draw(st.sampled_from(PART_TYPES))
            key = draw(st.sampled_from(["text", "image_url", "url", kind or "x"]))
            message["content"] = [{"type": kind, key: value}]
        else:
            role = draw(st.sampled_from(["assistant", "tool", "system", "developer", "user", "x"]))
            messages.append({"role": role, draw(st.sampled_from(MESSAGE_KEYS)): value})
    return top


def test_random_json_never_5xx_and_every_refusal_is_in_the_ledger(live: Live) -> None:
    before = rss_mb(os.getpid())
    statuses: set[int] = set()

    @FUZZ
    @given(st.one_of(json_values, mutated_bodies()))
    def one(value: Any) -> None:
        # json.dumps writes any int and writes NaN/Infinity: not JSON, so orjson refuses it.
        statuses.add(send(live, json.dumps(value).encode()))

    one()
    assert healthy(live)
    assert 422 in statuses  # validation was reached ...
    assert 200 in statuses  # ... and some mutations were still valid, and staged
    assert rss_mb(os.getpid()) - before < 200


def test_random_bytes_and_invalid_utf8_never_5xx(live: Live) -> None:
    valid = json.dumps(chat_body(user("hello"), max_tokens=8)).encode()

    @FUZZ
    @given(
        st.one_of(
            st.binary(max_size=512),
            # a valid body cut short, or with bytes spliced in (0x80-0xff: invalid UTF-8)
            st.integers(0, len(valid)).map(lambda n: valid[:n]),
            st.tuples(st.integers(0, len(valid)), st.binary(min_size=1, max_size=8)).map(
                lambda t: valid[: t[0]] + t[1] + valid[t[0] :]
            ),
        )
    )
    def one(raw: bytes) -> None:
        send(live, raw)

    one()
    assert healthy(live)


def _body(content: bytes = b'"ok"', extra: bytes = b"") -> bytes:
    """A chat body's bytes, with `content` as the user message and `extra` top-level members."""
    return (
        b'{"model": "policy", "messages": [{"role": "user", "content": '
        + content
        + b"}]"
        + (b", " + extra if extra else b"")
        + b"}"
    )


HOSTILE_JSON = {
    "invalid-utf8": _body(b'"\xff\xfe"'),
    "lone-surrogate-escape": _body(b'"\\ud800"'),
    "surrogate-utf8": _body(b'"\xed\xa0\x80"'),
    "int-10e400": _body(extra=b'"max_tokens": ' + str(10**400).encode()),
    "int-2e64": _body(extra=b'"seed": ' + str(2**64).encode()),
    "float-1e400": _body(extra=b'"temperature": 1e400'),
    "nan": _body(extra=b'"top_p": NaN'),
    "nesting-10k-arrays": _body(b"[" * 10_000 + b"]" * 10_000),
    "nesting-10k-objects": _body(extra=b'"metadata": ' + b'{"a":' * 10_000 + b"1" + b"}" * 10_000),
    "nesting-900-tool": _body(
        extra=b'"tools": [{"type": "function", "function": {"name": "f", "parameters": '
        + b'{"a":' * 900
        + b"1"
        + b"}" * 900
        + b"}}]"
    ),
    "messages-object": b'{"model": "policy", "messages": {"role": "user"}}',
    "messages-empty": b'{"model": "policy", "messages": []}',
    "array-body": b"[]",
    "null-body": b"null",
    "empty-body": b"",
}


@pytest.mark.parametrize("raw", HOSTILE_JSON.values(), ids=HOSTILE_JSON.keys())
def test_hostile_json_is_refused_precisely(live: Live, raw: bytes) -> None:
    status = send(live, raw)
    assert status in (400, 422), status
    assert healthy(live)


@given(
    payload=st.text(
        alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_ !%\n\x00é",
        max_size=64,
    ),
    media=st.sampled_from(["image/png", "image/jpeg", "text/plain", "image/", "", "image/png;x=y"]),
)
# One payload under two media types, in this order: the bytes are stored once, and the second
# call must read back (and verify) with its own media type, not the first call's.
@example(payload="AAECAwQF", media="image/png")
@example(payload="AAECAwQF", media="image/jpeg")
@FUZZ
def test_invalid_base64_images_are_refused_or_staged_exactly(
    live: Live, payload: str, media: str
) -> None:
    url = f"data:{media};base64,{payload}"
    body = chat_body(
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]},
        max_tokens=4,
    )
    status, call_id = send_for_id(live, json.dumps(body).encode())
    assert status in (200, 422), status
    if status == 200:  # it was valid base64 after all: the bytes staged are exactly its bytes
        with open_store(live.proxy.store_url) as store:
            (record,) = store.fetch([call_id])
        (attachment,) = record.attachments
        assert attachment.data == base64.b64decode(payload, validate=True)
        assert attachment.media_type == media.split(";")[0]


# -- bodies over the limit, refused before they are read ----------------------------------------


async def raw_request(
    port: int, head: bytes, body: bytes = b"", *, wait: float = 10
) -> tuple[int, dict[str, str]]:
    """Send raw bytes; the status and headers of the answer (read as soon as they arrive)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        async with asyncio.timeout(wait):
            raw = await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()
    lines = raw.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return int(lines[0].split()[1]), headers


def test_oversized_body_is_refused_from_content_length_before_it_is_read(live: Live) -> None:
    head = (
        f"POST /r/{ROLLOUT}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        f"Content-Type: application/json\r\nContent-Length: {2**40}\r\n\r\n"
    ).encode()
    forwarded = len(live.proxy.fake.requests)
    started = time.monotonic()
    status, headers = live.run(raw_request(live.port, head, b'{"model": '))
    # Answered while 1 TiB of body was never sent: nothing of it was waited for or read.
    assert status == 413
    assert time.monotonic() - started < 5
    live.sent[headers["x-capture-call-id"]] = headers["x-capture-status"]
    assert len(live.proxy.fake.requests) == forwarded
    assert healthy(live)


def test_oversized_chunked_body_is_cut_off_at_the_limit(live: Live) -> None:
    head = (
        f"POST /r/{ROLLOUT}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    chunk = b"%x\r\n%s\r\n" % (64 * 1024, b" " * 64 * 1024)
    body = chunk * (LIMIT // (64 * 1024) + 4) + b"0\r\n\r\n"  # no Content-Length to refuse by
    status, headers = live.run(raw_request(live.port, head, body))
    assert status == 413
    live.sent[headers["x-capture-call-id"]] = headers["x-capture-status"]
    assert healthy(live)


OTHER_ROUTES = pytest.mark.parametrize(
    "path", ["/admin/rollouts", "/r/fuzz/tokenize", "/tokenize"], ids=["admin", "r-tok", "tok"]
)


@OTHER_ROUTES
def test_oversized_bodies_on_other_routes_are_cut_off_at_the_limit(live: Live, path: str) -> None:
    body = b" " * (LIMIT + 64 * 1024)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer admin\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    status, _ = live.run(raw_request(live.port, head, body))
    assert status == 413
    assert healthy(live)


@OTHER_ROUTES
def test_oversized_bodies_on_other_routes_are_refused_before_they_are_read(
    live: Live, path: str
) -> None:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer admin\r\n"
        f"Content-Type: application/json\r\nContent-Length: {2**40}\r\n\r\n"
    ).encode()
    status, _ = live.run(raw_request(live.port, head, wait=2))
    assert status == 413


# -- path and header tricks ----------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/r/..%2F..%2Fetc%2Fpasswd/v1/chat/completions",
        "/r/%2e%2e%2f%2e%2e/v1/chat/completions",
        "/r/a%00b/v1/chat/completions",
        "/r/a%0d%0aSet-Cookie:x=1/v1/chat/completions",
        "/r/%C3%A9t%C3%A9/v1/chat/completions",
        "/r/%ff%fe/v1/chat/completions",
        "/r/" + "a" * 129 + "/v1/chat/completions",
        "/r//v1/chat/completions",
        "/r/a/b/v1/chat/completions",
        "/r/a/../v1/chat/completions",
        "/r/ok/../../admin/rollouts",
        "//r/ok/v1/chat/completions",
    ],
)
def test_path_tricks_in_rollout_ids(live: Live, path: str) -> None:
    body = json.dumps(chat_body(user("x"), max_tokens=4)).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    before = sorted(p.name for p in live.folder.iterdir())
    forwarded = len(live.proxy.fake.requests)
    status, headers = live.run(raw_request(live.port, head, body))
    assert status in (400, 404), status
    assert "set-cookie" not in headers
    assert len(live.proxy.fake.requests) == forwarded
    assert sorted(p.name for p in live.folder.iterdir()) == before  # nothing written outside
    assert healthy(live)


def test_dot_rollout_ids_are_opaque_names(live: Live) -> None:
    # "." and ".." are 1-128 characters of [A-Za-z0-9._:-], so valid rollout ids (and aiohttp
    # does not resolve dot segments): each must name a rollout in the store, nothing on disk.
    before = sorted(p.name for p in live.folder.iterdir())
    body = json.dumps(chat_body(user("dots"), max_tokens=4)).encode()
    got = {}
    for rollout, path, header in [
        ("..", "/r/../v1/chat/completions", b""),
        (".", "/r/./v1/chat/completions", b""),
        ("...", "/v1/chat/completions", b"X-Rollout-Id: ...\r\n"),
    ]:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n".encode()
            + header
            + b"\r\n"
        )
        status, headers = live.run(raw_request(live.port, head, body))
        assert status == 200
        assert headers["x-capture-status"] == "staged"
        got[rollout] = headers["x-capture-call-id"]
    with open_store(live.proxy.store_url) as store:
        for rollout, call_id in got.items():
            assert [
                r.call_id for r in store.calls(rollout, include_open=True, include_poisoned=True)
            ] == [call_id]
    assert sorted(p.name for p in live.folder.iterdir()) == before


REFUSED = (400, 413, 431)
HOSTILE_HEADERS = [
    (b"X-Rollout-Id: \xff\xfe\r\n", REFUSED),
    (b"X-Rollout-Id: caf\xc3\xa9\r\n", REFUSED),
    (b"x-session-id: a\x00b\r\n", REFUSED),
    (b"X-Rollout-Id: a\rInjected: 1\r\n", REFUSED),
    (b"X-Rollout-Id: a\nInjected: 1\r\n", REFUSED),
    (b"X-Rollout-Id: a\r\n Injected-By-Folding\r\n", REFUSED),
    (b"X-Rollout-Id: " + b"a" * 9000 + b"\r\n", REFUSED),
    (b"Transfer-Encoding: chunked\r\n", REFUSED),  # with a Content-Length too: smuggling
    (b"Content-Length: 5\r\n", REFUSED),  # a second, different Content-Length
    (b"Bad Header: x\r\n", REFUSED),
    # Not refused: the client's Authorization is ignored (never forwarded) without rollout keys.
    (b"Authorization: Bearer \xff\xfe\r\n", (200,)),
]


@pytest.mark.parametrize(("extra", "allowed"), HOSTILE_HEADERS, ids=range(len(HOSTILE_HEADERS)))
def test_header_injection_and_invalid_bytes(
    live: Live, extra: bytes, allowed: tuple[int, ...]
) -> None:
    body = json.dumps(chat_body(user("x"), max_tokens=4)).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
    )
    forwarded = len(live.proxy.fake.requests)
    status, headers = live.run(raw_request(live.port, head, body))
    assert status in allowed, status
    assert "injected" not in headers
    assert not any("injected" in v.lower() for v in headers.values())
    if status != 200:
        assert len(live.proxy.fake.requests) == forwarded
    else:
        sent = live.proxy.fake.request_headers[-1]
        assert "authorization" not in {k.lower() for k in sent}
    assert healthy(live)


def test_client_headers_are_not_forwarded_upstream(live: Live) -> None:
    resp = live.run(
        live.proxy.client.post(
            f"/r/{ROLLOUT}/v1/chat/completions",
            data=json.dumps(chat_body(user("headers"), max_tokens=4)),
            headers={
                "Content-Type": "application/json",
                "Authorization": "Bearer sandbox-key",
                "X-Forwarded-For": "10.0.0.1",
                "Cookie": "session=1",
                "X-Injected": "1",
            },
        )
    )
    assert resp.status == 200
    live.sent[resp.headers["X-Capture-Call-Id"]] = resp.headers["X-Capture-Status"]
    upstream = {k.lower(): v for k, v in live.proxy.fake.request_headers[-1].items()}
    for name in ("authorization", "x-forwarded-for", "cookie", "x-injected"):
        assert name not in upstream, upstream


# -- broken answers from the upstream ------------------------------------------------------


async def _one_call(fake: FakeVLLM, tmp: Path, **settings: Any) -> tuple[Any, float, Any]:
    p = await start_proxy(tmp, fake=fake, min_free_disk_mb=0, **settings)
    try:
        started = time.monotonic()
        resp = await p.chat(chat_body(user("x")))
        elapsed = time.monotonic() - started
        body = await resp.json()
        return (resp.status, resp.headers.get("X-Capture-Status"), body), elapsed, p.failures()
    finally:
        await stop_proxy(p)


@pytest.mark.parametrize("fault", [Fault.truncate_after(0), Fault.malformed_sse(0)])
async def test_truncated_non_streaming_json_is_502_and_recorded(
    tmp_path: Path, fault: Fault
) -> None:
    fake = FakeVLLM()
    fake.push(Turn("a whole answer", fault=fault))
    (status, capture, body), _, failures = await _one_call(fake, tmp_path)
    assert status == 502
    assert capture == "upstream_error"
    assert body["error"]["type"] == "upstream_error"
    assert "malformed" in body["error"]["message"]
    (entry,) = failures
    assert entry.status is CallStatus.UPSTREAM_ERROR
    assert entry.http_status == 502


class _FullBacklog:
    """A loopback port whose accept queue is full: connecting to it hangs (SYNs are dropped)."""

    def __init__(self) -> None:
        import socket

        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(0)
        self.port = self.server.getsockname()[1]
        self.fillers = []
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", self.port))
            self.fillers.append(s)

    def close(self) -> None:
        for s in [*self.fillers, self.server]:
            s.close()


async def test_upstream_connect_timeout_is_an_upstream_error(tmp_path: Path) -> None:
    backlog = _FullBacklog()
    try:
        (status, capture, _), elapsed, failures = await _one_call(
            FakeVLLM(),
            tmp_path,
            upstream=f"http://127.0.0.1:{backlog.port}",
            upstream_connect_timeout=0.3,
        )
    finally:
        backlog.close()
    assert status in (502, 504)
    assert capture == "upstream_error"
    (entry,) = failures
    assert entry.status is CallStatus.UPSTREAM_ERROR
    # Bounded by the connect timeout (version, fingerprint and the call each try once), not by
    # the 900 s first-byte timeout.
    assert elapsed < 5


async def test_upstream_connect_timeout_message_names_the_connect_timeout(tmp_path: Path) -> None:
    backlog = _FullBacklog()
    try:
        (_, _, body), _, _ = await _one_call(
            FakeVLLM(),
            tmp_path,
            upstream=f"http://127.0.0.1:{backlog.port}",
            upstream_connect_timeout=0.3,
        )
    finally:
        backlog.close()
    assert "connect" in body["error"]["message"], body


async def test_proxy_survives_a_flood_of_aborted_requests(tmp_path: Path) -> None:
    """Clients that vanish mid-request (headers only, half a body) leave nothing open."""
    p = await start_proxy(tmp_path, min_free_disk_mb=0)
    try:
        port = p.client.port
        assert port is not None
        for i in range(50):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /r/gone/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Length: 1000\r\n\r\n" + b'{"model":' * (i % 3)
            )
            await writer.drain()
            writer.close()
        await asyncio.sleep(0.2)
        ok = await p.chat(chat_body(user("still here")))
        assert ok.headers["X-Capture-Status"] == "staged"
        assert p.state.capture.inflight == 0
        assert (await p.client.get("/healthz")).status == 200
    finally:
        await stop_proxy(p)


# -- the OpenAPI description (docs/openapi.yaml) -------------------------------------------------

JSON = "application/json"
OPENAPI = ROOT / "docs" / "openapi.yaml"


def openapi_operations() -> set[tuple[str, str]]:
    """(METHOD, path) of every operation in docs/openapi.yaml, read from its layout (paths at
    two spaces, methods at four) so this check needs no YAML parser."""
    ops: set[tuple[str, str]] = set()
    path = None
    in_paths = False
    for line in OPENAPI.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line.startswith(" "):
            in_paths = line.startswith("paths:")
            continue
        if not in_paths:
            continue
        stripped = line.strip()
        if line.startswith("  /") and stripped.endswith(":"):
            path = stripped[:-1]
        elif line.startswith("    ") and not line.startswith("     ") and path:
            method = stripped.split(":")[0]
            if method in ("get", "post", "put", "delete", "patch"):
                ops.add((method.upper(), path))
    return ops


def test_openapi_describes_exactly_the_proxy_routes() -> None:
    from capture_proxy.server.app import create_app
    from capture_proxy.server.settings import Settings

    app = create_app(Settings(admin_token="t", store="memory://openapi"))
    routes = {
        (r.method, r.resource.canonical)
        for r in app.router.routes()
        if r.resource is not None and r.method != "HEAD"
    }
    assert openapi_operations() == routes


def test_schemathesis_finds_no_server_error_and_no_undocumented_answer(tmp_path: Path) -> None:
    import schemathesis  # a test dependency: this check never skips
    from schemathesis import checks
    from schemathesis.core.result import Ok
    from schemathesis.specs.openapi import checks as openapi_checks  # noqa: F401

    from tests.support.reliability_workers import start_proxy as serve

    token = "schemathesis-admin-token-0123"
    # Schemathesis opens a connection per request, faster than one address may (the rate is
    # tested in tests/server/test_slow_clients.py): off here, where the routes are the subject.
    no_rate = ("--max-connection-rate-per-address", "0")
    proxy = serve("fake", f"sqlite:///{tmp_path / 'schema.db'}", "--admin-token", token, *no_rate)
    try:
        base = proxy.wait_ready()
        schema = schemathesis.openapi.from_path(str(OPENAPI))
        run = [
            checks.not_a_server_error,
            checks.status_code_conformance,
            checks.content_type_conformance,
            checks.response_schema_conformance,
        ]

        seen: dict[str, set[int]] = {}

        def check(case: Any) -> None:
            body = case.body
            if case.operation.path.endswith("/next") and isinstance(body, dict):
                # A batch request's long poll, bounded here so the run stays short (each may
                # wait 30 s); the wait itself is tested in tests/server/test_batch_routes.py.
                wait = body.get("wait_s")
                if isinstance(wait, int | float) and not isinstance(wait, bool) and wait > 0.1:
                    body["wait_s"] = 0.1
            response = case.call(
                base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30
            )
            seen.setdefault(case.operation.label, set()).add(response.status_code)
            case.validate_response(response, checks=run)

        # Each operation gets its own bounded run (drawing 200 cases from the whole schema missed
        # one now and then); 16 each makes about the same ~200 calls, as operations without
        # parameters stop after their one possible case.
        operations = []
        for result in schema.get_all_operations():
            assert isinstance(result, Ok), result  # every operation of the description is usable
            operations.append(result.ok())
        for operation in operations:
            fuzz = given(operation.as_strategy())(check)
            settings(max_examples=16, deadline=None, database=None)(fuzz)()
            if operation.path.endswith("/chat/completions"):
                # Many generated chat bodies are refused (422); this one is valid, so a staged
                # answer is checked against the description on every run, not on most.
                rollout = {"rollout_id": "fuzz"} if "{rollout_id}" in operation.path else None
                valid = chat_body(user("hi"))
                check(operation.Case(path_parameters=rollout, body=valid, media_type=JSON))
        # Every documented operation was called, and the chat routes staged calls.
        documented = {f"{method} {path}" for method, path in openapi_operations()}
        assert {operation.label for operation in operations} == documented
        assert set(seen) == documented, sorted(documented - set(seen))
        assert 200 in seen["POST /r/{rollout_id}/v1/chat/completions"], seen
        assert 200 in seen["POST /v1/chat/completions"], seen
    finally:
        assert proxy.terminate() == 0, proxy.output()
