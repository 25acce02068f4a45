"""The on-disk layout of a Parquet dataset (format version 1).

::

    STORE/
      _format.json                  {"format": "capture-proxy-parquet", "version": 1}
      calls/<unit>.parquet          one row per staged call (the columns of `codec.ROW_FIELDS`)
      blobs/<unit>.parquet          content-addressed messages and request bodies (key, data)
      attachments/<unit>.parquet    content-addressed attachment bytes (sha256, media_type, data;
                                    each call's own media type is in its calls row)
      ledger/<unit>.parquet         rollout headers, not-staged calls, orphan marks, event logs
      claims/<rollout>/<seq>        admission claims, one file per seq (`_claims`), not in units
      _commits/<unit>.json          the commit marker: a unit exists once this file exists
      _checkpoint/live.json         the live units' markers, kept by maintenance (`_checkpoint`)
      _leases/maintenance           the lease of the one compaction or gc at a time (`_lease`)
      _leases/clock                 written to read the store's clock (`_lease`)
      _writer.lock                  held by the one writer (local folders)

A *unit* is what one group commit writes: up to one file per table, all immutable. Its data files
are written and fsynced first; the marker is written last, atomically, and names them. Readers
list ``_commits/`` and read only the files the markers name, so a unit whose marker is missing
(a crash mid-commit) does not exist, and temporary files (``*.tmp``) are never read.

Unit names are ``<order>-<id>``: `order` is a 20-digit, increasing number (nanoseconds at commit,
bumped to stay increasing), so name order is commit order; ledger rows are replayed in that order.
A marker lands within `COMMIT_LIMIT_S` of its order (the checkpoint's horizon rests on it).
Compaction writes a merged unit whose marker *retires* the units it replaces, in the same atomic
step: a reader sees either the old units or the merged one, never both and never neither.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from ..base import StoreError, StoreFormatError
from ._bounds import CheckedReads, check_pages
from ._fs import TMP_SUFFIX, DatasetFS
from ._ranged import open_columns

__all__ = [
    "ATTACHMENTS",
    "BLOBS",
    "CALLS",
    "COMMITS_DIR",
    "COMMIT_LIMIT_S",
    "COMMIT_MARGIN_S",
    "DEDUP_WINDOW_S",
    "FORMAT_FILE",
    "FORMAT_VERSION",
    "GC_MARGIN_S",
    "LEDGER",
    "PROBE_FILE",
    "SCHEMAS",
    "TABLES",
    "WRITER_LOCK",
    "Marker",
    "check_format",
    "conform",
    "create_dataset",
    "encode_table",
    "horizon_before",
    "list_markers",
    "live_units",
    "new_unit_name",
    "read_group",
    "read_groups",
    "read_table",
    "table_bytes",
    "unit_files",
]

FORMAT_NAME = "capture-proxy-parquet"
#: Bump when the layout or a schema changes; add a migration when old datasets must be read.
FORMAT_VERSION = 1
FORMAT_FILE = "_format.json"
COMMITS_DIR = "_commits"
#: Lock file (local datasets): one writer at a time.
WRITER_LOCK = "_writer.lock"
#: Written and removed by a writer whose writes fail, to learn when the store takes them again.
PROBE_FILE = "_writer.probe"
#: The window rule that lets gc run beside writers: a writer shares a blob or attachment only
#: with a copy committed less than this long ago (by its unit's order) and stores an older one
#: again; gc removes one only when every copy is older than this plus `GC_MARGIN_S` (the time a
#: writer's decision can take to commit, and clocks that differ between hosts).
DEDUP_WINDOW_S = 3600.0
GC_MARGIN_S = 900.0

#: A unit's marker lands within this long of the time in its name (`new_unit_name`): a writer
#: whose commit took longer retracts the unit and fails the batch (`_writer`).
COMMIT_LIMIT_S = 30.0
#: How far before a maintenance run's listing its checkpoint's horizon is (`_checkpoint`): a
#: marker named before the horizon was listed by that run, given `COMMIT_LIMIT_S` and hosts'
#: clocks within ``(COMMIT_MARGIN_S - COMMIT_LIMIT_S) / 2`` of each other.
COMMIT_MARGIN_S = 120.0


def horizon_before(ns: int) -> str:
    """The horizon a listing begun at `ns` (`time.time_ns`) allows: the 20-digit unit order
    `COMMIT_MARGIN_S` before it. A marker not listed then sorts after it (a checkpoint's
    ``listed_after``, a long-lived reader's own: `_refresh.Refreshing._roll`)."""
    return f"{max(0, ns - int(COMMIT_MARGIN_S * 1e9)):020d}"


CALLS, BLOBS, ATTACHMENTS, LEDGER = "calls", "blobs", "attachments", "ledger"
TABLES = (CALLS, BLOBS, ATTACHMENTS, LEDGER)

_s, _b, _i = pa.string(), pa.binary(), pa.int64()

#: One row per staged call: `codec.encode_record`'s row, column for column.
CALLS_SCHEMA = pa.schema(
    [
        ("call_id", _s),
        ("rollout_id", _s),
        ("seq", _i),
        ("parent_call_id", _s),
        ("retry_of", _s),
        ("created_at_ms", _i),
        ("weight_version", _i),
        ("model", _s),
        ("upstream_version", _s),
        ("tokenizer_fingerprint", _s),
        ("finish_reason", _s),
        ("schema_version", _i),
        ("sampling", _b),
        ("response", _b),
        ("extras", _b),
        ("request_key", _s),
        ("message_keys", _b),
        ("prompt_len", _i),
        ("prev_len", _i),
        ("delta_len", _i),
        ("cum_len", _i),
        ("delta_tokens", _b),
        ("completion_logprobs", _b),
        ("digest", _s),
        ("extras_digest", _s),
        ("attachment_shas", pa.list_(_s)),
        # The media type of each reference in `attachment_shas` (`codec.ROW_FIELDS`): one copy
        # of the bytes may be referred to under two media types. Nullable: rows written before
        # it read with the media type stored with the bytes, as they were sealed (the layout's
        # format stays 1).
        ("attachment_media_types", pa.list_(_s)),
        # Record schema 2 (`codec.V2_ROW_FIELDS`). Nullable: files written before these columns
        # lack them, and their rows read back as version-1 records (`conform` fills nulls).
        ("engine_weight_version", _s),
        ("weight_spans", _b),
        ("token_in", pa.bool_()),
        ("bridge_spans", _b),
        ("replica", _s),
        ("effective_sampling", _b),
        ("logprobs_mode", _s),
    ]
)
BLOBS_SCHEMA = pa.schema([("key", _s), ("data", _b)])
ATTACHMENTS_SCHEMA = pa.schema([("sha256", _s), ("media_type", _s), ("size", _i), ("data", _b)])
#: Rollout headers (kind "rollout"), not-staged calls ("failure"), orphan marks ("orphan") and
#: the rollouts' event logs ("event").
LEDGER_SCHEMA = pa.schema(
    [
        ("kind", _s),
        ("rollout_id", _s),
        ("call_id", _s),
        ("seq", _i),
        ("status", _s),
        ("reason", _s),
        ("message", _s),
        ("http_status", _i),
        ("at_ms", _i),
        ("state", _s),
        ("poisoned", pa.bool_()),
        ("sealed_at_ms", _i),
        ("metadata", _b),
        ("policy", _b),
        # Event-log rows (kind "event", `_events`); null in other rows and in files written
        # before event logs (`conform` fills them), so the layout's format stays 1.
        ("event_kind", _s),
        ("position", _i),
        ("body", _b),
        ("prev_hash", _s),
        ("hash", _s),
    ]
)
SCHEMAS: dict[str, pa.Schema] = {
    CALLS: CALLS_SCHEMA,
    BLOBS: BLOBS_SCHEMA,
    ATTACHMENTS: ATTACHMENTS_SCHEMA,
    LEDGER: LEDGER_SCHEMA,
}
#: Columns worth a dictionary (repeated values); token and text columns are not.
_DICTIONARY_COLUMNS = [
    "rollout_id",
    "model",
    "upstream_version",
    "tokenizer_fingerprint",
    "finish_reason",
    "replica",
    "logprobs_mode",
    "media_type",
    "kind",
    "status",
    "reason",
    "state",
    "event_kind",
]


def conform(name: str, table: pa.Table) -> pa.Table:
    """`table` (read from a file of table `name`) in the current schema: columns added since the
    file was written are filled with nulls (their defaults), then types are cast."""
    schema = SCHEMAS[name]
    for field in schema:
        if field.name not in table.column_names:
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return table.select(schema.names).cast(schema)


def table_bytes(name: str, rows: Sequence[Mapping[str, Any]]) -> bytes:
    """One table's rows as a Parquet file."""
    return encode_table(pa.Table.from_pylist(list(rows), schema=SCHEMAS[name]))


#: A column chunk is compressed (zstd) from this many bytes up; smaller ones are stored plain.
COMPRESS_COLUMN_BYTES = 1 << 10
#: Dictionary-encoded columns get a dictionary from this many rows up.
DICTIONARY_ROWS = 32


def encode_table(table: pa.Table, *, row_group_bytes: int = 16 << 20) -> bytes:
    """A table as Parquet bytes: zstd, page checksums, row groups of about `row_group_bytes`.

    Readers load one row group at a time, so a record in a large compacted file costs a row
    group, not the file. Only what can gain is encoded: a column chunk under
    `COMPRESS_COLUMN_BYTES` is stored plain and a table under `DICTIONARY_ROWS` rows has no
    dictionaries, since compressing or building a dictionary costs a fixed ~20 µs per column
    for a few bytes saved (a group commit's unit is mostly such columns; a compacted file
    hardly has any).
    """
    # A buffer size is read off the buffers, ~30x cheaper than `nbytes` (summed over each
    # column's slices) and not below it (but for a buffer that several chunks share, counted
    # once: then under 1 KiB of distinct bytes may go uncompressed): only a size that can reach
    # a limit is made exact, so a group commit's small tables skip the sums.
    size = table.get_total_buffer_size()
    if size >= row_group_bytes:
        size = table.nbytes
    per_row = max(1, size // max(1, table.num_rows))
    compression: str | dict[str, str] = "none"
    if size >= COMPRESS_COLUMN_BYTES:  # else no column can reach it
        compression = {
            # Codecs are per Parquet column, named by path: a list's values are
            # `name.list.element`.
            f"{field.name}.list.element" if pa.types.is_list(field.type) else field.name: (
                "zstd" if _at_least(column, COMPRESS_COLUMN_BYTES) else "none"
            )
            for field, column in zip(table.schema, table.columns, strict=True)
        }
    dictionary: list[str] | bool = False
    if table.num_rows >= DICTIONARY_ROWS:
        names = set(table.schema.names)
        dictionary = [c for c in _DICTIONARY_COLUMNS if c in names]
    sink = pa.BufferOutputStream()
    pq.write_table(
        table,
        sink,
        row_group_size=max(1, row_group_bytes // per_row),
        compression=compression,
        use_dictionary=dictionary,
        write_statistics=False,
        store_schema=False,
        write_page_checksum=True,
    )
    return bytes(sink.getvalue())


def _at_least(column: pa.ChunkedArray, limit: int) -> bool:
    """Whether `column`'s `nbytes` reach `limit` (its buffer size first: cheaper, not less)."""
    return bool(column.get_total_buffer_size() >= limit and column.nbytes >= limit)


# Reads are single-threaded: units are small, and pyarrow's thread pool costs more per file than
# it saves (measured: 1.3 ms vs 0.8 ms per small file). FileNotFoundError from any of these means
# a compaction removed the file: the reader re-lists and retries.


def _open(
    dfs: DatasetFS, rel: str, columns: Sequence[str] | None, groups: Sequence[int] | None = None
) -> pa.NativeFile:
    """`rel` to read `columns` of: on object storage, those columns' chunks fetched at once
    (`_ranged`: two rounds of requests instead of one per page header and chunk)."""
    if columns is not None and rel not in dfs.prefetched:
        ahead = dfs.ahead.get(rel)
        # (Taken once: a read on another thread may have taken it meanwhile.)
        if ahead is not None and ahead[0].issuperset(columns) and dfs.ahead.pop(rel, None) is ahead:
            return ahead[1]
        ranged = open_columns(dfs, rel, columns, groups)
        if ranged is not None:
            return ranged
    return dfs.open(rel)


def read_table(dfs: DatasetFS, rel: str, columns: Sequence[str] | None = None) -> pa.Table:
    """Read one data file, or some of its columns."""
    with _open(dfs, rel, columns) as f:
        pf = open_parquet(f, rel, columns=columns)
        cols = list(columns) if columns is not None else None
        return pf.read(columns=cols, use_threads=False)


def read_groups(dfs: DatasetFS, rel: str, columns: Sequence[str] | None = None) -> list[pa.Table]:
    """A data file's row groups (all columns, or `columns`), in order."""
    with _open(dfs, rel, columns) as f:
        pf = open_parquet(f, rel, columns=columns)
        cols = list(columns) if columns is not None else None
        return [
            pf.read_row_group(g, columns=cols, use_threads=False)
            for g in range(pf.metadata.num_row_groups)
        ]


def read_group(
    dfs: DatasetFS, rel: str, group: int, columns: Sequence[str] | None = None
) -> pa.Table:
    """One row group of a data file, every column (or `columns`)."""
    with _open(dfs, rel, columns, [group]) as f:
        pf = open_parquet(f, rel, groups=[group], columns=columns)
        cols = list(columns) if columns is not None else None
        return pf.read_row_group(group, columns=cols, use_threads=False)


def open_parquet(
    f: pa.NativeFile,
    rel: str,
    *,
    groups: Sequence[int] | None = None,
    columns: Sequence[str] | None = None,
) -> pq.ParquetFile:
    """`f` as a Parquet file whose `groups` and `columns` (None: all) decompress within
    `_bounds.MAX_PAGE_BYTES` and `MAX_READ_BYTES` (`StoreDamaged` otherwise); a read made
    lately is not checked again (files are never rewritten in place)."""
    pf = pq.ParquetFile(f)
    key = (
        rel,
        f.size(),
        None if groups is None else tuple(groups),
        None if columns is None else tuple(columns),
    )
    if not _CHECKED.seen(key):
        check_pages(f, pf.metadata, rel, groups, columns)
        _CHECKED.add(key)
    return pf


#: Reads already checked (`open_parquet`), the most recently used only.
_CHECKED = CheckedReads()


# -- the format file ------------------------------------------------------------------------------


def check_format(dfs: DatasetFS) -> bool:
    """True when `dfs` holds a dataset this version reads; False when there is no format file.

    Raises `StoreFormatError` for a newer format (the message says to upgrade) and `StoreError`
    for a format file that is not ours.
    """
    try:
        raw = dfs.read(FORMAT_FILE)
    except FileNotFoundError:
        return False
    try:
        info = orjson.loads(raw)
        name, version = info["format"], info["version"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as e:
        raise StoreError(f"{dfs.path(FORMAT_FILE)} is not a capture-proxy format file") from e
    if name != FORMAT_NAME or type(version) is not int:
        raise StoreError(f"{dfs.path(FORMAT_FILE)} describes {name!r}, not {FORMAT_NAME!r}")
    if version > FORMAT_VERSION:
        raise StoreFormatError(
            f"the dataset at {dfs.root} has format version {version}, newer than this "
            f"capture-proxy reads ({FORMAT_VERSION}): upgrade capture-proxy"
        )
    return True


def create_dataset(dfs: DatasetFS) -> None:
    """Make `dfs` a dataset: the folders, then the format file (written last: it is the flag).

    Several writers may create one new dataset at once (a fleet's proxies starting together on
    a new object-store prefix): one that finds files there finds the format file another just
    wrote, and opens that dataset; two that write it write the same bytes.
    """
    if dfs.is_dir() and dfs.listdir(""):
        if check_format(dfs):
            return
        raise StoreError(
            f"{dfs.root} holds files but no {FORMAT_FILE}: not a capture-proxy dataset "
            "(choose an empty or new folder)"
        )
    dfs.makedirs(COMMITS_DIR, *TABLES)
    dfs.put_all({FORMAT_FILE: orjson.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION})})


# -- commit markers -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Marker:
    """A committed unit: its data files (table -> path), row counts, and the units it retires."""

    unit: str
    files: Mapping[str, str]
    rows: Mapping[str, int]
    retires: tuple[str, ...] = ()
    created_at_ms: int = 0
    size: int = 0

    @property
    def order(self) -> int:
        return int(self.unit.split("-", 1)[0])

    @property
    def rel(self) -> str:
        return f"{COMMITS_DIR}/{self.unit}.json"

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "format": FORMAT_VERSION,
                "unit": self.unit,
                "files": dict(self.files),
                "rows": dict(self.rows),
                "retires": list(self.retires),
                "created_at_ms": self.created_at_ms,
                "bytes": self.size,
            }
        )

    @classmethod
    def decode(cls, raw: bytes) -> Marker:
        d = orjson.loads(raw)
        unit, files, rows = sys.intern(d["unit"]), d["files"], d["rows"]
        # A reader holds a marker per unit for as long as it lives: when the files have their
        # usual names (always, as written here) keep them as the unit's name and its tables
        # (about 0.1 KB instead of 0.8 KB of dicts and paths).
        tables = tuple(t for t in TABLES if t in files)
        if len(tables) == len(files) and files == unit_files(unit, tables):
            files = UnitFiles(unit, _TABLE_SETS.setdefault(tables, tables))
            if set(rows) <= set(tables):
                rows = UnitCounts(files.tables, tuple(int(rows.get(t, 0)) for t in tables))
        return cls(
            unit=unit,
            files=files,
            rows=rows,
            retires=tuple(d.get("retires", ())),
            created_at_ms=int(d.get("created_at_ms", 0)),
            size=int(d.get("bytes", 0)),
        )


#: One tuple per set of tables a unit has (there are few): shared by every `UnitFiles`.
_TABLE_SETS: dict[tuple[str, ...], tuple[str, ...]] = {}


class UnitFiles(Mapping[str, str]):
    """A unit's data files (table -> path), from its name and tables: ``<table>/<unit>.parquet``."""

    __slots__ = ("tables", "unit")

    def __init__(self, unit: str, tables: tuple[str, ...]) -> None:
        self.unit = unit
        self.tables = tables

    def __getitem__(self, table: str) -> str:
        if table not in self.tables:
            raise KeyError(table)
        return f"{table}/{self.unit}.parquet"

    def __iter__(self) -> Iterator[str]:
        return iter(self.tables)

    def __len__(self) -> int:
        return len(self.tables)


class UnitCounts(Mapping[str, int]):
    """A unit's row counts per table (as `UnitFiles`, without a dict per unit)."""

    __slots__ = ("counts", "tables")

    def __init__(self, tables: tuple[str, ...], counts: tuple[int, ...]) -> None:
        self.tables = tables
        self.counts = counts

    def __getitem__(self, table: str) -> int:
        try:
            return self.counts[self.tables.index(table)]
        except ValueError:
            raise KeyError(table) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.tables)

    def __len__(self) -> int:
        return len(self.tables)


def new_unit_name(after: int) -> tuple[str, int]:
    """A fresh unit name ordered after `after`; returns (name, order)."""
    order = max(time.time_ns(), after + 1)
    return f"{order:020d}-{uuid.uuid4().hex[:12]}", order


def unit_files(unit: str, tables: Iterable[str]) -> dict[str, str]:
    return {t: f"{t}/{unit}.parquet" for t in tables}


def list_markers(dfs: DatasetFS, after: str | None = None) -> list[str]:
    """Names of the committed units, in commit order (temporary files skipped); with `after`,
    only those whose names sort after it (on object storage the others are not listed)."""
    return [
        name[: -len(".json")]
        for name in dfs.names(COMMITS_DIR, after)
        if name.endswith(".json") and not name.endswith(TMP_SUFFIX)
    ]


def live_units(markers: Mapping[str, Marker]) -> list[Marker]:
    """The units a reader uses: committed and not retired by a compaction, in commit order."""
    retired = {u for m in markers.values() for u in m.retires}
    return [markers[u] for u in sorted(markers) if u not in retired]
