"""The vLLM dialect: what to ask vLLM for, and how to read its answers.

`VLLMAdapter.plan` adds the token fields capture needs to a request (`ForwardPlan`);
`parse_response` reads a unary answer and `stream` returns a sans-IO `StreamAccumulator` fed with
SSE bytes. Both yield a `Completion` (token ids, logprobs, message) and the bytes the client sees.
The token-in routes are read and written by `_render`, `_generate` and `_derender`;
`_derendered` shapes a token-in answer for the client by the same relay rules (`_chat_route`:
what the chat route does that derender does not), and
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
from ._chat_route import (
    REASONING_MARKERS,
    StopCut,
    StopTokenStrip,
    chat_finish_reason,
    count_reasoning_tokens,
    counts_reasoning_from_start,
    without_stop_token_id,
)
from ._derender import (
    SEED_IDS,
    DerenderCoalescer,
    derender_body,
    derender_chat_request,
    derender_chunk_body,
    derender_generate_answer,
    derender_prompt_start,
    derender_tail,
    merge_chunks,
    read_derender,
    to_completion,
    usage_chunk,
)
from ._derendered import Derendered, DerenderedStream, client_answer, read_derendered
from ._generate import Generated, GenerateEvent, GenerateStream, WeightSpan, read_generate
from ._ids_json import encode_ids, extend_ids_json
from ._render import Rendered, pair_anchor, read_anchored, read_render, read_render_pair
from ._stream_logprobs import StreamLogprobs

__all__ = [
    "REASONING_MARKERS",
    "SEED_IDS",
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
    "StopCut",
    "StopTokenStrip",
    "StreamAccumulator",
    "StreamLogprobs",
    "UpstreamProtocolError",
    "VLLMAdapter",
    "WeightSpan",
    "chat_finish_reason",
    "client_answer",
    "count_reasoning_tokens",
    "counts_reasoning_from_start",
    "derender_body",
    "derender_chat_request",
    "derender_chunk_body",
    "derender_generate_answer",
    "derender_prompt_start",
    "derender_tail",
    "encode_ids",
    "extend_ids_json",
    "merge_chunks",
    "pair_anchor",
    "parse_error_body",
    "read_anchored",
    "read_derender",
    "read_derendered",
    "read_generate",
    "read_render",
    "read_render_pair",
    "to_completion",
    "usage_chunk",
    "without_stop_token_id",
]
