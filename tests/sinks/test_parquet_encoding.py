"""What `encode_table` stores: a column chunk is compressed only from `COMPRESS_COLUMN_BYTES` up
and dictionaries only from `DICTIONARY_ROWS` rows up, whether or not the table's buffers are
shared with a larger one (a slice)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from capture_proxy.sinks.parquet._layout import (
    COMPRESS_COLUMN_BYTES,
    DICTIONARY_ROWS,
    encode_table,
)


def _codecs(data: bytes) -> dict[str, tuple[str, bool]]:
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata.row_group(0)
    return {
        meta.column(i).path_in_schema: (
            meta.column(i).compression,
            meta.column(i).dictionary_page_offset is not None,
        )
        for i in range(meta.num_columns)
    }


def test_small_columns_are_stored_plain_and_large_ones_compressed() -> None:
    big = "x" * COMPRESS_COLUMN_BYTES
    table = pa.table({"rollout_id": ["r"], "body": [big], "ids": [[1, 2, 3]]})
    assert _codecs(encode_table(table)) == {
        "rollout_id": ("UNCOMPRESSED", False),
        "body": ("ZSTD", False),
        "ids.list.element": ("UNCOMPRESSED", False),
    }
    tiny = pa.table({"rollout_id": ["r"], "body": ["b"]})
    assert _codecs(encode_table(tiny)) == {
        "rollout_id": ("UNCOMPRESSED", False),
        "body": ("UNCOMPRESSED", False),
    }


def test_a_slice_of_a_large_table_is_judged_by_its_own_bytes() -> None:
    rows = 4 * DICTIONARY_ROWS
    table = pa.table({"rollout_id": ["r"] * rows, "body": ["y" * 64] * rows})
    # Two rows of it: their buffers are the whole table's, their bytes a few dozen.
    assert _codecs(encode_table(table.slice(0, 2))) == {
        "rollout_id": ("UNCOMPRESSED", False),
        "body": ("UNCOMPRESSED", False),
    }
    # The whole table: every column over the limit, and enough rows for a dictionary.
    assert _codecs(encode_table(table)) == {
        "rollout_id": ("UNCOMPRESSED", True),
        "body": ("ZSTD", False),
    }
