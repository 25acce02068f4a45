"""Storage backends behind the `StagingSink` / `StagingSource` protocols."""

from .base import StagingSink, StagingSource, StoreError, StoreFormatError
from .memory import MemorySink

__all__ = ["MemorySink", "StagingSink", "StagingSource", "StoreError", "StoreFormatError"]
