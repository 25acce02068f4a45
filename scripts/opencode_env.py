"""A real OpenCode (npm `opencode-ai`, pinned) run offline against a local OpenAI-compatible server.

    python scripts/opencode_env.py install [--cache DIR]
    python scripts/opencode_env.py capture --out DIR [--cache DIR]   # record real request bodies

From Python (the test suite)::

    from scripts.opencode_env import opencode_run
    done = opencode_run(base_url, "list the files", files=[png], cwd=tmp, timeout=120)

OpenCode is installed once into `<cache>/opencode-<version>/` (cache: `$CAPTURE_PROXY_CACHE`, else
`~/.cache/capture-proxy`). Each run gets a fresh temporary HOME holding its `opencode.json`, so no
user configuration, session database or credentials leak in, and nothing is fetched: the provider
package `@ai-sdk/openai-compatible` is bundled in the OpenCode binary (checked: runs in a network
namespace with loopback only, see docs/reports/e2e.md), and the models.dev fetch is disabled.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

OPENCODE_VERSION = "1.18.33"
PROVIDER_ID = "local"
MODEL_ID = "policy"
API_KEY = "sk-capture-proxy-test"  # OpenCode needs some key; sent as `Authorization: Bearer ...`


def default_cache() -> Path:
    """`$CAPTURE_PROXY_CACHE`, else `~/.cache/capture-proxy`."""
    env = os.environ.get("CAPTURE_PROXY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "capture-proxy"


def _binary_candidates(root: Path) -> list[Path]:
    modules = root / "node_modules"
    # `opencode-ai/bin/opencode.exe` is the platform binary once the package's postinstall has
    # linked it; if npm skipped install scripts, the platform package's own binary is the same file.
    return [
        modules / "opencode-ai" / "bin" / "opencode.exe",
        modules / "opencode-linux-x64" / "bin" / "opencode",
        modules / "opencode-linux-x64-baseline" / "bin" / "opencode",
        modules / "opencode-linux-arm64" / "bin" / "opencode",
    ]


def _working_binary(root: Path) -> Path | None:
    for candidate in _binary_candidates(root):
        if not candidate.is_file():
            continue
        try:
            done = subprocess.run(
                [str(candidate), "--version"],
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "HOME": tempfile.gettempdir()},
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and done.stdout.strip() == OPENCODE_VERSION:
            return candidate
    return None


def install(cache_dir: Path | None = None) -> Path:
    """Install `opencode-ai@<version>` into the cache (reused when present); return its binary."""
    root = Path(cache_dir or default_cache()) / f"opencode-{OPENCODE_VERSION}"
    found = _working_binary(root)
    if found:
        return found
    root.mkdir(parents=True, exist_ok=True)
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not on PATH: OpenCode is installed from the npm registry")
    cmd = [npm, "install", "--no-audit", "--no-fund", "--no-save", "--loglevel=error"]
    done = subprocess.run(
        [*cmd, "--prefix", str(root), f"opencode-ai@{OPENCODE_VERSION}"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    found = _working_binary(root)
    if done.returncode != 0 or found is None:
        raise RuntimeError(
            f"npm install opencode-ai@{OPENCODE_VERSION} failed:\n{done.stderr[-3000:]}"
        )
    return found


def config(
    base_url: str,
    *,
    model_options: Mapping[str, Any] | None = None,
    interleaved_field: str | None = "reasoning",
    extra_headers: Mapping[str, str] | None = None,
    context_limit: int = 32768,
    output_limit: int = 256,
    image_input: bool = True,
) -> dict[str, Any]:
    """The `opencode.json` `opencode_run` writes: one provider, one model `local/policy`.

    `limit.output` matters: without it OpenCode asks for `max_tokens: 32000`. `limit.context` must
    match the server's max model length: OpenCode's prompt alone is ~16k tokens for the tiny
    model, and a smaller limit makes OpenCode compact the session after every call, forever.
    `interleaved_field=None` leaves the key out (OpenCode's default replay); `model_options`
    are copied by OpenCode to the top level of every request body.
    `image_input=False` declares a text-only model (`attachment: false`, text modality only), as
    the tiny vLLM model is: vLLM answers 400 "not a multimodal model" to any image part.
    """
    model: dict[str, Any] = {
        "name": MODEL_ID,
        "tool_call": True,
        "reasoning": True,
        "attachment": image_input,
        "temperature": True,
        "modalities": {"input": ["text", "image"] if image_input else ["text"], "output": ["text"]},
        "limit": {"context": context_limit, "output": output_limit},
        "options": dict(model_options or {}),
    }
    if interleaved_field is not None:
        model["interleaved"] = {"field": interleaved_field}
    options: dict[str, Any] = {"baseURL": base_url, "apiKey": API_KEY}
    if extra_headers:
        options["headers"] = dict(extra_headers)
    conf: dict[str, Any] = {
        "model": f"{PROVIDER_ID}/{MODEL_ID}",
        "small_model": f"{PROVIDER_ID}/{MODEL_ID}",
        "autoupdate": False,
        "share": "disabled",
        "lsp": False,
        "formatter": False,
        "permission": {"bash": "allow", "edit": "allow", "webfetch": "deny"},
        "provider": {
            PROVIDER_ID: {
                "npm": "@ai-sdk/openai-compatible",
                "name": "capture-proxy test upstream",
                "options": options,
                "models": {MODEL_ID: model},
            }
        },
    }
    return conf


def run_env(home: Path) -> dict[str, str]:
    """Environment for OpenCode: everything under `home`, no fetches, no update checks."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TERM", "TZ")}
    return {
        **keep,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_CLAUDE_CODE": "1",
        "NO_COLOR": "1",
    }


def _run_group(
    cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run` in a new process group, the whole group killed on timeout.

    OpenCode runs its tools (bash) as child processes: killing only OpenCode on a timeout would
    leave them running after the test.
    """
    proc = subprocess.Popen(
        cmd,
        cwd=str(cwd),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        _kill_group(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from exc
    except BaseException:
        _kill_group(proc)
        proc.communicate()
        raise
    # Anything OpenCode left behind in its group (a backgrounded tool) goes too.
    _kill_group(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def opencode_run(
    base_url: str,
    prompt: str,
    *,
    files: Sequence[Path | str] = (),
    title: str | None = None,
    cwd: Path | str,
    timeout: float,
    model_options: Mapping[str, Any] | None = None,
    interleaved_field: str | None = "reasoning",
    extra_headers: Mapping[str, str] | None = None,
    output_limit: int = 256,
    image_input: bool = True,
    output_format: str = "json",
    cache_dir: Path | None = None,
    home: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `opencode run PROMPT [--file F ...] [--title T]` against `base_url` and wait for it.

    `base_url` is the OpenAI base (ending in `/v1`). The message comes before `--file` (an array
    flag that would swallow it otherwise). Without `title` OpenCode first makes a title-generation
    call. `home` (default: a fresh temp dir, removed afterwards) holds config, logs and the
    session database; pass one to inspect them. Raises `subprocess.TimeoutExpired` after
    `timeout` seconds (the process is killed). stdout is OpenCode's JSON event lines by default.
    """
    binary = install(cache_dir)
    owned = home is None
    home_dir = Path(tempfile.mkdtemp(prefix="opencode-home-")) if home is None else Path(home)
    try:
        conf_dir = home_dir / ".config" / "opencode"
        conf_dir.mkdir(parents=True, exist_ok=True)
        conf = config(
            base_url,
            model_options=model_options,
            interleaved_field=interleaved_field,
            extra_headers=extra_headers,
            output_limit=output_limit,
            image_input=image_input,
        )
        (conf_dir / "opencode.json").write_text(json.dumps(conf, indent=2))
        cmd = [str(binary), "run", prompt]
        for f in files:
            cmd += ["--file", str(f)]
        if title is not None:
            cmd += ["--title", title]
        cmd += ["--model", f"{PROVIDER_ID}/{MODEL_ID}", "--format", output_format]
        return _run_group(cmd, cwd=Path(cwd), env=run_env(home_dir), timeout=timeout)
    finally:
        if owned:
            shutil.rmtree(home_dir, ignore_errors=True)


# --- recording server: what OpenCode really sends -------------------------------------------

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
TOOL_CALL_SSE = Path("/work/shared/fixtures/vllm-0.32.0/tool-call-stream.sse")


def _chunk(cid: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = None
    body = {"id": cid, "object": "chat.completion.chunk", "created": 1795980253, "model": MODEL_ID}
    return b"data: " + json.dumps({**body, "choices": [choice]}).encode() + b"\n\n"


def text_stream(cid: str, reasoning: str, content: str) -> bytes:
    """A streamed answer in vLLM 0.32's shape (role chunk, `delta.reasoning`, `delta.content`,
    finish chunk with `stop_reason`, usage chunk with empty `choices`, `[DONE]`)."""
    out = [_chunk(cid, {"role": "assistant", "content": ""})]
    out += [_chunk(cid, {"reasoning": w}) for w in reasoning.split(" ") if w]
    out += [_chunk(cid, {"content": w}) for w in content.split(" ") if w]
    out.append(_chunk(cid, {}, "stop"))
    usage = {"prompt_tokens": 100, "total_tokens": 110, "completion_tokens": 10}
    tail = {"id": cid, "object": "chat.completion.chunk", "created": 1795980253, "model": MODEL_ID}
    out.append(b"data: " + json.dumps({**tail, "choices": [], "usage": usage}).encode() + b"\n\n")
    return b"".join([*out, b"data: [DONE]\n\n"])


def tool_call_stream(fixture: bytes, reasoning: str) -> bytes:
    """The real vLLM tool-call stream (a `bash` call of `{"command": "ls -la"}`), with reasoning
    deltas put after its role chunk, so that OpenCode has reasoning to replay."""
    events = fixture.split(b"\n\n")
    first = json.loads(events[0].removeprefix(b"data: "))
    extra = b"".join(_chunk(first["id"], {"reasoning": w + " "}) for w in reasoning.split(" "))
    return events[0] + b"\n\n" + extra + b"\n\n".join(events[1:])


class Recorder:
    """An aiohttp app that records every request and answers chat completions as vLLM would.

    A request without tools is answered as a title; the first call with tools and no tool result
    yet gets the tool call; later calls get a plain text answer, which ends OpenCode's loop.
    """

    def __init__(self, tool_call_sse: bytes, *, title_delay_s: float = 0.0) -> None:
        import time

        self.requests: list[dict[str, Any]] = []
        # A slow title answer shows whether OpenCode waits for it before its main call.
        self.title_delay_s = title_delay_s
        self._tool_call_sse = tool_call_sse
        self._clock = time.monotonic
        self._t0 = time.monotonic()

    def _ms(self) -> int:
        return round((self._clock() - self._t0) * 1000)

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    def answer(self, body: dict[str, Any]) -> bytes:
        n = len(self.requests)
        if not body.get("tools"):
            return text_stream(f"chatcmpl-title{n}", "A title.", "Listing files")
        if not any(m.get("role") == "tool" for m in body.get("messages", [])):
            return tool_call_stream(self._tool_call_sse, "I should list the files.")
        return text_stream(f"chatcmpl-text{n}", "The listing is done.", "Here are the files.")

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        # Arrival and completion times tell whether OpenCode overlaps calls (title vs main).
        entry = {
            "method": request.method,
            "path": request.path_qs,
            "headers": dict(request.headers),
            "body": body,
            "received_ms": self._ms(),
        }
        self.requests.append(entry)
        if request.method != "POST" or not request.path.endswith("/chat/completions"):
            return web.json_response({"error": {"message": "not found", "code": 404}}, status=404)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if isinstance(body, dict) and not body.get("tools") and self.title_delay_s:
            import asyncio

            await asyncio.sleep(self.title_delay_s)
        try:
            await resp.write(self.answer(body if isinstance(body, dict) else {}))
            await resp.write_eof()
        except ConnectionError:
            # OpenCode exits without waiting for its title call: record that it hung up.
            entry["client_closed_ms"] = self._ms()
            return resp
        entry["answered_ms"] = self._ms()
        return resp


def tiny_png() -> bytes:
    """An 8x8 RGB PNG (a red-green gradient), built without an imaging library."""
    import struct
    import zlib

    rows = b"".join(
        b"\x00" + bytes(v for x in range(8) for v in (x * 32, y * 32, 128)) for y in range(8)
    )

    def part(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + part(b"IHDR", header)
        + part(b"IDAT", zlib.compress(rows))
        + part(b"IEND", b"")
    )


SCENARIOS: dict[str, dict[str, Any]] = {
    # The e2e shape: a title call, then the agent loop with a bash tool call, an image attached.
    "image-tool": {
        "files": True,
        "title": None,
        "interleaved_field": "reasoning",
        "title_delay_s": 3.0,
    },
    # `--title` given: OpenCode should skip its title-generation call.
    "titled": {"files": False, "title": "fixed title", "interleaved_field": "reasoning"},
    # No `interleaved` on the model: which field replays reasoning then?
    "no-interleaved": {"files": False, "title": "fixed title", "interleaved_field": None},
    # An image attached to a model declared text-only (what the tiny vLLM model is).
    "image-text-only": {
        "files": True,
        "title": "fixed title",
        "interleaved_field": "reasoning",
        "image_input": False,
    },
}


async def _record(
    name: str, work: Path, home: Path, cache_dir: Path | None, limit_s: float
) -> tuple[list[dict[str, Any]], subprocess.CompletedProcess[str]]:
    import asyncio

    from aiohttp import web

    fixture = await asyncio.to_thread(TOOL_CALL_SSE.read_bytes)
    recorder = Recorder(fixture, title_delay_s=SCENARIOS[name].get("title_delay_s", 0.0))
    runner = web.AppRunner(recorder.app())
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        spec = SCENARIOS[name]
        done = await asyncio.to_thread(
            opencode_run,
            f"http://127.0.0.1:{port}/v1",
            "list the files",
            files=[work / "img.png"] if spec["files"] else [],
            title=spec["title"],
            cwd=work,
            timeout=limit_s,
            interleaved_field=spec["interleaved_field"],
            image_input=spec.get("image_input", True),
            cache_dir=cache_dir,
            home=home,
        )
    finally:
        await runner.cleanup()
    return recorder.requests, done


def capture(
    out: Path, *, cache_dir: Path | None = None, timeout: float = 180.0, keep_home: bool = False
) -> int:
    """Run every scenario against a `Recorder`; write `<scenario>-NN.json` files into `out`.

    Returns the highest OpenCode exit code. Each run gets its own work dir (holding `notes.txt`
    and an 8x8 `img.png`) and HOME; `keep_home` keeps the HOMEs (logs, session DB) and prints them.
    """
    import asyncio

    out.mkdir(parents=True, exist_ok=True)
    worst = 0
    for name in SCENARIOS:
        work = Path(tempfile.mkdtemp(prefix="opencode-work-"))
        home = Path(tempfile.mkdtemp(prefix=f"opencode-home-{name}-"))
        try:
            (work / "notes.txt").write_text("hello\n")
            (work / "img.png").write_bytes(tiny_png())
            requests, done = asyncio.run(_record(name, work, home, cache_dir, timeout))
        finally:
            shutil.rmtree(work, ignore_errors=True)
            if not keep_home:
                shutil.rmtree(home, ignore_errors=True)
        for i, req in enumerate(requests, 1):
            text = json.dumps(req, indent=2, sort_keys=True) + "\n"
            (out / f"{name}-{i:02d}.json").write_text(text)
        (out / f"{name}-stdout.jsonl").write_text(done.stdout)
        kept = f", home kept at {home}" if keep_home else ""
        print(f"{name}: exit {done.returncode}, {len(requests)} requests{kept}", file=sys.stderr)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
        worst = max(worst, done.returncode)
    return worst


def _offline(argv: list[str]) -> int:
    """Re-run this script in a new network namespace with only loopback up (proves no fetch)."""
    shell = 'ip link set lo up && exec "$@"'
    cmd = ["unshare", "--net", "--", "sh", "-c", shell, "sh", sys.executable, __file__, *argv]
    return subprocess.run(cmd, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="opencode_env.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    inst = sub.add_parser("install")
    inst.add_argument("--cache", type=Path, default=None)
    cap = sub.add_parser("capture", help="run OpenCode against a recording server")
    cap.add_argument("--cache", type=Path, default=None)
    cap.add_argument("--out", type=Path, required=True)
    cap.add_argument("--timeout", type=float, default=180.0)
    cap.add_argument("--keep-home", action="store_true", help="keep each run's HOME")
    cap.add_argument("--offline", action="store_true", help="run in a loopback-only netns (root)")
    args = parser.parse_args(argv)
    if args.cmd == "install":
        print(install(args.cache))
        return 0
    if args.offline:
        install(args.cache)  # needs the registry; the capture itself must not
        rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--offline"]
        return _offline(rest)
    return capture(args.out, cache_dir=args.cache, timeout=args.timeout, keep_home=args.keep_home)


if __name__ == "__main__":
    sys.exit(main())
