"""The searcher's memory: loaded segments are accounted in bytes, released once no served version uses them,
and kept under SHOAL_SEARCHER_CACHE_BYTES by unloading the least recently searched indexes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.errors import CapacityError
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec

DIM = 16


def _index(shoal: Shoal, name: str, n: int, seed: int) -> np.ndarray:
    """A data source and flat index `name` with n random points, materialized; returns the vectors."""
    shoal.create_data_source(DataSourceSpec(name, "1", DIM, {"id": "int64"}, ["id"]))
    index = shoal.create_index(IndexSpec(f"{name}.Index", "1", name, "1", algorithm="FaissIndex.L2"))
    vectors = np.random.default_rng(seed).normal(size=(n, DIM)).astype(np.float32)
    shoal.producer(name, "1").upload_columns(vectors, {"id": np.arange(n)})
    for shard in index.shards:
        ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
    return vectors


def _nearest(shoal_searcher: object, name: str, query: np.ndarray) -> int:
    hits = shoal_searcher.search(f"{name}.Index", "1", query[None], 1)  # type: ignore[attr-defined]
    return int(hits[0].column("id")[0])


def test_superseded_segments_are_released(make_settings: Callable[..., Settings]) -> None:
    with Shoal(make_settings("local"), notify=False) as shoal:
        vectors = _index(shoal, "Mem", 500, 1)
        searcher = shoal.searcher(follow=False)
        cache = shoal.runtime.segment_cache
        try:
            assert _nearest(searcher, "Mem", vectors[7]) == 7
            first = cache.bytes
            assert first > vectors.nbytes and len(cache) == 1
            # Three more versions, then a merge into one segment: what the searcher held before is superseded.
            producer = shoal.producer("Mem", "1")
            shard_id = shoal.get_index("Mem.Index", "1").shards[0].id
            builder = ShardBuilder(shoal.engine, shoal.storage)
            for i in range(3):
                producer.upload_columns(vectors[:100] + 10.0 * (i + 1), {"id": np.arange(100)})
                builder.materialize(shard_id)
                searcher.refresh()
                assert len(cache) == i + 2  # the new segment beside the old ones, which the version still uses
            builder.merge(shard_id, force=True)
            searcher.refresh()
            assert len(cache) == 1, "segments no served version uses must be released"
            assert cache.bytes < first + vectors.nbytes  # one merged segment of the same 500 rows, not four
            assert _nearest(searcher, "Mem", vectors[300]) == 300
        finally:
            searcher.close()
        assert len(cache) == 0 and cache.bytes == 0  # a closed searcher holds nothing


def test_budget_unloads_least_recently_searched(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings("local")
    with Shoal(settings, notify=False) as probe:
        a = _index(probe, "A", 2000, 2)
        b = _index(probe, "B", 2000, 3)
        searcher = probe.searcher(follow=False)
        _nearest(searcher, "A", a[0])
        one_index = probe.runtime.segment_cache.bytes
        searcher.close()
    # Room for one of the two indexes, not both.
    budget = int(one_index * 1.5)
    with Shoal(settings.model_copy(update={"searcher_cache_bytes": budget}), notify=False) as shoal:
        searcher = shoal.searcher(follow=False)
        cache = shoal.runtime.segment_cache
        try:
            assert _nearest(searcher, "A", a[5]) == 5
            assert searcher.loaded("A.Index", "1")
            assert _nearest(searcher, "B", b[6]) == 6
            assert searcher.loaded("B.Index", "1") and not searcher.loaded("A.Index", "1")
            assert cache.bytes <= budget
            assert _nearest(searcher, "A", a[9]) == 9  # loaded again on demand, B unloaded in turn
            assert not searcher.loaded("B.Index", "1") and cache.bytes <= budget
        finally:
            searcher.close()
    # An index that alone passes the budget is refused with an error naming the setting, not served over it.
    with Shoal(settings.model_copy(update={"searcher_cache_bytes": one_index // 2}), notify=False) as shoal:
        searcher = shoal.searcher(follow=False)
        try:
            with pytest.raises(CapacityError, match="SHOAL_SEARCHER_CACHE_BYTES"):
                searcher.search("A.Index", "1", a[:1], 1)
            assert shoal.runtime.segment_cache.bytes == 0
        finally:
            searcher.close()
