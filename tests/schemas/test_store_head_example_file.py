"""The store head's worked examples of docs/digest.md are in the repo byte for byte
(tests/fixtures/digest/store-head-example.hex, and store-head-claims-example.hex for a Parquet
dataset's claim files): an implementer expands each leaf with SHAKE-128, adds the lanes with
plain integers, hashes the state and gets the documented head, and the code
(`schemas.store_head`, kept incrementally by a writer) gets the same."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from capture_proxy.schemas.events import event_hash
from capture_proxy.schemas.store_head import ClaimCount, StoreHead, StoreHeadState

EXAMPLE = Path(__file__).parent.parent / "fixtures" / "digest" / "store-head-example.hex"
WITH_CLAIMS = EXAMPLE.with_name("store-head-claims-example.hex")
DOCUMENTED = "b2e73af18ceb4bb20cbb818d4bf645e230555d4323a89697f0788a55f0c04aa3"
DOCUMENTED_WITH_CLAIMS = "ef3f10a671f37783738e871bc916d89177932576382220db8ada2e36b6460c6c"
EMPTY = "c0c16b6d9eb2f4b6913d9653cabdc931964498ddd60c89d08a92a856f89578ce"
R1 = "03b2a3a6b6090e853b493f068c80671305c5386d7af3745c9163de88cf82138b"
R2 = "fbb1e882a0221ae91f0b29e2bb4c5e4258352a8f3f9836bcc08e86a3ddd92f6f"
DOC = Path(__file__).parents[2] / "docs" / "digest.md"


def _sections(example: Path = EXAMPLE) -> dict[str, bytes]:
    out: dict[str, bytearray] = {}
    current = None
    for line in example.read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if text.startswith("[") and text.endswith("]"):
            current = out.setdefault(text[1:-1], bytearray())
        elif text:
            assert current is not None
            current += bytes.fromhex(text)
    return {k: bytes(v) for k, v in out.items()}


def s(text: str) -> bytes:
    """`text` as an ``S`` value, built from docs/digest.md's table."""
    return b"S" + struct.pack("<Q", len(text)) + text.encode()


def i(number: int) -> bytes:
    """`number` as an ``I`` value, built from docs/digest.md's table."""
    return b"I" + struct.pack("<q", number)


def _lanes(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 2}H", data))


def test_the_store_head_example_file_hashes_to_the_documented_head() -> None:
    parts = _sections()
    assert parts["leaf r1"] == b"capture-proxy:store-leaf:v1\0" + s("r1") + s(R1)
    assert parts["leaf r2"] == b"capture-proxy:store-leaf:v1\0" + s("r2") + s(R2)
    leaves = [hashlib.shake_128(parts[f"leaf {r}"]).digest(2048) for r in ("r1", "r2")]
    summed = [(a + b) % 65536 for a, b in zip(*map(_lanes, leaves), strict=True)]
    assert len(summed) == 1024
    assert _lanes(parts["state"]) == summed
    assert parts["head"] == b"capture-proxy:store-head:v1\0"
    head = hashlib.sha256(parts["head"] + parts["state"]).hexdigest()
    assert head == DOCUMENTED
    assert DOCUMENTED in DOC.read_text()
    assert EMPTY in DOC.read_text()


def test_the_code_gets_the_documented_head_at_once_and_event_by_event() -> None:
    assert event_hash("r2", 0, "claim", 0, "c1", 1000, {}, "") == R2
    at_once = StoreHeadState.of([("r1", R1, 1), ("r2", R2, 0)]).head()
    assert at_once == StoreHead(DOCUMENTED, 2, 3)
    # As a writer keeps it: r1's claim, r2's claim, then r1's seal (its claim's leaf taken out).
    r1_claim = "c233ea0f8336e7a97af403f60a4e06a9c04b707e01c6b55757572538c8aff367"
    kept = StoreHeadState()
    kept.advance("r1", "", r1_claim)
    kept.advance("r2", "", R2)
    kept.advance("r1", r1_claim, R1)
    assert kept.head() == at_once
    assert StoreHeadState().head().head == EMPTY


def test_the_claim_files_example_hashes_to_the_documented_head() -> None:
    parts = _sections(WITH_CLAIMS)
    leaf = b"capture-proxy:store-leaf:v1\0"
    one_claim_of_seq_0 = i(1) + i(0)
    assert parts["leaf r1"] == leaf + s("r1") + s(R1) + one_claim_of_seq_0
    assert parts["leaf r2"] == leaf + s("r2") + s("") + one_claim_of_seq_0
    leaves = [hashlib.shake_128(parts[f"leaf {r}"]).digest(2048) for r in ("r1", "r2")]
    summed = [(a + b) % 65536 for a, b in zip(*map(_lanes, leaves), strict=True)]
    assert _lanes(parts["state"]) == summed
    assert parts["head"] == b"capture-proxy:store-head:v1\0"
    head = hashlib.sha256(parts["head"] + parts["state"]).hexdigest()
    assert head == DOCUMENTED_WITH_CLAIMS
    assert DOCUMENTED_WITH_CLAIMS in DOC.read_text()


def test_the_code_gets_the_claim_files_example_at_once_and_as_a_writer_keeps_it() -> None:
    one = ClaimCount(1, 0)
    at_once = StoreHeadState.of([("r1", R1, 1)], {"r1": one, "r2": one}).head()
    assert at_once == StoreHead(DOCUMENTED_WITH_CLAIMS, 2, 2, 2)
    assert at_once.token() == f"{DOCUMENTED_WITH_CLAIMS}:2:2:2"
    assert StoreHead.parse(at_once.token()) == at_once
    # As a Parquet writer keeps it: r1's claim file, its claim event and its seal committing,
    # then r2's claim file (its event never committed: the proxy was killed).
    r1_claim = "c233ea0f8336e7a97af403f60a4e06a9c04b707e01c6b55757572538c8aff367"
    kept = StoreHeadState()
    kept.move("r1", ("", None), ("", one))
    kept.advance("r1", "", r1_claim, one)
    kept.advance("r1", r1_claim, R1, one)
    kept.move("r2", ("", None), ("", one))
    assert kept.head() == at_once
