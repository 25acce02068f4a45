"""One long-lived reader on the store a sink writes, for resuming rollouts and manifests."""

from __future__ import annotations

import threading

from ..sinks.base import SinkWithSource, StagingSink, StagingSource
from ..sinks.registry import open_source

__all__ = ["SharedReader"]


class SharedReader:
    """One reader on the sink's store, opened on first use and then shared: readers are
    thread-safe and see later commits, and opening a Parquet dataset indexes every unit.

    A sink that reads itself (`MemorySink`) or lends its own reader (`SinkWithSource`: a
    Parquet sink) is read through that: the process then holds one index of the store, and
    `close` leaves it to the sink."""

    def __init__(self, sink: StagingSink) -> None:
        self.sink = sink
        lent: StagingSource | None = None
        if isinstance(sink, StagingSource):
            lent = sink
        elif isinstance(sink, SinkWithSource):
            lent = sink.own_source()
        self._own = lent is None
        self._source = lent
        self._lock = threading.Lock()

    def __call__(self) -> StagingSource:
        with self._lock:
            if self._source is None:
                # Small cache: this reader lives as long as the proxy and mostly reads a few
                # rollouts' last calls (resume, manifests), never the whole store.
                self._source = open_source(self.sink.url, cache_bytes=8 << 20)
            return self._source

    def close(self) -> None:
        with self._lock:
            if self._source is not None and self._own:
                self._source.close_reader()
                self._source = None
