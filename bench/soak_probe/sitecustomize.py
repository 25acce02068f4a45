"""A memory probe for ``scripts/soak.py``'s proxy; off unless ``SOAK_PROBE_OUT`` is set.

    SOAK_PROBE_OUT=/tmp/probe PYTHONPATH=bench/soak_probe python -m scripts.soak --minutes 4 ...

Python imports this module at start-up in every process that has the folder on its path; it does
something only in a ``capture-proxy serve`` process (the soak's proxy). Every 10 s it appends a
JSON line to ``$SOAK_PROBE_OUT/probe.jsonl``: seconds since start, RSS and anonymous memory
(``/proc/self/smaps_rollup``), glibc's ``mallinfo2`` (heap in use, free in the heap, mmapped),
resident anonymous memory by mapping (``/proc/self/smaps``: the main heap, the other malloc
arenas, the threads' stacks, mimalloc's 1 GiB reservations, the rest), Python's own allocator
(its arenas, the bytes in use and free in them), Python's allocated blocks, what Arrow's pools
hold, and the calls the store holds (its claim files). Every ``SOAK_PROBE_MAPS_EVERY`` seconds
(default 60) it also appends every anonymous mapping (address range, permissions, kind, anonymous
bytes) to ``maps.jsonl``, for `bench/soak_probe/maps.py` (which mappings grew). With
``SOAK_PROBE_TRACE=1`` it also runs ``tracemalloc`` and writes a snapshot at each of the seconds
listed in ``SOAK_PROBE_SNAPS`` (default ``120,230``), for `bench/soak_probe/diff.py`. With
``SOAK_PROBE_NO_THP=1`` every process with the folder on its path runs without transparent huge
pages. With ``SOAK_PROBE_TRIM=1`` it calls glibc's ``malloc_trim(0)`` before each line and logs
how long it took (``trim_ms``), to tell free-but-held heap from memory in use. With
``SOAK_PROBE_BIG`` set to a list of seconds (``600,900``), at each it appends to ``big.jsonl``
every Python object of 256 KiB or more (by ``sys.getsizeof``: a dict's or set's table, a list's
array, a bytearray's buffer) with its type, length, a few of its keys and what holds it: the
owners of blocks over malloc's mmap threshold. With ``SOAK_PROBE_POOLS`` set to a list of
seconds, at each it appends to ``pools.jsonl`` a survey of Python's small-object memory: every
object reachable from the collector's, of 512 bytes or less (what Python's own allocator holds),
counted by the 1 MiB window of its address; windows where the objects found fill under a quarter
are the sparse ones that keep arenas allocated, and their objects are summed by type (and by the
line that allocated them when ``tracemalloc`` runs): what pins the arenas. With
``SOAK_PROBE_CENSUS`` set to a list of seconds, at each it appends to ``census.jsonl`` every
reachable object counted and sized by type, a sample of the strings, and the interned ones
counted by shape (digits and hex folded).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo() -> dict[str, int]:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return {"heap_used": m.uordblks, "heap_free": m.fordblks, "mmapped": m.hblkhd}


def _proc() -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Anonymous", "AnonHugePages"):
            out[key.lower()] = int(rest.split()[0]) * 1024
    return out


def _stack_pointers() -> list[int]:
    """Each thread's stack pointer while it waits in a system call (``/proc/self/task/*/syscall``:
    the number, six arguments, the stack pointer, the program counter; "running" otherwise)."""
    sps = []
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/syscall").read_text().split()
        except OSError:
            continue
        if len(fields) >= 9:
            sps.append(int(fields[-2], 16))
    return sps


def _mappings() -> list[list[object]]:
    """Every anonymous private mapping: start, end, permissions, kind and its anonymous bytes.

    Kinds: ``heap`` (glibc's main heap), ``arena`` (another malloc arena: a heap of its own
    starting on a 64 MiB boundary), ``reserve`` (at least 256 MiB of address space: mimalloc's
    arenas reserve 1 GiB and commit what they use), ``stack`` (holds a thread's stack pointer),
    ``guard`` (no access: the guard page below a thread's stack, an arena's reserved tail) and
    ``other``
    (Python's 1 MiB object arenas, malloc's own mmaps of blocks of 1 MiB or more, the stack of a
    thread running at the time of the sample, anything else a library maps).
    """
    sps = _stack_pointers()
    rows: list[list[object]] = []
    current: list[object] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(None, 6)
            if "-" in first[0] and len(first) >= 5:  # a mapping's header
                current = None
                low, high = (int(x, 16) for x in first[0].split("-"))
                path = first[5].strip() if len(first) > 5 else ""
                if path == "[heap]":
                    kind = "heap"
                elif path:
                    continue
                elif not first[1].startswith("rw"):
                    kind = "guard"
                elif high - low >= 256 << 20:
                    kind = "reserve"
                elif low % (64 << 20) == 0:
                    kind = "arena"
                elif any(low <= sp < high for sp in sps):
                    kind = "stack"
                else:
                    kind = "other"
                current = [low, high, first[1], kind, 0]
                rows.append(current)
            elif current is not None and first[0] == "Anonymous:":
                current[4] = int(first[1]) * 1024
    return rows


def _maps(rows: list[list[object]]) -> dict[str, int]:
    """Resident anonymous memory by where it lives: glibc's main heap (``[heap]``), its other
    arenas, the threads' stacks, and the rest (Python's object arenas, malloc's own mmaps)."""
    out = {"rss_heap": 0, "rss_arenas": 0, "rss_stacks": 0, "rss_reserve": 0, "rss_anon_other": 0}
    names = {
        "heap": "rss_heap",
        "arena": "rss_arenas",
        "stack": "rss_stacks",
        "reserve": "rss_reserve",
    }
    for row in rows:
        if row[3] != "guard":
            out[names.get(str(row[3]), "rss_anon_other")] += int(str(row[4]))
    return out


def _pymalloc(scratch: Path) -> dict[str, int]:
    """Python's small-object allocator from ``sys._debugmallocstats`` (written to fd 2, so fd 2
    points at a scratch file meanwhile; the GIL keeps Python threads from logging in between):
    its arenas' bytes, the bytes of blocks in use, and what is free inside its arenas."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(scratch, "w+") as f:
        os.dup2(f.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        text = f.read()
    stats: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition("=")
        number = value.strip().replace(",", "")
        if number.isdigit():
            stats[name.strip()] = int(number)
    pools = next((v for k, v in stats.items() if k.endswith("unused pools * 16384 bytes")), 0)
    return {
        "py_arenas": stats.get("# arenas allocated current", 0) << 20,
        "py_used": stats.get("# bytes in allocated blocks", 0),
        "py_free": stats.get("# bytes in available blocks", 0) + pools,
    }


def _arrow() -> dict[str, int]:
    """What Arrow's pools hold: the default pool of pyarrow's Python calls, and mimalloc's
    (the C++ default of pyarrow's wheels unless ``ARROW_DEFAULT_MEMORY_POOL`` said otherwise at
    import, used by the Parquet writer's encoders whatever `pyarrow.set_memory_pool` chose)."""
    pa = sys.modules.get("pyarrow")
    if pa is None:
        return {}
    mi = pa.mimalloc_memory_pool()
    return {
        "arrow_default": pa.total_allocated_bytes(),
        "arrow_mimalloc": mi.bytes_allocated(),
        "arrow_mimalloc_max": mi.max_memory(),
    }


def _claims(store: str | None) -> int:
    if not store or not store.startswith("parquet://"):
        return -1
    root = Path(store.removeprefix("parquet://")) / "claims"
    n = 0
    try:
        with os.scandir(root) as rollouts:
            for d in rollouts:
                n += len(os.listdir(d.path))
    except OSError:
        pass
    return n


def _big_objects(min_bytes: int = 256 << 10) -> list[dict[str, object]]:
    """Objects of `min_bytes` or more among the collector's objects and what they refer to."""
    import gc

    seen: set[int] = set()
    found: list[object] = []
    tracked = gc.get_objects()
    # The scan's own containers are not the proxy's (the id set alone is 8 MB by 200,000 ids).
    seen.update((id(seen), id(found), id(tracked)))
    for o in tracked:
        for x in (o, *gc.get_referents(o)):
            if id(x) in seen:
                continue
            seen.add(id(x))
            try:
                if sys.getsizeof(x) >= min_bytes:
                    found.append(x)
            except TypeError:
                pass
    rows = []
    ranked = sorted(found, key=sys.getsizeof, reverse=True)[:20]
    for x in ranked:
        holders = []
        for h in gc.get_referrers(x):
            if h is found or h is tracked or h is ranked or type(h).__name__ == "frame":
                continue
            name = type(h).__name__
            if isinstance(h, dict):
                owners = [
                    type(o).__qualname__
                    for o in gc.get_referrers(h)
                    if hasattr(o, "__dict__") and o.__dict__ is h
                ]
                name = f"dict of {owners[0]}" if owners else "dict"
            holders.append(name)
        keys: list[str] = []
        if isinstance(x, (dict, set, frozenset)):
            keys = [repr(k)[:60] for k, _ in zip(x, range(3), strict=False)]
        rows.append(
            {
                "type": type(x).__qualname__,
                "bytes": sys.getsizeof(x),
                "len": len(x) if hasattr(x, "__len__") else None,
                "keys": keys,
                "held_by": holders[:4],
            }
        )
    return rows


def _shape(s: str) -> str:
    """A string's kind, for counting: digits, hex and letters folded."""
    import re

    return re.sub(r"[0-9a-f]{8,}", "H", re.sub(r"[0-9]+", "9", s))[:60]


def _census(samples: int = 30) -> dict[str, object]:
    """Every object reachable from the collector's, counted and sized by type, with a sample of
    strings (what kind of string grows)."""
    import gc
    import random
    from collections import Counter

    count: Counter[str] = Counter()
    size: Counter[str] = Counter()
    strings: list[str] = []
    seen: set[int] = set()
    stack: list[object] = gc.get_objects()
    seen.update((id(seen), id(stack), id(strings)))
    n_str = 0
    interned: Counter[str] = Counter()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        kind = type(x).__qualname__
        count[kind] += 1
        with contextlib.suppress(TypeError):
            size[kind] += sys.getsizeof(x)
        if kind == "str":
            # CPython 3.11's PyASCIIObject: the state bit field after refcount, type, length
            # and hash; its low two bits say whether the string is interned.
            if ctypes.c_uint.from_address(id(x) + 32).value & 3:
                interned[_shape(x)] += 1  # type: ignore[arg-type]
            n_str += 1
            if len(strings) < samples:
                strings.append(x[:80])  # type: ignore[index]
            elif random.random() < samples / n_str:
                strings[random.randrange(samples)] = x[:80]  # type: ignore[index]
        stack.extend(gc.get_referents(x))
    return {
        "types": {k: [count[k], size[k]] for k, _ in size.most_common(200)},
        "strings": strings,
        "interned": dict(interned.most_common(30)),
    }


def _pool_survey(sparse_below: float = 0.25) -> dict[str, object]:
    """Python's small objects by 1 MiB window of address: how full the windows are, and what
    lives in the sparse ones (see the module's docstring)."""
    import gc
    from collections import Counter

    window_bytes: Counter[int] = Counter()
    seen: set[int] = set()
    small: list[tuple[int, int, str, str]] = []
    stack: list[object] = gc.get_objects()
    seen.update((id(seen), id(small), id(stack)))
    tracing = tracemalloc.is_tracing()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        try:
            size = sys.getsizeof(x)
        except TypeError:
            continue
        if gc.is_tracked(x):
            size += 16  # the collector's header, allocated with the object
        if size <= 512:
            window = id(x) >> 20
            window_bytes[window] += size
            where = ""
            if tracing:
                tb = tracemalloc.get_object_traceback(x)
                if tb is not None:  # the newest frames, innermost last
                    where = " < ".join(
                        f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(tb[-3:])
                    )
            small.append((window, size, type(x).__qualname__, where))
        stack.extend(gc.get_referents(x))
    sparse = {w for w, b in window_bytes.items() if b < sparse_below * (1 << 20)}
    by_kind: Counter[str] = Counter()
    by_kind_n: Counter[str] = Counter()
    for window, size, kind, where in small:
        if window in sparse:
            by_kind[f"{kind} {where}".strip()] += size
            by_kind_n[f"{kind} {where}".strip()] += 1
    fill = sorted(b / (1 << 20) for b in window_bytes.values())
    return {
        "windows": len(window_bytes),
        "sparse_windows": len(sparse),
        "found_mb": round(sum(window_bytes.values()) / 1e6, 2),
        "sparse_found_mb": round(sum(window_bytes[w] for w in sparse) / 1e6, 2),
        "fill_deciles": [round(fill[int(i * (len(fill) - 1) / 10)], 3) for i in range(11)]
        if fill
        else [],
        "sparse_top": [
            {"kind": k, "bytes": b, "n": by_kind_n[k]} for k, b in by_kind.most_common(40)
        ],
    }


def _run(out: Path, t0: float) -> None:
    time.sleep(1.0)
    if "serve" not in sys.argv:
        tracemalloc.stop()
        return
    store = sys.argv[sys.argv.index("--store") + 1] if "--store" in sys.argv else None
    snaps = [float(s) for s in os.environ.get("SOAK_PROBE_SNAPS", "120,230").split(",")]
    trim = os.environ.get("SOAK_PROBE_TRIM") == "1"
    libc = ctypes.CDLL("libc.so.6")
    out.mkdir(parents=True, exist_ok=True)
    maps_every = float(os.environ.get("SOAK_PROBE_MAPS_EVERY", "60"))
    big_at = [float(v) for v in os.environ.get("SOAK_PROBE_BIG", "").split(",") if v]
    pools_at = [float(v) for v in os.environ.get("SOAK_PROBE_POOLS", "").split(",") if v]
    census_at = [float(v) for v in os.environ.get("SOAK_PROBE_CENSUS", "").split(",") if v]
    next_maps = 0.0
    with open(out / "probe.jsonl", "a") as log, open(out / "maps.jsonl", "a") as maps:
        while True:
            time.sleep(10.0)
            t = time.monotonic() - t0
            row: dict[str, object] = {"t": round(t, 1)}
            if trim:
                started = time.perf_counter()
                libc.malloc_trim(0)
                row["trim_ms"] = round((time.perf_counter() - started) * 1000, 2)
            row |= {"calls": _claims(store), "blocks": sys.getallocatedblocks()}
            rows = _mappings()
            row |= (
                _proc()
                | _mallinfo()
                | _maps(rows)
                | _pymalloc(out / "mallocstats.txt")
                | _arrow()
                | {"threads": len(os.listdir("/proc/self/task"))}
            )
            if tracemalloc.is_tracing():
                row["traced"] = tracemalloc.get_traced_memory()[0]
                if snaps and t >= snaps[0]:
                    snaps.pop(0)
                    name = out / f"snap-{int(t)}-{row['calls']}.pickle"
                    tracemalloc.take_snapshot().dump(str(name))
            log.write(json.dumps(row) + "\n")
            log.flush()
            if big_at and t >= big_at[0]:
                big_at.pop(0)
                with open(out / "big.jsonl", "a") as big:
                    big.write(
                        json.dumps({"t": row["t"], "calls": row["calls"], "big": _big_objects()})
                        + "\n"
                    )
            if pools_at and t >= pools_at[0]:
                pools_at.pop(0)
                with open(out / "pools.jsonl", "a") as pools:
                    survey = {"t": row["t"], "calls": row["calls"], **_pool_survey()}
                    pools.write(json.dumps(survey) + "\n")
            if census_at and t >= census_at[0]:
                census_at.pop(0)
                with open(out / "census.jsonl", "a") as census:
                    taken = {"t": row["t"], "calls": row["calls"], **_census()}
                    census.write(json.dumps(taken) + "\n")
            if t >= next_maps:
                next_maps += maps_every
                maps.write(json.dumps({"t": row["t"], "calls": row["calls"], "maps": rows}))
                maps.write("\n")
                maps.flush()


if os.environ.get("SOAK_PROBE_OUT"):
    if os.environ.get("SOAK_PROBE_NO_THP") == "1":
        # prctl(PR_SET_THP_DISABLE, 1): no transparent huge pages for this process (inherited
        # by its children), to tell their share of RSS from the process's own growth.
        ctypes.CDLL("libc.so.6").prctl(41, 1, 0, 0, 0)
    if os.environ.get("SOAK_PROBE_TRACE") == "1":
        tracemalloc.start(int(os.environ.get("SOAK_PROBE_FRAMES", "1")))
    threading.Thread(
        target=_run,
        args=(Path(os.environ["SOAK_PROBE_OUT"]), time.monotonic()),
        daemon=True,
        name="soak-probe",
    ).start()
