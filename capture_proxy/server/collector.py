"""How `capture-proxy serve` runs Python's cyclic garbage collector: less often, and never over
what start-up built.

CPython frees almost everything by reference counting; the cyclic collector only finds cycles.
By default it runs a young-generation pass every 700 net container allocations and, now and
then, a full pass over every object the process holds. A captured call allocates a few hundred
containers (its decoded request, lineage nodes, futures), so the default ran a young pass every
few calls and a full pass every few hundred, and a full pass walks every long-lived object
(caches, lineage indexes, the modules): measured in the serving proxy at ~0.17 ms of CPU per
call, with full passes of ~50 ms CPU each on the event loop, where every call in flight waits
for them (docs/reports/performance.md).

`tune_for_serving` moves what start-up built (modules, settings, the app) out of the
collector's view (`gc.freeze`: those objects live as long as the process) and raises the young
threshold, so a young pass runs every few hundred calls instead; cycles are still collected,
just later, and the few megabytes of cyclic garbage that can wait in between are bounded by
the threshold. The library (`capture_proxy.library`) leaves the collector as its host
configured it: this is the server's choice for its own process.
"""

from __future__ import annotations

import gc

__all__ = ["THRESHOLDS", "tune_for_serving"]

#: `gc.set_threshold` while serving: a young pass every 20,000 net container allocations (the
#: default is 700), a middle one every 5 young passes, a full one every 5 middle ones (and only
#: when it would examine at least 25% more long-lived objects than the last, CPython's own rule).
THRESHOLDS = (20_000, 5, 5)


def tune_for_serving() -> None:
    """Collect once, freeze what survives, and set `THRESHOLDS`. Call when start-up is done."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
