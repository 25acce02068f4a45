"""The vLLM dialect: what to ask vLLM for, and how to read its answers.

`VLLMAdapter.plan` adds the token fields capture needs to a request (`ForwardPlan`);
`parse_response` reads a unary answer and `stream` returns a sans-IO `StreamAccumulator` fed with
SSE bytes. Both yield a `Completion` (token ids, logprobs, message) and the bytes the client sees.
The token-in routes (render, generate, derender) are read and written by `_token_in`'s parsers;
`_derendered` shapes a token-in answer for the client by the same relay rules, and
`_stream_logprobs` resolves a streamed one's logprobs.
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
from ._derendered import Derendered, DerenderedStream, client_answer, read_derendered
from ._ids_json import encode_ids, extend_ids_json
from ._stream_logprobs import StreamLogprobs
from ._token_in import (
    DerenderCoalescer,
    Generated,
    GenerateEvent,
    GenerateStream,
    Rendered,
    WeightSpan,
    derender_body,
    derender_chunk_body,
    derender_tail,
    merge_chunks,
    read_derender,
    read_generate,
    read_render,
    read_render_pair,
    to_completion,
)

__all__ = [
    "CaptureExtractionError",
    "ClientWants",
    "Completion",
    "DerenderCoalescer",
    "Derendered",
    "DerenderedStream",
    "ForwardPlan",
    "GenerateEvent",
    "GenerateStream",
    "Generated",
    "ReasoningField",
    "Rendered",
    "StreamAccumulator",
    "StreamLogprobs",
    "UpstreamProtocolError",
    "VLLMAdapter",
    "WeightSpan",
    "client_answer",
    "derender_body",
    "derender_chunk_body",
    "derender_tail",
    "encode_ids",
    "extend_ids_json",
    "merge_chunks",
    "parse_error_body",
    "read_derender",
    "read_derendered",
    "read_generate",
    "read_render",
    "read_render_pair",
    "to_completion",
]
