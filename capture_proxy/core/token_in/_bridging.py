"""The prompt a token-in call sends: the bridge's, or the plain rendering's (with the reason).

`token_in_prompt` does the upstream side of docs/token-in.md for one call. It asks the bridge
whether the request extends the rollout's previous staged call (`match`); if it does, it sends
the renders of the bridge's plan (the turn close from `CloseRenders` when cached; the other
dummies lean, without the system message and tools, unless the template needs them; one render
of a pair whose anchor it keeps) **at the same time as** the plain render of the request, then
assembles the exact prompt and measures where the plain one would have diverged. Otherwise, or
when the renders do not bridge, the plain render's ids are sent and the call starts a new
segment, with the reason. The plain render is always made: it is the ``GenerateRequest``
generate takes (sampling params resolved by vLLM, the effective sampling of the record), the
plain ids divergence is measured against, and the rendering that must end with the turn close
and the appended tokens the bridge found. With images, the bridged prompt's ``features`` are
the plain render's items placed where the bridge put them (`bridged_features`); the
placeholders are kept for the next call (`TokenInPrompt.media`).

`TokenInCall` (`_flow`) sends the result to generate and derenders the answer.
"""

from __future__ import annotations

import asyncio
import functools
from array import array
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from ...adapters.vllm import Rendered, encode_ids, extend_ids_json, read_render
from ...schemas.token_in_extras import SegmentBreak
from ..transport import EngineRoute, TokenInTransport
from ._assemble import divergence
from ._caches import CloseRenders, PromptJson
from ._match import match
from ._media import bridged_features
from ._plan import plan
from ._prompt import PLACED_BY_DUMMIES, PLACED_BY_RENDERING, RenderRefused, TokenInPrompt
from ._renders import Renders, read_bridge
from ._steady import Steady, from_rendering, learn_shape, steady_plan
from ._values import Bridged, BridgePlan, Extension, NotBridged, Prior

__all__ = ["Beside", "token_in_prompt", "token_in_prompt_beside"]

_T = TypeVar("_T")


async def _render(upstream: TokenInTransport, body: bytes) -> tuple[int, bytes]:
    async with await upstream.post_engine(EngineRoute.RENDER, body) as reply:
        return reply.status, await reply.read()


async def _all(*aws: Awaitable[_T]) -> list[_T]:
    """Every result, the requests under way at once; the first failure cancels the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def token_in_prompt(
    upstream: TokenInTransport,
    closes: CloseRenders,
    prior: Prior | None,
    request: Mapping[str, Any],
    render_request: Mapping[str, Any] | bytes,
    prompts: PromptJson | None = None,
    staged: Mapping[str, Any] | None = None,
    fingerprint: str | None = None,
) -> TokenInPrompt:
    """The prompt of a token-in call (module docs). `request` is the normalized request as
    the bridge compares it with `prior.request`; `render_request` the body to render (the
    request as forwarded, with the token fields capture asks for), encoded or not. A bridged
    prompt's JSON extends the prior's from `prompts` when it has it. `staged` is the request
    as staged (images by reference), which a prior read back from the store is compared with.

    Raises `RenderRefused` when the upstream refuses to render the request, `UpstreamFailed`
    when it cannot be reached.
    """
    got = await token_in_prompt_beside(
        upstream, closes, prior, request, render_request, prompts, staged, fingerprint
    )
    assert isinstance(got, TokenInPrompt)  # nothing is sent beside without `early`
    return got


async def token_in_prompt_beside(
    upstream: TokenInTransport,
    closes: CloseRenders,
    prior: Prior | None,
    request: Mapping[str, Any],
    render_request: Mapping[str, Any] | bytes,
    prompts: PromptJson | None = None,
    staged: Mapping[str, Any] | None = None,
    fingerprint: str | None = None,
    early: Callable[[int, bytes], bytes | None] | None = None,
) -> TokenInPrompt | Beside:
    """`token_in_prompt`, or with `early` (``--token-in-beside``: given the bridged prompt's
    length and JSON, generate's request built without the request's own render, None when
    not from this call) a `Beside` as soon as the dummy renders answer, when they bridge the
    call from single renders alone and `early` gives a request.

    Raises `RenderRefused` when the upstream refuses to render the request, `UpstreamFailed`
    when it cannot be reached.
    """
    verdict = match(prior, request, staged, fingerprint)
    if isinstance(render_request, bytes):
        plain_body = render_request
    else:
        plain_body = orjson.dumps(render_request)
    if isinstance(verdict, NotBridged):
        status, raw = await _render(upstream, plain_body)
        return TokenInPrompt(*_plain(status, raw), segment_break=_break(verdict))
    lean = plan(request, verdict, lean=True)
    bridge = plan(request, verdict) if closes.needs_context(lean.close_key) else lean
    # The prior's prompt JSON, when kept: the renders' ids mostly start as it does.
    kept = prompts.get(verdict.prior.prompt_ids) if prompts is not None else None
    # Beside generate, the dummies go first: vLLM's frontend serves renders one after another,
    # and the request's own render (the largest) is sent after generate, once they answered.
    beside = early is not None and _learnt(Renders(bridge, closes, verdict), bridge)
    plain_render = None if beside else asyncio.ensure_future(_render(upstream, plain_body))
    steady = None if early is not None else steady_plan(closes, bridge, request, verdict)
    read: Rendered | None = None  # the request's own render, once read
    try:
        if steady is not None and plain_render is not None:
            # A steady call: the request's own rendering places the appended tokens; the
            # dummy renders are made only when it does not (`_steady`), and the rendering
            # read here is what they are checked against.
            status, raw = await plain_render
            if status != 200:
                raise RenderRefused(status, raw)
            done, read = _steady_prompt(steady, raw, verdict.prior, kept)
            if done is not None:
                return done
        got, failed, learnt = await _bridge(upstream, closes, verdict, bridge, kept)
        if early is not None and learnt and isinstance(got, Bridged) and not got.media:
            ids_json = _bridged_json(got, verdict.prior, kept)
            body = early(len(got.prompt_ids), ids_json)
            if body is not None:
                check = functools.partial(
                    _start_check,
                    plain_render,
                    upstream,
                    plain_body,
                    closes,
                    request,
                    verdict,
                    bridge,
                    kept,
                    got,
                    failed,
                )
                return Beside(body, ids_json, check)
        if plain_render is None:  # the single renders did not bridge: rendered now
            plain_render = asyncio.ensure_future(_render(upstream, plain_body))
        return await _checked_prompt(
            upstream, closes, request, verdict, bridge, kept, got, failed, plain_render, read
        )
    except BaseException:
        if plain_render is not None:
            plain_render.cancel()
        raise


def _start_check(
    plain_render: asyncio.Future[tuple[int, bytes]] | None,
    upstream: TokenInTransport,
    plain_body: bytes,
    closes: CloseRenders,
    request: Mapping[str, Any],
    verdict: Extension,
    bridge: BridgePlan,
    kept: bytes | None,
    got: Bridged,
    failed: bool,
) -> asyncio.Future[TokenInPrompt]:
    """`Beside.check`: the request's own render (sent now, unless it already was) and the
    prompt checked against it (`_checked_prompt`)."""
    rendering = plain_render or asyncio.ensure_future(_render(upstream, plain_body))
    return asyncio.ensure_future(
        _checked_prompt(upstream, closes, request, verdict, bridge, kept, got, failed, rendering)
    )


def _learnt(renders: Renders, bridge: BridgePlan) -> bool:
    """Whether `renders` are single renders alone: the close cached, every kind anchored."""
    return renders.cached is not None and len(renders.anchored) == 1 + (bridge.turn is not None)


@dataclass(frozen=True, slots=True)
class Beside:
    """A bridged call's generate request built without the request's own render (`early`),
    and `check`: started once generate is sent, the call's prompt as the ordinary path builds it
    when that render answers (raising as `token_in_prompt` does)."""

    body: bytes
    ids_json: bytes
    check: Callable[[], asyncio.Future[TokenInPrompt]]


async def _checked_prompt(
    upstream: TokenInTransport,
    closes: CloseRenders,
    request: Mapping[str, Any],
    verdict: Extension,
    bridge: BridgePlan,
    kept: bytes | None,
    got: Bridged | NotBridged,
    failed: bool,
    plain_render: asyncio.Future[tuple[int, bytes]],
    read: Rendered | None = None,
) -> TokenInPrompt:
    """The call's prompt from the bridge's renders (`got`) and the request's own render,
    checked against it (the rest of `token_in_prompt`); `read`: that render already read
    against the previous prompt (a steady call's attempt), not read again."""
    try:
        status, raw = await plain_render
    except BaseException:
        plain_render.cancel()
        raise
    if status != 200:
        raise RenderRefused(status, raw)
    checked = _checked(got, raw, verdict.prior, kept, read)
    if isinstance(checked, NotBridged) and bridge.lean and not failed:
        # The lean dummies did not bridge, or not as the request renders: this template may
        # render the turn or the appended messages differently without the system message or
        # the tools. The dummies with them decide, as without lean dummies. (A render that
        # failed is the call's break, as it would be with them.)
        bridge = plan(request, verdict)
        whole, _, _ = await _bridge(upstream, closes, verdict, bridge, kept)
        checked = _checked(whole, raw, verdict.prior, kept, read)
        if not isinstance(checked, NotBridged):
            closes.context_needed(bridge.close_key)
    if isinstance(checked, NotBridged):
        rendered, plain_ids = _plain(status, raw, read)
        return TokenInPrompt(rendered, plain_ids, segment_break=_break(checked))
    got, rendered, ids_json = checked
    learn_shape(closes, request, verdict, bridge.close_key, got, rendered)
    return _bridged_prompt(got, rendered, ids_json, verdict.prior, PLACED_BY_DUMMIES)


def _bridged_prompt(
    got: Bridged, rendered: Rendered, ids_json: bytes, prior: Prior, placed: str
) -> TokenInPrompt:
    """The call's prompt once bridged: `got`, checked against the request's own `rendered`."""
    features, why = bridged_features(got.media, rendered.features)
    if why is not None:
        cut = SegmentBreak("multimodal_append", f"the images' features: {why}")
        return TokenInPrompt(rendered, rendered.prompt_ids, segment_break=cut)
    return TokenInPrompt(
        rendered,
        got.prompt_ids,
        tuple(got.bridge_spans),
        None,
        divergence(got.prompt_ids, rendered.prompt_ids, same=rendered.known_prefix),
        features,
        got.media,
        ids_json,
        _bridged_array(got, prior),
        placed,
    )


def _steady_prompt(
    steady: Steady, raw: bytes, prior: Prior, kept: bytes | None
) -> tuple[TokenInPrompt | None, Rendered]:
    """The call's prompt from the request's own render alone, or None (the dummies decide),
    and the render as read (against the previous prompt: its `known_prefix` holds for any
    prompt bridged from it)."""
    if kept is not None:
        rendered = read_render(raw, known=(kept, prior.prompt_ids))
    else:
        rendered = read_render(raw)
    got = from_rendering(prior, steady.close, steady.eos, steady.count, rendered)
    if got is None:
        return None, rendered
    ids_json = _bridged_json(got, prior, kept)
    return _bridged_prompt(got, rendered, ids_json, prior, PLACED_BY_RENDERING), rendered


async def _bridge(
    upstream: TokenInTransport,
    closes: CloseRenders,
    extension: Extension,
    bridge: BridgePlan,
    kept: bytes | None,
) -> tuple[Bridged | NotBridged, bool, bool]:
    """The bridged prompt from `bridge`'s renders (`Renders`: one render of a pair whose
    anchor is known), whether a render failed (an error status, or not a render's answer),
    and whether it came from single renders alone (the close cached, every kind anchored).
    Single renders that do not bridge are rendered as whole pairs, which decide; a kind whose
    render did not start with its anchor keeps to pairs from then on."""
    renders = Renders(bridge, closes, extension)
    learnt = _learnt(renders, bridge)
    answers = await _all(*(_render(upstream, orjson.dumps(b)) for b in renders.bodies))
    got = read_bridge(extension, renders, answers, closes, kept)
    if renders.anchored and isinstance(got, NotBridged):
        learnt = False
        for key in renders.unanchored:
            closes.pairs_only(key)
        seconds = await _all(*(_render(upstream, orjson.dumps(b)) for b in renders.seconds))
        got = read_bridge(extension, renders, renders.paired(answers, seconds), closes, kept)
    return got, renders.failed, learnt


def _checked(
    got: Bridged | NotBridged,
    raw: bytes,
    prior: Prior,
    kept: bytes | None,
    read: Rendered | None = None,
) -> tuple[Bridged, Rendered, bytes] | NotBridged:
    """The bridged prompt with the request's own render (`raw`, read against the bridged ids,
    or `read` when already read) and the prompt's JSON, when the render ends as the bridge says
    (`_appended_as_rendered`)."""
    if isinstance(got, NotBridged):
        return got
    ids_json = _bridged_json(got, prior, kept)
    # The plain rendering mostly spells the bridged prompt's ids: only the rest is decoded.
    rendered = read if read is not None else read_render(raw, known=(ids_json, got.prompt_ids))
    if not _appended_as_rendered(got, rendered):
        return NotBridged("template_not_bridgeable", _NOT_AS_RENDERED)
    return got, rendered, ids_json


#: Why a call is not bridged when the request's own rendering disagrees with the bridge.
_NOT_AS_RENDERED = (
    "the request's own rendering does not end with the turn close and the appended messages' "
    "tokens the dummy renders give: the template writes them differently after this "
    "conversation"
)


def _appended_as_rendered(got: Bridged, rendered: Rendered) -> bool:
    """Whether the request's own rendering ends with the appended messages' tokens (and the
    generation prompt) the bridge found, right after the turn close's last token: the template
    writes them after the real conversation as after the dummy one, and they start where the
    bridge says. Anything else would send the model tokens its template does not write there.

    Only the close's last token is compared, and it is the template's (`Bridged.close`), not
    the bridged prompt's: the tokens before it may merge with the content in the request's
    own rendering (Llama-2 writes ``' ' + content.strip() + ' ' + eos``: after an answer whose
    content is empty, as reasoning alone is to it, its two spaces are one token of the tiny
    vLLM's tokenizer, measured), and a model that stopped on the close's stop token without the
    token before it (Llama-2's space) has its own tokens there."""
    end = [*got.close[-1:], *got.prompt_ids[got.appended_start :]]
    plain = rendered.prompt_ids
    return len(plain) >= len(end) and plain[len(plain) - len(end) :] == end


def _bridged_array(got: Bridged, prior: Prior) -> array[int] | None:
    """The bridged prompt as int32: the prior's ids when they are already an array (a staged
    call's), copied, then the ids after them; None when they are not (converted when needed)."""
    head = prior.prompt_ids
    if not (isinstance(head, array) and head.typecode == "i"):
        return None
    return head + array("i", got.prompt_ids[len(head) :])


def _bridged_json(got: Bridged, prior: Prior, kept: bytes | None) -> bytes:
    """The bridged prompt's JSON: it starts with the prior's prompt ids (`assemble`), so the
    prior's JSON when kept (`PromptJson`), extended by the ids after them."""
    if kept is None:
        return encode_ids(got.prompt_ids)
    return extend_ids_json(kept, got.prompt_ids[len(prior.prompt_ids) :])


def _plain(status: int, raw: bytes, read: Rendered | None = None) -> tuple[Rendered, list[int]]:
    if status != 200:
        raise RenderRefused(status, raw)
    rendered = read if read is not None else read_render(raw)
    return rendered, rendered.prompt_ids


def _break(verdict: NotBridged) -> SegmentBreak:
    return SegmentBreak(verdict.reason, verdict.detail)
