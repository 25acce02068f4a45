"""The checks every loaded value passes: ranges, upstream URLs, the tokens' strength."""

from __future__ import annotations

import math
import string
from collections.abc import Callable

from ._fields import Settings, SettingsError, _env, _flag

#: Words of the placeholders people leave in example files and templates.
_PLACEHOLDERS = ("changeme", "change-me", "change_me", "replace", "placeholder", "example", "xxxx")
_MIN_TOKEN = 16


#: Estimated bits a token needs (`token_bits`): ``openssl rand -hex 32`` has ~250.
_MIN_TOKEN_BITS = 64
_CLASSES = (
    frozenset(string.digits),
    frozenset(string.ascii_lowercase),
    frozenset(string.ascii_uppercase),
)


def token_bits(token: str) -> float:
    """A token's estimated entropy, in bits: the rule weak admin and reader tokens fail.

    Each character counts log2 of the size of the character classes the token draws from
    (digits 10, lower case 26, upper case 26, anything else 33), except a character that
    repeats the one before it or steps one up or down from it (``aaaa``, ``1234``, ``fedc``),
    which counts nothing: ``0123456789abcdef`` is 10 bits, ``password12345678`` 41,
    ``openssl rand -hex 32`` about 250. Words are not told apart from random letters, so a
    passphrase counts as its letters.
    """
    size = sum(len(c) for c in _CLASSES if any(ch in c for ch in token))
    if any(not any(ch in c for c in _CLASSES) for ch in token):
        size += 33
    per = math.log2(size) if size > 1 else 0.0
    counted = sum(1 for i, ch in enumerate(token) if i == 0 or abs(ord(ch) - ord(token[i - 1])) > 1)
    return counted * per


def _weak_token(token: str) -> str | None:
    """Why `token` is too weak to guard the control API, or None."""
    if len(token) < _MIN_TOKEN:
        return f"{len(token)} characters (at least {_MIN_TOKEN} needed)"
    low = token.lower()
    for word in _PLACEHOLDERS:
        if word in low:
            return f"a placeholder (it holds {word!r})"
    bits = token_bits(token)
    if bits < _MIN_TOKEN_BITS:
        return (
            f"guessable: about {bits:.0f} bits estimated, at least {_MIN_TOKEN_BITS} needed "
            "(repeats and runs such as 1234 or abcd count nothing)"
        )
    return None


def _check(s: Settings) -> None:
    def bad(name: str, why: str) -> SettingsError:
        return SettingsError(f"{_flag(name)} ({_env(name)}) {why}")

    if not 0 <= s.port <= 65535:
        raise bad("port", f"must be 0-65535, got {s.port}")
    if not 0 <= s.admin_port <= 65535:
        raise bad("admin_port", f"must be 0-65535, got {s.admin_port}")
    for name in (
        "stage_timeout",
        "upstream_connect_timeout",
        "upstream_first_byte_timeout",
        "upstream_idle_timeout",
        "seal_timeout",
        "replica_probe_interval",
        "pause_hold_seconds",
        "pause_drain_timeout",
        "weight_version_refresh",
        "shutdown_timeout",
        "rollout_idle_timeout",
        "rollout_resume_timeout",
        "client_header_timeout",
        "client_body_timeout",
        "client_write_timeout",
        "token_in_upstream_bound",
    ):
        if getattr(s, name) <= 0:
            raise bad(name, f"must be > 0, got {getattr(s, name)}")
    for name in (
        "max_body_bytes",
        "max_passthrough_body_bytes",
        "max_pending_stages",
        "max_free_json_bytes",
        "max_free_json_items",
        "max_json_items",
        "max_live_rollouts",
    ):
        if getattr(s, name) < 1:
            raise bad(name, f"must be >= 1, got {getattr(s, name)}")
    for name in (
        "store_linger",
        "min_free_disk_mb",
        "max_tokens_cap",
        "max_inflight",
        "max_inflight_per_rollout",
        "fair_share_inflight",
        "fair_share_queue",
        "fair_share_wait",
        "max_model_len",
        "upstream_total_timeout",
        "max_rollout_bytes",
        "max_rollout_calls",
        "max_connections",
        "max_connections_per_address",
        "max_connection_rate_per_address",
        "max_rollout_body_rate",
        "max_rollout_refusal_rows",
        "malloc_trim_interval",
        "max_decoding_bytes",
    ):
        if getattr(s, name) < 0:
            raise bad(name, f"must be >= 0, got {getattr(s, name)}")
    if s.store_linger >= s.stage_timeout / 2:
        # Every call under load may wait the linger before its unit is written: past half the
        # stage timeout, a slow store's write on top of it would fail calls.
        raise bad(
            "store_linger",
            f"must be under half of --stage-timeout ({s.stage_timeout:g} s), "
            f"got {s.store_linger:g}",
        )
    _check_upstreams(s.upstreams, bad)
    for name in ("admin_token", "reader_token"):
        why = _weak_token(getattr(s, name)) if getattr(s, name) else None
        if why:
            raise bad(name, f"is {why}: use a random one, e.g. openssl rand -hex 32")
    if s.reader_token and not s.admin_token:
        raise bad(
            "reader_token",
            "needs --admin-token: the store's read routes are part of the control API",
        )
    if s.reader_token and s.reader_token == s.admin_token:
        raise bad("reader_token", "is the admin token: give readers a token of their own, or none")
    if s.require_rollout_keys and not s.admin_token:
        raise bad(
            "require_rollout_keys",
            "needs --admin-token: rollout keys are minted through the control API",
        )


def _check_upstreams(urls: tuple[str, ...], bad: Callable[[str, str], SettingsError]) -> None:
    if "fake" in urls and len(urls) > 1:
        raise bad("upstream", f"'fake' serves alone: it cannot be one of several, got {urls!r}")
    seen: set[str] = set()
    for url in urls:
        if url != "fake" and not url.startswith(("http://", "https://")):
            raise bad("upstream", f"must be an http(s) URL or 'fake', got {url!r}")
        key = url.rstrip("/").removesuffix("/v1")
        if key in seen:
            raise bad("upstream", f"names {url!r} twice: each replica once")
        seen.add(key)
