"""The fake vLLM's Llama-2-style template (``FakeVLLM(chat_template="llama2")``): every route
renders and answers with it alike, and an answer may end on the model's other end of sequence
(``Turn(stop_token="<|endoftext|>")``) as vLLM 0.32 answers one (``stop_reason: 0``, measured on
the tiny vLLM). What vLLM itself renders with such a template: tests/e2e/test_vllm_llama2.py."""

from __future__ import annotations

from typing import Any

import pytest

from capture_proxy.testing.fake_vllm import FakeToolCall, FakeVLLM, Turn, main
from capture_proxy.testing.fake_vllm._template import IM_END, SPECIAL_TOKENS, decode
from tests.testing.test_fake_token_in import DERENDER, GENERATE, RENDER, post, stream_events
from tests.testing.test_fake_vllm import Serve, chat, chat_stream, serve

__all__ = ["serve"]

ENDOFTEXT = SPECIAL_TOKENS["<|endoftext|>"]
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": " List. "},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
    {"role": "tool", "tool_call_id": "c1", "content": "b.py"},
    {"role": "assistant", "content": " Two files. ", "reasoning_content": "unseen"},
    {"role": "user", "content": "Thanks."},
]


def test_the_llama2_template_closes_an_assistant_turn_with_a_space_then_the_end_of_sequence() -> (
    None
):
    fake = FakeVLLM(chat_template="llama2")
    text = decode(fake.tokenize_chat(CONVERSATION, TOOLS))
    assert text.startswith("[INST] <<SYS>>\nBe brief.\n\n# Tools\n")
    assert text.endswith(
        "<</SYS>>\n\nList. [/INST]"
        ' <tool_call>\n{"name": "bash", "arguments": {}}\n</tool_call> <|im_end|>'
        "[INST] <tool_response>\na.py\n</tool_response>\n<tool_response>\nb.py\n"
        "</tool_response> [/INST] Two files. <|im_end|>[INST] Thanks. [/INST]"
    )
    # The generation prompt is empty: the answer follows `[/INST]`.
    assert fake.tokenize_chat(CONVERSATION, TOOLS, add_generation_prompt=False) == (
        fake.tokenize_chat(CONVERSATION, TOOLS)
    )
    with pytest.raises(ValueError, match="chat_template"):
        FakeVLLM(chat_template="llama3")


async def test_render_tokenize_and_chat_render_the_llama2_template_alike(serve: Serve) -> None:
    fake, client = await serve(Turn("ok"), scale_out=True, chat_template="llama2")
    body = {"messages": CONVERSATION, "tools": TOOLS}
    rendered = (await post(client, RENDER, body))["token_ids"]
    tokenized = (await post(client, "/tokenize", body))["tokens"]
    answer = await chat(client, {**body, "return_token_ids": True})
    assert rendered == tokenized == answer["prompt_token_ids"] == fake.tokenize_chat(*body.values())
    # A continued final message ends inside it, without the close.
    messages = [*CONVERSATION[:2], {"role": "assistant", "content": "Partly"}]
    cont = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    ids = (await post(client, RENDER, cont))["token_ids"]
    assert decode(ids).endswith("[/INST] Partly")


@pytest.mark.parametrize("template", ["chatml", "llama2"])
async def test_an_answer_ending_on_the_other_end_of_sequence_says_stop_reason_0(
    serve: Serve, template: str
) -> None:
    turns = [Turn("Other.", stop_token="<|endoftext|>") for _ in range(3)]
    _, client = await serve(*turns, scale_out=True, chat_template=template)
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi."}]}
    unary = (await chat(client, {**body, "return_token_ids": True}))["choices"][0]
    assert (unary["message"]["content"], unary["finish_reason"]) == ("Other.", "stop")
    assert (unary["stop_reason"], unary["token_ids"][-1]) == (0, ENDOFTEXT)
    streamed = await chat_stream(client, body)
    text = "".join(c["delta"].get("content") or "" for e in streamed for c in e["choices"])
    last = [c for e in streamed for c in e["choices"] if c.get("finish_reason")]
    assert text == "Other."
    assert [(c["finish_reason"], c["stop_reason"]) for c in last] == [("stop", 0)]
    rendered = await post(client, RENDER, body)
    generated = await post(client, GENERATE, rendered)
    choice = generated["choices"][0]
    assert (choice["token_ids"][-1], choice["stop_reason"]) == (ENDOFTEXT, 0)
    derendered = await post(
        client,
        DERENDER,
        {
            "generate_response": generated,
            "prompt_token_ids": rendered["token_ids"],
            "chat_request": body,
        },
    )
    assert derendered["choices"][0]["message"]["content"] == "Other."


async def test_a_llama2_generation_ends_on_the_sampled_end_of_sequence_without_the_space(
    serve: Serve,
) -> None:
    turn = Turn(tool_calls=[FakeToolCall("bash", {})])
    _, client = await serve(turn, scale_out=True, chat_template="llama2")
    rendered = await post(client, RENDER, {"messages": CONVERSATION[:2], "tools": TOOLS})
    events = await stream_events(client, {**rendered, "stream": True})
    ids = [t for e in events for c in e["choices"] for t in c["token_ids"]]
    assert decode(ids).endswith("</tool_call><|im_end|>")
    assert ids[-1] == IM_END


def test_the_command_line_names_the_templates_it_has(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--chat-template", "llama3"])
    err = capsys.readouterr().err
    assert "--chat-template: invalid choice: 'llama3'" in err
    assert "chatml" in err
    assert "llama2" in err
