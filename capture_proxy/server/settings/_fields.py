"""The settings, declared once: one dataclass field each, and how `serve --help` groups them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import CaptureProxyError

ENV_PREFIX = "CAPTURE_PROXY_"


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
    token_in_beside: str = _s(
        "off",
        "token-in: on sends a bridged call's generate once its dummy renders answer, beside the "
        "request's own render, which then checks it (a mismatch aborts that generation and sends "
        'the call again the ordinary way; docs/token-in.md, "The whole-request check beside '
        'generate")',
        choices=("off", "on"),
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
        "commas, brackets and braces a request body may hold, counted as it arrives, before "
        "it is decoded (strings included): what the body decodes into stays under its size + "
        "32 MiB; 413 the moment a body passes it, the rest of the body not received",
    )
    max_decoding_bytes: int = _s(
        192 * 2**20,
        "bytes of request bodies over 1 MiB decoded at once (the others wait their turn, in "
        "order; one larger than this is decoded alone); a call whose turn does not come within "
        "10 s gets 503 with Retry-After (0: no bound)",
    )
    stage_timeout: float = _s(10.0, "seconds a sink may take to stage a call before it fails")
    store_linger: float = _s(
        0.05,
        "a Parquet store on object storage: its writer commits a unit at most once per this "
        "many seconds under load (or per the last commit's duration, if shorter), each unit "
        "holding every call staged meanwhile (a call waits up to this long more; a call after "
        "a quiet spell commits at once): fewer units to open, follow and compact (0: each "
        "batch at once; under half of --stage-timeout; a local folder commits at once)",
    )
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


def _kind(hint: Any) -> type:
    return dict if getattr(hint, "__origin__", None) is dict else hint  # type: ignore[no-any-return,unused-ignore]


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
        "token_in token_in_upstream_bound token_in_beside",
    ),
    "store": (
        "where calls are staged",
        "store on_capture_failure stage_timeout store_linger max_pending_stages min_free_disk_mb",
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
