"""The exported tables: their Arrow schemas, and the columns of one rollout's rows.

Every row starts with its rollout's columns (`ROLLOUT_FIELDS`: id, outcome, state, seal time,
turns); then come the call's, the trajectory's or the segment's own. Columns are built as plain
values per row: token data as `array.array` (turned into Arrow buffers without a Python object
per token) and JSON values as Python objects, written as JSON text in Parquet and as nested
objects in JSON Lines.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Iterable
from typing import Any

import orjson
import pyarrow as pa

from ...schemas.records import Attachment, StagedCallRecord
from ..selection import SelectedRollout
from ..trainers._common import scalar_reward
from ..trajectory import Segment, Trajectory

__all__ = [
    "ATTACHMENT_SCHEMA",
    "CALL_SCHEMA",
    "JSON_COLUMNS",
    "SCHEMAS",
    "SEGMENT_SCHEMA",
    "TRAJECTORY_SCHEMA",
    "Rows",
    "rows_of",
]

#: Columns of every row: the rollout it belongs to and what the driver reported about it.
ROLLOUT_FIELDS = [
    ("rollout_id", pa.string()),
    ("group_id", pa.string()),
    ("reward", pa.float64()),
    # A list of {name, value}, not a map: HF `datasets` (and so verl's RLHFDataset) cannot load
    # a Parquet map column through `load_dataset("parquet")`.
    ("reward_components", pa.list_(pa.struct([("name", pa.string()), ("value", pa.float64())]))),
    ("state", pa.string()),
    ("poisoned", pa.bool_()),
    ("n_failures", pa.int32()),
    ("sealed_at_ms", pa.int64()),
    ("num_turns", pa.int32()),
]

#: Columns whose values are JSON: text in Parquet (read it with ``json.loads`` or DuckDB's
#: ``json`` functions), nested objects in JSON Lines.
JSON_COLUMNS = frozenset({"sampling", "request", "response", "extras"})

_ids = pa.list_(pa.int32())
_strings = pa.list_(pa.string())
#: A ``media_spans`` entry of vLLM (a JSON object) and where it sits in the row: the span's
#: positions count from the call's prompt, which starts at `offset` in the row's token ids.
_MEDIA_SPAN = pa.struct([("call_id", pa.string()), ("offset", pa.int64()), ("span", pa.string())])

CALL_SCHEMA = pa.schema(
    [
        *ROLLOUT_FIELDS,
        ("call_id", pa.string()),
        ("seq", pa.int64()),
        ("in_trajectory", pa.bool_()),
        ("parent_call_id", pa.string()),
        ("retry_of", pa.string()),
        ("weight_version", pa.int64()),
        ("engine_weight_version", pa.string()),
        ("model", pa.string()),
        ("upstream_version", pa.string()),
        ("tokenizer_fingerprint", pa.string()),
        ("finish_reason", pa.string()),
        ("created_at_ms", pa.int64()),
        ("prompt_token_ids", _ids),
        ("completion_token_ids", _ids),
        ("completion_logprobs", pa.list_(pa.float32())),
        ("digest", pa.string()),
        ("extras_digest", pa.string()),
        ("sampling", pa.string()),
        ("request", pa.string()),
        ("response", pa.string()),
        ("extras", pa.string()),
        ("attachment_shas", _strings),
        ("attachment_media_types", _strings),
    ]
)

_SEGMENT = pa.struct([("start", pa.int64()), ("end", pa.int64()), ("call_ids", _strings)])
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
_BRIDGE = pa.struct([("start", pa.int64()), ("end", pa.int64()), ("reason", pa.string())])
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
        *ROLLOUT_FIELDS,
        ("finish_reason", pa.string()),
        ("token_ids", _ids),
        ("loss_mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float32())),
        ("call_index", pa.list_(pa.int32())),
        ("weight_versions", pa.list_(pa.int64())),
        ("engine_weight_versions", _strings),
        ("n_segments", pa.int32()),
        ("n_drift", pa.int32()),
        ("n_breaks", pa.int32()),
        ("segments", pa.list_(_SEGMENT)),
        ("breaks", pa.list_(_BREAK)),
        ("drift", pa.list_(_DRIFT)),
        ("not_staged", pa.list_(_NOT_STAGED)),
        ("calls", _strings),
        ("apart", _strings),
        ("retries_skipped", _strings),
        ("attachment_shas", _strings),
        ("attachment_media_types", _strings),
        ("media_spans", pa.list_(_MEDIA_SPAN)),
        ("bridge_spans", pa.list_(_BRIDGE)),
    ]
)

SEGMENT_SCHEMA = pa.schema(
    [
        *ROLLOUT_FIELDS,
        ("segment_index", pa.int32()),
        ("n_segments", pa.int32()),
        ("break_reason", pa.string()),
        ("call_ids", _strings),
        ("finish_reason", pa.string()),
        ("prompt_ids", _ids),
        ("response_ids", _ids),
        ("response_mask", pa.list_(pa.int8())),
        ("response_logprobs", pa.list_(pa.float32())),
        ("response_weight_versions", pa.list_(pa.int64())),
        ("response_engine_weight_versions", _strings),
        ("attachment_shas", _strings),
        ("attachment_media_types", _strings),
        ("media_spans", pa.list_(_MEDIA_SPAN)),
    ]
)

SCHEMAS = {"call": CALL_SCHEMA, "trajectory": TRAJECTORY_SCHEMA, "segment": SEGMENT_SCHEMA}

#: The images (and other attachments) the exported rows refer to, one row per sha256.
ATTACHMENT_SCHEMA = pa.schema(
    [
        ("sha256", pa.string()),
        ("media_type", pa.string()),
        ("size", pa.int64()),
        ("data", pa.binary()),
    ]
)


@dataclasses.dataclass(slots=True)
class Rows:
    """One rollout's rows as columns, and what they refer to."""

    columns: dict[str, list[Any]]
    #: The records the rows were built from (their attachments and tokenizers are exported).
    records: list[StagedCallRecord]

    def attachments(self) -> Iterable[Attachment]:
        for record in self.records:
            yield from record.attachments


def _rollout_columns(sel: SelectedRollout, traj: Trajectory, n: int) -> dict[str, list[Any]]:
    components = traj.reward_components
    return {
        "rollout_id": [sel.rollout_id] * n,
        "group_id": [traj.group_id] * n,
        "reward": [_reward(traj)] * n,
        "reward_components": [
            None if components is None else [{"name": k, "value": v} for k, v in components.items()]
        ]
        * n,
        "state": [str(traj.state)] * n,
        "poisoned": [traj.poisoned] * n,
        "n_failures": [traj.n_failures] * n,
        "sealed_at_ms": [sel.sealed_at_ms] * n,
        "num_turns": [len(traj.calls)] * n,
    }


def _reward(traj: Trajectory) -> float | None:
    """The rollout's one number (`capture_proxy.read.trainers.scalar_reward`: an object reward
    is the sum of its components), or None when it has no reward."""
    if traj.reward is None and traj.reward_components is None:
        return None
    return scalar_reward(traj)


def _unique(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def _media_types(records: Iterable[StagedCallRecord]) -> list[str]:
    """The media type of each of `_unique`'s attachments, as the call that first referred to it
    in the row sent it: the same bytes may be sent under another type by another call (each
    record binds its own), so the attachments file's `media_type` (its first use in the export)
    is not the row's."""
    types: dict[str, str] = {}
    for record in records:
        own = {a.sha256: a.media_type for a in record.attachments}
        for sha in record.attachment_refs():
            if sha not in types:
                types[sha] = own.get(sha, "")
    return list(types.values())


def _media_spans(records: Iterable[StagedCallRecord], offset: int) -> list[dict[str, Any]]:
    """The calls' vLLM ``media_spans``, each once: every later call of a segment re-reports
    the spans of the images already in its prompt, at the same positions."""
    seen: set[bytes] = set()
    out: list[dict[str, Any]] = []
    for r in records:
        spans = r.extras.get("media_spans")
        for span in spans if isinstance(spans, list) else ():
            key = orjson.dumps(span, option=orjson.OPT_SORT_KEYS)
            if key not in seen:
                seen.add(key)
                out.append({"call_id": r.call_id, "offset": offset, "span": span})
    return out


def _call_rows(
    sel: SelectedRollout, traj: Trajectory, records: list[StagedCallRecord]
) -> dict[str, list[Any]]:
    in_traj = set(traj.calls)
    return {
        **_rollout_columns(sel, traj, len(records)),
        "call_id": [r.call_id for r in records],
        "seq": [r.seq for r in records],
        "in_trajectory": [r.call_id in in_traj for r in records],
        "parent_call_id": [r.parent_call_id for r in records],
        "retry_of": [r.retry_of for r in records],
        "weight_version": [r.weight_version for r in records],
        "engine_weight_version": [r.engine_weight_version for r in records],
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
        "sampling": [r.sampling for r in records],
        "request": [r.request for r in records],
        "response": [r.response for r in records],
        "extras": [r.extras for r in records],
        "attachment_shas": [_unique(r.attachment_refs()) for r in records],
        "attachment_media_types": [_media_types([r]) for r in records],
    }


def _trajectory_row(
    sel: SelectedRollout, traj: Trajectory, by_id: dict[str, StagedCallRecord]
) -> dict[str, list[Any]]:
    segment_media = [
        span
        for s in traj.segments
        for span in _media_spans((by_id[c] for c in s.call_ids), s.start)
    ]
    return {
        **_rollout_columns(sel, traj, 1),
        "finish_reason": [by_id[traj.calls[-1]].finish_reason],
        "token_ids": [traj.token_ids],
        "loss_mask": [traj.loss_mask],
        "logprobs": [traj.logprobs],
        "call_index": [traj.call_index],
        "weight_versions": [traj.weight_versions],
        "engine_weight_versions": [traj.engine_weight_versions],
        "n_segments": [len(traj.segments)],
        "n_drift": [len(traj.drift)],
        "n_breaks": [len(traj.breaks)],
        "segments": [
            [{"start": s.start, "end": s.end, "call_ids": list(s.call_ids)} for s in traj.segments]
        ],
        "breaks": [
            [
                {"call_id": b.call_id, "position": b.position, "reason": b.reason}
                for b in traj.breaks
            ]
        ],
        "drift": [[dataclasses.asdict(d) for d in traj.drift]],
        "not_staged": [[dataclasses.asdict(n) for n in traj.not_staged]],
        "calls": [traj.calls],
        "apart": [traj.apart],
        "retries_skipped": [traj.retries_skipped],
        "attachment_shas": [_unique(a for c in traj.calls for a in by_id[c].attachment_refs())],
        "attachment_media_types": [_media_types(by_id[c] for c in traj.calls)],
        "media_spans": [segment_media],
        "bridge_spans": [
            [{"start": a, "end": b, "reason": why} for a, b, why in traj.bridge_spans]
        ],
    }


def _split(traj: Trajectory, s: Segment) -> int:
    """Where the segment's response starts: its first generated token (its end if none)."""
    first = traj.loss_mask.tobytes().find(b"\x01", s.start, s.end)
    return s.end if first < 0 else first


def _segment_rows(
    sel: SelectedRollout, traj: Trajectory, by_id: dict[str, StagedCallRecord]
) -> dict[str, list[Any]]:
    segs = traj.segments
    reasons = {b.position: b.reason for b in traj.breaks}
    cuts = [_split(traj, s) for s in segs]
    tokens, mask, lps = traj.token_ids, traj.loss_mask, traj.logprobs
    versions, engine = traj.weight_versions, traj.engine_weight_versions
    return {
        **_rollout_columns(sel, traj, len(segs)),
        "segment_index": list(range(len(segs))),
        "n_segments": [len(segs)] * len(segs),
        "break_reason": [reasons.get(s.start) if i else None for i, s in enumerate(segs)],
        "call_ids": [list(s.call_ids) for s in segs],
        "finish_reason": [by_id[s.call_ids[-1]].finish_reason for s in segs],
        "prompt_ids": [tokens[s.start : c] for s, c in zip(segs, cuts, strict=True)],
        "response_ids": [tokens[c : s.end] for s, c in zip(segs, cuts, strict=True)],
        "response_mask": [mask[c : s.end] for s, c in zip(segs, cuts, strict=True)],
        "response_logprobs": [lps[c : s.end] for s, c in zip(segs, cuts, strict=True)],
        "response_weight_versions": [versions[c : s.end] for s, c in zip(segs, cuts, strict=True)],
        "response_engine_weight_versions": [
            engine[c : s.end] for s, c in zip(segs, cuts, strict=True)
        ],
        "attachment_shas": [
            _unique(a for call in s.call_ids for a in by_id[call].attachment_refs()) for s in segs
        ],
        "attachment_media_types": [_media_types(by_id[c] for c in s.call_ids) for s in segs],
        # Every call of a segment starts at the segment's first token: offset 0.
        "media_spans": [_media_spans((by_id[c] for c in s.call_ids), 0) for s in segs],
    }


def rows_of(
    per: str, sel: SelectedRollout, records: list[StagedCallRecord], traj: Trajectory
) -> Rows:
    """The rows of one rollout, exported `per` call, trajectory or segment."""
    if per == "call":
        return Rows(_call_rows(sel, traj, records), records)
    by_id = {r.call_id: r for r in records}
    used = [by_id[c] for c in traj.calls]
    if per == "trajectory":
        return Rows(_trajectory_row(sel, traj, by_id), used)
    return Rows(_segment_rows(sel, traj, by_id), used)


# -- Arrow ----------------------------------------------------------------------------------------

_ARROW_TYPES = {"i": pa.int32(), "f": pa.float32(), "b": pa.int8(), "q": pa.int64()}
_LITTLE = array("i", [1]).tobytes()[0] == 1


def _list_array(values: list[array[Any]], typecode: str) -> pa.Array:
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


def to_table(columns: dict[str, list[Any]], schema: pa.Schema) -> pa.Table:
    """The columns as an Arrow table of `schema` (JSON values as JSON text)."""
    arrays = []
    for f in schema:
        col = columns[f.name]
        if f.name in JSON_COLUMNS:
            arrays.append(pa.array([_dumps(v) for v in col], f.type))
        elif f.name == "media_spans":
            spans = [[{**m, "span": _dumps(m["span"])} for m in row] for row in col]
            arrays.append(pa.array(spans, f.type))
        elif pa.types.is_list(f.type) and f.type.value_type in _ARROW_TYPES.values():
            code = next(c for c, t in _ARROW_TYPES.items() if t == f.type.value_type)
            arrays.append(_list_array(col, code))
        else:
            arrays.append(pa.array(col, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def json_rows(columns: dict[str, list[Any]]) -> Iterable[dict[str, Any]]:
    """The columns as one dict per row, ready for a JSON encoder: nested values stay nested."""
    names = list(columns)
    for values in zip(*columns.values(), strict=True):
        row = {
            n: (v.tolist() if isinstance(v, array) else v)
            for n, v in zip(names, values, strict=True)
        }
        yield row
