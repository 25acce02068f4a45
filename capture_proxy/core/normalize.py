"""Request normalization: one decoded body in, the body to forward and the body to stage out.

`normalize_request` runs, in this order:

1. the body must be a JSON object;
2. on assistant messages, OpenCode's interleaved ``reasoning`` becomes ``reasoning_content`` (the
   canonical name inside the service); both present with the same text keep one, with different
   text are a 422 (``reasoning_conflict``): the proxy will not guess which one the model saw;
3. `validate_request`: the strict schema, limits on free-form values, consistency checks and
   the capture policy (``docs/request-schema.md``);
4. image parts: each ``data:image/...;base64,...`` URL is decoded (strict base64) into an
   `Attachment`; the staged copy refers to it as ``attachment:sha256:<hex>``, the forwarded copy
   keeps the data URL. Other URLs are refused (the proxy fetches nothing for a sandbox) unless
   remote media is allowed, in which case they are forwarded and staged as they are.

Nothing is copied that does not change: `NormalizedRequest.body` and `.staged` share every
message object that needs no edit, so both must be treated as read-only. The caller's dict is
never modified.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any

from ..schemas.attachments import attachment_url
from ..schemas.records import Attachment
from ..schemas.request import (
    ChatCompletionRequest,
    FreeJsonLimits,
    ImagePart,
    RequestValidationError,
    UserMessage,
    json_type_name,
    not_an_object,
    validate_request,
)

__all__ = ["DEFAULT_MAX_ATTACHMENT_BYTES", "NormalizedRequest", "normalize_request"]

DEFAULT_MAX_ATTACHMENT_BYTES = 32 * 2**20

# data:<type>/<subtype>[;<param>=<value>]*;base64,<payload>. Only base64 payloads: a percent-
# encoded image would need a second, looser decoder for no client that sends one.
_DATA_URL = re.compile(
    r"data:(?P<type>[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*)"
    r"(?:;[A-Za-z0-9!#$&^_.+-]+=[^;,]*)*;base64,",
    re.IGNORECASE,
)
_REMOTE_SCHEMES = ("http://", "https://")


@dataclass(frozen=True, slots=True)
class NormalizedRequest:
    """A request ready to forward and to stage.

    Attributes:
        body: the normalized request to forward: assistant reasoning under
            ``reasoning_content``, images still ``data:`` URLs.
        staged: the same request with every ``data:`` image replaced by
            ``{"url": "attachment:sha256:<hex>"}`` (other ``image_url`` keys kept).
        attachments: the decoded images by sha256 (one entry per distinct image).
        request: the validated, typed view of ``body``.
    """

    body: dict[str, Any]
    staged: dict[str, Any]
    attachments: dict[str, Attachment]
    request: ChatCompletionRequest


def normalize_request(
    data: Any,
    *,
    allow_remote_media: bool = False,
    max_attachment_bytes: int = DEFAULT_MAX_ATTACHMENT_BYTES,
    free_json: FreeJsonLimits | None = None,
) -> NormalizedRequest:
    """Normalize and validate one decoded Chat Completions body.

    Raises `RequestValidationError` (and nothing else) for any body it refuses; its ``param``
    names the JSON path of the problem. `free_json` bounds the free-form values (tool
    ``parameters``, ``chat_template_kwargs``, ...; `FreeJsonLimits`' defaults when None); images
    have their own limit, `max_attachment_bytes` per image.

    Decoding and hashing images is CPU work proportional to their size: about 8 ms per MiB of
    image on the 2-core development machine (base64 decoding dominates), against well under
    1 ms for a 25 KB text-only body. Callers on an event loop should run this in an executor
    when the body is large (say over 1 MiB) so one big image does not stall other calls.
    """
    if not isinstance(data, dict):
        raise not_an_object(data)
    body = _rename_reasoning(data)
    request = validate_request(body, free_json=free_json)
    staged, attachments = _stage_images(body, request, allow_remote_media, max_attachment_bytes)
    return NormalizedRequest(body, staged, attachments, request)


def _rename_reasoning(data: dict[str, Any]) -> dict[str, Any]:
    """``reasoning`` -> ``reasoning_content`` on assistant messages, copying only what changes.

    Malformed shapes (messages not a list, a message not an object) are left untouched for
    `validate_request` to report with their path.
    """
    messages = data.get("messages")
    if not isinstance(messages, list):
        return data
    changed: list[Any] | None = None
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or "reasoning" not in message
            or message.get("role") != "assistant"
        ):
            continue
        if changed is None:
            changed = list(messages)
        changed[i] = _renamed(message, i)
    if changed is None:
        return data
    return {**data, "messages": changed}


def _renamed(message: dict[str, Any], i: int) -> dict[str, Any]:
    reasoning = message["reasoning"]
    current = message.get("reasoning_content")
    # Type errors are reported here, under the key the client sent: after renaming, validation
    # would name a key the client never used, or call a type error a conflict.
    for key, value in (("reasoning", reasoning), ("reasoning_content", current)):
        if value is not None and not isinstance(value, str):
            raise RequestValidationError(
                f"messages[{i}].{key}",
                f"Expected `str | null`, got `{json_type_name(value)}` at messages[{i}].{key}",
                "invalid_type",
            )
    if reasoning is not None and current is not None and reasoning != current:
        raise RequestValidationError(
            f"messages[{i}].reasoning",
            f"`reasoning` at messages[{i}].reasoning differs from the message's "
            "`reasoning_content`; an assistant message carries its reasoning once, send only one",
            "reasoning_conflict",
        )
    out = {k: v for k, v in message.items() if k != "reasoning"}
    if current is None:
        out["reasoning_content"] = reasoning
    return out


def _stage_images(
    body: dict[str, Any],
    request: ChatCompletionRequest,
    allow_remote_media: bool,
    max_attachment_bytes: int,
) -> tuple[dict[str, Any], dict[str, Attachment]]:
    """The staged copy of `body` (images by reference) and the attachments it refers to."""
    attachments: dict[str, Attachment] = {}
    # A data URL seen twice in one request is decoded and hashed once.
    seen: dict[str, str] = {}
    staged_messages: list[Any] | None = None
    messages: list[Any] = body["messages"]
    for i, message in enumerate(request.messages):
        if not isinstance(message, UserMessage) or isinstance(message.content, str):
            continue
        staged_content: list[Any] | None = None
        raw_content: list[Any] = messages[i]["content"]
        for j, part in enumerate(message.content):
            if not isinstance(part, ImagePart):
                continue
            url = part.image_url.url
            param = f"messages[{i}].content[{j}].image_url.url"
            if url[:5].lower() != "data:":
                _check_remote(url, param, allow_remote_media)
                continue
            sha = seen.get(url)
            if sha is None:
                attachment = _decode_data_url(url, param, max_attachment_bytes)
                sha = seen[url] = attachment.sha256
                attachments.setdefault(sha, attachment)
            if staged_content is None:
                staged_content = list(raw_content)
            raw_part = raw_content[j]
            staged_content[j] = {
                **raw_part,
                "image_url": {**raw_part["image_url"], "url": attachment_url(sha)},
            }
        if staged_content is not None:
            if staged_messages is None:
                staged_messages = list(messages)
            staged_messages[i] = {**messages[i], "content": staged_content}
    if staged_messages is None:
        return body, attachments
    return {**body, "messages": staged_messages}, attachments


def _check_remote(url: str, param: str, allow_remote_media: bool) -> None:
    if not allow_remote_media:
        raise RequestValidationError(
            param,
            f"Image URL at {param} refused: the proxy does not fetch or forward URLs for a "
            "sandbox; send the image inline as a data:image/...;base64 URL",
            "remote_media_refused",
        )
    if not url[:8].lower().startswith(_REMOTE_SCHEMES):
        # file: and other schemes could make vLLM read its own host's files.
        raise RequestValidationError(
            param,
            f"Unsupported image URL scheme at {param}: only data: and http(s) URLs are accepted",
            "invalid_value",
        )


def _decode_data_url(url: str, param: str, max_bytes: int) -> Attachment:
    match = _DATA_URL.match(url)
    if match is None:
        raise RequestValidationError(
            param,
            f"Malformed data URL at {param}: expected data:image/<type>;base64,<data>",
            "invalid_image",
        )
    media_type = match.group("type").lower()
    if not media_type.startswith("image/"):
        raise RequestValidationError(
            param,
            f"Data URL at {param} has media type {media_type!r:.80}; an image_url part must "
            "carry an image/* type",
            "invalid_image",
        )
    payload = url[match.end() :]
    # Refuse by the encoded length before allocating the decoded bytes: max_bytes bytes take at
    # most this many base64 characters.
    if len(payload) > 4 * ((max_bytes + 2) // 3):
        raise RequestValidationError(
            param,
            f"Image at {param} is larger than the {max_bytes} byte attachment limit",
            "attachment_too_large",
            status=413,
        )
    data = _strict_b64decode(payload, param)
    if len(data) > max_bytes:
        raise RequestValidationError(
            param,
            f"Image at {param} is larger than the {max_bytes} byte attachment limit",
            "attachment_too_large",
            status=413,
        )
    if not data:
        raise RequestValidationError(param, f"Image at {param} is empty", "invalid_image")
    return Attachment.from_bytes(data, media_type)


def _strict_b64decode(payload: str, param: str) -> bytes:
    try:
        # validate=True: a character outside the alphabet (whitespace included) or bad padding
        # is an error instead of being skipped: what is staged is exactly what vLLM decodes.
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestValidationError(
            param, f"Invalid base64 image data at {param}", "invalid_image"
        ) from exc
