"""Export a store as a flat training table: Parquet or JSON Lines, one row per call or per rollout.

    capture-proxy export sqlite:///capture.db calls.parquet --format parquet --per call
    capture-proxy export parquet:///capture traj.jsonl --format jsonl --per trajectory

Per call, a row holds the call's identity and lineage, its versions, the full prompt and
completion token ids (``list<int32>``), the completion logprobs (``list<float32>``), its digests
and the request / response as JSON text. Per trajectory, a row holds a rollout's linearized
episode (`capture_proxy.read.trajectory`): token ids, loss mask, logprobs, per-token call index and
weight version, and its segments, breaks and drift. Every row says its rollout's `state`,
whether it is `poisoned` and its `n_failures`. Any Arrow tool reads the Parquet file (pyarrow,
DuckDB, Polars, Spark); ``duckdb.read_json`` reads the JSON Lines.

Like the reader's trainer-facing reads, the export leaves out open rollouts (not sealed yet) and
poisoned ones (a call answered but not staged) unless asked for them (``include_open``,
``include_poisoned``), and says which it left out (`ExportSummary.left_out`). Every record is
verified against its digest while exporting (a mismatch stops the export; ``verify=False`` skips
the check), and the output appears only when complete: it is written to a temporary file and
renamed. Orphaned records are left out, as the reader leaves them out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any, Literal

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from ..schemas.records import StagedCallRecord
from .reader import Store, open_store
from .status import RolloutExcluded, RolloutStatus, check_included
from .trajectory import Trajectory, trajectory_from_records

__all__ = ["CALL_SCHEMA", "TRAJECTORY_SCHEMA", "ExportSummary", "export_store"]

_LITTLE = sys.byteorder == "little"
_json = pa.string()

CALL_SCHEMA = pa.schema(
    [
        ("rollout_id", pa.string()),
        ("state", pa.string()),
        ("poisoned", pa.bool_()),
        ("n_failures", pa.int32()),
        ("call_id", pa.string()),
        ("seq", pa.int64()),
        ("parent_call_id", pa.string()),
        ("retry_of", pa.string()),
        ("weight_version", pa.int64()),
        ("model", pa.string()),
        ("upstream_version", pa.string()),
        ("tokenizer_fingerprint", pa.string()),
        ("finish_reason", pa.string()),
        ("created_at_ms", pa.int64()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("completion_token_ids", pa.list_(pa.int32())),
        ("completion_logprobs", pa.list_(pa.float32())),
        ("digest", pa.string()),
        ("extras_digest", pa.string()),
        ("sampling", _json),
        ("request", _json),
        ("response", _json),
        ("extras", _json),
        ("attachment_shas", pa.list_(pa.string())),
    ]
)

_SEGMENT = pa.struct(
    [("start", pa.int64()), ("end", pa.int64()), ("call_ids", pa.list_(pa.string()))]
)
_DRIFT = pa.struct(
    [
        ("call_id", pa.string()),
        ("parent_call_id", pa.string()),
        ("position", pa.int64()),
        ("parent_len", pa.int64()),
        ("prompt_len", pa.int64()),
    ]
)
_BREAK = pa.struct([("call_id", pa.string()), ("position", pa.int64()), ("reason", pa.string())])
_NOT_STAGED = pa.struct(
    [
        ("seq", pa.int64()),
        ("call_id", pa.string()),
        ("status", pa.string()),
        ("reason", pa.string()),
    ]
)
TRAJECTORY_SCHEMA = pa.schema(
    [
        ("rollout_id", pa.string()),
        ("state", pa.string()),
        ("poisoned", pa.bool_()),
        ("n_failures", pa.int32()),
        ("token_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float32())),
        ("call_index", pa.list_(pa.int32())),
        ("weight_versions", pa.list_(pa.int64())),
        ("n_segments", pa.int32()),
        ("n_drift", pa.int32()),
        ("n_breaks", pa.int32()),
        ("segments", pa.list_(_SEGMENT)),
        ("breaks", pa.list_(_BREAK)),
        ("drift", pa.list_(_DRIFT)),
        ("not_staged", pa.list_(_NOT_STAGED)),
        ("calls", pa.list_(pa.string())),
        ("apart", pa.list_(pa.string())),
        ("retries_skipped", pa.list_(pa.string())),
    ]
)

_ARROW_TYPES = {"i": pa.int32(), "f": pa.float32(), "b": pa.int8(), "q": pa.int64()}


def _list_array(values: Sequence[array[Any]], typecode: str) -> pa.Array:
    """A list column from arrays, built from their bytes (no Python object per token)."""
    offsets = array("i", [0])
    flat = array(typecode)
    for v in values:
        flat.extend(v)
        offsets.append(len(flat))
    if not _LITTLE:  # Arrow buffers are little-endian
        flat.byteswap()
        offsets.byteswap()
    items = pa.Array.from_buffers(
        _ARROW_TYPES[typecode], len(flat), [None, pa.py_buffer(flat.tobytes())]
    )
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), items)


def _dumps(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _call_columns(records: list[StagedCallRecord], status: RolloutStatus) -> dict[str, Any]:
    n = len(records)
    return {
        "rollout_id": [r.rollout_id for r in records],
        "state": [str(status.state)] * n,
        "poisoned": [status.poisoned] * n,
        "n_failures": [status.n_failures] * n,
        "call_id": [r.call_id for r in records],
        "seq": [r.seq for r in records],
        "parent_call_id": [r.parent_call_id for r in records],
        "retry_of": [r.retry_of for r in records],
        "weight_version": [r.weight_version for r in records],
        "model": [r.model for r in records],
        "upstream_version": [r.upstream_version for r in records],
        "tokenizer_fingerprint": [r.tokenizer_fingerprint for r in records],
        "finish_reason": [r.finish_reason for r in records],
        "created_at_ms": [r.created_at_ms for r in records],
        "prompt_token_ids": [r.prompt_token_ids for r in records],
        "completion_token_ids": [r.completion_token_ids for r in records],
        "completion_logprobs": [r.completion_logprobs for r in records],
        "digest": [r.digest for r in records],
        "extras_digest": [r.extras_digest for r in records],
        "sampling": [_dumps(r.sampling) for r in records],
        "request": [_dumps(r.request) for r in records],
        "response": [_dumps(r.response) for r in records],
        "extras": [_dumps(r.extras) for r in records],
        "attachment_shas": [list(dict.fromkeys(r.attachment_refs())) for r in records],
    }


def _trajectory_columns(trajs: list[Trajectory]) -> dict[str, Any]:
    return {
        "rollout_id": [t.rollout_id for t in trajs],
        "state": [str(t.state) for t in trajs],
        "poisoned": [t.poisoned for t in trajs],
        "n_failures": [t.n_failures for t in trajs],
        "token_ids": [t.token_ids for t in trajs],
        "loss_mask": [t.loss_mask for t in trajs],
        "logprobs": [t.logprobs for t in trajs],
        "call_index": [t.call_index for t in trajs],
        "weight_versions": [t.weight_versions for t in trajs],
        "n_segments": [len(t.segments) for t in trajs],
        "n_drift": [len(t.drift) for t in trajs],
        "n_breaks": [len(t.breaks) for t in trajs],
        "segments": [
            [{"start": s.start, "end": s.end, "call_ids": list(s.call_ids)} for s in t.segments]
            for t in trajs
        ],
        "breaks": [
            [{"call_id": b.call_id, "position": b.position, "reason": b.reason} for b in t.breaks]
            for t in trajs
        ],
        "drift": [[dataclasses.asdict(d) for d in t.drift] for t in trajs],
        "not_staged": [[dataclasses.asdict(n) for n in t.not_staged] for t in trajs],
        "calls": [t.calls for t in trajs],
        "apart": [t.apart for t in trajs],
        "retries_skipped": [t.retries_skipped for t in trajs],
    }


def _table(columns: dict[str, Any], schema: pa.Schema) -> pa.Table:
    arrays = []
    for f in schema:
        col = columns[f.name]
        if pa.types.is_list(f.type) and f.type.value_type in _ARROW_TYPES.values():
            code = next(c for c, t in _ARROW_TYPES.items() if t == f.type.value_type)
            arrays.append(_list_array(col, code))
        else:
            arrays.append(pa.array(col, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _jsonl_rows(columns: dict[str, Any]) -> Iterator[dict[str, Any]]:
    names = list(columns)
    for values in zip(*columns.values(), strict=True):
        yield {
            n: (v.tolist() if isinstance(v, array) else v)
            for n, v in zip(names, values, strict=True)
        }


@dataclasses.dataclass(slots=True)
class ExportSummary:
    """What `export_store` wrote, and which rollouts it left out and why."""

    #: Rows written.
    rows: int = 0
    #: Rollouts exported.
    rollouts: int = 0
    #: Rollout ids left out, by why: ``"open"`` (not sealed; ``include_open``) and
    #: ``"poisoned"`` (``include_poisoned``; a rollout both open and poisoned counts here).
    #: Only rollouts with staged calls are listed (the others have nothing to export).
    left_out: dict[str, list[str]] = dataclasses.field(
        default_factory=lambda: {"open": [], "poisoned": []}
    )

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "rollouts": self.rollouts, "left_out": self.left_out}


def _batches(
    store: Store,
    per: str,
    *,
    verify: bool,
    include_untooled: bool,
    include_open: bool,
    include_poisoned: bool,
    summary: ExportSummary,
) -> Iterator[dict[str, Any]]:
    """Columns for one rollout at a time (memory stays bounded by the largest rollout)."""
    for rollout_id in store.rollouts():
        status = store.status(rollout_id)
        try:
            check_included(
                rollout_id, status, include_open=include_open, include_poisoned=include_poisoned
            )
        except RolloutExcluded as e:
            if store.source.summaries(rollout_id):
                why = "poisoned" if e.keyword == "include_poisoned" else "open"
                summary.left_out[why].append(rollout_id)
            continue
        records = store.calls(rollout_id, include_open=True, include_poisoned=True, verify=verify)
        if per == "call":
            if records:
                summary.rollouts += 1
                yield _call_columns(records, status)
        else:
            traj = trajectory_from_records(
                rollout_id, records, include_untooled=include_untooled, status=status
            )
            if traj.calls or traj.apart:
                summary.rollouts += 1
                yield _trajectory_columns([traj])


def export_store(
    source_url: str,
    out: str,
    *,
    format: Literal["parquet", "jsonl"] = "parquet",
    per: Literal["call", "trajectory"] = "call",
    verify: bool = True,
    include_untooled: bool = False,
    include_open: bool = False,
    include_poisoned: bool = False,
) -> ExportSummary:
    """Write the store at `source_url` to the file `out`; say what was written and left out.

    Open and poisoned rollouts are left out unless `include_open` / `include_poisoned`.
    Raises `DigestMismatch` (and writes nothing) when a record does not verify; ``verify=False``
    skips the check.
    """
    if format not in ("parquet", "jsonl"):
        raise ValueError(f"format must be 'parquet' or 'jsonl', not {format!r}")
    if per not in ("call", "trajectory"):
        raise ValueError(f"per must be 'call' or 'trajectory', not {per!r}")
    schema = CALL_SCHEMA if per == "call" else TRAJECTORY_SCHEMA
    tmp = f"{out}.{os.getpid()}.tmp"
    summary = ExportSummary()
    batches = functools.partial(
        _batches,
        per=per,
        verify=verify,
        include_untooled=include_untooled,
        include_open=include_open,
        include_poisoned=include_poisoned,
        summary=summary,
    )
    with open_store(source_url) as store:
        try:
            with open(tmp, "wb") as f:
                write = _parquet_writer(f, schema) if format == "parquet" else _jsonl_writer(f)
                with write as emit:
                    for columns in batches(store):
                        summary.rows += emit(columns, schema)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    return summary


Emit = Callable[[dict[str, Any], pa.Schema], int]


@contextlib.contextmanager
def _parquet_writer(f: IO[bytes], schema: pa.Schema) -> Iterator[Emit]:
    with pq.ParquetWriter(f, schema, compression="zstd") as writer:

        def emit(columns: dict[str, Any], schema: pa.Schema) -> int:
            table = _table(columns, schema)
            writer.write_table(table)
            return int(table.num_rows)

        yield emit


@contextlib.contextmanager
def _jsonl_writer(f: IO[bytes]) -> Iterator[Emit]:
    def emit(columns: dict[str, Any], schema: pa.Schema) -> int:
        n = 0
        for row in _jsonl_rows(columns):
            f.write(orjson.dumps(row) + b"\n")
            n += 1
        return n

    yield emit
