"""The version-2 worked example of docs/digest.md is in the repo byte for byte
(tests/fixtures/digest/v2-example.hex): an implementer hashes the file's sections and gets the
documented digests, and the code seals the same record to the same digest."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.schemas.test_digest import IMAGE, minimal_v2

EXAMPLE = Path(__file__).parent.parent / "fixtures" / "digest" / "v2-example.hex"
DOCUMENTED = "3545d3dd6dee9b4519c929cabbb072090d057db6b2c6de9ae3ca967e0f5b7544"


def _sections() -> dict[str, bytes]:
    out: dict[str, bytearray] = {}
    current = None
    for line in EXAMPLE.read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if text.startswith("[") and text.endswith("]"):
            current = out.setdefault(text[1:-1], bytearray())
        elif text:
            assert current is not None
            current += bytes.fromhex(text)
    return {k: bytes(v) for k, v in out.items()}


def test_the_v2_example_file_hashes_to_the_documented_digests() -> None:
    parts = _sections()
    assert parts["image"] == IMAGE.data
    image_sha = hashlib.sha256(parts["image"]).hexdigest()
    assert f"attachment:sha256:{image_sha}".encode() in parts["message"]
    message_h = hashlib.sha256(parts["message"]).digest()
    assert b"H" + message_h in parts["record"]
    assert hashlib.sha256(parts["record"]).hexdigest() == DOCUMENTED == minimal_v2().digest
    assert DOCUMENTED in (Path(__file__).parents[2] / "docs" / "digest.md").read_text()
