"""Chain heads a driver kept: the anchor of an anchored read.

The control API's seal and outcome answers carry the rollout's ``chain_head``
(`capture_proxy.read.integrity.chain_head`): one hash over its event log, records included by
digest. A driver that keeps the last answer it got for each rollout can later refuse any
rollout whose stored chain does not end there, which an edit made from the public spec alone
(events rehashed, digests recomputed) cannot hide:

    >>> heads = load_heads("seal-answers.jsonl")          # rollout id -> chain head
    >>> for traj in store.iter_trajectories(expected_heads=heads): ...
    >>> export_store(store, "out.parquet", expected_heads=heads)
    $ capture-proxy export STORE out.parquet --expected-heads seal-answers.jsonl

docs/contract.md ("Anchored reads") says what to keep and what it proves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from ..errors import CaptureProxyError

__all__ = ["AnchorsInvalid", "heads_of", "load_heads"]

#: A file of anchors larger than this is refused (a driver's answers are ~1 KB a rollout).
MAX_ANCHORS_BYTES = 256 << 20


class AnchorsInvalid(CaptureProxyError):
    """A file of expected chain heads cannot be read; the message names the line."""


def heads_of(answers: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Rollout id -> chain head from seal or outcome answers (or ``{"rollout_id",
    "chain_head"}`` objects), in the order given: a later answer for a rollout replaces an
    earlier one (an outcome sent after the seal moves the head). Answers without a head
    (a proxy from before chain heads) are skipped."""
    heads: dict[str, str] = {}
    for answer in answers:
        rollout_id, head = answer.get("rollout_id"), answer.get("chain_head")
        if isinstance(rollout_id, str) and isinstance(head, str):
            heads[rollout_id] = head
    return heads


def load_heads(path: str) -> dict[str, str]:
    """Read a file of the seal and outcome answers a driver kept: JSON Lines (one answer per
    line) or one JSON array of them. Raises `AnchorsInvalid` naming what is wrong."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_ANCHORS_BYTES + 1)
    except OSError as e:
        raise AnchorsInvalid(f"{path}: {e.strerror or e}") from e
    if len(raw) > MAX_ANCHORS_BYTES:
        raise AnchorsInvalid(f"{path}: over {MAX_ANCHORS_BYTES} bytes")
    text = raw.strip()
    answers: list[Mapping[str, Any]] = []
    if text.startswith(b"["):
        try:
            items = orjson.loads(text)
        except orjson.JSONDecodeError as e:
            raise AnchorsInvalid(f"{path}: not JSON: {e}") from e
        lines = [(i, item) for i, item in enumerate(items, 1)]
    else:
        lines = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                lines.append((n, orjson.loads(line)))
            except orjson.JSONDecodeError as e:
                raise AnchorsInvalid(f"{path}, line {n}: not JSON: {e}") from e
    for n, item in lines:
        if not isinstance(item, dict):
            raise AnchorsInvalid(f"{path}, item {n}: an answer is a JSON object")
        answers.append(item)
    return heads_of(answers)
