"""Does a new request extend the previous call? (`match`)

A request extends the previous staged call when it renders the same way up to the answer the
model gave, and adds messages after it:

- the same tools (absent, null and ``[]`` are the same) and the same template keys
  (`TEMPLATE_KEYS`; absent or null is the key's default, ``{}`` the same as no
  ``chat_template_kwargs``);
- its messages start with the previous call's messages, each the same;
- the next message is the previous call's answer, replayed: an assistant message whose content
  is the same text (null and ``""`` are the same; a list of text parts counts as their joined
  text), whose reasoning is the same or omitted, and whose tool calls have the same names and the
  same *parsed* JSON arguments (clients re-serialize them), compared in the canonical form the
  record's digest uses (`capture_proxy.schemas.digest.encode_value`: ``true`` is not ``1``, ``1.0``
  is not ``1``, an object with a key twice is text), call ids kept or not;
- at least one message follows, and none of those is an assistant's;
- the images of the earlier messages (content parts other than text) are the previous call's,
  whose placeholders it kept (`Prior.media`), and the leading system message has none. The
  appended messages' images are bridged when the renders place them (`_assemble`).

A previous call read back from the store (`Prior.stored`) has its request as its record keeps
it, each image an ``attachment:sha256:`` reference: its messages are compared with the request
as staged (the same references), and its placeholders are the record's (`media_of`).

Otherwise the answer is a `NotBridged` whose detail names the first difference found, checked in the
order of the list above.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ...schemas.digest import EncodingError, encode_value
from ._media import media_parts
from ._values import Extension, NotBridged, Prior

__all__ = ["TEMPLATE_KEYS", "match"]

#: Request keys that change how vLLM renders the messages into tokens (besides ``messages`` and
#: ``tools``). ``tool_choice`` is here because vLLM leaves the tools out of the prompt for
#: ``"none"``; ``reasoning_effort`` because some templates (gpt-oss) render it.
TEMPLATE_KEYS = (
    "model",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "mm_processor_kwargs",
    "reasoning_effort",
    "tool_choice",
)


def match(
    prior: Prior | None,
    request: Mapping[str, Any],
    staged: Mapping[str, Any] | None = None,
    fingerprint: str | None = None,
) -> Extension | NotBridged:
    """Whether `request` (normalized as `prior.request` was) extends `prior` (module docs).
    `staged` is the request as staged (images by reference), which a stored prior's earlier
    messages are compared with; the request's own when not given. `fingerprint` is the
    upstream's tokenizer fingerprint now (None: not checked): another than the prior's is
    ``tokenizer_changed``, one of them unknown ("") included."""
    if prior is None:
        return NotBridged("no_prior", "the rollout has no staged call to continue")
    if fingerprint is not None and fingerprint != prior.fingerprint:
        return NotBridged(
            "tokenizer_changed",
            f"the upstream's tokenizer fingerprint is {fingerprint or 'unknown'}, the previous "
            f"call was staged under {prior.fingerprint or 'an unknown one'}",
        )
    if (prior.request.get("tools") or []) != (request.get("tools") or []):
        return NotBridged("tools_changed", "the tool list differs from the previous call's")
    for key in TEMPLATE_KEYS:
        if _template_value(prior.request, key) != _template_value(request, key):
            return NotBridged("template_changed", f"`{key}` differs from the previous call's")
    before: Sequence[Mapping[str, Any]] = prior.request.get("messages") or []
    messages: Sequence[Mapping[str, Any]] = request.get("messages") or []
    earlier = messages
    if prior.stored and staged is not None:
        earlier = staged.get("messages") or []
    for i, old in enumerate(before):
        if i >= len(earlier):
            return NotBridged(
                "history_edited",
                f"the request has {len(earlier)} messages, fewer than the previous call's "
                f"{len(before)}",
            )
        difference = _message_difference(old, earlier[i])
        if difference:
            return NotBridged("history_edited", f"message {i}: {difference}")
    n = len(before)
    if n >= len(messages):
        return NotBridged("reply_mismatch", f"message {n}: the previous answer was not replayed")
    difference = _message_difference({"role": "assistant", **prior.message}, messages[n])
    if difference:
        return NotBridged("reply_mismatch", f"message {n}: {difference}")
    appended = tuple(messages[n + 1 :])
    if not appended:
        return NotBridged("nothing_appended", "no message follows the replayed answer")
    for i, message in enumerate(appended, start=n + 1):
        if message.get("role") == "assistant":
            return NotBridged("assistant_appended", f"message {i} is an assistant message")
    history = media_parts(messages[: n + 1])
    known = prior.media
    if history and known is None and prior.stored:
        return NotBridged(
            "media_not_recorded",
            f"{history} images in the earlier messages, and the previous call's record (read "
            "back from the store) keeps no image placeholders (`token_in_media`): written "
            "before records kept them, more than the proxy keeps, or unreadable",
        )
    if history and (known is None or len(known) != history):
        return NotBridged(
            "multimodal_history",
            f"{history} images in the earlier messages, and the previous call's image "
            "placeholders are not known",
        )
    if messages and messages[0].get("role") == "system" and media_parts(messages[:1]):
        # The bridge's dummy renders start with it: their images would not all be appended.
        return NotBridged("multimodal_history", "the system message has an image")
    return Extension(prior, request, messages[n], appended)


#: What vLLM takes for a template key the request leaves absent or null (`tool_choice`: "auto"
#: with tools, "none" without; the tools are the same when this is asked).
_DEFAULTS: dict[str, Any] = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "add_special_tokens": False,
}


def _template_value(request: Mapping[str, Any], key: str) -> Any:
    value = request.get(key)
    if value is None:
        if key == "tool_choice":
            return "auto" if request.get("tools") else "none"
        return _DEFAULTS.get(key)
    if key == "chat_template_kwargs" and value == {}:
        return None
    return value


def _message_difference(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """The first field in which two messages differ, as words (None: the same message)."""
    if old == new:
        return None  # the common case, compared in C: a history replayed as it was sent
    if old.get("role") != new.get("role"):
        return f"role {new.get('role')!r} where {old.get('role')!r} was"
    if old.get("role") != "assistant":
        for key in sorted(old.keys() | new.keys()):
            if old.get(key) != new.get(key):
                return f"`{key}` differs"
        return None
    if _text(old.get("content")) != _text(new.get("content")):
        return "assistant `content` differs"
    had, replayed = _reasoning(old), _reasoning(new)
    if replayed and replayed != had:
        return "assistant `reasoning_content` differs"
    old_calls: Sequence[Any] = old.get("tool_calls") or []
    new_calls: Sequence[Any] = new.get("tool_calls") or []
    if len(old_calls) != len(new_calls):
        return f"{len(new_calls)} tool calls where {len(old_calls)} were"
    for j, (a, b) in enumerate(zip(old_calls, new_calls, strict=True)):
        fa, fb = _function(a), _function(b)
        if fa.get("name") != fb.get("name"):
            return f"tool call {j}: name {fb.get('name')!r} where {fa.get('name')!r} was"
        if _arguments(fa.get("arguments")) != _arguments(fb.get("arguments")):
            return f"tool call {j}: arguments differ"
    return None


def _text(content: Any) -> Any:
    """Content as the template sees its text: null is "", a list of text parts is their text."""
    if content is None:
        return ""
    if isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" for p in content
    ):
        return "".join(str(p.get("text", "")) for p in content)
    return content


def _reasoning(message: Mapping[str, Any]) -> Any:
    return message.get("reasoning_content") or message.get("reasoning") or None


def _function(call: Any) -> Mapping[str, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    return fn if isinstance(fn, Mapping) else {}


class _DuplicateKey(ValueError):
    """An object names a key twice: its parse would keep only the last value."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _DuplicateKey
    return out


def _arguments(arguments: Any) -> tuple[str, Any]:
    """Arguments compared by meaning, as the digest tells values apart: a JSON string parsed and
    canonically encoded (`encode_value`: ``true``, ``1`` and ``1.0`` differ); one that does not
    parse, names a key twice or has no canonical encoding is compared as its text. Python's own
    equality would take ``{"n": true}`` or ``{"n": 1.0}`` for the model's ``{"n": 1}``, and the
    staged request would keep arguments the model did not write."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, object_pairs_hook=_unique)
        except ValueError:
            return ("text", arguments)
    try:
        return ("json", encode_value(arguments))
    except EncodingError:
        return ("text", json.dumps(arguments, sort_keys=True, default=repr))
