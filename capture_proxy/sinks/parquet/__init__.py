"""The Parquet store: immutable units in a dataset folder (local or a pyarrow filesystem),
an index, ledger files, garbage collection and compaction.
"""

from __future__ import annotations

from ._compact import (
    compact_dataset,
    compact_store,
)
from ._gc import (
    gc_parquet,
)
from ._lease import (
    Lease,
    LeaseLost,
    maintenance_lease,
)
from ._sink import (
    ParquetSink,
    ParquetSource,
)
from ._snapshot import (
    LiveFiles,
    live_files,
)

__all__ = [
    "Lease",
    "LeaseLost",
    "LiveFiles",
    "ParquetSink",
    "ParquetSource",
    "compact_dataset",
    "compact_store",
    "gc_parquet",
    "live_files",
    "maintenance_lease",
]
