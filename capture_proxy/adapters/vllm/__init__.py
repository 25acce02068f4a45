"""The vLLM dialect: what to ask vLLM for, and how to read its answers.

`VLLMAdapter.plan` adds the token fields capture needs to a request (`ForwardPlan`);
`parse_response` reads a unary answer and `stream` returns a sans-IO `StreamAccumulator` fed with
SSE bytes. Both yield a `Completion` (token ids, logprobs, message) and the bytes the client sees.
"""

from __future__ import annotations

from ._adapter import (
    CaptureExtractionError,
    ClientWants,
    Completion,
    ForwardPlan,
    ReasoningField,
    StreamAccumulator,
    UpstreamProtocolError,
    VLLMAdapter,
    parse_error_body,
)

__all__ = [
    "CaptureExtractionError",
    "ClientWants",
    "Completion",
    "ForwardPlan",
    "ReasoningField",
    "StreamAccumulator",
    "UpstreamProtocolError",
    "VLLMAdapter",
    "parse_error_body",
]
