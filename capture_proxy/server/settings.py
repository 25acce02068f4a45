"""Every setting of `capture-proxy serve`, declared once.

Each field of `Settings` is one setting: its name, type, default and help text. The command-line
flag (``--stage-timeout``) and the environment variable (``CAPTURE_PROXY_STAGE_TIMEOUT``) are both
derived from that one declaration, and so is the key in a TOML config file (``--config``) and the
settings page in ``docs/settings.md`` (``capture-proxy settings --markdown``): `--help`, the
environment, the file and the docs cannot disagree.

Precedence: flag > environment > config file > default. Invalid values fail at start with one
sentence that names the setting.

A list setting (``--upstream``) is given by repeating its flag, comma-separated in its
environment variable, or as an array in TOML; its value is kept comma-joined (the environment's
spelling), and `Settings.upstreams` splits it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import string
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_type_hints

import orjson

from ..errors import CaptureProxyError

__all__ = [
    "ENV_PREFIX",
    "GROUPS",
    "Settings",
    "SettingsError",
    "add_arguments",
    "load_settings",
    "settings_markdown",
    "token_bits",
]

log = logging.getLogger("capture_proxy")

ENV_PREFIX = "CAPTURE_PROXY_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class SettingsError(CaptureProxyError, ValueError):
    """A setting has an invalid value; the message names the flag and the variable."""


def _s(
    default: Any,
    help: str,
    *,
    choices: Sequence[str] | None = None,
    secret: bool = False,
    many: bool = False,
) -> Any:
    # many: a list of strings, kept comma-joined (see the module docstring).
    meta = {"help": help, "choices": choices, "secret": secret, "many": many}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class Settings:
    upstream: str = _s(
        "fake",
        "vLLM base URL (http://host:8000), or 'fake' for the bundled fake vLLM served in-process; "
        "several URLs (the flag repeated, comma-separated in the environment, an array in TOML) "
        "are replicas of one model, each rollout pinned to one (docs/fleets.md)",
        many=True,
    )
    store: str = _s(
        "sqlite:///capture.db",
        "where records are staged: sqlite:///file.db, parquet:///folder, a Parquet dataset on"
        " object storage (s3://bucket/prefix, gs://, az://), or a path. Three slashes take a "
        "path relative to the working folder (parquet:///data/x is ./data/x), four an absolute "
        "one (parquet:////data/x is /data/x)",
    )
    host: str = _s("127.0.0.1", "address to listen on")
    port: int = _s(8100, "port to listen on (0 picks a free one)")
    public_url: str = _s(
        "",
        "base URL sandboxes reach the proxy at, for control-API answers (default: listen address)",
    )
    upstream_api_key: str = _s(
        "", "API key sent to the upstream; never forwarded from clients, never logged", secret=True
    )
    upstream_reasoning_field: str = _s(
        "auto",
        "field replayed reasoning is sent upstream under; auto reads the upstream's /version",
        choices=("auto", "reasoning_content", "reasoning"),
    )
    upstream_logprobs_mode: str = _s(
        "unknown",
        "the --logprobs-mode vLLM was started with, recorded on every call (vLLM's default "
        "raw_logprobs are taken before temperature and penalties; training wants "
        "processed_logprobs)",
        choices=("raw_logprobs", "processed_logprobs", "unknown"),
    )
    token_in: str = _s(
        "off",
        "token-in mode: on sends each call as token ids through vLLM's render, generate and "
        "derender routes (vLLM started with --enable-scale-out), so the model sees its own "
        "sampled tokens; a rollout may choose for itself (POST /admin/rollouts token_in)",
        choices=("off", "on"),
    )
    token_in_upstream_bound: float = _s(
        3.0,
        "a token-in call sends vLLM at most about this many times the bytes the plain call "
        "would (renders, generate, derender): a stream's derender calls get what the call's "
        "renders and generate left of it, then wait for its end (docs/token-in.md, "
        '"Upstream bytes"); higher streams in more pieces',
    )
    on_capture_failure: str = _s(
        "poison",
        "when a call cannot be staged: poison (answer, poison the rollout) or error (503)",
        choices=("poison", "error"),
    )
    require_rollout_id: bool = _s(
        False, "answer 400 to calls that name no rollout (path, X-Rollout-Id or x-session-id)"
    )
    max_body_bytes: int = _s(64 * 2**20, "largest request body accepted (413 above it)")
    client_header_timeout: float = _s(
        60.0,
        "seconds a client connection may take to send a whole request head, counted from when "
        "it opens or from its previous answer; then it is closed (idle keep-alive ones too)",
    )
    client_body_timeout: float = _s(
        60.0, "seconds a client may take to send a request body once its head is in (408 after)"
    )
    client_write_timeout: float = _s(
        60.0,
        "seconds a client may leave its answer unread (the connection's buffers full): a stream "
        "is then cut and its call recorded aborted (client_stalled); any connection left unread "
        "twice as long is closed",
    )
    max_connections: int = _s(
        4096,
        "client connections open at once on the proxy port; a new one beyond it gets 503 with "
        "Retry-After and is closed (0: no cap). Lowered at start to what the open-file limit "
        "allows",
    )
    max_connections_per_address: int = _s(
        64,
        "client connections from one address that have not yet carried an authorized call "
        "(a rollout's key, where keys are required); a new one beyond it gets 503 with "
        "Retry-After. Sandboxes behind one NAT share an address: a connection that has carried "
        "a call no longer counts (0: no cap)",
    )
    max_connection_rate_per_address: float = _s(
        64.0,
        "new client connections one address may open a second, with twice as many saved up; "
        "one beyond gets 503 with Retry-After when it is accepted, before its request is read. "
        "A client that keeps its connections open (every OpenAI SDK) opens a few; sandboxes "
        "behind one NAT share the rate (0: no limit)",
    )
    max_passthrough_body_bytes: int = _s(
        2**20,
        "largest body of a pass-through route (/tokenize, /detokenize), relayed uncaptured; "
        "413 above it",
    )
    allow_remote_media: bool = _s(
        False, "accept image URLs other than data: URLs (forwarded as-is, not captured as bytes)"
    )
    max_free_json_bytes: int = _s(
        2**20,
        "largest free-form JSON value of a request (a tool's parameters, chat_template_kwargs, "
        "...), in bytes; 413 above it",
    )
    max_free_json_items: int = _s(
        131_072,
        "JSON values (objects, arrays, numbers, strings) in all free-form values of a request "
        "together; 413 above it",
    )
    max_json_items: int = _s(
        262_144,
        "commas, brackets and braces a request body may hold, counted before it is decoded "
        "(strings included): what the body decodes into stays under its size + 32 MiB; 413 "
        "above it",
    )
    max_decoding_bytes: int = _s(
        192 * 2**20,
        "bytes of request bodies over 1 MiB decoded at once (the others wait their turn, in "
        "order; one larger than this is decoded alone); a call whose turn does not come within "
        "10 s gets 503 with Retry-After (0: no bound)",
    )
    stage_timeout: float = _s(10.0, "seconds a sink may take to stage a call before it fails")
    max_pending_stages: int = _s(
        256, "staging writes in progress at once; beyond it calls get 503 with Retry-After"
    )
    min_free_disk_mb: int = _s(
        512, "below this much free disk at a local store, new calls get 503 (0 disables the check)"
    )
    max_tokens_cap: int = _s(0, "cap max_tokens / max_completion_tokens at this value (0: no cap)")
    served_model: str = _s(
        "",
        "rewrite every request's model field to this name; with several upstreams, the model "
        "name every replica must serve (docs/fleets.md)",
    )
    on_replica_loss: str = _s(
        "fail",
        "with several upstreams, a call of a rollout whose replica is unhealthy: fail (503 "
        "upstream_unavailable) or move (the rollout moves to a healthy replica, recorded)",
        choices=("fail", "move"),
    )
    replica_probe_interval: float = _s(
        5.0,
        "with several upstreams, seconds between health probes of each replica (/health, "
        "/version, the tokenizer fingerprint); a replica that fails a call is probed at once",
    )
    upstream_connect_timeout: float = _s(10.0, "seconds to connect to the upstream")
    upstream_first_byte_timeout: float = _s(
        900.0, "seconds to wait for the upstream's response headers"
    )
    upstream_idle_timeout: float = _s(
        300.0, "seconds the upstream may stay silent between stream chunks or body bytes"
    )
    upstream_total_timeout: float = _s(
        3600.0,
        "seconds from sending a call upstream until its whole answer is in, unary or streamed "
        "(a trickling upstream fails past it; 0: no deadline)",
    )
    max_inflight: int = _s(
        0, "calls in flight at once across rollouts; excess gets 429 (0: no limit)"
    )
    max_inflight_per_rollout: int = _s(
        16,
        "calls in flight at once in one rollout (one sandbox, with rollout keys); excess gets "
        "429 (0: no limit). An agent makes one call at a time, a few with subagents",
    )
    fair_share_inflight: int = _s(
        32,
        "chat calls in flight across rollouts from which they are shared fairly: then a "
        "rollout holding its share (this over the rollouts with calls in flight, at least 2) "
        "waits its turn, before its body is read, while a rollout with nothing in flight goes "
        "at once (docs/security.md; 0: off)",
    )
    fair_share_queue: int = _s(
        16,
        "calls of one rollout that may wait for a fair turn; one more gets 429 "
        "rollout_over_fair_share at once",
    )
    fair_share_wait: float = _s(
        600.0,
        "seconds a call may wait for a fair turn, then 429 rollout_over_fair_share; it waits "
        "only while its own rollout has calls in flight, for one of them to end (a generation "
        "may take minutes), holding its connection but not its body",
    )
    admin_token: str = _s(
        "",
        "bearer token for the control API (/admin), 16 characters and 64 bits (estimated) at "
        "least; empty: the control API is off. Prefer the environment or --admin-token-file: a "
        "flag shows in ps",
        secret=True,
    )
    admin_token_file: str = _s(
        "", "file whose first line is the control API's bearer token (instead of --admin-token)"
    )
    reader_token: str = _s(
        "",
        "bearer token that may only read the store through the control API (trainers on other "
        "hosts: open_store('http://HOST:PORT', token=...)), 16 characters and 64 bits at least, "
        "not the admin token; needs --admin-token. Prefer the environment or --reader-token-file",
        secret=True,
    )
    reader_token_file: str = _s(
        "", "file whose first line is the reader token (instead of --reader-token)"
    )
    admin_port: int = _s(0, "serve the control API on this port instead of the main one (0: main)")
    admin_host: str = _s(
        "", "address the --admin-port listener binds (default: --host); e.g. 127.0.0.1"
    )
    require_rollout_keys: bool = _s(
        False, "sandboxes must send the key minted for their rollout by POST /admin/rollouts"
    )
    max_rollout_bytes: int = _s(
        2**30,
        "bytes one rollout may stage (its records' requests, answers, tokens and images); "
        "further calls get 429 (0: no limit)",
    )
    max_rollout_calls: int = _s(
        10_000,
        "calls one rollout may make; beyond, 429 (0: no limit). Its refused calls are bounded "
        "apart by the same number: past it they are answered 429 and counted in /metrics, not "
        "written to the ledger one by one",
    )
    max_rollout_refusal_rows: float = _s(
        8.0,
        "refused calls of one rollout written to its ledger one by one per second, twice as many "
        "saved up; past it they are answered as before and written together, one entry a second "
        "(reason refusals_folded) counting them (0: every refusal its own entry)",
    )
    max_rollout_body_rate: float = _s(
        16.0,
        "MiB of request bodies one rollout may send per second, with up to twice "
        "--max-body-bytes saved up; a body beyond it gets 429 with Retry-After before it is "
        "read (an agent resending every image sends a few MiB a second; 0: no limit)",
    )
    max_live_rollouts: int = _s(
        10_000,
        "rollouts kept in memory at once; past it the oldest idle ones leave memory (and resume "
        "from the store when seen again). A live rollout holds its last prompt's and answer's "
        "ids, about 1 MB at a 60k-token prompt: size it with the memory limit",
    )
    seal_timeout: float = _s(60.0, "seconds sealing waits for a rollout's in-flight calls")
    pause_hold_seconds: float = _s(
        30.0,
        "while paused for a weight update (POST /admin/weights/pause), seconds a new call is held "
        "waiting for the resume; then 503 `paused` with Retry-After",
    )
    weight_version_refresh: float = _s(
        5.0,
        "seconds between re-reads of the weight version the store last recorded (set by any "
        "proxy on the same store; also re-read at every pause and resume answer): a proxy "
        "stamps another proxy's update on calls admitted at most this long after it",
    )
    pause_drain_timeout: float = _s(
        60.0,
        "seconds POST /admin/weights/pause waits for in-flight calls to finish; calls still "
        "running then are cut (aborted, `weights_paused`) and listed in its answer",
    )
    rollout_resume_timeout: float = _s(
        20.0,
        "seconds a call waits for its rollout to be read back from the store (after a restart, "
        "an idle release, a hand-off from another proxy); then 503 `rollout_resume_timeout` "
        "with Retry-After, logged and counted, while the read goes on for the retry",
    )
    rollout_idle_timeout: float = _s(
        600.0,
        "seconds after its last call an unsealed rollout is released from memory (a later call "
        "resumes it from the store)",
    )
    shutdown_timeout: float = _s(
        30.0, "on SIGTERM, seconds in-flight calls and streams may take to finish"
    )
    # RUF009: `_s` returns a dataclasses.field with a default_factory for dict settings.
    policy_defaults: dict[str, Any] = _s(  # noqa: RUF009
        {},
        "sampling parameters filled in when the client sent none (JSON object, or a TOML table), "
        'e.g. {"temperature": 1.0, "chat_template_kwargs": {"enable_thinking": true}}',
    )
    policy_force: dict[str, Any] = _s(  # noqa: RUF009
        {}, "sampling parameters imposed on every call, over the client and rollout policies"
    )
    max_model_len: int = _s(
        0,
        "the upstream's context window: calls whose prompt + max_tokens cannot fit are handled "
        "per --context-overflow before reaching vLLM (0: no guard; costs a /tokenize per call)",
    )
    context_overflow: str = _s(
        "error",
        "a call that cannot fit the context: error (400) or cap (lower max_tokens to what fits)",
        choices=("error", "cap"),
    )
    loop: str = _s(
        "uvloop",
        "event loop: uvloop (less CPU per call; asyncio's loop where uvloop is not installed) "
        "or asyncio (the standard library's)",
        choices=("uvloop", "asyncio"),
    )
    transparent_huge_pages: str = _s(
        "off",
        "transparent huge pages for the serving process: off (its memory follows what it holds; "
        "huge pages step RSS up by tens of MB at random) or system (the machine's policy)",
        choices=("off", "system"),
    )
    malloc_trim_interval: float = _s(
        10.0,
        "seconds between returns of the C heap's free pages to the system (glibc's malloc_trim, "
        "on a worker thread: RSS follows what the process holds; 0: never; /metrics: "
        "capture_proxy_heap_trims_total, capture_proxy_heap_trim_last_seconds and _max_seconds)",
    )
    log_level: str = _s("info", "log level", choices=("debug", "info", "warning", "error"))
    log_format: str = _s(
        "json",
        "log lines as JSON objects (with rollout and call ids) or plain text",
        choices=("json", "text"),
    )

    @property
    def upstreams(self) -> tuple[str, ...]:
        """The upstream URLs (or ``("fake",)``), split from `upstream`, in the order given."""
        return tuple(u.strip() for u in self.upstream.split(","))

    def public(self) -> dict[str, Any]:
        """The settings with secrets masked, for logs and `/readyz`."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = "***" if f.metadata["secret"] and v else v
        return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return repr(f.default)


#: How ``serve --help`` groups the settings: title -> (what the group is about, its settings in
#: help order). A test holds every setting to exactly one group; one left out still shows, last.
GROUPS: dict[str, tuple[str, str]] = {
    "upstream": (
        "the vLLM the proxy calls, and how",
        "upstream upstream_api_key upstream_reasoning_field upstream_logprobs_mode served_model "
        "max_model_len context_overflow on_replica_loss replica_probe_interval "
        "upstream_connect_timeout upstream_first_byte_timeout upstream_idle_timeout "
        "upstream_total_timeout",
    ),
    "token-in": (
        "prompts built from the model's own sampled tokens (docs/token-in.md)",
        "token_in token_in_upstream_bound",
    ),
    "store": (
        "where calls are staged",
        "store on_capture_failure stage_timeout max_pending_stages min_free_disk_mb",
    ),
    "sandboxes": (
        "where agents reach the proxy, and what they must send",
        "host port public_url require_rollout_id require_rollout_keys allow_remote_media "
        "client_header_timeout client_body_timeout client_write_timeout",
    ),
    "request policy": (
        "sampling parameters filled in or imposed (docs/usage.md)",
        "policy_defaults policy_force max_tokens_cap",
    ),
    "control API": (
        "rollout drivers and trainers: /admin (docs/contract.md)",
        "admin_token admin_token_file reader_token reader_token_file admin_port admin_host "
        "seal_timeout pause_hold_seconds pause_drain_timeout weight_version_refresh",
    ),
    "limits": (
        "what one request, rollout or client may take",
        "max_body_bytes max_passthrough_body_bytes max_free_json_bytes max_free_json_items "
        "max_json_items max_decoding_bytes max_connections max_connections_per_address "
        "max_connection_rate_per_address "
        "max_inflight max_inflight_per_rollout fair_share_inflight fair_share_queue "
        "fair_share_wait max_rollout_bytes max_rollout_calls "
        "max_rollout_body_rate max_rollout_refusal_rows "
        "max_live_rollouts rollout_idle_timeout rollout_resume_timeout",
    ),
    "process": (
        "the serving process and its logs",
        "loop transparent_huge_pages malloc_trim_interval shutdown_timeout log_level log_format",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per setting, in the argument groups of `GROUPS`. Defaults are left as None
    so the environment can fill them; a setting with choices shows them (``{off,on}``)."""
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help=f"a TOML file of settings (keys as below, snake_case; env {ENV_PREFIX}CONFIG)",
    )
    hints = get_type_hints(Settings)
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    grouped = {title: names.split() for title, (_, names) in GROUPS.items()}
    grouped["other"] = [n for n in fields if not any(n in g for g in grouped.values())]
    for title, names in grouped.items():
        if not names:
            continue
        group = parser.add_argument_group(title, GROUPS.get(title, ("", ""))[0] or None)
        for name in names:
            _add_flag(group, fields[name], hints[name])


def _add_flag(group: argparse._ArgumentGroup, f: dataclasses.Field[Any], kind: Any) -> None:
    help_text = f"{f.metadata['help']} (env {_env(f.name)}; default: {_default_text(f)})"
    if f.metadata["many"]:
        group.add_argument(
            _flag(f.name),
            action="append",
            default=None,
            metavar=f.name.upper(),
            help=help_text + "; repeat the flag for several",
        )
    elif kind is bool:
        group.add_argument(
            _flag(f.name), action=argparse.BooleanOptionalAction, default=None, help=help_text
        )
    else:
        group.add_argument(
            _flag(f.name),
            type=str,
            default=None,
            # With choices, argparse shows them ({off,on}) where the metavar would be.
            metavar=None if f.metadata["choices"] else f.name.upper(),
            choices=f.metadata["choices"],
            help=help_text,
        )


def _kind(hint: Any) -> type:
    return dict if getattr(hint, "__origin__", None) is dict else hint  # type: ignore[no-any-return,unused-ignore]


def _convert(kind: type, raw: Any, source: str) -> Any:
    """Convert a flag or environment string (or a TOML value) to the setting's type."""
    if kind is dict:
        value = raw
        if isinstance(raw, str):
            try:
                value = orjson.loads(raw) if raw.strip() else {}
            except orjson.JSONDecodeError as e:
                raise SettingsError(f"{source} must be a JSON object: {e}") from e
        if not isinstance(value, dict):
            raise SettingsError(f"{source} must be a JSON object (a table in TOML), got {raw!r}")
        return value
    if type(raw) is kind:
        return raw
    if kind is float and type(raw) is int:  # TOML's 10 for a float setting
        return float(raw)
    if not isinstance(raw, str):
        raise SettingsError(f"{source} must be a {kind.__name__}, got {raw!r}")
    if kind is str:
        return raw
    text = raw.strip()
    try:
        if kind is bool:
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        pass
    raise SettingsError(f"{source} must be a {kind.__name__}, got {raw!r}")


def _joined(raw: Any, source: str) -> Any:
    """A list setting's value as one comma-joined string: a repeated flag gives a list, TOML an
    array (or a string), the environment a comma-separated string."""
    if isinstance(raw, list):
        if not all(isinstance(v, str) for v in raw):
            raise SettingsError(f"{source} must be a list of strings, got {raw!r}")
        return ",".join(raw)
    return raw


def _read_config(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise SettingsError(f"--config: no such file {path}") from exc
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"--config {path} is not valid TOML: {e}") from e
    names = {f.name for f in dataclasses.fields(Settings)}
    for key in data:
        if key not in names:
            raise SettingsError(
                f"--config {path}: unknown setting {key!r} (settings are the flags' names "
                "in snake_case, e.g. stage_timeout)"
            )
    return data


def load_settings(
    args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Build `Settings`: flag > environment > config file (``--config``) > default."""
    environ = os.environ if environ is None else environ
    config_path = getattr(args, "config", None) or environ.get(ENV_PREFIX + "CONFIG")
    config = _read_config(config_path) if config_path else {}
    hints = get_type_hints(Settings)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        flag_value = getattr(args, f.name, None) if args is not None else None
        if flag_value is not None:
            raw, source = flag_value, _flag(f.name)
        elif _env(f.name) in environ:
            raw, source = environ[_env(f.name)], f"{_env(f.name)}"
        elif f.name in config:
            raw, source = config[f.name], f"{f.name} in {config_path}"
        else:
            continue
        if f.metadata["many"]:
            raw = _joined(raw, source)
        value = _convert(_kind(hints[f.name]), raw, source)
        choices = f.metadata["choices"]
        if choices and value not in choices:
            raise SettingsError(f"{source} must be one of {', '.join(choices)}, got {value!r}")
        values[f.name] = value
    for name in ("admin_token", "reader_token"):
        if values.get(f"{name}_file"):
            values[name] = _read_token_file(values, name)
        elif args is not None and getattr(args, name, None):
            # Taken, but said: every local user sees a process's command line (ps, /proc).
            log.warning(
                "%s was given on the command line, where every user of this machine can read "
                "it (ps); give it in %s or a file (%s) instead",
                _flag(name),
                _env(name),
                _flag(f"{name}_file"),
            )
    settings = Settings(**values)
    _check(settings)
    return settings


def _read_token_file(values: Mapping[str, Any], name: str) -> str:
    """The token in the file `values` names for the setting `name` (``admin_token``, ...)."""
    path = values[f"{name}_file"]
    where = f"{_flag(f'{name}_file')} ({_env(f'{name}_file')})"
    if values.get(name):
        raise SettingsError(f"{where} and {_flag(name)} are both set: give one, not both")
    try:
        with open(path, encoding="utf-8") as fh:
            token = fh.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise SettingsError(f"{where}: cannot read {path}: {e}") from e
    if not token:
        raise SettingsError(f"{where}: {path} holds no token on its first line")
    return token


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


def settings_markdown() -> str:
    """The settings page (docs/settings.md), generated from the declarations."""
    hints = get_type_hints(Settings)
    lines = [
        "# Settings",
        "",
        "Generated by `capture-proxy settings --markdown` from `capture_proxy/server/settings.py`;",
        "a test keeps this page equal to that output. Precedence: flag > environment > config file",
        "(`--config FILE`, TOML, keys in snake_case) > default. `capture-proxy serve --help` shows",
        f"the same settings in groups: {', '.join(GROUPS)}.",
        "",
        "| flag | environment | TOML key | type | default | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for f in dataclasses.fields(Settings):
        kind = _kind(hints[f.name]).__name__
        if f.metadata["many"]:
            kind = f"list of {kind}"
        choices = f.metadata["choices"]
        if choices:
            kind = " \\| ".join(choices)
        help_text = f.metadata["help"].replace("|", "\\|")
        lines.append(
            f"| `{_flag(f.name)}` | `{_env(f.name)}` | `{f.name}` | {kind} | "
            f"`{_default_text(f)}` | {help_text} |"
        )
    return "\n".join(lines) + "\n"


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
