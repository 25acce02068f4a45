"""Capture vLLM 0.32's token-in routes into tests/fixtures/vllm-0.32.0/token-in/ (re-runnable).

    python scripts/capture_token_in_fixtures.py [--port P] [--plain-port Q] [--out DIR]
        [--skip-plain | --only-plain]

Without `--port`, starts the tiny CPU vLLM (scripts/tiny_vllm.py) with `--enable-scale-out` and
`VLLM_SERVER_DEV_MODE=1` on a free loopback port, captures, and stops it; without
`--plain-port`, starts it again without either to capture the 403s and 404s. A given port is
used as is (a server started by hand with `tiny_vllm.py serve`). Every request is small and
greedy and has a timeout, so a run costs two server starts (~1 min each) and a few seconds.

What the experiments found is written to `experiments.json` beside the fixtures; the docs
(docs/upstream-facts.md, "Token-in routes") state it in words.
"""

from __future__ import annotations

import argparse
import copy
import http.client
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Run as a script from any directory: the repo root on the path makes `scripts` importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import contextlib

from scripts import tiny_vllm

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "vllm-0.32.0" / "token-in"
TIMEOUT_S = 60.0
MODEL = tiny_vllm.SERVED_MODEL_NAME

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a shell agent."}
USER = {"role": "user", "content": "List the files here."}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "bash", "arguments": '{"command":"ls"}'},
}

# A plain chat: greedy, short, logprobs on (the settings a capture asks for).
PLAIN: dict[str, Any] = {
    "model": MODEL,
    "messages": [SYSTEM, USER],
    "max_tokens": 6,
    "temperature": 0,
    "logprobs": True,
    "top_logprobs": 1,
}
# Tools and a replayed assistant turn with reasoning and a tool result. The random model is
# steered into a real tool call with a regex (as tool-call-request.json does), which also shows
# whether render carries `structured_outputs` into `sampling_params`.
TOOLS_CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [
        SYSTEM,
        USER,
        {
            "role": "assistant",
            "content": "",
            "reasoning": "I will list them.",
            "tool_calls": [CALL],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\nb.txt\n"},
    ],
    "tools": TOOLS,
    "tool_choice": "auto",
    "max_tokens": 60,
    "temperature": 0,
    "structured_outputs": {
        "regex": '<tool_call>\n\\{"name": "bash", "arguments": \\{"command": "ls -la"\\}\\}\n'
        "</tool_call>"
    },
    "chat_template_kwargs": {"enable_thinking": False},
}
# A final assistant message to continue: no generation prompt, no end-of-turn after it.
CONTINUE: dict[str, Any] = {
    "model": MODEL,
    "messages": [SYSTEM, USER, {"role": "assistant", "content": "Here are"}],
    "add_generation_prompt": False,
    "continue_final_message": True,
    "max_tokens": 6,
    "temperature": 0,
}


class Http:
    """JSON over one loopback port, answers kept whole (status, bytes)."""

    def __init__(self, port: int) -> None:
        self.port = port

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, body: Any = None, want: int = 200) -> Any:
        status, raw = self.call(method, path, body)
        if status != want:
            raise RuntimeError(f"{method} {path}: {status} (wanted {want}): {raw[:500]!r}")
        return json.loads(raw)

    def stream(self, path: str, body: Any, on_event: Callable[[int], None] | None = None) -> bytes:
        """POST and read an SSE answer to its end; `on_event(n)` after each `data:` line."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
        try:
            conn.request(
                "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"POST {path}: {resp.status}: {resp.read()[:500]!r}")
            raw = b""
            seen = 0
            while line := resp.readline():
                raw += line
                if line.startswith(b"data: {"):
                    seen += 1
                    if on_event is not None:
                        on_event(seen)
            return raw
        finally:
            conn.close()


def events(raw: bytes) -> Iterator[Any]:
    for line in raw.decode().split("\n"):
        if line.startswith("data: {"):
            yield json.loads(line[len("data: ") :])


class Saver:
    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)

    def json(self, name: str, value: Any) -> None:
        (self.out / name).write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")

    def raw(self, name: str, value: bytes) -> None:
        (self.out / name).write_bytes(value)


def capture_scale_out(api: Http, save: Saver) -> dict[str, Any]:
    found: dict[str, Any] = {}

    # --- render ---
    renders: dict[str, Any] = {}
    for name, body in (("chat", PLAIN), ("tools", TOOLS_CHAT), ("continue", CONTINUE)):
        save.json(f"render-{name}-request.json", body)
        renders[name] = api.json("POST", "/v1/chat/completions/render", body)
        save.json(f"render-{name}-response.json", renders[name])
    # The same messages with the generation prompt (the default) vs continued: where they part.
    opened = api.json(
        "POST",
        "/v1/chat/completions/render",
        {**CONTINUE, "add_generation_prompt": True, "continue_final_message": False},
    )
    cont = renders["continue"]["token_ids"]
    found["continue_final_message"] = {
        "continued_len": len(cont),
        "closed_len": len(opened["token_ids"]),
        "continued_is_prefix_of_closed": opened["token_ids"][: len(cont)] == cont,
        "continued_tail": cont[-4:],
        "closed_tail": opened["token_ids"][-6:],
    }
    no_gen = api.json(
        "POST",
        "/v1/chat/completions/render",
        {**PLAIN, "add_generation_prompt": False},
    )
    found["add_generation_prompt_false"] = {
        "len_with": len(renders["chat"]["token_ids"]),
        "len_without": len(no_gen["token_ids"]),
        "without_is_prefix_of_with": renders["chat"]["token_ids"][: len(no_gen["token_ids"])]
        == no_gen["token_ids"],
    }
    sp_tools = renders["tools"]["sampling_params"]
    found["sampling_params_carry"] = {
        "structured_outputs": sp_tools.get("structured_outputs"),
        "chat_logprobs_true_top_1": renders["chat"]["sampling_params"].get("logprobs"),
        "tools_no_logprobs": sp_tools.get("logprobs"),
        "continue_no_logprobs": renders["continue"]["sampling_params"].get("logprobs"),
        "max_tokens": renders["chat"]["sampling_params"].get("max_tokens"),
    }

    found["default_max_tokens"] = capture_default_limit(api, save)

    # --- generate, non-streamed and streamed, then derender each way ---
    for name, chat in (("chat", PLAIN), ("tools", TOOLS_CHAT)):
        gen_req = renders[name]
        save.json(f"generate-{name}-request.json", gen_req)
        gen = api.json("POST", "/inference/v1/generate", gen_req)
        save.json(f"generate-{name}-response.json", gen)
        der_req = {
            "generate_response": gen,
            "prompt_token_ids": gen_req["token_ids"],
            "chat_request": chat,
        }
        save.json(f"derender-{name}-request.json", der_req)
        save.json(
            f"derender-{name}-response.json",
            api.json("POST", "/v1/chat/completions/derender", der_req),
        )
        stream_req = {**gen_req, "stream": True, "stream_options": {"include_usage": True}}
        save.json(f"generate-{name}-stream-request.json", stream_req)
        raw = api.stream("/inference/v1/generate", stream_req)
        save.raw(f"generate-{name}-stream.sse", raw)
        # Call i sends SSE event i with the previous answer's `stream_state` (None first) and
        # the same prompt ids and chat request each time; only call 0's request is kept whole
        # (the others follow from it, the .sse and the answers), to keep the file small.
        answers: list[Any] = []
        first: Any = None
        state: Any = None
        for chunk in events(raw):
            req = {
                "stream": True,
                "generate_chunk": chunk,
                "stream_state": state,
                "prompt_token_ids": gen_req["token_ids"],
                "chat_request": chat,
            }
            first = first or req
            answer = api.json("POST", "/v1/chat/completions/derender", req)
            answers.append(answer)
            state = answer["stream_state"]
        save.json(f"derender-{name}-stream.json", {"first_request": first, "responses": answers})
    found["derender_resend"] = derender_resend(api, renders["tools"], TOOLS_CHAT)

    # --- dev mode: weight version and pause ---
    save.json("weight-info.json", api.json("GET", "/weight_info"))
    update = {"new_version": "step-1"}
    save.json("update-weight-version-request.json", update)
    save.json(
        "update-weight-version-response.json", api.json("POST", "/update_weight_version", update)
    )
    save.json("weight-info-after-update.json", api.json("GET", "/weight_info"))
    found["weight_versions"] = weight_spans(api, renders["chat"], save)
    save.json("is-paused-before.json", api.json("GET", "/is_paused"))
    save.json("pause-response.json", api.json("POST", "/pause?mode=keep"))
    save.json("is-paused-while-paused.json", api.json("GET", "/is_paused"))
    save.json("resume-response.json", api.json("POST", "/resume"))
    save.json("is-paused-after.json", api.json("GET", "/is_paused"))
    save.json(
        "update-weight-version-back.json",
        api.json("POST", "/update_weight_version", {"new_version": "default"}),
    )
    return found


def capture_default_limit(api: Http, save: Saver) -> dict[str, Any]:
    """A render asked for `max_tokens: 16`, SamplingParams' default: its answer leaves the key
    out, and generate given that answer back samples past 16 tokens (the proxy must say it)."""
    body = {**PLAIN, "max_tokens": 16}
    save.json("render-max-tokens-16-request.json", body)
    rendered = api.json("POST", "/v1/chat/completions/render", body)
    save.json("render-max-tokens-16-response.json", rendered)
    seen = 0

    def on_event(n: int) -> None:
        nonlocal seen
        seen = n
        if n > 32:  # one event per token: enough to tell (unbounded, it runs to the context)
            raise _Enough

    with contextlib.suppress(_Enough):
        api.stream("/inference/v1/generate", {**rendered, "stream": True}, on_event)
    return {
        "max_tokens_in_answer": "max_tokens" in rendered["sampling_params"],
        "generate_events_past_16": seen > 16,
    }


class _Enough(Exception):
    """Stops reading a stream that has shown what it had to."""


def derender_resend(api: Http, rendered: Any, chat: Any) -> dict[str, Any]:
    """Streamed derender with a parser configured: which calls need the prompt ids and the chat
    request, and whether sending them on the first call only still gives the same chunks."""
    body = {**rendered, "stream": True}
    chunks = list(events(api.stream("/inference/v1/generate", body)))
    out: dict[str, Any] = {"chunks": len(chunks)}

    def run(first_only: bool, keys: tuple[str, ...]) -> tuple[list[Any], list[Any]]:
        state: Any = None
        got: list[Any] = []
        errors: list[Any] = []
        for i, chunk in enumerate(chunks):
            req: dict[str, Any] = {"stream": True, "generate_chunk": chunk, "stream_state": state}
            if not first_only or i == 0:
                full = {"prompt_token_ids": rendered["token_ids"], "chat_request": chat}
                req.update({k: full[k] for k in keys})
            status, raw = api.call("POST", "/v1/chat/completions/derender", req)
            if status != 200:
                errors.append({"call": i, "status": status, "body": json.loads(raw)})
                return got, errors
            answer = json.loads(raw)
            got.append(answer["chunk"]["choices"])
            state = answer["stream_state"]
        return got, errors

    both = ("prompt_token_ids", "chat_request")
    reference, _ = run(False, both)
    for label, first_only, keys in (
        ("first_call_only", True, both),
        ("no_prompt_ids", False, ("chat_request",)),
        ("no_chat_request", False, ("prompt_token_ids",)),
    ):
        got, errors = run(first_only, keys)
        out[label] = {"errors": errors[:1], "same_choices": got == reference}
    # Bytes per call if everything is resent (the prompt here is short; it scales with it).
    out["state_keys"] = sorted(
        json.loads(
            api.call(
                "POST",
                "/v1/chat/completions/derender",
                {
                    "stream": True,
                    "generate_chunk": chunks[0],
                    "prompt_token_ids": rendered["token_ids"],
                    "chat_request": chat,
                },
            )[1]
        )["stream_state"]
    )
    return out


def weight_spans(api: Http, rendered: Any, save: Saver) -> dict[str, Any]:
    """A streamed generate during which the weight version changes (after its 2nd event), to
    see how `weight_versions` spans are indexed; then a plain one under the new version."""
    body = copy.deepcopy(rendered)
    body["sampling_params"]["max_tokens"] = 48
    body["stream"] = True
    done = threading.Event()

    def on_event(n: int) -> None:
        if n == 2 and not done.is_set():
            done.set()
            # Another connection, while this stream is still open.
            api.json("POST", "/update_weight_version", {"new_version": "step-2"})

    raw = api.stream("/inference/v1/generate", body, on_event)
    save.json("generate-weight-update-stream-request.json", body)
    save.raw("generate-weight-update-stream.sse", raw)
    spans = [
        (i, c.get("weight_versions"), len(c.get("token_ids") or []))
        for i, e in enumerate(events(raw))
        for c in e.get("choices", [])
    ]
    plain = copy.deepcopy(rendered)
    plain["sampling_params"]["max_tokens"] = 48
    gen = api.json("POST", "/inference/v1/generate", plain)
    return {
        "stream_chunks": [
            {"event": i, "tokens": n, "weight_versions": w} for i, w, n in spans if w or n
        ],
        "non_streamed_after": gen["choices"][0].get("weight_versions"),
        "non_streamed_tokens": len(gen["choices"][0].get("token_ids") or []),
    }


#: Steering for the parity captures: close the reasoning (``</think>``, id 4) and lean on the end
#: of turn (``<|im_end|>``, id 2), then a regex writes the answer (tests/e2e/test_vllm.py).
STEER = {"logit_bias": {"4": 100, "2": 50}}


def _steered(regex: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say it."}],
        "temperature": 0,
        "max_tokens": 48,
        **STEER,
        "structured_outputs": {"regex": regex},
        **extra,
    }


def _derender_each(api: Http, raw: bytes, prompt: list[int], chat: Any) -> list[Any]:
    """One streamed derender call per generate event (as `capture_scale_out` does)."""
    answers: list[Any] = []
    state: Any = None
    for chunk in events(raw):
        req = {
            "stream": True,
            "generate_chunk": chunk,
            "stream_state": state,
            "prompt_token_ids": prompt,
            "chat_request": chat,
        }
        answer = api.json("POST", "/v1/chat/completions/derender", req)
        answers.append(answer)
        state = answer["stream_state"]
    return answers


def capture_parity(api: Http, save: Saver, only: str | None = None) -> dict[str, Any]:
    """What derender gives where the chat route gives something else, for the same request
    (docs/upstream-facts.md, "Token-in routes"): `parity-<name>.json` holds the chat request,
    the chat route's answer (unary and streamed), generate's answer (unary and streamed) and
    derender's (unary; streamed, one call per event). `only`: that case alone, its findings
    merged into `parity-experiments.json`."""
    found: dict[str, Any] = {}
    cases = {
        "end-of-turn": _steered(r"Done\."),
        "stop-string": _steered(r"Done\. Gone\.", stop=["on"]),
        "tool-call-length": {
            **_steered(
                '<tool_call>\n\\{"name": "bash", "arguments": '
                '\\{"command": "ls -la /tmp/a/long/path"\\}\\}\n</tool_call>'
            ),
            "tools": TOOLS,
            "max_tokens": 34,
        },
        # A final assistant message whose reasoning closed, continued: render says the prompt
        # ended the reasoning, the chat route counts the content it writes as reasoning.
        "continued-after-reasoning": {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": "Say it."},
                {"role": "assistant", "reasoning_content": "Fine.", "content": "Ok"},
            ],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "temperature": 0,
            "max_tokens": 8,
        },
        # With `return_tokens_as_token_ids`, the chat route writes logprob tokens as
        # "token_id:N" (a top entry's bytes too); derender does not read that key.
        "logprobs-as-token-ids": _steered(
            r"Done\. é",
            logprobs=True,
            top_logprobs=2,
            return_tokens_as_token_ids=True,
            return_token_ids=True,
        ),
        # A named tool choice: the chat route's finish is "stop" (not "tool_calls"), its tool
        # call ids `chatcmpl-tool-<16 hex>`; derender's unary ids are bare 16 hex. A bias on
        # `}` (id 101) ends the arguments the structured output writes.
        "tool-call-named": {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say it."}],
            "temperature": 0,
            "max_tokens": 64,
            "logit_bias": {"4": 100, "101": 30},
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "bash"}},
        },
        # A stop string inside a tool call's arguments: the chat route's stream cuts the
        # arguments there and says "tool_calls"; derender's stream has them whole.
        "tool-call-stop-string": {
            **_steered(
                '<tool_call>\n\\{"name": "bash", "arguments": '
                '\\{"command": "ls -la"\\}\\}\n</tool_call>'
            ),
            "tools": TOOLS,
            "max_tokens": 64,
            "stop": ["la"],
        },
        # `stream_options.continuous_usage_stats`: usage on every chunk of the chat route's
        # stream (its `stream_options`, taken out of the chat request: unary refuses them).
        "continuous-usage": {
            **_steered(r"Done\."),
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    }
    if only is not None:
        cases = {only: cases[only]}
    for name, case in cases.items():
        chat = {k: v for k, v in case.items() if k != "stream_options"}
        options = case.get("stream_options", {"include_usage": True})
        rendered = api.json("POST", "/v1/chat/completions/render", chat)
        gen = api.json("POST", "/inference/v1/generate", rendered)
        prompt = rendered["token_ids"]
        unary = api.json(
            "POST",
            "/v1/chat/completions/derender",
            {"generate_response": gen, "prompt_token_ids": prompt, "chat_request": chat},
        )
        stream_req = {**rendered, "stream": True, "stream_options": {"include_usage": True}}
        raw = api.stream("/inference/v1/generate", stream_req)
        streamed = _derender_each(api, raw, prompt, chat)
        chat_unary = api.json("POST", "/v1/chat/completions", chat)
        chat_stream = api.stream(
            "/v1/chat/completions",
            {**chat, "stream": True, "stream_options": options},
        ).decode()
        save.json(
            f"parity-{name}.json",
            {
                "chat_request": chat,
                **({"chat_stream_options": options} if "stream_options" in case else {}),
                "prompt_token_ids": prompt,
                "chat_response": chat_unary,
                "chat_stream": chat_stream,
                "generate_response": gen,
                "generate_stream": raw.decode(),
                "derender_response": unary,
                "derender_stream": streamed,
            },
        )
        deltas = [a["chunk"]["choices"][0]["delta"] for a in streamed if a["chunk"]["choices"]]
        finishes = [
            c["finish_reason"]
            for a in streamed
            for c in a["chunk"]["choices"]
            if c["finish_reason"]
        ]
        found[name] = {
            "generate_finish": gen["choices"][0]["finish_reason"],
            "generate_stop_reason": gen["choices"][0]["stop_reason"],
            "chat_content": chat_unary["choices"][0]["message"]["content"],
            "derender_content": unary["choices"][0]["message"]["content"],
            "derender_stream_content": "".join(d.get("content") or "" for d in deltas),
            "derender_stream_finish": finishes[-1] if finishes else None,
            "chat_usage": chat_unary["usage"],
            "derender_usage": unary["usage"],
            "reasoning_ended": rendered["reasoning_ended"],
        }
    if only is not None:
        path = save.out / "parity-experiments.json"
        merged = {**json.loads(path.read_text()), **found}
        save.json("parity-experiments.json", merged)
        return found
    # The last event again, without its end-of-turn id: derender gives no text for it.
    case = json.loads((save.out / "parity-end-of-turn.json").read_text())
    chunks = list(events(case["generate_stream"].encode()))
    k = max(i for i, e in enumerate(chunks) if e["choices"])
    stripped = copy.deepcopy(chunks[k])
    stripped["choices"][0]["token_ids"] = stripped["choices"][0]["token_ids"][:-1]
    for label, chunk in (("alone", chunks[k]), ("without_its_id", stripped)):
        answer = api.json(
            "POST",
            "/v1/chat/completions/derender",
            {
                "stream": True,
                "generate_chunk": chunk,
                "stream_state": case["derender_stream"][k - 1]["stream_state"] if k else None,
                "prompt_token_ids": case["prompt_token_ids"],
                "chat_request": case["chat_request"],
            },
        )
        found["end-of-turn"][f"last_chunk_{label}"] = answer["chunk"]["choices"][0]
    save.json("parity-experiments.json", found)
    return found


def capture_plain(api: Http, save: Saver) -> None:
    """Without `--enable-scale-out` and dev mode: what the same routes answer."""
    gen_body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1}}
    for name, method, path, body in (
        ("render", "POST", "/v1/chat/completions/render", PLAIN),
        ("generate", "POST", "/inference/v1/generate", gen_body),
        ("derender", "POST", "/v1/chat/completions/derender", {"generate_response": {}}),
        ("weight-info", "GET", "/weight_info", None),
    ):
        status, raw = api.call(method, path, body)
        save.json(f"disabled-{name}.json", {"status": status, "body": json.loads(raw)})


def with_server(port: int | None, scale_out: bool, job: Callable[[Http], None]) -> None:
    if port is not None:
        job(Http(port))
        return
    port = tiny_vllm.free_port()
    began = time.monotonic()
    proc = tiny_vllm.start(None, port, scale_out=scale_out, dev_mode=scale_out)
    print(f"vLLM up on {port} in {time.monotonic() - began:.0f} s", flush=True)
    try:
        job(Http(port))
    finally:
        tiny_vllm.stop(proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, help="a running server with scale-out and dev mode")
    parser.add_argument("--plain-port", type=int, help="a running server without either")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--skip-plain", action="store_true", help="do not capture the 403s")
    parser.add_argument("--only-plain", action="store_true", help="capture only the 403s")
    parser.add_argument(
        "--only-parity", action="store_true", help="capture only the parity-*.json cases"
    )
    parser.add_argument("--parity-case", help="with --only-parity: that case alone")
    args = parser.parse_args(argv)
    save = Saver(args.out)
    found: dict[str, Any] = {}
    if args.only_parity:
        with_server(
            args.port,
            True,
            lambda api: print(json.dumps(capture_parity(api, save, args.parity_case))),
        )
        return 0

    def scale_out(api: Http) -> None:
        found.update(capture_scale_out(api, save))
        save.json("version.json", api.json("GET", "/version"))

    if not args.only_plain:
        with_server(args.port, True, scale_out)
        save.json("experiments.json", found)
    if not args.skip_plain:
        with_server(args.plain_port, False, lambda api: capture_plain(api, save))
    print(f"saved into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
