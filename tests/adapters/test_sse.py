"""SSEParser: real vLLM streams, line endings and field rules, limits, chunk-split fuzzing."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.adapters.sse import SSEError, SSEEvent, SSEParser, encode_event
from tests.support import FIXTURES

FIXTURES = next(
    p
    for p in (
        FIXTURES / "vllm-0.32.0",
        Path("/work/shared/fixtures/vllm-0.32.0"),
    )
    if p.is_dir()
)


def parse_all(stream: bytes, chunks: list[int] | None = None) -> tuple[list[SSEEvent], bool]:
    """Parse `stream` fed in pieces cut at `chunks` offsets; returns (events, pending at end)."""
    parser = SSEParser()
    events: list[SSEEvent] = []
    start = 0
    for cut in sorted(chunks or []):
        events += parser.feed(stream[start:cut])
        start = cut
    events += parser.feed(stream[start:])
    events += parser.close()
    return events, parser.pending


@pytest.mark.parametrize(("name", "count"), [("chat-stream.sse", 9), ("tool-call-stream.sse", 51)])
def test_fixture_streams_parse_into_their_data_lines(name: str, count: int) -> None:
    stream = (FIXTURES / name).read_bytes()
    events, pending = parse_all(stream)
    assert not pending
    assert len(events) == count
    expected = [line[6:] for line in stream.split(b"\n") if line.startswith(b"data: ")]
    assert [e.data for e in events] == expected
    assert events[-1].data == b"[DONE]"
    assert all(e.event is None and e.comments == () for e in events)
    # The raw bytes of all events are the stream itself: nothing lost, nothing invented.
    assert b"".join(e.raw for e in events) == stream


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_every_line_ending_gives_the_same_events(eol: bytes) -> None:
    stream = eol.join([b"data: a", b"data:b", b"", b": note", b"data: c", b"", b""])
    events, pending = parse_all(stream)
    assert [e.data for e in events] == [b"a\nb", b"c"]
    assert events[1].comments == (b"note",)
    assert events[0].raw == b"data: a" + eol + b"data:b" + eol + eol
    assert not pending


def test_field_rules() -> None:
    stream = (
        b"data:no space\n\n"
        b"data:  two spaces\n\n"
        b"data\n\n"
        b"event: update\nid: 7\nretry: 100\nfoo: bar\ndata: x\n\n"
        b":comment without space\n\n"
        b"\n\n\n"
        b"data: last\n\n"
    )
    events, _ = parse_all(stream)
    assert [e.data for e in events] == [b"no space", b" two spaces", b"", b"x", b"", b"last"]
    assert events[3].event == "update"
    assert events[3].raw == b"event: update\nid: 7\nretry: 100\nfoo: bar\ndata: x\n\n"
    assert events[4].comments == (b"comment without space",)
    # Blank lines between events belong to no event.
    assert events[5].raw == b"data: last\n\n"


def test_unterminated_event_is_discarded_and_reported_pending() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: done\n\ndata: cut") == [
        SSEEvent(b"done", None, (), b"data: done\n\n")
    ]
    assert parser.pending
    assert parser.close() == []
    assert parser.pending
    with pytest.raises(SSEError, match="after close"):
        parser.feed(b"\n\n")


def test_event_lines_without_blank_line_are_pending() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: x\n") == []
    assert parser.pending
    assert parser.close() == []


def test_trailing_cr_waits_for_a_possible_lf() -> None:
    parser = SSEParser()
    # The second "\r" may be the start of "\r\n": the event is held back until the next byte.
    assert parser.feed(b"data: x\r\r") == []
    assert [e.raw for e in parser.feed(b"\ndata: y\r\r")] == [b"data: x\r\r\n"]
    # At the end of the stream a held-back "\r" is a complete blank line.
    assert [e.data for e in parser.close()] == [b"y"]
    assert not parser.pending


def test_lone_trailing_cr_is_not_pending() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: x\n\n\r") != []
    assert not parser.pending


def test_byte_order_mark_is_dropped_even_when_split() -> None:
    events, _ = parse_all(b"\xef\xbb\xbfdata: x\n\n", [1, 2])
    assert events == [SSEEvent(b"x", None, (), b"data: x\n\n")]
    parser = SSEParser()
    assert parser.feed(b"\xef\xbb") == []
    assert parser.close() == []
    assert not parser.pending


def test_multibyte_utf8_split_inside_a_character() -> None:
    stream = "data: héllo ✓\n\n".encode()
    for cut in range(1, len(stream)):
        events, _ = parse_all(stream, [cut])
        assert [e.data.decode() for e in events] == ["héllo ✓"]


def test_max_event_size() -> None:
    with pytest.raises(SSEError, match="larger than 16"):
        SSEParser(max_event_size=16).feed(b"data: 0123456789abcdef")  # unfinished, already too big
    with pytest.raises(SSEError, match="larger than 16"):
        SSEParser(max_event_size=16).feed(b"data: 0123456789abcdef\n\n")  # complete, too big
    parser = SSEParser(max_event_size=16)
    # Many small events in one chunk are fine: the limit is per event.
    assert len(parser.feed(b"data: 12345678\n\n" * 100)) == 100
    with pytest.raises(ValueError, match="positive"):
        SSEParser(max_event_size=0)


def test_encode_event_round_trips() -> None:
    for data in (b"{}", b"a\nb", b"", b'{"x":\n1}'):
        events, pending = parse_all(encode_event(data))
        assert [e.data for e in events] == [data]
        assert not pending


_LINE = st.one_of(
    st.builds(
        lambda v: b"data: " + v,
        st.binary(max_size=12).filter(lambda b: b"\r" not in b and b"\n" not in b),
    ),
    st.sampled_from([b"", b": c", b"event: e", b"id: 1", b"data", b"retry: 5", "data: é".encode()]),
)


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(_LINE, max_size=30),
    eols=st.lists(st.sampled_from([b"\n", b"\r\n", b"\r"]), min_size=30, max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_any_split_of_a_well_formed_stream_gives_identical_events(
    lines: list[bytes], eols: list[bytes], cuts: list[int]
) -> None:
    stream = b"".join(line + eol for line, eol in zip(lines, eols, strict=False))
    whole = parse_all(stream)
    assert parse_all(stream, [c for c in cuts if c <= len(stream)]) == whole
    assert parse_all(stream, list(range(1, len(stream)))) == whole  # one byte at a time


@settings(max_examples=300, deadline=None)
@given(stream=st.binary(max_size=300), cuts=st.lists(st.integers(0, 300), max_size=10))
def test_any_split_of_arbitrary_bytes_gives_identical_events(
    stream: bytes, cuts: list[int]
) -> None:
    whole = parse_all(stream)
    assert parse_all(stream, [c for c in cuts if c <= len(stream)]) == whole
    # Whatever the bytes, the raws of the events are exactly a subsequence of the input.
    assert all(e.raw in stream for e in whole[0])


class GeneralRulesOnly(SSEParser):
    """The parser without its fast path for ``data: ...\\n\\n`` events: the reference."""

    def _simple_events(self, events: list[SSEEvent]) -> None:
        return None


_PIECE = st.sampled_from(
    [
        b'data: {"a":1}\n\n',
        b"data: x\n\n",
        b"data: \n\n",
        b"data:x\n\n",
        b": c\n",
        b"\r\n",
        b"data: a\r\n\r\n",
        b"data: y\ndata: z\n\n",
        b"event: e\n",
        b"\n",
        b"data: \xc3\xa9\n\n",
        b"data: [DONE]\n\n",
        b"data: q\r",
        b"\n\n\n",
    ]
)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(_PIECE, max_size=25), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_fast_path_gives_the_events_of_the_general_rules(
    pieces: list[bytes], cuts: list[int]
) -> None:
    stream = b"".join(pieces)
    cut_at = sorted(c for c in cuts if c <= len(stream))
    for feed_at in (cut_at, list(range(1, len(stream)))):
        fast, slow = SSEParser(), GeneralRulesOnly()
        got: list[SSEEvent] = []
        want: list[SSEEvent] = []
        start = 0
        for cut in [*feed_at, len(stream)]:
            got += fast.feed(stream[start:cut])
            want += slow.feed(stream[start:cut])
            start = cut
        assert got + fast.close() == want + slow.close()
        assert fast.pending == slow.pending
