"""Faults the fake vLLM can inject into one answer (attach one to a `Turn`).

Each constructor documents what a client sees. "Chunks" are the stream's ``data:`` events counted
from the first (the role chunk is chunk 1); a non-streaming answer applies the fault to its body.

Example::

    fake.push(Turn("partial answer", fault=Fault.reset_after(3)))
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = ["Fault", "FaultKind"]


class FaultKind(StrEnum):
    HTTP_ERROR = "http_error"
    DELAY_FIRST_BYTE = "delay_first_byte"
    RESET_AFTER = "reset_after"
    MALFORMED_SSE = "malformed_sse"
    TRUNCATE_AFTER = "truncate_after"
    DROP_TOKEN_IDS = "drop_token_ids"
    USAGE_MISMATCH = "usage_mismatch"
    HANG = "hang"
    ERROR_EVENT = "error_event"


@dataclass(frozen=True)
class Fault:
    """One injected failure; build it with the class methods, not the constructor."""

    kind: FaultKind
    status: int = 500
    body: Any = None
    seconds: float = 0.0
    n_chunks: int = 0
    every: int | None = None
    message: str = ""

    @classmethod
    def http_error(cls, status: int, body: Any = None) -> Fault:
        """Answer ``status`` at once with ``body`` (a dict is sent as JSON, str/bytes as is).

        Without a body, vLLM's error shape ``{"error": {"message", "type", "param", "code"}}``.
        """
        return cls(FaultKind.HTTP_ERROR, status=status, body=body)

    @classmethod
    def delay_first_byte(cls, seconds: float) -> Fault:
        """Wait ``seconds`` before the status line; the answer is otherwise normal."""
        return cls(FaultKind.DELAY_FIRST_BYTE, seconds=seconds)

    @classmethod
    def reset_after(cls, n_chunks: int) -> Fault:
        """Abort the TCP connection after ``n_chunks`` stream events (non-streaming: no body)."""
        return cls(FaultKind.RESET_AFTER, n_chunks=n_chunks)

    @classmethod
    def malformed_sse(cls, after: int) -> Fault:
        """After ``after`` events, send one ``data:`` event that is not JSON, then carry on.

        Non-streaming: a 200 whose body is cut in the middle of the JSON.
        """
        return cls(FaultKind.MALFORMED_SSE, n_chunks=after)

    @classmethod
    def truncate_after(cls, n_chunks: int) -> Fault:
        """End the response cleanly after ``n_chunks`` events: no finish chunk, no ``[DONE]``.

        Non-streaming: a complete HTTP response whose JSON body stops halfway.
        """
        return cls(FaultKind.TRUNCATE_AFTER, n_chunks=n_chunks)

    @classmethod
    def drop_token_ids(cls, every: int | None = None) -> Fault:
        """Lose token ids although they were asked for.

        ``every=None``: ``prompt_token_ids`` and every ``token_ids`` are null. ``every=k``: every
        k-th generated token's stream chunk is not sent at all (as with vLLM #27482's tool parser;
        the finish chunk is always sent),
        non-streaming: every k-th id and its logprob are left out of the choice.
        """
        return cls(FaultKind.DROP_TOKEN_IDS, every=every)

    @classmethod
    def usage_mismatch(cls) -> Fault:
        """Report one completion token more in ``usage`` than were generated."""
        return cls(FaultKind.USAGE_MISMATCH)

    @classmethod
    def hang(cls) -> Fault:
        """Never answer; the generation counts as aborted once the client goes away."""
        return cls(FaultKind.HANG)

    @classmethod
    def error_event(
        cls, after: int = 1, message: str = "engine failure (injected)", status: int = 500
    ) -> Fault:
        """After ``after`` events send vLLM's mid-stream error event, then ``data: [DONE]``.

        The event is ``data: {"error": {"message", "type", "param", "code"}}`` (vLLM writes it with
        ``json.dumps``, spaces included). Non-streaming: an HTTP ``status`` with that error body.
        """
        return cls(FaultKind.ERROR_EVENT, n_chunks=after, message=message, status=status)
