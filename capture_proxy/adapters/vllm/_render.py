"""vLLM's render route read without I/O (``POST /v1/chat/completions/render``).

The answer is a ``GenerateRequest`` (docs/upstream-facts.md, "Token-in routes (vLLM 0.32,
measured)"), decoded once (msgspec, only the fields read typed):

- `read_render` → `Rendered`: the prompt ids (a list, each checked to be an int as it is
  decoded; with ``known``, only from where their JSON differs from a known list's), their JSON
  as it came, the resolved sampling params, ``features``, and `Rendered.generate_body` —
  the render answer sent back with ``token_ids`` replaced, its other fields as they came (kept
  undecoded);
- `read_render_pair` reads of two answers (the bridge's pairs) only the ids from where their
  common suffix starts, and ``features``;
- `pair_anchor` gives, of a pair that differs in exactly one id, the JSON of the first's ids up
  to and including it (where the dummy content is), and `read_anchored` reads a single answer
  against such an anchor: the ids after it (docs/token-in.md, "One render instead of a pair").
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import orjson

from ._generate import malformed
from ._ids_json import common_prefix_len, encode_ids, read_known_ids
from ._wire import UpstreamProtocolError

__all__ = [
    "Rendered",
    "compact_sampling",
    "pair_anchor",
    "read_anchored",
    "read_render",
    "read_render_pair",
]

_decode_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_ids = msgspec.json.Decoder(list[int]).decode
_decode_object = msgspec.json.Decoder(dict[str, Any]).decode
_NULL = msgspec.Raw(b"null")
#: vLLM's ``SamplingParams.max_tokens`` default, which its render answers leave out.
DEFAULT_MAX_TOKENS = 16
#: The render answer's fields `Rendered.generate_body` writes itself.
_WRITTEN = frozenset({"token_ids", "stream", "stream_options"})
#: What a streamed generate request says.
_STREAM = b'"stream":true,"stream_options":{"include_usage":true}'
#: The values of a ``GenerateRequest``'s top-level fields that are their defaults in vLLM 0.32
#: (``token_in_token_out/protocol.py``: every optional field defaults to None, ``priority`` to
#: 0, ``output_mode`` to "tokens", ``stream`` to false): `Rendered.generate_body` leaves such a
#: field out, which vLLM reads as the same request, in fewer bytes.
_DEFAULTS: dict[str, msgspec.Raw] = {
    "priority": msgspec.Raw(b"0"),
    "output_mode": msgspec.Raw(b'"tokens"'),
    "stream": msgspec.Raw(b"false"),
}
#: ``SamplingParams`` fields (vLLM 0.32, ``sampling_params.py``) and the values that build the
#: same parameters as leaving them out (its ``__post_init__`` turns a null ``stop``,
#: ``stop_token_ids`` or ``bad_words`` into ``[]``); ``output_kind``, which generate sets itself
#: (streamed or not), whatever it gets. Not ``max_tokens``: generate tells one it got from one
#: it did not (``is_sampling_param_provided``: then it fills in the room the prompt leaves).
_SAMPLING_DEFAULTS: dict[str, tuple[Any, ...] | None] = {
    "n": (1,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "temperature": (1.0,),
    "top_p": (1.0,),
    "top_k": (0,),
    "min_p": (0.0,),
    "seed": (None,),
    "stop": (None, []),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "ignore_eos": (False,),
    "min_tokens": (0,),
    "prompt_logprobs": (None,),
    "include_stop_str_in_output": (False,),
    "output_kind": None,  # any value: generate overwrites it
}
#: The ``GenerateRequest`` fields vLLM 0.32 reads only for a structured output's grammar: the
#: engine's ``Request`` hands them to its ``structured_output_request``, which exists only when
#: the sampling parameters have ``structured_outputs`` (``v1/request.py``,
#: ``v1/structured_output/__init__.py``). Render answers them whenever the server has a
#: reasoning parser (``reasoning_parser_kwargs`` is the template keys: 110 bytes and more).
#: Without a structured output both go (`_unread`), but a true ``reasoning_ended``: the bundled
#: fake vLLM's scripted model plans its answer from it (its template does not write
#: ``enable_thinking: false`` into the prompt, as Qwen3's does), and it is 22 bytes.
_STRUCTURED_ONLY: Final = frozenset({"reasoning_ended", "reasoning_parser_kwargs"})
_TRUE: Final = msgspec.Raw(b"true")
#: The prompt logprobs fields whose absence makes ``skip_reading_prefix_cache`` default to false
#: (``SamplingParams.__post_init__``: None becomes whether prompt logprobs are asked for).
_PROMPT_LOGPROBS: Final = ("prompt_logprobs", "prompt_logprob_token_ids")


def compact_sampling(params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` without the fields generate reads the same when left out (`_SAMPLING_DEFAULTS`,
    compared by type and value: ``0`` is not taken for ``false``), and without
    ``skip_reading_prefix_cache: false`` when no prompt logprobs are asked for (what vLLM
    0.32's ``SamplingParams`` then sets it to)."""
    out = {k: v for k, v in params.items() if not _sampling_default(k, v)}
    if out.get("skip_reading_prefix_cache") is False and all(
        out.get(k) is None for k in _PROMPT_LOGPROBS
    ):
        del out["skip_reading_prefix_cache"]
    return out


def _sampling_default(key: str, value: Any) -> bool:
    if key not in _SAMPLING_DEFAULTS:
        return False
    defaults = _SAMPLING_DEFAULTS[key]
    if defaults is None:
        return True
    return any(value == d and type(value) is type(d) for d in defaults)


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
    #: How many of `prompt_ids` at their start were read as `read_render`'s ``known`` ids
    #: (byte for byte the same JSON): they are those ids, not compared again (`divergence`).
    known_prefix: int = 0

    @property
    def prompt_json(self) -> bytes:
        """`prompt_ids` as a JSON list: as they came when known, else encoded."""
        return self.ids_json if self.ids_json is not None else encode_ids(self.prompt_ids)

    @property
    def resolved_sampling(self) -> dict[str, Any]:
        """`sampling_params` with the output limit said: vLLM 0.32's render leaves out a
        ``max_tokens`` equal to SamplingParams' default (16), and its generate takes a missing
        one as no limit (sampling to the end of the context window;
        tests/fixtures/vllm-0.32.0/token-in/render-max-tokens-16-response.json)."""
        params = self.sampling_params
        if params and "max_tokens" not in params:
            return {**params, "max_tokens": DEFAULT_MAX_TOKENS}
        return params

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
        rendered ones, the limit said: `resolved_sampling`), streamed with usage when `stream`.
        `ids_json`, when given, is the ids already encoded (a JSON list), sent as they are."""
        if sampling_params is None and self.sampling_params:
            sampling_params = self.resolved_sampling  # with the limit vLLM's answer left out
        if sampling_params is not None:
            sampling_params = compact_sampling(sampling_params)
        # Without a structured output, generate reads neither field (`_STRUCTURED_ONLY`).
        unstructured = (
            sampling_params is not None and sampling_params.get("structured_outputs") is None
        )
        parts = [b"{"]
        for key, value in self.rest.items():
            if (
                (sampling_params is None or key != "sampling_params")
                and not (unstructured and _unread(key, value))
                and not _default(key, value)
            ):
                parts += (orjson.dumps(key), b":", value, b",")
        if sampling_params is not None:
            parts += (b'"sampling_params":', orjson.dumps(sampling_params), b",")
        if stream:
            parts += (_STREAM, b",")
        else:
            for key, value in self.unary.items():
                if not _default(key, value):
                    parts += (orjson.dumps(key), b":", value, b",")
        if ids_json is None:
            ids_json = self.prompt_json if prompt_ids is None else encode_ids(prompt_ids)
        parts += (b'"token_ids":', ids_json, b"}")
        return b"".join(parts)


def _unread(key: str, value: msgspec.Raw) -> bool:
    """Whether generate does not read a render answer's field without a structured output
    (`_STRUCTURED_ONLY`)."""
    return key in _STRUCTURED_ONLY and not (key == "reasoning_ended" and value == _TRUE)


def _default(key: str, value: msgspec.Raw) -> bool:
    """Whether a render answer's field, as it came, is its ``GenerateRequest`` default
    (`_DEFAULTS`): generate reads the request the same without it."""
    return value == _NULL or value == _DEFAULTS.get(key)


def read_render(raw: bytes, known: tuple[bytes, Sequence[int]] | None = None) -> Rendered:
    """Read a render answer once, its ids checked as they are decoded (msgspec); the fields
    generate takes back unchanged stay as they came. `UpstreamProtocolError` when it is not a
    ``GenerateRequest``.

    `known` is a JSON list and the ids it holds (checked ints), which the answer's ids likely
    start with (a bridged prompt, against the plain rendering of the same request): the
    answer's ids are decoded only from the first one whose JSON is not byte for byte the same
    as `known`'s; those before it are `known`'s (the same bytes are the same ids)."""
    cut = _without_known(raw, known[0], ints=True) if known is not None else None
    fields = _known_fields(cut) if cut is not None else None
    if cut is None or fields is None:
        fields = _fields("render", raw)
        ids, features, known_prefix = _ids_and_features(fields, known)
        ids_json = bytes(fields["token_ids"])
    else:
        assert known is not None
        ids, features, _ = _ids_and_features(fields)
        known_prefix = cut.ids.count(b",")
        head = known[1][:known_prefix]
        ids = head + ids if isinstance(head, list) else [*head, *ids]
        ids_json = cut.whole_list(fields["token_ids"])
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
        known_prefix=known_prefix,
    )


class _RenderRaw(msgspec.Struct, gc=False):
    token_ids: msgspec.Raw
    features: Any = None


_decode_render_raw = msgspec.json.Decoder(_RenderRaw).decode
#: Bytes between two ids of a JSON list.
_SEPARATORS = frozenset(b"[, \t\r\n")


def read_render_pair(
    first: bytes, second: bytes, known: bytes | None = None
) -> tuple[tuple[list[int], list[int]], Any]:
    """Two render answers that differ in one message's content (the bridge's pairs): of each,
    the token ids from the last one that is not in their common suffix to the end (the whole
    list when there is none: for two answers with the same ids, both lists), and the
    ``features`` of each (None when null).

    The common suffix of the two returned lists is the answers' common suffix, and they are the
    same exactly when the answers' lists are: all the bridge reads of a pair, without decoding
    the ids the two share at their start (an agent's system prompt and tools: most of them).
    Those are checked to be JSON, the returned ones to be ints. `UpstreamProtocolError` as
    `read_render`. `known`, when given, is a JSON list of checked ints the answers' ids likely
    start with (the previous call's prompt: the same system prompt and tools): the ids they
    spell byte for byte as it does are not parsed again, as the second's are not against the
    first's.
    """
    a, a_features = _render_raw(first, known, ints=True)
    # The second mostly spells the same ids: only the rest of it is parsed.
    b, b_features = _render_raw(second, known, ints=True) if known else _render_raw(second, a)
    shared = _common_suffix_len(a, b)
    ids = (_decode_tail(a, len(a) - shared), _decode_tail(b, len(b) - shared))
    return ids, (a_features, b_features)


def _render_raw(raw: bytes, known: bytes | None = None, *, ints: bool = False) -> tuple[bytes, Any]:
    """A render answer's ``token_ids`` as the JSON it came as, and its ``features``. `known`:
    a JSON list the answer's ids likely start with, `ints` when it is checked to hold only
    ints (`_without_known`)."""
    cut = _without_known(raw, known, ints=ints) if known else None
    answer = None
    if cut is not None:
        try:
            answer = _decode_render_raw(cut.rest)
        except msgspec.DecodeError:  # a validation error too: the whole answer says which
            answer = None
    if answer is None:
        cut = None
        try:
            answer = _decode_render_raw(raw)
        except msgspec.ValidationError as exc:
            raise UpstreamProtocolError("no_token_ids", f"the render answer: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise malformed("render", exc) from exc
    ids = bytes(answer.token_ids) if cut is None else cut.whole_list(answer.token_ids)
    if not (ids.startswith(b"[") and ids.endswith(b"]")):
        raise UpstreamProtocolError("no_token_ids", "the render answer has no token_ids list")
    return ids, answer.features


def pair_anchor(first: bytes, second: bytes) -> bytes | None:
    """Where the one id in which two render answers differ ends: the JSON of the first's ids up
    to and including that id and its comma (``[1,2,65,``), or None when the two do not differ
    in exactly one id followed by at least one they share, or are not spelled as vLLM spells
    them (`_HEAD`, compact ints).

    Of a bridge pair (two dummy conversations that differ only in the assistant's one-token
    content) it is everything the template writes up to and including the content: a single
    render of the same conversation with other messages after it is read against it
    (`read_anchored`)."""
    a, b = _HEAD.match(first), _HEAD.match(second)
    if a is None or b is None:
        return None
    x, y = first[a.end() - 1 :], second[b.end() - 1 :]
    if x == y:
        return None
    begin = x.rfind(b",", 0, common_prefix_len(x, y)) + 1 or 1  # the differing id's start
    end_x, end_y = x.find(b",", begin), y.find(b",", begin)
    if end_x < 0 or end_y < 0:
        return None
    # Exactly that id differs: the lists are byte for byte the same from the comma after it to
    # their end (the first "]": ints only, checked where it matters).
    if x[end_x : x.find(b"]", end_x) + 1] != y[end_y : y.find(b"]", end_y) + 1]:
        return None
    anchor = x[: end_x + 1]
    if begin in (end_x, end_y) or b",," in anchor:
        return None
    if anchor[1:].translate(None, _INT_LIST_BYTES) or y[begin:end_y].translate(None, _DIGITS):
        return None
    return anchor


def read_anchored(raw: bytes, anchor: bytes) -> tuple[list[int], Any] | None:
    """A render answer read against `anchor` (`pair_anchor`): the ids after the anchor's, and
    the ``features`` (None when null); None when the answer's ids do not start with the
    anchor's byte for byte, or it is not spelled as vLLM spells them. `UpstreamProtocolError`
    when the rest of it is not a render answer (as `read_render`)."""
    cut = _without_known(raw, anchor, ints=True)
    if cut is None or len(cut.ids) != len(anchor) - 1:
        return None
    try:
        answer = _decode_render_raw(cut.rest)
    except msgspec.ValidationError as exc:
        raise UpstreamProtocolError("no_token_ids", f"the render answer: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise malformed("render", exc) from exc
    try:
        ids = _decode_ids(bytes(answer.token_ids))
    except msgspec.DecodeError as exc:
        raise UpstreamProtocolError(
            "no_token_ids", f"the render answer's token_ids: {exc}"
        ) from exc
    return ids, answer.features


#: How vLLM's ``GenerateRequest`` answers start: a request id of these bytes, then the ids. An
#: answer that starts so has its ``token_ids`` list found without a parse (`_without_known`).
_HEAD = re.compile(rb'\{"request_id":"[A-Za-z0-9._:-]*","token_ids":\[')


@dataclass(frozen=True, slots=True)
class _Cut:
    """A render answer with the ids it spells byte for byte as a known list cut out."""

    #: The answer without them: its start up to ``[``, then the rest of the list (and object).
    rest: bytes
    #: The ids cut out, as their JSON, each followed by its comma: the known list's first ones.
    ids: bytes

    def whole_list(self, tail: bytes) -> bytes:
        """The answer's whole ``token_ids`` JSON from the rest's (`tail`, ``[`` ...)."""
        return b"".join((b"[", self.ids, bytes(tail)[1:]))


#: What a JSON list of ints is made of, compact (`_without_known` of an unchecked list).
_INT_LIST_BYTES = b"0123456789,"
_DIGITS = b"0123456789"


def _without_known(raw: bytes, known: bytes, *, ints: bool) -> _Cut | None:
    """`raw`, a render answer, with the ids at its ``token_ids``' start that are byte for byte
    those of `known` (a JSON list) cut out, or None when it does not start as vLLM's do
    (`_HEAD`) or shares no whole id with `known`. `ints`: `known` is checked to hold only
    ints; when not, the bytes cut must be digits and commas only.

    The answer is valid JSON, and means the same, exactly when its rest is: the bytes cut are
    a run of whole ints, each followed by its comma, from just after the ``[`` to just after a
    comma. So only the rest is parsed (a few hundred bytes instead of a render's 80 KB)."""
    head = _HEAD.match(raw)
    if head is None:
        return None
    start = head.end() - 1  # the list's "["
    shared = common_prefix_len(raw, known, start)
    end = raw.rfind(b",", start, start + shared) + 1  # after the last comma both lists share
    if end <= 0:
        return None
    ids = raw[start + 1 : end]
    if not ints and ids.translate(None, _INT_LIST_BYTES):
        return None
    return _Cut(raw[: start + 1] + raw[end:], ids)


def _known_fields(cut: _Cut) -> dict[str, msgspec.Raw] | None:
    """The fields of a cut answer (`_without_known`); None when it is not an object (the
    whole answer then says why)."""
    try:
        return _decode_fields(cut.rest)
    except msgspec.DecodeError:
        return None


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
) -> tuple[list[int], Any, int]:
    value = fields.get("token_ids")
    known_prefix = 0
    try:
        if value is None:
            ids = None
        elif known is None:
            ids = _decode_ids(value)
        else:
            ids, known_prefix = read_known_ids(bytes(value), *known)
    except msgspec.DecodeError:
        ids = None
    if ids is None:
        raise UpstreamProtocolError("no_token_ids", "the render answer has no token_ids list")
    features = fields.get("features", _NULL)
    return ids, None if features == _NULL else msgspec.json.decode(features), known_prefix
