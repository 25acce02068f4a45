"""Admission claims of a Parquet dataset: one small file per claimed seq.

    STORE/claims/<rollout id, escaped>/<seq, 10 digits>     {"call_id": ..., "at_ms": ...}

On a local folder a claim file is created exclusively (``O_CREAT | O_EXCL``) and fsynced with
its folder before the claim is acknowledged, so the file system itself refuses a second claim of
a seq, whichever process asks. Not in a unit: a claim must be refused by the store, and a unit
is written under a name no other writer uses, so nothing would ever conflict. The claim's
``claim`` event still goes into the unit of its group commit (`_events`), in the rollout's chain.

On object storage (a dataset on a remote pyarrow filesystem) pyarrow cannot create an object only
if it is absent, so claims are **checked, not enforced** there yet: the file is written after a
check that it is missing, and two writers racing for one seq can both win. Conditional writes
through obstore are the planned fix (docs/reports/object-store-spike.md).
"""

from __future__ import annotations

import contextlib
import os
import urllib.parse

import orjson

from ._fs import DatasetFS

__all__ = [
    "CLAIMS_DIR",
    "claim_rel",
    "create_claim",
    "read_claims",
    "remove_claims",
]

CLAIMS_DIR = "claims"


def _folder(rollout_id: str) -> str:
    # Rollout ids are [A-Za-z0-9._:-]: "." and ".." would be folders of their own meaning, and
    # ":" is not allowed everywhere; quote() never escapes ".", so do it by hand.
    return urllib.parse.quote(rollout_id, safe="-_").replace(".", "%2E")


def claim_rel(rollout_id: str, seq: int) -> str:
    return f"{CLAIMS_DIR}/{_folder(rollout_id)}/{seq:010d}"


def _holder(dfs: DatasetFS, rel: str) -> str:
    try:
        return str(orjson.loads(dfs.read(rel))["call_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown (its claim file is unreadable)"


def create_claim(dfs: DatasetFS, rollout_id: str, seq: int, call_id: str, at_ms: int) -> str | None:
    """Claim `seq` for `call_id`, durably; returns None, or the call that holds the seq already.

    Blocking I/O: the writer thread only. The same call claiming its seq again is accepted.
    """
    rel = claim_rel(rollout_id, seq)
    body = orjson.dumps({"call_id": call_id, "rollout_id": rollout_id, "seq": seq, "at_ms": at_ms})
    if not dfs.local:
        if dfs.exists(rel):
            holder = _holder(dfs, rel)
            return holder if holder != call_id else None
        dfs.makedirs(os.path.dirname(rel))  # a no-op on object stores; some filesystems need it
        dfs.put_all({rel: body})
        return None
    folder = os.path.dirname(dfs.path(rel))
    if not os.path.isdir(folder):
        dfs.makedirs(CLAIMS_DIR, os.path.dirname(rel))
    try:
        fd = os.open(dfs.path(rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        holder = _holder(dfs, rel)
        return holder if holder != call_id else None
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the new name is durable too, not just the bytes
    finally:
        os.close(dir_fd)
    return None


def read_claims(dfs: DatasetFS, rollout_id: str) -> dict[int, str]:
    """The rollout's claims: seq -> call id ({} when none)."""
    folder = f"{CLAIMS_DIR}/{_folder(rollout_id)}"
    out: dict[int, str] = {}
    for entry in dfs.listdir(folder):
        name = entry.name
        if name.isdigit():
            out[int(name)] = _holder(dfs, f"{folder}/{name}")
    return dict(sorted(out.items()))


def remove_claims(dfs: DatasetFS, rollout_ids: list[str]) -> None:
    """Delete the claims of rollouts `gc` removed (their ids may be used again)."""
    for rollout_id in rollout_ids:
        folder = f"{CLAIMS_DIR}/{_folder(rollout_id)}"
        for entry in dfs.listdir(folder):
            dfs.delete(f"{folder}/{entry.name}")
        if dfs.local:
            with contextlib.suppress(OSError):
                os.rmdir(dfs.path(folder))
