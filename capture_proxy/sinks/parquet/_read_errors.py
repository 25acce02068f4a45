"""What a failed read of a Parquet dataset means: a file gone under the reader (a compaction's
clean-up: re-list and retry) or damage (a file no writer could have written: said as such)."""

from __future__ import annotations

from ..base import StoreDamaged, StoreError

__all__ = ["damaged", "vanished"]


def vanished(e: OSError) -> bool:
    """Whether `e` says a file is gone: pyarrow's S3 filesystem raises FileNotFoundError when it
    opens a missing file, but a plain OSError ("NO_SUCH_KEY") when a file it opened is deleted
    before it reads a range of it (a compaction's clean-up under a reader): "NO_SUCH_KEY", or
    "RESOURCE_NOT_FOUND" when the 404 has no body. A response that broke off mid-read
    ("INTERNAL_FAILURE ... Failed to flush response stream", seen on moto's server while a
    compaction's clean-up ran beside the reads; S3 asks clients to retry an internal error) is
    read again too."""
    return any(
        code in str(e)
        for code in (
            "NO_SUCH_KEY",
            "NoSuchKey",
            "RESOURCE_NOT_FOUND",
            "Failed to flush response stream",
        )
    )


def damaged(url: str, e: BaseException) -> StoreDamaged | None:
    """`e` as damage of the dataset at `url`, or None when it is not (a store error of its
    own, an unknown key, an I/O failure). pyarrow's ArrowInvalid and ArrowTypeError are
    ValueError and TypeError: a file no writer could have written ends a read as damage, not as
    a traceback."""
    if isinstance(e, (KeyError, StoreError)) or not isinstance(
        e, (ValueError, TypeError, OverflowError, UnicodeError, IndexError)
    ):
        return None
    return StoreDamaged(
        f"{url} is damaged ({type(e).__name__}: {e}); capture-proxy inspect --verify lists "
        "the damage"
    )
