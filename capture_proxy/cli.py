"""The `capture-proxy` command: serve, and the store tools built on the reader."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from .core.policy import PolicyError
from .logs import setup_logging
from .server.settings import SettingsError, add_arguments, load_settings, settings_markdown
from .sinks.base import StoreError, UnsupportedStoreOperation

log = logging.getLogger("capture_proxy")

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="capture-proxy",
        description="OpenAI-compatible proxy in front of vLLM that stages the exact tokens of "
        "every call, or reports loudly that it could not.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="run the proxy",
        description="Run the proxy. Every option can also be set with a CAPTURE_PROXY_* "
        "environment variable (flag > environment > default).",
    )
    add_arguments(serve)
    settings = sub.add_parser("settings", help="list every setting (flag, environment, TOML key)")
    settings.add_argument("--markdown", action="store_true", help="as the docs/settings.md page")

    from .inspect.cli import add_inspect_parser

    add_inspect_parser(sub)

    export = sub.add_parser(
        "export",
        help="write a flat training table (Parquet or JSON lines) from a store",
        description="Write every staged call, or every rollout's trajectory, as one table. "
        "Every record is verified first; nothing is written if one does not verify.",
    )
    export.add_argument("store", help="store URL or path (sqlite:///x.db, parquet:///dir, ...)")
    export.add_argument("out", help="output file")
    export.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    export.add_argument("--per", choices=("call", "trajectory"), default="call")
    export.add_argument(
        "--include-untooled",
        action="store_true",
        help="with --per trajectory: keep calls without tools (title calls) in the trajectory",
    )

    replay = sub.add_parser(
        "replay-ledger",
        help="write a ledger journal (entries a stopped proxy could not store) into a store",
        description="A proxy that stops with ledger entries its store would not take writes "
        "them to <store>.ledger-journal.jsonl, or to stderr as 'capture-proxy ledger-journal' "
        "lines; the next serve on the store replays the journal by itself. This command replays "
        "one explicitly (a file of saved stderr lines too), then removes it. Entries already in "
        "the store are skipped. Stop the proxy first: a store has one writer.",
    )
    replay.add_argument("store", help="store URL or path")
    replay.add_argument("journal", nargs="?", help="default: the store's own journal file")

    compact = sub.add_parser(
        "compact", help="merge a Parquet store's small files (records and digests unchanged)"
    )
    compact.add_argument("store", help="a Parquet store URL or folder")
    compact.add_argument("--target-mb", type=int, default=256, help="size of merged files")

    gc = sub.add_parser(
        "gc",
        help="remove whole sealed rollouts older than a cutoff",
        description="Retention: removes sealed rollouts (all their calls, attachments no other "
        "call uses, and their ledger) sealed more than --older-than ago. Open rollouts are "
        "never touched.",
    )
    gc.add_argument("store", help="store URL or path")
    gc.add_argument(
        "--older-than", required=True, type=_duration, metavar="AGE", help="e.g. 7d, 12h, 30m, 90s"
    )
    gc.add_argument("--dry-run", action="store_true", help="list what would go; change nothing")
    gc.add_argument(
        "--vacuum",
        action="store_true",
        help="SQLite: shrink the file afterwards (exclusive lock: stop the proxy)",
    )
    return p


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> int:
    """'7d' -> milliseconds; argparse turns the ValueError into a usage error naming the flag."""
    text = text.strip()
    if len(text) < 2 or text[-1] not in _UNITS or not text[:-1].isdigit():
        raise argparse.ArgumentTypeError(f"expected a number and a unit (s, m, h, d), got {text!r}")
    return int(text[:-1]) * _UNITS[text[-1]] * 1000


def _run_gc(args: argparse.Namespace) -> int:
    import time

    from .sinks.registry import gc_store

    stats = gc_store(
        args.store,
        older_than_ms=args.older_than,
        now_ms=int(time.time() * 1000),
        dry_run=args.dry_run,
        vacuum=args.vacuum,
    )
    verb = "would remove" if args.dry_run else "removed"
    print(
        f"{verb} {len(stats.rollouts)} sealed rollout(s), {stats.calls} call(s); "
        f"{stats.blobs} blob(s) and {stats.attachments} attachment(s) no longer used"
    )
    for rollout_id in stats.rollouts:
        print(f"  {rollout_id}")
    return 0


async def _replay_ledger(args: argparse.Namespace) -> int:
    from .core.journal import journal_path, replay_journal
    from .sinks.registry import open_sink, open_source

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


async def _serve(settings_args: argparse.Namespace) -> int:
    from .server.run import serve

    settings = load_settings(settings_args)
    setup_logging(settings.log_level, settings.log_format)
    log.info("starting with settings %s", settings.public())
    return await serve(settings)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return asyncio.run(_serve(args))
        if args.command == "settings":
            sys.stdout.write(settings_markdown())
            return 0
        if args.command == "inspect":
            from .inspect.cli import run_inspect

            return run_inspect(args)
        if args.command == "export":
            from .read.export import export_store

            rows = export_store(
                args.store,
                args.out,
                format=args.format,
                per=args.per,
                include_untooled=args.include_untooled,
            )
            print(f"wrote {rows} row(s) to {args.out}")
            return 0
        if args.command == "compact":
            from .sinks.registry import compact_store

            c = compact_store(args.store, target_bytes=args.target_mb << 20)
            print(
                f"{c.units_before} unit(s) -> {c.units_after}, {c.files_before} file(s) -> "
                f"{c.files_after}, {c.records} record(s) unchanged; "
                f"{c.deleted_files} retired file(s) deleted"
            )
            return 0
        if args.command == "gc":
            return _run_gc(args)
        if args.command == "replay-ledger":
            return asyncio.run(_replay_ledger(args))
    except (SettingsError, PolicyError) as e:
        print(f"capture-proxy: {e}", file=sys.stderr)
        return 2
    except UnsupportedStoreOperation as e:  # gc of memory://, compact of SQLite: a usage error
        print(f"capture-proxy {args.command}: {e}", file=sys.stderr)
        return 2
    except (StoreError, KeyError, ValueError) as e:
        print(f"capture-proxy {args.command}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"capture-proxy: {e}", file=sys.stderr)
        return 1
    return 2
