"""The fake vLLM's Llama-2-style chat template (``FakeVLLM(chat_template="llama2")``).

Llama-2's chat template (its ``tokenizer_config.json``) closes an assistant turn with a plain
token before the end-of-sequence token: ``' ' + content.strip() + ' ' + eos_token``. A model
samples the end-of-sequence token without that space, so the close holds a token the model
never samples, before the one it stops on: what token-in must place without doubling either
(docs/token-in.md, "Where the close is placed"). Here, over the fake's tokenizer (`_template`),
whose end-of-sequence token is ``<|im_end|>`` (as the tiny vLLM's, scripts/tiny_vllm.py)::

    [INST] <<SYS>>\\n{system}\\n\\n{tools preamble}\\n<</SYS>>\\n\\n{user} [/INST]
     {assistant content, stripped}{\\n<tool_call>...</tool_call> per call} <|im_end|>
    [INST] <tool_response>\\n{result}\\n</tool_response> [/INST]

(no line breaks between turns). Llama-2's own layout, with three changes for an agent: the
``<s>`` it writes before every ``[INST]`` is left out (the fake's vocabulary has none), tool
calls are written as the ChatML template's hermes blocks (the fake's tool parser reads those),
and consecutive tool results share one ``[INST]`` turn. The assistant's reasoning is not
rendered (Llama-2's template reads only ``content``); the generation prompt is empty (the
answer follows ``[/INST]``, as Llama-2's template ignores ``add_generation_prompt``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ._template import TOOLS_POSTAMBLE, TOOLS_PREAMBLE, assistant_text, content_text

__all__ = ["LLAMA2_CLOSE", "render_llama2"]

#: What the template writes after an assistant turn's content: a space, then the end of sequence.
LLAMA2_CLOSE = " <|im_end|>"


def render_llama2(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    *,
    reparse_tool_arguments: bool = False,
) -> str:
    """The prompt text for a conversation (the module docstring's layout)."""
    rest = list(messages)
    system = ""
    if rest and rest[0].get("role") == "system":
        system = content_text(rest.pop(0).get("content"))
    if tools:
        lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        system = (system + "\n\n" if system else "") + TOOLS_PREAMBLE + lines + TOOLS_POSTAMBLE
    parts: list[str] = []
    for i, message in enumerate(rest):
        role = message.get("role")
        if role == "assistant":
            body = assistant_text(message, (), reparse_tool_arguments)
            parts.append(" " + body.strip() + LLAMA2_CLOSE)
            continue
        if role == "tool":
            prev_tool = i > 0 and rest[i - 1].get("role") == "tool"
            next_tool = i + 1 < len(rest) and rest[i + 1].get("role") == "tool"
            body = f"<tool_response>\n{content_text(message.get('content'))}\n</tool_response>"
            parts.append(("\n" if prev_tool else "[INST] ") + body)
            if not next_tool:
                parts.append(" [/INST]")
            continue
        text = content_text(message.get("content")).strip()
        if system:
            text = f"<<SYS>>\n{system}\n<</SYS>>\n\n{text}"
            system = ""
        parts.append(f"[INST] {text} [/INST]")
    return "".join(parts)
