"""The digest encoding, pinned: golden vectors of both versions, one vector of each rebuilt from
docs/digest.md with `struct`, the doc's worked example, coverage of every digest field, and
refusals that name the path of the bad value.

`minimal` and `rich` are version-1 records (what the previous release sealed: they must keep
verifying); `minimal_v2` and `rich_v2` are version 2, with every field of record schema 2 set.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from array import array
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capture_proxy.schemas.attachments import attachment_url
from capture_proxy.schemas.digest import (
    MESSAGE_DOMAIN,
    RECORD_FIELDS,
    RECORD_FIELDS_V1,
    DigestMismatch,
    EncodingError,
    encode_value,
    extras_digest,
    message_digest,
    record_digest,
    seal_record,
    verify_record,
)
from capture_proxy.schemas.records import (
    V2_DEFAULTS as DEFAULTS,
)
from capture_proxy.schemas.records import (
    Attachment,
    RecordValidationError,
    StagedCallRecord,
)
from tests.support import ROOT

DOC = ROOT / "docs" / "digest.md"
IMAGE = Attachment.from_bytes(b"\x89PNG\r\n\x1a\n golden image bytes", "image/png")


def minimal(**v2: Any) -> StagedCallRecord:
    """The minimal record; version 1 unless fields of version 2 are given."""
    return seal_record(
        StagedCallRecord(
            schema_version=2 if v2 else 1,
            **v2,
            rollout_id="r1",
            call_id="c1",
            seq=0,
            model="m",
            finish_reason="stop",
            request={"messages": [{"role": "user", "content": "hi"}]},
            response={"role": "assistant", "content": "hello"},
            prompt_token_ids=array("i", [1, 2, 3]),
            completion_token_ids=array("i", [4]),
            completion_logprobs=array("f", [-0.5]),
        )
    )


def rich(image_sha: str = "5f" * 32, **v2: Any) -> StagedCallRecord:
    """Tool calls, reasoning, an image reference, extras, and every optional field of version 1
    set; version 2 when fields of version 2 are given (then the image is `IMAGE`, with its media
    type)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "bash",
                "parameters": {
                    "type": "object",
                    "properties": {"command": {"type": "string"}},
                    "required": ["command"],
                },
            },
        }
    ]
    messages = [
        {"role": "system", "content": "You are OpenCode."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture? ünïcode ✓"},
                {"type": "image_url", "image_url": {"url": attachment_url(image_sha)}},
            ],
        },
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Let me look.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": '{"command":"ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "cat.png\n"},
    ]
    return seal_record(
        StagedCallRecord(
            schema_version=2 if v2 else 1,
            **v2,
            rollout_id="rollout-7",
            call_id="call-0042",
            seq=3,
            model="qwen3-tiny",
            finish_reason="tool_calls",
            request={
                "model": "qwen3-tiny",
                "stream": True,
                "max_tokens": 32000,
                "tool_choice": "auto",
                "tools": tools,
                "messages": messages,
            },
            response={
                "role": "assistant",
                "content": None,
                "reasoning_content": "Run file on it.",
                "tool_calls": [
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"command":"file cat.png"}'},
                    }
                ],
            },
            prompt_token_ids=array("i", [151644, 8948, 198, 0, 2147483647, 42]),
            completion_token_ids=array("i", [151657, 515, 151658]),
            completion_logprobs=array("f", [-0.0, -1.25, -17.5]),
            parent_call_id="call-0041",
            retry_of="call-0040",
            created_at_ms=1764441600123,
            weight_version=17,
            upstream_version="0.32.0",
            tokenizer_fingerprint="ab" * 32,
            sampling={
                "temperature": 0.7,
                "top_p": 0.95,
                "seed": -1,
                "stop": ["</s>"],
                "logprobs": True,
                "top_logprobs": 0,
            },
            extras={
                "routed_experts": "k05VTVBZAQB2AHsn",
                "media_spans": [[4, 260]],
                "routed_experts_prompt_start": 3,
                "note": None,
            },
        ),
        attachments={image_sha: IMAGE} if v2 else None,
    )


#: Every field of record schema 2 set to something other than its default.
V2_FIELDS: dict[str, Any] = {
    "engine_weight_version": "ckpt-17",
    "weight_spans": [("ckpt-17", 0, 2), ("ckpt-18", 2, 3)],
    "token_in": True,
    "bridge_spans": [(4, 5, "end_of_turn")],
    "replica": "http://vllm-1:8000",
    "effective_sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 20},
    "logprobs_mode": "processed_logprobs",
}


#: The image part of `minimal_v2`'s user message.
IMAGE_PART = {"type": "image_url", "image_url": {"url": attachment_url(IMAGE.sha256)}}


def minimal_v2() -> StagedCallRecord:
    """The version-2 vector of docs/digest.md: `minimal` with an image and a few new fields."""
    return seal_record(
        StagedCallRecord(
            rollout_id="r1",
            call_id="c1",
            seq=0,
            model="m",
            finish_reason="stop",
            request={"messages": [{"role": "user", "content": [IMAGE_PART]}]},
            response={"role": "assistant", "content": "hello"},
            prompt_token_ids=array("i", [1, 2, 3]),
            completion_token_ids=array("i", [4]),
            completion_logprobs=array("f", [-0.5]),
            weight_spans=[("w1", 0, 1)],
            logprobs_mode="raw_logprobs",
        ),
        attachments={IMAGE.sha256: IMAGE},
    )


def rich_v2() -> StagedCallRecord:
    return rich(IMAGE.sha256, **V2_FIELDS)


# -- golden vectors ---------------------------------------------------------------------------

GOLDEN = {
    "minimal": (
        minimal,
        "cd851e87c1e19cb6ca54f2f22866d0b8aa26816c58c27e541dcb640b440580d8",
        "bcd7dd3dccf7647ed8735c4a01859bb091fc460fb6f942737dff1b85f4b32db3",
    ),
    "rich": (
        rich,
        "cc2419bba9422c9dd846fb1a452f8929a38ed2346a15d72066c16acf7ce98486",
        "ded97e4ba9f9db6cdb88f0023a6d3df9048ad7f84a162eab86a3b8977bd794e5",
    ),
    "minimal_v2": (
        minimal_v2,
        "3545d3dd6dee9b4519c929cabbb072090d057db6b2c6de9ae3ca967e0f5b7544",
        "bcd7dd3dccf7647ed8735c4a01859bb091fc460fb6f942737dff1b85f4b32db3",
    ),
    "rich_v2": (
        rich_v2,
        "de0469f34ea880ef5036e563459b6e411b98c5a0a0b8735a32df5ebdee764639",
        "ded97e4ba9f9db6cdb88f0023a6d3df9048ad7f84a162eab86a3b8977bd794e5",
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_vectors(name: str) -> None:
    build, digest, ex = GOLDEN[name]
    record = build()
    assert (record.digest, record.extras_digest) == (digest, ex)


def _u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def _s(text: str) -> bytes:
    b = text.encode("utf-8")
    return b"S" + _u64(len(b)) + b


def _i(n: int) -> bytes:
    return b"I" + struct.pack("<q", n)


def _map(pairs: dict[str, bytes]) -> bytes:
    keys = sorted(pairs, key=lambda k: k.encode("utf-8"))
    return b"M" + _u64(len(keys)) + b"".join(_s(k) + pairs[k] for k in keys)


def test_minimal_record_built_by_hand_from_the_spec() -> None:
    """The bytes docs/digest.md describes, written out with struct, hash to the golden digest."""
    message = _map({"role": _s("user"), "content": _s("hi")})
    message_h = hashlib.sha256(b"capture-proxy:message:v1\x00" + message).digest()
    extras_hex = hashlib.sha256(b"capture-proxy:extras:v1\x00" + b"M" + _u64(0)).hexdigest()
    fields = [
        ("schema_version", _i(1)),
        ("rollout_id", _s("r1")),
        ("call_id", _s("c1")),
        ("parent_call_id", b"N"),
        ("seq", _i(0)),
        ("retry_of", b"N"),
        ("created_at_ms", _i(0)),
        ("weight_version", _i(0)),
        ("model", _s("m")),
        ("upstream_version", _s("")),
        ("tokenizer_fingerprint", _s("")),
        ("sampling", b"M" + _u64(0)),
        ("finish_reason", _s("stop")),
        ("request", _map({"messages": b"L" + _u64(1) + b"H" + message_h})),
        ("response", _map({"role": _s("assistant"), "content": _s("hello")})),
        ("prompt_token_ids", b"i" + _u64(3) + struct.pack("<3i", 1, 2, 3)),
        ("completion_token_ids", b"i" + _u64(1) + struct.pack("<i", 4)),
        ("completion_logprobs", b"f" + _u64(1) + struct.pack("<f", -0.5)),
        ("extras_digest", _s(extras_hex)),
    ]
    assert tuple(name for name, _ in fields) == RECORD_FIELDS_V1
    data = b"capture-proxy:record:v1\x00" + b"".join(_s(name) + value for name, value in fields)
    record = minimal()
    assert extras_hex == record.extras_digest == GOLDEN["minimal"][2]
    assert hashlib.sha256(data).hexdigest() == record.digest == GOLDEN["minimal"][1]


def test_minimal_v2_record_built_by_hand_from_the_spec() -> None:
    """Version 2 from docs/digest.md with struct: version 1's fields, the new ones, and the
    attachments with their media types, after the ``record:v2`` domain."""
    image_part = _map(
        {
            "type": _s("image_url"),
            "image_url": _map({"url": _s("attachment:sha256:" + IMAGE.sha256)}),
        }
    )
    message = _map({"role": _s("user"), "content": b"L" + _u64(1) + image_part})
    message_h = hashlib.sha256(b"capture-proxy:message:v1\x00" + message).digest()
    extras_hex = hashlib.sha256(b"capture-proxy:extras:v1\x00" + b"M" + _u64(0)).hexdigest()
    fields = [
        ("schema_version", _i(2)),
        ("rollout_id", _s("r1")),
        ("call_id", _s("c1")),
        ("parent_call_id", b"N"),
        ("seq", _i(0)),
        ("retry_of", b"N"),
        ("created_at_ms", _i(0)),
        ("weight_version", _i(0)),
        ("model", _s("m")),
        ("upstream_version", _s("")),
        ("tokenizer_fingerprint", _s("")),
        ("sampling", b"M" + _u64(0)),
        ("finish_reason", _s("stop")),
        ("request", _map({"messages": b"L" + _u64(1) + b"H" + message_h})),
        ("response", _map({"role": _s("assistant"), "content": _s("hello")})),
        ("prompt_token_ids", b"i" + _u64(3) + struct.pack("<3i", 1, 2, 3)),
        ("completion_token_ids", b"i" + _u64(1) + struct.pack("<i", 4)),
        ("completion_logprobs", b"f" + _u64(1) + struct.pack("<f", -0.5)),
        ("extras_digest", _s(extras_hex)),
        ("engine_weight_version", b"N"),
        ("weight_spans", b"L" + _u64(1) + b"L" + _u64(3) + _s("w1") + _i(0) + _i(1)),
        ("token_in", b"F"),
        ("bridge_spans", b"L" + _u64(0)),
        ("replica", _s("")),
        ("effective_sampling", b"N"),
        ("logprobs_mode", _s("raw_logprobs")),
        ("attachments", b"L" + _u64(1) + b"L" + _u64(2) + _s(IMAGE.sha256) + _s("image/png")),
    ]
    assert tuple(name for name, _ in fields) == RECORD_FIELDS
    data = b"capture-proxy:record:v2\x00" + b"".join(_s(name) + value for name, value in fields)
    record = minimal_v2()
    assert extras_hex == record.extras_digest == GOLDEN["minimal_v2"][2]
    assert hashlib.sha256(data).hexdigest() == record.digest == GOLDEN["minimal_v2"][1]


def test_worked_example_in_the_doc_is_what_the_code_produces() -> None:
    text = DOC.read_text()
    (hex_block,) = re.findall(r"```hex\n(.*?)```", text, re.S)
    (sha_block,) = re.findall(r"```sha256\n(.*?)```", text, re.S)
    data = bytes.fromhex(" ".join(line.split("#")[0] for line in hex_block.splitlines()))
    message = {"role": "user", "content": "hi"}
    assert data == MESSAGE_DOMAIN + encode_value(message)
    assert len(data) == 87
    assert hashlib.sha256(data).hexdigest() == sha_block.strip()
    assert message_digest(message).hex() == sha_block.strip()
    assert GOLDEN["minimal"][1] in text
    assert GOLDEN["minimal"][2] in text
    assert GOLDEN["minimal_v2"][1] in text
    assert encode_value(array("i", [1, 2])).hex(" ") in text
    assert encode_value(array("f", [-0.5])).hex(" ") in text


# -- every covered field is covered -----------------------------------------------------------


def _bump_logprob(r: StagedCallRecord) -> StagedCallRecord:
    lps = array("f", r.completion_logprobs)
    (bits,) = struct.unpack("<I", struct.pack("<f", lps[1]))
    (lps[1],) = struct.unpack("<f", struct.pack("<I", bits + 1))  # one float32 ULP
    return replace(r, completion_logprobs=lps)


def _edit_message(r: StagedCallRecord) -> StagedCallRecord:
    messages = [dict(m) for m in r.request["messages"]]
    messages[3]["content"] = "cat.png"  # the tool output lost its newline
    return replace(r, request={**r.request, "messages": messages})


EDITS: dict[str, Callable[[StagedCallRecord], StagedCallRecord]] = {
    # Read as version 2 (whose digest also needs the image's media type).
    "schema_version": lambda r: replace(
        r, schema_version=2, attachments=(Attachment("5f" * 32, "image/png", b""),)
    ),
    "rollout_id": lambda r: replace(r, rollout_id="rollout-8"),
    "call_id": lambda r: replace(r, call_id="call-0043"),
    "parent_call_id": lambda r: replace(r, parent_call_id=None),
    "seq": lambda r: replace(r, seq=4),
    "retry_of": lambda r: replace(r, retry_of=None),
    "created_at_ms": lambda r: replace(r, created_at_ms=r.created_at_ms + 1),
    "weight_version": lambda r: replace(r, weight_version=18),
    "model": lambda r: replace(r, model="qwen3-tiny2"),
    "upstream_version": lambda r: replace(r, upstream_version="0.32.1"),
    "tokenizer_fingerprint": lambda r: replace(r, tokenizer_fingerprint="ac" * 32),
    "sampling": lambda r: replace(r, sampling={**r.sampling, "temperature": 0.70000001}),
    "finish_reason": lambda r: replace(r, finish_reason="stop"),
    "request": _edit_message,
    "response": lambda r: replace(r, response={**r.response, "reasoning_content": "Run it."}),
    "prompt_token_ids": lambda r: replace(
        r, prompt_token_ids=array("i", [*r.prompt_token_ids[:-1], 43])
    ),
    "completion_token_ids": lambda r: replace(
        r, completion_token_ids=array("i", [151657, 516, 151658])
    ),
    "completion_logprobs": _bump_logprob,
    "extras_digest": lambda r: replace(r, extras_digest="0" * 64),
}
#: Edits of a version-2 record's own fields (applied to `rich_v2`).
EDITS_V2: dict[str, Callable[[StagedCallRecord], StagedCallRecord]] = {
    **EDITS,
    "schema_version": lambda r: replace(r, schema_version=1, **DEFAULTS),
    "engine_weight_version": lambda r: replace(r, engine_weight_version="ckpt-18"),
    "weight_spans": lambda r: replace(r, weight_spans=[("ckpt-17", 0, 1), ("ckpt-18", 1, 3)]),
    "token_in": lambda r: replace(r, token_in=False),
    "bridge_spans": lambda r: replace(r, bridge_spans=[(4, 5, "end_of_turn_length")]),
    "replica": lambda r: replace(r, replica="http://vllm-2:8000"),
    "effective_sampling": lambda r: replace(r, effective_sampling=None),
    "logprobs_mode": lambda r: replace(r, logprobs_mode="raw_logprobs"),
    # An attachment's media type edited in the store (its bytes unchanged).
    "attachments": lambda r: replace(r, attachments=(replace(IMAGE, media_type="image/jpeg"),)),
}


def test_every_record_field_has_an_edit() -> None:
    assert set(EDITS) == set(RECORD_FIELDS_V1)
    assert set(EDITS_V2) == set(RECORD_FIELDS)


@pytest.mark.parametrize("name", RECORD_FIELDS_V1)
def test_editing_a_covered_field_changes_the_digest(name: str) -> None:
    record = rich()
    edited = EDITS[name](record)
    assert getattr(edited, name) != getattr(record, name)
    assert record_digest(edited) != record.digest
    with pytest.raises(DigestMismatch, match=r"call-004[23]: (digest|extras_digest) mismatch"):
        verify_record(edited)  # the stored digest no longer matches


@pytest.mark.parametrize("name", RECORD_FIELDS)
def test_editing_a_covered_field_of_a_v2_record_breaks_verify(name: str) -> None:
    record = replace(rich_v2(), attachments=(IMAGE,))
    verify_record(record)
    edited = EDITS_V2[name](record)
    assert getattr(edited, name) != getattr(record, name)
    with pytest.raises(DigestMismatch, match=r"call-004[23]: (digest|extras_digest) mismatch"):
        verify_record(edited)


def test_v1_records_verify_with_the_v1_encoding() -> None:
    """A record sealed by the previous release (schema 1, digest v1) keeps verifying."""
    record = replace(rich(IMAGE.sha256), attachments=(IMAGE,))
    assert record.digest_version == 1
    verify_record(record)
    # Its digest does not bind the media type (version 1 did not): only version 2 does.
    verify_record(replace(record, attachments=(replace(IMAGE, media_type="image/jpeg"),)))


def test_a_v1_record_cannot_hold_fields_of_version_2() -> None:
    """A version-1 digest does not cover them, so they would be unsealed: refused by name."""
    fits_minimal = {**V2_FIELDS, "weight_spans": [("w1", 0, 1)], "bridge_spans": [(0, 1, "x")]}
    v1 = {f.name: getattr(minimal(), f.name) for f in fields(StagedCallRecord)}
    for name, value in fits_minimal.items():
        with pytest.raises(RecordValidationError, match=f"^{name}: needs record schema_version 2"):
            StagedCallRecord(**{**v1, name: value})


def test_sealing_a_v2_record_needs_its_attachments_media_types() -> None:
    with pytest.raises(EncodingError, match=f"attachments: .*{IMAGE.sha256}.*media type"):
        seal_record(replace(minimal_v2(), digest=""), attachments={})
    # Read back from a store, a record carries its attachments: they are used.
    assert seal_record(replace(minimal_v2(), attachments=(IMAGE,))).digest == minimal_v2().digest


def test_an_edited_attachment_media_type_names_the_record() -> None:
    record = replace(minimal_v2(), attachments=(replace(IMAGE, media_type="image/gif"),))
    with pytest.raises(DigestMismatch, match="c1: digest mismatch"):
        verify_record(record)


def test_request_keys_beyond_messages_are_covered() -> None:
    record = rich()
    assert record_digest(replace(record, request={**record.request, "max_tokens": 31999})) != (
        record.digest
    )


def test_editing_extras_changes_both_digests() -> None:
    record = rich()
    edited = replace(record, extras={**record.extras, "media_spans": [[4, 261]]})
    assert extras_digest(edited.extras) != record.extras_digest
    with pytest.raises(DigestMismatch, match="extras_digest"):
        verify_record(edited)
    resealed = seal_record(edited)
    assert resealed.digest != record.digest


def test_attachment_bytes_are_bound_by_reference_not_hashed_in() -> None:
    record = rich(IMAGE.sha256)
    other = Attachment.from_bytes(b"other bytes", "image/png")
    with_image = replace(record, attachments=(IMAGE,))
    verify_record(with_image)
    # The bytes are not part of the digest: attaching them changes nothing ...
    assert seal_record(with_image).digest == record.digest
    # ... but wrong bytes under the reference fail verification, naming the attachment,
    forged = replace(record, attachments=(Attachment(IMAGE.sha256, "image/png", other.data),))
    with pytest.raises(DigestMismatch, match=IMAGE.sha256):
        verify_record(forged)
    with pytest.raises(DigestMismatch, match="missing"):
        verify_record(record)  # and so does a reference with no bytes.
    # Changing the reference changes the digest.
    assert rich(other.sha256).digest != record.digest


@pytest.mark.parametrize(
    ("extras", "path", "what"),
    [
        ({"media_spans": [[1, 2], [3, math.nan]]}, "extras.media_spans[1][1]", "NaN"),
        ({"x": {"y": math.inf}}, "extras.x.y", "inf"),
        ({"routed": {1: "a"}}, "extras.routed", "not a string"),
        ({"big": 2**63}, "extras.big", "int64"),
        ({"small": [-(2**63) - 1]}, "extras.small[0]", "int64"),
        ({"s": "\ud800"}, "extras.s", "surrogate"),
        ({"o": object()}, "extras.o", "no canonical encoding"),
    ],
)
def test_unencodable_extras_refused_with_their_path(
    extras: dict[Any, Any], path: str, what: str
) -> None:
    with pytest.raises(EncodingError, match=re.escape(path)) as info:
        seal_record(replace(minimal(), extras=extras))
    assert what.lower() in str(info.value).lower()
    assert info.value.field == path


def test_unencodable_request_and_sampling_refused_with_their_path() -> None:
    bad_message = {"messages": [{"role": "user", "content": "ok"}, {"role": "user", "x": math.nan}]}
    with pytest.raises(EncodingError, match=re.escape("request.messages[1].x")):
        seal_record(replace(minimal(), request=bad_message))
    with pytest.raises(EncodingError, match=re.escape("sampling.seed")):
        seal_record(replace(minimal(), sampling={"seed": 2**64}))
    with pytest.raises(EncodingError, match=re.escape("request.messages")):
        seal_record(replace(minimal(), request={"model": "m"}))


def test_int64_bounds_are_accepted() -> None:
    assert encode_value(2**63 - 1) == b"I" + struct.pack("<q", 2**63 - 1)
    assert encode_value(-(2**63)) == b"I" + struct.pack("<q", -(2**63))


# -- properties ------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=6),
            inner,
            max_size=4,
        )
    ),
    max_leaves=20,
)


def _strict_equal(a: Any, b: Any) -> bool:
    """Equality the encoding must respect: same types all the way down, floats by bits."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_strict_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_strict_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def _reversed_keys(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _reversed_keys(v[k]) for k in reversed(list(v))}
    if isinstance(v, list):
        return [_reversed_keys(x) for x in v]
    return v


@given(json_values)
def test_key_order_does_not_matter(value: Any) -> None:
    assert encode_value(_reversed_keys(value)) == encode_value(value)


@given(st.dictionaries(st.text(max_size=5), json_scalars, min_size=1, max_size=6))
def test_record_digest_ignores_request_key_order(extra: dict[str, Any]) -> None:
    record = minimal()
    extra.pop("messages", None)
    forward = {**extra, "messages": list(record.request["messages"])}
    backward = _reversed_keys(forward)
    assert record_digest(replace(record, request=forward)) == record_digest(
        replace(record, request=backward)
    )


def test_distinct_types_encode_differently() -> None:
    values: list[Any] = [
        1, 1.0, True, "1", [1], {"1": 1}, None, b"1", (1,), array("i", [1]), array("f", [1.0]),
        0, 0.0, -0.0, False, "", [], {}, b"",
    ]  # fmt: skip
    encodings = [encode_value(v) for v in values]
    # (1,) and [1] are the same JSON list: the only intended collision.
    assert encodings[4] == encodings[8]
    distinct = encodings[:8] + encodings[9:]
    assert len(set(distinct)) == len(distinct)


@given(json_values, json_values)
def test_encoding_is_injective(a: Any, b: Any) -> None:
    assert (encode_value(a) == encode_value(b)) == _strict_equal(a, b)


@given(json_values)
def test_equal_values_have_equal_encodings(a: Any) -> None:
    import copy

    assert encode_value(copy.deepcopy(a)) == encode_value(a)


def test_map_keys_with_lone_surrogates_are_refused() -> None:
    from capture_proxy.schemas.digest import EncodingError, extras_digest, record_digest

    with pytest.raises(EncodingError, match="extras"):
        extras_digest({"\ud800": 1})
    bad_request = replace(minimal(), request={"messages": [], "\udc00x": 1})
    with pytest.raises(EncodingError, match="request"):
        record_digest(bad_request)
