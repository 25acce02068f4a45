"""A process that stages into a store (SQLite or Parquet, by URL) until it is killed
(tests/reliability/test_crash.py), or until its SQLite file fills up
(tests/sinks/test_sink_sqlite.py). Run from the repository root:

    python -m tests.support.crash_worker STORE loop --round R [--sessions K] [--max-records N]
                                                    [--max-seconds T]
    python -m tests.support.crash_worker STORE diskfull

``loop`` runs K agent sessions concurrently, each staging turn after turn (continuing the
sessions a previous round left in the store, so parents are rebuilt from the file after a crash;
some turns add a new image). After each `stage` returns ``staged`` it prints the staging key on
its own line and flushes: every printed key was acknowledged. It prints ``ready`` once the sink
is open and ``done`` if it reaches its bounds before being killed.

``diskfull`` stages one record, then caps the size of any file it writes (RLIMIT_FSIZE: a real
"disk full" for this process), stages a batch of records whose commit cannot fit, lifts the cap,
stages the same records again, and prints one JSON line describing what happened.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

from capture_proxy.schemas.records import CallStatus
from capture_proxy.sinks.registry import open_sink, open_source
from capture_proxy.sinks.sqlite import SQLiteSink
from capture_proxy.sinks.urls import parse_store_url
from tests.support.sink_factories import Session, image

#: A session ends after this many calls and a new one starts: keeps records (and the test's
#: verification of all of them) small while still crossing kills mid-session.
SESSION_TURNS = 12


def _store_exists(url: str) -> bool:
    return Path(parse_store_url(url).location).exists()


def _sessions(url: str, round_no: int, count: int) -> list[Session]:
    """Continue the unfinished sessions earlier rounds left in the store; start new ones."""
    out: list[Session] = []
    if _store_exists(url):
        source = open_source(url)
        for rollout_id in source.rollouts():
            calls = source.calls(rollout_id)
            # A seq claimed by a call the kill cut off is taken for good (it reads
            # `lost_in_crash`): a session continues only if its last record holds its last claim.
            claimed = max(source.claims(rollout_id), default=-1)
            if (
                calls
                and calls[-1].seq >= claimed
                and calls[-1].seq + 1 < SESSION_TURNS
                and len(out) < count
            ):
                out.append(
                    Session.resume(calls[-1], seed=round_no, prefix=f"r{round_no}-{rollout_id}")
                )
        source.close_reader()
    while len(out) < count:
        out.append(_new_session(round_no, len(out)))
    return out


def _new_session(round_no: int, n: int) -> Session:
    rollout_id = f"r{round_no}-s{n}"
    img = image(rollout_id) if n % 2 == 0 else None
    return Session(rollout_id, seed=round_no, image=img)


async def loop(args: argparse.Namespace) -> None:
    sessions = _sessions(args.store, args.round, args.sessions)
    sink = open_sink(args.store)
    print("ready", flush=True)
    deadline = time.monotonic() + args.max_seconds
    budget = [args.max_records]
    started = [len(sessions)]

    async def run(s: Session) -> None:
        while budget[0] > 0 and time.monotonic() < deadline:
            budget[0] -= 1
            if s.seq >= SESSION_TURNS:
                s = _new_session(args.round, started[0])
                started[0] += 1
            new = image(f"{s.prefix}-t{s.seq}") if s.seq % 4 == 3 else None
            record, atts = s.next(new_prompt=200, completion=50, new_image=new)
            result = await sink.stage(record, attachments=atts)
            if result.status is not CallStatus.STAGED:
                raise SystemExit(f"not staged: {result}")
            sys.stdout.write(record.staging_key + "\n")
            sys.stdout.flush()

    await asyncio.gather(*(run(s) for s in sessions))
    await sink.close()
    print("done", flush=True)


async def diskfull(args: argparse.Namespace) -> None:
    store = Path(parse_store_url(args.store).location)
    sink = SQLiteSink(str(store))
    first, atts = Session("ok", image=image("ok")).next()
    assert (await sink.stage(first, attachments=atts)).status is CallStatus.STAGED
    # Without this, exceeding the limit kills the process with SIGXFSZ; ignored, the write
    # fails with EFBIG, which SQLite reports like a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    sizes = [p.stat().st_size for p in store.parent.iterdir() if p.name.startswith(store.name)]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max(sizes) + 8192, hard))
    batch = [
        Session(f"full{i}", image=image(f"full{i}")).next(new_prompt=4000, completion=100)
        for i in range(8)
    ]
    outcomes = await asyncio.gather(
        *(sink.stage(r, attachments=a) for r, a in batch), return_exceptions=True
    )
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    retried = await asyncio.gather(*(sink.stage(r, attachments=a) for r, a in batch))
    await sink.close()
    report = {
        "first": first.call_id,
        "keys": [r.call_id for r, _ in batch],
        "errors": [
            f"{type(o).__name__}: {o}" if isinstance(o, BaseException) else None for o in outcomes
        ],
        "staged": [o.status.value for o in outcomes if not isinstance(o, BaseException)],
        "retried": [o.status.value for o in retried],
    }
    print(json.dumps(report), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("store", help="store URL: sqlite:///x.db or parquet:///dir")
    parser.add_argument("mode", choices=["loop", "diskfull"])
    parser.add_argument("--round", type=int, default=0)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--max-records", type=int, default=5000)
    parser.add_argument("--max-seconds", type=float, default=10.0)
    args = parser.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    asyncio.run(loop(args) if args.mode == "loop" else diskfull(args))


if __name__ == "__main__":
    main()
