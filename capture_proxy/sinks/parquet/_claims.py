"""Admission claims of a Parquet dataset: one small file (object) per claimed seq.

    STORE/claims/<rollout id, escaped>/<seq, 10 digits>
        {"call_id": ..., "rollout_id": ..., "seq": ..., "at_ms": ..., "writer": ...}

A claim is created only if absent, by the store itself, so the store decides which call holds a
seq whichever writer asks, in any process: on a local folder the file is created exclusively
(``O_CREAT | O_EXCL``) and fsynced with its folder (a group commit's claims together); on object
storage it is one ``PUT`` with
``If-None-Match: *`` through obstore (`DatasetFS.create`), which the store refuses (HTTP 412)
when the key exists. Not in a unit: a unit is written under a name no other writer uses, so
nothing in it would ever conflict. The claim's ``claim`` event still goes into the unit of its
group commit (`_events`), in the rollout's chain. `writer` names the sink that created it (a
proxy process): a writer continuing a rollout whose last claim another writer made records a
``handoff`` event.

On a dataset written through a configured pyarrow filesystem (no obstore store) a create cannot
be conditional: claims there are checked, not enforced (`DatasetFS.enforced`).

The store head covers the claim files (`claim_counts`: how many each rollout has and its highest
seq), so a claim file deleted after its writer published the head is caught against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import obstore
import orjson
import pyarrow.fs as pafs

from ...schemas.store_head import ClaimCount
from ..base import StoreError
from ._fs import DatasetFS, run_io

__all__ = [
    "CLAIMS_DIR",
    "Holders",
    "SeqClaim",
    "claim_counts",
    "claim_rel",
    "claim_seqs",
    "create_claims",
    "last_claim",
    "read_claims",
    "remove_claims",
]

CLAIMS_DIR = "claims"
#: Seq holders a writer remembers (its own claims, mostly): about 0.2 KB each. A sealed
#: rollout's go when its seal commits (`Holders.forget`), so this bounds rollouts left open.
_HOLDERS_KEPT = 65_536
#: Claims of one group commit written at once on object storage (each is one request).
_CONCURRENCY = 64


@dataclass(frozen=True, slots=True)
class SeqClaim:
    """`call_id` asks to hold `seq` of `rollout_id` (admitted at `at_ms`)."""

    rollout_id: str
    seq: int
    call_id: str
    at_ms: int

    @property
    def key(self) -> tuple[str, int]:
        return (self.rollout_id, self.seq)


def _folder(rollout_id: str) -> str:
    # Rollout ids are [A-Za-z0-9._:-]: "." and ".." would be folders of their own meaning, and
    # ":" is not allowed everywhere; quote() never escapes ".", so do it by hand.
    return urllib.parse.quote(rollout_id, safe="-_").replace(".", "%2E")


def claim_rel(rollout_id: str, seq: int) -> str:
    return f"{CLAIMS_DIR}/{_folder(rollout_id)}/{seq:010d}"


def _body(claim: SeqClaim, writer: str) -> bytes:
    return orjson.dumps(
        {
            "call_id": claim.call_id,
            "rollout_id": claim.rollout_id,
            "seq": claim.seq,
            "at_ms": claim.at_ms,
            "writer": writer,
        }
    )


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _holder(body: dict[str, Any]) -> str:
    holder = body.get("call_id")
    return str(holder) if holder is not None else "unknown (its claim file is unreadable)"


def _read_body(dfs: DatasetFS, rel: str) -> dict[str, Any]:
    try:
        return _decode(dfs.read(rel))
    except OSError:
        return {}


def create_claims(
    dfs: DatasetFS, claims: Sequence[SeqClaim], writer: str
) -> dict[tuple[str, int], str | Exception]:
    """Create each claim if its seq is free; returns, per (rollout, seq), the call that holds it
    now (the claim's own call when it was created, or the holder found) or the error that kept
    the store from answering.

    Blocking I/O: the writer thread only. On object storage the claims are written at once (one
    conditional ``PUT`` each, then one ``GET`` per refused one for its holder); locally each is
    created exclusively, then all are fsynced at once with their folders (`DatasetFS.create_all`).
    Claims of one seq by several calls: the first in `claims` asks.
    """
    first: dict[tuple[str, int], SeqClaim] = {}
    for c in claims:
        first.setdefault(c.key, c)
    wanted = list(first.values())
    out: dict[tuple[str, int], str | Exception] = {}
    if dfs.store is None:
        rels = {claim_rel(c.rollout_id, c.seq): c for c in wanted}
        got = dfs.create_all({rel: _body(c, writer) for rel, c in rels.items()})
        for rel, c in rels.items():
            created = got[rel]
            try:
                if isinstance(created, Exception):
                    raise created
                out[c.key] = c.call_id if created else _holder(_read_body(dfs, rel))
            except Exception as e:
                out[c.key] = e
        return out
    store = dfs.store
    gate = asyncio.Semaphore(_CONCURRENCY)

    async def one(c: SeqClaim) -> str:
        rel = claim_rel(c.rollout_id, c.seq)
        async with gate:
            if await dfs.create_async(rel, _body(c, writer)):
                return c.call_id
            got = await obstore.get_async(store, rel)
            return _holder(_decode(bytes(await got.bytes_async())))

    async def every() -> list[str | BaseException]:
        return await asyncio.gather(*(one(c) for c in wanted), return_exceptions=True)

    for c, result in zip(wanted, run_io(every()), strict=True):
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result
        out[c.key] = result
    return out


class Holders:
    """Which call holds each seq, as the store answered a writer. Writer thread only.

    `settle` writes the claims of a batch at once before the batch runs; `holder` answers each
    piece of work from that (or claims the seq then, if the batch did not). The holders of
    recent seqs are kept (a holder never changes), so a record staged after its claim costs no
    request; `forget` drops a rollout's once it takes no more calls (sealed), and beyond
    `_HOLDERS_KEPT` the least recently used rollouts' go. A holder not kept is read from its
    claim file when asked.
    """

    def __init__(
        self,
        dfs: DatasetFS,
        writer_id: str,
        on_created: Callable[[list[SeqClaim]], None] | None = None,
    ) -> None:
        self._dfs = dfs
        self.writer_id = writer_id
        #: Told of the claims created (durable), once per `create_claims` (the store head).
        self._on_created = on_created
        # Per rollout (least recently used first), seq -> holder; `_count` holders in all.
        self._held: OrderedDict[str, dict[int, str]] = OrderedDict()
        self._count = 0
        #: Claims of the batch being committed that the store could not answer.
        self._errors: dict[tuple[str, int], Exception] = {}
        #: Claims the batch being committed created: not what a handoff continues after.
        self._created: set[tuple[str, int]] = set()

    def settle(self, claims: Sequence[SeqClaim]) -> None:
        """Start a batch: create its claims whose holder is not known yet, all at once."""
        self._errors = {}
        self._created = set()
        wanted = [c for c in claims if self._known(c.key) is None]
        if not wanted:
            return
        first: dict[tuple[str, int], SeqClaim] = {}
        for c in wanted:
            first.setdefault(c.key, c)
        created = []
        for key, got in create_claims(self._dfs, wanted, self.writer_id).items():
            if isinstance(got, Exception):
                self._errors[key] = got
            else:
                self._hold(key, got)
                if got == first[key].call_id:
                    self._created.add(key)
                    created.append(first[key])
        self._tell(created)

    def holder(self, claim: SeqClaim) -> str:
        """The call holding `claim`'s seq, as the store decided (claimed now if still free);
        `StoreError` when the store could not answer."""
        key = claim.key
        held = self._known(key)
        if held is not None:
            return held
        error = self._errors.pop(key, None)
        if error is None:
            got = create_claims(self._dfs, [claim], self.writer_id)[key]
            if not isinstance(got, Exception):
                if got == claim.call_id:
                    self._created.add(key)
                    self._tell([claim])
                return self._hold(key, got)
            error = got
        raise StoreError(
            f"claiming seq {claim.seq} of rollout {claim.rollout_id} failed "
            f"({type(error).__name__}: {error})"
        ) from error

    def _tell(self, created: list[SeqClaim]) -> None:
        if created and self._on_created is not None:
            self._on_created(created)

    def created_now(self, rollout_id: str) -> set[int]:
        """Seqs of `rollout_id` this batch claimed."""
        return {seq for rid, seq in self._created if rid == rollout_id}

    def forget(self, rollout_id: str) -> None:
        """Drop the holders of `rollout_id` (sealed: it takes no more calls; a late entry's
        claim is answered by the store)."""
        seqs = self._held.pop(rollout_id, None)
        if seqs is not None:
            self._count -= len(seqs)

    def __len__(self) -> int:
        """How many holders are kept."""
        return self._count

    def _known(self, key: tuple[str, int]) -> str | None:
        seqs = self._held.get(key[0])
        return None if seqs is None else seqs.get(key[1])

    def _hold(self, key: tuple[str, int], holder: str) -> str:
        rollout_id, seq = key
        seqs = self._held.get(rollout_id)
        if seqs is None:
            seqs = self._held[rollout_id] = {}
        else:
            self._held.move_to_end(rollout_id)
        if seq not in seqs:
            self._count += 1
        seqs[seq] = holder
        while self._count > _HOLDERS_KEPT:
            _, dropped = self._held.popitem(last=False)
            self._count -= len(dropped)
        return holder


def read_claims(dfs: DatasetFS, rollout_id: str) -> dict[int, str]:
    """The rollout's claims: seq -> call id ({} when none). One listing, then the bodies
    (at once on object storage)."""
    folder = f"{CLAIMS_DIR}/{_folder(rollout_id)}"
    seqs = [int(e.name) for e in dfs.listdir(folder) if e.name.isdigit()]
    rels = [f"{folder}/{seq:010d}" for seq in seqs]
    if dfs.store is None:
        bodies = [_read_body(dfs, rel) for rel in rels]
    else:
        store = dfs.store

        async def every() -> list[dict[str, Any]]:
            async def one(rel: str) -> dict[str, Any]:
                try:
                    got = await obstore.get_async(store, rel)
                    return _decode(bytes(await got.bytes_async()))
                except OSError:
                    return {}

            return await asyncio.gather(*(one(r) for r in rels))

        bodies = run_io(every())
    return dict(sorted((seq, _holder(b)) for seq, b in zip(seqs, bodies, strict=True)))


def last_claim(
    dfs: DatasetFS, rollout_id: str, skip: Collection[int] = ()
) -> tuple[int, str, str] | None:
    """The rollout's highest claimed seq not in `skip`, its call and the writer that claimed it
    (one listing, one read), or None when it has no such claim."""
    folder = f"{CLAIMS_DIR}/{_folder(rollout_id)}"
    seqs = [int(e.name) for e in dfs.listdir(folder) if e.name.isdigit()]
    seqs = [seq for seq in seqs if seq not in skip]
    if not seqs:
        return None
    seq = max(seqs)
    body = _read_body(dfs, f"{folder}/{seq:010d}")
    return seq, _holder(body), str(body.get("writer") or "")


def claim_seqs(dfs: DatasetFS, rollout_id: str) -> list[int]:
    """The seqs of the rollout's claim files (one listing, no body read)."""
    names = dfs.names(f"{CLAIMS_DIR}/{_folder(rollout_id)}")
    return [int(name) for name in names if name.isdigit()]


def claim_counts(dfs: DatasetFS) -> dict[str, ClaimCount]:
    """Every rollout's claim files, counted (`ClaimCount`), from their names alone: what the
    store head covers of them. A local folder is listed folder by folder; object storage in
    one recursive listing."""
    seqs: dict[str, list[int]] = {}
    if dfs.local:
        for folder in dfs.names(CLAIMS_DIR):
            try:
                names = os.listdir(dfs.path(f"{CLAIMS_DIR}/{folder}"))
            except NotADirectoryError:
                continue
            found = [int(name) for name in names if name.isdigit()]
            if found:
                seqs[urllib.parse.unquote(folder)] = found
    else:
        selector = pafs.FileSelector(dfs.path(CLAIMS_DIR), recursive=True, allow_not_found=True)
        for info in dfs.fs.get_file_info(selector):
            folder = info.path.rstrip("/").split("/")[-2]
            if info.type == pafs.FileType.File and info.base_name.isdigit():
                seqs.setdefault(urllib.parse.unquote(folder), []).append(int(info.base_name))
    return {rollout_id: ClaimCount(len(s), max(s)) for rollout_id, s in seqs.items()}


def remove_claims(dfs: DatasetFS, rollout_ids: list[str]) -> None:
    """Delete the claims of rollouts `gc` removed (their ids may be used again)."""
    for rollout_id in rollout_ids:
        folder = f"{CLAIMS_DIR}/{_folder(rollout_id)}"
        dfs.delete_many([f"{folder}/{entry.name}" for entry in dfs.listdir(folder)])
        if dfs.local:
            with contextlib.suppress(OSError):
                os.rmdir(dfs.path(folder))
