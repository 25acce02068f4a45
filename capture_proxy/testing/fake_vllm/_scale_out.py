"""The fake vLLM's scale-out routes (vLLM's ``--enable-scale-out``): render, generate, derender.

A mixin of `FakeVLLM`: the handlers read the fake's state (its queue of turns, its template, its
weight version) and build their answers with the sans-IO modules `_render`, `_generate`,
`_derender` and `_features` (images). Without ``scale_out`` each answers vLLM's 403 "Scale-out
endpoints are disabled".
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from aiohttp import web

from ._derender import derender_body, derender_stream_answer
from ._faults import FaultKind
from ._features import check_features, render_features
from ._generate import Generation, check_generate, generate_body, generate_events
from ._generation import (
    Plan,
    Turn,
    plan_answer,
    prompt_ends_reasoning,
    sample_logprobs,
    stop_on_strings,
)
from ._http import (
    complete_raw,
    fault_response,
    json_response,
    read_json,
    wait_connected,
    write_events,
)
from ._llama2 import LLAMA2_CLOSE
from ._render import SCALE_OUT_DISABLED, render_answer, resolve_sampling
from ._template import encode
from ._validate import RequestError, check_model, require_messages

__all__ = ["ScaleOutRoutes"]


class ScaleOutRoutes:
    """The render, generate and derender handlers of `FakeVLLM` (see its docstring)."""

    model: str
    max_model_len: int
    latency: float
    chunk_delay: float
    seed: int
    scale_out: bool
    chat_template: str
    generation_config: dict[str, Any]
    weight_version: str
    running: asyncio.Event
    route_hits: collections.Counter[str]
    requests: list[dict[str, Any]]
    request_headers: list[dict[str, str]]
    responses: list[dict[str, Any]]
    aborted: int
    _plans: collections.OrderedDict[str, Plan]
    _mm_cache: dict[str, str]

    def _hex(self) -> str:
        raise NotImplementedError

    def _next_turn(self, body: dict[str, Any]) -> Turn:
        raise NotImplementedError

    def _render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None, gen: bool
    ) -> str:
        raise NotImplementedError

    async def _render_chat(self, request: web.Request) -> web.Response:
        refused = self._scale_out_refusal(request)
        if refused is not None:
            return refused
        try:
            body = await read_json(request)
            check_model(body, self.model)
            ids = self._render_ids(body)
            features = render_features(require_messages(body), ids, self._mm_cache)
        except RequestError as exc:
            return exc.response()
        room = max(self.max_model_len - len(ids), 0)
        sampling = resolve_sampling(body, self.generation_config, room)
        # Deterministic (the fake's random stream belongs to its answers); the shape is vLLM's.
        request_id = f"chatcmpl-{self.route_hits[request.path]:016x}"
        answer = render_answer(body, ids, sampling, self.model, request_id, features)
        return json_response(200, answer)

    def _render_ids(self, body: Mapping[str, Any]) -> list[int]:
        """Render's prompt ids (`_prompt_text`)."""
        return encode(self._prompt_text(body))

    def _prompt_text(self, body: Mapping[str, Any]) -> str:
        """The prompt render and the chat route give: ``add_generation_prompt: false`` leaves out
        the generation prompt; ``continue_final_message: true`` ends inside the final assistant
        message, unclosed (without the template's turn close)."""
        messages = require_messages(body)
        cont = bool(body.get("continue_final_message"))
        if cont and (not messages or messages[-1].get("role") != "assistant"):
            # vLLM refuses this too; its exact wording was not captured.
            raise RequestError(
                400, "continue_final_message is set but the last message is not from the assistant."
            )
        gen = body.get("add_generation_prompt", True) is not False and not cont
        text = self._render(messages, body.get("tools") or None, gen)
        if cont:
            close = LLAMA2_CLOSE if self.chat_template == "llama2" else "<|im_end|>\n"
            text = text.removesuffix(close)
        return text

    def _scale_out_refusal(self, request: web.Request) -> web.Response | None:
        self.route_hits[request.path] += 1
        if self.scale_out:
            return None
        return RequestError(403, SCALE_OUT_DISABLED, err_type="PermissionDeniedError").response()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        refused = self._scale_out_refusal(request)
        if refused is not None:
            return refused
        try:
            body = await read_json(request)
            self.requests.append(body)
            self.request_headers.append(dict(request.headers))
            check_model(body, self.model)
            prompt_ids, sampling = check_generate(body)
            check_features(body.get("features"), prompt_ids, self._mm_cache)
        except RequestError as exc:
            return exc.response()
        await self.running.wait()
        turn = self._next_turn(body)
        fault = turn.fault
        if fault is not None and fault.kind is FaultKind.HTTP_ERROR:
            return fault_response(fault)
        if fault is not None and fault.kind is FaultKind.HANG:
            await wait_connected(request, None)
            return web.Response()
        delay = self.latency + (fault.seconds if fault is not None else 0.0)
        if delay > 0 and not await wait_connected(request, delay):
            self.aborted += 1
            return web.Response()
        g = self._generation(body, turn, prompt_ids, sampling)
        options = body.get("stream_options")
        stream = bool(body.get("stream"))
        self.responses.append(
            {
                "id": g.request_id,
                "stream": stream,
                "prompt_token_ids": list(prompt_ids),
                "completion_token_ids": g.ids,
                "logprobs": g.logprobs[: g.n],
                "finish_reason": g.finish_reason,
                "fault": fault.kind.value if fault is not None else None,
            }
        )
        if not stream:
            for _ in range(g.n):
                g.versions.append(self.weight_version)
            return complete_raw(request, orjson.dumps(generate_body(g)), fault)
        usage = isinstance(options, Mapping) and bool(options.get("include_usage"))
        events = generate_events(g, lambda: self.weight_version, include_usage=usage)
        try:
            resp, aborted = await write_events(request, events, fault, self.chunk_delay)
        except asyncio.CancelledError:
            # The test server cancels a handler whose client disconnected (as the chat route).
            self.aborted += 1
            raise
        self.aborted += aborted
        return resp

    def _generation(
        self,
        body: Mapping[str, Any],
        turn: Turn,
        prompt_ids: list[int],
        sampling: Mapping[str, Any],
    ) -> Generation:
        # vLLM's generate reads render's `reasoning_ended` only for a structured output: the
        # proxy sends it otherwise only when true (`enable_thinking: false`, which this fake's
        # template does not write into the prompt); else the scripted model reads its prompt.
        ended = body.get("reasoning_ended")
        if ended is None:
            ended = prompt_ends_reasoning(prompt_ids, thinking=True)
        plan = plan_answer(
            turn,
            thinking=not ended,
            parse_tools=True,
            new_tool_id=lambda: f"chatcmpl-tool-{self._hex()}",
        )
        room = max(self.max_model_len - len(prompt_ids), 0)
        limit = sampling.get("max_tokens")
        bound = room if limit is None else min(limit, room)
        stop_on_strings(plan, sampling.get("stop"), sampling.get("min_tokens"), bound)
        n = min(len(plan.ids), bound)
        top = sampling.get("logprobs")
        top_k = top if type(top) is int and top >= 0 else None
        logprobs, tops = sample_logprobs(self.seed, prompt_ids, plan.ids[:n], top_k or 0)
        request_id = f"generate-tokens-{body.get('request_id') or f'chatcmpl-{self._hex()}'}"
        self._plans[request_id] = plan
        while len(self._plans) > 1024:
            self._plans.popitem(last=False)
        return Generation(
            request_id=request_id,
            created=int(time.time()),
            model=self.model,
            prompt_ids=prompt_ids,
            plan=plan,
            n=n,
            logprobs=logprobs,
            tops=tops,
            top_k=top_k,
        )

    def _plan_for(self, request_id: str, ids: list[int]) -> Plan | None:
        plan = self._plans.get(request_id)
        if plan is None or plan.ids[: len(ids)] != ids:
            return None
        return plan

    async def _derender(self, request: web.Request) -> web.Response:
        refused = self._scale_out_refusal(request)
        if refused is not None:
            return refused
        try:
            body = await read_json(request)
            check_model(body.get("chat_request") or {}, self.model)
            build = derender_stream_answer if body.get("stream") else derender_body
            answer = build(body, self._plan_for, self.model, int(time.time()))
        except RequestError as exc:
            return exc.response()
        return json_response(200, answer)
