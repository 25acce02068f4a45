"""The streamed token chunk, read in one typed pass and relayed by splicing its bytes.

Almost every event of a vLLM stream is one generated token::

    {"id":…,"object":"chat.completion.chunk","created":…,"model":…,
     "choices":[{"index":0,"delta":{…},"logprobs":{…},"finish_reason":null,"token_ids":[…]}]}

`read_token_chunk` decodes such an event straight into Structs (no per-field raw pass) and builds
the client's copy by cutting ``,"token_ids":[…]`` out of the bytes and putting ``null`` in place
of the logprobs: the same bytes the generic path (`_wire.strip_for_client`, re-encoding)
produces for vLLM's compact JSON, at a fraction of the cost. Anything else (another key, another
key order, spaces between tokens, several choices) returns None and the caller takes the generic
path, so the fast path can only be faster, never different.
"""

from __future__ import annotations

import msgspec

from ..sse import encode_event
from ._wire import ClientWants, Logprobs, Message

__all__ = ["TokenChoice", "TokenChunk", "read_token_chunk"]


class TokenChoice(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    index: int
    delta: Message
    logprobs: Logprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class TokenChunk(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """A token chunk: exactly these keys (any other key sends the event to the generic path)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[TokenChoice]


_decode_chunk = msgspec.json.Decoder(TokenChunk).decode
_check_json = msgspec.json.Decoder(msgspec.Raw).decode
_TOKEN_IDS = b',"token_ids":'
_FINISH = b',"finish_reason":'
_LOGPROBS = b',"logprobs":'
_TAIL = b"}]}"


def read_token_chunk(
    data: bytes, raw: bytes, has_comments: bool, wants: ClientWants
) -> tuple[TokenChoice, TokenChunk, bytes] | None:
    """``(choice, chunk, event to relay)`` for a one-token chunk, or None (use the generic path).

    `data` is the event's data, `raw` its exact bytes (relayed as they are when nothing needs
    stripping and the event carries no comments).
    """
    if data[:1] != b"{" or not data.endswith(_TAIL):
        return None
    try:
        chunk = _decode_chunk(data)
    except msgspec.DecodeError:
        return None
    if len(chunk.choices) != 1 or chunk.choices[0].index != 0 or chunk.object == "error":
        return None
    choice = chunk.choices[0]
    strip_ids = not wants.token_ids
    strip_logprobs = not wants.logprobs and choice.logprobs is not None
    if not strip_ids and not strip_logprobs:
        return choice, chunk, (encode_event(data) if has_comments else raw)
    # The choice's last keys, in vLLM's order, found from the end: token ids and the finish
    # reason hold no quotes or braces, so their keys are found exactly; the logprobs value is
    # checked to be one whole JSON value, which a nested look-alike key could not give.
    ids_at = data.rfind(_TOKEN_IDS)
    if ids_at < 0:
        return None
    finish_at = data.rfind(_FINISH, 0, ids_at)
    if finish_at < 0:
        return None
    head = data[:finish_at]
    if strip_logprobs:
        logprobs_at = data.rfind(_LOGPROBS, 0, finish_at)
        if logprobs_at < 0:
            return None
        value = data[logprobs_at + len(_LOGPROBS) : finish_at]
        try:
            _check_json(value)
        except msgspec.DecodeError:
            return None
        head = data[: logprobs_at + len(_LOGPROBS)] + b"null"
    middle = data[finish_at:ids_at]
    tail = _TAIL if strip_ids else data[ids_at:]
    return choice, chunk, encode_event(head + middle + tail)
