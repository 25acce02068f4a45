"""The one base of every request struct: unknown keys are an error, never silently dropped."""

from __future__ import annotations

from msgspec import Struct

__all__ = ["Strict"]


class Strict(Struct, forbid_unknown_fields=True):
    """Base: unknown keys are an error (a 422 naming the key's JSON path), never dropped."""
