"""A call's routed experts over its whole prompt + completion, rebuilt from the stored deltas.

Each record stores the rows vLLM returned for it: from position ``routed_experts_prompt_start``
on (absent: 0), the rows before it being those of the call named ``routed_experts_parent_call_id``
(`capture_proxy.schemas.experts`). `assemble_experts` walks that chain back to a record that holds
every position, then lays the rows down again from there: each call's rows replace its parent's
from its start. The result is one ``.npy`` array of shape ``(positions, ...)``, encoded as vLLM
sends it (base64), so a trainer decodes an assembled value and a stored one the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import CaptureProxyError
from ..schemas.experts import (
    EXPERTS,
    EXPERTS_INCOMPLETE,
    EXPERTS_PARENT,
    EXPERTS_START,
    NpyArray,
    decode_npy,
    encode_npy,
)
from ..schemas.records import StagedCallRecord

__all__ = ["ExpertsIncomplete", "ExpertsUnavailable", "assemble_experts"]


class ExpertsUnavailable(CaptureProxyError):
    """A call's routed experts cannot be rebuilt: a record of its chain is missing or its rows
    do not fit together."""


class ExpertsIncomplete(ExpertsUnavailable):
    """A call's routed experts are flagged ``routed_experts_incomplete`` (its prompt drifted from
    its parent's tokens before its start, or its chain holds such a call): some rows are its
    parent's, routed for other tokens. ``allow_incomplete=True`` returns them anyway."""


def assemble_experts(
    fetch: Callable[[str], StagedCallRecord],
    record: StagedCallRecord,
    *,
    allow_incomplete: bool = False,
) -> str | None:
    """`record`'s routed experts over all its positions (None: it has none); `fetch` reads a
    record by call id. Raises `ExpertsIncomplete` for a flagged chain unless
    `allow_incomplete`, `ExpertsUnavailable` when the chain cannot be rebuilt."""
    if EXPERTS not in record.extras:
        return None
    chain = [record]
    incomplete = False
    seen = {record.call_id}
    while True:
        extras = chain[-1].extras
        incomplete = incomplete or extras.get(EXPERTS_INCOMPLETE) is True
        parent_id = extras.get(EXPERTS_PARENT)
        if parent_id is None:
            break
        if not isinstance(parent_id, str) or parent_id in seen:
            raise ExpertsUnavailable(f"{chain[-1].call_id}: bad experts parent {parent_id!r}")
        try:
            parent = fetch(parent_id)
        except KeyError as exc:
            raise ExpertsUnavailable(
                f"{chain[-1].call_id}: its experts parent {parent_id} is not in the store"
            ) from exc
        if EXPERTS not in parent.extras:
            raise ExpertsUnavailable(f"{chain[-1].call_id}: {parent_id} holds no routed experts")
        seen.add(parent_id)
        chain.append(parent)
    if incomplete and not allow_incomplete:
        raise ExpertsIncomplete(
            f"{record.call_id}: routed experts incomplete (a prompt drifted before its start); "
            "pass allow_incomplete=True to get them anyway"
        )
    root = chain[-1]
    if _start(root):
        raise ExpertsUnavailable(
            f"{root.call_id}: no stored call holds the experts before position {_start(root)} "
            "(the client chose its own routed_experts_prompt_start)"
        )
    first = decode_npy(root.extras[EXPERTS])
    data = bytearray(first.data)
    rows = first.shape[0]
    for child in reversed(chain[:-1]):
        arr = decode_npy(child.extras[EXPERTS])
        start = _start(child)
        if (arr.descr, arr.shape[1:]) != (first.descr, first.shape[1:]):
            raise ExpertsUnavailable(
                f"{child.call_id}: experts of {arr.descr} {arr.shape} do not continue "
                f"{first.descr} {first.shape}"
            )
        if start > rows:
            raise ExpertsUnavailable(
                f"{child.call_id}: starts at position {start}, its parent has {rows} rows"
            )
        # In place: a long chain costs its total size once, not once per link.
        del data[start * first.row_bytes :]
        data += arr.data
        rows = start + arr.shape[0]
    return encode_npy(NpyArray(first.descr, (rows, *first.shape[1:]), bytes(data)))


def _start(record: StagedCallRecord) -> int:
    start = record.extras.get(EXPERTS_START, 0)
    if type(start) is not int or start < 0:
        raise ExpertsUnavailable(f"{record.call_id}: bad {EXPERTS_START} {start!r}")
    return start
