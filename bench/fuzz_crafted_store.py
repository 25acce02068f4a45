"""Crafted stores fail cleanly: a fixed-seed fuzz of store files someone else wrote.

    .venv/bin/python bench/fuzz_crafted_store.py [--cases 1000] [--seed 29] [--max-s 600]
                                                 [--kind sqlite|parquet]

A small store is written as the proxy writes it (two sealed rollouts with outcomes, a call with
an image, a capture failure), then each case copies it and edits one to three cells or rows
behind the store's back: a value of the wrong type in any column (a text ``seq``, a float, a
blob, NULL), a number out of range, bytes that are not JSON, a zlib bomb where a compressed blob
is (2 MB that decompress to 2 GiB), an unknown codec, ANSI and OSC escapes in ids and text, a
deleted or duplicated row. With ``--kind parquet`` the store is a Parquet dataset and the edits
keep each file's column types (what a Parquet file enforces) and change values, rows and bytes;
one case in ten also gets a page decompression bomb in a random column of a random file
(`tests.support.parquet_bomb`: a page of a few MB that holds 2 GiB, or pages each under
`MAX_PAGE_BYTES` that together pass `MAX_READ_BYTES`).
Every trainer-facing read then runs on the edited store:
`Store.verify`, `iter_trajectories`, `export_store`, and ``inspect`` (overview, ``--rollout``,
``--verify``) through its CLI entry point.

A case passes when every read ends *cleanly*: a result, or an error of the project's own
(`CaptureProxyError`: `StoreCorrupted`, `StoreError`, `RolloutExcluded`, ...), or a CLI exit
status with a one-line message; and no terminal output carries a raw control character. Anything
else (a traceback from deep inside, a MemoryError) is counted and its first lines printed. The
run reports cases, failures, wall time and the process's peak RSS; it exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import logging
import random
import re
import resource
import shutil
import sqlite3
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from capture_proxy.errors import CaptureProxyError
from capture_proxy.inspect.cli import main as inspect_main
from capture_proxy.read.export import export_store
from capture_proxy.read.reader import open_store
from capture_proxy.schemas.events import EventDraft, EventKind, claim_event
from capture_proxy.schemas.outcome import RolloutOutcome
from capture_proxy.schemas.records import (
    Attachment,
    CallStatus,
    LedgerEntry,
    RolloutInfo,
    RolloutState,
)
from capture_proxy.sinks.base import StagingSink
from capture_proxy.sinks.parquet import ParquetSink
from capture_proxy.sinks.parquet._bounds import MAX_PAGE_BYTES, MAX_READ_BYTES
from capture_proxy.sinks.sqlite import SQLiteSink

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.parquet_bomb import bomb_file
from tests.support.sink_factories import Session

#: The share of Parquet cases that also get a page decompression bomb (`parquet_bomb`).
_PAGE_BOMBS = 0.1
#: Raw control characters a terminal would act on (tab and newline are layout).
_RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
#: A zlib stream of 2 MB that decompresses to 2 GiB of zeros, built once.
_BOMB: bytes = b""


def _bomb() -> bytes:
    global _BOMB
    if not _BOMB:
        z = zlib.compressobj(9)
        chunk = bytes(1 << 24)
        _BOMB = b"".join(z.compress(chunk) for _ in range(128)) + z.flush()
    return _BOMB


async def _write(path: Path, kind: str = "sqlite") -> None:
    sink: StagingSink = SQLiteSink(str(path)) if kind == "sqlite" else ParquetSink(str(path))
    png = Attachment.from_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64), "image/png")
    for n, rollout_id in enumerate(("r-a", "r-b")):
        session = Session(rollout_id, image=png if n == 0 else None)
        for _ in range(3):
            record, atts = session.next(new_prompt=300)
            await sink.append_event(claim_event(rollout_id, record.seq, record.call_id, 1))
            await sink.stage(record, attachments=atts)
        if n == 1:
            await sink.append_event(claim_event(rollout_id, 3, "lost", 2))
            await sink.record_failure(
                LedgerEntry(rollout_id, "lost", 3, CallStatus.CAPTURE_FAILED, "stage_timeout", "x")
            )
        outcome = RolloutOutcome(0.5, "g", at_ms=5)
        info = RolloutInfo(
            rollout_id, RolloutState.SEALED, n == 1, 1, 6, outcome_history=(outcome,)
        )
        await sink.put_rollout(info)
        body = {"reward": 0.5, "group_id": "g", "revision": 1}
        await sink.append_event(EventDraft(rollout_id, EventKind.OUTCOME, 5, body=body))
        await sink.append_event(EventDraft(rollout_id, EventKind.SEAL, 6))
    await sink.close()


def _values(rng: random.Random, column: str) -> Any:
    return rng.choice(
        [
            "abc",
            "",
            -1,
            2**62,
            1.5,
            None,
            b"\x00\xff garbage",
            '{"not": "closed"',
            "[1, 2",
            "\x1b[31mred\x1b[0m\x1b]0;title\x07",
            "\x1b]8;;http://evil/\x07link\x1b]8;;\x07",
            f"{column}\u202e",
            _bomb(),
            7,
        ]
    )


def _mutate(path: Path, rng: random.Random) -> list[str]:
    done: list[str] = []
    db = sqlite3.connect(path, isolation_level=None)
    try:
        tables = [
            r[0]
            for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
            if r[0] != "meta" or rng.random() < 0.1
        ]
        for _ in range(rng.randint(1, 3)):
            table = rng.choice(tables)
            columns = [r[1] for r in db.execute(f"PRAGMA table_info({table})")]
            rowids = [r[0] for r in db.execute(f"SELECT rowid FROM {table}")]
            if not rowids:
                continue
            rowid = rng.choice(rowids)
            what = rng.random()
            if what < 0.1:
                db.execute(f"DELETE FROM {table} WHERE rowid = ?", (rowid,))
                done.append(f"delete {table}#{rowid}")
            elif what < 0.15:
                # Triggers refuse some duplicates; a crafted file need not have them.
                for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='trigger'"):
                    db.execute(f"DROP TRIGGER {name}")
                with contextlib.suppress(sqlite3.IntegrityError):
                    db.execute(
                        f"INSERT INTO {table} SELECT * FROM {table} WHERE rowid = ?", (rowid,)
                    )
                    done.append(f"duplicate {table}#{rowid}")
            else:
                column = rng.choice(columns)
                value = _values(rng, column)
                if table == "blobs" and rng.random() < 0.5:
                    column, value = "data", _bomb()
                    db.execute("UPDATE blobs SET codec = 1 WHERE rowid = ?", (rowid,))
                with contextlib.suppress(sqlite3.IntegrityError):
                    db.execute(f"UPDATE {table} SET {column} = ? WHERE rowid = ?", (value, rowid))
                    shown = "<zlib bomb>" if value is _BOMB else repr(value)[:40]
                    done.append(f"{table}#{rowid}.{column} = {shown}")
    finally:
        db.close()
    return done


def _typed_value(rng: random.Random, field: pa.Field, column: str) -> Any:
    """A value Parquet's schema takes in `field` (a crafted file keeps the column types; what
    it changes is the values)."""
    t = field.type
    if pa.types.is_integer(t):
        return rng.choice([-1, 0, 2**62, -(2**63), 7, 10**12])
    if pa.types.is_boolean(t):
        return rng.random() < 0.5
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return rng.choice([b"", b"\x00\xff garbage", b"[1, 2]", b'{"a": ', b"\x01\x02\x03", b"{}"])
    if pa.types.is_list(t):
        return rng.choice([[], None, ["x" * 64], ["\x1b[31m"]])
    return _values(rng, column) if rng.random() < 0.5 else rng.choice(["", "\x1b]0;t\x07", "x"])


def _mutate_parquet(path: Path, rng: random.Random) -> list[str]:
    done: list[str] = []
    files = sorted(p for p in path.rglob("*.parquet"))
    for _ in range(rng.randint(1, 3)):
        f = rng.choice(files)
        table = pq.read_table(f)
        rows = table.to_pylist()
        if not rows:
            continue
        i = rng.randrange(len(rows))
        what = rng.random()
        if what < 0.1:
            del rows[i]
            done.append(f"delete {f.parent.name}/{f.name}#{i}")
        elif what < 0.15:
            rows.append(dict(rows[i]))
            done.append(f"duplicate {f.parent.name}#{i}")
        else:
            field = rng.choice(list(table.schema))
            value = _typed_value(rng, field, field.name)
            rows[i][field.name] = value
            done.append(f"{f.parent.name}#{i}.{field.name} = {repr(value)[:40]}")
        try:
            edited = pa.Table.from_pylist(rows, schema=table.schema)
        except (pa.ArrowException, ValueError, TypeError, OverflowError):
            done.pop()
            continue
        pq.write_table(edited, f)
    if rng.random() < _PAGE_BOMBS:  # last: a later rewrite of the file would drop it
        f = rng.choice(files)
        column = rng.choice(pq.read_schema(f).names)
        if rng.random() < 0.5:  # one page that holds 2 GiB
            bomb_file(f, column=column)
            done.append(f"{f.parent.name}.{column}: a page of 2 GiB")
        else:  # pages each under the page limit, together past the read limit
            pages = MAX_READ_BYTES // MAX_PAGE_BYTES + 1
            bomb_file(f, column=column, pages=pages, page_bytes=MAX_PAGE_BYTES)
            done.append(f"{f.parent.name}.{column}: {pages} pages of {MAX_PAGE_BYTES} bytes")
    return done


def _clean(exc: BaseException) -> bool:
    return isinstance(exc, CaptureProxyError)


def _reads(path: Path, out_dir: Path, kind: str = "sqlite") -> list[str]:
    """Every trainer-facing read; the unclean endings, described."""
    bad: list[str] = []
    url = f"sqlite:///{path}" if kind == "sqlite" else f"parquet:///{path}"

    def api(name: str, fn: Any) -> None:
        try:
            fn()
        except Exception as e:
            if not _clean(e):
                tb = traceback.format_exception(e)
                bad.append(f"{name}: {type(e).__name__}: {e}"[:300] + "\n" + "".join(tb[-3:]))

    def verify() -> None:
        with open_store(url) as store, contextlib.suppress(CaptureProxyError):
            store.verify()

    def iterate() -> None:
        with open_store(url) as store:
            for _ in store.iter_trajectories(include_poisoned=True, skipped={}):
                pass

    def export() -> None:
        export_store(url, str(out_dir / "x.parquet"), include_poisoned=True)

    api("verify", verify)
    api("iter_trajectories", iterate)
    api("export_store", export)
    for argv in ([url], [url, "--verify"], [url, "--rollout", "r-a"], [url, "--rollout", "r-b"]):
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                code = inspect_main(argv, stdout=out)
        except Exception as e:
            tb = traceback.format_exception(e)
            bad.append(
                f"inspect {argv[1:]}: {type(e).__name__}: {e}"[:300] + "\n" + "".join(tb[-3:])
            )
            continue
        if code not in (0, 1, 2):
            bad.append(f"inspect {argv[1:]}: exit {code}")
        for stream, text in (("stdout", out.getvalue()), ("stderr", err.getvalue())):
            hit = _RAW_CONTROL.search(text)
            if hit:
                bad.append(f"inspect {argv[1:]}: raw control {hit.group()!r} on {stream}")
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--max-s", type=float, default=600.0, help="stop after this long")
    parser.add_argument("--kind", choices=("sqlite", "parquet"), default="sqlite")
    args = parser.parse_args()
    # Rollouts left out as unverified are logged as warnings: thousands of them here.
    logging.disable(logging.WARNING)
    rng = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="fuzz-crafted-"))
    failures = bombs = 0
    start = time.monotonic()
    try:
        pristine = base / ("pristine.db" if args.kind == "sqlite" else "pristine")
        asyncio.run(_write(pristine, args.kind))
        n = 0
        for n in range(1, args.cases + 1):
            if args.kind == "sqlite":
                case = base / "case.db"
                shutil.copyfile(pristine, case)
                edits = _mutate(case, rng)
            else:
                case = base / "case"
                shutil.copytree(pristine, case)
                edits = _mutate_parquet(case, rng)
                bombs += any("page" in e for e in edits)
            bad = _reads(case, base, args.kind)
            if bad:
                failures += 1
                if failures <= 10:
                    print(f"case {n}: {'; '.join(edits)}")
                    for b in bad:
                        print("   ", b.replace("\n", "\n    "))
            if case.is_dir():
                shutil.rmtree(case)
            else:
                case.unlink()
            if time.monotonic() - start > args.max_s:
                break
        wall = time.monotonic() - start
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"{args.kind}: {n} cases (seed {args.seed}), {failures} with an unclean ending, "
            + (f"{bombs} with a page bomb, " if args.kind == "parquet" else "")
            + f"{wall:.0f} s, "
            f"peak RSS {rss_mb:.0f} MB"
        )
        return 1 if failures else 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
