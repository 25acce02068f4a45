"""An image-heavy agent session through the proxy to the real tiny VLM, beside a text session.

    .venv/bin/python bench/bench_images.py [--upstream http://127.0.0.1:PORT] [--turns 20]

Plays an OpenCode-like visual coding session through ``capture-proxy serve`` (SQLite store) in
front of the real vLLM 0.32 serving the tiny Qwen2.5-VL of scripts/tiny_vlm.py (started here
unless `--upstream` names one already running, which must be idle): a ~16 KB system prompt, the
task image, then `--turns` calls, each replaying the model's previous answer and adding a user
message with a new crop (a 160x160 PNG of the task image, as an agent's crop tool gives it). The
text session is the same with each crop replaced by a line of text. Each session runs on the plain
path and with ``--token-in on``, each in a proxy process of its own.

Prints one JSON object: per session and mode, the proxy's CPU seconds per call (user + system of
the proxy process, /proc), its peak RSS over the session (VmHWM after a reset) and RSS at the end,
the wall time per call, the store's size, and for the image sessions the bytes stored per image
(the attachments' bytes, and the store's growth over the text session's, per image) beside the
PNG's own size, and the session's segments (1: token-in bridged every call). Calls are
sequential (one session): this measures the proxy's cost per image call, not throughput.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import socket
import sqlite3
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from typing import Any

from procstat import cpu_seconds, peak_rss_mb, reset_peak_rss, rss_mb

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from capture_proxy.read.reader import open_store  # noqa: E402
from scripts import tiny_vllm, tiny_vlm  # noqa: E402

SYSTEM = {
    "role": "system",
    "content": ("You are a visual coding agent; crop and plot images to check your work. " * 220)[
        :16_000
    ],
}


def png(width: int, height: int, pixels: bytes) -> bytes:
    """An RGB PNG of `pixels` (width * height * 3 bytes), written with zlib alone."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    rows = b"".join(b"\x00" + pixels[y * width * 3 : (y + 1) * width * 3] for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows, 6))
        + chunk(b"IEND", b"")
    )


class TaskImage:
    """A 512x512 'screenshot': flat panels with noise, so crops compress as real UI crops do."""

    SIZE = 512

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        pixels = bytearray()
        for y in range(self.SIZE):
            for x in range(self.SIZE):
                base = ((x // 64) * 31 + (y // 64) * 57) % 200
                noise = rng.randrange(24)
                pixels += bytes((base + noise, (base * 3 + noise) % 256, 255 - base))
        self.pixels = bytes(pixels)

    def crop(self, x: int, y: int, size: int) -> bytes:
        rows = (
            self.pixels[((y + r) * self.SIZE + x) * 3 : ((y + r) * self.SIZE + x + size) * 3]
            for r in range(size)
        )
        return png(size, size, b"".join(rows))

    def whole(self) -> bytes:
        return png(self.SIZE, self.SIZE, self.pixels)


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def post(url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
    )
    try:
        resp = urllib.request.urlopen(req, timeout=300)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{e.code}: {e.read()[:1000]!r}") from None
    with resp:
        answer: dict[str, Any] = json.loads(resp.read())
        if resp.headers.get("X-Capture-Status") != "staged":
            raise RuntimeError(f"not staged: {resp.headers.get('X-Capture-Status')}")
        return answer


def start_proxy(upstream: str, store: Path, token_in: bool) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [sys.executable, "-m", "capture_proxy", "serve", "--upstream", upstream]
    argv += ["--store", f"sqlite:///{store}", "--port", str(port)]
    if token_in:
        argv += ["--token-in", "on"]
    log = (store.parent / f"{store.stem}.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2):
                return proc, url
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the proxy did not start (log {log.name})")


def session(url: str, turns: int, images: bool, rollout: str) -> dict[str, Any]:
    """Play one session; per-call wall times and the PNG bytes sent (each new image once)."""
    task = TaskImage(11)
    rng = random.Random(5)
    whole = task.whole()
    first: list[dict[str, Any]] = [{"type": "text", "text": "Make the page match this design."}]
    if images:
        first.append({"type": "image_url", "image_url": {"url": data_url(whole)}})
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": first}]
    sent, walls = [whole] if images else [], []
    for turn in range(turns + 1):
        body = {"model": "policy", "messages": messages, "max_tokens": 8, "temperature": 0}
        began = time.perf_counter()
        answer = post(f"{url}/v1/chat/completions", body, {"X-Rollout-Id": rollout})
        walls.append(time.perf_counter() - began)
        message = answer["choices"][0]["message"]
        replay: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("reasoning"):
            replay["reasoning"] = message["reasoning"]
        if turn == turns:
            break
        x, y = rng.randrange(0, 352), rng.randrange(0, 352)
        if images:
            crop = task.crop(x, y, 160)
            sent.append(crop)
            part: dict[str, Any] = {"type": "image_url", "image_url": {"url": data_url(crop)}}
        else:
            part = {"type": "text", "text": f"crop.png: the 160x160 region at ({x}, {y})."}
        messages = [*messages, replay, {"role": "user", "content": [part]}]
    return {"walls": walls, "png_bytes": [len(b) for b in sent]}


def measure(upstream: str, turns: int, images: bool, token_in: bool, work: Path) -> dict[str, Any]:
    name = f"{'image' if images else 'text'}-{'token-in' if token_in else 'plain'}"
    store = work / f"{name}.db"
    proc, url = start_proxy(upstream, store, token_in)
    try:
        # One call of another rollout first: imports and connections are not the session's cost.
        session(url, 0, images, f"{name}-warm")
        reset_peak_rss(proc.pid)
        cpu = cpu_seconds(proc.pid)
        played = session(url, turns, images, name)
        cpu = cpu_seconds(proc.pid) - cpu
        result: dict[str, Any] = {
            "calls": len(played["walls"]),
            "cpu_ms_per_call": round(1000 * cpu / len(played["walls"]), 1),
            "wall_ms_per_call": round(1000 * sum(played["walls"]) / len(played["walls"]), 1),
            "peak_rss_mb": round(peak_rss_mb(proc.pid), 1),
            "rss_end_mb": round(rss_mb(proc.pid), 1),
        }
    finally:
        proc.terminate()
        proc.wait(30)
    db = sqlite3.connect(store)
    try:
        (attached,) = db.execute("SELECT coalesce(sum(size), 0) FROM attachments").fetchone()
        (count,) = db.execute("SELECT count(*) FROM attachments").fetchone()
    finally:
        db.close()
    with open_store(f"sqlite:///{store}") as reader:
        result["segments"] = len(reader.trajectory(name, include_open=True).segments)
    result["store_bytes"] = sum(
        p.stat().st_size for p in work.glob(f"{store.name}*") if p.is_file()
    )
    if images:
        result["images"] = count
        result["png_bytes_per_image"] = round(sum(played["png_bytes"]) / len(played["png_bytes"]))
        result["attachment_bytes_per_image"] = round(attached / max(count, 1))
    return {name: result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--upstream", help="a running tiny VLM (default: start one)")
    parser.add_argument("--turns", type=int, default=20)
    args = parser.parse_args(argv)
    server = None
    upstream = args.upstream
    if upstream is None:
        port = tiny_vllm.free_port()
        server = tiny_vlm.start(None, port, scale_out=True)
        upstream = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {"turns": args.turns, "cpus": os.cpu_count()}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-images-") as tmp:
            for token_in in (False, True):
                for images in (False, True):
                    results.update(measure(upstream, args.turns, images, token_in, Path(tmp)))
    finally:
        if server is not None:
            tiny_vllm.stop(server)
    for mode in ("plain", "token-in"):
        image, text = results[f"image-{mode}"], results[f"text-{mode}"]
        image["store_growth_per_image"] = round(
            (image["store_bytes"] - text["store_bytes"]) / image["images"]
        )
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
