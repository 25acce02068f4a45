"""Which renders reveal the template's tokens for an extension (`plan`).

The bridge never assumes the template is append-only (Qwen3's drops earlier reasoning once a new
user message arrives). It renders a small dummy conversation instead of the real history:

    D(v) = [the request's leading system message, if any; user "u"; assistant with content v]

with the request's tools and template keys, for two one-token contents `DUMMY_CONTENTS`. Two
renders that differ only in v share every token after it, so their common suffix is exactly what
the template writes after an assistant turn's content:

- ``close``: D(v1), D(v2) without a generation prompt: the common suffix is the turn close
  (ChatML: ``<|im_end|>`` then ``"\\n"``). It depends only on the model, the system message, the
  tools and the template keys, so the plan names a cache key for it.
- ``turn``, only when the replayed answer has tool calls: D(v) with those tool calls on the
  dummy assistant (as replayed, ids included), without a generation prompt: the common suffix is
  the template's tool calls and the close of such a turn. Templates that render a tool result
  from the assistant turn before it (its call's name or id) or refuse a tool result after a turn
  without tool calls then render the appended messages as they would after the real answer.
- ``suffix``: the dummy (with the tool calls, if any) + the appended messages, with the
  request's generation prompt: the common suffix is the ``turn`` (or ``close``) suffix, then the
  appended messages as the template renders them after that turn, then the generation prompt.

The dummy assistant never has reasoning: its turn close is the plain one. A *lean* plan leaves the
system message and the tools out of the ``turn`` and ``suffix`` dummies (not the ``close``):
their renders are then a few hundred tokens instead of the agent's whole system prompt and tools.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

from ._match import TEMPLATE_KEYS
from ._values import BridgePlan, Extension

__all__ = ["DUMMY_CONTENTS", "plan"]

#: The two assistant contents of the dummy conversation: each a single token in common
#: tokenizers, different from each other, and unlike any template's own text.
DUMMY_CONTENTS = ("A", "B")

_PER_RENDER = ("add_generation_prompt", "continue_final_message")


def plan(request: Mapping[str, Any], extension: Extension, *, lean: bool = False) -> BridgePlan:
    """The render requests (vLLM's ``/v1/chat/completions/render`` bodies) for `extension`.

    `lean`: the ``turn`` and ``suffix`` dummies without the leading system message and the
    tools (an agent's system prompt and tools are most of a render's tokens); the ``close``
    pair keeps them. What a lean plan gives must be checked against the request's own
    rendering (the flow does: docs/token-in.md, "Lean dummies")."""
    base: dict[str, Any] = {k: request[k] for k in TEMPLATE_KEYS if request.get(k) is not None}
    if request.get("tools"):
        base["tools"] = request["tools"]
    messages = request.get("messages") or []
    lead: list[Mapping[str, Any]] = []
    if messages and messages[0].get("role") == "system":
        lead.append(messages[0])
    generation = request.get("add_generation_prompt", True) is not False

    calls = extension.replayed.get("tool_calls") or []

    def dummy(v: str, with_calls: bool, context: bool) -> list[Mapping[str, Any]]:
        assistant: dict[str, Any] = {"role": "assistant", "content": v}
        if with_calls:
            assistant["tool_calls"] = calls
        return [*(lead if context else ()), {"role": "user", "content": "u"}, assistant]

    def body(
        v: str,
        appended: tuple[Mapping[str, Any], ...],
        gen: bool,
        with_calls: bool = False,
        context: bool = not lean,
    ) -> dict[str, Any]:
        keys = base if context else {k: x for k, x in base.items() if k != "tools"}
        out = {**keys, "messages": [*dummy(v, with_calls, context), *appended]}
        # vLLM's defaults (a generation prompt, no continued message) go unsaid: fewer bytes.
        out.pop("continue_final_message", None)
        if gen:
            out.pop("add_generation_prompt", None)
        else:
            out["add_generation_prompt"] = False
        return out

    v1, v2 = DUMMY_CONTENTS
    # The two generation keys are set per render, so they are no part of what the close depends on.
    fixed = {k: v for k, v in base.items() if k not in _PER_RENDER}
    key_source = {"lead": lead, **fixed}
    close_key = hashlib.sha256(orjson.dumps(key_source, option=orjson.OPT_SORT_KEYS)).hexdigest()
    appended, tc = extension.appended, bool(calls)
    return BridgePlan(
        extension=extension,
        close_key=close_key,
        close=(body(v1, (), False, context=True), body(v2, (), False, context=True)),
        suffix=(body(v1, appended, generation, tc), body(v2, appended, generation, tc)),
        turn=(body(v1, (), False, True), body(v2, (), False, True)) if tc else None,
        lean=lean,
    )
