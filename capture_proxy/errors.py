"""The project's errors: `CaptureProxyError`, the root of every error capture-proxy raises on
purpose, and the errors that become HTTP answers.

Each HTTP error carries its status; `error_body` builds the one OpenAI-style body every error
uses: ``{"error": {"message", "type", "param", "code"}}``.

This module imports nothing of ours, so every layer (``schemas`` at the bottom included) may
derive its errors from `CaptureProxyError`; ``tests/test_package.py`` holds it to that. The root
lives here rather than in ``schemas/`` because it is not part of any schema: it is the one home of
the project's errors, next to the HTTP errors users already import from here.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = [
    "BadRequest",
    "CaptureProxyError",
    "CaptureUnavailable",
    "Conflict",
    "Forbidden",
    "NotFound",
    "PayloadTooLarge",
    "ProxyError",
    "RequestTimeout",
    "TooManyRequests",
    "Unauthorized",
    "Unprocessable",
    "UnsupportedMediaType",
    "UpstreamFailed",
    "error_body",
    "error_text",
]


def error_body(
    message: str, *, type: str, code: str | int | None, param: str | None = None
) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


def error_text(exc: BaseException) -> str:
    """`exc` as the sentence it carries, for a message. A KeyError's ``str()`` is the repr of its
    argument (``"'no rollout x'"``, quotes and all); this is the argument itself."""
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        return str(exc.args[0])
    return str(exc)


class CaptureProxyError(Exception):
    """The root of every error capture-proxy raises on purpose.

    ``except CaptureProxyError`` catches a refused request (`RequestValidationError`), a store that
    cannot be opened or read (`StoreError`, `StoreCorrupted`), a broken upstream answer
    (`UpstreamProtocolError`), an answer that cannot be captured (`CaptureExtractionError`), an
    invalid record, policy or setting, and every error the proxy answers over HTTP
    (`ProxyError`). Errors that were ``ValueError`` before keep that base too.
    """


class ProxyError(CaptureProxyError):
    """An error answered to the client. `code` is a short machine-readable reason."""

    status = 500
    type = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        code: str = "error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.message, type=self.type, code=self.code, param=self.param)

    def to_dict(self) -> dict[str, Any]:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}


class BadRequest(ProxyError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ProxyError):
    status = 401
    type = "authentication_error"


class Forbidden(ProxyError):
    status = 403
    type = "permission_error"


class NotFound(ProxyError):
    status = 404
    type = "not_found_error"


class Conflict(ProxyError):
    status = 409
    type = "conflict_error"


class RequestTimeout(ProxyError):
    """The client did not send its request in time (``--client-body-timeout``)."""

    status = 408
    type = "invalid_request_error"


class PayloadTooLarge(ProxyError):
    status = 413
    type = "invalid_request_error"


class UnsupportedMediaType(ProxyError):
    status = 415
    type = "invalid_request_error"


class Unprocessable(ProxyError):
    status = 422
    type = "invalid_request_error"


class TooManyRequests(ProxyError):
    status = 429
    type = "rate_limit_error"


class UpstreamFailed(ProxyError):
    """The upstream could not be reached, timed out, or answered something unusable."""

    status = 502
    type = "upstream_error"

    def __init__(self, message: str, *, code: str = "upstream_error", status: int = 502) -> None:
        super().__init__(message, code=code)
        self.status = status


class CaptureUnavailable(ProxyError):
    """The proxy will not take a call it could not capture (sink down, disk floor, overload)."""

    status = 503
    type = "capture_unavailable"
