"""An HNSW build long enough to signal or kill its worker in the middle of it, and how far it got."""

from __future__ import annotations

import uuid

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from shoal import DataSourceSpec, Shoal
from shoal.catalog.models import IndexShard
from shoal.log.records import IndexSpec


def queue_a_long_build(shoal: Shoal, *, prefix: str, dim: int, points: int, seed: int = 7) -> tuple[str, int]:
    """An HNSW index over `points` random points of `dim` dimensions, its build queued (the upload's trigger):
    its name and the log head."""
    tag = uuid.uuid4().hex[:8]
    spec = DataSourceSpec(f"{prefix}-{tag}", "1", dim, {"id": "int64"}, ["id"])
    shoal.create_data_source(spec)
    index = f"{prefix}-{tag}-ix"
    shoal.create_index(IndexSpec(index, "1", spec.name, "1", algorithm="hnsw", metric="euclidean"))
    vectors = np.random.default_rng(seed).standard_normal((points, dim)).astype(np.float32)
    head = shoal.producer(spec.name, "1").upload_columns(vectors, {"id": np.arange(points)}).seq
    return index, head


def built(shoal: Shoal, index: str) -> int:
    """The lowest built watermark among the index's shards."""
    return min(s.built_watermark for s in shoal.index_status(index, "1"))


def building(shoal: Shoal, index: str) -> bool:
    """Whether a worker holds a live build lease on a shard of the index: its task runs (a task only received
    waits in the worker's prefetch, and a warm shutdown hands it back rather than running it)."""
    shards = [s.id for s in shoal.get_index(index, "1").shards]
    with Session(shoal.engine) as s:
        return bool(s.scalar(select(func.count()).select_from(IndexShard).where(
            IndexShard.id.in_(shards), IndexShard.lease_owner.is_not(None),
            IndexShard.lease_expires_at > func.clock_timestamp())))
