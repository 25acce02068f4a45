"""What the proxy knows about its upstream: version, reasoning field, tokenizer fingerprint.

All of it is fetched lazily (a sidecar may start before vLLM is up) and fetched again after the
upstream was unreachable (it may have restarted with another model or tokenizer).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from array import array
from dataclasses import dataclass

import aiohttp
import orjson

from ..errors import UpstreamFailed

__all__ = ["PROBE_MESSAGES", "Upstream", "UpstreamInfo", "reasoning_field_for"]

log = logging.getLogger("capture_proxy.upstream")

#: The fixed conversation whose token ids fingerprint the upstream's tokenizer + chat template.
PROBE_MESSAGES = [
    {"role": "system", "content": "capture-proxy tokenizer probe v1"},
    {"role": "user", "content": 'Hello, world! 0123456789 {"k": [1, 2.5]} ü 漢字 🙂\n\tend'},
]
_REFRESH_SECONDS = 300.0


def reasoning_field_for(version: str) -> str:
    """vLLM 0.16–0.21 read replayed reasoning only as `reasoning`; others `reasoning_content`."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    if m and int(m.group(1)) == 0 and 16 <= int(m.group(2)) <= 21:
        return "reasoning"
    return "reasoning_content"


@dataclass(frozen=True, slots=True)
class UpstreamInfo:
    version: str
    reasoning_field: str
    fingerprint: str


class Upstream:
    """The upstream vLLM: base URL, auth header, and lazily fetched facts about it."""

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        *,
        api_key: str = "",
        reasoning_field: str = "auto",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.session = session
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._reasoning_setting = reasoning_field
        self._version: str | None = None
        self._fingerprints: dict[str, str] = {}
        self._fetched_at = 0.0
        self._lock = asyncio.Lock()

    def url(self, path: str) -> str:
        return self.base_url + path

    def mark_stale(self) -> None:
        """Called after the upstream was unreachable: fetch version and fingerprint again."""
        self._version = None
        self._fingerprints.clear()

    async def info(self, model: str) -> UpstreamInfo:
        if time.monotonic() - self._fetched_at > _REFRESH_SECONDS:
            self.mark_stale()
        if self._version is None or model not in self._fingerprints:
            async with self._lock:
                if self._version is None:
                    self._version = await self._fetch_version()
                    self._fetched_at = time.monotonic()
                if model not in self._fingerprints:
                    self._fingerprints[model] = await self._fetch_fingerprint(model)
        version = self._version or ""
        field = self._reasoning_setting
        if field == "auto":
            field = reasoning_field_for(version)
        return UpstreamInfo(version, field, self._fingerprints.get(model, ""))

    async def count_prompt_tokens(self, request: dict[str, object]) -> int:
        """The prompt's token count from the upstream's /tokenize (the context guard)."""
        body = {
            k: request[k]
            for k in ("model", "messages", "tools", "chat_template_kwargs", "add_generation_prompt")
            if k in request
        }
        try:
            async with self.session.post(
                self.url("/tokenize"),
                data=orjson.dumps(body),
                headers={**self.headers, "Content-Type": "application/json"},
            ) as resp:
                data = orjson.loads(await resp.read())
                if resp.status != 200:
                    raise UpstreamFailed(
                        f"the context guard could not tokenize the prompt: upstream /tokenize "
                        f"answered {resp.status}",
                        code="context_guard",
                    )
                return int(data["count"])
        except (
            aiohttp.ClientError,
            TimeoutError,
            orjson.JSONDecodeError,
            KeyError,
            TypeError,
        ) as e:
            raise UpstreamFailed(
                f"the context guard could not tokenize the prompt: {type(e).__name__}: {e}",
                code="context_guard",
            ) from None

    async def _fetch_version(self) -> str:
        try:
            async with self.session.get(self.url("/version"), headers=self.headers) as resp:
                if resp.status == 200:
                    body = orjson.loads(await resp.read())
                    return str(body.get("version", ""))
                log.warning("upstream /version answered %d", resp.status)
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, AttributeError) as e:
            log.warning("upstream /version failed: %s", e)
        return ""

    async def _fetch_fingerprint(self, model: str) -> str:
        body = {"model": model, "messages": PROBE_MESSAGES, "add_generation_prompt": True}
        try:
            async with self.session.post(
                self.url("/tokenize"),
                data=orjson.dumps(body),
                headers={**self.headers, "Content-Type": "application/json"},
            ) as resp:
                if resp.status != 200:
                    log.warning(
                        "upstream /tokenize answered %d: no tokenizer fingerprint", resp.status
                    )
                    return ""
                tokens = orjson.loads(await resp.read())["tokens"]
        except (
            aiohttp.ClientError,
            TimeoutError,
            orjson.JSONDecodeError,
            KeyError,
            TypeError,
        ) as e:
            log.warning("upstream /tokenize failed: %s: no tokenizer fingerprint", e)
            return ""
        try:
            ids = array("i", tokens)
        except (TypeError, OverflowError):
            return ""
        return "sha256:" + hashlib.sha256(ids.tobytes()).hexdigest()
