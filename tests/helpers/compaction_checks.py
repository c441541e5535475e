"""Workload and checks shared by the compaction tests and their child processes."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import pyarrow as pa
from sqlalchemy import select
from sqlalchemy.orm import Session

from shoal import DataPoint, DataSourceSpec, Shoal, Tombstone
from shoal.catalog.models import ProducerBatch
from shoal.log.segment_file import decode_segment

DIM = 8
COMPACT_SPEC = DataSourceSpec("Compact.Source", "1", DIM, {"id": "int64", "text": "string"}, ["id"])
KEYS = 60  # the keys the crash workload updates and deletes


def _rng(batch_id: str) -> random.Random:
    return random.Random(int(hashlib.sha1(batch_id.encode()).hexdigest()[:12], 16))


def vector_of(batch_id: str, position: int) -> list[float]:
    """A deterministic vector for a batch's point, so a checker can recompute it from the batch id."""
    rng = _rng(f"{batch_id}/{position}")
    return [rng.uniform(-1, 1) for _ in range(DIM)]


def mix_batch(batch_id: str) -> list[DataPoint | Tombstone]:
    """A batch of the crash workload, derived from its id: half upserts, half tombstones of KEYS keys."""
    rng = _rng(batch_id)
    items: list[DataPoint | Tombstone] = []
    for pos in range(rng.randint(4, 24)):
        k = rng.randrange(KEYS)
        if rng.random() < 0.5:
            items.append(Tombstone({"id": k}))
        else:
            items.append(DataPoint({"id": k, "text": f"{batch_id}/{pos}"}, vector_of(batch_id, pos)))
    return items


def init_batch(batch_id: str, keys: range) -> list[DataPoint | Tombstone]:
    """Inserts of `keys`, with vectors derived from the batch id."""
    return [DataPoint({"id": k, "text": f"{batch_id}/{i}"}, vector_of(batch_id, i)) for i, k in enumerate(keys)]


def committed_batches(shoal: Shoal, name: str, version: str) -> list[tuple[str, int, int]]:
    """(batch id, first seq, last seq) of every committed producer batch of the source, in seq order."""
    source_id = shoal.get_data_source(name, version).id
    with Session(shoal.engine) as s:
        rows = s.execute(
            select(ProducerBatch.batch_id, ProducerBatch.first_seq, ProducerBatch.last_seq)
            .where(ProducerBatch.data_source_id == source_id)
            .order_by(ProducerBatch.first_seq)
        ).all()
    return [(r[0], int(r[1]), int(r[2])) for r in rows]


def replay(batches: list[tuple[str, list[DataPoint | Tombstone]]]) -> dict[int, str]:
    """key -> text of the live points after applying the batches in order (last write wins)."""
    state: dict[int, str] = {}
    for _, items in batches:
        for item in items:
            if isinstance(item, Tombstone):
                state.pop(int(item.key["id"]), None)  # type: ignore[call-overload]
            else:
                state[int(item.attributes["id"])] = str(item.attributes["text"])  # type: ignore[call-overload]
    return state


def folded_state(shoal: Shoal, name: str, version: str) -> dict[int, str]:
    """key -> text of the live points in the folded log."""
    table = shoal.fold(name, version)
    return dict(zip(table["id"].to_pylist(), table["text"].to_pylist(), strict=True))


def comparable_fold(shoal: Shoal, name: str, version: str, up_to: int | None = None) -> pa.Table:
    """The folded state without the seq offsets (compaction renumbers them within its segments), by key."""
    table = shoal.fold(name, version, up_to)
    table = table.drop_columns([c for c in ("__seq_offset",) if c in table.column_names])
    return table.sort_by("__key")


def assert_log_intact(shoal: Shoal, name: str, version: str) -> dict[str, Any]:
    """Segments tile 1..head; every segment row's file exists and matches its checksum; its entries lie in
    its seq range, strictly increasing, as many as the row says. Returns a few totals."""
    record = shoal.get_data_source(name, version)
    segments = shoal.log_segments(name, version)
    expected_first = 1
    last_seen = 0
    entries = 0
    for seg in segments:
        assert seg.first_seq == expected_first, f"gap or overlap before {seg.path}"
        expected_first = seg.last_seq + 1
        assert shoal.storage.exists(seg.path), f"catalog row points at a missing file: {seg.path}"
        table = decode_segment(shoal.storage.read(seg.path), seg.checksum, seg.path)
        seqs = table["__seq_offset"].to_numpy() + seg.first_seq
        assert table.num_rows == seg.upsert_count + seg.tombstone_count
        if len(seqs):
            assert seqs[0] > last_seen and seqs[-1] <= seg.last_seq and seqs[0] >= seg.first_seq
            assert np.all(np.diff(seqs) > 0)
            last_seen = int(seqs[-1])
        entries += table.num_rows
    assert expected_first - 1 == record.head_seq
    return {"segments": len(segments), "entries": entries, "head": record.head_seq,
            "bytes": sum(s.bytes for s in segments)}
