"""The ledger journal: ledger entries the store would not take, kept outside it until it does.

While the sink fails, `LedgerWriter` holds the entries it refused in memory. If the proxy stops
with some still held (the store's filesystem went read-only, the file was deleted), they are
spilled, at shutdown, to a journal beside the store: ``<store>.ledger-journal.jsonl`` (one JSON
object per line, appended, fsynced with its folder). Where there is no local folder (an object
store, ``memory://``) or the journal cannot be written either, each entry goes to stderr as one
line ``capture-proxy ledger-journal {...}``, which an operator can save into a journal file. The
proxy then exits with status 1 and says so in its last log line.

**Its space is reserved at start.** A full disk is the usual reason a store refuses writes, and
then a journal written only at shutdown could not be written either: the entries went to stderr,
and the automatic restart (systemd ``Restart=on-failure``, compose ``restart``) started clean
without them and handed their sequence numbers out again. So ``serve`` allocates
``<store>.ledger-journal.reserve`` (`RESERVE_BYTES`, with ``posix_fallocate``: blocks the disk
has given, not a sparse promise) before it serves; `spill_journal` writes into those blocks
and renames the file into the journal, which needs no new space. A clean stop with nothing
to spill removes the reserve.

A journal is replayed into the store by the next ``capture-proxy serve`` on that store, before it
serves, or by ``capture-proxy replay-ledger STORE JOURNAL``; it is removed once every entry is in
the store. Replay is idempotent: an entry whose call is already in its rollout's ledger is
skipped, so a replay cut short is simply run again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import orjson

from ..schemas.records import CallStatus, LedgerEntry
from ..sinks.base import DuplicateSeq, StagingSink, StagingSource, StoreError
from ..sinks.registry import store_local_dir
from ..sinks.urls import parse_store_url

__all__ = [
    "RESERVE_BYTES",
    "Replayed",
    "journal_path",
    "read_journal",
    "release_reserve",
    "replay_journal",
    "reserve_journal",
    "spill_journal",
]

log = logging.getLogger("capture_proxy.ledger")

#: The prefix of a journal line written to stderr (what follows it is the JSON object).
STDERR_PREFIX = "capture-proxy ledger-journal "

#: Space kept for the journal: ~100,000 entries of ~300 bytes, the ledger's held limit.
RESERVE_BYTES = 32 << 20


def journal_path(store_url: str) -> str | None:
    """Where the ledger journal of the store at `store_url` lives; None without a local folder."""
    if store_local_dir(store_url) is None:  # in memory, or on a remote filesystem
        return None
    location = parse_store_url(store_url).location
    return os.path.abspath(location).rstrip("/") + ".ledger-journal.jsonl"


def _line(entry: LedgerEntry) -> bytes:
    return orjson.dumps({**asdict(entry), "status": entry.status.value})


def _reserve_path(path: str) -> str:
    return path.removesuffix(".jsonl") + ".reserve"


def reserve_journal(path: str | None, size: int = RESERVE_BYTES) -> str | None:
    """Allocate the journal's space beside the store (see the module docs). Returns why it
    could not (the caller logs it), else None. Blocking: start-up."""
    if path is None:
        return None
    reserve = _reserve_path(path)
    try:
        fd = os.open(reserve, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.posix_fallocate(fd, 0, size)
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(os.path.dirname(reserve))
    except OSError as e:
        return f"cannot reserve {size} bytes for the ledger journal at {reserve}: {e}"
    return None


def release_reserve(path: str | None) -> None:
    """Remove the journal's reserved space (a clean stop with nothing to spill). Blocking."""
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_reserve_path(path))


def _write_into_reserve(path: str, data: bytes) -> bool:
    """Write `data` as the journal at `path` in the reserved blocks; False if there is no
    reserve, or it is too small (then the journal is written the ordinary way)."""
    reserve = _reserve_path(path)
    if os.path.exists(path):
        return False  # a journal still waiting to be replayed: append to it instead
    try:
        fd = os.open(reserve, os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        if os.fstat(fd).st_size < len(data):
            return False
        written = 0
        while written < len(data):  # pwrite into allocated blocks: no new space needed
            written += os.pwrite(fd, data[written:], written)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(reserve, path)
    _fsync_dir(os.path.dirname(path))
    return True


def spill_journal(entries: Iterable[LedgerEntry], path: str | None) -> str:
    """Write `entries` to the journal at `path` (fsynced): into its reserved space where there
    is one, else appended; where it could not, write them to stderr. Returns where they went,
    for the log. Blocking."""
    items = list(entries)
    if path is not None:
        data = b"".join(_line(e) + b"\n" for e in items)
        try:
            if _write_into_reserve(path, data):
                return path
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            _fsync_dir(os.path.dirname(path))
            return path
        except OSError as e:
            log.error(
                "cannot write the ledger journal %s (%s): writing it to stderr instead", path, e
            )
    for entry in items:
        sys.stderr.write(STDERR_PREFIX + _line(entry).decode() + "\n")
    sys.stderr.flush()
    return f"stderr (lines starting {STDERR_PREFIX.strip()!r})"


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_journal(path: str) -> list[LedgerEntry]:
    """The entries of a journal file.

    A journal file holds one JSON object per line. A file with any line starting with the
    stderr prefix (``capture-proxy ledger-journal``) is a saved log: only those lines count, so
    the proxy's whole stderr can be given as it is. Raises `StoreError` naming a bad line."""
    with open(path, "rb") as f:
        lines = [(n, raw.strip()) for n, raw in enumerate(f, 1) if raw.strip()]
    prefix = STDERR_PREFIX.encode()
    if any(text.startswith(prefix) for _, text in lines):
        lines = [(n, text[len(prefix) :]) for n, text in lines if text.startswith(prefix)]
    entries: list[LedgerEntry] = []
    for number, text in lines:
        try:
            d = orjson.loads(text)
            entries.append(
                LedgerEntry(
                    d["rollout_id"],
                    d["call_id"],
                    int(d["seq"]),
                    CallStatus(d["status"]),
                    d["reason"],
                    d["message"],
                    d.get("http_status"),
                    int(d.get("at_ms", 0)),
                )
            )
        except (ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{path}:{number}: not a ledger journal line: {e}") from e
    return entries


@dataclass(frozen=True, slots=True)
class Replayed:
    """What a replay did: entries written, already in the store, refused for good."""

    written: int
    already: int
    refused: int


async def replay_journal(sink: StagingSink, source: StagingSource, path: str) -> Replayed:
    """Write the journal's entries into the store through `sink`, then remove the journal.

    Entries already in their rollout's ledger are skipped; one the store refuses for good
    (another call holds its seq) is logged in full and dropped, as `LedgerWriter` does. Raises
    `StoreError` (the journal kept) if the store fails.
    """
    entries = await asyncio.to_thread(read_journal, path)  # start-up or the CLI: small
    seen: dict[str, set[str]] = {}
    written = already = refused = 0
    for entry in entries:
        known = seen.get(entry.rollout_id)
        if known is None:
            try:
                known = {f.call_id for f in source.failures(entry.rollout_id)}
            except KeyError:
                known = set()
            seen[entry.rollout_id] = known
        if entry.call_id in known:
            already += 1
            continue
        try:
            await sink.record_failure(entry)
        except DuplicateSeq as e:
            refused += 1
            log.error(
                "journal entry refused by the store, not written: %s; the entry: %s", e, entry
            )
            continue
        except Exception as e:
            raise StoreError(
                f"replaying the ledger journal {path} failed after {written} entries, the "
                f"journal is kept: {type(e).__name__}: {e}"
            ) from e
        known.add(entry.call_id)
        written += 1
    os.unlink(path)
    with contextlib.suppress(OSError):
        _fsync_dir(os.path.dirname(path))
    return Replayed(written, already, refused)
