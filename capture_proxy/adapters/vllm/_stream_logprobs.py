"""OpenAI-shaped logprobs for a streamed token-in answer's chunks (sans-IO).

The chat route streams each chunk's ``logprobs`` (``{content: [{token, logprob, bytes,
top_logprobs}]}``) when the client asks for them. A streamed token-in answer is built by vLLM
0.32's streamed derender, which leaves them null when the server has a reasoning or tool parser
(its parsed streaming path does not resolve logprobs; without a parser it does). Generate gives
them with token ids only: the token strings and bytes need vLLM's tokenizer, which the proxy does
not have. vLLM's *unary* derender resolves them (with the same replacement-character correction
the chat route applies, from the preceding sampled ids), so for each streamed chunk that carries
logprobs `StreamLogprobs` builds one small unary derender request: the chunk's ids and logprobs
entries, preceded by the last `CONTEXT` ids sampled before them as context entries whose
resolution is dropped, and a one-message chat request (the parser's result is not read; the
logprobs do not depend on the chat request). docs/token-in.md, "The call flow", says what it
costs.

`request(chunk)` gives the body for a ``generate_chunk`` (JSON, as `merge_chunks` gives it), or
None when it carries no logprobs; `read(answer)` gives that chunk's ``logprobs`` from the unary
derender answer. Call them in the stream's order, one `read` per `request`.
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

from ._wire import UpstreamProtocolError

__all__ = ["CONTEXT", "StreamLogprobs"]

#: How many preceding sampled ids vLLM reads to correct a token that decodes to an incomplete
#: character (``_correct_decoded_token``: at most 4); sent before each chunk's own entries.
CONTEXT = 4


class _Content(msgspec.Struct, gc=False):
    content: list[msgspec.Raw] | None = None


class _Choice(msgspec.Struct, gc=False):
    token_ids: list[int] | None = None
    logprobs: _Content | None = None


class _Chunk(msgspec.Struct, gc=False):
    request_id: str = ""
    choices: list[_Choice] = []


class _AnswerChoice(msgspec.Struct, gc=False):
    logprobs: dict[str, Any] | None = None


class _Answer(msgspec.Struct, gc=False):
    choices: list[_AnswerChoice]


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_decode_answer = msgspec.json.Decoder(_Answer).decode


class StreamLogprobs:
    """Builds, for each streamed chunk, the unary derender request that resolves its logprobs,
    and reads the answer (module docs). `model` is the chat request's model (the derender route
    checks it)."""

    def __init__(self, model: str) -> None:
        self._chat = orjson.dumps({"model": model, "messages": [{"role": "user", "content": ""}]})
        #: The last `CONTEXT` ids sampled before the next chunk.
        self._context: list[int] = []
        #: How many context entries the pending request's answer starts with.
        self._skip: int | None = None

    def request(self, chunk: bytes) -> bytes | None:
        """The unary derender body resolving `chunk`'s logprobs, or None when it has none
        (the usage event, or logprobs not asked of generate). `UpstreamProtocolError` for a
        chunk that is not a generate event."""
        try:
            event = _decode_chunk(chunk)
        except msgspec.DecodeError as exc:
            raise UpstreamProtocolError(
                "malformed_json", f"the generate stream event: {exc}"
            ) from exc
        choice = event.choices[0] if event.choices else None
        ids = (choice.token_ids or []) if choice is not None else []
        content = choice.logprobs.content if choice and choice.logprobs else None
        context = self._context
        self._context = [*context, *ids][-CONTEXT:]
        if not content:
            return None
        self._skip = len(context)
        entries = [
            orjson.dumps({"token_id": t, "logprob": 0.0, "top_logprobs": []}) for t in context
        ]
        entries += [bytes(e) for e in content]
        generate = b"".join(
            (
                b'{"request_id":',
                orjson.dumps(event.request_id),
                b',"choices":[{"index":0,"finish_reason":null,"token_ids":',
                orjson.dumps([*context, *ids]),
                b',"logprobs":{"content":[',
                b",".join(entries),
                b"]}}]}",
            )
        )
        return b"".join(
            (
                b'{"generate_response":',
                generate,
                b',"prompt_token_ids":[],"chat_request":',
                self._chat,
                b"}",
            )
        )

    def read(self, answer: bytes) -> dict[str, Any]:
        """The ``logprobs`` (``{"content": [...]}``) of the chunk of the last `request`, from
        the unary derender `answer`. `UpstreamProtocolError` when it has none for each entry."""
        skip, self._skip = self._skip, None
        if skip is None:
            raise ValueError("read() without a pending request()")
        try:
            decoded = _decode_answer(answer)
        except msgspec.DecodeError as exc:
            raise UpstreamProtocolError("malformed_json", f"the derender answer: {exc}") from exc
        logprobs = decoded.choices[0].logprobs if decoded.choices else None
        content = logprobs.get("content") if logprobs is not None else None
        if not isinstance(content, list) or len(content) <= skip:
            raise UpstreamProtocolError(
                "missing_logprobs", "the derender answer resolved no logprobs for the chunk"
            )
        return {"content": content[skip:]}
