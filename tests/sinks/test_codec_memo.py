"""The codec names each message blob of a rollout once (`codec.MESSAGE_KEYS`), and the row and
blobs it writes are exactly those it wrote without the memo."""

from __future__ import annotations

import hashlib
from array import array
from typing import Any

import orjson

from capture_proxy.schemas.digest import seal_record, verify_record
from capture_proxy.schemas.records import StagedCallRecord
from capture_proxy.sinks.codec import MESSAGE_KEYS, decode_row, encode_record


def _record(rollout: str, seq: int, messages: list[dict[str, Any]]) -> StagedCallRecord:
    return seal_record(
        StagedCallRecord(
            rollout_id=rollout,
            call_id=f"{rollout}-{seq}",
            seq=seq,
            model="m",
            finish_reason="stop",
            # Decoded afresh, as every call's request is.
            request=orjson.loads(orjson.dumps({"model": "m", "messages": messages})),
            response={"role": "assistant", "content": f"answer {seq}"},
            prompt_token_ids=array("i", range(10 + seq)),
            completion_token_ids=array("i", [7]),
            completion_logprobs=array("f", [-0.5]),
        )
    )


def test_rows_and_blobs_are_the_same_with_every_message_hashed_once_per_rollout() -> None:
    history: list[dict[str, Any]] = [{"role": "system", "content": "s" * 300}]
    hits = MESSAGE_KEYS.hits
    for seq in range(5):
        history = [*history, {"role": "user", "content": f"q{seq}", "extra": [seq, None]}]
        record = _record("codec-memo", seq, history)
        encoded = encode_record(record, None)
        datas = [orjson.dumps(m) for m in record.request["messages"]]
        keys = [hashlib.sha256(d).hexdigest() for d in datas]
        assert encoded.row["message_keys"] == b"".join(bytes.fromhex(k) for k in keys)
        assert all(encoded.blobs[k] == d for k, d in zip(keys, datas, strict=True))
        back, _ = decode_row(encoded.row, encoded.blobs.__getitem__, None)
        verify_record(back)
        assert back.digest == record.digest
    # Call n sends n + 2 messages, of which n + 1 were sent before: each named from the memo.
    assert MESSAGE_KEYS.hits - hits == sum(seq + 1 for seq in range(1, 5))
