"""`RemoteSource`: the store behind a running proxy, read over HTTP with the standard library.

A trainer on another host opens it as ``open_store("http://HOST:PORT", token=T)``. It speaks to
the read routes of the proxy's control API (docs/contract.md, "Reading the store from another
host") with `http.client`: synchronous, one kept-alive connection, no event loop and no aiohttp.
"""

from __future__ import annotations

import http.client
import ssl
import threading
import urllib.parse
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import msgspec

from ...schemas.events import RolloutEvent
from ...schemas.records import (
    CallSummary,
    CommitCoords,
    LedgerEntry,
    RolloutInfo,
    StagedCallRecord,
)
from ...schemas.store_head import ClaimCount
from ..base import StoreError, StoreFormatError
from ..rollout_index import IndexedRollout, RolloutQuery, scan_headers
from ._replicas import ReplicaStatus
from ._wire import CONTENT_TYPE, WIRE_VERSION, RecordDecoder, WireError, iter_frames

__all__ = ["RemoteSource", "StoreAccessDenied"]

T = TypeVar("T")

#: Keys per fetch or coords request: bounds one answer, and the request body.
_BATCH = 1000
_ROUTES = "/admin/store"


class StoreAccessDenied(StoreError):
    """The proxy refused the token (HTTP 401 or 403): none was given, or not its reader or admin
    token."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class _RouteMissing(StoreError):
    """The proxy does not serve a route (a release without it)."""


class _Answer:
    """An answer's status, error code and message (the OpenAI error body), for errors."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.code = ""
        self.param: str | None = None
        self.message = body[:300].decode("utf-8", "replace")
        try:
            error = msgspec.json.decode(body)["error"]
            self.code = str(error.get("code") or "")
            self.param = error.get("param")
            self.message = str(error.get("message") or self.message)
        except (msgspec.DecodeError, KeyError, TypeError, AttributeError):
            pass  # not our error body: the raw text says what it is


class RemoteSource:
    """A `StagingSource` reading the store of the proxy at `url` through its read routes.

    `token` is the proxy's ``--reader-token`` (reads only) or its ``--admin-token``; without
    one, or with a wrong one, opening raises `StoreAccessDenied`. Records arrive as the sinks
    store them and are rebuilt here; `capture_proxy.read.reader.Store` then recomputes their
    digests, so what the network changed does not pass for a staged call.
    """

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 300.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise StoreError(f"{url!r} is not a proxy's address: write http://HOST:PORT")
        if parts.query or parts.fragment or parts.username or parts.password:
            raise StoreError(
                f"{url!r}: give the proxy's address alone (http://HOST:PORT[/prefix]); the "
                "token goes in token=, never in the URL"
            )
        self.url = url.rstrip("/")
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self._token = token
        self._timeout = timeout
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        about = self._json("GET", "", dict[str, Any])
        version = about.get("wire_version")
        if not isinstance(version, int) or version > WIRE_VERSION:
            self.close_reader()
            raise StoreFormatError(
                f"the proxy at {self.url} sends records in wire version {version}; this "
                f"capture-proxy reads version {WIRE_VERSION}: upgrade capture-proxy"
            )

    # -- HTTP ------------------------------------------------------------------------------

    def _connect(self) -> http.client.HTTPConnection:
        if self._scheme == "https":
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)

    def _send(self, method: str, path: str, body: bytes | None) -> http.client.HTTPResponse:
        headers = {"Accept": f"application/json, {CONTENT_TYPE}"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        if body is not None:
            headers["Content-Type"] = "application/json"
        for attempt in (1, 2):
            reused = self._conn is not None
            if self._conn is None:
                self._conn = self._connect()
            try:
                self._conn.request(method, self._prefix + _ROUTES + path, body, headers)
                return self._conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                # A kept-alive connection the server closed meanwhile: every route only reads,
                # so asking again on a fresh one is safe.
                self._drop()
                if attempt == 2 or not reused:
                    raise StoreError(f"the proxy at {self.url} closed the connection: {e}") from e
            except (OSError, http.client.HTTPException) as e:
                self._drop()
                raise StoreError(f"cannot read the store of the proxy at {self.url}: {e}") from e
        raise AssertionError("unreachable")

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _refused(self, answer: _Answer, path: str, names: Sequence[str]) -> Exception:
        """The error a non-200 answer is, in this source's terms. `names` are what the request
        named (a rollout id, a batch of keys): a 404 for one of them is its KeyError, as from a
        local store."""
        where = f"the proxy at {self.url}"
        if answer.status in (401, 403):
            given = "no token was given" if not self._token else "the token given is not valid"
            return StoreAccessDenied(
                f"{where} refused to read its store ({answer.status}): {given}; pass "
                "token=<its --reader-token or --admin-token> (or set "
                f"CAPTURE_PROXY_READER_TOKEN). It said: {answer.message}",
                answer.status,
            )
        if answer.status == 404 and answer.code == "control_api_off":
            return StoreError(
                f"{where} does not serve its store: start it with --admin-token (and "
                "--reader-token for trainers); the read routes are part of the control API"
            )
        if answer.status == 404 and answer.code == "route_not_found":
            return _RouteMissing(
                f"{where} has no store read routes at {self._prefix + _ROUTES + path}: not a "
                "capture-proxy, a release without them, or its --admin-port is elsewhere"
            )
        if answer.status == 404 and answer.code == "unknown_rollout" and names:
            return KeyError(names[0])
        if answer.status == 404 and answer.code == "unknown_key":
            index = (answer.param or "").removeprefix("keys[").removesuffix("]")
            if index.isdigit() and int(index) < len(names):
                return KeyError(names[int(index)])
            return KeyError(answer.message)
        return StoreError(f"{where} answered {answer.status}: {answer.message}")

    def _call(
        self, method: str, path: str, body: bytes | None, names: Sequence[str]
    ) -> tuple[http.client.HTTPResponse, str]:
        resp = self._send(method, path, body)
        if resp.status != 200:
            answer = _Answer(resp.status, resp.read())
            raise self._refused(answer, path, names)
        return resp, resp.getheader("Content-Type", "").split(";")[0].strip()

    def _json(
        self, method: str, path: str, kind: type[T], body: Any = None, names: Sequence[str] = ()
    ) -> T:
        data = None if body is None else msgspec.json.encode(body)
        with self._lock:
            try:
                resp, ctype = self._call(method, path, data, names)
                raw = resp.read()
            except BaseException:
                self._drop()
                raise
        if ctype != "application/json":
            raise WireError(f"{self.url}{_ROUTES}{path} answered {ctype or 'no content type'}")
        try:
            return msgspec.json.decode(raw, type=kind)
        except msgspec.DecodeError as e:  # ValidationError included: a record refused a value
            raise WireError(f"{self.url}{_ROUTES}{path}: an answer that cannot be read: {e}") from e

    def _frames(
        self, method: str, path: str, body: Any = None, names: Sequence[str] = ()
    ) -> Iterator[dict[str, Any]]:
        """The frames of a streamed answer; the lock is held until it is read through."""
        data = None if body is None else msgspec.json.encode(body)
        where = f"{self.url}{_ROUTES}{path}"
        with self._lock:
            try:
                resp, ctype = self._call(method, path, data, names)
                if ctype != CONTENT_TYPE:
                    raise WireError(f"{where} answered {ctype or 'no content type'}")
                for msg in iter_frames(resp.read, where):
                    if msg.get("t") == "error":
                        answer = _Answer(int(msg.get("status") or 500), b"")
                        answer.code = str(msg.get("code") or "")
                        answer.param = msg.get("param")
                        answer.message = str(msg.get("message") or "")
                        raise self._refused(answer, path, names)
                    yield msg
                resp.read()  # the chunked stream's last, empty chunk: the connection is reusable
            except BaseException:
                self._drop()
                raise

    def _records(
        self, method: str, path: str, body: Any = None, names: Sequence[str] = ()
    ) -> list[StagedCallRecord]:
        decoder = RecordDecoder(f"{self.url}{_ROUTES}{path}")
        out = []
        for msg in self._frames(method, path, body, names):
            record = decoder.feed(msg)
            if record is not None:
                out.append(record)
        return out

    # -- StagingSource ------------------------------------------------------------------------

    def rollouts(self) -> list[str]:
        return self._json("GET", "/rollouts", list[str])

    def rollout_info(self, rollout_id: str) -> RolloutInfo:
        return self._json("GET", f"/rollouts/{_q(rollout_id)}", RolloutInfo, names=[rollout_id])

    def calls(self, rollout_id: str, *, include_orphaned: bool = False) -> list[StagedCallRecord]:
        flag = "true" if include_orphaned else "false"
        return self._records("GET", f"/rollouts/{_q(rollout_id)}/calls?include_orphaned={flag}")

    def failures(self, rollout_id: str) -> list[LedgerEntry]:
        return self._json("GET", f"/rollouts/{_q(rollout_id)}/failures", list[LedgerEntry])

    def events(self, rollout_id: str) -> list[RolloutEvent]:
        # The events as the server's store holds them, hashes included: `Store.verify` checks
        # the chain here, on the reading side.
        return self._json("GET", f"/rollouts/{_q(rollout_id)}/events", list[RolloutEvent])

    def claims(self, rollout_id: str) -> dict[int, str]:
        return self._json("GET", f"/rollouts/{_q(rollout_id)}/claims", dict[int, str])

    def claim_counts(self) -> dict[str, ClaimCount]:
        """The server's store's claim files, counted (`sinks.base.ClaimFiles`; {} when its
        claims are events only): the store head covers them."""
        got = self._json("GET", "/claim-counts", dict[str, tuple[int, int]])
        return {rollout_id: ClaimCount(*count) for rollout_id, count in got.items()}

    def summaries(self, rollout_id: str) -> list[CallSummary]:
        return self._json("GET", f"/rollouts/{_q(rollout_id)}/summaries", list[CallSummary])

    def fetch(self, keys: Sequence[str]) -> list[StagedCallRecord]:
        out: list[StagedCallRecord] = []
        for start in range(0, len(keys), _BATCH):
            batch = list(keys[start : start + _BATCH])
            got = self._records("POST", "/fetch", {"keys": batch}, batch)
            by_key = {r.staging_key: r for r in got}
            out.extend(_in_order(batch, by_key, self.url))
        return out

    def coords(self, keys: Sequence[str]) -> list[CommitCoords]:
        out: list[CommitCoords] = []
        for start in range(0, len(keys), _BATCH):
            batch = list(keys[start : start + _BATCH])
            out.extend(self._json("POST", "/coords", list[CommitCoords], {"keys": batch}, batch))
        return out

    def orphaned(self) -> set[str]:
        return set(self._json("GET", "/orphaned", list[str]))

    def all_keys(self) -> list[str]:
        keys: list[str] = []
        for msg in self._frames("GET", "/keys"):
            if msg.get("t") != "keys":
                raise WireError(f"{self.url}{_ROUTES}/keys: unexpected frame {msg.get('t')!r}")
            keys.extend(str(k) for k in msg["keys"])
        return keys

    def unreferenced_attachments(self) -> list[str]:
        return self._json("GET", "/unreferenced-attachments", list[str])

    def replicas(self) -> list[ReplicaStatus] | None:
        """The proxy's upstream replicas and their states (docs/fleets.md): empty with a single
        upstream, None from a proxy too old to say. Not part of the store: what the proxy
        fronts now, for `inspect`."""
        try:
            return self._json("GET", "/replicas", list[ReplicaStatus])
        except _RouteMissing:
            return None

    def indexed_rollouts(self, query: RolloutQuery) -> list[IndexedRollout]:
        """The proxy's rollout index, filtered on the proxy (``GET /admin/store/index``); a
        proxy too old to have it is read one header at a time."""
        params: list[tuple[str, str]] = []
        # The proxy leaves out poisoned rows of a state: a query that wants them asks for every
        # state, in one answer (the store's order), and keeps its state here.
        if query.state is not None and not (query.with_poisoned and query.state != "poisoned"):
            params.append(("state", query.state))
        if query.since_ms is not None:
            params.append(("since", str(query.since_ms)))
        params.extend(("group", g) for g in sorted(query.groups or ()))
        if query.graded is not None:
            params.append(("graded", "true" if query.graded else "false"))
        path = "/index" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            rows = self._json("GET", path, list[dict[str, Any]])
        except _RouteMissing:
            return scan_headers(self, query)
        out = [IndexedRollout(**r) for r in rows]
        return [r for r in out if query.matches(r)]

    def next_batch(
        self, consumer: str, request: dict[str, Any], wait_s: float
    ) -> dict[str, Any] | None:
        """The proxy's next batch for `consumer` (`capture_proxy.read.batches`), waiting on the
        proxy up to `wait_s` seconds; None when none was ready."""
        body = {**request, "wait_s": wait_s}
        got = self._json("POST", f"/batches/{_q(consumer)}/next", dict[str, Any], body)
        batch = got.get("batch")
        return None if batch is None else dict(batch)

    def ack_batch(self, consumer: str, batch_id: str) -> int:
        """Acknowledge `batch_id` on the proxy; how many rollouts it acknowledged."""
        got = self._json(
            "POST", f"/batches/{_q(consumer)}/ack", dict[str, Any], {"batch_id": batch_id}
        )
        return int(got["acked"])

    def close_reader(self) -> None:
        with self._lock:
            self._drop()


def _q(rollout_id: str) -> str:
    return urllib.parse.quote(rollout_id, safe="")


def _in_order(
    keys: list[str], by_key: dict[str, StagedCallRecord], url: str
) -> Iterator[StagedCallRecord]:
    for key in keys:
        if key not in by_key:
            raise WireError(f"{url}{_ROUTES}/fetch: the answer left out {key}")
        yield by_key[key]
