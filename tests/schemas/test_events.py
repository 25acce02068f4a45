"""The event hash is pinned: docs/digest.md ("The event log") gives these vectors."""

from __future__ import annotations

import hashlib
import struct

from capture_proxy.schemas.events import EventDraft, EventKind, chain_event, claim_event


def _s(text: str) -> bytes:
    b = text.encode()
    return b"S" + struct.pack("<Q", len(b)) + b


def test_a_first_claim_built_by_hand_from_the_spec() -> None:
    data = b"capture-proxy:event:v1\x00"
    data += _s("rollout_id") + _s("r1")
    data += _s("position") + b"I" + struct.pack("<q", 0)
    data += _s("kind") + _s("claim")
    data += _s("seq") + b"I" + struct.pack("<q", 0)
    data += _s("call_id") + _s("c1")
    data += _s("at_ms") + b"I" + struct.pack("<q", 1000)
    data += _s("body") + b"M" + struct.pack("<Q", 0)
    data += _s("prev_hash") + _s("")
    first = chain_event(claim_event("r1", 0, "c1", 1000), None)
    assert first.hash == hashlib.sha256(data).hexdigest()
    assert first.hash == "c233ea0f8336e7a97af403f60a4e06a9c04b707e01c6b55757572538c8aff367"
    seal = chain_event(EventDraft("r1", EventKind.SEAL, 2000), (first.position, first.hash))
    assert (seal.position, seal.prev_hash) == (1, first.hash)
    assert seal.hash == "03b2a3a6b6090e853b493f068c80671305c5386d7af3745c9163de88cf82138b"
