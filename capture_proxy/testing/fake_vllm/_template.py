"""The fake vLLM's tokenizer and chat template: deterministic, no files, no model.

Tokenizer (byte level): every UTF-8 byte ``b`` of ordinary text is the id ``b + 16``; a handful of
special tokens have small ids, and their literal text inside a string is encoded as the special id
(as Hugging Face tokenizers do):

====  =====================
id    token
====  =====================
0     ``<|endoftext|>``
1     ``<|im_start|>``
2     ``<|im_end|>``          (end of turn: the id a finished answer ends with)
3     ``<think>``
4     ``</think>``
5     ``<tool_call>``
6     ``</tool_call>``
7     ``<tool_response>``
8     ``</tool_response>``
9     ``<|image_pad|>``       (one per image part of a message)
====  =====================

Ids 1–8 are the ids the real tokenizer behind ``fixtures/vllm-0.32.0`` gave the same tokens. Ids
10–15 are unused; the vocabulary has 272 ids.

Chat template (ChatML like Qwen3)::

    <|im_start|>system\\n{system}\\n\\n# Tools\\n...<tools>\\n{one tool json per line}\\n</tools>...
    <|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{content}
    \\n<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n                       (the generation prompt)

The think block is rendered only when the assistant message carries non-empty reasoning; the
``\\n`` before ``<tool_call>`` only after non-empty content or a previous tool call. ``ARGS`` is the
replayed ``arguments`` string verbatim, so a client that re-serializes arguments renders different
tokens than were generated (drift), unless ``reparse_tool_arguments`` is set: real vLLM parses the
string and the Qwen3 template re-dumps it (``fixtures/vllm-0.32.0/chat-response.json`` renders the
compact ``{"command":"ls"}`` as ``{"command": "ls"}``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "BYTE_OFFSET",
    "IM_END",
    "SPECIAL_TOKENS",
    "THINK_END",
    "THINK_START",
    "TOOLS_POSTAMBLE",
    "TOOLS_PREAMBLE",
    "VOCAB_SIZE",
    "assistant_text",
    "content_text",
    "decode",
    "encode",
    "reasoning_keys_for",
    "render_chat",
    "token_bytes",
    "token_text",
    "tool_call_text",
]

BYTE_OFFSET = 16
VOCAB_SIZE = 256 + BYTE_OFFSET
SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<think>": 3,
    "</think>": 4,
    "<tool_call>": 5,
    "</tool_call>": 6,
    "<tool_response>": 7,
    "</tool_response>": 8,
    "<|image_pad|>": 9,
}
IM_END = SPECIAL_TOKENS["<|im_end|>"]
THINK_START = SPECIAL_TOKENS["<think>"]
THINK_END = SPECIAL_TOKENS["</think>"]
_SPECIAL_BY_ID = {i: s.encode() for s, i in SPECIAL_TOKENS.items()}
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def encode(text: str) -> list[int]:
    """Token ids of ``text``; special-token strings become their special ids."""
    ids: list[int] = []
    for i, part in enumerate(_SPECIAL_RE.split(text)):
        if i % 2:
            ids.append(SPECIAL_TOKENS[part])
        elif part:
            ids.extend(b + BYTE_OFFSET for b in part.encode())
    return ids


def token_bytes(token_id: int) -> bytes:
    """The bytes one id stands for; ValueError for an id outside the vocabulary."""
    if BYTE_OFFSET <= token_id < VOCAB_SIZE:
        return bytes((token_id - BYTE_OFFSET,))
    special = _SPECIAL_BY_ID.get(token_id)
    if special is None:
        raise ValueError(f"token id {token_id} is not in the vocabulary (0-9, 16-271)")
    return special


def token_text(token_id: int) -> str:
    """One token as text; a lone byte of a multi-byte character becomes U+FFFD."""
    return token_bytes(token_id).decode("utf-8", errors="replace")


def decode(ids: Iterable[int]) -> str:
    """Text of a token sequence (incomplete UTF-8 sequences become U+FFFD)."""
    return b"".join(token_bytes(i) for i in ids).decode("utf-8", errors="replace")


def tool_call_text(name: str, arguments: str) -> str:
    """One hermes tool-call block, exactly as generated and as rendered in history."""
    name_json = json.dumps(name, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {name_json}, "arguments": {arguments}}}\n</tool_call>'


def reasoning_keys_for(version: str) -> tuple[str, ...]:
    """Which assistant-message keys a vLLM version reads replayed reasoning from.

    0.16–0.21 read only ``reasoning``; older versions only ``reasoning_content`` (an assumption:
    they emitted only that name); 0.22 and later (0.32 observed) read both, ``reasoning`` first.
    """
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return ("reasoning", "reasoning_content")
    if (major, minor) < (0, 16):
        return ("reasoning_content",)
    if (major, minor) < (0, 22):
        return ("reasoning",)
    return ("reasoning", "reasoning_content")


def content_text(content: Any) -> str:
    """A message's content as template text: strings as is, parts joined, images as a pad token."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out: list[str] = []
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if kind == "text":
            out.append(str(part.get("text", "")))
        elif kind in ("image_url", "input_image", "image"):
            out.append("<|image_pad|>")
    return "".join(out)


def _arguments_text(arguments: Any, reparse: bool) -> str:
    if not isinstance(arguments, str):
        return json.dumps(arguments, ensure_ascii=False)
    if reparse:
        try:
            return json.dumps(json.loads(arguments), ensure_ascii=False)
        except ValueError:
            return arguments
    return arguments


def assistant_text(message: Mapping[str, Any], reasoning_keys: Sequence[str], reparse: bool) -> str:
    reasoning = next((message[k] for k in reasoning_keys if message.get(k)), None)
    content = content_text(message.get("content"))
    text = f"<think>\n{reasoning}\n</think>\n\n{content}" if reasoning else content
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function", {}) if isinstance(call, Mapping) else {}
        if i > 0 or content:
            text += "\n"
        text += tool_call_text(
            str(fn.get("name", "")), _arguments_text(fn.get("arguments"), reparse)
        )
    return text


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    *,
    add_generation_prompt: bool = True,
    reasoning_keys: Sequence[str] = ("reasoning", "reasoning_content"),
    reparse_tool_arguments: bool = False,
    drop_past_reasoning: bool = False,
) -> str:
    """The prompt text for a conversation (see the module docstring for the layout).

    With ``drop_past_reasoning`` the template is Qwen3's in the way that matters for token-in: the
    reasoning of an assistant message before the last user message is not rendered, so the
    rendering of a conversation is not a prefix of the rendering of its continuation once a new
    user message arrives (the template is not append-only).
    """
    parts: list[str] = []
    rest = list(messages)
    if tools:
        system = ""
        if rest and rest[0].get("role") == "system":
            system = content_text(rest.pop(0).get("content")) + "\n\n"
        lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        parts.append(
            f"<|im_start|>system\n{system}{TOOLS_PREAMBLE}{lines}{TOOLS_POSTAMBLE}<|im_end|>\n"
        )
    last_user = max((i for i, m in enumerate(rest) if m.get("role") == "user"), default=-1)
    for i, message in enumerate(rest):
        role = str(message.get("role", ""))
        if role == "tool":
            # Consecutive tool results share one user turn, as in Qwen3's template.
            prev_tool = i > 0 and rest[i - 1].get("role") == "tool"
            next_tool = i + 1 < len(rest) and rest[i + 1].get("role") == "tool"
            body = f"\n<tool_response>\n{content_text(message.get('content'))}\n</tool_response>"
            parts.append(("" if prev_tool else "<|im_start|>user") + body)
            if not next_tool:
                parts.append("<|im_end|>\n")
            continue
        if role == "assistant":
            keys = () if drop_past_reasoning and i < last_user else reasoning_keys
            body = assistant_text(message, keys, reparse_tool_arguments)
        else:
            body = content_text(message.get("content"))
        parts.append(f"<|im_start|>{role}\n{body}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
