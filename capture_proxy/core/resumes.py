"""Reading a rollout back from the store, bounded: a call never waits on it without end.

A rollout this process does not hold (after a restart, an idle release, or a hand-off from
another proxy on the same store) is read from the store before its call is admitted
(`resume_rollout`). On object storage a reader that must first index the store can take
minutes; the call then waits at most ``--rollout-resume-timeout`` seconds and is refused with
503 ``rollout_resume_timeout`` and ``Retry-After`` (nothing was sent upstream, and no seq was
taken: there is no ledger entry to write). The read goes on: concurrent calls of the rollout,
and the retry, wait for the same read, and once it ends its rollout is held for them. A read
that fails is a 503 ``rollout_resume_failed`` naming why, never a 500. Each is logged once per
call and counted (``capture_proxy_rollout_resumes_total`` and its ``_timeouts``/``_failures``).

A sink that reads a rollout it does not hold before writing it (`ReadsRolloutsAhead`: Parquet on
object storage, where another proxy may have continued the rollout) makes that read here too,
beside the resume and within the same bound: the call's claim and record then find the rollout
read, and neither they nor the calls queued behind them wait for the store (a slow read is this
503, never a ``stage_timeout`` poisoning the rollout).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from ..errors import CaptureUnavailable
from ..sinks.base import StagingSource
from .rollouts import RolloutLive, resume_rollout

__all__ = ["RESUME_REFUSALS", "Resumes"]

log = logging.getLogger("capture_proxy.capture")

#: The refusals of a call whose rollout could not be read in time: no ledger entry (no seq).
RESUME_REFUSALS = frozenset({"rollout_resume_timeout", "rollout_resume_failed"})


#: Threads reading rollouts back (`read_threads`): for resumes, and for the re-reads of
#: answered calls' rollouts (hand-backs).
READ_THREADS = 2
ANSWERED_READ_THREADS = 4
_pools: dict[bool, ThreadPoolExecutor] = {}


def read_threads(answered: bool = False) -> ThreadPoolExecutor:
    """The threads rollouts are read back on: not the event loop's default executor, where every
    call's own work runs (its admission keys, its record): a burst of hand-backs takes seconds
    of store reads each, and queued there they held up every other call behind them.

    A few at a time: a resume is mostly decoding (its requests are made at once,
    `ParquetSource`), and on a busy machine many running together each take as long as all of
    them (every one then misses its bound) where a queue finishes the first ones in time. The
    re-read of an `answered` call's rollout (a hand-back: past its bound the call's rollout is
    poisoned) has threads of its own, so it never waits behind resumes (past theirs, a 503 the
    client retries)."""
    pool = _pools.get(answered)
    if pool is None:
        threads = ANSWERED_READ_THREADS if answered else READ_THREADS
        name = "rollout-reread" if answered else "rollout-read"
        pool = _pools[answered] = ThreadPoolExecutor(threads, name)
    return pool


class Resumes:
    """The store reads of rollouts in progress, one per rollout, each awaited at most
    `timeout` seconds by a call. `took` is called with each read's result when it ends (in
    time or not), so a read that outlived its call still serves the retry."""

    def __init__(
        self,
        source: Callable[[], StagingSource],
        timeout: float,
        took: Callable[[str, RolloutLive | None], object],
        prepare: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.source = source
        #: The sink's read of a rollout before writing it (`ReadsRolloutsAhead`), if it makes one.
        self.prepare = prepare
        self.timeout = timeout
        self._took = took
        self._reads: dict[str, asyncio.Future[RolloutLive | None]] = {}
        #: Reads started, and calls refused because a read outlasted `timeout` or failed.
        self.started = 0
        self.timeouts = 0
        self.failures = 0
        #: The longest read so far, in seconds.
        self.slowest_s = 0.0

    async def read(self, rollout_id: str) -> RolloutLive | None:
        """The rollout as the store has it (None: unknown there), within `timeout` seconds.

        Raises `CaptureUnavailable` (503, ``Retry-After``): ``rollout_resume_timeout`` when the
        read takes longer (it goes on), ``rollout_resume_failed`` when it fails."""
        read = self._reads.get(rollout_id)
        if read is None:
            read = asyncio.ensure_future(self._run(rollout_id))
            # Retrieved here: a read whose calls all gave up must not log "never retrieved".
            read.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._reads[rollout_id] = read
            self.started += 1
        started = time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(read), self.timeout)
        except TimeoutError:
            self.timeouts += 1
            log.warning(
                "rollout %s: reading it from the store took over %gs "
                "(--rollout-resume-timeout): its call is refused with 503 "
                "rollout_resume_timeout; the read goes on for the retry",
                rollout_id,
                self.timeout,
                extra={"rollout_id": rollout_id},
            )
            raise CaptureUnavailable(
                f"rollout {rollout_id} is being read from the store, which took over "
                f"{self.timeout:g}s (--rollout-resume-timeout); retry",
                code="rollout_resume_timeout",
                headers={"Retry-After": "5"},
            ) from None
        except CaptureUnavailable:
            raise
        except Exception as e:
            self.failures += 1
            log.error(
                "rollout %s: reading it from the store failed after %.1fs: %s: %s",
                rollout_id,
                time.monotonic() - started,
                type(e).__name__,
                e,
                extra={"rollout_id": rollout_id},
            )
            raise CaptureUnavailable(
                f"rollout {rollout_id} could not be read from the store: {type(e).__name__}: {e}",
                code="rollout_resume_failed",
                headers={"Retry-After": "5"},
            ) from e

    async def _run(self, rollout_id: str) -> RolloutLive | None:
        started = time.monotonic()
        try:
            found = await read_with_sink(self.source, rollout_id, self.prepare)
        finally:
            self._reads.pop(rollout_id, None)
            self.slowest_s = max(self.slowest_s, time.monotonic() - started)
        self._took(rollout_id, found)
        return found


async def read_with_sink(
    source: Callable[[], StagingSource],
    rollout_id: str,
    prepare: Callable[[str], Awaitable[None]] | None,
    mine: frozenset[str] = frozenset(),
    *,
    answered: bool = False,
) -> RolloutLive | None:
    """`resume_rollout` in a worker thread of the rollout reads' own (`read_threads`; an
    `answered` call's re-read on its own ones), and at once the sink's own read of the rollout
    (`prepare`, if any): both done, or the first error."""
    loop = asyncio.get_running_loop()
    pool = read_threads(answered)
    read = loop.run_in_executor(pool, resume_rollout, source, rollout_id, mine)
    if prepare is None:
        return await read
    found, _ = await asyncio.gather(read, prepare(rollout_id))
    return found
