"""The proxy on uvloop: the tests imported here run a second time with uvloop as the event loop
(this folder's conftest), so the paths that touch the transport directly (the connection gate's
cap and its unread-answer deadline, streams, the stage round trip) behave the same on both loops.
`tests/test_cli_serve.py` runs the real ``serve`` process on each loop."""

from __future__ import annotations

import asyncio

from capture_proxy.server.event_loop import loop_name
from tests.server.test_proxy_chat import (
    test_stream_relays_chunks_then_status_comment_then_done as test_stream_on_uvloop,
)
from tests.server.test_proxy_chat import (
    test_unary_call_is_staged_exactly_and_client_sees_plain_openai as test_unary_on_uvloop,
)
from tests.server.test_slow_clients import (
    test_a_connection_over_the_cap_gets_503_with_retry_after as test_cap_on_uvloop,
)
from tests.server.test_slow_clients import (
    test_a_stream_whose_client_stops_reading_is_cut_and_recorded_as_stalled as test_stall_on_uvloop,
)
from tests.server.test_slow_clients import (
    test_an_unread_answer_does_not_hold_its_connection_forever as test_unread_on_uvloop,
)

__all__ = [
    "test_cap_on_uvloop",
    "test_stall_on_uvloop",
    "test_stream_on_uvloop",
    "test_unary_on_uvloop",
    "test_unread_on_uvloop",
]


async def test_the_tests_here_run_on_uvloop() -> None:
    assert loop_name(asyncio.get_running_loop()) == "uvloop"
