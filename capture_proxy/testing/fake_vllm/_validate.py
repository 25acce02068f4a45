"""The fake vLLM's request checks, with vLLM 0.32's error bodies and messages.

Unknown top-level keys are ignored silently, as vLLM does. The messages follow vLLM's wording
(``fixtures/vllm-0.32.0/error-*.json``); vLLM's own request-validation errors (a body that is not
JSON, ``messages`` missing) have the type ``"Bad Request"``, its engine checks ``BadRequestError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from ._protocol import error_body

__all__ = ["RequestError", "check_model", "output_limit", "require_messages"]


class RequestError(Exception):
    """A request vLLM would refuse; `response` is the HTTP answer vLLM gives."""

    def __init__(
        self, status: int, message: str, *, err_type: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type or ("Bad Request" if status == 400 else "NotFoundError")
        self.param = param

    def response(self) -> web.Response:
        body = orjson.dumps(error_body(self.message, self.err_type, self.status, self.param))
        return web.Response(status=self.status, body=body, content_type="application/json")


def check_model(body: Mapping[str, Any], served: str) -> None:
    """404 for a model other than the served one (a missing ``model`` means the served one)."""
    model = body.get("model")
    if model is not None and model != served:
        raise RequestError(
            404,
            f"The model `{model}` does not exist. Valid aliases: {served}.",
            err_type="NotFoundError",
            param="model",
        )


def require_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ``messages`` list; 400 when it is missing or not a list of objects."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RequestError(400, "`messages` must be a list of message objects.", param="messages")
    return messages


def output_limit(body: Mapping[str, Any], prompt_tokens: int, max_model_len: int) -> int:
    """How many tokens may be generated; vLLM's 400s when the request cannot fit.

    ``max_completion_tokens`` wins over ``max_tokens``; without either, whatever room the prompt
    leaves. vLLM stops tokenizing one token past the room it has, so a prompt that does not fit is
    reported as "at least" that many tokens.
    """
    param = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    requested = body.get(param)
    if requested is not None:
        if type(requested) is not int:
            raise RequestError(400, f"`{param}` must be an integer.", param=param)
        if requested > max_model_len:
            raise RequestError(
                400,
                f"{param}={requested} cannot be greater than max_model_len={max_model_len}. "
                f"Please request fewer output tokens. (parameter={param}, value={requested})",
                err_type="BadRequestError",
                param=param,
            )
        if requested < 1:
            raise RequestError(
                400,
                f"max_tokens must be at least 1, got {requested}. "
                f"(parameter={param}, value={requested})",
                err_type="BadRequestError",
                param=param,
            )
    out = requested if requested is not None else max(0, max_model_len - prompt_tokens)
    room = max_model_len - out
    if prompt_tokens > room:
        shown = room + 1
        raise RequestError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {out} output tokens and your prompt contains at least {shown} input "
            f"tokens, for a total of at least {shown + out} tokens. Please reduce the length of "
            f"the input prompt or the number of requested output tokens. "
            f"(parameter=input_tokens, value={shown})",
            err_type="BadRequestError",
            param="input_tokens",
        )
    if (body.get("n") or 1) != 1:
        raise RequestError(400, "The fake vLLM generates one choice per request (n=1).", param="n")
    return out
