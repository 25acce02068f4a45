"""The ledger journal: ledger entries the store would not take, kept outside it until it does.

While the sink fails, `LedgerWriter` holds the entries it refused in memory. If the proxy stops
with some still held (the store's filesystem went read-only, the file was deleted), they are
spilled, at shutdown, to a journal beside the store: ``<store>.ledger-journal.jsonl`` (one JSON
object per line, appended, fsynced with its folder). Where there is no local folder (an object
store, ``memory://``) or the journal cannot be written either, each entry goes to stderr as one
line ``capture-proxy ledger-journal {...}``, which an operator can save into a journal file. The
proxy then exits with status 1 and says so in its last log line.

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

__all__ = ["Replayed", "journal_path", "read_journal", "replay_journal", "spill_journal"]

log = logging.getLogger("capture_proxy.ledger")

#: The prefix of a journal line written to stderr (what follows it is the JSON object).
STDERR_PREFIX = "capture-proxy ledger-journal "


def journal_path(store_url: str) -> str | None:
    """Where the ledger journal of the store at `store_url` lives; None without a local folder."""
    if store_local_dir(store_url) is None:  # in memory, or on a remote filesystem
        return None
    location = parse_store_url(store_url).location
    return os.path.abspath(location).rstrip("/") + ".ledger-journal.jsonl"


def _line(entry: LedgerEntry) -> bytes:
    return orjson.dumps({**asdict(entry), "status": entry.status.value})


def spill_journal(entries: Iterable[LedgerEntry], path: str | None) -> str:
    """Append `entries` to the journal at `path` (fsynced); where it could not, write them to
    stderr. Returns where they went, for the log. Blocking."""
    items = list(entries)
    if path is not None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, b"".join(_line(e) + b"\n" for e in items))
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
