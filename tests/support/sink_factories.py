"""Sinks under test, and the records the sink tests stage.

`SINKS` maps a sink kind to a factory ``factory(tmp_path, fault=None) -> SinkCase``. A `SinkCase`
holds the `sink` to write through, opens a fresh reader on the same store (`reopen`), and knows
how to damage the store behind the sink's back (`tamper`) and count stored attachments, so
`tests/sinks/test_sink_conformance.py` can hold every backend to the same suite. A new backend
registers here and must pass that suite.

`Session` builds the sealed records of a multi-turn agent session (a growing conversation, token
ids that extend the previous call's prompt + completion, optional images), shared by the sink
tests, the crash worker and nothing else.
"""

from __future__ import annotations

import hashlib
import random
import sqlite3
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

from capture_proxy.schemas.attachments import attachment_url
from capture_proxy.schemas.digest import seal_record
from capture_proxy.schemas.records import Attachment, StagedCallRecord
from capture_proxy.sinks.base import FaultHook, StagingSink, StagingSource
from capture_proxy.sinks.memory import MemorySink
from capture_proxy.sinks.sqlite import SQLiteSink, SQLiteSource

Part = Literal["tokens", "message", "attachment", "media_type"]

#: The fields of record schema 2, each set to something other than its default (for records of
#: a session's 12-token completions and 40-token prompts).
V2_VALUES: dict[str, Any] = {
    "engine_weight_version": "ckpt-7",
    "weight_spans": (("ckpt-7", 0, 5), ("ckpt-8", 5, 12)),
    "token_in": True,
    "bridge_spans": ((3, 4, "end_of_turn"),),
    "replica": "http://vllm-0:8000",
    "effective_sampling": {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
    "logprobs_mode": "processed_logprobs",
}

# -- records ----------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def png_bytes(tag: str, size: int = 2048) -> bytes:
    """Deterministic image-like bytes (a PNG signature and pseudo-random filler)."""
    seed = hashlib.sha256(tag.encode()).digest()
    body = (seed * (size // 32 + 1))[:size]
    return b"\x89PNG\r\n\x1a\n" + body


def image(tag: str) -> Attachment:
    return Attachment.from_bytes(png_bytes(tag), "image/png")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 150_000) for _ in range(n)]


class Session:
    """The calls of one agent session, each extending the previous call's sequence.

    `next` returns the next sealed record and the attachments to stage with it. With `image`, the
    first user message carries that image and every later call re-sends it (as OpenCode does).
    A resumed session (`resume`) knows the references of earlier images but not their bytes: the
    store has them.
    """

    def __init__(
        self,
        rollout_id: str,
        *,
        seed: int = 0,
        image: Attachment | None = None,
        prefix: str | None = None,
        schema_version: int = 2,
    ) -> None:
        self.rollout_id = rollout_id
        #: 1 builds records as the release before record schema 2 sealed them (old stores).
        self.schema_version = schema_version
        self.prefix = prefix or rollout_id
        self.rng = random.Random(f"{rollout_id}:{seed}")
        self.images: dict[str, Attachment] = {image.sha256: image} if image is not None else {}
        #: Every image the session refers to, staged here or before a resume (sealing binds
        #: their media types).
        self.known: dict[str, Attachment] = dict(self.images)
        self.seq = 0
        self.parent: str | None = None
        self.full = array("i")
        user: dict[str, Any] = {"role": "user", "content": f"task for {rollout_id}"}
        if image is not None:
            user["content"] = [
                {"type": "text", "text": f"look at this, {rollout_id}"},
                {"type": "image_url", "image_url": {"url": attachment_url(image.sha256)}},
            ]
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a careful coding agent."},
            user,
        ]

    @classmethod
    def resume(cls, last: StagedCallRecord, *, seed: int = 0, prefix: str | None = None) -> Session:
        """Continue a session from its last staged record (e.g. after a restart)."""
        s = cls(last.rollout_id, seed=seed + last.seq + 1, prefix=prefix)
        s.seq = last.seq + 1
        s.parent = last.call_id
        s.full = array("i", last.prompt_token_ids)
        s.full.extend(last.completion_token_ids)
        s.messages = [dict(m) for m in last.request["messages"]]
        # Read back from the store, `last` holds its images: their media types seal later calls.
        s.known = {a.sha256: a for a in last.attachments}
        s.messages.append(dict(last.response))
        s.messages.append({"role": "user", "content": f"continue turn {s.seq}"})
        return s

    def next(
        self,
        *,
        new_prompt: int = 40,
        completion: int = 12,
        drift_at: int | None = None,
        extras: dict[str, Any] | None = None,
        new_image: Attachment | None = None,
    ) -> tuple[StagedCallRecord, dict[str, Attachment]]:
        """The next call, and the images this session has sent so far (re-sent every call).

        `new_image` adds a user message showing it before this call.
        """
        if new_image is not None:
            self.images[new_image.sha256] = new_image
            self.known[new_image.sha256] = new_image
            self.messages.append(
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": attachment_url(new_image.sha256)},
                        }
                    ],
                }
            )
        prompt = array("i", self.full[:drift_at] if drift_at is not None else self.full)
        prompt.extend(_tokens(self.rng, new_prompt))
        out = array("i", _tokens(self.rng, completion))
        logprobs = array("f", [-self.rng.random() * 5 for _ in range(completion)])
        call_id = f"{self.prefix}-c{self.seq}"
        response = {
            "role": "assistant",
            "content": f"answer {self.seq} of {self.rollout_id}",
            "reasoning_content": f"thinking about turn {self.seq}",
        }
        record = StagedCallRecord(
            rollout_id=self.rollout_id,
            call_id=call_id,
            seq=self.seq,
            model="tiny-qwen",
            finish_reason="stop",
            request={"model": "tiny-qwen", "messages": list(self.messages), "tools": TOOLS},
            response=response,
            prompt_token_ids=prompt,
            completion_token_ids=out,
            completion_logprobs=logprobs,
            parent_call_id=self.parent,
            created_at_ms=1_700_000_000_000 + self.seq,
            upstream_version="0.32.0",
            tokenizer_fingerprint="f" * 64,
            sampling={"temperature": 1.0, "max_tokens": 32000},
            extras=extras or {},
            schema_version=self.schema_version,
        )
        sealed = seal_record(record, attachments=self.known)
        self.seq += 1
        self.parent = call_id
        self.full = array("i", prompt)
        self.full.extend(out)
        self.messages = [*self.messages, response, {"role": "user", "content": f"go on {call_id}"}]
        return sealed, dict(self.images)


# -- sinks ------------------------------------------------------------------------------------


async def stage_parquet(
    url: str, sessions: list[Session], calls: int, *, writer_id: str = "w"
) -> list[StagedCallRecord]:
    """`calls` records of each session, in turn, through one Parquet writer (`writer_id`) that
    stages them one at a time (so one unit each) and is then closed; the records."""
    from capture_proxy.sinks.parquet import ParquetSink

    sink = ParquetSink(url, writer_id=writer_id)
    staged = []
    try:
        for session in sessions:
            for _ in range(calls):
                record, atts = session.next()
                await sink.stage(record, attachments=atts)
                staged.append(record)
    finally:
        await sink.close()
    return staged


class SinkCase(Protocol):
    @property
    def sink(self) -> StagingSink:
        """The sink under test."""
        ...

    def reopen(self) -> StagingSource:
        """A fresh reader on the store the sink writes."""
        ...

    def tamper(self, key: str, part: Part) -> None:
        """Damage one stored part of record `key` behind the sink's back (sink closed)."""
        ...

    def attachment_count(self) -> int:
        """How many attachment copies the store holds."""
        ...

    def downgrade(self) -> None:
        """Turn the store (sink closed) into what the release before record schema 2 wrote:
        no storage for the schema-2 fields (its records must be version 1)."""
        ...

    def drop_reference_media_types(self) -> None:
        """Turn the store (sink closed) into what the release before per-reference media types
        wrote (SQLite format 5, Parquet calls without ``attachment_media_types``): every
        reference then reads with the media type stored with its bytes."""
        ...


class SinkFactory(Protocol):
    """A `SinkCase` class: ``factory(tmp_path)``, or ``factory(tmp_path, fault)``."""

    def __call__(self, tmp_path: Path, fault: FaultHook | None = None, /) -> SinkCase: ...


def _flip_json_letter(data: bytes) -> bytes:
    """Change one letter inside a JSON string, keeping the JSON valid (a silent edit)."""
    start = data.index(b'":"') + 3
    for i in range(start, len(data)):
        c = data[i : i + 1]
        if c.isalpha():
            return data[:i] + c.swapcase() + data[i + 1 :]
    raise AssertionError("no letter to flip")


def _flip_byte(data: bytes, at: int = 0) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


class MemoryCase:
    def __init__(self, tmp_path: Path, fault: FaultHook | None = None) -> None:
        self.sink: MemorySink = MemorySink(fault=fault)

    def reopen(self) -> StagingSource:
        return self.sink  # its reader is itself

    def tamper(self, key: str, part: Part) -> None:
        from dataclasses import replace

        rec = self.sink._records[key]
        if part == "tokens":
            ids = array("i", rec.prompt_token_ids)
            ids[0] ^= 1
            self.sink._records[key] = replace(rec, prompt_token_ids=ids)
        elif part == "message":
            messages = [dict(m) for m in rec.request["messages"]]
            messages[0]["content"] = str(messages[0]["content"]).swapcase()
            self.sink._records[key] = replace(rec, request={**rec.request, "messages": messages})
        elif part == "attachment":
            sha = rec.attachment_refs()[0]
            att = self.sink._attachments[sha]
            self.sink._attachments[sha] = Attachment(sha, att.media_type, _flip_byte(att.data, 9))
        else:
            self.sink._media_types[key][0] = "image/jpeg"

    def attachment_count(self) -> int:
        return len(self.sink._attachments)

    def downgrade(self) -> None:
        pass  # records are kept as objects: nothing is stored per column

    def drop_reference_media_types(self) -> None:
        self.sink._media_types.clear()


def _drop_format_7(db: sqlite3.Connection) -> None:
    """Format 7's rollout index and consumers' cursors dropped (the version is set by the
    caller)."""
    db.execute("DROP INDEX rollouts_state_sealed")
    db.execute("DROP INDEX rollouts_group")
    db.execute("ALTER TABLE rollouts DROP COLUMN group_id")
    db.execute("ALTER TABLE rollouts DROP COLUMN graded")
    db.execute("DROP TABLE consumers")
    db.execute("UPDATE meta SET value='6' WHERE key='format_version'")


class SQLiteCase:
    def __init__(self, tmp_path: Path, fault: FaultHook | None = None) -> None:
        self.path = tmp_path / "store" / "capture.db"
        self.sink = SQLiteSink(str(self.path), fault=fault)

    def reopen(self) -> StagingSource:
        return SQLiteSource(str(self.path))

    def tamper(self, key: str, part: Part) -> None:
        with sqlite3.connect(self.path) as db:
            if part == "tokens":
                (data,) = db.execute(
                    "SELECT delta_tokens FROM calls WHERE call_id=?", (key,)
                ).fetchone()
                db.execute(
                    "UPDATE calls SET delta_tokens=? WHERE call_id=?", (_flip_byte(data), key)
                )
            elif part == "message":
                (keys,) = db.execute(
                    "SELECT message_keys FROM calls WHERE call_id=?", (key,)
                ).fetchone()
                blob_key = keys[:32].hex()
                (data,) = db.execute("SELECT data FROM blobs WHERE key=?", (blob_key,)).fetchone()
                db.execute(
                    "UPDATE blobs SET data=? WHERE key=?", (_flip_json_letter(data), blob_key)
                )
            else:
                (sha,) = db.execute(
                    "SELECT sha256 FROM call_attachments WHERE call_id=? ORDER BY ord", (key,)
                ).fetchone()
                (data,) = db.execute(
                    "SELECT data FROM attachments WHERE sha256=?", (sha,)
                ).fetchone()
                if part == "attachment":
                    db.execute(
                        "UPDATE attachments SET data=? WHERE sha256=?", (_flip_byte(data, 9), sha)
                    )
                else:
                    db.execute(
                        "UPDATE call_attachments SET media_type='image/jpeg'"
                        " WHERE call_id=? AND ord=0",
                        (key,),
                    )
        db.close()

    def downgrade(self) -> None:
        """Format 3: format 6's and 4's columns and format 5's event log dropped (SQLite >=
        3.35), the version set back."""
        from capture_proxy.sinks.codec import V2_ROW_FIELDS

        with sqlite3.connect(self.path) as db:
            _drop_format_7(db)
            db.execute("ALTER TABLE call_attachments DROP COLUMN media_type")
            db.execute("DROP TABLE events")
            for name in V2_ROW_FIELDS:
                db.execute(f"ALTER TABLE calls DROP COLUMN {name}")
            db.execute("UPDATE meta SET value='3' WHERE key='format_version'")
        db.close()

    def drop_reference_media_types(self) -> None:
        """Format 5: format 6's per-reference media types dropped, the version set back."""
        with sqlite3.connect(self.path) as db:
            _drop_format_7(db)
            db.execute("ALTER TABLE call_attachments DROP COLUMN media_type")
            db.execute("UPDATE meta SET value='5' WHERE key='format_version'")
        db.close()

    def attachment_count(self) -> int:
        with sqlite3.connect(self.path) as db:
            (n,) = db.execute("SELECT count(*) FROM attachments").fetchone()
        db.close()
        return int(n)


class ParquetCase:
    """The Parquet sink, tampered with by rewriting its Parquet files in place with pyarrow."""

    def __init__(self, tmp_path: Path, fault: FaultHook | None = None) -> None:
        from capture_proxy.sinks.parquet import ParquetSink

        self.location = tmp_path / "dataset"
        self.sink = ParquetSink(str(self.location), fault=fault)

    def reopen(self) -> StagingSource:
        from capture_proxy.sinks.parquet import ParquetSource

        return ParquetSource(str(self.location))

    def _rewrite(self, match: str, value: str, column: str, edit: Callable[[bytes], bytes]) -> bool:
        """Edit `column` in the rows whose `match` column equals `value`, in every file."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        done = False
        for f in sorted(self.location.rglob("*.parquet")):
            table = pq.read_table(f)
            if match not in table.column_names or column not in table.column_names:
                continue
            keys = table.column(match).to_pylist()
            if value not in keys:
                continue
            col = table.column(column).to_pylist()
            col = [edit(v) if k == value else v for k, v in zip(keys, col, strict=True)]
            idx = table.column_names.index(column)
            table = table.set_column(idx, table.schema.field(idx), pa.array(col, pa.binary()))
            pq.write_table(table, f)
            done = True
        return done

    def _value(self, match: str, value: str, column: str) -> Any:
        import pyarrow.parquet as pq

        for f in sorted(self.location.rglob("*.parquet")):
            table = pq.read_table(f)
            if match in table.column_names and column in table.column_names:
                for k, v in zip(
                    table.column(match).to_pylist(), table.column(column).to_pylist(), strict=True
                ):
                    if k == value:
                        return v
        raise AssertionError(f"tamper: no {match}={value} with a {column} column in the dataset")

    def tamper(self, key: str, part: Part) -> None:
        if part == "tokens":
            ok = self._rewrite("call_id", key, "delta_tokens", _flip_byte)
        elif part == "message":
            blob_key = bytes(self._value("call_id", key, "message_keys"))[:32].hex()
            ok = self._rewrite("key", blob_key, "data", _flip_json_letter)
        elif part == "attachment":
            sha = self._value("call_id", key, "attachment_shas")[0]
            ok = self._rewrite("sha256", sha, "data", lambda d: _flip_byte(d, 9))
        else:
            ok = self._rewrite_media_types(key, "image/jpeg")
        assert ok, f"tamper: found nothing to edit for {part} of {key}"

    def _rewrite_media_types(self, key: str, first: str) -> bool:
        """Set the media type of call `key`'s first attachment reference to `first`."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        done = False
        for f in sorted((self.location / "calls").glob("*.parquet")):
            table = pq.read_table(f)
            keys = table.column("call_id").to_pylist()
            if key not in keys:
                continue
            col = table.column("attachment_media_types").to_pylist()
            col = [[first, *v[1:]] if k == key else v for k, v in zip(keys, col, strict=True)]
            idx = table.column_names.index("attachment_media_types")
            table = table.set_column(
                idx, table.schema.field(idx), pa.array(col, pa.list_(pa.string()))
            )
            pq.write_table(table, f)
            done = True
        return done

    def downgrade(self) -> None:
        """Calls files rewritten without the schema-2 columns (nor the references' media
        types), as the release before record schema 2 wrote."""
        import pyarrow.parquet as pq

        from capture_proxy.sinks.codec import V2_ROW_FIELDS

        for f in sorted((self.location / "calls").glob("*.parquet")):
            table = pq.read_table(f)
            pq.write_table(table.drop_columns([*V2_ROW_FIELDS, "attachment_media_types"]), f)

    def drop_reference_media_types(self) -> None:
        """Calls files rewritten without ``attachment_media_types``."""
        import pyarrow.parquet as pq

        for f in sorted((self.location / "calls").glob("*.parquet")):
            table = pq.read_table(f)
            pq.write_table(table.drop_columns(["attachment_media_types"]), f)

    def attachment_count(self) -> int:
        import pyarrow.parquet as pq

        n = 0
        for f in self.location.rglob("*.parquet"):
            names = pq.read_schema(f).names
            if "sha256" in names and "data" in names:
                n += pq.read_metadata(f).num_rows
        return n


class ParquetUnitsCase(ParquetCase):
    """The Parquet sink as a proxy keeps it: the writer holding two rollouts and four blob keys
    in memory (so every path that reads a rollout back is taken), read back through a reader
    indexed per unit (`index="units"`, the proxy's long-lived reader)."""

    def __init__(self, tmp_path: Path, fault: FaultHook | None = None) -> None:
        from capture_proxy.sinks.parquet import ParquetSink

        self.location = tmp_path / "dataset"
        self.sink = ParquetSink(
            str(self.location), fault=fault, max_live_rollouts=2, max_blob_keys=4
        )

    def reopen(self) -> StagingSource:
        from capture_proxy.sinks.parquet import ParquetSource

        return ParquetSource(str(self.location), index="units")


SINKS: dict[str, SinkFactory] = {
    "memory": MemoryCase,
    "sqlite": SQLiteCase,
    "parquet": ParquetCase,
    "parquet-units": ParquetUnitsCase,
}
