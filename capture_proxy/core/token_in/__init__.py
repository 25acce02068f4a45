"""Token-in: the exact prompt for a call that continues the previous one, and its answer.

In token-in mode the proxy sends vLLM token ids instead of messages. For a call whose messages
are the previous staged call's messages, the answer the client replayed, and new messages after
it (tool results, a user message), the prompt is that call's **exact prompt ids + completion
ids**, then the tokens that close the model's turn, then the template's tokens for the appended
messages and the generation prompt. The model then sees its own sampled tokens, never the
template's re-rendering of them (Qwen3-style templates drop earlier reasoning, clients
re-serialize tool arguments, whitespace moves); docs/token-in.md explains it for users.

Every piece of token-in lives here; the vLLM wire formats it speaks are in
`capture_proxy.adapters.vllm`. **The entry**: the exchange (`capture_proxy.core.exchange`) holds
one `TokenInCall` per token-in call and calls its steps (``post``, ``finish`` or ``relay``,
``facts``, ``continued_by_next``); the pipeline keeps what calls share (`CloseRenders`,
`PromptJson`), the gate before admission (`goes_token_in`, `check_scale_out`), and the metrics'
`TokenInReport`. Underneath, by module:

- ``_flow``: `TokenInCall`, the call's steps against vLLM's render, generate and derender routes.
- ``_bridging``: `token_in_prompt`, the renders sent for one call and the prompt assembled from
  them; ``_renders`` which of a plan's renders one call sends and how their answers are read;
  ``_prompt`` the result (`TokenInPrompt`); ``_caches`` what is learnt once; ``_steady`` a
  steady call's appended tokens read from the request's own render, without the plan's renders.
- ``_beside``: generate's request built without the request's own render, and the check that
  render then makes of it (``--token-in-beside``).
- ``_derender``: `StreamedDerender`, a generate stream derendered for the client.
- ``_scale_out``, ``_report``: the scale-out routes check; what a call reports to the metrics.

The bridge itself is pure decision and arithmetic, without I/O (``_match``, ``_plan``,
``_assemble``, ``_media``, ``_values``); the flow asks vLLM's render route for the bodies a plan
lists. In order:

1. `match(prior, request)`: an `Extension`, or a `NotBridged` saying why not (`BREAK_REASONS`): the
   call then goes the plain way and starts a new trajectory segment.
2. `plan(request, extension)`: a `BridgePlan`, the render bodies to send (`requests()`): two
   for the turn close, cacheable under ``close_key``; two more when the replayed answer has tool
   calls; two for the appended messages. They are independent: send them at once. Once a pair
   of a kind has shown where its dummy content ends, the flow may send only its first render
   and give `assemble` what follows that point (`AfterContent`).
3. `assemble(prior, plan, BridgeRenders.from_answers(...))`: a `Bridged` prompt with its
   ``bridge_spans`` (the tokens the proxy inserted, for the record), or a `NotBridged`.
   Its ``media`` are the prompt's images (the previous call's, then the appended messages');
   `bridged_features(media, the request's render's features)` gives generate's ``features``.
4. `divergence(bridged, plain)`: where the plain rendering would have differed (what token-in
   avoided), or None.
"""

from ._assemble import END_OF_TURN_ADDED, TURN_CLOSE, assemble, common_suffix, divergence
from ._bridging import token_in_prompt
from ._caches import CloseRenders, PromptJson
from ._derender import StreamedDerender, post_derender
from ._flow import TokenInCall
from ._match import TEMPLATE_KEYS, match
from ._media import MediaItem, bridged_features, media_items, media_parts, suffix_media
from ._plan import DUMMY_CONTENTS, plan
from ._prompt import RenderRefused, TokenInPrompt, token_in_line
from ._report import EXTENDED, NEW_SEGMENT, TokenInReport
from ._scale_out import (
    SCALE_OUT_MISSING,
    ScaleOutMissing,
    check_scale_out,
    goes_token_in,
    require_scale_out,
    rollout_conflict,
)
from ._values import (
    BREAK_REASONS,
    AfterContent,
    Bridged,
    BridgePlan,
    BridgeRenders,
    Extension,
    NotBridged,
    Prior,
)

__all__ = [
    "BREAK_REASONS",
    "DUMMY_CONTENTS",
    "END_OF_TURN_ADDED",
    "EXTENDED",
    "NEW_SEGMENT",
    "SCALE_OUT_MISSING",
    "TEMPLATE_KEYS",
    "TURN_CLOSE",
    "AfterContent",
    "BridgePlan",
    "BridgeRenders",
    "Bridged",
    "CloseRenders",
    "Extension",
    "MediaItem",
    "NotBridged",
    "Prior",
    "PromptJson",
    "RenderRefused",
    "ScaleOutMissing",
    "StreamedDerender",
    "TokenInCall",
    "TokenInPrompt",
    "TokenInReport",
    "assemble",
    "bridged_features",
    "check_scale_out",
    "common_suffix",
    "divergence",
    "goes_token_in",
    "match",
    "media_items",
    "media_parts",
    "plan",
    "post_derender",
    "require_scale_out",
    "rollout_conflict",
    "suffix_media",
    "token_in_line",
    "token_in_prompt",
]
