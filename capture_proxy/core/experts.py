"""Routed experts stored as deltas: which earlier call's rows a new call can start after.

vLLM returns the experts of every prompt and output position (`schemas/experts.py`); a session
that re-sends its history would store each position's rows again on every later call, quadratic
in the session. So before a call is sent, the proxy looks for the earlier call of the rollout that
the request continues, and asks vLLM for rows only from that call's end
(``routed_experts_prompt_start``); the record then says where its rows start and after which call.

The start must be chosen before the prompt's tokens exist, so the continuation is found by
*messages*: an earlier call is a candidate when the new request's messages begin with that call's
request messages followed by its answer. Assistant messages are compared loosely — content None
as "", tool calls by name and parsed arguments, reasoning ignored — because clients replay them
re-serialized (OpenCode compacts tool arguments, docs/upstream-facts.md); the exact check comes
after the answer, on tokens: the new prompt must start with the tokens the earlier call's rows
were routed for, or the record is flagged `EXPERTS_INCOMPLETE`.

Only calls whose records hold routed experts are candidates, so the request field is sent only to
an upstream that has returned experts to this rollout: stock vLLM (which sends null) never sees
it, and no setting is needed.
"""

from __future__ import annotations

import contextlib
import hashlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ..schemas.experts import (
    EXPERTS,
    EXPERTS_INCOMPLETE,
    EXPERTS_PARENT,
    EXPERTS_START,
    ExpertsFormatError,
    npy_rows,
)
from ..schemas.tokens import full_sequence

__all__ = [
    "ExpertsIndex",
    "ExpertsParent",
    "ExpertsPlan",
    "message_chain",
    "record_experts",
    "stored_entry",
]

_SEED = b"capture-proxy:experts-messages:v1\0"


@dataclass(frozen=True, slots=True)
class ExpertsParent:
    """A staged call whose rows a later call may start after.

    `end` is the position after its last stored row (its start plus its rows: every position of
    its prompt + completion that vLLM routed); `sha256` the digest of its first `end` tokens.
    `complete` is false for a record flagged `EXPERTS_INCOMPLETE`: a call continuing it asks
    for every position instead (it starts a new chain rather than inherit the gap).
    """

    seq: int
    call_id: str
    end: int
    sha256: bytes
    complete: bool = True


@dataclass(slots=True)
class ExpertsPlan:
    """What admission decided for one call: the message chain of its request (computed once, for
    the lookup and for its own entry), the parent it continues and the start it asks for."""

    chain: list[bytes] | None = None
    parent: ExpertsParent | None = None

    @property
    def start(self) -> int | None:
        """``routed_experts_prompt_start`` to send (None: ask for every position)."""
        return self.parent.end if self.parent is not None and self.parent.end > 0 else None


def _loose(message: Mapping[str, Any]) -> Any:
    """A message as compared for continuation: assistant messages loosely (module docs)."""
    if message.get("role") != "assistant":
        return message
    calls = []
    for tc in message.get("tool_calls") or ():
        fn = tc.get("function") if isinstance(tc, Mapping) else None
        fn = fn if isinstance(fn, Mapping) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(orjson.JSONDecodeError):  # not JSON: compared as a string
                args = orjson.loads(args)
        calls.append([fn.get("name"), args])
    return ["assistant", message.get("content") or "", calls]


def _link(previous: bytes, message: Any) -> bytes:
    encoded = orjson.dumps(_loose(message), option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(previous + encoded).digest()


def message_chain(request: Mapping[str, Any]) -> list[bytes]:
    """``chain[i]``: the key of the request's first ``i`` messages (``chain[0]``: none).

    Seeded with what else shapes the rendered prompt (model, tools, chat-template arguments), so
    a call with other tools never continues one rendered with these.
    """
    context = {k: request.get(k) for k in ("model", "tools", "chat_template_kwargs")}
    key = hashlib.sha256(_SEED + orjson.dumps(context, option=orjson.OPT_SORT_KEYS)).digest()
    chain = [key]
    messages = request.get("messages")
    for message in messages if isinstance(messages, list) else ():
        key = _link(key, message if isinstance(message, Mapping) else {"": message})
        chain.append(key)
    return chain


class ExpertsIndex:
    """The staged calls of one rollout that hold routed experts, by the key of their messages
    (request messages + answer). Ties (the same conversation answered the same way): the latest.
    """

    __slots__ = ("_by_key",)

    def __init__(self) -> None:
        self._by_key: dict[bytes, ExpertsParent] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, key: bytes, parent: ExpertsParent) -> None:
        held = self._by_key.get(key)
        if held is None or held.seq <= parent.seq:
            self._by_key[key] = parent

    def choose(self, chain: Sequence[bytes]) -> ExpertsParent | None:
        """The candidate whose conversation is the longest message prefix of `chain`'s."""
        for key in reversed(chain[1:]):
            found = self._by_key.get(key)
            if found is not None:
                return found
        return None

    def plan(self, request: Mapping[str, Any]) -> ExpertsPlan:
        """Admission's lookup for a new request. Free when the rollout has no candidate (no
        upstream answer carried experts): the messages are hashed only when one may match."""
        if not self._by_key or request.get(EXPERTS_START) is not None:
            return ExpertsPlan()  # nothing to continue, or the client chose its own start
        chain = message_chain(request)
        parent = self.choose(chain)
        return ExpertsPlan(chain, parent if parent is not None and parent.complete else None)


def record_experts(
    plan: ExpertsPlan,
    request: Mapping[str, Any],
    response: Mapping[str, Any],
    prompt: array[int],
    completion: array[int],
    extras: Mapping[str, Any],
    seq: int,
    call_id: str,
) -> tuple[dict[str, Any], tuple[bytes, ExpertsParent] | None]:
    """What a completed call adds to its record's extras, and its own index entry (or None).

    `extras` is what the upstream answered (`EXPERTS` when it
    sent experts). The start the call asked for is recorded with the parent it came from; the
    record is flagged incomplete when its prompt does not start with the parent's routed tokens.
    A client that sent its own start gets it recorded, flagged incomplete: no stored call holds
    the rows before it.
    """
    if EXPERTS not in extras:
        return {}, None
    full = full_sequence(prompt, completion)
    added: dict[str, Any] = {}
    client_start = request.get(EXPERTS_START)
    if plan.parent is not None and plan.start is not None:
        parent, start = plan.parent, plan.start
        added[EXPERTS_START] = start
        added[EXPERTS_PARENT] = parent.call_id
        if len(prompt) < start or _sha(full, start) != parent.sha256:
            added[EXPERTS_INCOMPLETE] = True
    elif isinstance(client_start, int) and client_start > 0:
        start = client_start
        added[EXPERTS_START] = start
        added[EXPERTS_INCOMPLETE] = True
    else:
        start = 0
    entry = _entry(plan.chain, request, response, full, start, {**extras, **added}, seq, call_id)
    return added, entry


def stored_entry(
    request: Mapping[str, Any],
    response: Mapping[str, Any],
    full: array[int],
    extras: Mapping[str, Any],
    seq: int,
    call_id: str,
) -> tuple[bytes, ExpertsParent] | None:
    """The index entry of a record read back from the store (a resumed rollout), or None."""
    if EXPERTS not in extras:
        return None
    start = extras.get(EXPERTS_START, 0)
    if type(start) is not int or start < 0:
        return None
    return _entry(None, request, response, full, start, extras, seq, call_id)


def _entry(
    chain: list[bytes] | None,
    request: Mapping[str, Any],
    response: Mapping[str, Any],
    full: array[int],
    start: int,
    extras: Mapping[str, Any],
    seq: int,
    call_id: str,
) -> tuple[bytes, ExpertsParent] | None:
    # A record whose rows cannot be counted, or overrun its tokens, is no parent.
    try:
        end = start + npy_rows(extras[EXPERTS])
    except ExpertsFormatError:
        return None
    if end > len(full):
        return None
    if chain is None:
        chain = message_chain(request)
    key = _link(chain[-1], response)
    complete = extras.get(EXPERTS_INCOMPLETE) is not True
    return key, ExpertsParent(seq, call_id, end, _sha(full, end), complete)


def _sha(tokens: array[int], n: int) -> bytes:
    return hashlib.sha256(memoryview(tokens)[:n].cast("B")).digest()
