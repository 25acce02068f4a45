"""The command line of `capture-proxy`: every subcommand's arguments, and ``--help`` showing
each flag's default."""

from __future__ import annotations

import argparse
import copy
from typing import TypeAlias

from .. import __version__
from ..server.settings import add_arguments


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


#: What `add_subparsers` returns: each subcommand is added to it (generic for mypy only).
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


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

    from ..inspect.cli import add_inspect_parser

    add_inspect_parser(sub)
    _add_export(sub)
    _add_store_tools(sub)
    # Every subcommand, including those added by other modules (inspect), shows its defaults.
    for command in sub.choices.values():
        command.formatter_class = _DefaultsFormatter
    return p


def _add_export(sub: Subcommands) -> None:
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


def _add_store_tools(sub: Subcommands) -> None:
    """seal, replay-ledger, compact and gc: the tools that change a store."""
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
    _add_wait(compact)
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
    _add_wait(gc)
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


def _add_wait(command: argparse.ArgumentParser) -> None:
    """compact's and gc's ``--wait``: both take the store's maintenance lease."""
    command.add_argument(
        "--wait",
        type=_duration,
        default="0s",
        metavar="AGE",
        help="Parquet: when another compaction or gc holds the store's maintenance lease, wait "
        "up to this long for it, first in line, instead of exiting 1 (default: 0s)",
    )


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
