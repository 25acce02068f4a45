"""A vLLM 0.32 non-streamed answer read in one typed pass, and the client's copy built from it.

The generic path (`vllm.VLLMAdapter.parse_response`) decodes an answer's top level into raw
values, then its choices, then each field it needs: some 200 KB of JSON are scanned three times.
When the answer has exactly vLLM 0.32's keys (``chat-response.json``), `read_answer` decodes it
once into Structs that keep every relayed value raw (its exact bytes) and type only what capture
reads (logprobs, completion token ids), and builds the client's body from those raw values by the
same rules. Any other key, several choices, an answer without ``token_ids``, or a client that
asked for logprobs or token ids (whose bytes must be relayed as they came) returns None, and the
generic path runs. The client's body is then the generic path's bytes, in vLLM 0.32's key order.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from msgspec import UNSET, Raw, UnsetType

from ._wire import NULL, NULL_DROPPED_FIELDS, ClientWants, Logprobs, RawDict, encode, is_null

__all__ = ["FastAnswer", "read_answer"]


class _Choice(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    index: Raw | UnsetType = UNSET
    message: Raw | UnsetType = UNSET
    logprobs: Logprobs | UnsetType | None = UNSET
    finish_reason: Raw | UnsetType = UNSET
    stop_reason: Raw | UnsetType = UNSET
    token_ids: list[int] | UnsetType | None = UNSET
    routed_experts: Raw | UnsetType = UNSET


class _Answer(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    id: Raw | UnsetType = UNSET
    object: Raw | UnsetType = UNSET
    created: Raw | UnsetType = UNSET
    model: Raw | UnsetType = UNSET
    choices: list[_Choice] | UnsetType = UNSET
    service_tier: Raw | UnsetType = UNSET
    system_fingerprint: Raw | UnsetType = UNSET
    usage: Raw | UnsetType = UNSET
    prompt_logprobs: Raw | UnsetType = UNSET
    prompt_token_ids: Raw | UnsetType = UNSET
    prompt_text: Raw | UnsetType = UNSET
    kv_transfer_params: Raw | UnsetType = UNSET
    ec_transfer_params: Raw | UnsetType = UNSET
    metrics: Raw | UnsetType = UNSET


_decode_answer = msgspec.json.Decoder(_Answer).decode
_TOP = _Answer.__struct_fields__
_CHOICE = _Choice.__struct_fields__
#: Choice values capture reads typed; the client never gets them as sent (see `read_answer`).
_TYPED = ("logprobs", "token_ids")
_NOT_FOR_CLIENT = ("token_ids", "routed_experts")


_PROMPT_KEY = b'"prompt_token_ids":['
#: Stands in for the cut-out prompt ids: a JSON string no vLLM value is.
_PLACEHOLDER = b'"\\u0000prompt_token_ids"'


def _cut_prompt(raw: bytes) -> tuple[bytes | None, bytes]:
    """``(the prompt ids' bytes, the answer with a placeholder in their place)``.

    The ids are some 110 KB of a 200 KB answer, and `decode_prompt` reads them by comparing
    bytes: scanning them as JSON here first would cost more than everything else. The key holds
    no escape, so it cannot sit inside a string; ints hold no ``]``, so the first one after
    ``[`` ends the array (anything else in it fails in `decode_prompt`, as a full decode would).
    """
    at = raw.rfind(_PROMPT_KEY)
    if at < 0 or _PLACEHOLDER in raw:  # an upstream that sends the placeholder is not cut
        return None, raw
    start = at + len(_PROMPT_KEY) - 1
    end = raw.find(b"]", start)
    if end < 0:
        return None, raw
    return raw[start : end + 1], raw[:start] + _PLACEHOLDER + raw[end + 1 :]


@dataclass(frozen=True, slots=True)
class FastAnswer:
    """What `read_answer` found: raw values for the extraction, typed token data, client bytes."""

    top: RawDict  # every top-level value but ``choices``
    choice: RawDict  # the one choice's values but logprobs and token ids
    logprobs: Logprobs | None
    token_ids: list[int]
    client_body: bytes


def read_answer(raw: bytes, wants: ClientWants) -> FastAnswer | None:
    """One pass over a vLLM 0.32 answer, or None when the generic path must read it."""
    if wants.logprobs or wants.token_ids:
        return None
    prompt, rest = _cut_prompt(raw)
    try:
        answer = _decode_answer(rest)
    except msgspec.DecodeError:
        return None  # malformed, or another shape: the generic path says which
    if prompt is not None:
        # The cut was the top-level value only if that is where the placeholder landed.
        if isinstance(answer.prompt_token_ids, UnsetType) or bytes(answer.prompt_token_ids) != (
            _PLACEHOLDER
        ):
            return None
        answer.prompt_token_ids = Raw(prompt)
    choices = answer.choices
    if isinstance(choices, UnsetType) or len(choices) != 1:
        return None
    choice = choices[0]
    token_ids = choice.token_ids
    if isinstance(token_ids, UnsetType) or token_ids is None:
        return None  # the "token_id:N" fallback needs the logprob tokens: generic path
    logprobs = None if isinstance(choice.logprobs, UnsetType) else choice.logprobs
    client_choice: dict[str, Raw] = {}
    raw_choice: RawDict = {}
    for name in _CHOICE:
        value = getattr(choice, name)
        if value is UNSET:
            continue
        if name == "logprobs":
            client_choice[name] = NULL  # present: null for a client that did not ask
        elif name not in _TYPED:
            raw_choice[name] = value
            if name not in _NOT_FOR_CLIENT:
                client_choice[name] = value
    top: RawDict = {}
    body: dict[str, object] = {}
    for name in _TOP:
        value = getattr(answer, name)
        if value is UNSET:
            continue
        if name == "choices":
            body[name] = [client_choice]
            continue
        top[name] = value
        if name in ("prompt_token_ids", "prompt_text"):
            continue
        if name in NULL_DROPPED_FIELDS and is_null(value):
            continue
        body[name] = value
    return FastAnswer(top, raw_choice, logprobs, token_ids, encode(body))
