"""Scripted turns from a JSON file: ``python -m capture_proxy.fake_vllm --script turns.json``.

The file is a JSON array; each entry is one answer, used in order (then the default echo
answer), with the fields of `Turn`::

    [
      {"reasoning": "look first", "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}]},
      {"content": "Two files.", "finish_reason": "stop"},
      {"content": "late", "fault": {"kind": "delay_first_byte", "seconds": 2}},
      {"fault": {"kind": "http_error", "status": 503}}
    ]

A fault is ``{"kind": ...}`` plus the arguments of the `Fault` constructor of that name
(``http_error``: ``status``, ``body``; ``reset_after``: ``n_chunks``; ``error_event``:
``after``, ``message``, ``status``; ...). Errors name the entry as a JSON path
(``$[1].tool_calls[0].name``), so a typo is found without reading this module.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

from ._faults import Fault, FaultKind
from ._generation import FakeToolCall, Turn

__all__ = ["load_script", "parse_script"]

_TURN_KEYS = ("content", "reasoning", "tool_calls", "finish_reason", "fault")
#: Fault arguments by name, with the JSON types they take (every constructor uses these names).
_FAULT_ARGS: dict[str, tuple[type, ...]] = {
    "status": (int,),
    "body": (dict, list, str),
    "seconds": (int, float),
    "n_chunks": (int,),
    "after": (int,),
    "every": (int,),
    "message": (str,),
}
_JSON_NAMES: dict[type, str] = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "an integer",
}


def load_script(path: str) -> list[Turn]:
    """The turns of a script file (see the module's docstring); ValueError naming the file and
    the entry when it is not one."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON: {e}") from e
    try:
        return parse_script(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def parse_script(data: Any) -> list[Turn]:
    """Turns from decoded JSON (a list of turn objects); ValueError naming the entry."""
    if not isinstance(data, list):
        raise ValueError(f"$: expected an array of turns, got {_kind(data)}")
    return [_turn(entry, f"$[{i}]") for i, entry in enumerate(data)]


def _turn(entry: Any, at: str) -> Turn:
    obj = _object(entry, at, _TURN_KEYS)
    content = _typed(obj.get("content", ""), f"{at}.content", str)
    reasoning = obj.get("reasoning")
    if reasoning is not None:
        _typed(reasoning, f"{at}.reasoning", str)
    finish_reason = obj.get("finish_reason")
    if finish_reason is not None:
        _typed(finish_reason, f"{at}.finish_reason", str)
    calls = _typed(obj.get("tool_calls", []), f"{at}.tool_calls", list)
    tool_calls = [_tool_call(c, f"{at}.tool_calls[{j}]") for j, c in enumerate(calls)]
    fault = _fault(obj["fault"], f"{at}.fault") if obj.get("fault") is not None else None
    return Turn(content, reasoning, tool_calls, finish_reason, fault)


def _tool_call(entry: Any, at: str) -> FakeToolCall:
    obj = _object(entry, at, ("name", "arguments"))
    if "name" not in obj:
        raise ValueError(f"{at}: a tool call needs a name")
    name = _typed(obj["name"], f"{at}.name", str)
    arguments = _typed(obj.get("arguments", {}), f"{at}.arguments", dict)
    return FakeToolCall(name, arguments)


def _fault(entry: Any, at: str) -> Fault:
    kinds = [k.value for k in FaultKind]
    obj = _object(entry, at, None)
    kind = obj.get("kind")
    if kind not in kinds:
        raise ValueError(f"{at}.kind: expected one of {', '.join(kinds)}, got {kind!r}")
    make: Callable[..., Fault] = getattr(Fault, kind)
    params = inspect.signature(make).parameters
    args = {k: v for k, v in obj.items() if k != "kind"}
    for key, value in args.items():
        if key not in params:
            known = ", ".join(params) or "none"
            raise ValueError(f"{at}: a {kind} fault takes no {key!r} (its arguments: {known})")
        if not (key == "every" and value is None):
            _typed(value, f"{at}.{key}", *_FAULT_ARGS[key])
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty]
    missing = [n for n in missing if n not in args]
    if missing:
        raise ValueError(f"{at}: a {kind} fault needs {', '.join(missing)}")
    return make(**args)


def _object(value: Any, at: str, keys: tuple[str, ...] | None) -> dict[str, Any]:
    obj: dict[str, Any] = _typed(value, at, dict)
    unknown = [k for k in obj if keys is not None and k not in keys]
    if unknown and keys is not None:
        raise ValueError(f"{at}: unknown key {unknown[0]!r} (known: {', '.join(keys)})")
    return obj


def _typed(value: Any, at: str, *types: type) -> Any:
    # bool is an int to Python, not to JSON: `"status": true` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, types):
        wanted = "a number" if float in types else " or ".join(_JSON_NAMES[t] for t in types)
        raise ValueError(f"{at}: expected {wanted}, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {value!r}"
    return _JSON_NAMES.get(type(value), type(value).__name__)
