"""A sans-IO Server-Sent Events parser: bytes in, events out, no awaits.

`SSEParser` follows the WHATWG event-stream rules (lines end in ``\\r\\n``, ``\\n`` or ``\\r``; a
blank line ends an event; ``data:`` lines are joined with ``\\n``; one space after the colon is
dropped; lines starting with ``:`` are comments) and keeps each event's exact bytes so a proxy
can relay it verbatim. Feed it chunks split anywhere: the events it returns do not depend on where
the chunks were cut, including inside ``\\r\\n`` or inside a multi-byte UTF-8 character (the parser
works on bytes; only ASCII bytes are structural).

An event still open when the stream ends is *not* returned (the spec discards it); `pending`
tells the caller that bytes of such an event remain, so it can treat the stream as truncated.

Example::

    parser = SSEParser()
    for chunk in body_chunks:
        for event in parser.feed(chunk):
            handle(event.data)
    for event in parser.close():
        handle(event.data)
    if parser.pending:
        raise Truncated()
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import CaptureProxyError

__all__ = ["DEFAULT_MAX_EVENT_SIZE", "SSEError", "SSEEvent", "SSEParser", "encode_event"]

#: The largest event (its raw bytes) a parser accepts by default: 64 MiB.
DEFAULT_MAX_EVENT_SIZE = 64 * 1024 * 1024

_EOL = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"


class SSEError(CaptureProxyError, ValueError):
    """The bytes cannot be parsed as SSE: an event over the size limit, or a feed after close."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One complete event.

    `data` is the event's ``data:`` lines joined by ``\\n`` (``b""`` if it had none: a comment-only
    or id-only event, which the spec does not dispatch; callers normally skip those). `event` is
    the ``event:`` field if any. `comments` holds each comment line's text after the ``:`` (one
    leading space dropped, like field values). `raw` is the event exactly as it arrived, through
    its terminating blank line, ready to relay unchanged.
    """

    data: bytes
    event: str | None
    comments: tuple[bytes, ...]
    raw: bytes


class SSEParser:
    """Incremental SSE parser; see the module docstring.

    `max_event_size` bounds the bytes of one event (and of an unfinished one): beyond it `feed`
    raises `SSEError`, so a peer that never ends an event cannot exhaust memory.
    """

    __slots__ = (
        "_bom_checked",
        "_buf",
        "_closed",
        "_comments",
        "_data",
        "_event",
        "_has_lines",
        "_max",
        "_pos",
        "_start",
    )

    def __init__(self, *, max_event_size: int = DEFAULT_MAX_EVENT_SIZE) -> None:
        if max_event_size <= 0:
            raise ValueError("max_event_size must be positive")
        self._max = max_event_size
        self._buf = bytearray()
        self._start = 0  # where the current event's raw bytes begin in _buf
        self._pos = 0  # where the next unparsed line begins in _buf
        self._data: list[bytes] = []
        self._event: str | None = None
        self._comments: list[bytes] = []
        self._has_lines = False
        self._bom_checked = False
        self._closed = False

    @property
    def pending(self) -> bool:
        """True while bytes of an unfinished event remain (after `close`: one was discarded)."""
        if self._has_lines:
            return True
        rest = self._buf[self._pos :]
        # A lone "\r" held back at the end is a blank line, not the start of an event.
        return bool(rest) and rest != b"\r"

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Parse `chunk` and return the events it completed (possibly none)."""
        if self._closed:
            raise SSEError("feed() after close()")
        if not chunk:
            return []
        self._buf += chunk
        if not self._bom_checked and not self._strip_bom():
            return []
        events = self._parse(final=False)
        self._compact()
        if len(self._buf) - self._start > self._max:
            raise SSEError(f"SSE event larger than {self._max} bytes")
        return events

    def close(self) -> list[SSEEvent]:
        """Signal end of stream; returns an event whose final blank line was a held-back ``\\r``."""
        if self._closed:
            return []
        self._closed = True
        if not self._bom_checked:
            self._bom_checked = True
            if _BOM.startswith(bytes(self._buf)):
                # The stream was only a (partial) byte-order mark.
                self._buf.clear()
                return []
        events = self._parse(final=True)
        self._compact()
        return events

    def _strip_bom(self) -> bool:
        """Drop a leading UTF-8 BOM; False while too few bytes arrived to decide."""
        head = bytes(self._buf[:3])
        if len(head) < 3 and _BOM.startswith(head):
            return False
        self._bom_checked = True
        if head == _BOM:
            del self._buf[:3]
        return True

    def _parse(self, *, final: bool) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        buf = self._buf
        end = len(buf)
        while True:
            if not self._has_lines:
                self._simple_events(events)
            m = _EOL.search(buf, self._pos)
            if m is None:
                break
            if not final and m.end() == end and buf[m.start()] == 0x0D:
                # A "\r" at the very end may be the first half of "\r\n": wait for the next byte
                # so the event's raw bytes (and line count) do not depend on chunk boundaries.
                break
            line = bytes(buf[self._pos : m.start()])
            self._pos = m.end()
            if line:
                self._field(line)
            elif self._has_lines:
                events.append(self._dispatch())
            else:
                # A blank line outside any event: nothing to dispatch, not part of any raw.
                self._start = self._pos
        return events

    def _simple_events(self, events: list[SSEEvent]) -> None:
        """Take complete ``data: <one line>\n\n`` events (what vLLM sends) without the line loop.

        Called between events only. The result is what the general rules give for such an
        event; anything else (comments, other fields, several lines, CR) is left to them.
        """
        buf = self._buf
        pos = self._pos
        while buf.startswith(b"data: ", pos):
            stop = buf.find(b"\n", pos)
            if stop < 0 or buf[stop + 1 : stop + 2] != b"\n" or buf.find(b"\r", pos, stop) >= 0:
                break
            raw = bytes(buf[pos : stop + 2])
            if len(raw) > self._max:
                raise SSEError(f"SSE event larger than {self._max} bytes")
            events.append(SSEEvent(raw[6:-2], None, (), raw))
            pos = stop + 2
        self._pos = self._start = pos

    def _field(self, line: bytes) -> None:
        self._has_lines = True
        if line[0] == 0x3A:  # ':' starts a comment
            self._comments.append(line[2:] if line[1:2] == b" " else line[1:])
            return
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
        elif name == b"event":
            self._event = value.decode("utf-8", "replace")
        # "id", "retry" and unknown fields carry nothing a relay needs; they stay in `raw`.

    def _dispatch(self) -> SSEEvent:
        raw = bytes(self._buf[self._start : self._pos])
        if len(raw) > self._max:
            raise SSEError(f"SSE event larger than {self._max} bytes")
        event = SSEEvent(b"\n".join(self._data), self._event, tuple(self._comments), raw)
        self._start = self._pos
        self._data = []
        self._event = None
        self._comments = []
        self._has_lines = False
        return event

    def _compact(self) -> None:
        # Trim consumed bytes once per feed, not once per event: a chunk holding many events
        # would otherwise cost quadratic copying.
        if self._start:
            del self._buf[: self._start]
            self._pos -= self._start
            self._start = 0


def encode_event(data: bytes) -> bytes:
    """One SSE event carrying `data`: ``data: ...`` lines and the blank line that ends it."""
    if b"\n" not in data and b"\r" not in data:
        return b"data: " + data + b"\n\n"
    lines = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    return b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"
