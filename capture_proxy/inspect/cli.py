"""`capture-proxy inspect STORE`: what a store holds, for a person debugging a rollout.

    capture-proxy inspect sqlite:///capture.db               # rollouts, newest first
    capture-proxy inspect capture.db --rollout r17           # its calls, staged and failed
    capture-proxy inspect capture.db --call 01J9... --tokens # one call in full, with token ids
    capture-proxy inspect capture.db --verify                # every digest; exit 1 on a problem
    capture-proxy inspect capture.db --rollout r17 --follow  # keep printing new calls
    capture-proxy inspect http://proxy-host:8101             # a running proxy's store

``--json`` prints the same views as JSON (keys in docs/inspect.md). On a terminal the output is
rich tables sized to it; anywhere else, plain aligned text. Errors are one sentence on stderr
and exit status 2; ``--verify`` exits 1 when it finds a problem, ``--call`` when its record does
not verify.

Output goes to an `Out` (see `capture_proxy.inspect.render`): `RichOut` on a terminal,
`PlainOut` anywhere else. The views themselves are built by `capture_proxy.inspect.views`.

The lead's `capture_proxy.cli` wires this in with `add_inspect_parser` and `run_inspect`; `main`
runs it standalone (``python -c "from capture_proxy.inspect.cli import main; main()"``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from types import FrameType
from typing import IO, TYPE_CHECKING, Any

import orjson

from ..read.reader import Store, open_store
from ..schemas.store_head import StoreHead
from ..sinks.base import StoreError
from .escape import escape_json, escape_text
from .follow import Follower
from .progress import progress_bar
from .render import (
    Column,
    Out,
    event_line,
    render_call,
    render_overview,
    render_rollout,
    render_verify,
)
from .shapes import CallView, OverviewView, RolloutView, VerifyView
from .views import (
    InspectError,
    TokenText,
    call_view,
    overview,
    rollout_view,
    verify_view,
)

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "PlainOut",
    "RichOut",
    "absolute_store_hint",
    "add_inspect_parser",
    "load_tokenizer",
    "main",
    "relative_store_path",
    "run_inspect",
]

PROG = "capture-proxy inspect"
#: Polling bounds for --follow: fast enough to watch a session, slow enough not to load a store.
MIN_INTERVAL, MAX_INTERVAL = 0.05, 60.0


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--interval wants seconds, got {text!r}") from exc
    if not MIN_INTERVAL <= value <= MAX_INTERVAL:
        raise argparse.ArgumentTypeError(
            f"--interval must be between {MIN_INTERVAL} and {MAX_INTERVAL} seconds, got {value}"
        )
    return value


def relative_store_path(url: str) -> str | None:
    """The path of a store named ``kind:///path`` with three slashes, which by the project's
    convention (SQLAlchemy's) is relative to the working folder: ``parquet:///data/x`` is
    ``data/x``. None for any other form (four slashes, a plain path, a URL)."""
    from ..sinks.registry import resolve_store

    try:
        kind, store = resolve_store(url)
    except StoreError:
        return None
    three = any(url.strip().startswith(f"{s}:///") for s in kind.path_schemes)
    return store.location if three and not os.path.isabs(store.location) else None


def absolute_store_hint(url: str) -> str | None:
    """What to say when `url` names a relative store that does not exist while the absolute
    path spelt the same way does (``parquet:///data/x`` for ``/data/x``), else None."""
    path = relative_store_path(url)
    if path is None or os.path.lexists(path) or not os.path.exists("/" + path):
        return None
    scheme = url.strip().split(":", 1)[0]
    return (
        f"{url} is relative to the working folder (three slashes): {os.path.abspath(path)}, "
        f"which does not exist; /{path} does: for it write {scheme}:////{path}"
    )


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "store",
        metavar="STORE",
        help="sqlite:///file.db, parquet:///folder (three slashes: relative to the working "
        "folder; four: absolute), s3://bucket/prefix (gs://, az://), a running proxy's "
        "http://HOST:PORT (https://; its reader or admin token in CAPTURE_PROXY_READER_TOKEN), "
        "or a path",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--rollout", metavar="ID", help="one rollout's calls, staged and failed")
    what.add_argument("--call", metavar="ID", help="one call in full (request, response, digests)")
    what.add_argument(
        "--verify",
        action="store_true",
        help="check every digest and attachment; exit 1 if any fails",
    )
    p.add_argument(
        "--expected-store-head",
        metavar="HEAD[:ROLLOUTS[:EVENTS[:CLAIMS]]]",
        help="with --verify: the store head its writer published last (its log's store_head "
        "line, or capture_proxy_store_head_info); a store whose head differs fails, saying how",
    )
    p.add_argument("--tokens", action="store_true", help="with --call: print the token ids")
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="with --call: a tokenizer.json; shows each token id with its text "
        "(needs the `tokenizers` package)",
    )
    p.add_argument("--json", action="store_true", help="print JSON (keys in docs/inspect.md)")
    p.add_argument(
        "--follow",
        action="store_true",
        help="keep printing new calls as the store grows (the store, or --rollout); Ctrl-C stops",
    )
    p.add_argument(
        "--interval",
        type=_interval,
        default=1.0,
        metavar="SECONDS",
        help="how often --follow looks for new calls (default: %(default)s)",
    )


def add_inspect_parser(subparsers: Any) -> None:
    """Add ``inspect`` to a `capture-proxy` subparsers object; run the result with `run_inspect`."""
    p = subparsers.add_parser(
        "inspect",
        help="show what a store holds: rollouts, calls, tokens; verify digests",
        description=(__doc__ or "").split("\n\n")[0],
    )
    _add_arguments(p)


def load_tokenizer(path: str) -> TokenText:
    """Each token id's text, from a Hugging Face tokenizer.json (through `tokenizers`)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise InspectError(
            "--tokenizer needs the tokenizers package, which is not installed: "
            "pip install tokenizers"
        ) from exc
    if not os.path.isfile(path):
        raise InspectError(f"--tokenizer: no file at {path}")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # the library raises its own Exception subclass for a bad file
        raise InspectError(f"--tokenizer: {path} is not a tokenizer.json ({e})") from e

    def text(token_id: int) -> str:
        decoded: str = tok.decode([token_id], skip_special_tokens=False)
        # A lone byte of a multi-byte character decodes to nothing: show the vocabulary entry.
        return decoded or (tok.id_to_token(token_id) or "")

    return text


# -- where the output goes ----------------------------------------------------------------


class PlainOut:
    """Aligned plain text: what `inspect` prints when stdout is not a terminal."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def line(self, text: str = "", *, alert: bool = False, strong: bool = False) -> None:
        self.stream.write(escape_text(text, keep_layout=True) + "\n")

    def table(
        self, columns: Sequence[Column], rows: Sequence[Sequence[str]], alerts: Sequence[bool]
    ) -> None:
        rows = [[escape_text(cell) for cell in row] for row in rows]
        widths = [len(c.name) for c in columns]
        for row in rows:
            widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
        for cells in ([c.name for c in columns], *rows):
            parts = [
                cell.rjust(w) if c.numeric else cell.ljust(w)
                for c, cell, w in zip(columns, cells, widths, strict=True)
            ]
            self.stream.write("  ".join(parts).rstrip() + "\n")


class RichOut:
    """Rich tables and colour, sized to the console (a terminal, or one a test builds)."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def line(self, text: str = "", *, alert: bool = False, strong: bool = False) -> None:
        from rich.text import Text

        style = "bold red" if alert else ("bold" if strong else "")
        self.console.print(Text(escape_text(text, keep_layout=True), style=style))

    def table(
        self, columns: Sequence[Column], rows: Sequence[Sequence[str]], alerts: Sequence[bool]
    ) -> None:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        rows = [[escape_text(cell) for cell in row] for row in rows]
        keep, widths = _fit(columns, rows, self.console.width)
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for i, width in zip(keep, widths, strict=True):
            table.add_column(
                columns[i].name,
                justify="right" if columns[i].numeric else "left",
                no_wrap=True,
                overflow="ellipsis",
                width=width,
            )
        for row, alert in zip(rows, alerts, strict=True):
            cells = (Text(row[i]) for i in keep)
            table.add_row(*cells, style="bold red" if alert else None)
        self.console.print(table)
        hidden = [c.name for i, c in enumerate(columns) if i not in keep and _filled(rows, i)]
        if hidden:
            self.console.print(
                f"(hidden to fit: {', '.join(hidden)}; widen the terminal or use --json)",
                style="dim",
                markup=False,
            )


#: Space between two columns of a rich table without edges: padding, rule, padding.
_GAP = 3
_MIN_FLEX = 12


def _filled(rows: Sequence[Sequence[str]], i: int) -> bool:
    return any(row[i] not in ("", "-") for row in rows)


def _fit(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], total: int
) -> tuple[list[int], list[int]]:
    """Which columns to show, and their widths, on a terminal `total` characters wide.

    Fixed columns keep their natural width (ids must stay whole to be copied); flexible ones
    share what is left by their `flex`. Empty hideable columns go first; when the rest still
    does not fit, hideable columns go by their `hide` rank.
    """
    natural = [max([len(c.name), *(len(row[i]) for row in rows)]) for i, c in enumerate(columns)]
    keep = [i for i, c in enumerate(columns) if c.hide == 0 or _filled(rows, i)]

    def need(kept: list[int]) -> int:
        flex_min = sum(min(natural[i], _MIN_FLEX) for i in kept if columns[i].flex)
        fixed = sum(natural[i] for i in kept if not columns[i].flex)
        return flex_min + fixed + _GAP * (len(kept) - 1)

    for i in sorted((i for i in keep if columns[i].hide), key=lambda i: -columns[i].hide):
        if need(keep) <= total:
            break
        keep.remove(i)
    widths = {i: natural[i] for i in keep}
    room = total - _GAP * (len(keep) - 1) - sum(natural[i] for i in keep if not columns[i].flex)
    # Narrow flexible columns keep their natural width and leave the rest to the others.
    pending = sorted((i for i in keep if columns[i].flex), key=lambda i: natural[i])
    while pending:
        weight = sum(columns[i].flex for i in pending)
        i = pending.pop(0)
        share = max(min(natural[i], _MIN_FLEX), room * columns[i].flex // weight)
        widths[i] = min(natural[i], share)
        room -= widths[i]
    return keep, [widths[i] for i in keep]


def _out_for(stream: IO[str]) -> Out:
    if stream.isatty():
        from rich.console import Console

        return RichOut(Console(file=stream, highlight=False))
    return PlainOut(stream)


def _print_json(view: Any, stream: IO[str], *, compact: bool = False) -> None:
    option = orjson.OPT_APPEND_NEWLINE | (0 if compact else orjson.OPT_INDENT_2)
    stream.write(escape_json(orjson.dumps(view, option=option, default=str).decode()))
    stream.flush()


def _follow(follower: Follower, args: argparse.Namespace, stream: IO[str], out: Out) -> int:
    print(
        f"following {follower.store.url} every {args.interval:g}s (Ctrl-C to stop)",
        file=sys.stderr,
        flush=True,
    )

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    # SIGTERM (a supervisor, `timeout`) ends a follow as cleanly as Ctrl-C: output stays whole.
    # Signal handlers can only be set from the main thread; elsewhere the default stays.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if main_thread else None
    try:
        while True:
            time.sleep(args.interval)
            for e in follower.poll():
                if args.json:
                    _print_json({"event": "call", **e}, stream, compact=True)
                    continue
                refs = (e["parent_call_id"], e["retry_of"]) if e["status"] == "staged" else ()
                seq_of = {k: s for k in refs if k and (s := follower.seq_of(k)) is not None}
                prefix = "" if args.rollout else f"{e['rollout_id']} "
                out.line(prefix + event_line(e, seq_of), alert=e["status"] != "staged")
                stream.flush()
    except KeyboardInterrupt:
        return 0
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _check_flags(args: argparse.Namespace) -> None:
    if (args.tokens or args.tokenizer) and not args.call:
        raise InspectError("--tokens and --tokenizer go with --call ID")
    if args.expected_store_head is not None:
        if not args.verify:
            raise InspectError("--expected-store-head goes with --verify")
        try:
            StoreHead.parse(args.expected_store_head)
        except ValueError as e:
            raise InspectError(f"--expected-store-head: {e}") from None
    if args.follow and (args.call or args.verify):
        raise InspectError("--follow follows the store or one --rollout, not --call or --verify")


def _run(store: Store, args: argparse.Namespace, stream: IO[str]) -> int:
    out = _out_for(stream)
    # The baseline is taken before the first view is read: a call landing in between is
    # printed twice at worst, never missed.
    follower = Follower(store, args.rollout) if args.follow else None
    view: OverviewView | RolloutView | CallView | VerifyView | None = None
    # Each view bound to its own renderer, so mypy checks the pair.
    draw: Callable[[Out], None] | None = None
    failed = False
    if args.verify:
        with progress_bar("verifying") as progress:
            verified = verify_view(
                store, progress=progress, expected_store_head=args.expected_store_head
            )
        view, draw, failed = verified, partial(render_verify, verified), not verified["ok"]
    elif args.call:
        text = load_tokenizer(args.tokenizer) if args.tokenizer else None
        try:
            call = call_view(
                store, args.call, tokens=args.tokens or text is not None, token_text=text
            )
        except KeyError as exc:
            raise InspectError(
                f"no call {args.call!r} in {store.url} (neither staged nor in a ledger)"
            ) from exc
        view, draw = call, partial(render_call, call)
        detail = call["call"]
        if detail["status"] == "staged":  # checked against its digest as it was read
            failed = not detail["check"]["ok"] or not all(a["ok"] for a in detail["attachments"])
    elif args.rollout:
        try:
            rollout = rollout_view(store, args.rollout)
        except KeyError as exc:
            if follower is None:
                raise InspectError(f"no rollout {args.rollout!r} in {store.url}") from exc
            # Following a rollout before its first call is how one watches a run start.
            print(f"no rollout {args.rollout!r} in {store.url} yet: waiting", file=sys.stderr)
        else:
            view, draw = rollout, partial(render_rollout, rollout)
    else:
        listed = overview(store)
        view, draw = listed, partial(render_overview, listed)
    if view is not None and args.json:
        _print_json(view, stream, compact=follower is not None)
    elif draw is not None:
        draw(out)
        stream.flush()
    if follower is not None:
        return _follow(follower, args, stream, out)
    return 1 if failed else 0


def run_inspect(args: argparse.Namespace, *, stdout: IO[str] | None = None) -> int:
    """Run ``inspect`` with parsed arguments; returns the exit status (0; 1: ``--verify`` found
    a problem, or the ``--call`` record does not verify; 2: a usage error or a store, rollout or
    call that cannot be found or read)."""
    stream = stdout if stdout is not None else sys.stdout
    try:
        _check_flags(args)
        with open_store(args.store) as store:
            return _run(store, args, stream)
    except (InspectError, StoreError) as e:
        hint = absolute_store_hint(args.store) if isinstance(e, StoreError) else None
        message = f"{e}" + (f"; {hint}" if hint else "")
        print(f"{PROG}: {escape_text(message, keep_layout=True)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`inspect ... | head`): not an error, and nothing left to say.
        if stream is sys.stdout:
            # Otherwise Python reports the broken pipe again when it flushes stdout at exit.
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def main(argv: Sequence[str] | None = None, *, stdout: IO[str] | None = None) -> int:
    """``capture-proxy inspect`` on its own; `argv` excludes the program name."""
    p = argparse.ArgumentParser(prog=PROG, description=(__doc__ or "").split("\n\n")[0])
    _add_arguments(p)
    return run_inspect(p.parse_args(argv), stdout=stdout)
