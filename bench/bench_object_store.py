"""Object storage spike: conditional writes on a loopback S3, and what each commit option costs.

    .venv/bin/python bench/bench_object_store.py [--units 1000] [--batch 16] [--quick] [--json]

Needs the test extra (moto's server, obstore) and, for option (c) only, ``pip install deltalake``
(see docs/reports/object-store-spike.md). Everything runs against moto's S3 server,
started here as a subprocess on 127.0.0.1 (a free port) and stopped at the end; no other network.

1. Conditional writes: does the server honour ``If-None-Match: *`` (create-if-absent: a second put
   of the same key fails with 412) and ``If-Match: <etag>`` (compare-and-swap), through obstore's
   ``put(..., mode=...)``? And pyarrow's `S3FileSystem`: it has no precondition option, so a second
   ``open_output_stream`` of a key silently replaces it (checked here).
2. Three ways to commit a group-commit batch of N calls, each building one store of `units`
   commits (the first 100 with N=1, the rest with N=`batch`):

   (a) ``parquet+claim/call``: today's Parquet layout (`capture_proxy.sinks.parquet._layout`:
       data files, then the commit marker, through pyarrow's S3FileSystem), plus one
       create-if-absent claim object per call (``claims/<rollout>/<seq>``, obstore, concurrent);
   (b) ``parquet+claim/batch``: the same with one create-if-absent object per batch;
   (c) ``delta``: `deltalake.write_deltalake` appends the batch's blobs, then its calls, to two
       Delta tables (a commit each; delta-rs commits with a create-if-absent put of the next log
       entry).

   Reported per option: seconds per commit (median and p90) at N=1 and N=`batch`, S3 requests
   per commit (counted from moto's request log), and the time and requests for a new reader to
   open the store and list its rollouts at 100 units and at `units` (a `ParquetSource` for (a)
   and (b); `DeltaTable` plus the ``rollout_id`` column for (c)).

Rows are synthetic but shaped like the sink's: each call has 1,024 delta tokens and logprobs
(8 KB) and one 8 KB message blob. Each phase stops early after `--max-seconds`. One run, on a
shared machine: figures are noisy; compare the options by ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

# Never ask an instance-metadata endpoint for credentials: every client here gets them explicitly.
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

import obstore
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from obstore.exceptions import AlreadyExistsError, PreconditionError
from obstore.store import S3Store

from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._layout import (
    BLOBS,
    CALLS,
    LEDGER,
    SCHEMAS,
    Marker,
    create_dataset,
    new_unit_name,
    table_bytes,
    unit_files,
)
from capture_proxy.sinks.parquet._source import ParquetSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.s3 import MotoS3

BUCKET = "capture-bench"
KEY, SECRET, REGION = "bench", "bench", "us-east-1"
TOKENS = 1_024
BLOB_BYTES = 8_192
ROLLOUTS = 64


# -- moto's S3 server on loopback ------------------------------------------------------------------


class Moto(MotoS3):
    """moto's S3 server on 127.0.0.1 with the bench's bucket (tests/support/s3.py)."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, bucket=BUCKET)


def obstore_client(moto: Moto) -> S3Store:
    return S3Store(
        BUCKET,
        endpoint=moto.endpoint,
        access_key_id=KEY,
        secret_access_key=SECRET,
        region=REGION,
        client_options={"allow_http": True},
    )


def pyarrow_fs(moto: Moto) -> pafs.S3FileSystem:
    return pafs.S3FileSystem(
        access_key=KEY,
        secret_key=SECRET,
        region=REGION,
        scheme="http",
        endpoint_override=f"127.0.0.1:{moto.port}",
    )


def delta_options(moto: Moto) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": moto.endpoint,
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_REGION": REGION,
        "AWS_ALLOW_HTTP": "true",
    }


# -- 1. conditional writes -------------------------------------------------------------------------


def _outcome(fn: Callable[[], object]) -> str:
    try:
        fn()
    except AlreadyExistsError:
        return "refused: AlreadyExistsError (HTTP 412)"
    except PreconditionError as e:
        status = "404" if "404" in str(e) else "412" if "412" in str(e) else "?"
        return f"refused: PreconditionError (HTTP {status})"
    return "accepted"


def check_conditional_writes(moto: Moto) -> dict[str, str]:
    store = obstore_client(moto)
    first = obstore.put(store, "probe/claim", b"1", mode="create")
    etag = first["e_tag"] or ""
    out = {
        "obstore create, key absent": "accepted",
        "obstore create, key present": _outcome(
            lambda: obstore.put(store, "probe/claim", b"2", mode="create")
        ),
    }
    after = bytes(obstore.get(store, "probe/claim").bytes())
    out["content after the refused create"] = after.decode()
    second = obstore.put(store, "probe/claim", b"3", mode={"e_tag": etag})
    out["obstore update, etag current"] = "accepted"
    out["obstore update, etag stale"] = _outcome(
        lambda: obstore.put(store, "probe/claim", b"4", mode={"e_tag": etag})
    )
    out["obstore update, key absent"] = _outcome(
        lambda: obstore.put(store, "probe/absent", b"5", mode={"e_tag": second["e_tag"] or ""})
    )
    fs = pyarrow_fs(moto)
    for data in (b"first", b"second"):
        with fs.open_output_stream(f"{BUCKET}/probe/pyarrow") as f:
            f.write(data)
    got = bytes(obstore.get(store, "probe/pyarrow").bytes()).decode()
    out["pyarrow open_output_stream, key present"] = f"accepted (object now {got!r})"
    return out


# -- synthetic rows --------------------------------------------------------------------------------


@dataclass
class Rows:
    """Calls of `ROLLOUTS` rollouts, each rollout's seq counting up."""

    rng: random.Random = field(default_factory=lambda: random.Random(0))
    next_seq: dict[str, int] = field(default_factory=dict)
    n: int = 0

    def batch(self, size: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        calls: list[dict[str, Any]] = []
        blobs: list[dict[str, Any]] = []
        for _ in range(size):
            rollout = f"rollout-{self.n % ROLLOUTS:03d}"
            seq = self.next_seq.get(rollout, 0)
            self.next_seq[rollout] = seq + 1
            self.n += 1
            key = self.rng.randbytes(32).hex()
            blobs.append({"key": key, "data": self.rng.randbytes(BLOB_BYTES)})
            calls.append(self._call(rollout, seq, key))
        return calls, blobs

    def _call(self, rollout: str, seq: int, blob_key: str) -> dict[str, Any]:
        values: dict[str, Any] = {
            "call_id": f"call-{self.n:08d}",
            "rollout_id": rollout,
            "seq": seq,
            "parent_call_id": None,
            "retry_of": None,
            "request_key": blob_key,
            "message_keys": bytes.fromhex(blob_key),
            "delta_tokens": self.rng.randbytes(4 * TOKENS),
            "completion_logprobs": self.rng.randbytes(4 * TOKENS),
            "prompt_len": 0,
            "prev_len": 0,
            "delta_len": TOKENS,
            "cum_len": TOKENS,
            "attachment_shas": [],
            "sampling": b"{}",
            "response": b"{}",
            "extras": b"{}",
        }
        # Any other column gets a plain value of its type, so the rows follow the sink's schema.
        for f in SCHEMAS[CALLS]:
            if f.name not in values:
                if pa.types.is_integer(f.type):
                    values[f.name] = 1
                elif pa.types.is_binary(f.type):
                    values[f.name] = b""
                elif pa.types.is_boolean(f.type):
                    values[f.name] = False
                elif pa.types.is_string(f.type):
                    values[f.name] = f.name
        return values


def ledger_rows(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A rollout header for each rollout's first call (what the sink writes implicitly)."""
    return [
        {"kind": "rollout", "rollout_id": c["rollout_id"], "state": "open", "poisoned": False}
        | {"at_ms": 0, "metadata": b"{}", "policy": b"{}"}
        for c in calls
        if c["seq"] == 0
    ]


# -- the three options -----------------------------------------------------------------------------


class Option:
    name = ""

    def commit(self, calls: list[dict[str, Any]], blobs: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def open_and_list(self) -> int:
        """A new reader: open the store and list its rollouts; returns how many."""
        raise NotImplementedError


class ParquetWithClaims(Option):
    """Today's layout through pyarrow, plus create-if-absent claims through obstore."""

    def __init__(self, moto: Moto, prefix: str, *, per_call: bool) -> None:
        self.name = "parquet+claim/call" if per_call else "parquet+claim/batch"
        self.per_call = per_call
        self.prefix = prefix
        self.fs = pyarrow_fs(moto)
        self.dfs = DatasetFS(f"{BUCKET}/{prefix}", self.fs)
        create_dataset(self.dfs)
        self.store = obstore_client(moto)
        self.last_order = 0

    async def _claim(self, keys: list[str], body: bytes) -> None:
        await asyncio.gather(*(obstore.put_async(self.store, k, body, mode="create") for k in keys))

    def commit(self, calls: list[dict[str, Any]], blobs: list[dict[str, Any]]) -> None:
        unit, order = new_unit_name(self.last_order)
        if self.per_call:
            keys = [f"{self.prefix}/claims/{c['rollout_id']}/{c['seq']:010d}" for c in calls]
        else:
            keys = [f"{self.prefix}/claims/batches/{unit}"]
        # A refused claim (AlreadyExistsError) would refuse its call; none is expected here.
        asyncio.run(self._claim(keys, unit.encode()))
        rows = {CALLS: calls, BLOBS: blobs, LEDGER: ledger_rows(calls)}
        tables = [t for t, r in rows.items() if r]
        files = unit_files(unit, tables)
        data = {files[t]: table_bytes(t, rows[t]) for t in tables}
        marker = Marker(
            unit=unit,
            files=files,
            rows={t: len(rows[t]) for t in tables},
            size=sum(map(len, data.values())),
        )
        self.dfs.put_all(data)
        self.dfs.put_all({marker.rel: marker.encode()})
        self.last_order = order

    def open_and_list(self) -> int:
        source = ParquetSource(f"{BUCKET}/{self.prefix}", filesystem=self.fs)
        return len(source.rollouts())


class Delta(Option):
    """Two Delta tables (blobs, calls), one append each per batch.

    The writer keeps each table open, as a long-running sink would: a commit then reads only the
    log entries added since its last one, not the whole log.
    """

    name = "delta"

    def __init__(self, moto: Moto, prefix: str) -> None:
        # Imported here: deltalake is needed for this option only (the spike did not adopt it).
        from deltalake import DeltaTable, write_deltalake

        self.table_type, self.write = DeltaTable, write_deltalake
        self.uri = f"s3://{BUCKET}/{prefix}"
        self.options = delta_options(moto)
        self.tables: dict[str, Any] = {}

    def commit(self, calls: list[dict[str, Any]], blobs: list[dict[str, Any]]) -> None:
        for name, rows in ((BLOBS, blobs), (CALLS, calls)):
            data = pa.Table.from_pylist(rows, schema=SCHEMAS[name])
            table = self.tables.get(name)
            if table is None:
                uri = f"{self.uri}/{name}"
                self.write(uri, data, mode="append", storage_options=self.options)
                self.tables[name] = self.table_type(uri, storage_options=self.options)
            else:
                self.write(table, data, mode="append")

    def open_and_list(self) -> int:
        dt = self.table_type(f"{self.uri}/{CALLS}", storage_options=self.options)
        ids = dt.to_pyarrow_table(columns=["rollout_id"]).column("rollout_id")
        return len(pc.unique(ids))


# -- measuring -------------------------------------------------------------------------------------


def _q(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def run_option(
    option: Option, moto: Moto, *, units: int, batch: int, max_seconds: float
) -> dict[str, Any]:
    rows = Rows()
    out: dict[str, Any] = {"option": option.name}
    built = 0
    for label, size, target in (("n1", 1, min(100, units)), (f"n{batch}", batch, units)):
        times: list[float] = []
        before = moto.requests()
        start = time.monotonic()
        while built < target and time.monotonic() - start < max_seconds:
            calls, blobs = rows.batch(size)
            t0 = time.perf_counter()
            option.commit(calls, blobs)
            times.append(time.perf_counter() - t0)
            built += 1
        if times:
            out[label] = {
                "commits": len(times),
                "calls_per_commit": size,
                "median_s": statistics.median(times),
                "p90_s": _q(times, 0.9),
                "requests_per_commit": (moto.requests() - before) / len(times),
            }
        before = moto.requests()
        t0 = time.perf_counter()
        n_rollouts = option.open_and_list()
        out[f"open_{built}"] = {
            "units": built,
            "seconds": time.perf_counter() - t0,
            "requests": moto.requests() - before,
            "rollouts": n_rollouts,
        }
        print(f"  {option.name}: {label} done, {built} units", file=sys.stderr)
    return out


@contextlib.contextmanager
def running_moto() -> Iterator[Moto]:
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
        moto = Moto(Path(tmp))
        try:
            yield moto
        finally:
            moto.stop()


def print_table(results: list[dict[str, Any]], batch: int) -> None:
    base = results[0]
    print(f"\n{'':26}" + "".join(f"{r['option']:>22}" for r in results))

    def row(label: str, get: Callable[[dict[str, Any]], float | None], fmt: str) -> None:
        cells = []
        for r in results:
            v = get(r)
            ref = get(base)
            cell = "-" if v is None else format(v, fmt)
            if v is not None and ref and r is not base:
                cell += f" ({v / ref:.2f}x)"
            cells.append(f"{cell:>22}")
        print(f"{label:26}" + "".join(cells))

    for label in ("n1", f"n{batch}"):
        row(f"commit {label} median ms", _getter(label, "median_s", 1000), ".1f")
        row(f"commit {label} p90 ms", _getter(label, "p90_s", 1000), ".1f")
        row(f"requests/commit {label}", _getter(label, "requests_per_commit"), ".1f")
    opens = sorted({k for r in results for k in r if k.startswith("open_")}, key=_units_of)
    for key in opens:
        row(f"{key} s", _getter(key, "seconds"), ".2f")
        row(f"{key} requests", _getter(key, "requests"), ".0f")


def _getter(key: str, what: str, scale: float = 1) -> Callable[[dict[str, Any]], float | None]:
    def get(r: dict[str, Any]) -> float | None:
        v = r.get(key, {}).get(what)
        return None if v is None else scale * float(v)

    return get


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _units_of(key: str) -> int:
    return int(key.split("_")[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--units", type=int, default=1_000, help="commits per option (default 1000)")
    ap.add_argument("--batch", type=int, default=16, help="calls per group commit after 100")
    ap.add_argument("--max-seconds", type=float, default=120.0, help="time bound per phase")
    ap.add_argument("--options", default="claim-call,claim-batch,delta")
    ap.add_argument("--quick", action="store_true", help="100 units per option")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    units = 100 if args.quick else args.units
    chosen = args.options.split(",")
    env = {
        "python": platform.python_version(),
        **{p: _version(p) for p in ("pyarrow", "obstore", "deltalake", "moto")},
        "cpus": os.cpu_count(),
        "load": os.getloadavg()[0],
    }
    print(json.dumps(env), file=sys.stderr)
    results: list[dict[str, Any]] = []
    with running_moto() as moto:
        answers = check_conditional_writes(moto)
        for k, v in answers.items():
            print(f"  {k}: {v}", file=sys.stderr)
        makers: dict[str, Callable[[], Option]] = {
            "claim-call": lambda: ParquetWithClaims(moto, "a", per_call=True),
            "claim-batch": lambda: ParquetWithClaims(moto, "b", per_call=False),
            "delta": lambda: Delta(moto, "c"),
        }
        for name in chosen:
            results.append(
                run_option(
                    makers[name](),
                    moto,
                    units=units,
                    batch=args.batch,
                    max_seconds=args.max_seconds,
                )
            )
    if args.json:
        print(json.dumps({"env": env, "conditional_writes": answers, "results": results}, indent=1))
    else:
        print_table(results, args.batch)


if __name__ == "__main__":
    main()
