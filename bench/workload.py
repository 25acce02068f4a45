"""The benchmark's workload, built once from a seed: the request a client sends and vLLM's answers.

Sizes follow the reference figures of docs/reports/performance.md: an OpenCode-like request of
about 30 KB (two system prompts, ten tool definitions, a short history with a tool call and its
result, replayed reasoning) and vLLM 0.32 answers with about 16k prompt token ids and 1,024
completion tokens with logprobs (about 200 KB of JSON). The answers are built with the shapes and
key order of ``tests/fixtures/vllm-0.32.0`` (the fake vLLM's protocol module, which
``tests/testing/test_fake_vllm.py`` checks against those fixtures), with token ids spread over a
151k vocabulary as a Qwen tokenizer gives them and tokens of a few characters, so their byte size
and digit counts are realistic.

Sessions, not one answer repeated: there are `TURNS` answers, and turn t's prompt is turn t-1's
prompt + completion + a tool result of `TOOL_RESULT_TOKENS` tokens, as in an agent session (the
prompts grow from 12,288 to 20,352 tokens: 16k on average). The load generator writes a tag into
the request's placeholder (`tag_request`): the call's turn and number, so every call has one new
message, and the upstream answers the turn the tag names (`turn_of`).
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass
from typing import Any

import orjson

from capture_proxy.testing.fake_vllm._protocol import DONE, ChunkWriter, message_body, usage_body

__all__ = ["COUNTER_PLACEHOLDER", "TURNS", "Workload", "build_workload", "tag_request", "turn_of"]

TURNS = 8
FIRST_PROMPT_TOKENS = 12_288
TOOL_RESULT_TOKENS = 128
COMPLETION_TOKENS = 1_024
REASONING_TOKENS = 640
VOCAB = 151_000
#: Replaced by `tag_request` (same width) in every request the load generator sends.
COUNTER_PLACEHOLDER = b"#CALL-000000000#"
_TAG = b"#T"


def tag_request(template: bytes, turn: int, number: int) -> bytes:
    """The request for call `number`, at `turn` of its session (0 <= turn < 10)."""
    return template.replace(COUNTER_PLACEHOLDER, b"#T%1d-%011d#" % (turn, number))


def turn_of(body: bytes) -> int:
    """The turn a tagged request names (0 when it carries no tag)."""
    at = body.find(_TAG)
    if at < 0 or at + 2 >= len(body):
        return 0
    digit = body[at + 2] - 0x30
    return digit if 0 <= digit < TURNS else 0


_VOCABULARY_TEXT = (
    "the of and to in is for on that with as it by this be are from or at an you we can file "
    "path read write test run bash command output error value return function class import self "
    "def async await list dict str int none true false check build fix change"
)
_WORDS = _VOCABULARY_TEXT.split(" ")


@dataclass(frozen=True, slots=True)
class Workload:
    """Pre-built bytes: two request templates (streamed or not) and the upstream's answers."""

    request: bytes  # non-streaming client request (~30 KB), with the placeholder
    stream_request: bytes  # the same with stream + stream_options.include_usage (OpenCode)
    answers: list[bytes]  # per turn: the chat.completion body vLLM sends for the proxy's request
    streams: list[list[bytes]]  # per turn: the streamed answer, one SSE event each, [DONE] last
    prompt_tokens: list[int]  # per turn

    @property
    def answer(self) -> bytes:
        """The answer of the turn whose prompt is closest to 16k tokens."""
        return self.answers[TURNS // 2]

    @property
    def events(self) -> list[bytes]:
        return self.streams[TURNS // 2]


def _text(rng: random.Random, n_bytes: int) -> str:
    words: list[str] = []
    size = 0
    while size < n_bytes:
        w = rng.choice(_WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)


def _tool(rng: random.Random, name: str) -> dict[str, Any]:
    props = {f"{name}_{k}": {"type": "string", "description": _text(rng, 120)} for k in range(4)}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": _text(rng, 500),
            "parameters": {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "type": "object",
                "properties": props,
                "required": [next(iter(props))],
                "additionalProperties": False,
            },
        },
    }


def _request(rng: random.Random) -> dict[str, Any]:
    names = ["bash", "read", "write", "edit", "glob", "grep", "list", "webfetch", "todo", "task"]
    tool_call = {
        "id": "call_0a1b2c3d",
        "type": "function",
        "function": {"name": "bash", "arguments": '{"command":"ls -la","description":"List"}'},
    }
    return {
        "model": "policy",
        "max_tokens": 32000,
        "temperature": 0.6,
        "top_p": 0.95,
        "messages": [
            {"role": "system", "content": _text(rng, 9000)},
            {"role": "system", "content": _text(rng, 1500)},
            {"role": "user", "content": _text(rng, 600)},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": _text(rng, 1200),
                "tool_calls": [tool_call],
            },
            {"role": "tool", "tool_call_id": "call_0a1b2c3d", "content": _text(rng, 4000)},
            {"role": "assistant", "content": _text(rng, 800), "reasoning_content": _text(rng, 400)},
            {"role": "user", "content": COUNTER_PLACEHOLDER.decode() + " " + _text(rng, 300)},
        ],
        "tools": [_tool(rng, n) for n in names],
        "tool_choice": "auto",
        "chat_template_kwargs": {"enable_thinking": True},
        "top_k": 20,
    }


def _logprob_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}


def _answer(
    rng: random.Random, turn: int, prompt_ids: list[int]
) -> tuple[bytes, list[bytes], list[int]]:
    """One turn's answer, non-streamed and streamed; returns them with its completion ids."""
    ids = [rng.randrange(VOCAB) for _ in range(COMPLETION_TOKENS)]
    tokens = [rng.choice(_WORDS) + (" " if rng.random() < 0.7 else "") for _ in ids]
    # vLLM computes logprobs in float32; its JSON shows the float32 value widened to float64.
    logprobs = [
        struct.unpack("f", struct.pack("f", -rng.expovariate(2.0)))[0] for _ in range(len(ids))
    ]
    reasoning = "".join(tokens[:REASONING_TOKENS])
    content = "".join(tokens[REASONING_TOKENS:])
    call_id = f"chatcmpl-bench{turn:014d}"
    created = 1795979440
    fingerprint = "vllm-0.32.0-289ee19c"
    prompt_n = len(prompt_ids)
    entries = [_logprob_entry(t, lp) for t, lp in zip(tokens, logprobs, strict=True)]
    answer = {
        "id": call_id,
        "object": "chat.completion",
        "created": created,
        "model": "policy",
        "choices": [
            {
                "index": 0,
                "message": message_body("reasoning", reasoning, content, []),
                "logprobs": {"content": entries},
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": ids,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage_body(prompt_n, COMPLETION_TOKENS, REASONING_TOKENS, stream=False),
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }
    writer = ChunkWriter(call_id, created, "policy")
    events = [writer.first(prompt_ids, None)]
    for k, (token_id, token, entry) in enumerate(zip(ids, tokens, entries, strict=True)):
        last = k == len(ids) - 1
        delta = {"reasoning": token} if k < REASONING_TOKENS else {"content": token}
        events.append(
            writer.token(delta, [entry], [token_id], finish_reason="stop" if last else None)
        )
    usage = usage_body(prompt_n, COMPLETION_TOKENS, REASONING_TOKENS, stream=True)
    events.append(writer.usage(usage, fingerprint))
    events.append(DONE)
    return orjson.dumps(answer), events, ids


def build_workload(seed: int = 0) -> Workload:
    """The request and answer bytes (deterministic for a seed)."""
    rng = random.Random(seed)
    request = _request(rng)
    stream_request = {**request, "stream": True, "stream_options": {"include_usage": True}}
    prompt = [rng.randrange(VOCAB) for _ in range(FIRST_PROMPT_TOKENS)]
    answers: list[bytes] = []
    streams: list[list[bytes]] = []
    lengths: list[int] = []
    for turn in range(TURNS):
        answer, events, completion = _answer(rng, turn, prompt)
        answers.append(answer)
        streams.append(events)
        lengths.append(len(prompt))
        # The next turn's prompt extends this one's prompt + completion (an agent session).
        prompt = prompt + completion + [rng.randrange(VOCAB) for _ in range(TOOL_RESULT_TOKENS)]
    return Workload(
        request=orjson.dumps(request),
        stream_request=orjson.dumps(stream_request),
        answers=answers,
        streams=streams,
        prompt_tokens=lengths,
    )
