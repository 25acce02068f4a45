"""Retention for Parquet datasets: `capture-proxy gc` removes whole sealed rollouts and nothing
anything else uses, in one atomic commit, while proxies may write to the dataset (blobs and
attachments only once every copy is older than the writers' dedup window); a later `compact`
deletes the retired files.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from capture_proxy.cli import main
from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import CallStatus, RolloutInfo, RolloutState
from capture_proxy.sinks.parquet import (
    ParquetSink,
    ParquetSource,
    compact_store,
    gc_parquet,
    maintenance_lease,
)
from capture_proxy.sinks.registry import open_sink
from tests.support.aging import age_units
from tests.support.proxy_harness import Proxy, chat_body, user
from tests.support.sealing import put_sealed
from tests.support.sink_factories import Session

ADMIN = {"Authorization": "Bearer t"}
SYSTEM = {"role": "system", "content": "You are a shell agent. " * 20}
DAY_MS = 86_400_000
#: Older than the writers' dedup window plus gc's margin (`_layout.DEDUP_WINDOW_S`).
AGED_S = 2 * 3600
#: Refused before forwarding (an unknown key): a `rejected` entry in the rollout's ledger.
REJECTED = chat_body(user("a"), {"role": "assistant", "content": "b", "thinking_trace": "t"})


def _png(tag: bytes) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + tag * 50


def _image(tag: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(_png(tag)).decode()
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}


SHARED, OLD_ONLY = _image(b"shared"), _image(b"old-only")
SHARED_SHA = hashlib.sha256(_png(b"shared")).hexdigest()
OLD_SHA = hashlib.sha256(_png(b"old-only")).hexdigest()


@dataclass
class Story:
    proxy: Proxy
    url: str
    ds: Path
    #: rollout -> its staged call's id
    ids: dict[str, str]


async def _dataset_with_three_rollouts(make_proxy: Any, tmp_path: Path) -> Story:
    """`old` (sealed a week ago: its own image, a rejected call, an orphaned record), `recent`
    (sealed now) and `open`, all sharing a system prompt and an image; the proxy still runs."""
    ds = tmp_path / "dataset"
    url = f"parquet:///{ds}"
    p = await make_proxy(admin_token="t", sink=open_sink(url))
    ids = {}
    for rollout, own in (("old", OLD_ONLY), ("recent", None), ("open", None)):
        msgs = [SYSTEM, SHARED] + ([own] if own else []) + [user(f"task {rollout}")]
        resp = await p.chat(chat_body(*msgs), rollout=rollout)
        assert resp.status == 200
        assert resp.headers["X-Capture-Status"] == "staged"
        ids[rollout] = resp.headers["X-Capture-Call-Id"]
        assert (await p.chat(REJECTED, rollout=rollout)).status == 422
    await p.sink.mark_orphaned(ids["old"], "stage_timeout")
    for rollout in ("old", "recent"):
        assert (await p.client.post(f"/admin/rollouts/{rollout}/seal", headers=ADMIN)).status == 200
    # As if sealed a week ago: the sink writes the header again with that time (a later header
    # replaces an earlier one; the SQLite test UPDATEs the row).
    info = ParquetSource(str(ds)).rollout_info("old")
    week_ago = int(time.time() * 1000) - 7 * DAY_MS
    await p.sink.put_rollout(replace(info, sealed_at_ms=week_ago))
    return Story(p, url, ds, ids)


def _files(ds: Path) -> dict[str, tuple[int, int]]:
    """Every data file and marker (not the lock file and the maintenance lease), with size and
    mtime."""
    return {
        str(p.relative_to(ds)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in ds.rglob("*")
        if p.is_file() and not p.name.endswith(".lock") and p.parent.name != "_leases"
    }


def _read_back(url: str, rollouts: list[str]) -> dict[str, Any]:
    """Everything a reader sees of `rollouts`: headers, ledgers, records, coordinates."""
    out: dict[str, Any] = {}
    with open_store(url) as store:
        for r in rollouts:
            records = store.calls(
                r, include_orphaned=True, include_open=True, include_poisoned=True
            )
            out[r] = (
                store.rollout_info(r),
                store.failures(r),
                [
                    (
                        x.call_id,
                        x.digest,
                        x.prompt_token_ids.tobytes(),
                        x.completion_token_ids.tobytes(),
                        x.completion_logprobs.tobytes(),
                        x.request,
                        x.response,
                        [(a.sha256, a.media_type, a.data) for a in x.attachments],
                    )
                    for x in records
                ],
                store.coords([x.call_id for x in records]),
                store.trajectory(r, include_open=True, include_poisoned=True).to_dict(),
            )
    return out


def _rows_on_disk(ds: Path, table: str) -> list[dict[str, Any]]:
    """The rows of every file of `table` on disk, live or retired."""
    return [
        row for f in sorted((ds / table).glob("*.parquet")) for row in pq.read_table(f).to_pylist()
    ]


def _marker_files(ds: Path) -> list[bytes]:
    return [p.read_bytes() for p in sorted((ds / "_commits").glob("*.json"))]


def _counts(line: str) -> str:
    return re.sub(r"^(would remove|removed) ", "", line)


async def test_gc_removes_old_sealed_rollouts_only(
    make_proxy: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = await _dataset_with_three_rollouts(make_proxy, tmp_path)
    await s.proxy.sink.close()
    age_units(s.ds, AGED_S)  # past the window: no writer shares these copies any more
    kept = ["recent", "open"]
    before, files = _read_back(s.url, kept), _files(s.ds)

    assert main(["gc", s.url, "--older-than", "1d", "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert "would remove 1 sealed rollout(s), 1 call(s); " in dry
    assert "and 1 attachment(s) no longer used" in dry  # the old rollout's own image
    assert _files(s.ds) == files

    assert main(["gc", s.url, "--older-than", "1d"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1:] == ["  old"]
    assert _counts(out.splitlines()[0]) == _counts(dry.splitlines()[0])
    with open_store(s.url) as store:
        assert store.rollouts() == kept
        store.verify()  # no torn record, no orphan attachment, shared blobs intact
        for rollout in kept:
            (record,) = store.calls(rollout, include_open=True)
            assert record.request["messages"][0] == SYSTEM
            assert [a.sha256 for a in record.attachments] == [SHARED_SHA]
        assert store.failures("old") == []
        assert store.source.orphaned() == set()  # the old record's orphan mark went with it
        with pytest.raises(KeyError):
            store.rollout_info("old")
    assert _read_back(s.url, kept) == before
    # The replaced files stay until a compaction's grace period is over: open readers use them.
    # The removed rollout's claims go at once (no reader needs them; its id may be used again).
    claims = {rel for rel in files if rel.startswith("claims/")}
    assert {rel.split("/")[1] for rel in claims} == {"old", "recent", "open"}
    assert all((s.ds / rel).exists() for rel in files if not rel.startswith("claims/old/"))
    assert not (s.ds / "claims" / "old").exists()

    # A proxy writing again stores the old image anew: it does not count on bytes that are gone.
    p2 = await make_proxy(sink=open_sink(s.url))
    resp = await p2.chat(chat_body(SYSTEM, SHARED, OLD_ONLY, user("again")), rollout="later")
    assert resp.headers["X-Capture-Status"] == "staged"
    await p2.sink.close()
    with open_store(s.url) as store:
        store.verify()
        (record,) = store.calls("later", include_open=True)
        assert [a.sha256 for a in record.attachments] == [SHARED_SHA, OLD_SHA]


async def test_gc_never_removes_open_rollouts(make_proxy: Any, tmp_path: Path) -> None:
    s = await _dataset_with_three_rollouts(make_proxy, tmp_path)
    await s.proxy.sink.close()
    before = _read_back(s.url, ["open"])
    assert main(["gc", s.url, "--older-than", "0s"]) == 0
    with open_store(s.url) as store:
        assert store.rollouts() == ["open"]
        store.verify()
    assert _read_back(s.url, ["open"]) == before


async def test_gc_runs_while_the_proxy_writes_and_keeps_what_it_may_share(
    make_proxy: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = await _dataset_with_three_rollouts(make_proxy, tmp_path)
    before = _read_back(s.url, ["recent", "open"])
    assert main(["gc", s.url, "--older-than", "1d"]) == 0
    # The old rollout goes; its image stays: committed a moment ago, a writer may still share it.
    assert _counts(capsys.readouterr().out.splitlines()[0]) == (
        "1 sealed rollout(s), 1 call(s); 0 blob(s) and 0 attachment(s) no longer used"
    )
    resp = await s.proxy.chat(chat_body(SYSTEM, SHARED, OLD_ONLY, user("more")), rollout="open")
    assert resp.headers["X-Capture-Status"] == "staged"
    await s.proxy.sink.close()
    with open_store(s.url) as store:
        assert store.rollouts() == ["recent", "open"]
        store.verify()
        assert [len(r.attachments) for r in store.calls("open", include_open=True)] == [1, 2]
    assert _read_back(s.url, ["recent"]) == {"recent": before["recent"]}


async def test_a_second_maintenance_run_is_refused_naming_the_holder(
    make_proxy: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = await _dataset_with_three_rollouts(make_proxy, tmp_path)
    await s.proxy.sink.close()
    with maintenance_lease(str(s.ds), "compact") as lease:
        files = _files(s.ds)
        assert main(["gc", s.url, "--older-than", "1d"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(
            f"capture-proxy gc: another maintenance run holds {s.ds}/_leases/maintenance: "
            f"compact by {lease.holder}, until "
        )
        assert err.endswith(
            "unless renewed; run gc again once it has finished (a holder that died is taken "
            "over once its lease expires)\n"
        )
        assert _files(s.ds) == files
        assert main(["compact", s.url]) == 1
        assert "another maintenance run holds" in capsys.readouterr().err
    assert main(["gc", s.url, "--older-than", "1d"]) == 0
    assert "removed 1 sealed rollout(s)" in capsys.readouterr().out


class _Refusing(pafs.SubTreeFileSystem):  # type: ignore[misc]
    """A bucket that refuses uploads under one prefix (a denied PUT): the object-storage path."""

    def __init__(self, root: str, refused: str) -> None:
        super().__init__(root, pafs.LocalFileSystem())
        self.refused = refused

    def open_output_stream(self, path: str, *args: Any, **kwargs: Any) -> Any:
        if path.startswith(self.refused):
            raise PermissionError(f"upload of {path} denied")
        return super().open_output_stream(path, *args, **kwargs)


async def test_a_failed_commit_leaves_the_dataset_as_it_was(
    make_proxy: Any, tmp_path: Path
) -> None:
    s = await _dataset_with_three_rollouts(make_proxy, tmp_path)
    await s.proxy.sink.close()
    age_units(s.ds, AGED_S)
    everything = ["old", "recent", "open"]
    before, files = _read_back(s.url, everything), _files(s.ds)
    now = int(time.time() * 1000)
    # The ledger file fails after the calls, blobs and attachments files were uploaded; the
    # marker fails after every data file was: either way they are removed again.
    for refused in ("dataset/ledger/", "dataset/_commits/"):
        fs = _Refusing(str(tmp_path), refused)
        with pytest.raises(PermissionError, match=f"upload of {refused}.* denied"):
            gc_parquet("dataset", older_than_ms=DAY_MS, now_ms=now, filesystem=fs)
        assert _files(s.ds) == files
        assert _read_back(s.url, everything) == before
    fs = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    stats = gc_parquet("dataset", older_than_ms=DAY_MS, now_ms=now, filesystem=fs)
    assert (stats.rollouts, stats.calls, stats.attachments) == (["old"], 1, 1)
    assert stats.bytes_after < stats.bytes_before
    with open_store(s.url) as store:
        assert store.rollouts() == ["recent", "open"]
        store.verify()


async def test_compact_deletes_the_removed_rows_after_the_grace_period(
    make_proxy: Any, tmp_path: Path
) -> None:
    s = await _dataset_with_three_rollouts(make_proxy, tmp_path)
    await s.proxy.sink.close()
    age_units(s.ds, AGED_S)
    reader = ParquetSource(str(s.ds))  # opened before gc, still open after it
    before = _read_back(s.url, ["recent", "open"])
    recent = [r.digest for r in reader.calls("recent")]
    assert main(["gc", s.url, "--older-than", "1d"]) == 0
    compact_store(str(s.ds), grace_s=60)  # removed a moment ago: readers may still use them
    assert OLD_SHA in {r["sha256"] for r in _rows_on_disk(s.ds, "attachments")}

    compact_store(str(s.ds), grace_s=0)
    assert OLD_SHA not in {r["sha256"] for r in _rows_on_disk(s.ds, "attachments")}
    assert "old" not in {r["rollout_id"] for r in _rows_on_disk(s.ds, "calls")}
    assert "old" not in {r["rollout_id"] for r in _rows_on_disk(s.ds, "ledger")}
    assert s.ids["old"] not in {r["call_id"] for r in _rows_on_disk(s.ds, "ledger")}
    assert SHARED_SHA in {r["sha256"] for r in _rows_on_disk(s.ds, "attachments")}
    assert len(_marker_files(s.ds)) == 1
    assert _read_back(s.url, ["recent", "open"]) == before
    # The reader opened before all this re-lists when its files vanish and reads the same data.
    assert [r.digest for r in reader.calls("recent")] == recent
    assert reader.rollouts() == ["recent", "open"]


async def test_kept_ledger_rows_keep_their_commit_order(tmp_path: Path) -> None:
    ds = str(tmp_path / "ds")
    sink = ParquetSink(ds)
    await sink.put_rollout(RolloutInfo("first", RolloutState.OPEN, False, 1))
    old = Session("old")
    await sink.stage(old.next()[0])
    # Marked before its late write landed, so the mark names no rollout: it goes by call id.
    await sink.mark_orphaned("old-c1", "stage_timeout")
    await sink.stage(old.next()[0])
    await sink.put_rollout(RolloutInfo("kept", RolloutState.OPEN, False, 2, None, {"v": 1}))
    await sink.stage(Session("kept").next()[0])
    await sink.close()
    compact_store(ds)  # one unit holding rows of both the rollout that goes and those that stay
    sink = ParquetSink(ds)
    await put_sealed(sink, RolloutInfo("kept", RolloutState.SEALED, False, 2, 20, {"v": 2}))
    await put_sealed(sink, RolloutInfo("old", RolloutState.SEALED, False, 0, 10))
    await sink.close()
    url = f"parquet:///{ds}"
    assert ParquetSource(ds).orphaned() == {"old-c1"}
    before = _read_back(url, ["first", "kept"])
    # Everything from the mixed unit to the old rollout's last header is rewritten as one unit
    # in their place, so the kept rollout's later header still wins.
    stats = gc_parquet(ds, older_than_ms=DAY_MS, now_ms=10 + DAY_MS + 1)
    assert (stats.rollouts, stats.calls) == (["old"], 2)
    assert _read_back(url, ["first", "kept"]) == before
    assert ParquetSource(ds).orphaned() == set()
    info = ParquetSource(ds).rollout_info("kept")
    assert (info.state, dict(info.metadata)) == (RolloutState.SEALED, {"v": 2})
    assert ParquetSource(ds).rollouts() == ["first", "kept"]


async def test_when_every_rollout_goes_the_dataset_stays_usable(tmp_path: Path) -> None:
    ds = str(tmp_path / "ds")
    sink = ParquetSink(ds)
    for rollout in ("a", "b"):
        await sink.stage(Session(rollout).next()[0])
        await sink.put_rollout(RolloutInfo(rollout, RolloutState.SEALED, False, 1, 2))
    await sink.close()
    age_units(Path(ds), AGED_S)  # blobs too go: out of the writers' window
    stats = gc_parquet(ds, older_than_ms=0, now_ms=3)
    assert (stats.rollouts, stats.calls, stats.bytes_after) == (["a", "b"], 2, 0)
    (marker,) = [m for m in map(json.loads, _marker_files(tmp_path / "ds")) if m["retires"]]
    assert marker["files"] == {}  # nothing left to write: the marker alone retires every unit
    source = ParquetSource(ds)
    assert (source.rollouts(), list(source.all_keys())) == ([], [])
    # The dataset takes new records (the same ids too) and compacts as before.
    sink = ParquetSink(ds)
    res = await sink.stage(Session("a").next()[0])
    await sink.close()
    assert res.status is CallStatus.STAGED
    compact_store(ds, grace_s=0)
    with open_store(ds) as store:
        assert store.rollouts() == ["a"]
        store.verify()


def test_gc_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gc", str(tmp_path / "nothing"), "--older-than", "7d"]) == 1
    assert capsys.readouterr().err == (
        f"capture-proxy gc: no capture-proxy Parquet dataset at {tmp_path / 'nothing'}\n"
    )
    assert not (tmp_path / "nothing").exists()  # gc never creates a dataset
    assert main(["gc", "memory://x", "--older-than", "7d"]) == 2
    assert "memory://x lives in a process's memory" in capsys.readouterr().err
