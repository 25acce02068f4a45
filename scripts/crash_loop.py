"""SIGKILL ``capture-proxy serve`` at random moments under load, round after round, on one store.

    python -m scripts.crash_loop --store sqlite --rounds 20 [--seed N] [--concurrency 16]
    python -m scripts.crash_loop --store parquet --rounds 20

Each round starts a real proxy process on the same store (no manual step between rounds) in front
of the fake vLLM (its own process), sends agent-like traffic (multi-turn sessions, about half of
the calls streamed, some with images) from many concurrent sandboxes, and kills the proxy with
SIGKILL after a random, seeded delay. Then, with the proxy dead:

- every call a client saw as ``staged`` (header, or the stream's ``: capture-status`` line) is in
  the store, in the rollout the client sent it to, and its digest verifies (`Store.fetch`);
- `Store.verify` passes: no torn record, no attachment without its record;
- no rollout holds two records with the same sequence number.

The sessions carry on into the next round, so each restarted proxy resumes their rollouts from the
store (it logs ``resumed rollout ... from the store``). A last round stops the proxy with SIGTERM
and every rollout's trajectory is built. Prints one JSON line per round and a JSON summary; exits
1 at the first violation. ``tests/reliability/test_reliability_crash.py`` runs a short variant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from capture_proxy.read.reader import open_store
from tests.support.reliability_workers import Loader, start_fake, start_proxy


class Violation(AssertionError):
    """The store broke a promise of docs/contract.md ("Durability") after a kill."""


@dataclass
class Round:
    round: int
    killed_after_s: float  # after the round's first acknowledged call
    exit: str  # "SIGKILL", or "SIGTERM rc=0" for the last, clean round
    start_s: float  # spawn to listening: the restart on the same store
    acked: int  # calls acknowledged as staged in this round
    acked_total: int
    records: int  # records in the store after the round
    resumed: int  # rollouts the new process resumed from the store (its log says so)
    leftovers: int  # temporary files of writes the kill cut short (ignored by readers)
    verify_s: float


#: What the clients of the last `crash_loop` got, by outcome (for the summary).
outcomes: Counter[str] = Counter()


def store_url(kind: str, folder: Path) -> str:
    return f"sqlite:///{folder / 'crash.db'}" if kind == "sqlite" else f"parquet:///{folder / 'ds'}"


def check_store(url: str, acked: dict[str, str], *, trajectories: bool = False) -> int:
    """Raise `Violation` unless every acknowledged call is there and the store verifies."""
    with open_store(url) as store:
        keys = list(acked)
        try:
            records = store.fetch(keys)  # present, and each digest verifies
        except Exception as e:
            raise Violation(f"an acknowledged call is missing or corrupt: {e!r}") from e
        for record in records:
            if record.rollout_id != acked[record.call_id]:
                raise Violation(f"{record.call_id} is in {record.rollout_id}, not its rollout")
        try:
            store.verify()
        except Exception as e:
            raise Violation(str(e)) from e
        total = 0
        for rollout_id in store.rollouts():
            seqs = [
                r.seq
                for r in store.calls(
                    rollout_id, include_orphaned=True, include_open=True, include_poisoned=True
                )
            ]
            if len(seqs) != len(set(seqs)):
                raise Violation(f"rollout {rollout_id} has two records with one seq: {seqs}")
            total += len(seqs)
            if trajectories:
                store.trajectory(rollout_id, include_open=True, include_poisoned=True)
        return total


def _leftovers(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*") if p.name.endswith((".tmp", "-journal")))


async def crash_loop(
    kind: str,
    folder: Path,
    *,
    rounds: int,
    seed: int = 20261129,
    concurrency: int = 16,
    kill_after: tuple[float, float] = (0.5, 2.5),
    on_round: Callable[[Round], None] | None = None,
) -> list[Round]:
    """Run the loop (`rounds` kills, then one clean stop); the rounds, or raise `Violation`."""
    await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
    url = store_url(kind, folder)
    rng = random.Random(seed)
    loader = Loader(f"crash-{kind}", concurrency=concurrency, seed=seed)
    fake = start_fake(latency=0.02, chunk_delay=0.002)
    done: list[Round] = []
    outcomes.clear()
    try:
        for n in range(rounds + 1):
            last = n == rounds
            t0 = time.perf_counter()
            proxy = start_proxy(fake.url, url)
            base = await asyncio.to_thread(proxy.wait_ready)
            start_s = time.perf_counter() - t0
            before = len(loader.acked)
            loader.start(base)
            # The random moment is counted from the round's first acknowledged call, so a slow
            # start on a loaded machine cannot turn a round into a kill before any work.
            for _ in range(600):
                if len(loader.acked) > before:
                    break
                await asyncio.sleep(0.05)
            delay = rng.uniform(*kill_after)
            await asyncio.sleep(delay)
            if last:
                await loader.stop()
                rc = await asyncio.to_thread(proxy.terminate)
                exit_ = f"SIGTERM rc={rc}"
                if rc != 0:
                    raise Violation(f"the proxy did not stop cleanly (rc {rc}):\n{proxy.output()}")
            else:
                await asyncio.to_thread(proxy.kill)
                await loader.stop()
                exit_ = "SIGKILL"
            t1 = time.perf_counter()
            records = await asyncio.to_thread(
                check_store, url, dict(loader.acked), trajectories=last
            )
            result = Round(
                round=n,
                killed_after_s=round(delay, 3),
                exit=exit_,
                start_s=round(start_s, 2),
                acked=len(loader.acked) - before,
                acked_total=len(loader.acked),
                records=records,
                resumed=sum("resumed rollout" in line for line in proxy.lines),
                leftovers=_leftovers(folder),
                verify_s=round(time.perf_counter() - t1, 2),
            )
            if result.acked == 0:
                raise Violation(f"round {n}: the restarted proxy staged nothing:\n{proxy.output()}")
            done.append(result)
            if on_round is not None:
                on_round(result)
    finally:
        fake.kill()
        outcomes.update(loader.outcomes)
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=["sqlite", "parquet"], default="sqlite")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=20261129)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--dir", type=Path, default=None, help="store folder (default: a temp dir)")
    args = parser.parse_args()
    folder = args.dir or Path(tempfile.mkdtemp(prefix=f"crash-{args.store}-"))
    started = time.perf_counter()
    try:
        rounds = asyncio.run(
            crash_loop(
                args.store,
                folder,
                rounds=args.rounds,
                seed=args.seed,
                concurrency=args.concurrency,
                on_round=lambda r: print(json.dumps(asdict(r)), flush=True),
            )
        )
    except Violation as e:
        print(f"VIOLATION: {e}", file=sys.stderr)
        return 1
    summary = {
        "store": args.store,
        "folder": str(folder),
        "kills": sum(r.exit == "SIGKILL" for r in rounds),
        "acked": rounds[-1].acked_total,
        "records": rounds[-1].records,
        "max_leftovers": max(r.leftovers for r in rounds),
        "restart_s_max": max(r.start_s for r in rounds),
        "seconds": round(time.perf_counter() - started, 1),
        "outcomes": dict(outcomes),
    }
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
