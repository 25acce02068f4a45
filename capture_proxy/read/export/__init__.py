"""Export a store as a table trainers take as it is: one row per call, per rollout or per segment.

    capture-proxy export sqlite:///capture.db segments.parquet --per segment
    capture-proxy export parquet:///capture traj.jsonl --per trajectory
    capture-proxy export sqlite:///capture.db - --per segment | head -1      # JSON Lines on stdout

Every row starts with its rollout's columns: `rollout_id`, the driver's outcome (`reward`,
`reward_components`, `group_id`), `state`, `poisoned`, `n_failures`, `sealed_at_ms` and
`num_turns`. Per call, a row holds the call's identity, lineage, versions, full prompt and
completion token ids, logprobs, digests, request and response. Per trajectory, a row holds the
rollout's linearized episode (`capture_proxy.read.trajectory`). Per segment, a row holds one
sequence the model saw in one pass, split as RL trainers take it: `prompt_ids` (everything before
its first generated token), `response_ids`, `response_mask` (1 on generated tokens, 0 on tool
output and template tokens inside the response) and `response_logprobs`. docs/trajectories.md
lists every column; `capture_proxy.read.trainers` gives trainers their own shapes.

Like the reader's trainer-facing reads, the export leaves out open rollouts (not sealed yet),
poisoned ones (a call answered but not staged) and ones that do not verify (a record's digest,
the event log's chain or accounting, the header against the chain:
`capture_proxy.read.integrity`) unless asked for them (``include_open``, ``include_poisoned``,
``verify=False``), and says which it left out and why (`ExportSummary.left_out`,
`ExportSummary.unverified`); it can be limited to named rollouts, groups, rollouts sealed since
a time, and anchored to the chain heads a driver kept (``expected_heads``). An incremental
export passes an `ExportCursor` (``cursor``): it skips the rollouts the cursor took and adds the
ones it exported, so every sealed rollout is exported exactly once over the passes. Rows come
oldest rollout first, the rollouts of one group together. A file appears only when complete: it
is written to a temporary file and renamed. The images the rows refer to go, once
each, to a sibling Parquet file keyed by sha256 (`attachments_path`).

A Parquet export carries file-level metadata (`read_export_metadata`): the export format version,
the capture-proxy version, the store URL, and the tokenizer fingerprints of the exported calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Literal

from ...schemas.records import RolloutState
from ...sinks.base import Progress
from ..cursor import ExportCursor
from ..reader import Store, open_store
from ..selection import SelectedRollout
from ._columns import ATTACHMENT_SCHEMA, CALL_SCHEMA, SCHEMAS, SEGMENT_SCHEMA, TRAJECTORY_SCHEMA
from ._columns import rows_of as _rows_of
from ._write import AttachmentFile, JsonLinesOut, ParquetOut, RowsOut, atomic_file

__all__ = [
    "ATTACHMENT_SCHEMA",
    "CALL_SCHEMA",
    "EXPORT_FORMAT_VERSION",
    "SEGMENT_SCHEMA",
    "TRAJECTORY_SCHEMA",
    "ExportCursor",
    "ExportSummary",
    "attachments_path",
    "export_format",
    "export_store",
    "read_export_metadata",
]

#: The version of the exported tables' layout (columns, their types and meaning), in every
#: Parquet export's metadata. Bumped when a column changes type or meaning; new columns do not.
#: 2 (2026-12-04): `reward` is the sum of an object reward's components (was null), and
#: `reward_components` a list of ``{name, value}`` (was a map, which HF `datasets` cannot load).
EXPORT_FORMAT_VERSION = 2
#: The prefix of the file-level metadata keys of a Parquet export.
METADATA_PREFIX = "capture_proxy."
#: The default size of a row group, in Arrow's in-memory bytes.
ROW_GROUP_BYTES = 128 << 20

Format = Literal["parquet", "jsonl"]
Per = Literal["call", "trajectory", "segment"]


def export_format(out: str, format: str | None = None) -> Format:
    """The format to write `out` in: `format` when given, else JSON Lines for ``-`` (stdout) and
    names ending in ``.jsonl`` or ``.ndjson``, Parquet otherwise.

    Raises ValueError for an unknown format, and for Parquet to stdout (a Parquet file ends with
    its footer, written once everything else is: it needs a file).
    """
    if format is None:
        jsonl = out == "-" or out.endswith((".jsonl", ".ndjson"))
        return "jsonl" if jsonl else "parquet"
    if format not in ("parquet", "jsonl"):
        raise ValueError(f"format must be 'parquet' or 'jsonl', not {format!r}")
    if format == "parquet" and out == "-":
        raise ValueError(
            "Parquet cannot be written to stdout (its footer is written last, into a file): "
            "name an output file, or write JSON Lines to stdout (--format jsonl, or no --format)"
        )
    return format  # type: ignore[return-value]


def attachments_path(out: str) -> str:
    """Where the attachments of the export at `out` go: ``traj.parquet`` ->
    ``traj.attachments.parquet`` (named after the export, so two exports in one folder do not
    overwrite each other's images)."""
    stem, ext = os.path.splitext(out)
    return f"{stem if ext in ('.parquet', '.jsonl', '.ndjson') else out}.attachments.parquet"


def _capture_proxy_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("capture-proxy")
    except PackageNotFoundError:  # running from a source tree that was not installed
        return "unknown"


def read_export_metadata(path: str) -> dict[str, str]:
    """The file-level metadata of a Parquet export (or of its attachments file), without the
    key prefix: ``export_format_version``, ``capture_proxy_version``, ``store``, ``per`` and
    ``tokenizer_fingerprints`` (a JSON list: the distinct fingerprints of the exported calls)."""
    import pyarrow.parquet as pq

    raw = pq.read_metadata(path).metadata or {}
    prefix = METADATA_PREFIX.encode()
    return {k[len(prefix) :].decode(): v.decode() for k, v in raw.items() if k.startswith(prefix)}


@dataclasses.dataclass(slots=True)
class ExportSummary:
    """What `export_store` wrote, and which rollouts it left out and why."""

    #: Rows written.
    rows: int = 0
    #: Rollouts exported.
    rollouts: int = 0
    #: Rollout ids left out, by why: ``"open"`` (not sealed; ``include_open``),
    #: ``"poisoned"`` (``include_poisoned``; a rollout both open and poisoned counts here) and
    #: ``"unverified"`` (``verify=False``; `unverified` says why). Only rollouts with staged
    #: calls are listed as open or poisoned (the others have nothing to export). An anchored
    #: export (``expected_heads``) adds ``"missing"`` (anchored, not in the store) and
    #: ``"unanchored"`` (in the store, not anchored: not exported).
    left_out: dict[str, list[str]] = dataclasses.field(
        default_factory=lambda: {"open": [], "poisoned": [], "unverified": []}
    )
    #: Why each rollout left out as unverified was: rollout id -> its problems.
    unverified: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    #: Distinct attachments written to `attachments_out`.
    attachments: int = 0
    #: The attachments file, or None when no row refers to one (or the export went to stdout).
    attachments_out: str | None = None
    #: The latest seal time (ms since the epoch) of the exported rollouts, by the clocks of the
    #: proxies that sealed them. As `since` for a next export it misses a rollout sealed earlier
    #: that became visible only after this export read the store: read incrementally with a
    #: `cursor` instead.
    last_sealed_at_ms: int | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "rows": self.rows,
            "rollouts": self.rollouts,
            "left_out": self.left_out,
            "unverified": self.unverified,
            "attachments": self.attachments,
            "attachments_out": self.attachments_out,
            "last_sealed_at_ms": self.last_sealed_at_ms,
        }


def export_store(
    source: str | Store,
    out: str,
    *,
    format: Format | None = None,
    per: Per = "call",
    verify: bool = True,
    include_untooled: bool = False,
    include_open: bool = False,
    include_poisoned: bool = False,
    rollouts: Iterable[str] | None = None,
    group: str | Iterable[str] | None = None,
    since: int | datetime | None = None,
    cursor: ExportCursor | None = None,
    expected_heads: Mapping[str, str] | None = None,
    attachments: bool = True,
    row_group_bytes: int = ROW_GROUP_BYTES,
    progress: Progress | None = None,
) -> ExportSummary:
    """Write the store (a URL, or a `Store` already open) to `out`; say what was written and
    left out. ``out="-"`` writes JSON Lines to stdout.

    `format` defaults from `out` (`export_format`). `per` is ``"call"``, ``"trajectory"`` or
    ``"segment"``. Open and poisoned rollouts are left out unless `include_open` /
    `include_poisoned`; `rollouts` (ids), `group` (one group id or several) and `since` (a
    `datetime` or ms since the epoch: rollouts whose seal time, by the sealing proxy's clock, is
    at or after it) narrow the export further. `cursor` (an `ExportCursor`) leaves out the
    rollouts it took, and once the export is complete takes the sealed rollouts exported (a
    failed export leaves it unchanged): passed to every export of an incremental loop, it exports
    each sealed rollout exactly once, however late it became visible (a rollout left out as
    unverified is not taken). `expected_heads` (rollout id -> the ``chain_head`` its driver
    kept, `capture_proxy.read.anchors.load_heads`) exports only those rollouts, each only if
    its stored chain ends there. A rollout that does not verify is left out and said in
    `ExportSummary.left_out` and `ExportSummary.unverified` (``verify=False`` exports it as
    it is). The attachments the rows refer to are written to `attachments_path(out)` unless
    ``attachments=False`` (never for stdout). Raises KeyError for a rollout id the store does
    not hold; ValueError for a bad `format` or `per`. `progress`, if given, is called with
    ``(rollouts written, rollouts selected)`` as the export goes.
    """
    fmt = export_format(out, format)
    if per not in SCHEMAS:
        raise ValueError(f"per must be 'call', 'trajectory' or 'segment', not {per!r}")
    schema = SCHEMAS[per]
    store = open_store(source) if isinstance(source, str) else source
    summary = ExportSummary()
    skipped: dict[str, list[str]] = {"open": [], "poisoned": []}
    summary.unverified = {}
    try:
        selected = store._select(
            include_open=include_open,
            include_poisoned=include_poisoned,
            since=since,
            group=group,
            rollouts=rollouts,
            skipped=skipped,
            cursor=cursor,
            expected_heads=expected_heads,
            unverified=summary.unverified,
        )
        # Rollouts without any staged call have nothing to export, left out or not.
        # Rollouts left out as unverified while selecting (a ledger too damaged to read) are
        # listed whatever they hold.
        summary.left_out = {
            why: [
                r
                for r in ids
                if why in ("missing", "unanchored", "unverified") or store.source.summaries(r)
            ]
            for why, ids in skipped.items()
        }
        summary.left_out.setdefault("unverified", [])
        metadata = {
            "export_format_version": str(EXPORT_FORMAT_VERSION),
            "capture_proxy_version": _capture_proxy_version(),
            "store": store.url,
            "per": per,
        }
        run = _Run(
            store,
            per,
            selected,
            verify,
            include_untooled,
            summary,
            metadata,
            expected_heads,
            progress,
        )
        if out == "-":
            run.write(JsonLinesOut(sys.stdout.buffer), None)
            if cursor is not None:
                cursor.add(run.taken)
            return summary
        side = AttachmentFile(f"{attachments_path(out)}.{os.getpid()}.tmp") if attachments else None
        try:
            with atomic_file(out) as f:
                rows_out: RowsOut = (
                    ParquetOut(f, schema, row_group_bytes) if fmt == "parquet" else JsonLinesOut(f)
                )
                try:
                    run.write(rows_out, side)
                except BaseException:
                    rows_out.abort()
                    raise
                has_side = side is not None and side.close(run.file_metadata())
        except BaseException:
            if side is not None:
                side.discard()
            raise
        _place_attachments(side if has_side else None, out, summary)
        if cursor is not None:
            cursor.add(run.taken)
        return summary
    finally:
        if isinstance(source, str):
            store.close()


def _place_attachments(side: AttachmentFile | None, out: str, s: ExportSummary) -> None:
    final = attachments_path(out)
    if side is not None:
        os.replace(side.path, final)
        s.attachments, s.attachments_out = len(side.seen), final
    else:
        # The export at `out` was replaced: an attachments file from an earlier export to the
        # same name would describe rows that are gone.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(final)


@dataclasses.dataclass(slots=True)
class _Run:
    store: Store
    per: Per
    selected: list[SelectedRollout]
    verify: bool
    include_untooled: bool
    summary: ExportSummary
    metadata: dict[str, str]
    expected_heads: Mapping[str, str] | None = None
    progress: Progress | None = None
    #: The sealed rollouts written (or with nothing to write): what a cursor takes.
    taken: list[str] = dataclasses.field(default_factory=list)

    def write(self, rows_out: RowsOut, side: AttachmentFile | None) -> None:
        """Every selected rollout's rows, one rollout in memory at a time."""
        fingerprints: dict[str, None] = {}
        total = len(self.selected)
        for done, sel in enumerate(self.selected):
            if self.progress is not None:
                self.progress(done, total)
            got = self.store._take(
                sel,
                self.include_untooled,
                self.verify,
                self.expected_heads,
                self.summary.left_out,
                self.summary.unverified,
            )
            if got is None:
                continue
            records, traj = got
            if sel.status.state is RolloutState.SEALED:
                self.taken.append(sel.rollout_id)
            if not (traj.calls or traj.apart):
                continue
            rows = _rows_of(self.per, sel, records, traj)
            self.summary.rows += rows_out.emit(rows.columns)
            self.summary.rollouts += 1
            if sel.sealed_at_ms is not None:
                last = self.summary.last_sealed_at_ms
                self.summary.last_sealed_at_ms = max(last or 0, sel.sealed_at_ms)
            fingerprints.update(dict.fromkeys(r.tokenizer_fingerprint for r in rows.records))
            if side is not None:
                side.add(rows.attachments())
        self.metadata["tokenizer_fingerprints"] = json.dumps([f for f in fingerprints if f])
        rows_out.finish(self.file_metadata())
        if self.progress is not None:
            self.progress(total, total)

    def file_metadata(self) -> dict[str, str]:
        return {METADATA_PREFIX + k: v for k, v in self.metadata.items()}
