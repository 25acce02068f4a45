"""The `capture-proxy` command: serve, and the store tools built on the reader.

`main` parses the command line (`_args.py`) and runs one command: ``serve`` (`_serve.py`),
``settings``, ``inspect`` (`capture_proxy.inspect`), ``export`` (`_export.py`), and the tools
that change a store, ``seal``, ``compact``, ``gc`` and ``replay-ledger`` (`_store_tools.py`).
Errors are one sentence on stderr: exit status 2 for a usage error, 1 for a store that failed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence

from ..core.policy import PolicyError
from ..errors import error_text
from ..server.settings import SettingsError, settings_markdown
from ..sinks.base import StoreError, UnsupportedStoreOperation
from ._args import _parser as _parser  # tests build the parser to read its flags
from ._export import run_export
from ._serve import run_serve
from ._store_tools import run_compact, run_gc, run_replay_ledger, run_seal

__all__ = ["main"]


def _settings(args: argparse.Namespace) -> int:
    sys.stdout.write(settings_markdown())
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from ..inspect.cli import run_inspect

    return run_inspect(args)


#: Each command's run, by its name on the command line; it returns the exit status.
_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": run_serve,
    "settings": _settings,
    "inspect": _inspect,
    "export": run_export,
    "seal": lambda args: asyncio.run(run_seal(args)),
    "compact": run_compact,
    "gc": run_gc,
    "replay-ledger": lambda args: asyncio.run(run_replay_ledger(args)),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run `capture-proxy` with `argv` (default: the process's arguments); its exit status."""
    args = _parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
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
