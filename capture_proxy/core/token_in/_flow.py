"""One token-in call's steps: prompt, generate, derender, and what the record says of them.

A token-in call (docs/token-in.md, "The call flow") is prepared, admitted, failed and staged by
the exchange (`capture_proxy.core.exchange`) like any other; what differs is in the one object
the exchange holds for it, `TokenInCall`: `post` renders the call's prompt (`token_in_prompt`)
and posts generate; `finish` derenders a unary answer, `relay` a stream (coalesced, its logprobs
resolved when asked, `StreamedDerender`); `facts` gives the record what generate and the render
said; `continued_by_next` keeps the staged call for the rollout's next token-in call and reports
it to the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import orjson

from ...adapters.vllm import (
    REASONING_MARKERS,
    Completion,
    Derendered,
    DerenderedStream,
    Generated,
    StopCut,
    StreamLogprobs,
    UpstreamProtocolError,
    WeightSpan,
    client_answer,
    count_reasoning_tokens,
    counts_reasoning_from_start,
    derender_body,
    derender_chat_request,
    derender_generate_answer,
    derender_prompt_start,
    encode_ids,
    read_derendered,
    read_generate,
    to_completion,
    without_stop_token_id,
)
from ...errors import UpstreamFailed
from ...schemas.token_in_extras import SegmentBreak, token_in_extras
from ..sampling import RESOLVED_SAMPLING_KEYS, effective_sampling
from ..transport import (
    SCALE_OUT_DISABLED,
    EngineRoute,
    TextTokenizer,
    TokenInTransport,
    UpstreamReply,
    token_in_transport,
)
from ._beside import early_body, mismatch, template_key
from ._bridging import Beside, token_in_prompt_beside
from ._derender import StreamedDerender, post_derender
from ._prompt import TokenInPrompt, token_in_line
from ._report import EXTENDED, NEW_SEGMENT, TokenInReport
from ._values import Prior

if TYPE_CHECKING:
    from ..exchange import Exchange
    from ..pipeline import Outcome

__all__ = ["REQUEST_HEAD", "TokenInCall"]

#: What the token-in call counts for each request's line and headers, beside its body (the
#: lean client's are about 110 bytes; the plain call's own headers are not counted).
REQUEST_HEAD = 128

_DONE = b"data: [DONE]\n\n"
#: Where an SSE event's JSON starts (after ``data: ``).
_DATA = len(b"data: ")


class TokenInCall:
    """The token-in steps of one call, for the `Exchange` that holds it (module docs)."""

    def __init__(self, exchange: Exchange) -> None:
        self._exchange = exchange
        #: The call's prompt (set by `post`).
        self.prompt: TokenInPrompt | None = None
        #: The request rendered for the call, encoded (set by `post`).
        self._render_body = b""
        #: The chat request derender calls send (`derender_chat_request`), encoded (`post`).
        self._derender_chat = b""
        #: The reasoning parser's marker ids (`_reasoning_markers`; None: no reasoning tokens).
        self._markers: tuple[int, int, int | None] | None = None
        #: The call's line of calls (`token_in_line`), hashed once per call (`_token_in_line`).
        self._line: str | None = None
        #: The bytes the call's renders and generate sent, heads counted as `REQUEST_HEAD`.
        self.sent = 0
        #: ``--token-in-beside``: "" (generate waited for the request's render), ``passed``, or
        #: why the generation sent beside it was aborted (`BESIDE_MISMATCHES`).
        self.beside = ""
        #: The record's `token_in_beside_aborted` (None: nothing was aborted).
        self.beside_aborted: SegmentBreak | None = None

    @property
    def _upstream(self) -> TokenInTransport:
        upstream = token_in_transport(self._exchange.upstream)  # the call's replica's, with several
        if upstream is None:
            raise UpstreamFailed(SCALE_OUT_DISABLED, code="scale_out_disabled", status=503)
        return upstream

    @property
    def _token_in_line(self) -> str:
        if self._line is None:
            self._line = token_in_line(self._exchange.request)
        return self._line

    async def post(self) -> UpstreamReply:
        """Render the call's prompt and post it to generate; the reply once its headers are in.
        Raises `RenderRefused` when vLLM refuses to render the request."""
        assert self._exchange.plan is not None
        upstream = self._upstream
        # The request as the chat route would get it, rendered: generate's request comes from it.
        render_request: dict[str, Any] = orjson.loads(self._exchange.plan.body)
        for key in ("stream", "stream_options"):
            render_request.pop(key, None)
        # Encoded once: the plain render sends it; derender calls, what derender reads of it.
        self._render_body = orjson.dumps(render_request)
        wants = self._exchange.plan.wants
        self._derender_chat = orjson.dumps(
            derender_chat_request(render_request, token_ids=wants.token_ids)
        )
        counted = _Counted(upstream)
        config = self._exchange.pipeline.config
        templates = self._exchange.pipeline.close_renders.generate_templates
        beside_key = template_key(render_request) if config.token_in_beside else None
        template = templates.get(beside_key) if beside_key is not None else None
        request, streamed = self._exchange.request, self._exchange.streamed

        def early(length: int, ids_json: bytes) -> bytes | None:
            assert template is not None
            return early_body(template, request, length, ids_json, stream=streamed)

        got = await token_in_prompt_beside(
            cast(TokenInTransport, counted),  # token_in_prompt posts renders, nothing else
            self._exchange.pipeline.close_renders,
            self._exchange.admitted.rollout.token_in_prior(self._token_in_line),
            request,
            self._render_body,
            self._exchange.pipeline.prompt_json,
            self._exchange.admitted.request,
            self._exchange.info.fingerprint,
            early if template is not None else None,
        )
        if isinstance(got, Beside):
            assert beside_key is not None
            return await self._beside(upstream, counted, got, beside_key)
        self.prompt = got
        if beside_key is not None:
            templates.put(beside_key, got.rendered)
        self._markers = await self._reasoning_markers(got)
        body = got.generate_body(request, stream=streamed)
        self.sent = counted.sent + len(body) + REQUEST_HEAD
        return await upstream.post_engine(EngineRoute.GENERATE, body)

    async def _beside(
        self, upstream: TokenInTransport, counted: _Counted, beside: Beside, key: str
    ) -> UpstreamReply:
        """Generate sent at once with `beside`'s request; kept when the request's own render
        builds the same request (`mismatch`), else aborted (its connection closed: vLLM aborts
        a generation whose client left) and the ordinary request sent. Nothing of a generation
        reaches the client before this returns."""
        generating = asyncio.ensure_future(upstream.post_engine(EngineRoute.GENERATE, beside.body))
        checking = beside.check()  # the request's own render, sent after generate
        try:
            prompt = await checking
        except BaseException:
            checking.cancel()
            await _abort(generating)
            raise
        self.prompt = prompt
        request, streamed = self._exchange.request, self._exchange.streamed
        body = prompt.generate_body(request, stream=streamed)
        why = mismatch(beside.body, body, beside.ids_json)
        if why is None and prompt.segment_break is None:
            self.beside = "passed"
            self._exchange.pipeline.close_renders.generate_templates.put(key, prompt.rendered)
            self.sent = counted.sent + len(beside.body) + REQUEST_HEAD
            self._markers = await self._reasoning_markers(prompt)
            return await generating
        await _abort(generating)
        cut = prompt.segment_break
        reason = "prompt" if cut is not None else why or "prompt"
        self.beside = reason
        self.beside_aborted = SegmentBreak(reason, _ABORTED[reason])
        # A fact of the server (its sampling, a generation config capping the limit) would abort
        # every call with these keys: they go the ordinary way from now on. A fact of this call
        # (its rendering, a bridged prompt shorter than the plain one) does not.
        shorter = len(prompt.prompt_ids) < len(prompt.rendered.prompt_ids)
        if reason in ("sampling", "request") or (reason == "max_tokens" and not shorter):
            self._exchange.pipeline.close_renders.generate_templates.refuse(key)
        self.sent = counted.sent + len(beside.body) + len(body) + 2 * REQUEST_HEAD
        self._markers = await self._reasoning_markers(prompt)
        return await upstream.post_engine(EngineRoute.GENERATE, body)

    @property
    def derender_budget(self) -> int:
        """The bytes a stream's derender calls may send: what ``--token-in-upstream-bound``
        (`ExchangeConfig.token_in_upstream_bound`, 3 by default: issue 28's bound) times the
        plain call's request leaves after the call's renders and generate (at least 0)."""
        assert self._exchange.plan is not None
        bound = self._exchange.pipeline.config.token_in_upstream_bound
        return max(int(bound * len(self._exchange.plan.body)) - self.sent, 0)

    async def _reasoning_markers(self, prompt: TokenInPrompt) -> tuple[int, int, int | None] | None:
        """The reasoning parser's marker ids, when the chat route would count the answer's
        ``reasoning_tokens``: the server has a reasoning parser (render answers its
        ``reasoning_parser_kwargs``) whose reasoning markers are one token each (the tool call
        start too, else a tool call does not end the count). Asked once per tokenizer
        fingerprint (three ``/tokenize`` calls), then kept."""
        kwargs = prompt.rendered.rest.get("reasoning_parser_kwargs")
        if kwargs is None or bytes(kwargs) == b"null":
            return None
        known = self._exchange.pipeline.close_renders.reasoning_markers
        key = self._exchange.info.fingerprint
        if key in known:
            return known[key]
        upstream = self._upstream
        if not isinstance(upstream, TextTokenizer):
            return None
        start, end, tool = await asyncio.gather(
            *(upstream.tokenize_text(self._model, text) for text in REASONING_MARKERS)
        )
        if start is None or end is None or tool is None:
            return None  # not answered: asked again by the next call
        tool_id = tool[0] if len(tool) == 1 else None
        markers = (start[0], end[0], tool_id) if len(start) == 1 == len(end) else None
        known[key] = markers
        return markers

    def _reasoning_tokens(self, generated: Generated | None, *, stream: bool) -> int | None:
        """The chat route's ``reasoning_tokens`` for `generated` (None: not given). The token a
        generation stopped on is not counted: an end of sequence (the tokenizer's, ``stop_reason``
        null, or one of the model's generation config, ``stop_reason`` its id: any stop token
        the request's ``stop_token_ids`` does not name); streamed after a prompt that leaves
        reasoning open, any stop token unless ``include_stop_str_in_output`` (the chat route's
        streaming parser never sees an undecoded token; after a prompt that ended it, the
        stream is counted as unary is).
        The count starts in reasoning unless thinking is off, whatever the prompt
        (`counts_reasoning_from_start`). Measured on the tiny vLLM,
        tests/e2e/test_vllm_parity.py."""
        markers, prompt = self._markers, self.prompt
        if markers is None or prompt is None or generated is None:
            return None
        rest = prompt.rendered.rest
        ended = rest.get("reasoning_ended")
        closed = ended is not None and bytes(ended) == b"true"
        kwargs = rest.get("reasoning_parser_kwargs")
        from_start = counts_reasoning_from_start(
            orjson.loads(bytes(kwargs)) if kwargs is not None else None
        )
        ids: Sequence[int] = generated.completion_ids
        on_token = generated.finish_reason == "stop" and not isinstance(generated.stop_reason, str)
        # With `include_stop_str_in_output` the chat route decodes a `stop_token_ids` id, and
        # its streaming parser counts it (measured).
        request = self._exchange.request
        decoded = request.get("include_stop_str_in_output") is True
        streamed_undecoded = stream and not closed and not decoded
        named = request.get("stop_token_ids") or ()
        # `<|endoftext|>` ended on with `stop_reason: 0` (the generation config's end of
        # sequence, which vLLM adds to the stop token ids) is not counted, unary or streamed;
        # `stop_token_ids: [1]` (`<|im_start|>`) is, unary (measured: test_vllm_parity.py).
        end_of_sequence = generated.stop_reason is None or generated.stop_reason not in named
        if ids and on_token and (streamed_undecoded or end_of_sequence):
            ids = ids[:-1]
        return count_reasoning_tokens(ids, markers, open_at_start=from_start)

    async def finish(self, raw: bytes) -> Outcome:
        """Derender generate's unary answer `raw` for the client, then stage the call."""
        prompt = self.prompt
        assert prompt is not None
        assert self._exchange.plan is not None
        try:
            include = self._exchange.request.get("include_stop_str_in_output") is True
            sent, only_stop_token = without_stop_token_id(raw, include)
            # Without its nulls, nor logprobs the client does not get.
            logprobs = self._exchange.plan.wants.logprobs
            sent = derender_generate_answer(sent, logprobs=logprobs, unary=True)
            ids, ids_json = self._derender_prompt(prompt)
            body = derender_body(sent, ids, self._derender_chat, ids_json=ids_json)
            # Derender takes generate's answer as it came: it is sent first, and the answer is
            # read for the record while vLLM derenders it (not before).
            derendering = asyncio.ensure_future(self._derender(body))
            try:
                generated = read_generate(raw)
            except BaseException:
                derendering.cancel()  # not started yet: nothing was sent
                raise
            # Derender does not cut at stop strings; the chat route does.
            derendered = await derendering
            if only_stop_token:
                derendered = derendered.without_text()
            derendered = derendered.cut_at_stop(
                StopCut.of(self._exchange.request), generated.stop_reason
            )
            derendered = derendered.with_chat_logprobs(generated, self._exchange.plan.wants)
        except UpstreamProtocolError as e:
            malformed = UpstreamFailed(
                f"the upstream answer is malformed: {e.message}", code=e.reason
            )
            await self._exchange.fail_upstream(malformed)
            raise malformed from e
        except UpstreamFailed as e:
            await self._exchange.fail_upstream(e)
            raise
        self._exchange._upstream_s = time.perf_counter() - self._exchange._t_up
        ids = prompt.prompt_array
        record_view = derendered.for_record()
        completion = _as_chat(
            to_completion(generated, ids, record_view, model=self._model), self._exchange.request
        )
        client_body = client_answer(
            derendered,
            generated,
            prompt.prompt_ids,
            self._exchange.plan.wants,
            ids_json=prompt.prompt_json,
            reasoning_tokens=self._reasoning_tokens(generated, stream=False),
            named_tool_choice=_named_tool_choice(self._exchange.request),
        )
        return await self._exchange._stage(completion, client_body, generated.weight_spans)

    def _derender_prompt(self, prompt: TokenInPrompt) -> tuple[Sequence[int], bytes]:
        """The prompt ids derender calls send, and their JSON: the tail of the prompt derender
        reads (`derender_prompt_start`), the whole prompt when that is not known."""
        start = derender_prompt_start(prompt.prompt_array, self._derender_markers(prompt))
        if start == 0:
            return prompt.prompt_ids, prompt.prompt_json
        ids = prompt.prompt_ids[start:]
        return ids, encode_ids(ids)

    def _derender_markers(self, prompt: TokenInPrompt) -> tuple[int, ...] | None:
        """The reasoning parser's marker ids for `derender_prompt_start`: ``()`` when the server
        has no reasoning parser, None when it has one whose markers are not known."""
        kwargs = prompt.rendered.rest.get("reasoning_parser_kwargs")
        if kwargs is None or bytes(kwargs) == b"null":
            return ()
        markers = self._markers
        return None if markers is None else markers[:2]  # `<think>`, `</think>`

    async def _derender(self, body: bytes) -> Derendered:
        return read_derendered(await post_derender(self._upstream, body))

    @property
    def _model(self) -> str:
        return str(self._exchange.request.get("model", ""))

    async def relay(self) -> AsyncGenerator[bytes, None]:
        """`relay_stream` for token-in: generate's stream derendered in coalesced calls."""
        prompt, plan, reply = self.prompt, self._exchange.plan, self._exchange._reply
        assert prompt is not None
        assert plan is not None
        assert reply is not None
        ids, ids_json = self._derender_prompt(prompt)
        derender = StreamedDerender(
            self._upstream,
            reply,
            ids,
            self._derender_chat,
            logprobs=StreamLogprobs(self._model) if plan.wants.logprobs else None,
            ids_json=ids_json,
            include_stop_str=self._exchange.request.get("include_stop_str_in_output") is True,
            # What the bound leaves after render and generate; then the stream waits for its
            # end: a slow stream of one token per call costs no more than a fast one.
            budget=self.derender_budget,
            head=REQUEST_HEAD,
        )

        def reasoning_tokens() -> int | None:
            return self._reasoning_tokens(derender.so_far, stream=True)

        def running_reasoning(n: int) -> int | None:
            so_far = derender.so_far
            if so_far is None:
                return None
            first = Generated(so_far.request_id, completion_ids=so_far.completion_ids[:n])
            return self._reasoning_tokens(first, stream=True)

        shaped = DerenderedStream(
            plan.wants,
            prompt.prompt_ids,
            StopCut.of(self._exchange.request),
            reasoning_tokens,
            generated=lambda: derender.so_far,
            running_reasoning=running_reasoning,
        )
        async with reply:
            events = derender.events()
            try:
                async for event in events:
                    if event == _DONE:
                        continue  # the proxy sends its own once the call is staged
                    piece = shaped.feed(orjson.loads(event[_DATA:]))
                    if piece is not None:
                        yield piece
            except UpstreamProtocolError as e:
                await self._exchange.fail_upstream(
                    UpstreamFailed(e.message, code=e.reason), http_status=502
                )
                return
            except UpstreamFailed as e:
                await self._exchange.fail_upstream(e, http_status=502)
                return
            finally:
                if isinstance(events, AsyncGenerator):
                    await events.aclose()  # its reader task ends now, with the client's stream
        generated = derender.generated
        assert generated is not None  # the events end only after the whole generation
        answer = {"choices": [{"message": shaped.message()}]}
        ids = prompt.prompt_array
        completion = _as_chat(
            to_completion(generated, ids, answer, model=self._model), self._exchange.request
        )
        await self._exchange._stage(completion, b"", generated.weight_spans)

    def continued_by_next(self, completion: Completion, prompt: TokenInPrompt) -> None:
        """A staged token-in call: the one the rollout's next token-in call continues; tell the
        metrics what token-in did."""
        call = self._exchange.admitted
        prior = Prior(
            request=self._exchange.request,
            message=completion.message,
            prompt_ids=completion.prompt_token_ids,
            completion_ids=completion.completion_token_ids,
            finish_reason=completion.finish_reason,
            media=prompt.media,
            fingerprint=self._exchange.info.fingerprint,
            stop_reason=completion.stop_reason,
        )
        line = self._token_in_line
        replaced = call.rollout.token_in_priors.get(line)
        call.rollout.remember_token_in(call.seq, line, prior)
        kept = call.rollout.token_in_priors.get(line)
        if kept is not None and kept[1] is prior:
            # The next call's bridged prompt starts with these ids: its JSON extends this one's
            # (the call this one replaced is continued no more).
            if replaced is not None:
                self._exchange.pipeline.prompt_json.discard(replaced[1].prompt_ids)
            self._exchange.pipeline.prompt_json.put(prior.prompt_ids, prompt.prompt_json)
        cut = prompt.segment_break
        self._exchange.pipeline.report_token_in(
            TokenInReport(
                call.rollout_id,
                call.call_id,
                NEW_SEGMENT if cut is not None else EXTENDED,
                cut.reason if cut is not None else "",
                prompt.plain_divergence,
                self.beside,
                prompt.placed,
            )
        )

    def facts(
        self,
        prompt: TokenInPrompt,
        completion: Completion,
        sampling: Mapping[str, Any],
        spans: Sequence[WeightSpan],
    ) -> tuple[str | None, list[WeightSpan], dict[str, Any] | None]:
        """The record's engine weight version, weight spans and effective sampling: generate says
        which weights sampled which tokens, the call's own render what vLLM resolved its sampling
        to. The break, the divergence and the prompt's images go into `completion`'s extras."""
        weight_spans = list(spans)
        versions = {version for version, _, _ in weight_spans}
        engine_version = versions.pop() if len(versions) == 1 else None
        params = prompt.rendered.sampling_params
        resolved = {k: params[k] for k in RESOLVED_SAMPLING_KEYS if k in params}
        completion.extras.update(
            token_in_extras(
                prompt.segment_break, prompt.plain_divergence, prompt.media, self.beside_aborted
            )
        )
        return engine_version, weight_spans, effective_sampling(sampling, resolved)


#: What the record says of each reason a generation sent beside the render was aborted.
_ABORTED = {
    "prompt": "the request's own rendering did not end as the bridge said: the call was sent "
    "again the ordinary way",
    "max_tokens": "the request's own render resolved another output limit than the one worked "
    "out for the bridged prompt",
    "sampling": "the request's own render resolved other sampling parameters than the last "
    "render with the same keys",
    "request": "the request's own render gave generate another request than the last render "
    "with the same keys",
}


async def _abort(generating: asyncio.Future[UpstreamReply]) -> None:
    """Abort a generation sent beside the request's render: a request still waiting for its
    headers is cancelled (its connection closed), a reply closed; vLLM aborts a generation
    whose connection closes (its generate route's ``with_cancellation``, a stream's
    disconnect)."""
    if not generating.done():
        generating.cancel()
        with contextlib.suppress(BaseException):
            await generating
        return
    if generating.cancelled() or generating.exception() is not None:
        return
    generating.result().close()


class _Counted:
    """A call's upstream as `token_in_prompt` uses it (`post_engine`), counting the bytes of what
    it posts (`sent`: bodies, and `REQUEST_HEAD` for each request's line and headers)."""

    def __init__(self, upstream: TokenInTransport) -> None:
        self._upstream = upstream
        self.sent = 0

    async def post_engine(self, route: EngineRoute, body: bytes) -> UpstreamReply:
        self.sent += len(body) + REQUEST_HEAD
        return await self._upstream.post_engine(route, body)


def _named_tool_choice(request: Mapping[str, Any]) -> bool:
    """Whether the request names its function in ``tool_choice`` (the chat route then says
    ``stop``, not ``tool_calls``, for the call it makes)."""
    return isinstance(request.get("tool_choice"), Mapping)


def _as_chat(completion: Completion, request: Mapping[str, Any]) -> Completion:
    """The finish reason the chat route gives (and the client got): ``tool_calls`` for an
    answer with tool calls, where generate, which parses nothing, says ``stop`` (but for a
    named ``tool_choice``: vLLM 0.32's chat route says ``stop`` then)."""
    calls = completion.message.get("tool_calls") and not _named_tool_choice(request)
    if completion.finish_reason == "stop" and calls:
        return dataclasses.replace(completion, finish_reason="tool_calls")
    return completion
