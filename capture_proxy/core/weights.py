"""The driver's weight version: kept in the store, so a restart does not stamp calls with 0.

The version a driver sets (``PUT /admin/weight-version``) is written into the store before it
is used, as the metadata of the proxy-state rollout header (`PROXY_STATE_ROLLOUT`): every store
kind already keeps rollout headers through `StagingSink.put_rollout`, so this needs no table,
file or format change of its own, and a store written before it simply has no header (version 0).
A proxy starting on the store restores the last version set (`stored_weight_version`).

Per rollout the version is expected not to go down, but a decrease is legitimate (a rollback to a
checkpoint): such a call is staged and flagged, with `DECREASED_FROM` in its record's extras
(covered by the digest through ``extras_digest``) and in its manifest line.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from ..schemas.records import RolloutInfo, RolloutState
from ..sinks.base import PROXY_STATE_ROLLOUT, StagingSource

__all__ = ["DECREASED_FROM", "state_header", "stored_weight_version"]

#: The metadata key of the proxy-state header that holds the weight version.
_VERSION_KEY = "weight_version"
#: The extras key (and manifest field) of a call stamped lower than its rollout's previous call:
#: that previous call's version.
DECREASED_FROM = "weight_version_decreased_from"


def state_header(weight_version: int) -> RolloutInfo:
    """The proxy-state header holding `weight_version` (and when it was set)."""
    now = int(time.time() * 1000)
    return RolloutInfo(
        PROXY_STATE_ROLLOUT,
        RolloutState.OPEN,
        False,
        now,
        None,
        {_VERSION_KEY: weight_version, "set_at_ms": now},
    )


def stored_weight_version(
    open_source: Callable[[], StagingSource], *, listed_within_s: float = 0.0
) -> int | None:
    """The weight version last set on this store, or None if none was. Blocking I/O.

    `listed_within_s`: a reader that lists the store before each read (a Parquet dataset's
    commit markers) may use a listing it took less than that many seconds ago instead (a
    proxy starting on a store its sink has just opened and listed)."""
    source = open_source()
    recent = getattr(source, "snapshot", None)  # optional on sources: a Parquet reader's
    within = recent(listed_within_s) if listed_within_s > 0 and callable(recent) else None
    try:
        with within if within is not None else contextlib.nullcontext():
            info = source.rollout_info(PROXY_STATE_ROLLOUT)
    except KeyError:
        return None
    value = info.metadata.get(_VERSION_KEY)
    # Only this module writes the header; anything else there is not a version to stamp.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None
