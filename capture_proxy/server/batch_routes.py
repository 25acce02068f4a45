"""The batch API's routes: trainers on other hosts take batches of the proxy's store.

``POST /admin/store/batches/{consumer}/next`` is a long poll: it answers as soon as the
consumer's next batch is ready (its ids; the trainer reads and verifies the rollouts itself
through the read routes), or ``{"batch": null}`` once the wait it asked for (at most
`MAX_WAIT_S`) has passed. The consumer's place is kept in the proxy's store
(`capture_proxy.read.batch_queue`), so it outlives both the proxy and the trainer. Same tokens
as the read routes: the reader token may take and acknowledge batches (a consumer's place is its
own, not the store's data). docs/batches.md has the statuses.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from ..errors import Conflict, Unprocessable
from ..read.batch_queue import BatchQueue, BatchRequest, BatchUnknown
from ..read.reader import Store
from ..sinks.base import StoreError
from ..sinks.cursors import CursorConflict, check_consumer
from .read_routes import authorize_read, json_answer, read_store
from .validation import read_body

__all__ = ["MAX_WAIT_S", "add_batch_routes"]

#: The longest a ``next`` request waits (a proxy or load balancer in between may cut longer
#: requests); the trainer's client asks again until its own wait is over.
MAX_WAIT_S = 30.0
#: How often a waiting request looks at the store again.
POLL_S = 0.2

_QUEUE: web.AppKey[list[BatchQueue]] = web.AppKey("capture_proxy_batch_queue", list)


class NextBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rollouts: int | None = Field(default=None, ge=1)
    groups: int | None = Field(default=None, ge=1)
    group_size: int | None = Field(default=None, ge=1)
    max_staleness: int | None = Field(default=None, ge=0)
    current_version: int | None = Field(default=None, ge=0)
    wait_s: float = Field(default=0.0, ge=0.0, le=MAX_WAIT_S)


class AckBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_id: str = Field(min_length=1, max_length=300)


def _consumer(request: web.Request) -> str:
    name = request.match_info["consumer"]
    try:
        return check_consumer(name)
    except ValueError as e:
        raise Unprocessable(str(e), param="consumer", code="invalid_consumer") from e


async def _queue(request: web.Request) -> BatchQueue:
    """The proxy's one queue, over its shared reader (made at the first batch request)."""
    held = request.app[_QUEUE]
    if not held:
        state = authorize_read(request)
        try:
            queue = await read_store(state, lambda source: BatchQueue(Store(source)))
        except StoreError as e:
            raise Conflict(str(e), code="no_batches") from e
        if not held:
            held.append(queue)
    return held[0]


async def _run(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A blocking queue call on a thread, its errors as the answers they are."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except BatchUnknown as e:
        raise Conflict(str(e), code="batch_unknown") from e
    except CursorConflict as e:
        raise Conflict(str(e), code="cursor_conflict") from e
    except StoreError as e:
        raise Conflict(str(e), code="no_batches") from e


async def next_batch(request: web.Request) -> web.Response:
    authorize_read(request)
    consumer = _consumer(request)
    body = read_body(await request.read(), NextBody)
    try:
        ask = BatchRequest(
            body.rollouts, body.groups, body.group_size, body.max_staleness, body.current_version
        )
    except ValueError as e:
        raise Unprocessable(str(e), param="rollouts", code="invalid_batch_request") from e
    queue = await _queue(request)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + body.wait_s
    while True:
        got = await _run(queue.next, consumer, ask, read=False)
        if got is not None:
            return json_answer({"batch": got[0].to_dict()})
        left = deadline - loop.time()
        if left <= 0:
            return json_answer({"batch": None})
        await asyncio.sleep(min(POLL_S, left))


async def ack_batch(request: web.Request) -> web.Response:
    authorize_read(request)
    consumer = _consumer(request)
    body = read_body(await request.read(), AckBody)
    queue = await _queue(request)
    acked = await _run(queue.ack, consumer, body.batch_id)
    return json_answer({"consumer": consumer, "batch_id": body.batch_id, "acked": acked})


async def position(request: web.Request) -> web.Response:
    authorize_read(request)
    consumer = _consumer(request)
    queue = await _queue(request)
    return json_answer(await _run(queue.position, consumer))


def add_batch_routes(app: web.Application) -> None:
    """The batch routes, under ``/admin/store/batches`` (docs/batches.md)."""
    app[_QUEUE] = []
    app.router.add_post("/admin/store/batches/{consumer}/next", next_batch)
    app.router.add_post("/admin/store/batches/{consumer}/ack", ack_batch)
    app.router.add_get("/admin/store/batches/{consumer}", position)
