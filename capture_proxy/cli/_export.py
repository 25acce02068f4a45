"""`capture-proxy export`: a training table from a store, and what was left out, and why."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import error_text
from ..inspect.escape import escape_text
from ..inspect.progress import progress_bar
from ..sinks.base import StoreError


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
        from ..inspect.cli import absolute_store_hint

        hint = absolute_store_hint(args.store)
        return 2, f"{e}" + (f"; {hint}" if hint else "")
    written = (
        "nothing written" if args.out != "-" else "the rows on stdout are not the whole export"
    )
    return 1, f"{error_text(e)}; {written}"


def run_export(args: argparse.Namespace) -> int:
    from ..read.cursor import CursorInvalid, ExportCursor
    from ..read.export import export_format, export_store
    from ..read.reader import StoreCorrupted
    from ..schemas.digest import DigestMismatch

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
        from ..read.anchors import AnchorsInvalid, load_heads

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
