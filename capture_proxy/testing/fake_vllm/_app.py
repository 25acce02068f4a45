"""A scriptable fake vLLM 0.32 server, shipped for tests and first runs (like httpx MockTransport).

It speaks vLLM's OpenAI protocol as observed in ``fixtures/vllm-0.32.0``: the same body and chunk
shapes, token ids, logprobs, error bodies and quirks, over a deterministic byte-level tokenizer
and a Qwen3-like ChatML template (`_template`). Answers come from a queue of
scripted `Turn` s, else from ``script(request)``, else a default echo answer.

In a test::

    fake = FakeVLLM()
    ls = FakeToolCall("bash", {"command": "ls"})
    fake.push(Turn("", reasoning="look first", tool_calls=[ls]))
    client = await aiohttp_client(fake.app())
    ...
    assert fake.responses[0]["completion_token_ids"] == staged.completion_token_ids

Standalone: ``python -m capture_proxy.fake_vllm --port 8000`` (binds 127.0.0.1), or
``capture-proxy serve --upstream fake``.

Routes: ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /version``, ``POST /tokenize``,
``POST /detokenize``, ``GET /health``; with ``scale_out`` the token-in routes ``POST
/v1/chat/completions/render``, ``POST /inference/v1/generate`` and ``POST
/v1/chat/completions/derender`` (403 without, as vLLM; `_generate`, `_derender`); with
``dev_mode`` ``GET /weight_info``, ``POST /update_weight_version``, ``POST /pause``, ``POST
/resume`` and ``GET /is_paused`` (404 without). Paused, the fake holds a new generation until
``/resume`` (as vLLM's scheduler stops scheduling), rather than refusing it.
With ``api_key`` every ``/v1`` route wants
``Authorization: Bearer <key>`` (401 ``{"error": "Unauthorized"}`` otherwise, as vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiohttp import web

from ._answer import answer_for
from ._faults import Fault, FaultKind
from ._generation import FakeToolCall, Plan, Turn, default_turn
from ._http import (
    complete_response,
    fault_response,
    json_response,
    read_json,
    wait_connected,
    write_stream,
)
from ._llama2 import render_llama2
from ._protocol import model_list
from ._render import weight_version_update
from ._scale_out import ScaleOutRoutes
from ._script import load_script
from ._template import decode, encode, reasoning_keys_for, render_chat, token_text
from ._validate import RequestError, check_model, output_limit, require_messages

__all__ = ["CHAT_TEMPLATES", "FakeToolCall", "FakeVLLM", "Fault", "Turn", "main", "serve_fake"]

#: The templates the fake renders with (`FakeVLLM`'s ``chat_template``).
CHAT_TEMPLATES = ("chatml", "llama2")

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FakeVLLM(ScaleOutRoutes):
    """A fake vLLM server. Build the aiohttp app with `app`; script answers with `push`.

    Attributes for assertions: ``requests`` (every chat and generate request body, decoded),
    ``request_headers`` (their headers, e.g. to see which ``Authorization`` arrived), ``responses``
    (per generated answer: ``id``, ``stream``, ``prompt_token_ids``, ``completion_token_ids``,
    ``logprobs`` (float32 values), ``finish_reason``, ``fault``; recorded before any fault, so
    it is what the upstream produced), ``aborted`` (generations cut off by the client leaving).

    ``version`` decides which replayed reasoning keys are read (0.16–0.21: only ``reasoning``)
    and the output key. ``latency`` delays every answer's first byte, ``chunk_delay`` each further
    stream event. ``reparse_tool_arguments`` renders replayed tool arguments re-serialized (as real
    vLLM + Qwen3 does) instead of verbatim. ``routed_experts`` answers as a server started with
    ``--enable-return-routed-experts`` does: every choice carries ``routed_experts``, honouring
    the request's ``routed_experts_prompt_start`` (the values: `_experts.experts_for`).
    ``drop_past_reasoning`` renders history as Qwen3's template does: the reasoning of assistant
    turns before the last user message is left out (a template that is not append-only).
    ``chat_template`` picks the template every route renders with (vLLM's ``--chat-template``):
    ``"chatml"`` (Qwen3-like, `_template`) or ``"llama2"`` (Llama-2-style, `_llama2`: an
    assistant turn closes with a space, then ``<|im_end|>``).

    ``generation_config`` holds the model's sampling defaults (``{"temperature": 0.6, "top_p":
    0.95, "top_k": 20}`` for Qwen3), which the render route resolves requests over;
    ``scale_out`` serves that route (vLLM's ``--enable-scale-out``); ``dev_mode`` serves the
    weight-version routes (``VLLM_SERVER_DEV_MODE=1``), whose version is ``weight_version``.
    To imitate a restart, stop one fake's server and start another fake on the same port.
    """

    def __init__(
        self,
        *,
        model: str = "policy",
        version: str = "0.32.0",
        max_model_len: int = 8192,
        latency: float = 0.0,
        chunk_delay: float = 0.0,
        seed: int = 0,
        script: Callable[[dict[str, Any]], Turn] | None = None,
        api_key: str | None = None,
        reparse_tool_arguments: bool = False,
        routed_experts: bool = False,
        generation_config: Mapping[str, Any] | None = None,
        scale_out: bool = False,
        dev_mode: bool = False,
        drop_past_reasoning: bool = False,
        chat_template: str = "chatml",
    ) -> None:
        if chat_template not in CHAT_TEMPLATES:
            raise ValueError(f"chat_template: one of {CHAT_TEMPLATES}, not {chat_template!r}")
        self.model = model
        self.version = version
        self.max_model_len = max_model_len
        self.latency = latency
        self.chunk_delay = chunk_delay
        self.seed = seed
        self.script = script
        self.api_key = api_key
        self.reparse_tool_arguments = reparse_tool_arguments
        self.routed_experts = routed_experts
        self.generation_config: dict[str, Any] = dict(generation_config or {})
        self.scale_out = scale_out
        self.dev_mode = dev_mode
        self.drop_past_reasoning = drop_past_reasoning
        self.chat_template = chat_template
        self.weight_version = "default"
        #: Cleared by ``POST /pause``: a new chat call waits for ``POST /resume``.
        self.running = asyncio.Event()
        self.running.set()
        #: Requests per route other than chat (``"/version"``, ``"/weight_info"``, ...).
        self.route_hits: collections.Counter[str] = collections.Counter()
        #: Request body bytes received per route (every route, ``Content-Length``), so a test can
        #: hold what a client sends upstream to a bound.
        self.body_bytes: collections.Counter[str] = collections.Counter()
        self.requests: list[dict[str, Any]] = []
        self.request_headers: list[dict[str, str]] = []
        self.responses: list[dict[str, Any]] = []
        self.aborted = 0
        self.created = int(time.time())
        self.fingerprint = f"vllm-{version}-{hashlib.sha256(model.encode()).hexdigest()[:8]}"
        self._queue: collections.deque[Turn] = collections.deque()
        # What each generate call planned, by request id, so derender parses the ids as the
        # fake generated them (bounded: a test double, not a cache anyone relies on).
        self._plans: collections.OrderedDict[str, Plan] = collections.OrderedDict()
        # Multimodal items render processed, by hash (vLLM's processor cache): `_features`.
        self._mm_cache: dict[str, str] = {}
        self._rng = random.Random(seed)
        self._perm_id = f"modelperm-{self._hex()}"

    def _hex(self) -> str:
        return f"{self._rng.getrandbits(64):016x}"

    def push(self, *turns: Turn) -> None:
        """Queue answers, used in order; then ``script(request)`` if given, else a default."""
        self._queue.extend(turns)

    def tokenize_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt ids this server renders for a conversation (as ``/tokenize`` and chat do).

        ``chat_template_kwargs`` is accepted for symmetry; the template does not depend on it.
        """
        del chat_template_kwargs
        return encode(self._render(messages, tools, add_generation_prompt))

    def _render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None, gen: bool
    ) -> str:
        if self.chat_template == "llama2":
            return render_llama2(
                messages, tools, reparse_tool_arguments=self.reparse_tool_arguments
            )
        return render_chat(
            messages,
            tools,
            add_generation_prompt=gen,
            reasoning_keys=reasoning_keys_for(self.version),
            reparse_tool_arguments=self.reparse_tool_arguments,
            drop_past_reasoning=self.drop_past_reasoning,
        )

    def app(self) -> web.Application:
        """A fresh aiohttp application serving this fake (all apps share the fake's state)."""
        # vLLM (uvicorn) sets no body limit; aiohttp's default of 1 MiB would refuse images.
        app = web.Application(
            middlewares=[self._count, *([self._auth] if self.api_key is not None else [])],
            client_max_size=1 << 30,
        )
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions/render", self._render_chat)
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_post("/v1/chat/completions/derender", self._derender)
        app.router.add_get("/weight_info", self._weight_info)
        app.router.add_post("/update_weight_version", self._update_weight_version)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        app.router.add_get("/is_paused", self._is_paused)
        return app

    # -- dev-mode routes (_render) -----------------------------------------------------------

    async def _weight_info(self, request: web.Request) -> web.Response:
        self.route_hits[request.path] += 1
        if not self.dev_mode:
            return json_response(404, {"detail": "Not Found"})
        return json_response(200, {"weight_version": self.weight_version})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        self.route_hits[request.path] += 1
        if not self.dev_mode:
            return json_response(404, {"detail": "Not Found"})
        try:
            self.weight_version = weight_version_update(await read_json(request))
        except RequestError as exc:
            return exc.response()
        return json_response(200, {"success": True, "new_version": self.weight_version})

    async def _pause(self, request: web.Request) -> web.Response:
        self.route_hits[request.path] += 1
        if not self.dev_mode:
            return json_response(404, {"detail": "Not Found"})
        self.running.clear()
        return json_response(200, {"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.route_hits[request.path] += 1
        if not self.dev_mode:
            return json_response(404, {"detail": "Not Found"})
        self.running.set()
        return json_response(200, {"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        self.route_hits[request.path] += 1
        if not self.dev_mode:
            return json_response(404, {"detail": "Not Found"})
        return json_response(200, {"is_paused": not self.running.is_set()})

    @web.middleware
    async def _count(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        self.body_bytes[request.path] += request.content_length or 0
        return await handler(request)

    @web.middleware
    async def _auth(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        # vLLM checks only /v1 routes; /health, /version and /tokenize stay open.
        if request.path.startswith("/v1"):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or token != self.api_key:
                return json_response(401, {"error": "Unauthorized"})
        return await handler(request)

    async def _models(self, request: web.Request) -> web.Response:
        cards = model_list(self.model, self.created, self.max_model_len, self._perm_id)
        return json_response(200, cards)

    async def _version(self, request: web.Request) -> web.Response:
        self.route_hits[request.path] += 1
        return json_response(200, {"version": self.version})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        # A few of vLLM's own series, in its names and Prometheus' text format (vLLM serves
        # /metrics without its API key).
        served = len(self.requests)
        text = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{self.model}"}} 0.0\n'
            "# HELP vllm:request_success_total Count of successfully processed requests.\n"
            "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{finished_reason="stop",model_name="{self.model}"}} '
            f"{float(served)}\n"
        )
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            check_model(body, self.model)
            if "messages" in body:
                gen = body.get("add_generation_prompt", True) is not False
                ids = encode(self._render(require_messages(body), body.get("tools") or None, gen))
            elif isinstance(body.get("prompt"), str):
                ids = encode(body["prompt"])
            else:
                raise RequestError(400, "Either `prompt` or `messages` must be given.")
        except RequestError as exc:
            return exc.response()
        strs = [token_text(i) for i in ids] if body.get("return_token_strs") else None
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        return json_response(200, {**out, "token_strs": strs})

    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            check_model(body, self.model)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
                raise RequestError(400, "`tokens` must be a list of integers.", param="tokens")
            text = decode(tokens)
        except ValueError as exc:  # an id outside the vocabulary
            return RequestError(400, str(exc), err_type="BadRequestError").response()
        except RequestError as exc:
            return exc.response()
        return json_response(200, {"prompt": text})

    def _next_turn(self, body: dict[str, Any]) -> Turn:
        if self._queue:
            return self._queue.popleft()
        if self.script is not None:
            return self.script(body)
        return default_turn(body)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            resp, aborted = await self._chat_inner(request)
        except asyncio.CancelledError:
            # The test server cancels a handler whose client disconnected.
            self.aborted += 1
            raise
        self.aborted += aborted
        return resp

    async def _chat_inner(self, request: web.Request) -> tuple[web.StreamResponse, bool]:
        try:
            body = await read_json(request)
            self.requests.append(body)
            self.request_headers.append(dict(request.headers))
            check_model(body, self.model)
            prompt_text = self._prompt_text(body)
            prompt_ids = encode(prompt_text)
            limit = output_limit(body, len(prompt_ids), self.max_model_len)
        except RequestError as exc:
            return exc.response(), False
        await self.running.wait()  # held while paused (POST /pause), as vLLM holds generation
        turn = self._next_turn(body)
        fault = turn.fault
        if fault is not None and fault.kind is FaultKind.HTTP_ERROR:
            return fault_response(fault), False
        if fault is not None and fault.kind is FaultKind.HANG:
            await wait_connected(request, None)
            return web.Response(), True
        delay = self.latency + (fault.seconds if fault is not None else 0.0)
        if delay > 0 and not await wait_connected(request, delay):
            return web.Response(), True
        answer = answer_for(
            body,
            turn,
            prompt_ids=prompt_ids,
            prompt_text=prompt_text,
            limit=limit,
            model=self.model,
            fingerprint=self.fingerprint,
            version=self.version,
            seed=self.seed,
            new_id=lambda prefix: f"{prefix}{self._hex()}",
            routed_experts=self.routed_experts,
        )
        self.responses.append(answer.record())
        if body.get("stream"):
            return await write_stream(request, answer, fault, self.chunk_delay)
        return complete_response(request, answer, fault), False


async def serve_fake(
    host: str = "127.0.0.1", port: int = 0, **kwargs: Any
) -> tuple[FakeVLLM, web.AppRunner, str]:
    """Start a `FakeVLLM` (``kwargs`` go to its constructor) on ``host:port`` (0: a free port).

    Returns the fake, the runner (``await runner.cleanup()`` stops it) and the base URL
    ``http://127.0.0.1:PORT`` (without ``/v1``).
    """
    fake = FakeVLLM(**kwargs)
    # A fake answering never (Fault.hang) must not hold a test's teardown for aiohttp's 60 s.
    runner = web.AppRunner(fake.app(), access_log=None, shutdown_timeout=0.25)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return fake, runner, f"http://{host}:{runner.addresses[0][1]}"


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m capture_proxy.fake_vllm``: serve a fake vLLM on 127.0.0.1."""
    parser = argparse.ArgumentParser(
        prog="python -m capture_proxy.fake_vllm", description="Serve a fake vLLM 0.32."
    )
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    parser.add_argument("--model", default="policy", help="served model name")
    parser.add_argument("--version", default="0.32.0", help="vLLM version to imitate")
    parser.add_argument("--max-model-len", type=int, default=8192, help="context length")
    parser.add_argument("--api-key", default=None, help="require this bearer key on /v1 routes")
    parser.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="serve POST /v1/chat/completions/render (as vLLM's flag)",
    )
    parser.add_argument(
        "--dev-mode",
        action="store_true",
        help="serve /weight_info, /update_weight_version, /pause, /resume and /is_paused (vLLM's "
        "VLLM_SERVER_DEV_MODE=1)",
    )
    parser.add_argument(
        "--chat-template",
        choices=CHAT_TEMPLATES,
        default="chatml",
        help="the chat template: chatml (Qwen3-like) or llama2 (an assistant turn closes with "
        "a space, then the end of sequence)",
    )
    parser.add_argument(
        "--generation-config",
        type=_json_object,
        default=None,
        help='the model\'s sampling defaults as JSON, e.g. \'{"temperature": 0.6, "top_k": 20}\'',
    )
    parser.add_argument(
        "--script",
        metavar="FILE",
        default=None,
        help="a JSON array of turns answered in order, then echo answers; a turn is "
        '{"content", "reasoning", "tool_calls": [{"name", "arguments"}], "finish_reason", '
        '"fault": {"kind", ...}}, every key optional',
    )
    args = parser.parse_args(argv)
    turns: list[Turn] = []
    if args.script is not None:
        try:
            turns = load_script(args.script)
        except ValueError as e:
            parser.error(f"--script {e}")
    fake = FakeVLLM(
        model=args.model,
        version=args.version,
        max_model_len=args.max_model_len,
        api_key=args.api_key,
        generation_config=args.generation_config,
        scale_out=args.enable_scale_out,
        dev_mode=args.dev_mode,
        chat_template=args.chat_template,
    )
    fake.push(*turns)
    if args.script is not None:
        print(
            f"fake vLLM: {len(turns)} scripted turn(s) from {args.script}, then echo answers",
            file=sys.stderr,
            flush=True,
        )
    web.run_app(fake.app(), host="127.0.0.1", port=args.port)
