"""Encoding a log segment: validated batches plus seq offsets and ingestion time, as one Parquet file."""

from __future__ import annotations

import datetime as dt
import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shoal.errors import ShoalError
from shoal.ingest.batch import INGESTED_AT, OP, SEQ_OFFSET, SPARSE_INDICES, SPARSE_VALUES, UPSERT, VECTOR


class CorruptSegmentError(ShoalError):
    """A segment's bytes do not match the checksum the catalog recorded."""


def build_segment_table(tables: list[pa.Table]) -> pa.Table:
    """Concatenate validated batches in order and number their entries 0..n-1 (the seq offsets)."""
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    n = table.num_rows
    now = pa.scalar(dt.datetime.now(dt.UTC), pa.timestamp("us", tz="UTC"))
    table = table.add_column(0, SEQ_OFFSET, pa.array(np.arange(n, dtype=np.int64)))
    return table.append_column(INGESTED_AT, pa.repeat(now, n))


def count_ops(table: pa.Table) -> tuple[int, int]:
    """(upserts, tombstones) in a batch or segment table."""
    upserts = int(pa.compute.sum(pa.compute.equal(table[OP], UPSERT)).as_py() or 0)
    return upserts, table.num_rows - upserts


def encode_segment(table: pa.Table) -> tuple[pa.Buffer, str]:
    """The Parquet bytes of a segment table and their checksum (`sha256:<hex>`)."""
    sink = pa.BufferOutputStream()
    vector_columns = {VECTOR, SPARSE_INDICES, SPARSE_VALUES}
    others = [f.name for f in table.schema if f.name not in vector_columns]
    # Embedding floats neither dictionary-encode nor compress usefully; skipping both for the vector
    # column keeps encoding close to memcpy speed. Attribute columns keep both, and statistics for
    # pruning by seq offset and attribute values.
    pq.write_table(
        table,
        sink,
        compression={name: "snappy" for name in others} | {name: "none" for name in vector_columns & set(table.column_names)},
        use_dictionary=[name for name in others if name not in (SEQ_OFFSET,)],
        write_statistics=others,
        row_group_size=max(table.num_rows, 1),
    )
    buf = sink.getvalue()
    return buf, checksum(buf)


def checksum(buf: pa.Buffer | bytes) -> str:
    """The checksum recorded for a segment file."""
    return "sha256:" + hashlib.sha256(memoryview(buf)).hexdigest()


def decode_segment(buf: pa.Buffer, expected_checksum: str, path: str) -> pa.Table:
    """The table in a segment file, after checking its bytes against the catalog's checksum."""
    got = checksum(buf)
    if got != expected_checksum:
        raise CorruptSegmentError(f"segment {path} is corrupt: checksum {got} != recorded {expected_checksum}")
    return pq.read_table(pa.BufferReader(buf))
