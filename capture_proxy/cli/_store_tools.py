"""The store tools that change a store: gc, compact, seal and replay-ledger."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..inspect.progress import progress_bar
from ..sinks.base import StoreError


def run_gc(args: argparse.Namespace) -> int:
    import time

    from ..sinks.registry import gc_store

    with progress_bar("removing" if not args.dry_run else "looking") as progress:
        stats = gc_store(
            args.store,
            older_than_ms=args.older_than,
            now_ms=int(time.time() * 1000),
            dry_run=args.dry_run,
            vacuum=args.vacuum,
            progress=progress,
            wait_s=args.wait / 1000,
        )
    if args.json:
        summary = {"store": args.store, "dry_run": args.dry_run, **dataclasses.asdict(stats)}
        print(json.dumps(summary))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    print(
        f"{verb} {len(stats.rollouts)} sealed rollout(s), {stats.calls} call(s); "
        f"{stats.blobs} blob(s) and {stats.attachments} attachment(s) no longer used"
    )
    for rollout_id in stats.rollouts:
        print(f"  {rollout_id}")
    return 0


def run_compact(args: argparse.Namespace) -> int:
    from ..sinks.registry import compact_store

    with progress_bar("compacting") as progress:
        c = compact_store(
            args.store,
            target_bytes=args.target_mb << 20,
            grace_s=args.grace / 1000,
            progress=progress,
            wait_s=args.wait / 1000,
        )
    if args.json:
        print(json.dumps({"store": args.store, **dataclasses.asdict(c)}))
        return 0
    print(
        f"{c.units_before} unit(s) -> {c.units_after}, {c.files_before} file(s) -> "
        f"{c.files_after}, {c.records} record(s) unchanged; "
        f"{c.deleted_files} retired file(s) deleted; the lease held {c.lease_held_s:.2f} s"
    )
    if c.merges_dropped:
        print(
            f"{c.merges_dropped} merge(s) not committed: another maintenance run merged some of "
            "their units first (their files are deleted; the next run merges what is left)"
        )
    return 0


async def run_replay_ledger(args: argparse.Namespace) -> int:
    from ..core.journal import journal_path, replay_journal
    from ..sinks.registry import open_sink, open_source

    journal = args.journal or journal_path(args.store)
    if journal is None:
        print(
            f"capture-proxy replay-ledger: {args.store} has no journal file: name one",
            file=sys.stderr,
        )
        return 2
    sink = open_sink(args.store)
    try:
        source = open_source(sink.url)
        try:
            done = await replay_journal(sink, source, journal)
        finally:
            source.close_reader()
    finally:
        await sink.close()
    print(
        f"replayed {journal}: {done.written} entries written, {done.already} already in the "
        f"store, {done.refused} refused (logged); the journal is removed"
    )
    return 0


async def run_seal(args: argparse.Namespace) -> int:
    import time

    from ..schemas.events import EventDraft, EventKind
    from ..schemas.records import RolloutInfo, RolloutState
    from ..sinks.registry import open_sink, open_source

    def read_infos() -> list[RolloutInfo]:
        source = open_source(args.store)  # a missing store is an error (a writer would make one)
        try:
            known = set(source.rollouts())
            missing = [r for r in args.rollouts if r not in known]
            if missing:
                raise StoreError(
                    f"no rollout {', '.join(map(repr, missing))} in {args.store}: nothing sealed"
                )
            return [source.rollout_info(r) for r in args.rollouts]
        finally:
            source.close_reader()

    read_infos()  # nothing is opened for writing when a store or a rollout is missing
    try:
        sink = open_sink(args.store)  # takes the writer lock: refused while a proxy writes
    except StoreError as e:
        raise StoreError(
            f"{e}. A running proxy seals through its control API "
            "(POST /admin/rollouts/ROLLOUT/seal); or stop it, then seal offline"
        ) from e
    try:
        infos = read_infos()  # again under the lock: nothing changes them now
        now = int(time.time() * 1000)
        for info in infos:
            if info.state is RolloutState.SEALED:
                print(f"{info.rollout_id}: already sealed")
                continue
            # The event first, as the control API seals: a header that says sealed always has
            # its seal event (verified reads hold one to the other).
            await sink.append_event(EventDraft(info.rollout_id, EventKind.SEAL, now))
            await sink.put_rollout(
                dataclasses.replace(info, state=RolloutState.SEALED, sealed_at_ms=now)
            )
            print(f"{info.rollout_id}: sealed")
    finally:
        await sink.close()
    return 0
