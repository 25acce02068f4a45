"""`capture-proxy serve`: the settings loaded, the logs set up, the proxy run."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..logs import setup_logging
from ..server.settings import load_settings

log = logging.getLogger("capture_proxy")


def run_serve(settings_args: argparse.Namespace) -> int:
    from ..server.event_loop import run
    from ..server.run import serve

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
    from ..inspect.cli import absolute_store_hint, relative_store_path

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
