"""vLLM's render route read without I/O (``POST /v1/chat/completions/render``).

The answer is a ``GenerateRequest`` (docs/upstream-facts.md, "Token-in routes (vLLM 0.32,
measured)"), decoded once (msgspec, only the fields read typed):

- `read_render` → `Rendered`: the prompt ids (a list, each checked to be an int as it is
  decoded; with ``known``, only from where their JSON differs from a known list's), their JSON
  as it came, the resolved sampling params, ``features``, and `Rendered.generate_body` —
  the render answer sent back with ``token_ids`` replaced, its other fields as they came (kept
  undecoded);
- `read_render_pair` reads of two answers (the bridge's pairs) only the ids from where their
  common suffix starts, and ``features``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from ._generate import malformed
from ._ids_json import encode_ids, ids_after_known
from ._wire import UpstreamProtocolError

__all__ = ["Rendered", "read_render", "read_render_pair"]

_decode_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_ids = msgspec.json.Decoder(list[int]).decode
_decode_object = msgspec.json.Decoder(dict[str, Any]).decode
_NULL = msgspec.Raw(b"null")
#: The render answer's fields `Rendered.generate_body` writes itself.
_WRITTEN = frozenset({"token_ids", "stream", "stream_options"})
#: What a streamed generate request says.
_STREAM = b'"stream":true,"stream_options":{"include_usage":true}'


@dataclass(frozen=True, slots=True)
class Rendered:
    """A render answer: what generate needs, and the rest of it to send back unchanged."""

    prompt_ids: list[int]
    sampling_params: dict[str, Any]
    features: Any
    #: The answer's other fields (a ``GenerateRequest``'s), each its JSON as it came: sent
    #: back to generate without being decoded or encoded again.
    rest: Mapping[str, msgspec.Raw]
    #: The answer's ``stream`` and ``stream_options``, those it has, as they came: sent back
    #: in a unary generate request (a streamed one sets its own).
    unary: Mapping[str, msgspec.Raw] = field(default_factory=dict)
    #: `prompt_ids` as the JSON they came as (None: encode them when needed).
    ids_json: bytes | None = None

    @property
    def prompt_json(self) -> bytes:
        """`prompt_ids` as a JSON list: as they came when known, else encoded."""
        return self.ids_json if self.ids_json is not None else encode_ids(self.prompt_ids)

    def generate_body(
        self,
        prompt_ids: Sequence[int] | None = None,
        *,
        stream: bool = False,
        sampling_params: Mapping[str, Any] | None = None,
        ids_json: bytes | None = None,
    ) -> bytes:
        """The generate request: the render answer with ``token_ids`` replaced by `prompt_ids`
        (default: the rendered ones) and ``sampling_params`` by `sampling_params` (default: the
        rendered ones), streamed with usage when `stream`. `ids_json`, when given, is the ids
        already encoded (a JSON list), sent as they are."""
        parts = [b"{"]
        for key, value in self.rest.items():
            if sampling_params is None or key != "sampling_params":
                parts += (orjson.dumps(key), b":", value, b",")
        if sampling_params is not None:
            parts += (b'"sampling_params":', orjson.dumps(sampling_params), b",")
        if stream:
            parts += (_STREAM, b",")
        else:
            for key, value in self.unary.items():
                parts += (orjson.dumps(key), b":", value, b",")
        if ids_json is None:
            ids_json = self.prompt_json if prompt_ids is None else encode_ids(prompt_ids)
        parts += (b'"token_ids":', ids_json, b"}")
        return b"".join(parts)


def read_render(raw: bytes, known: tuple[bytes, Sequence[int]] | None = None) -> Rendered:
    """Read a render answer once, its ids checked as they are decoded (msgspec); the fields
    generate takes back unchanged stay as they came. `UpstreamProtocolError` when it is not a
    ``GenerateRequest``.

    `known` is a JSON list and the ids it holds (checked ints), which the answer's ids likely
    start with (a bridged prompt, against the plain rendering of the same request): the
    answer's ids are decoded only from the first one whose JSON is not byte for byte the same
    as `known`'s; those before it are `known`'s (the same bytes are the same ids)."""
    fields = _fields("render", raw)
    ids, features = _ids_and_features(fields, known)
    ids_json = bytes(fields["token_ids"])
    params = fields.get("sampling_params", _NULL)
    try:
        decoded = {} if params == _NULL else _decode_object(params)
    except msgspec.DecodeError:  # not an object: none read (generate gets it as it came)
        decoded = {}
    return Rendered(
        prompt_ids=ids,
        sampling_params=decoded,
        features=features,
        rest={k: v for k, v in fields.items() if k not in _WRITTEN},
        unary={k: v for k, v in fields.items() if k in ("stream", "stream_options")},
        ids_json=ids_json,
    )


class _RenderRaw(msgspec.Struct, gc=False):
    token_ids: msgspec.Raw
    features: Any = None


_decode_render_raw = msgspec.json.Decoder(_RenderRaw).decode
#: Bytes between two ids of a JSON list.
_SEPARATORS = frozenset(b"[, \t\r\n")


def read_render_pair(first: bytes, second: bytes) -> tuple[tuple[list[int], list[int]], Any]:
    """Two render answers that differ in one message's content (the bridge's pairs): of each,
    the token ids from the last one that is not in their common suffix to the end (the whole
    list when there is none: for two answers with the same ids, both lists), and the
    ``features`` of each (None when null).

    The common suffix of the two returned lists is the answers' common suffix, and they are the
    same exactly when the answers' lists are: all the bridge reads of a pair, without decoding
    the ids the two share at their start (an agent's system prompt and tools: most of them).
    Those are checked to be JSON, the returned ones to be ints. `UpstreamProtocolError` as
    `read_render`.
    """
    (a, a_features), (b, b_features) = _render_raw(first), _render_raw(second)
    shared = _common_suffix_len(a, b)
    ids = (_decode_tail(a, len(a) - shared), _decode_tail(b, len(b) - shared))
    return ids, (a_features, b_features)


def _render_raw(raw: bytes) -> tuple[bytes, Any]:
    """A render answer's ``token_ids`` as the JSON it came as, and its ``features``."""
    try:
        answer = _decode_render_raw(raw)
    except msgspec.ValidationError as exc:
        raise UpstreamProtocolError("no_token_ids", f"the render answer: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise malformed("render", exc) from exc
    ids = bytes(answer.token_ids)
    if not (ids.startswith(b"[") and ids.endswith(b"]")):
        raise UpstreamProtocolError("no_token_ids", "the render answer has no token_ids list")
    return ids, answer.features


def _common_suffix_len(a: bytes, b: bytes) -> int:
    """How many bytes `a` and `b` end with in common: blocks compared in C, then bytes."""
    n = min(len(a), len(b))
    k = 0
    for block in (4096, 256, 16, 1):
        while (
            k + block <= n
            and a[len(a) - k - block : len(a) - k] == b[len(b) - k - block : len(b) - k]
        ):
            k += block
    return k


def _decode_tail(ids: bytes, start: int) -> list[int]:
    """The ids of the JSON list `ids` from the last one with a byte before `start`: not one of
    the ids its common suffix with the other list has (those are byte for byte the same, with
    the separator before them). The whole list when there is none."""
    j = start - 1
    while j > 0 and ids[j] in _SEPARATORS:
        j -= 1
    begin = max(ids.rfind(b",", 0, j), ids.rfind(b"[", 0, j)) + 1 if j > 0 else 1
    tail = b"[" + ids[begin:]
    try:
        return _decode_ids(tail)
    except msgspec.DecodeError as exc:
        raise UpstreamProtocolError(
            "no_token_ids", f"the render answer's token_ids: {exc}"
        ) from exc


def _fields(route: str, raw: bytes) -> dict[str, msgspec.Raw]:
    try:
        return _decode_fields(raw)
    except msgspec.ValidationError as exc:
        raise UpstreamProtocolError("no_token_ids", f"the {route} answer is not an object") from exc
    except msgspec.DecodeError as exc:
        raise malformed(route, exc) from exc


def _ids_and_features(
    fields: Mapping[str, msgspec.Raw], known: tuple[bytes, Sequence[int]] | None = None
) -> tuple[list[int], Any]:
    value = fields.get("token_ids")
    try:
        if value is None:
            ids = None
        elif known is None:
            ids = _decode_ids(value)
        else:
            ids = ids_after_known(bytes(value), *known)
    except msgspec.DecodeError:
        ids = None
    if ids is None:
        raise UpstreamProtocolError("no_token_ids", "the render answer has no token_ids list")
    features = fields.get("features", _NULL)
    return ids, None if features == _NULL else msgspec.json.decode(features)
