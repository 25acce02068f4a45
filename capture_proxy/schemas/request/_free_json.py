"""Limits on the free-form JSON inside a request (tool parameter schemas, template kwargs, ...).

The schema types most of a request, but some values are free JSON by design. Whatever is
accepted is later staged and digested, and the digest encoding takes integers that fit in int64
and nesting that the encoder can walk. A value outside that must be refused *here*, before the
call is forwarded: found only at staging time, it would make an answered call `capture_failed`.
JSON decoding (orjson) already excludes NaN, infinities and lone surrogates, but lets integers up
to 2**64 - 1 and 1024 levels of nesting through.
"""

from __future__ import annotations

from typing import Any

from ._errors import RequestValidationError

__all__ = ["INT64_MAX", "INT64_MIN", "MAX_FREE_JSON_DEPTH", "check_free_json"]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Levels of nesting inside one free-form value. JSON Schemas of agent tools use about ten.
MAX_FREE_JSON_DEPTH = 64

_SKIP = (str, bool, type(None))
_JSON_TYPES = (*_SKIP, int, float, dict, list)


def check_free_json(value: Any, param: str) -> None:
    """Raise `RequestValidationError` (naming the path under `param`) if `value` holds an
    integer beyond int64, a non-finite float, a non-string key, or nests deeper than
    `MAX_FREE_JSON_DEPTH`."""
    if not _fine(value):
        raise _locate(value, param)


def _fine(root: Any) -> bool:
    """The fast pass: no paths are built, since almost every value is fine."""
    stack = [(root, 0)]
    while stack:
        value, depth = stack.pop()
        kind = type(value)
        if kind is dict:
            if depth >= MAX_FREE_JSON_DEPTH:
                return False
            for key, item in value.items():
                if type(key) is not str:
                    return False
                if not isinstance(item, _SKIP):
                    stack.append((item, depth + 1))
        elif kind is list:
            if depth >= MAX_FREE_JSON_DEPTH:
                return False
            stack.extend((item, depth + 1) for item in value if not isinstance(item, _SKIP))
        elif kind is int:
            if not INT64_MIN <= value <= INT64_MAX:
                return False
        elif kind is float:
            if value - value != 0.0:  # NaN or an infinity
                return False
        elif not isinstance(value, _SKIP):
            return False
    return True


def _locate(root: Any, param: str) -> RequestValidationError:
    """The slow pass, run only on failure: find the first offending value and its path."""
    stack: list[tuple[Any, str, int]] = [(root, param, 0)]
    while stack:
        value, path, depth = stack.pop()
        kind = type(value)
        if kind is dict or kind is list:
            if depth >= MAX_FREE_JSON_DEPTH:
                return RequestValidationError(
                    path,
                    f"Nesting deeper than {MAX_FREE_JSON_DEPTH} levels at {path} is not accepted",
                    "invalid_value",
                )
            if kind is dict:
                for key in value:
                    if type(key) is not str:
                        return RequestValidationError(
                            path,
                            f"Object key {key!r:.40} at {path} is not a string",
                            "invalid_type",
                        )
                children = [(item, f"{path}.{key}") for key, item in value.items()]
            else:
                children = [(item, f"{path}[{i}]") for i, item in enumerate(value)]
            # Reversed, so the first child is examined first (the error names the first problem).
            stack.extend((item, p, depth + 1) for item, p in reversed(children))
        elif kind is int and not INT64_MIN <= value <= INT64_MAX:
            return RequestValidationError(
                path, f"Integer at {path} does not fit in 64 bits", "invalid_value"
            )
        elif kind is float and value - value != 0.0:
            return RequestValidationError(path, f"Number at {path} is not finite", "invalid_value")
        elif not isinstance(value, _JSON_TYPES):
            return RequestValidationError(
                path, f"Value of type {kind.__name__} at {path} is not JSON", "invalid_type"
            )
    # _fine and _locate disagree only if the value changed in between.
    return RequestValidationError(param, f"Invalid value at {param}", "invalid_value")
