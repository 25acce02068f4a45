"""The `capture-proxy` command: serve, and the store tools built on the reader."""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence

from . import __version__
from .core.policy import PolicyError
from .errors import error_text
from .inspect.escape import escape_text
from .inspect.progress import progress_bar
from .logs import setup_logging
from .server.settings import SettingsError, add_arguments, load_settings, settings_markdown
from .sinks.base import StoreError, UnsupportedStoreOperation

log = logging.getLogger("capture_proxy")

__all__ = ["main"]


class _DefaultsFormatter(argparse.HelpFormatter):
    """``--help`` shows every flag's default: "(default: X)" after its help, unless the help
    says it already (serve's settings do, since their argparse default is None so that the
    environment can fill them). Switches and flags without a default show none.
    """

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and _shows_default(action):
            # argparse skips the help column of a flag without help: give it one for the default.
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not _shows_default(action):
            return text
        return f"{text} (default: %(default)s)"


def _shows_default(action: argparse.Action) -> bool:
    # A switch (nargs 0: --include-open, --no-verify) is off unless given: no default to show.
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
        return False
    return bool(action.option_strings) or action.nargs in ("?", "*")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="capture-proxy",
        description="OpenAI-compatible proxy in front of vLLM that stages the exact tokens of "
        "every call, or reports loudly that it could not.",
        formatter_class=_DefaultsFormatter,
    )
    p.add_argument("--version", action="version", version=f"capture-proxy {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="run the proxy",
        usage="%(prog)s [--config FILE] [OPTION ...]",
        description="Run the proxy. Every option can also be set with a CAPTURE_PROXY_* "
        "environment variable or a key of the --config file (flag > environment > file > "
        "default); capture-proxy settings lists them all.",
    )
    add_arguments(serve)
    settings = sub.add_parser("settings", help="list every setting (flag, environment, TOML key)")
    settings.add_argument("--markdown", action="store_true", help="as the docs/settings.md page")

    from .inspect.cli import add_inspect_parser

    add_inspect_parser(sub)

    export = sub.add_parser(
        "export",
        help="write a training table (Parquet or JSON lines) from a store",
        description="Write every staged call, every rollout's trajectory, or every segment "
        "(prompt_ids, response_ids, response_mask, response_logprobs: the shape RL trainers "
        "take) as one table, a GRPO group's rollouts next to each other. Open (not sealed) and "
        "poisoned (a call answered but not staged) rollouts are left out unless asked for; "
        "what was left out is said on stderr. Each rollout is verified first (every record's "
        "digest, its event log's chain and accounting, its header against the chain): one "
        "that does not verify is left out and said on stderr. The images rows refer to go to "
        "OUT's sibling <name>.attachments.parquet. Exit status: 0 written, 1 a rollout did not "
        "verify (the file holds the others) or the store could not be read whole, 2 a usage "
        "error or a store or rollout not found.",
    )
    export.add_argument(
        "store",
        help="store URL or path: sqlite:///x.db, parquet:///dir (three slashes: relative to the "
        "working folder; four: absolute), s3://bucket/prefix, http://HOST:PORT, ...",
    )
    export.add_argument(
        "out",
        help="output file: *.parquet (Parquet), *.jsonl or *.ndjson (JSON Lines), or - for JSON "
        "Lines on stdout; its folder must exist",
    )
    export.add_argument(
        "--format",
        choices=("parquet", "jsonl"),
        default=None,
        help="default: from OUT's suffix (another suffix is refused unless --format is given)",
    )
    export.add_argument(
        "--per",
        choices=("call", "trajectory", "segment"),
        default="call",
        help="one row per call, per rollout, or per segment (the trainers' shape)",
    )
    export.add_argument(
        "--rollout",
        action="append",
        dest="rollouts",
        metavar="ID",
        help="export only this rollout (repeatable)",
    )
    export.add_argument(
        "--group",
        action="append",
        dest="groups",
        metavar="GROUP",
        help="export only the rollouts of this group, as the driver reported it (repeatable)",
    )
    export.add_argument(
        "--since",
        type=_since,
        metavar="TIME",
        help="only rollouts whose seal time (the sealing proxy's clock) is at or after TIME: "
        "milliseconds since the epoch or an ISO 8601 time. To export incrementally use --cursor "
        "(a rollout sealed before TIME may become visible after the previous export)",
    )
    export.add_argument(
        "--cursor",
        metavar="FILE",
        help="export incrementally: leave out the rollouts FILE says earlier exports took, and "
        "add the sealed rollouts exported (FILE is created on the first export and rewritten "
        "once the export is complete); each sealed rollout is exported exactly once",
    )
    export.add_argument(
        "--expected-heads",
        metavar="FILE",
        help="export only the rollouts FILE anchors, each only if its stored event log ends at "
        "the chain head FILE gives it: FILE holds the seal and outcome answers a driver kept "
        "(JSON Lines, or one JSON array; the last answer of a rollout counts). A rollout "
        "rewritten since, even consistently, is left out with exit status 1",
    )
    export.add_argument(
        "--no-attachments",
        dest="attachments",
        action="store_false",
        help="do not write the images rows refer to (their sha256 stay in attachment_shas)",
    )
    export.add_argument(
        "--include-untooled",
        action="store_true",
        help="with --per trajectory: keep calls without tools (title calls) in the trajectory",
    )
    export.add_argument(
        "--include-open",
        action="store_true",
        help="also export rollouts not sealed yet (seal finished ones: capture-proxy seal)",
    )
    export.add_argument(
        "--include-poisoned",
        action="store_true",
        help="also export rollouts with a call answered but not staged (their trajectory "
        "misses what the policy generated there)",
    )
    export.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="do not verify rollouts (digests, event logs, headers): faster, for data "
        "verified already; exports rollouts that do not verify as they are",
    )
    export.add_argument(
        "--json",
        action="store_true",
        help="print the summary (rows, rollouts, left out by why) as one JSON object",
    )

    seal = sub.add_parser(
        "seal",
        help="seal rollouts in a store offline (no proxy running)",
        description="Mark rollouts sealed (finished) in the store, as the control API's seal "
        "does, for runs without a control API: export and iter_trajectories leave open "
        "rollouts out. Refused while a proxy writes the store (its writer lock is held): seal "
        "through the proxy's control API then, or stop it first.",
    )
    seal.add_argument("store", help="store URL or path")
    seal.add_argument("rollouts", nargs="+", metavar="ROLLOUT", help="rollout ids to seal")

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
    compact.add_argument(
        "--wait",
        type=_duration,
        default="0s",
        metavar="AGE",
        help="Parquet: when another compaction or gc holds the store's maintenance lease, wait "
        "up to this long for it, first in line, instead of exiting 1 (default: 0s)",
    )
    compact.add_argument(
        "--grace",
        type=_duration,
        default="10m",
        metavar="AGE",
        help="delete units retired more than this long ago; a reader that listed a unit reads "
        "it for this long after it is retired, e.g. 0s, 90s (default: 10m)",
    )
    compact.add_argument(
        "--json",
        action="store_true",
        help="print the summary (units, files and bytes before and after, records, deleted "
        "files) as one JSON object",
    )

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
        "--wait",
        type=_duration,
        default="0s",
        metavar="AGE",
        help="Parquet: when another compaction or gc holds the store's maintenance lease, wait "
        "up to this long for it, first in line, instead of exiting 1 (default: 0s)",
    )
    gc.add_argument(
        "--vacuum",
        action="store_true",
        help="SQLite: shrink the file afterwards (exclusive lock: stop the proxy)",
    )
    gc.add_argument(
        "--json",
        action="store_true",
        help="print the summary (rollouts, calls, blobs, attachments, bytes before and after) "
        "as one JSON object",
    )
    # Every subcommand, including those added by other modules (inspect), shows its defaults.
    for command in sub.choices.values():
        command.formatter_class = _DefaultsFormatter
    return p


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _since(text: str) -> int:
    """'1764583200000' or '2026-12-01T10:00:00Z' -> milliseconds since the epoch (a time
    without a zone is UTC)."""
    import datetime

    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected milliseconds since the epoch or an ISO 8601 time, got {text!r}"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return int(when.timestamp() * 1000)


def _duration(text: str) -> int:
    """'7d' -> milliseconds; argparse turns the ValueError into a usage error naming the flag."""
    text = text.strip()
    if len(text) < 2 or text[-1] not in _UNITS or not text[:-1].isdigit():
        raise argparse.ArgumentTypeError(f"expected a number and a unit (s, m, h, d), got {text!r}")
    return int(text[:-1]) * _UNITS[text[-1]] * 1000


def _run_gc(args: argparse.Namespace) -> int:
    import time

    from .sinks.registry import gc_store

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


def _report_export(args: argparse.Namespace, summary: dict[str, object]) -> None:
    left = summary["left_out"]
    assert isinstance(left, dict)
    # With the rows on stdout, the summary goes to stderr.
    report = sys.stderr if args.out == "-" else sys.stdout
    if args.json:
        print(json.dumps({"out": args.out, **summary}), file=report)
    else:
        print(
            f"wrote {summary['rows']} row(s) of {summary['rollouts']} rollout(s) to {args.out}",
            file=report,
        )
        if summary["attachments_out"]:
            print(
                f"wrote {summary['attachments']} attachment(s) to {summary['attachments_out']}",
                file=report,
            )
    parts = []
    if left["open"]:
        parts.append(
            f"{len(left['open'])} open (not sealed: --include-open exports them, "
            "or seal finished ones with capture-proxy seal)"
        )
    if left["poisoned"]:
        parts.append(
            f"{len(left['poisoned'])} poisoned (a call answered but not staged: "
            "--include-poisoned exports them)"
        )
    if left.get("missing"):
        parts.append(
            f"{len(left['missing'])} anchored but not in the store "
            f"({', '.join(map(escape_text, left['missing'][:5]))})"
        )
    if left.get("unanchored"):
        parts.append(f"{len(left['unanchored'])} not anchored by --expected-heads")
    if left.get("unverified"):
        parts.append(
            f"{len(left['unverified'])} that do not verify (--no-verify exports them as they are)"
        )
    if parts:
        n = sum(len(ids) for ids in left.values())
        print(f"capture-proxy export: left out {n} rollout(s): {'; '.join(parts)}", file=sys.stderr)
    why = summary.get("unverified")
    assert isinstance(why, dict)
    for rollout_id, problems in why.items():
        for problem in problems:
            print(
                f"capture-proxy export: {escape_text(rollout_id)} does not verify: "
                f"{escape_text(problem)}",
                file=sys.stderr,
            )


#: The output names `export` writes without --format, and what it writes to them.
_EXPORT_SUFFIXES = {".parquet": "Parquet", ".jsonl": "JSON Lines", ".ndjson": "JSON Lines"}


def _export_refusal(args: argparse.Namespace) -> str | None:
    """Why `export` refuses its output arguments before reading anything, or None."""
    if args.out != "-" and args.format is None:
        suffix = os.path.splitext(args.out)[1]
        if suffix not in _EXPORT_SUFFIXES:
            named = f"a {suffix} file" if suffix else "a name without a suffix"
            return (
                f"{args.out}: export writes Parquet (*.parquet) or JSON Lines (*.jsonl, "
                f"*.ndjson, or - for stdout), not {named}; rename it, or give --format "
                "parquet|jsonl to write that name anyway"
            )
    for what, path in (("output", args.out), ("--cursor", args.cursor)):
        if path is None or path == "-":
            continue
        folder = os.path.dirname(path) or "."
        if not os.path.isdir(folder):
            state = "is not a folder" if os.path.exists(folder) else "does not exist"
            return f"{what}: the folder {folder} {state} (for {path}); create it first"
    return None


def _export_failure(args: argparse.Namespace, e: Exception) -> tuple[int, str]:
    """A failed export's exit status and sentence: 2 when the store or a named rollout is not
    there, 1 when what the store holds did not verify or could not be read."""
    if isinstance(e, KeyError):
        key = error_text(e)
        if key in (args.rollouts or ()):  # a Parquet store's KeyError is the bare id
            return 2, f"no rollout {key!r} in {args.store}"
        if key.startswith("no rollout "):
            return 2, key
        return 1, f"{key}: the store misses it (capture-proxy inspect STORE --verify)"
    if isinstance(e, StoreError):
        from .inspect.cli import absolute_store_hint

        hint = absolute_store_hint(args.store)
        return 2, f"{e}" + (f"; {hint}" if hint else "")
    written = (
        "nothing written" if args.out != "-" else "the rows on stdout are not the whole export"
    )
    return 1, f"{error_text(e)}; {written}"


def _export(args: argparse.Namespace) -> int:
    from .read.cursor import CursorInvalid, ExportCursor
    from .read.export import export_format, export_store
    from .read.reader import StoreCorrupted
    from .schemas.digest import DigestMismatch

    refusal = _export_refusal(args)
    if refusal is not None:
        print(f"capture-proxy export: {refusal}", file=sys.stderr)
        return 2
    try:
        fmt = export_format(args.out, args.format)
    except ValueError as e:  # Parquet to stdout: a usage error
        print(f"capture-proxy export: {e}", file=sys.stderr)
        return 2
    try:
        cursor = None if args.cursor is None else ExportCursor.load(args.cursor)
    except CursorInvalid as e:
        print(f"capture-proxy export: --cursor: {e}", file=sys.stderr)
        return 2
    heads = None
    if args.expected_heads is not None:
        from .read.anchors import AnchorsInvalid, load_heads

        try:
            heads = load_heads(args.expected_heads)
        except AnchorsInvalid as e:
            print(f"capture-proxy export: --expected-heads: {e}", file=sys.stderr)
            return 2
    try:
        with progress_bar("exporting") as progress:  # on a terminal's stderr only
            summary = export_store(
                args.store,
                args.out,
                format=fmt,
                per=args.per,
                verify=args.verify,
                include_untooled=args.include_untooled,
                include_open=args.include_open,
                include_poisoned=args.include_poisoned,
                rollouts=args.rollouts,
                group=args.groups,
                since=args.since,
                cursor=cursor,
                expected_heads=heads,
                attachments=args.attachments and args.out != "-",
                progress=progress,
            )
    except (StoreError, KeyError, DigestMismatch, StoreCorrupted) as e:
        code, sentence = _export_failure(args, e)
        print(f"capture-proxy export: {sentence}", file=sys.stderr)
        return code
    if cursor is not None:
        cursor.save(args.cursor)  # only now: a failed export leaves the cursor as it was
    _report_export(args, summary.to_dict())
    refused = summary.left_out["unverified"] or summary.left_out.get("missing")
    return 1 if refused else 0


async def _seal(args: argparse.Namespace) -> int:
    import time

    from .schemas.events import EventDraft, EventKind
    from .schemas.records import RolloutInfo, RolloutState
    from .sinks.registry import open_sink, open_source

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


def _serve(settings_args: argparse.Namespace) -> int:
    from .server.event_loop import run
    from .server.run import serve

    settings = load_settings(settings_args)
    setup_logging(settings.log_level, settings.log_format)
    # Fields, not a formatted dict: in JSON mode a log pipeline reads settings.port directly.
    log.info("starting", extra={"settings": settings.public()})
    _say_where_the_store_is(settings.store)
    return run(serve(settings), settings.loop)


def _say_where_the_store_is(url: str) -> None:
    """At start, a store named ``kind:///path`` (three slashes) is said to be relative to the
    working folder, with its absolute path; a warning when that path does not exist while the
    absolute one spelt the same way does (``parquet:///data/x`` meant for ``/data/x``)."""
    from .inspect.cli import absolute_store_hint, relative_store_path

    path = relative_store_path(url)
    if path is None:
        return
    scheme = url.strip().split(":", 1)[0]
    print(
        f"capture-proxy store {url} is {os.path.abspath(path)}: three slashes take a path "
        f"relative to the working folder, four an absolute one ({scheme}:////{path})",
        file=sys.stderr,
        flush=True,
    )
    hint = absolute_store_hint(url)
    if hint is not None:
        log.warning(f"store {hint}; the store is made where the URL says")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "settings":
            sys.stdout.write(settings_markdown())
            return 0
        if args.command == "inspect":
            from .inspect.cli import run_inspect

            return run_inspect(args)
        if args.command == "export":
            return _export(args)
        if args.command == "seal":
            return asyncio.run(_seal(args))
        if args.command == "compact":
            from .sinks.registry import compact_store

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
        print(f"capture-proxy {args.command}: {error_text(e)}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"capture-proxy: {e}", file=sys.stderr)
        return 1
    return 2
