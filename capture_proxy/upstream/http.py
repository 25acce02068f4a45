"""The upstream vLLM behind one aiohttp client: chat, pass-through routes, facts, readiness.

Every aiohttp error and timeout is turned into the project's `UpstreamFailed` in one place
(`_mapped`, raised ``from`` the original so its cause stays in tracebacks), the way httpx maps
httpcore's exceptions at its boundary. Facts about the upstream (version, reasoning field,
tokenizer fingerprint, sampling defaults) are fetched lazily — a sidecar may start before vLLM is
up — and fetched again for each new upstream process (`known.UpstreamFacts`): after the upstream
was unreachable, and when a chat call opens a new connection (`connector.WatchedConnector`).
Token-in's routes (`post_engine`) go through a lean client of their own
(`rpc.RpcPool`), with the same timeouts, error codes and restart check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import aiohttp
import orjson

from ..core.transport import SCALE_OUT_DISABLED, EngineRoute, UpstreamInfo
from ..errors import UpstreamFailed
from .connector import WATCHED_PATHS, WatchedConnector
from .known import UpstreamFacts
from .read_watch import ReadWatch, past_deadline
from .rpc import KEEPALIVE_S, RpcPool, RpcReply

__all__ = ["HTTPUpstream", "HTTPUpstreamReply"]

log = logging.getLogger("capture_proxy.upstream")

JSON = "application/json"
#: What the context guard sends to /tokenize: the parts of a chat request that shape the prompt.
_PROMPT_KEYS = ("model", "messages", "tools", "chat_template_kwargs", "add_generation_prompt")
#: Longest wait for a fact (``/version``, the fingerprint's ``/tokenize``, the probe render).
#: Calls wait for them, so a hanging upstream route must not hold every call for the first-byte
#: timeout; a fact not fetched in time is left empty and asked for again a few seconds later.
_FACT_TIMEOUT = 5.0
#: What vLLM's 403 for a token-in route says when it runs without ``--enable-scale-out``.
_SCALE_OUT_403 = b"Scale-out endpoints are disabled"
#: Connections the facts requests may hold at once (their own pool: see `facts_session`).
_FACTS_CONNECTIONS = 4
#: The headers aiohttp adds to every request that vLLM does not read: the facts requests go
#: without them (84 bytes of a ``/weight_info`` read's 137, which the plain path sends twice a
#: call when vLLM serves it). ``Host`` stays, and the ``Authorization`` an API key adds.
_UNREAD_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding")
#: The codes after which every fact is fetched again (the upstream may have restarted).
_STALE_CODES = frozenset({"upstream_unreachable", "upstream_connect_timeout"})


class HTTPUpstream:
    """An upstream vLLM at `base_url` (with or without ``/v1``), reached over HTTP.

    Pass a shared `session` (the proxy pools one per process), or none and the client opens its
    own on first use; `close` closes only a session it opened. Only a session of its own
    notices an upstream restart before a call is sent (`capture_proxy.core.transport.
    UpstreamRestarted`); with a shared one, a restart is noticed when a connection fails.
    Timeouts: `connect_timeout` to
    open a connection, `first_byte_timeout` until the response headers, `idle_timeout` between
    two reads of a response body, `total_timeout` (0: none) from sending a chat call until its
    whole answer is in, so an upstream that trickles bytes cannot hold a call forever.
    """

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession | None = None,
        *,
        api_key: str = "",
        reasoning_field: str = "auto",
        connect_timeout: float = 10.0,
        first_byte_timeout: float = 600.0,
        idle_timeout: float = 300.0,
        total_timeout: float = 0.0,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self._session = session
        self._own_session = session is None
        self._facts_session: aiohttp.ClientSession | None = None
        self._rpc: RpcPool | None = None
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.connect_timeout = connect_timeout
        self.first_byte_timeout = first_byte_timeout
        self.idle_timeout = idle_timeout
        self.total_timeout = total_timeout
        self.known = UpstreamFacts(
            self._fetch, reasoning_field, min(_FACT_TIMEOUT, first_byte_timeout)
        )

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
                connector=WatchedConnector(
                    self.known.verify, limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S
                ),
            )
        return self._session

    @property
    def facts_session(self) -> aiohttp.ClientSession:
        """The small pool the facts requests use (``/version``, the probe ``/tokenize`` and
        render, ``/weight_info``). A new chat connection's check asks for several facts at once:
        through the chat pool each would open (and keep) a connection of its own, growing the
        pool to a multiple of the calls in flight. A shared session given by the caller is used
        as it is."""
        if not self._own_session:
            return self.session
        if self._facts_session is None:
            self._facts_session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
                connector=aiohttp.TCPConnector(limit=_FACTS_CONNECTIONS),
                skip_auto_headers=_UNREAD_AUTO_HEADERS,
            )
        return self._facts_session

    @property
    def fact_timeout(self) -> float:
        """Longest wait for one fact (``/version``, ``/tokenize``, the probe render)."""
        return self.known.timeout

    @fact_timeout.setter
    def fact_timeout(self, seconds: float) -> None:
        self.known.timeout = seconds

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None
        if self._facts_session is not None:
            await self._facts_session.close()
            self._facts_session = None
        if self._rpc is not None:
            self._rpc.close()
            self._rpc = None

    def url(self, path: str) -> str:
        return self.base_url + path

    def mark_stale(self) -> None:
        """Fetch every fact again: the upstream was unreachable (maybe restarted)."""
        self.known.forget()

    # -- errors ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _mapped(self, what: str, *, code: str = "upstream_unreachable") -> Iterator[None]:
        """The one map from aiohttp's errors and timeouts to `UpstreamFailed`."""
        try:
            yield
        except aiohttp.ConnectionTimeoutError as e:
            # Before TimeoutError: aiohttp's connect timeout is a TimeoutError too.
            self.mark_stale()
            raise UpstreamFailed(
                f"could not connect to the upstream within {self.connect_timeout:g}s "
                "(--upstream-connect-timeout)",
                code="upstream_connect_timeout",
                status=504,
            ) from e
        except TimeoutError as e:
            raise UpstreamFailed(
                f"the upstream sent no response within {self.first_byte_timeout:g}s",
                code="upstream_timeout",
                status=504,
            ) from e
        except aiohttp.ClientError as e:
            self.mark_stale()
            raise UpstreamFailed(f"{what}: {type(e).__name__}: {e}", code=code) from e

    # -- the chat route ----------------------------------------------------------------------

    async def post_chat(self, body: bytes) -> HTTPUpstreamReply:
        """POST a chat request; the reply once its headers are in (`UpstreamFailed` if not)."""
        return await self._post("/v1/chat/completions", body)

    async def post_engine(self, route: EngineRoute, body: bytes) -> HTTPUpstreamReply | RpcReply:
        """POST to one of vLLM's token-in routes (render, generate, derender), as `post_chat`
        does; a 403 "Scale-out endpoints are disabled" raises `UpstreamFailed` with code
        ``scale_out_disabled`` (503), whose message names ``--enable-scale-out``.

        With a session of its own, the upstream sends them through a lean pooled client
        (`capture_proxy.upstream.rpc`): the same timeouts, errors and restart check, at a third
        of aiohttp's CPU per request."""
        reply: HTTPUpstreamReply | RpcReply
        if self._own_session:
            reply = await self._post_rpc(route.value, body)
        else:
            reply = await self._post(route.value, body)
        if reply.status == 403:
            async with reply:
                raw = await reply.read()  # aiohttp keeps it: the caller may read it again
            if _SCALE_OUT_403 in raw:
                raise UpstreamFailed(SCALE_OUT_DISABLED, code="scale_out_disabled", status=503)
        return reply

    async def _post_rpc(self, path: str, body: bytes) -> RpcReply:
        if self._rpc is None:
            self._rpc = RpcPool(
                self.base_url,
                headers=self.headers,
                connect_timeout=self.connect_timeout,
                on_new=self.known.verify,
                watched=WATCHED_PATHS,
            )
        self._rpc.connect_timeout = self.connect_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_timeout if self.total_timeout else None
        first_byte = self.first_byte_timeout
        if self.total_timeout:
            first_byte = min(first_byte, self.total_timeout)
        try:
            return await self._rpc.post(
                path,
                body,
                first_byte=first_byte,
                idle=self.idle_timeout,
                deadline=deadline,
                total=self.total_timeout,
            )
        except UpstreamFailed as e:
            if e.code in _STALE_CODES:
                self.mark_stale()
            raise

    async def _post(self, path: str, body: bytes) -> HTTPUpstreamReply:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_timeout if self.total_timeout else None
        first_byte = self.first_byte_timeout
        if self.total_timeout:
            first_byte = min(first_byte, self.total_timeout)
        headers = {**self.headers, "Content-Type": JSON}
        data: bytes | AsyncIterator[memoryview] = body
        if len(body) > _WHOLE_WRITE_BYTES:
            # In slices, each written once the connection has room for it: aiohttp writes a
            # bytes body in one call, which held the event loop ~70 ms per 50 MiB image body
            # (py-spy beside bench/bench_big_body.py). Same bytes, same Content-Length.
            data = _slices(body)
            headers["Content-Length"] = str(len(body))
        with self._mapped("cannot reach the upstream"):
            async with asyncio.timeout(first_byte):
                resp = await self.session.post(self.url(path), data=data, headers=headers)
        return HTTPUpstreamReply(resp, self.idle_timeout, deadline, self.total_timeout)

    # -- other routes ------------------------------------------------------------------------

    async def relay(
        self,
        method: str,
        path: str,
        body: bytes | None,
        content_type: str | None,
        *,
        within: float | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> tuple[int, str, bytes]:
        """One uncaptured request (pass-through routes): status, content type and body, within
        `within` seconds (default: the first-byte timeout)."""
        headers = dict(self.headers)
        if body is not None:
            headers["Content-Type"] = content_type or JSON
        with self._mapped("cannot reach the upstream"):
            async with (session or self.session).request(
                method,
                self.url(path),
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(
                    total=within or self.first_byte_timeout, sock_connect=self.connect_timeout
                ),
            ) as resp:
                return resp.status, resp.headers.get("Content-Type", JSON), await resp.read()

    async def problem(self, within: float = 2.0) -> str | None:
        """Why the upstream is not ready (``/version`` unreachable or 5xx within `within`
        seconds), or None."""
        try:
            async with self.session.get(
                self.url("/version"),
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=within, sock_connect=self.connect_timeout),
            ) as resp:
                if resp.status >= 500:
                    return f"upstream /version answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as e:
            return f"upstream unreachable: {type(e).__name__}"
        return None

    async def count_prompt_tokens(self, request: Mapping[str, Any]) -> int:
        """The prompt's token count from the upstream's /tokenize (the context guard)."""
        body = {k: request[k] for k in _PROMPT_KEYS if k in request}
        what = "the context guard could not tokenize the prompt"
        try:
            status, _, raw = await self.relay("POST", "/tokenize", orjson.dumps(body), JSON)
        except UpstreamFailed as e:
            raise UpstreamFailed(f"{what}: {e.message}", code="context_guard") from e
        if status != 200:
            raise UpstreamFailed(
                f"{what}: upstream /tokenize answered {status}", code="context_guard"
            )
        try:
            return int(orjson.loads(raw)["count"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise UpstreamFailed(f"{what}: {type(e).__name__}: {e}", code="context_guard") from e

    async def tokenize_text(self, model: str, text: str) -> list[int] | None:
        """The ids of `text` from the upstream's /tokenize, no special tokens added (None when
        it does not answer them): token-in learns the reasoning parser's marker ids with it."""
        body = {"model": model, "prompt": text, "add_special_tokens": False}
        try:
            status, _, raw = await self.relay(
                "POST", "/tokenize", orjson.dumps(body), JSON, within=self.fact_timeout
            )
            tokens = orjson.loads(raw)["tokens"] if status == 200 else None
        except (UpstreamFailed, orjson.JSONDecodeError, KeyError, TypeError):
            return None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            return None
        return tokens

    # -- vLLM's weight-update routes (served with VLLM_SERVER_DEV_MODE=1) ----------------------

    async def engine_route(self, path: str, body: Mapping[str, Any] | None = None) -> bool:
        """POST one of vLLM's dev-mode routes (``/pause``, ``/resume``,
        ``/update_weight_version``): True when done, False when the upstream does not serve it
        (404: no ``VLLM_SERVER_DEV_MODE=1``). `UpstreamFailed` (502) for any other answer."""
        data = orjson.dumps(body) if body is not None else None
        status, _, raw = await self.relay("POST", path, data, JSON)
        if status == 404:
            return False
        if not 200 <= status < 300:
            raise UpstreamFailed(
                f"upstream {path} answered {status}: {raw[:200].decode(errors='replace')}",
                code="upstream_weights_route",
            )
        return True

    async def pause_engine(self) -> bool:
        return await self.engine_route("/pause")

    async def resume_engine(self) -> bool:
        return await self.engine_route("/resume")

    async def push_weight_version(self, version: int) -> bool:
        # vLLM's weight version is a string ("default" at start).
        # Each call reads the engine's version for itself (`UpstreamFacts.
        # read_engine_weight_version`): nothing cached here can go stale.
        return await self.engine_route("/update_weight_version", {"new_version": str(version)})

    # -- facts -------------------------------------------------------------------------------

    async def info(self, model: str) -> UpstreamInfo:
        """Version, reasoning field, tokenizer fingerprint and sampling defaults for `model`
        (cached per upstream process; see `capture_proxy.upstream.known`)."""
        return await self.known.info(model)

    async def read_engine_weight_version(self) -> str | None:
        """vLLM's own weight version now (``/weight_info``, served with
        ``VLLM_SERVER_DEV_MODE=1``), or None when not served: one request when it is."""
        return await self.known.read_engine_weight_version()

    async def scale_out_served(self) -> bool | None:
        """Whether the upstream serves vLLM's scale-out routes (what token-in calls): known from
        the probe render of this upstream process, else asked with one probe render; None while
        unknown (the upstream unreachable)."""
        return await self.known.check_scale_out()

    def fact_problems(self) -> list[str]:
        """The facts about the upstream that are missing now, one sentence each."""
        return self.known.problems()

    async def _fetch(
        self, method: str, path: str, body: bytes | None, within: float
    ) -> tuple[int, bytes]:
        status, _, raw = await self.relay(
            method, path, body, JSON, within=within, session=self.facts_session
        )
        return status, raw


class HTTPUpstreamReply:
    """An aiohttp response as an `UpstreamReply`, with the idle timeout between reads and the
    call's total deadline (`deadline`, in loop time; None: none)."""

    def __init__(
        self,
        resp: aiohttp.ClientResponse,
        idle_timeout: float,
        deadline: float | None = None,
        total_timeout: float = 0.0,
    ) -> None:
        self._resp = resp
        self._idle = idle_timeout
        self._deadline = deadline
        self._total = total_timeout

    def _past_deadline(self) -> UpstreamFailed:
        return past_deadline(self._total)

    @property
    def status(self) -> int:
        return self._resp.status

    async def __aenter__(self) -> HTTPUpstreamReply:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._resp.release()

    def close(self) -> None:
        """Drop the connection (vLLM aborts the generation when its client goes away)."""
        self._resp.close()

    async def read(self) -> bytes:
        loop = asyncio.get_running_loop()
        wait = self._idle
        if self._deadline is not None:
            wait = min(wait, self._deadline - loop.time())
        try:
            async with asyncio.timeout(wait):
                return await self._resp.read()
        except TimeoutError as e:
            if self._deadline is not None and loop.time() >= self._deadline:
                self._resp.close()
                raise self._past_deadline() from e
            raise UpstreamFailed(
                f"the upstream answer broke off: {type(e).__name__}: {e}", code="upstream_broken"
            ) from e
        except aiohttp.ClientError as e:
            raise UpstreamFailed(
                f"the upstream answer broke off: {type(e).__name__}: {e}", code="upstream_broken"
            ) from e

    async def chunks(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        content = self._resp.content
        watch = ReadWatch(
            self._idle,
            self._deadline,
            lambda kind: content.set_exception(
                _UpstreamDeadline() if kind == "deadline" else _UpstreamIdle()
            ),
        )
        try:
            while True:
                if self._deadline is not None and loop.time() >= self._deadline:
                    self._resp.close()
                    raise self._past_deadline()
                watch.waiting_since = loop.time()
                try:
                    chunk = await self._resp.content.readany()
                except _UpstreamDeadline as e:
                    self._resp.close()
                    raise self._past_deadline() from e
                except (_UpstreamIdle, TimeoutError) as e:
                    self._resp.close()
                    raise UpstreamFailed(
                        f"the upstream sent nothing for {self._idle:g}s mid-stream",
                        code="upstream_idle_timeout",
                    ) from e
                except aiohttp.ClientError as e:
                    raise UpstreamFailed(
                        f"the upstream stream broke: {type(e).__name__}: {e}",
                        code="upstream_broken",
                    ) from e
                watch.waiting_since = None
                if not chunk:
                    return
                yield chunk
        finally:
            watch.stop()


class _UpstreamIdle(Exception):
    """A read of the upstream body waited longer than the idle timeout (`ReadWatch`)."""


class _UpstreamDeadline(Exception):
    """The call's total deadline passed while a read of the upstream body waited."""


#: Request bodies over this size are written to the upstream in slices of `_SLICE_BYTES`.
_WHOLE_WRITE_BYTES = 4 << 20
_SLICE_BYTES = 1 << 20


async def _slices(body: bytes) -> AsyncIterator[memoryview]:
    view = memoryview(body)
    for start in range(0, len(view), _SLICE_BYTES):
        yield view[start : start + _SLICE_BYTES]
