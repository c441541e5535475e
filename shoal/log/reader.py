"""Reading a data source's log between two seqs, and folding it to the latest state per key."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from sqlalchemy import Engine

from shoal.catalog.repo import head_of, list_segments
from shoal.log.segment_file import read_segment
from shoal.log.validation import KEY, OP, SEQ, SEQ_OFFSET, UPSERT
from shoal.storage import Storage


def read_log(
    engine: Engine,
    storage: Storage,
    source_id: int,
    after_seq: int = 0,
    up_to_seq: int | None = None,
    *,
    columns: Sequence[str] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Yield the log entries with seq in (after_seq, up_to_seq] in seq order, each with its absolute `__seq`.

    `up_to_seq` defaults to the head when the call starts, so a concurrent commit never shows half way.
    Every segment is checked against its recorded checksum before any of it is yielded. `columns` limits
    the columns read (`__seq` is always added). Seqs are strictly increasing but not dense once the log was
    compacted: a compacted segment covers its seq range and holds only the entries that survived.
    """
    if up_to_seq is None:
        up_to_seq = head_of(engine, source_id)[0]
    wanted = None if columns is None else list(dict.fromkeys([SEQ_OFFSET, *columns]))
    # One snapshot of the segment rows: a compaction swapping segments meanwhile leaves the files listed
    # here in place for its grace period, so this read sees the log wholly before or wholly after it.
    for seg in list_segments(engine, source_id, after_seq, up_to_seq):
        table = read_segment(storage, seg.path, seg.checksum, wanted)
        seqs = pc.add(table[SEQ_OFFSET], pa.scalar(seg.first_seq, pa.int64()))
        table = table.append_column(SEQ, seqs)
        if seg.first_seq <= after_seq or seg.last_seq > up_to_seq:
            mask = pc.and_(pc.greater(seqs, after_seq), pc.less_equal(seqs, up_to_seq))
            table = table.filter(mask)
        yield from table.to_batches()


def fold(batches: Iterable[pa.RecordBatch], schema: pa.Schema | None = None) -> pa.Table:
    """The latest state per key: for each key its last entry wins, and a tombstone removes the key.

    Returns the surviving upserts, one row per key, in seq order (an empty `schema` table when none).
    """
    parts = [pa.Table.from_batches([b]) for b in batches if b.num_rows]
    if not parts:
        return schema.empty_table() if schema is not None else pa.table({})
    table = pa.concat_tables(parts)
    latest = table.group_by(KEY, use_threads=False).aggregate([(SEQ, "max")])
    winners = pc.is_in(table[SEQ], value_set=latest[f"{SEQ}_max"])
    table = table.filter(pc.and_(winners, pc.equal(table[OP], UPSERT)))
    order = np.argsort(table[SEQ].to_numpy(), kind="stable")
    return table.take(pa.array(order))
