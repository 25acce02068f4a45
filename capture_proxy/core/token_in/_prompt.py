"""What a token-in call sends to generate (`TokenInPrompt`), the line of calls it belongs to
(`token_in_line`), and the error of a request vLLM refuses to render (`RenderRefused`)."""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from ...adapters.vllm import Rendered, encode_ids
from ...errors import CaptureProxyError
from ...schemas.fields import BridgeSpan
from ...schemas.token_in_extras import SegmentBreak
from ._match import TEMPLATE_KEYS
from ._media import MediaItem, media_items

__all__ = [
    "MEDIA_KEPT_BYTES",
    "PLACED_BY_DUMMIES",
    "PLACED_BY_RENDERING",
    "RenderRefused",
    "TokenInPrompt",
    "token_in_line",
]

#: `TokenInPrompt.placed`: the appended tokens read from the request's own render alone.
PLACED_BY_RENDERING = "rendering"
#: `TokenInPrompt.placed`: the appended tokens placed by the bridge's dummy renders.
PLACED_BY_DUMMIES = "dummies"

#: At most this many bytes of a call's image placeholders (hashes and positions) are kept for
#: the next call's bridge; a call with more leaves the next one with images unbridged.
MEDIA_KEPT_BYTES = 64 * 1024

#: Request keys that set the output limit: unset, vLLM's render fills in the room the rendered
#: prompt leaves in the context window, which a longer bridged prompt does not have.
_LIMIT_KEYS = ("max_tokens", "max_completion_tokens")


def token_in_line(request: Mapping[str, Any]) -> str:
    """Which line of calls a request belongs to: a hash of its tools, template keys and leading
    system message. The calls of one agent loop share them; a side call in the same rollout
    (OpenCode's title call: no tools, its own system prompt) has its own line, so it never
    comes between a call and the next one of the loop."""
    messages = request.get("messages") or []
    lead = messages[0] if messages and messages[0].get("role") == "system" else None
    keys = {k: request[k] for k in TEMPLATE_KEYS if request.get(k) is not None}
    line = {"tools": request.get("tools") or [], "keys": keys, "system": lead}
    return hashlib.sha256(orjson.dumps(line, option=orjson.OPT_SORT_KEYS)).hexdigest()


class RenderRefused(CaptureProxyError):
    """The upstream answered the request's own render with an error status: the call's answer,
    relayed to the client as the chat route's error would be."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"render answered {status}")
        self.status = status
        self.body = body


@dataclass(frozen=True, slots=True)
class TokenInPrompt:
    """What a token-in call sends to generate, and what its record says of it.

    Attributes:
        rendered: the plain render of the request (vLLM's ``GenerateRequest``).
        prompt_ids: the ids to generate from: the bridged prompt, or the plain one.
        bridge_spans: the prompt tokens the proxy inserted (``()`` for a plain prompt).
        segment_break: why the call starts a new segment (None: it extends the previous call).
        plain_divergence: where the plain ids differ from the bridged ones (None: they do not,
            or the plain ids were sent).
        features: the ``features`` generate gets instead of the render's, for a bridged prompt
            with images (None: the render's, as they came).
        bridged_media: a bridged prompt's images (`media` reads the plain render's otherwise).
        ids_json: `prompt_ids` as a JSON list, encoded once for generate and derender
            (`prompt_json`; when not given: the plain render's JSON as it came for its own ids,
            else encoded).
    """

    rendered: Rendered
    prompt_ids: list[int]
    bridge_spans: tuple[BridgeSpan, ...] = ()
    segment_break: SegmentBreak | None = None
    plain_divergence: int | None = None
    features: dict[str, Any] | None = None
    bridged_media: tuple[MediaItem, ...] | None = None
    ids_json: bytes | None = None
    #: `prompt_ids` as int32 (the record's), when built from the prior's without a conversion.
    ids_array: array[int] | None = None
    #: How a bridged prompt's appended tokens were placed: `PLACED_BY_RENDERING` (the request's
    #: own render alone, docs/token-in.md "A steady call without dummy renders") or
    #: `PLACED_BY_DUMMIES`; "" for a plain prompt.
    placed: str = ""

    def __post_init__(self) -> None:
        if self.ids_json is None:
            rendered = self.rendered
            plain = self.prompt_ids is rendered.prompt_ids
            ids_json = rendered.prompt_json if plain else encode_ids(self.prompt_ids)
            object.__setattr__(self, "ids_json", ids_json)

    @property
    def prompt_array(self) -> array[int]:
        """`prompt_ids` as an int32 array, as the record keeps them."""
        if self.ids_array is None:  # converted once: derender's window and the record read it
            object.__setattr__(self, "ids_array", array("i", self.prompt_ids))
        assert self.ids_array is not None
        return self.ids_array

    @property
    def prompt_json(self) -> bytes:
        """`prompt_ids` as a JSON list (generate and derender send it as it is)."""
        assert self.ids_json is not None  # set by __post_init__
        return self.ids_json

    @property
    def media(self) -> tuple[MediaItem, ...] | None:
        """The prompt's images as the next call's bridge needs them (`Prior.media`); None when
        the render's ``features`` cannot be read, or they are more than `MEDIA_KEPT_BYTES`."""
        media = self.bridged_media
        if media is None:
            try:
                media = media_items(self.rendered.features)
            except ValueError:
                return None
        if sum(len(m.hash) + len(m.modality) + 16 for m in media) > MEDIA_KEPT_BYTES:
            return None
        return media

    def generate_body(self, request: Mapping[str, Any], *, stream: bool) -> bytes:
        """The generate request: the plain render's answer with `prompt_ids`. When `request`
        sets no output limit, vLLM's render chose the room its own prompt left in the context
        window; a longer bridged prompt has that much less."""
        rendered = self.rendered
        if self.features is not None:
            features = msgspec.Raw(orjson.dumps(self.features))
            rendered = dataclasses.replace(rendered, rest={**rendered.rest, "features": features})
        grown = len(self.prompt_ids) - len(rendered.prompt_ids)
        params = rendered.resolved_sampling
        limit = params.get("max_tokens")
        unset = all(request.get(k) is None for k in _LIMIT_KEYS)
        if grown > 0 and unset and type(limit) is int:
            params = {**params, "max_tokens": max(1, limit - grown)}
            return rendered.generate_body(
                self.prompt_ids, stream=stream, sampling_params=params, ids_json=self.prompt_json
            )
        return rendered.generate_body(self.prompt_ids, stream=stream, ids_json=self.prompt_json)
