"""The offline store commands: `export_store` (a flat training table, read back here with DuckDB
and pyarrow) and `compact_store` (fewer, larger files; every record, digest, coordinate, ledger
entry and trajectory identical before and after, even for a reader or writer open meanwhile).
"""

from __future__ import annotations

import json
import os
import threading
import time
from array import array
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq
import pytest

from capture_proxy.cli import main
from capture_proxy.read.export import export_store
from capture_proxy.read.reader import Store, open_store
from capture_proxy.schemas.digest import seal_record
from capture_proxy.schemas.records import (
    CallStatus,
    LedgerEntry,
    RolloutInfo,
    RolloutState,
    StagedCallRecord,
)
from capture_proxy.sinks.base import StagingSink, StoreError
from capture_proxy.sinks.parquet import (
    ParquetSink,
    ParquetSource,
    compact_store,
    maintenance_lease,
)
from capture_proxy.sinks.sqlite import SQLiteSink
from tests.support.aging import age_units
from tests.support.sealing import put_sealed
from tests.support.sink_factories import ParquetCase, Session, image


async def fill(sink: StagingSink, *, turns: int = 4) -> list[StagedCallRecord]:
    """Two agent sessions (one with an image and a title call, one that drifts), a failure."""
    title = seal_record(
        StagedCallRecord(
            rollout_id="ra",
            call_id="ra-title",
            seq=0,
            model="tiny-qwen",
            finish_reason="stop",
            request={"model": "tiny-qwen", "messages": [{"role": "user", "content": "Title?"}]},
            response={"role": "assistant", "content": "A title"},
            prompt_token_ids=array("i", [5, 6, 7]),
            completion_token_ids=array("i", [8]),
            completion_logprobs=array("f", [-0.5]),
        )
    )
    assert (await sink.stage(title)).status is CallStatus.STAGED
    staged = [title]
    a, b = Session("ra", image=image("ra")), Session("rb")
    a.seq = 1  # after the title call
    for turn in range(turns):
        for s in (a, b):
            r, atts = s.next(drift_at=20 if (s is b and turn == 2) else None)
            res = await (sink.stage(r, attachments=atts) if atts else sink.stage(r))
            assert res.status is CallStatus.STAGED
            staged.append(r)
    await sink.record_failure(
        LedgerEntry("rb", "rb-x", 50, CallStatus.UPSTREAM_ERROR, "upstream_500", "boom", 500, 9)
    )
    return staged


async def seal(sink: StagingSink, *rollout_ids: str) -> None:
    """Seal as the proxy does: the header, then the seal event."""
    for rollout_id in rollout_ids:
        await put_sealed(sink, RolloutInfo(rollout_id, RolloutState.SEALED, False, 1, 2))


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture(params=["parquet", "sqlite"])
async def store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[str, list[StagedCallRecord]]:
    if request.param == "parquet":
        url = f"parquet:///{tmp_path / 'ds'}"
        sink: StagingSink = ParquetSink(str(tmp_path / "ds"))
    else:
        url = f"sqlite:///{tmp_path / 'capture.db'}"
        sink = SQLiteSink(str(tmp_path / "capture.db"))
    staged = await fill(sink)
    await seal(sink, "ra", "rb")
    await sink.close()
    return url, staged


# -- export ---------------------------------------------------------------------------------------


def _f32(values: list[float]) -> bytes:
    return array("f", values).tobytes()


async def test_per_call_parquet_read_by_pyarrow_and_duckdb(
    store: tuple[str, list[StagedCallRecord]], tmp_path: Path
) -> None:
    url, staged = store
    out = tmp_path / "calls.parquet"
    assert export_store(url, str(out), format="parquet", per="call").rows == len(staged)
    table = pq.read_table(out)
    assert table.schema.field("prompt_token_ids").type.value_type == "int32"
    assert table.schema.field("completion_logprobs").type.value_type == "float"
    rows = {r["call_id"]: r for r in table.to_pylist()}
    assert set(rows) == {r.call_id for r in staged}
    for r in staged:
        row = rows[r.call_id]
        assert (row["rollout_id"], row["seq"], row["parent_call_id"]) == (
            r.rollout_id,
            r.seq,
            r.parent_call_id,
        )
        assert row["prompt_token_ids"] == r.prompt_token_ids.tolist()
        assert row["completion_token_ids"] == r.completion_token_ids.tolist()
        assert _f32(row["completion_logprobs"]) == r.completion_logprobs.tobytes()
        assert row["digest"] == r.digest
        assert orjson.loads(row["request"]) == r.request
        assert orjson.loads(row["response"]) == r.response
    got = duckdb.execute(
        "SELECT call_id, prompt_token_ids, completion_logprobs, weight_version, finish_reason "
        f"FROM read_parquet('{out}') ORDER BY rollout_id, seq"
    ).fetchall()
    want = sorted(staged, key=lambda r: (r.rollout_id, r.seq))
    assert [g[0] for g in got] == [r.call_id for r in want]
    for g, r in zip(got, want, strict=True):
        assert g[1] == r.prompt_token_ids.tolist()
        assert _f32(g[2]) == r.completion_logprobs.tobytes()
        assert (g[3], g[4]) == (r.weight_version, r.finish_reason)


async def test_per_call_jsonl(store: tuple[str, list[StagedCallRecord]], tmp_path: Path) -> None:
    url, staged = store
    out = tmp_path / "calls.jsonl"
    assert export_store(url, str(out), format="jsonl", per="call").rows == len(staged)
    lines = [json.loads(x) for x in out.read_bytes().splitlines()]
    by_id = {r.call_id: r for r in staged}
    for line in lines:
        r = by_id[line["call_id"]]
        assert line["completion_token_ids"] == r.completion_token_ids.tolist()
        assert _f32(line["completion_logprobs"]) == r.completion_logprobs.tobytes()
        # JSON values are nested objects, not JSON text inside JSON.
        assert (line["request"], line["response"]) == (r.request, r.response)
        assert line["extras"] == r.extras
    ((n, tokens),) = duckdb.execute(
        "SELECT count(*), sum(len(prompt_token_ids)) "
        f"FROM read_json('{out}', format='newline_delimited')"
    ).fetchall()
    assert (n, tokens) == (len(staged), sum(len(r.prompt_token_ids) for r in staged))
    # pyarrow's JSON reader needs one type per field: a message's content is a string in one
    # call and a list of parts in another, so it reads the calls' columns without `request`.
    schema = pa.schema([("call_id", pa.string()), ("prompt_token_ids", pa.list_(pa.int32()))])
    opts = pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    assert pajson.read_json(out, parse_options=opts).num_rows == len(staged)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
async def test_per_trajectory(
    store: tuple[str, list[StagedCallRecord]], tmp_path: Path, fmt: str
) -> None:
    url, _ = store
    out = tmp_path / f"traj.{fmt}"
    done = export_store(url, str(out), format=fmt, per="trajectory")  # type: ignore[arg-type]
    assert (done.rows, done.rollouts) == (2, 2)
    if fmt == "parquet":
        rows = pq.read_table(out).to_pylist()
        q = f"read_parquet('{out}')"
    else:
        rows = [json.loads(x) for x in out.read_bytes().splitlines()]
        q = f"read_json('{out}', format='newline_delimited')"
    with open_store(url) as s:
        for row in rows:
            traj = s.trajectory(row["rollout_id"])
            assert row["token_ids"] == traj.token_ids.tolist()
            assert row["loss_mask"] == traj.loss_mask.tolist()
            assert _f32(row["logprobs"]) == traj.logprobs.tobytes()
            assert row["call_index"] == traj.call_index.tolist()
            assert row["weight_versions"] == traj.weight_versions.tolist()
            assert (row["n_segments"], row["n_drift"]) == (len(traj.segments), len(traj.drift))
            assert row["calls"] == traj.calls
            assert row["apart"] == traj.apart
            # rb's upstream_error is a failure, not poison.
            assert (row["state"], row["poisoned"]) == ("sealed", False)
            assert row["n_failures"] == (1 if row["rollout_id"] == "rb" else 0)
            assert row["n_breaks"] == len(traj.breaks)
            assert [b["reason"] for b in row["breaks"]] == [b.reason for b in traj.breaks]
    summary = dict(
        duckdb.execute(f"SELECT rollout_id, n_drift FROM {q} ORDER BY rollout_id").fetchall()
    )
    assert summary == {"ra": 0, "rb": 1}
    apart = duckdb.execute(f"SELECT apart FROM {q} WHERE rollout_id = 'ra'").fetchall()
    assert apart == [(["ra-title"],)]


async def test_a_tampered_rollout_is_left_out_of_the_export_with_its_reason(
    tmp_path: Path,
) -> None:
    case = ParquetCase(tmp_path)
    staged = await fill(case.sink, turns=2)
    await seal(case.sink, "ra", "rb")
    await case.sink.close()
    case.tamper(staged[-1].call_id, "tokens")
    out = tmp_path / "out.parquet"
    summary = export_store(f"parquet:///{case.location}", str(out), format="parquet", per="call")
    assert summary.left_out["unverified"] == ["rb"]
    (problem,) = summary.unverified["rb"]
    assert problem.startswith(f"{staged[-1].call_id}: digest mismatch")
    assert set(pq.read_table(out)["rollout_id"].to_pylist()) == {"ra"}
    with pytest.raises(ValueError, match="format"):
        export_store(f"parquet:///{case.location}", str(out), format="csv")  # type: ignore[arg-type]


async def test_orphans_are_not_exported(tmp_path: Path) -> None:
    sink = ParquetSink(str(tmp_path / "ds"))
    s = Session("o")
    keep, drop = s.next()[0], s.next()[0]
    for r in (keep, drop):
        await sink.stage(r)
    await sink.mark_orphaned(drop.call_id, "stage_timeout")
    await sink.close()
    out = tmp_path / "o.jsonl"
    done = export_store(
        str(tmp_path / "ds"),
        str(out),
        format="jsonl",
        per="call",
        include_open=True,
        include_poisoned=True,
    )
    assert done.rows == 1
    row = json.loads(out.read_bytes())
    assert row["call_id"] == keep.call_id
    assert (row["poisoned"], row["state"], row["n_failures"]) == (True, "open", 1)


# -- compaction -----------------------------------------------------------------------------------


def snapshot(ds: Path) -> dict[str, Any]:
    """Everything a reader can observe, to compare before and after compaction."""
    source = ParquetSource(str(ds))
    s = Store(source)
    keys = sorted(source.all_keys())
    rollouts = source.rollouts()
    return {
        "keys": keys,
        "records": [_logical(r) for r in s.fetch(keys)],
        "coords": source.coords(keys),
        "rollouts": rollouts,
        "info": [source.rollout_info(r) for r in rollouts],
        "failures": [source.failures(r) for r in rollouts],
        "orphaned": source.orphaned(),
        "trajectories": [
            s.trajectory(r, include_open=True, include_poisoned=True).to_dict() for r in rollouts
        ],
        "problems": s.problems(),
    }


def _logical(r: StagedCallRecord) -> tuple[Any, ...]:
    return (
        r.call_id,
        r.digest,
        r.extras_digest,
        r.request,
        r.response,
        r.prompt_token_ids.tobytes(),
        r.completion_token_ids.tobytes(),
        r.completion_logprobs.tobytes(),
        [(a.sha256, a.data) for a in r.attachments],
    )


def live_markers(ds: Path) -> list[dict[str, Any]]:
    ms = [json.loads(p.read_bytes()) for p in sorted((ds / "_commits").glob("*.json"))]
    retired = {u for m in ms for u in m["retires"]}
    return [m for m in ms if m["unit"] not in retired]


async def staged_dataset(ds: Path) -> ParquetSink:
    sink = ParquetSink(str(ds))
    await sink.put_rollout(RolloutInfo("ra", RolloutState.OPEN, False, 5, None, {"task": 1}))
    await fill(sink)
    await put_sealed(sink, RolloutInfo("ra", RolloutState.SEALED, False, 5, 6, {"task": 1}))
    last = Session("orph")
    o, _ = last.next()
    await sink.stage(o)
    await sink.mark_orphaned(o.call_id, "stage_timeout")
    return sink


async def test_compaction_changes_files_not_data(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    await (await staged_dataset(ds)).close()
    before = snapshot(ds)
    n_units = len(live_markers(ds))
    stats = compact_store(f"parquet:///{ds}")
    assert (stats.units_before, stats.units_after) == (n_units, 1)
    assert stats.files_after == 4 < stats.files_before
    assert stats.bytes_after < stats.bytes_before
    assert stats.records == len(before["keys"])
    assert stats.deleted_files == 0  # retired files stay for readers until the grace period
    assert snapshot(ds) == before
    assert before["problems"] == []
    # Attachments stay stored once; a second run finds nothing to merge.
    (merged,) = live_markers(ds)
    assert pq.read_metadata(ds / merged["files"]["attachments"]).num_rows == 1
    again = compact_store(str(ds))
    assert (again.units_before, again.units_after) == (1, 1)
    assert snapshot(ds) == before


async def test_compaction_under_an_open_writer_and_reader(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    sink = await staged_dataset(ds)
    reader = ParquetSource(str(ds))
    before = [_logical(r) for r in reader.calls("ra")]
    n_keys = len(list(reader.all_keys()))
    compact_store(str(ds), grace_s=0)  # retired files deleted at once: the reader must re-list
    assert [_logical(r) for r in reader.calls("ra")] == before
    # The writer, open all along, extends a session whose parent now lives in the merged unit.
    parent = reader.calls("rb")[-1]
    nxt, _ = Session.resume(parent, prefix="after").next()
    res = await sink.stage(nxt)
    assert res.coords is not None
    assert res.coords.prev_len == parent.cum_len
    assert (await sink.stage(nxt)).reason == "duplicate_key"
    await sink.close()
    # A merge is merged again once it is older than gc's window (before, its blobs would look
    # young for ever); then the first generation stays retired even once the unit that retired
    # it is itself gone.
    assert compact_store(str(ds), grace_s=0).units_after == 2
    age_units(ds, 2 * 3600)
    compact_store(str(ds), grace_s=0)
    compact_store(str(ds), grace_s=0)
    assert len(list((ds / "_commits").glob("*.json"))) == 1
    after = snapshot(ds)
    assert after["problems"] == []
    assert nxt.call_id in after["keys"]
    assert len(after["keys"]) == len(set(after["keys"])) == n_keys + 1


async def test_concurrent_reader_never_sees_gaps_or_duplicates(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    sink = await staged_dataset(ds)
    await sink.close()
    want = snapshot(ds)["keys"]
    seen: list[list[str]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        source = ParquetSource(str(ds))
        try:
            for _ in range(500):  # bounded; stops soon after compaction finishes
                seen.append(sorted(source.all_keys()))
                seen.append(sorted(r.call_id for rid in ("ra", "rb") for r in source.calls(rid)))
                if done.is_set() and len(seen) > 10:
                    break
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=read)
    t.start()
    for _ in range(3):
        compact_store(str(ds), grace_s=0)
    done.set()
    t.join(timeout=30)
    assert not t.is_alive()
    assert errors == []
    assert seen
    assert all(keys == want for keys in seen[::2])
    assert all(len(keys) == len(want) - 1 for keys in seen[1::2])  # all but the orphan


async def test_cleanup_after_grace_and_of_leftovers(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    await (await staged_dataset(ds)).close()
    files_before = sorted(p for p in ds.rglob("*.parquet"))
    compact_store(str(ds))
    assert all(p.exists() for p in files_before)  # within the grace period
    # Leftovers of a crashed commit: an unreferenced data file and a temporary file.
    old = time.time() - 3600
    leftover = ds / "calls" / "00000000000000000001-crashed00000.parquet"
    leftover.write_bytes(b"PAR1")
    tmp = ds / "blobs" / "x.parquet.abcd.tmp"
    tmp.write_bytes(b"half")
    young = ds / "ledger" / "99999999999999999999-inflight0000.parquet"
    young.write_bytes(b"PAR1")  # a commit in progress right now: must survive
    for p in (leftover, tmp):
        os.utime(p, (old, old))
    stats = compact_store(str(ds), grace_s=60)
    assert stats.deleted_files == 2
    assert not leftover.exists()  # 1 hour old, unreferenced
    assert not tmp.exists()
    assert young.exists()
    assert all(p.exists() for p in files_before)  # retired a moment ago: still in grace
    before = snapshot(ds)
    stats = compact_store(str(ds), grace_s=0)
    assert stats.deleted_files >= len(files_before)
    assert not any(p.exists() for p in files_before)
    assert snapshot(ds) == before


async def test_compact_refuses_what_it_cannot_compact(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="is a SQLite store"):
        compact_store(f"sqlite:///{tmp_path / 'x.db'}")
    with pytest.raises(StoreError, match="no capture-proxy Parquet dataset"):
        compact_store(str(tmp_path / "missing"))
    ds = tmp_path / "ds"
    await (await staged_dataset(ds)).close()
    with (
        maintenance_lease(str(ds), "compact"),  # another one is running
        pytest.raises(StoreError, match=r"another maintenance run holds .*: compact by "),
    ):
        compact_store(str(ds))
    assert len(live_markers(ds)) > 1  # nothing was merged


async def test_a_tampered_rollout_is_left_out_of_a_stdout_export_with_status_1(
    tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    # On stdout the rows stream: the exit status and stderr are what tell the consumer the
    # export is not whole.
    case = ParquetCase(tmp_path)
    staged = await fill(case.sink, turns=2)
    await seal(case.sink, "ra", "rb")
    await case.sink.close()
    case.tamper(staged[-1].call_id, "tokens")
    url = f"parquet:///{case.location}"
    assert main(["export", url, "-", "--per", "segment"]) == 1
    out, err = capsysbinary.readouterr()
    assert [json.loads(line)["rollout_id"] for line in out.splitlines()] == ["ra"]
    assert b"capture-proxy export: left out 1 rollout(s): 1 that do not verify" in err
    assert b"capture-proxy export: rb does not verify: " + staged[-1].call_id.encode() in err
    with pytest.raises(ValueError, match="per must be 'call', 'trajectory' or 'segment'"):
        export_store(url, str(tmp_path / "x.parquet"), per="turn")  # type: ignore[arg-type]
