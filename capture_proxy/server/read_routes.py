"""The read routes of the control API: the proxy's store, served to trainers on other hosts.

``open_store("http://HOST:PORT", token=T)`` (`capture_proxy.sinks.remote.RemoteSource`) speaks
to these: one route per `StagingSource` method the reader uses. Small answers are JSON; records
and keys are streamed (chunked) as msgpack frames in the wire form of
`capture_proxy.sinks.remote`, built one batch at a time, so an answer's size does not bound the
proxy's memory. Records are sent as stored: the reader recomputes their digests. One route is
not the store's: ``/admin/store/replicas``, the upstream replicas' states, for ``inspect``.

Each route takes the admin token or the reader token (``--reader-token``: reads only; the
control API's other routes answer it 403). Store reads block, so they run on threads, through
the proxy's one shared reader.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from ..errors import NotFound, ProxyError, Unauthorized, Unprocessable
from ..schemas.records import StagedCallRecord
from ..sinks.base import ClaimFiles, StagingSource
from ..sinks.remote import (
    CONTENT_TYPE,
    WIRE_VERSION,
    RecordEncoder,
    ReplicaStatus,
    end_frame,
    error_frame,
    keys_frame,
)
from ..sinks.rollout_index import RolloutQuery, indexed
from ..upstream.replicas import ReplicaSet
from .state import STATE, ProxyState, token_bytes
from .validation import read_body

__all__ = ["add_read_routes", "authorize_read", "json_answer", "read_store", "reader_may_not"]

T = TypeVar("T")

#: Keys one fetch or coords request may name (the client sends batches of 1000).
MAX_KEYS = 10_000
#: Records read from the store per thread hop, and keys per frame.
_RECORDS_PER_READ = 32
_KEYS_PER_FRAME = 10_000


class Keys(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[str] = Field(max_length=MAX_KEYS)


def _bearer(request: web.Request) -> bytes:
    auth = request.headers.get("Authorization", "")
    return token_bytes(auth[7:] if auth.startswith("Bearer ") else "")


def authorize_read(request: web.Request) -> ProxyState:
    state = request.app[STATE]
    admin, reader = state.settings.admin_token, state.settings.reader_token
    if not admin:
        raise NotFound(
            "the control API is off: start capture-proxy with --admin-token", code="control_api_off"
        )
    given = _bearer(request)
    # Both compared every time, so the answer's timing does not say which token was close.
    ok_admin = hmac.compare_digest(given, admin.encode())
    ok_reader = hmac.compare_digest(given, (reader or admin).encode())
    if not (ok_admin or (reader and ok_reader)):
        raise Unauthorized(
            "reading the store needs Authorization: Bearer <reader token or admin token>",
            code="reader_token",
        )
    return state


def reader_may_not(request: web.Request) -> bool:
    """True when the request carries the reader token: the control API's write routes refuse
    it (403) rather than call it unknown."""
    reader = request.app[STATE].settings.reader_token
    return bool(reader) and hmac.compare_digest(_bearer(request), reader.encode())


async def read_store(state: ProxyState, fn: Callable[[StagingSource], T]) -> T:
    source = state.capture.source
    if source is None:  # a Capture built without a reader: only in embeddings, never serve
        raise NotFound("this proxy has no reader on its store", code="no_store_reader")
    return await asyncio.to_thread(lambda: fn(source()))


def json_answer(value: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(value), content_type="application/json")


def _flag(request: web.Request, name: str) -> bool:
    raw = request.query.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise Unprocessable(
            f"Invalid value {raw[:16]!r} at {name}; expected true or false", param=name
        )
    return raw in ("true", "1")


def _unknown_key(exc: KeyError, keys: Sequence[str]) -> ProxyError:
    """The 404 of a missing key, naming it by its place in the request (``keys[3]``). Sources
    raise KeyError with the key, or with a message quoting it (SQLite's)."""
    said = str(exc.args[0]) if exc.args else ""
    index = next((i for i, k in enumerate(keys) if said in (k, repr(k)) or repr(k) in said), None)
    if index is None:
        return NotFound(f"a key is not in the store: {said}", code="unknown_key", param="keys")
    return NotFound(f"no staged call {keys[index]}", code="unknown_key", param=f"keys[{index}]")


async def about(request: web.Request) -> web.Response:
    state = authorize_read(request)
    return json_answer({"store": state.sink.url, "wire_version": WIRE_VERSION})


def _query(request: web.Request) -> RolloutQuery | None:
    """The rollout index query of ``?state=&since=&group=&graded=`` (None: no filter). ``group``
    may be given several times."""
    q = request.query
    if not any(k in q for k in ("state", "since", "group", "graded")):
        return None
    since = q.get("since")
    # Milliseconds since the epoch: 15 digits reach the year 33658 (and stay within SQLite's
    # integers).
    if since is not None and not (since.isdigit() and len(since) <= 15):
        raise Unprocessable(
            f"Invalid value {since[:16]!r} at since; expected milliseconds since the epoch",
            param="since",
        )
    try:
        return RolloutQuery(
            state=q.get("state"),  # type: ignore[arg-type]  # checked by RolloutQuery
            since_ms=None if since is None else int(since),
            groups=frozenset(q.getall("group")) if "group" in q else None,
            graded=_flag(request, "graded") if "graded" in q else None,
        )
    except ValueError as e:
        raise Unprocessable(f"Invalid value at state: {e}", param="state") from e


async def rollouts(request: web.Request) -> web.Response:
    """Rollout ids, oldest first; with ``?state=&since=&group=&graded=`` only those the
    rollout index keeps, evaluated here (the answer costs what it returns)."""
    state = authorize_read(request)
    query = _query(request)
    if query is None:
        return json_answer(await read_store(state, lambda s: s.rollouts()))
    rows = await read_store(state, lambda s: indexed(s, query))
    return json_answer([r.rollout_id for r in rows])


async def index(request: web.Request) -> web.Response:
    """The rollout index's rows the filters keep (as ``/rollouts``), each a JSON object."""
    state = authorize_read(request)
    query = _query(request) or RolloutQuery()
    rows = await read_store(state, lambda s: indexed(s, query))
    return json_answer([r.to_dict() for r in rows])


async def rollout_info(request: web.Request) -> web.Response:
    state = authorize_read(request)
    rollout_id = request.match_info["rollout_id"]
    try:
        return json_answer(await read_store(state, lambda s: s.rollout_info(rollout_id)))
    except KeyError as exc:
        raise NotFound(f"no rollout {rollout_id}", code="unknown_rollout") from exc


async def events(request: web.Request) -> web.Response:
    state = authorize_read(request)
    rollout_id = request.match_info["rollout_id"]
    return json_answer(await read_store(state, lambda s: s.events(rollout_id)))


async def claims(request: web.Request) -> web.Response:
    state = authorize_read(request)
    rollout_id = request.match_info["rollout_id"]
    return json_answer(await read_store(state, lambda s: s.claims(rollout_id)))


async def claim_counts(request: web.Request) -> web.Response:
    """Every rollout's claim files, counted (a Parquet dataset's; {} for a store whose claims are
    events only): what the store head covers of them, for `Store.store_head` read remotely."""
    state = authorize_read(request)
    return json_answer(
        await read_store(state, lambda s: s.claim_counts() if isinstance(s, ClaimFiles) else {})
    )


async def failures(request: web.Request) -> web.Response:
    state = authorize_read(request)
    rollout_id = request.match_info["rollout_id"]
    return json_answer(await read_store(state, lambda s: s.failures(rollout_id)))


async def summaries(request: web.Request) -> web.Response:
    state = authorize_read(request)
    rollout_id = request.match_info["rollout_id"]
    return json_answer(await read_store(state, lambda s: s.summaries(rollout_id)))


async def orphaned(request: web.Request) -> web.Response:
    state = authorize_read(request)
    return json_answer(sorted(await read_store(state, lambda s: s.orphaned())))


async def unreferenced(request: web.Request) -> web.Response:
    state = authorize_read(request)
    return json_answer(await read_store(state, lambda s: s.unreferenced_attachments()))


async def replicas(request: web.Request) -> web.Response:
    """The proxy's upstream replicas and their states (none with a single upstream), so that
    ``inspect`` on a running proxy shows which replicas serve and why the others do not."""
    state = authorize_read(request)
    upstream = state.upstream
    if not isinstance(upstream, ReplicaSet):
        return json_answer([])
    load = state.pipeline.replica_load()
    return json_answer(
        [ReplicaStatus(**r.to_dict(), live_rollouts=load.get(r.name, 0)) for r in upstream.replicas]
    )


async def coords(request: web.Request) -> web.Response:
    state = authorize_read(request)
    keys = read_body(await request.read(), Keys).keys
    try:
        return json_answer(await read_store(state, lambda s: s.coords(keys)))
    except KeyError as exc:
        raise _unknown_key(exc, keys) from exc


async def _stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
    response.enable_chunked_encoding()
    await response.prepare(request)
    return response


async def _send_records(
    request: web.Request,
    batches: list[Callable[[StagingSource], list[StagedCallRecord]]],
    state: ProxyState,
    keys: Sequence[str] = (),
) -> web.StreamResponse:
    """Stream the records each batch reads. The first batch is read before the answer begins,
    so a missing key or rollout is an ordinary 404; a later failure is an ``error`` frame."""
    encoder = RecordEncoder()
    response: web.StreamResponse | None = None
    try:
        for batch in batches:
            records = await read_store(state, batch)
            if response is None:
                response = await _stream(request)
            for record in records:
                await response.write(encoder.encode(record))
    except KeyError as exc:
        if response is None:
            raise _unknown_key(exc, keys) from exc
        err = _unknown_key(exc, keys)
        await response.write(error_frame(404, err.code, err.message, err.param))
        return response
    except Exception as exc:
        if response is None:
            raise
        # The status line is sent: the reader learns of the failure from this frame (and from
        # the missing end frame, should even this write fail).
        await response.write(error_frame(500, "store_read_failed", f"{type(exc).__name__}: {exc}"))
        return response
    if response is None:
        response = await _stream(request)
    await response.write(end_frame(encoder.count))
    await response.write_eof()
    return response


async def calls(request: web.Request) -> web.StreamResponse:
    state = authorize_read(request)
    rollout_id = request.match_info["rollout_id"]
    include_orphaned = _flag(request, "include_orphaned")
    return await _send_records(
        request, [lambda s: s.calls(rollout_id, include_orphaned=include_orphaned)], state
    )


async def fetch(request: web.Request) -> web.StreamResponse:
    state = authorize_read(request)
    keys = read_body(await request.read(), Keys).keys

    def batch(part: list[str]) -> Callable[[StagingSource], list[StagedCallRecord]]:
        return lambda s: s.fetch(part)

    parts = [keys[i : i + _RECORDS_PER_READ] for i in range(0, len(keys), _RECORDS_PER_READ)]
    return await _send_records(request, [batch(p) for p in parts], state, keys)


async def all_keys(request: web.Request) -> web.StreamResponse:
    state = authorize_read(request)
    keys = await read_store(state, lambda s: list(s.all_keys()))
    response = await _stream(request)
    for start in range(0, len(keys), _KEYS_PER_FRAME):
        await response.write(keys_frame(keys[start : start + _KEYS_PER_FRAME]))
    await response.write(end_frame(len(keys)))
    await response.write_eof()
    return response


def add_read_routes(app: web.Application) -> None:
    """The read routes, under ``/admin/store`` (docs/contract.md)."""
    app.router.add_get("/admin/store", about)
    app.router.add_get("/admin/store/rollouts", rollouts)
    app.router.add_get("/admin/store/index", index)
    app.router.add_get("/admin/store/rollouts/{rollout_id}", rollout_info)
    app.router.add_get("/admin/store/rollouts/{rollout_id}/calls", calls)
    app.router.add_get("/admin/store/rollouts/{rollout_id}/failures", failures)
    app.router.add_get("/admin/store/rollouts/{rollout_id}/summaries", summaries)
    app.router.add_get("/admin/store/rollouts/{rollout_id}/events", events)
    app.router.add_get("/admin/store/rollouts/{rollout_id}/claims", claims)
    app.router.add_get("/admin/store/claim-counts", claim_counts)
    app.router.add_post("/admin/store/fetch", fetch)
    app.router.add_post("/admin/store/coords", coords)
    app.router.add_get("/admin/store/keys", all_keys)
    app.router.add_get("/admin/store/orphaned", orphaned)
    app.router.add_get("/admin/store/unreferenced-attachments", unreferenced)
    app.router.add_get("/admin/store/replicas", replicas)
    from .batch_routes import add_batch_routes  # it uses this module's helpers

    add_batch_routes(app)
