"""Records, digests and request schemas: the data model every other part agrees on (no I/O)."""
