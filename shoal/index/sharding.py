"""Which shard a data point belongs to, and which split inside it."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from shoal.log.validation import encode_keys


def shard_numbers(table: pa.Table, shard_attributes: Sequence[str], shard_count: int) -> np.ndarray:
    """The shard of every row: a stable hash (crc32) of its shard attribute values, modulo the shard count.

    Shard attributes are permanent, so an upsert and a later tombstone of one key land on the same shard.
    """
    if shard_count == 1:
        return np.zeros(table.num_rows, dtype=np.int64)
    keys = encode_keys([table[a].combine_chunks() for a in shard_attributes]).to_pylist()
    return np.fromiter((zlib.crc32(k.encode()) % shard_count for k in keys), dtype=np.int64, count=len(keys))


def split_keys(table: pa.Table, split_attributes: Sequence[str]) -> pa.Array:
    """The split of every row, as the encoded values of its split attributes ("" with no split attributes)."""
    if not split_attributes:
        return pa.array([""] * table.num_rows, pa.string())
    return encode_keys([table[a].combine_chunks() for a in split_attributes])
