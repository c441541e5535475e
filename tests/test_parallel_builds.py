"""Shards of one index build in parallel on several workers (issue 14): a 4-shard HNSW index and 2 real
worker processes; both build shards, at the same time, and every shard reaches the head."""

from __future__ import annotations

import datetime as dt
import re
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import start_worker, stop_process, wait_for

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.log.records import IndexSpec

pytestmark = pytest.mark.slow  # real Celery worker processes

DIM = 64
# "[2026-11-25 14:40:01,123: INFO/MainProcess] Task shoal.workers.tasks.materialize_shard[...] succeeded in
# 3.2s: {'shard': 7, 'version': 12, 'watermark': 40000, 'changed': True}"
BUILT = re.compile(
    r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): \w+/[\w-]+\] Task shoal\.workers\.tasks\.materialize_shard\[[^\]]+\] "
    r"succeeded in ([\d.]+)s: \{'shard': (\d+), 'version': \d+, 'watermark': \d+, 'changed': True\}"
)


def _builds(log: Path) -> list[tuple[float, float, int]]:
    """(start, end, shard) of each materialization that published, from a worker's log."""
    out = []
    for stamp, took, shard in BUILT.findall(log.read_text(errors="replace")):
        end = dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        out.append((end - float(took), end, int(shard)))
    return out


def test_two_workers_build_the_shards_of_one_index_in_parallel(
    make_settings: Callable[..., Settings], redis_url: str, worker_catalog: str
) -> None:
    settings = make_settings("local", database_url=worker_catalog, redis_url=redis_url, sweep_interval_s=1.0,
                             pending_ttl_s=2.0, merge_interval_s=0)
    with Shoal(settings) as shoal:
        tag = uuid.uuid4().hex[:8]
        source = DataSourceSpec(f"par-{tag}", "1", DIM, {"id": "int64"}, ["id"])
        shoal.create_data_source(source)
        index = f"par-{tag}-idx"
        shoal.create_index(IndexSpec(index, "1", source.name, "1", algorithm="hnsw", metric="euclidean",
                                     shard_count=4, params={"M": 16, "ef_construction": 200, "ef_search": 64}))
        workers = [start_worker(settings), start_worker(settings, beat=True)]
        try:
            # Both ready before the first upload: a worker that started late would find every shard built.
            for w in workers:
                wait_for(lambda w=w: " ready." in w.log_path.read_text() or w.poll() is not None,  # type: ignore[attr-defined,misc]
                         120, "the worker to start")
                assert w.poll() is None, w.log_path.read_text()  # type: ignore[attr-defined]
            ids = np.arange(60_000)
            vectors = np.random.default_rng(3).standard_normal((len(ids), DIM)).astype(np.float32)
            head = 0
            for part in np.array_split(ids, 6):
                head = shoal.producer(source.name, "1").upload_columns(vectors[part], {"id": part}).seq
            wait_for(lambda: all(s.built_watermark == head for s in shoal.index_status(index, "1")), 300,
                     "the 4 shards to be built up to the head")
        finally:
            for w in workers:
                stop_process(w)  # type: ignore[arg-type]
        shards = {s.id for s in shoal.get_index(index, "1").shards}
        builds = [_builds(w.log_path) for w in workers]  # type: ignore[attr-defined]
        print("builds per worker (start, end, shard):", builds)
        assert all(builds), "each worker built some shard"
        assert {b[2] for per in builds for b in per} <= shards
        overlap = max(
            min(a_end, b_end) - max(a_start, b_start)
            for a_start, a_end, _ in builds[0] for b_start, b_end, _ in builds[1]
        )
        assert overlap > 0, "the two workers never built at the same time"
        print(f"the workers built at the same time for up to {overlap:.1f} s")
