"""The remote store's client against answers a real proxy would never send: edited records, cut
streams, error frames, a newer wire version. A tiny aiohttp server on loopback serves them."""

from __future__ import annotations

import asyncio
import contextlib
import io
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from capture_proxy.read.integrity import RolloutUnverified
from capture_proxy.read.reader import open_store
from capture_proxy.schemas.digest import seal_record
from capture_proxy.schemas.events import (
    EventDraft,
    EventKind,
    RolloutEvent,
    chain_event,
    claim_event,
    staged_event,
)
from capture_proxy.schemas.records import (
    Attachment,
    RolloutInfo,
    RolloutState,
    StagedCallRecord,
)
from capture_proxy.sinks.base import StoreError, StoreFormatError
from capture_proxy.sinks.remote import (
    CONTENT_TYPE,
    RecordDecoder,
    RecordEncoder,
    WireError,
    end_frame,
    error_frame,
    iter_frames,
)

TOKEN = "a-reader-token-0123456789"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def sealed(
    call_id: str, seq: int, prompt: list[int], parent: str | None = None
) -> StagedCallRecord:
    png = Attachment.from_bytes(b"\x89PNG" + bytes(64), "image/png")
    request = {
        "model": "policy",
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"attachment:sha256:{png.sha256}"}}
                ],
            },
        ],
    }
    return seal_record(
        StagedCallRecord(
            rollout_id="r1",
            call_id=call_id,
            seq=seq,
            model="policy",
            finish_reason="stop",
            request=request,
            response={"role": "assistant", "content": "ok"},
            prompt_token_ids=array("i", prompt),
            completion_token_ids=array("i", [7, 8]),
            completion_logprobs=array("f", [-0.5, -0.25]),
            parent_call_id=parent,
            attachments=(png,),
        )
    )


FIRST = sealed("c1", 0, [1, 2, 3])
SECOND = sealed("c2", 1, [1, 2, 3, 7, 8, 4, 5], parent="c1")


def event_log(*records: StagedCallRecord) -> list[RolloutEvent]:
    """The event log a proxy keeps of `records`, then sealed: what `verify` holds them to."""
    drafts = []
    for r in records:
        drafts += [claim_event("r1", r.seq, r.call_id, 1), staged_event(r, 1)]
    drafts.append(EventDraft("r1", EventKind.SEAL, 2))
    events: list[RolloutEvent] = []
    for d in drafts:
        events.append(chain_event(d, (events[-1].position, events[-1].hash) if events else None))
    return events


EVENTS = event_log(FIRST, SECOND)


def records_body(*records: StagedCallRecord, end: bool = True) -> bytes:
    encoder = RecordEncoder()
    body = b"".join(encoder.encode(r) for r in records)
    return body + (end_frame(encoder.count) if end else b"")


def fake_proxy(
    calls_body: bytes, *, wire_version: int = 1, events: list[RolloutEvent] = EVENTS
) -> web.Application:
    """The read routes a `RemoteSource` needs, answering `calls_body` for every rollout's calls."""

    def json(value: Any) -> web.Response:
        return web.Response(body=msgspec.json.encode(value), content_type="application/json")

    async def about(request: web.Request) -> web.Response:
        return json({"store": "sqlite:///x.db", "wire_version": wire_version})

    async def rollouts(request: web.Request) -> web.Response:
        return json(["r1"])

    async def info(request: web.Request) -> web.Response:
        return json(RolloutInfo("r1", RolloutState.SEALED, False, 1, 2))

    async def empty(request: web.Request) -> web.Response:
        return json([])

    async def event_log(request: web.Request) -> web.Response:
        return json(events)

    async def no_claims(request: web.Request) -> web.Response:
        return json({})

    async def calls(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(calls_body)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/admin/store", about)
    app.router.add_get("/admin/store/rollouts", rollouts)
    app.router.add_get("/admin/store/rollouts/{rollout_id}", info)
    app.router.add_get("/admin/store/rollouts/{rollout_id}/failures", empty)
    app.router.add_get("/admin/store/rollouts/{rollout_id}/summaries", empty)
    app.router.add_get("/admin/store/rollouts/{rollout_id}/events", event_log)
    app.router.add_get("/admin/store/rollouts/{rollout_id}/claims", no_claims)
    app.router.add_get("/admin/store/rollouts/{rollout_id}/calls", calls)
    app.router.add_post("/admin/store/fetch", calls)
    return app


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    server = TestServer(app)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def read_calls(
    body: bytes, events: list[RolloutEvent] = EVENTS, **kwargs: Any
) -> list[StagedCallRecord]:
    async with serve(fake_proxy(body, events=events)) as url:

        def read() -> list[StagedCallRecord]:
            with open_store(url, token=TOKEN) as store:
                return store.calls("r1", **kwargs)

        return await asyncio.to_thread(read)


async def test_honest_answers_round_trip_exactly() -> None:
    got = await read_calls(records_body(FIRST, SECOND))
    assert [r.digest for r in got] == [FIRST.digest, SECOND.digest]
    assert got[1].prompt_token_ids == SECOND.prompt_token_ids
    assert got[1].attachments == SECOND.attachments


async def test_one_image_under_two_media_types_reads_back_with_each_records_own() -> None:
    """The image frame goes once, with its first media type; each row carries the media type of
    its own references, so a later call that sent the bytes as image/jpeg still verifies."""
    png = FIRST.attachments[0]
    jpeg = Attachment(png.sha256, "image/jpeg", png.data)
    second = seal_record(replace(SECOND, attachments=(jpeg,)))
    got = await read_calls(records_body(FIRST, second), event_log(FIRST, second))  # verified
    assert [[a.media_type for a in r.attachments] for r in got] == [["image/png"], ["image/jpeg"]]


def test_a_row_without_reference_media_types_reads_with_the_images_own() -> None:
    """An answer from a proxy of the release before: its rows carry no media types of their
    own, and each image reads with the media type of its frame."""
    decoder = RecordDecoder("test")
    frames = list(iter_frames(io.BytesIO(records_body(FIRST)).read, "test"))
    for msg in frames:
        if msg["t"] == "row":
            del msg["row"]["attachment_media_types"]
    (record,) = [r for msg in frames if (r := decoder.feed(msg)) is not None]
    assert record.attachments == FIRST.attachments


@pytest.mark.parametrize(
    "edit",
    [
        {"completion_token_ids": array("i", [7, 9])},
        {"completion_logprobs": array("f", [-0.5, -0.125])},
        {"response": {"role": "assistant", "content": "ko"}},
    ],
    ids=["token", "logprob", "response"],
)
async def test_a_record_edited_on_the_way_fails_verification(edit: dict[str, Any]) -> None:
    tampered = replace(SECOND, **edit)  # keeps the digest the proxy sealed
    with pytest.raises(RolloutUnverified, match="c2: digest mismatch"):
        await read_calls(records_body(FIRST, tampered))
    # Verification is what caught it: unverified, the edited record passes as it came.
    (_, raw) = await read_calls(records_body(FIRST, tampered), verify=False)
    assert raw.digest == SECOND.digest


async def test_an_edited_image_fails_verification() -> None:
    forged = Attachment(FIRST.attachments[0].sha256, "image/png", b"\x89PNG" + bytes(63) + b"!")
    with pytest.raises(RolloutUnverified, match=r"c1: attachment .* mismatch"):
        await read_calls(records_body(replace(FIRST, attachments=(forged,))))


async def test_a_stream_cut_short_is_an_error_not_fewer_records() -> None:
    with pytest.raises(WireError, match="cut short"):
        await read_calls(records_body(FIRST, SECOND, end=False))
    with pytest.raises(WireError, match="cut short"):
        await read_calls(records_body(FIRST, SECOND)[:-20])


async def test_an_error_frame_is_raised_with_the_servers_words() -> None:
    body = records_body(FIRST, end=False) + error_frame(500, "store_read_failed", "disk on fire")
    with pytest.raises(StoreError, match="disk on fire"):
        await read_calls(body)


async def test_garbage_is_not_a_capture_proxy_answer() -> None:
    with pytest.raises(WireError):
        await read_calls(b"\xff\xff\xff\xff" + b"x" * 64)


async def test_a_newer_wire_version_asks_for_an_upgrade() -> None:
    async with serve(fake_proxy(b"", wire_version=99)) as url:
        with pytest.raises(StoreFormatError, match="upgrade capture-proxy"):
            await asyncio.to_thread(open_store, url, token=TOKEN)


def decode_all(body: bytes) -> list[StagedCallRecord]:
    decoder = RecordDecoder("test")
    out = []
    for msg in iter_frames(io.BytesIO(body).read, "test"):
        record = decoder.feed(msg)
        if record is not None:
            out.append(record)
    return out


def test_a_tail_whose_parent_was_not_sent_is_refused() -> None:
    # Only the second call: its row is a tail of c1's tokens, which this answer does not hold.
    encoder = RecordEncoder()
    assert len(decode_all(encoder.encode(FIRST) + end_frame(1))) == 1
    body = encoder.encode(SECOND) + end_frame(1)
    with pytest.raises(WireError, match="which the answer did not hold"):
        decode_all(body)
