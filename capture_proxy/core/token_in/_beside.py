"""Generate sent beside the request's own render (``--token-in-beside on``; docs/token-in.md,
"The whole-request check beside generate").

A bridged call's generate request is built from the plain render of the request (the sampling
vLLM resolved, ``max_tokens`` from the prompt's length, ``reasoning_ended``), and vLLM's frontend
serves the renders one after another, so generate waits for it. Beside, a call whose close and
anchors are known (its dummy renders are single, anchored renders) builds generate's request
from what the proxy already knows instead:

- `GenerateTemplate`: the last plain render of a request with the same keys besides its
  messages (`template_key`): its resolved sampling, its other ``GenerateRequest`` fields, its
  prompt's length. vLLM 0.32's render resolves the sampling from the request's keys and the
  server's generation config only (``ChatCompletionRequest.to_sampling_params``), the limit from
  the prompt's length (``get_max_tokens``), ``reasoning_ended`` from the prompt's ids.
- `early_body`: that template with the bridged prompt, a fresh ``request_id`` and the limit
  worked out for the bridged prompt as the ordinary path would send it.

Generate goes out as soon as the dummies answer; when the plain render answers, the ordinary
request is built from it as always, and `mismatch` compares the two: anything but the
``request_id`` (and ``reasoning_ended`` when no structured output reads it) that differs means
the generation is not the ordinary one, so the flow aborts it and sends the ordinary request.
"""

from __future__ import annotations

import hashlib
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from ...adapters.vllm import Rendered

__all__ = [
    "BESIDE_MISMATCHES",
    "GenerateTemplate",
    "GenerateTemplates",
    "early_body",
    "mismatch",
    "template_key",
]

#: Why a generation sent beside the plain render was aborted (`mismatch`): the request's own
#: rendering did not end as the bridge says (the call is then a new segment, its break says
#: why), the limit differed (`max_tokens`), the resolved sampling (`sampling`), or another
#: field of generate's request (`request`).
BESIDE_MISMATCHES = ("prompt", "max_tokens", "sampling", "request")

_LIMIT_KEYS = ("max_tokens", "max_completion_tokens")
_NULL = msgspec.Raw(b"null")


def template_key(render_request: Mapping[str, Any]) -> str:
    """What a render's sampling and other fields depend on besides the prompt: the request
    rendered, without its messages (the sampling keys, the tools, the template keys, the
    model)."""
    rest = {k: v for k, v in render_request.items() if k != "messages"}
    return hashlib.sha256(orjson.dumps(rest, option=orjson.OPT_SORT_KEYS)).hexdigest()


@dataclass(frozen=True, slots=True)
class GenerateTemplate:
    """A plain render's answer without its prompt: what a later call with the same keys
    (`template_key`) builds generate's request from, beside its own render."""

    #: The render answer's ``sampling_params`` with the limit said (`Rendered.resolved_sampling`).
    sampling: Mapping[str, Any]
    rest: Mapping[str, msgspec.Raw]
    unary: Mapping[str, msgspec.Raw]
    #: The length of the prompt it was rendered for.
    prompt_length: int

    @classmethod
    def of(cls, rendered: Rendered) -> GenerateTemplate | None:
        """The template of `rendered`; None when a call cannot be sent from it: it has
        images (``features``) or a structured output (which reads ``reasoning_ended``, a fact
        of the prompt), or its sampling or limit was not read."""
        sampling = rendered.resolved_sampling
        if rendered.features is not None or type(sampling.get("max_tokens")) is not int:
            return None
        if sampling.get("structured_outputs") is not None:
            return None
        rest = {k: v for k, v in rendered.rest.items() if k not in ("token_ids", "features")}
        return cls(sampling, rest, dict(rendered.unary), len(rendered.prompt_ids))


class GenerateTemplates:
    """The last `GenerateTemplate` per `template_key` (the most recent `limit` kept), and the
    keys whose calls go the ordinary way for good (`refuse`: a generation sent beside was
    aborted once). Cleared with the turn closes for a new upstream process."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._templates: OrderedDict[str, GenerateTemplate | None] = OrderedDict()

    def get(self, key: str) -> GenerateTemplate | None:
        template = self._templates.get(key)
        if template is not None:
            self._templates.move_to_end(key)
        return template

    def put(self, key: str, rendered: Rendered) -> None:
        """Keep `rendered`'s template for `key` (unless the key was refused); a render no call
        can be sent from (`GenerateTemplate.of`: images, a structured output) leaves none."""
        if key in self._templates and self._templates[key] is None:
            return
        template = GenerateTemplate.of(rendered)
        if template is None:
            self._templates.pop(key, None)
            return
        self._templates[key] = template
        self._templates.move_to_end(key)
        self._bound()

    def refuse(self, key: str) -> None:
        """Send `key`'s calls the ordinary way from now on."""
        self._templates[key] = None
        self._templates.move_to_end(key)
        self._bound()

    def _bound(self) -> None:
        while len(self._templates) > self.limit:
            self._templates.popitem(last=False)

    def clear(self) -> None:
        self._templates.clear()


def early_body(
    template: GenerateTemplate,
    request: Mapping[str, Any],
    prompt_length: int,
    ids_json: bytes,
    *,
    stream: bool,
) -> bytes:
    """Generate's request for a prompt of `prompt_length` ids (`ids_json`) from `template`.

    The limit is the one the ordinary path sends (`TokenInPrompt.generate_body`): a request
    that sets one gets vLLM's resolution of it (the template's: the room the prompt leaves
    binds it only near the end of the context window, and `mismatch` then tells); one that
    sets none gets the room the bridged prompt leaves, ``max_model_len - len(prompt)``,
    worked out from the template's (its ``max_tokens`` plus its prompt's length: vLLM's
    ``get_max_tokens`` when no generation-config cap binds; `mismatch` tells when one did)."""
    sampling = dict(template.sampling)
    if all(request.get(k) is None for k in _LIMIT_KEYS):
        room = int(sampling["max_tokens"]) + template.prompt_length
        sampling["max_tokens"] = max(1, room - prompt_length)
    fresh = msgspec.Raw(orjson.dumps(f"chatcmpl-{uuid.uuid4().hex}"))  # vLLM's form of one
    rest = {**template.rest, "request_id": fresh}
    rendered = Rendered(
        prompt_ids=[], sampling_params=sampling, features=None, rest=rest, unary=template.unary
    )
    return rendered.generate_body(stream=stream, sampling_params=sampling, ids_json=ids_json)


def mismatch(early: bytes, ordinary: bytes, ids_json: bytes) -> str | None:
    """Why the generation of `early` is not the one `ordinary` asks for (a reason of
    `BESIDE_MISMATCHES`), or None when they are the same: the same prompt (`ids_json`, the
    last field of both) and the same fields but the ``request_id``, and ``reasoning_ended``
    when no structured output reads it (vLLM 0.32 reads it only for a structured output's
    grammar, ``v1/structured_output/__init__.py``)."""
    tail = b'"token_ids":' + ids_json + b"}"
    if not (early.endswith(tail) and ordinary.endswith(tail)):
        return "prompt"
    a = _head(early[: -len(tail)])
    b = _head(ordinary[: -len(tail)])
    for fields in (a, b):
        fields.pop("request_id", None)
    sa, sb = a.pop("sampling_params", {}), b.pop("sampling_params", {})
    if sb.get("structured_outputs") is None:
        a.pop("reasoning_ended", None)
        b.pop("reasoning_ended", None)
    if sa.get("max_tokens") != sb.get("max_tokens"):
        return "max_tokens"
    if sa != sb:
        return "sampling"
    if a != b:
        return "request"
    return None


def _head(head: bytes) -> dict[str, Any]:
    """The fields of a generate request before its ``token_ids`` (`head` ends with ``,``)."""
    fields = orjson.loads(head[:-1] + b"}" if head.endswith(b",") else head + b"}")
    assert isinstance(fields, dict)
    return fields
