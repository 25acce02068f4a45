"""Where the milliseconds after vLLM's answer go, for one call at a time: a per-phase timeline.

    .venv/bin/python bench/timeline.py [--calls 40] [--store sqlite|parquet] [--new-rollouts]

Starts the 200 ms upstream (`upstream_fixture.py`) and ``capture-proxy serve`` with stamps
added around the steps a unary call takes once vLLM has answered (the serve process is this
script run with ``--serve``: it wraps the steps' functions, then runs the CLI as usual), sends
`calls` calls one after another from one agent session (``--new-rollouts``: each call the
first of a new rollout, as ``unary-200ms-sequential`` does), and prints the median and p90 of
each phase in milliseconds. The stamps are ``time.perf_counter`` (CLOCK_MONOTONIC on Linux, one
clock for every process), so the client's own stamp is comparable:

====================  ===========================================================================
prepared              `Exchange.prepare` returned (decoded, validated, admitted: for a new
                      rollout, its resume from the store), from the handler calling it
headers               the upstream's status line and headers are in (the upstream's 200 ms)
answer read           the whole answer body is read
parsed                `VLLMAdapter.parse_response` returned (answer decoded, client body built)
sealed                `Capture.build_record` returned (record built, digests, sealed)
handed to writer      the stage reached the writer thread's queue (`WriterThread.submit`)
writer picks up       the writer thread starts the batch holding it
encoded               `encode_record` returned on the writer thread (SQLite)
inserted              the record's savepoint work returned (blobs, call row, events)
committed             ``COMMIT`` (its fdatasync) and the file check returned
loop resumes          the event loop runs the callback that settles the caller's future
stage returned        `Stager.stage` returned to `Capture.complete_call`
response built        the chat handler built the response
response written      aiohttp wrote its last byte (``write_eof`` returned)
client has it         the client read the whole body (this process)
====================  ===========================================================================

A phase's figure is the time from the stamp before it (with ``--store parquet`` the SQLite
writer's steps are absent: its commit counts from the hand-off). Sequential calls only: the
stamps of one call are told apart from the next by order, which concurrency would mix.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

HERE = Path(__file__).resolve().parent
PY = sys.executable

PHASES = (
    "request in",
    "prepared",
    "headers",
    "answer read",
    "parsed",
    "sealed",
    "handed to writer",
    "writer picks up",
    "encoded",
    "inserted",
    "committed",
    "loop resumes",
    "stage returned",
    "response built",
    "response written",
)

_AFTER_ANSWER = frozenset(PHASES[PHASES.index("answer read") + 1 :])

# -- the serve process: stamps around the steps -------------------------------------------------

_current: dict[str, float] | None = None
_timelines: list[dict[str, float]] = []


def _stamp(name: str) -> None:
    # The admission claim passes the same writer steps before the answer: not this timeline's.
    if _current is None or name in _current:
        return
    if name in _AFTER_ANSWER and "answer read" not in _current:
        return
    _current[name] = time.perf_counter()


def _after(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        _stamp(name)
        return out

    return wrapper


def _before(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _stamp(name)
        return fn(*args, **kwargs)

    return wrapper


def _install() -> None:
    from aiohttp import web

    from capture_proxy.adapters.vllm import VLLMAdapter
    from capture_proxy.core import exchange
    from capture_proxy.core.capture import Capture
    from capture_proxy.core.staging import Stager
    from capture_proxy.server import chat
    from capture_proxy.sinks import writer_thread
    from capture_proxy.sinks.sqlite import _sink, _writer

    prepare = exchange.Exchange.prepare

    async def timed_prepare(self: Any, body: Any, *, items_counted: bool = False) -> None:
        global _current
        _current = {"request in": time.perf_counter()}
        await prepare(self, body, items_counted=items_counted)
        _stamp("prepared")

    exchange.Exchange.prepare = timed_prepare  # type: ignore[method-assign]
    read_unary = exchange.Exchange.read_unary

    async def timed_read_unary(self: Any) -> Any:
        _stamp("headers")
        return await read_unary(self)

    exchange.Exchange.read_unary = timed_read_unary  # type: ignore[method-assign]
    finish_unary = exchange.Exchange.finish_unary

    async def timed_finish_unary(self: Any, raw: bytes) -> Any:
        _stamp("answer read")
        return await finish_unary(self, raw)

    exchange.Exchange.finish_unary = timed_finish_unary  # type: ignore[method-assign]
    VLLMAdapter.parse_response = _after(VLLMAdapter.parse_response, "parsed")  # type: ignore[method-assign]
    Capture.build_record = _after(Capture.build_record, "sealed")
    submit = writer_thread.WriterThread.submit

    async def timed_submit(self: Any, work: Any) -> Any:
        _stamp("handed to writer")
        return await submit(self, work)

    writer_thread.WriterThread.submit = timed_submit  # type: ignore[method-assign]
    _writer.GroupCommitWriter._commit = _before(  # type: ignore[method-assign]
        _writer.GroupCommitWriter._commit, "writer picks up"
    )
    _sink.encode_record = _after(_sink.encode_record, "encoded")  # type: ignore[attr-defined]
    _sink.SQLiteSink._stage_one = _after(_sink.SQLiteSink._stage_one, "inserted")  # type: ignore[method-assign]
    deliver = writer_thread.WriterThread._deliver
    writer_thread.WriterThread._deliver = staticmethod(_before(deliver, "committed"))  # type: ignore[method-assign]
    writer_thread._settle = _before(writer_thread._settle, "loop resumes")
    stage = Stager.stage

    async def timed_stage(self: Any, record: Any, attachments: Any) -> Any:
        out = await stage(self, record, attachments)
        _stamp("stage returned")
        return out

    Stager.stage = timed_stage  # type: ignore[method-assign]
    chat._unary_response = _after(chat._unary_response, "response built")
    write_eof = web.Response.write_eof

    async def timed_write_eof(self: Any, data: bytes = b"") -> None:
        global _current
        await write_eof(self, data)
        if _current is not None:
            _current["response written"] = time.perf_counter()
            _timelines.append(_current)
            _current = None

    web.Response.write_eof = timed_write_eof  # type: ignore[method-assign]


def serve(out: Path, argv: list[str]) -> int:
    _install()
    atexit.register(lambda: out.write_bytes(orjson.dumps(_timelines)))
    from capture_proxy.cli import main

    return main(argv)


# -- the driver --------------------------------------------------------------------------------


async def drive(url: str, calls: int, new_rollouts: bool, gap: float) -> list[float]:
    import aiohttp
    from workload import TURNS, build_workload, tag_request

    w = build_workload()
    ends: list[float] = []
    async with aiohttp.ClientSession() as session:
        for i in range(calls + 2):  # two warm-up calls: the proxy's first-use fetches
            rollout = f"tl-{i}" if new_rollouts else "tl-session"
            body = tag_request(w.request, i % TURNS, i)
            headers = {"Content-Type": "application/json", "X-Rollout-Id": rollout}
            async with session.post(f"{url}/v1/chat/completions", data=body, headers=headers) as r:
                await r.read()
                if i >= 2:
                    ends.append(time.perf_counter())
                if r.status != 200 or r.headers.get("X-Capture-Status") != "staged":
                    raise RuntimeError(f"call {i}: {r.status} {r.headers.get('X-Capture-Status')}")
            await asyncio.sleep(gap)
    return ends


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--store", choices=("sqlite", "parquet"), default="sqlite")
    p.add_argument("--new-rollouts", action="store_true", help="each call a new rollout")
    p.add_argument("--gap", type=float, default=0.0, help="seconds between calls")
    p.add_argument("--json", type=Path, help="write every call's timeline here")
    p.add_argument(
        "--python",
        default=PY,
        help="the Python that serves (another checkout's .venv/bin/python: its proxy, timed)",
    )
    if sys.argv[1:2] == ["--serve"]:  # the serve process: its stamps file, then the CLI's argv
        return serve(Path(sys.argv[2]), sys.argv[3:])
    args = p.parse_args()
    from bench_proxy import Proc

    work = Path(tempfile.mkdtemp(prefix="bench-timeline-"))
    procs: list[Proc] = []
    try:
        upstream = Proc("upstream", [PY, str(HERE / "upstream_fixture.py"), "--delay", "0.2"], work)
        procs.append(upstream)
        store = f"sqlite:///{work}/store.db" if args.store == "sqlite" else f"parquet:///{work}/pq"
        stamps = work / "stamps.json"
        argv = [args.python, str(Path(__file__).resolve()), "--serve", str(stamps), "serve"]
        argv += ["--upstream", upstream.url, "--store", store, "--port", "0"]
        proxy = Proc("proxy", argv, work)
        procs.append(proxy)
        ends = asyncio.run(drive(proxy.url, args.calls, args.new_rollouts, args.gap))
        proxy.stop()
        timelines: list[dict[str, float]] = orjson.loads(stamps.read_bytes())[2:]
    finally:
        for proc in reversed(procs):
            proc.stop()
        shutil.rmtree(work, ignore_errors=True)
    for line, end in zip(timelines, ends, strict=True):
        line["client has it"] = end
    if args.json:
        args.json.write_bytes(orjson.dumps(timelines, option=orjson.OPT_INDENT_2))
    report(timelines)
    return 0


def report(timelines: list[dict[str, float]]) -> None:
    """Each phase's median and p90, from the latest stamp before it that the call has (the
    Parquet writer has no SQLite steps: its commit then counts from the hand-off)."""
    names = [*PHASES, "client has it"]
    spans: dict[str, list[float]] = {}
    for t in timelines:
        prev = None
        for name in names:
            if name not in t:
                continue
            if prev is not None:
                spans.setdefault(name, []).append(1000 * (t[name] - t[prev]))
            prev = name
    load = os.getloadavg()[0]
    print(f"{len(timelines)} calls, one at a time; ms from the stamp before (load {load:.1f})")
    print(f"{'phase':<20} {'p50':>7} {'p90':>7}")
    for name in names:
        values = sorted(spans.get(name, ()))
        if values:
            p90 = values[int(0.9 * (len(values) - 1))]
            print(f"{name:<20} {statistics.median(values):7.3f} {p90:7.3f}")
    total = [1000 * (t["client has it"] - t["answer read"]) for t in timelines]
    print(f"{'answer → client':<20} {statistics.median(total):7.3f}")


if __name__ == "__main__":
    sys.exit(main())
