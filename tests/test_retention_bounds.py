"""Bounds of the log's upkeep meeting its readers:

- a `retention_days` integer past the float range (the dataset API takes any non-negative integer) is a retention
  longer than the calendar: it keeps every point, and never stops the retention sweep of the other sources (every
  tenant's);
- a tag (or as_of) on an index made after a compaction, with a shard not built yet, reads the log from seq 0 up to
  a seq at or past the compaction's bound: it answers exactly, while a read that needs compacted entries refuses.
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import use_settings_env, wait_for

from shoal import DataPoint, DataSourceSpec, Shoal, Tombstone
from shoal.config.settings import Settings
from shoal.engines.metrics import Metric, exact_top_k
from shoal.errors import NotFoundError
from shoal.index.builder import ShardBuilder
from shoal.log import retention
from shoal.log.records import IndexSpec
from shoal.workers.base import ShoalTask

DIM = 2


def _spec(name: str, retention_days: object) -> DataSourceSpec:
    return DataSourceSpec(name, "1", DIM, {"id": "int64"}, ["id"], custom_metadata={"retention_days": retention_days})


def _ids(shoal: Shoal, name: str) -> list[int]:
    return sorted(shoal.fold(name, "1")["id"].to_pylist())


# -- retention_days past the float range ------------------------------------------------------------------


@pytest.fixture
def worker_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Settings], None]]:
    """Give this process a worker's environment for `settings`, so beat's task functions run here directly."""

    def use(settings: Settings) -> None:
        use_settings_env(monkeypatch, settings)
        ShoalTask.reset_context()

    yield use
    ShoalTask.reset_context()


def test_a_retention_past_the_float_range_keeps_its_points_and_never_stops_the_sweep(
    make_shoal: Callable[..., Shoal], worker_env: Callable[[Settings], None], redis_url: str,
) -> None:
    """One source with retention_days 10**400 (float() overflows on it) made every run of the beat sweep fail
    with OverflowError before any source was looked at: no tenant expired anything."""
    from shoal.workers import tasks

    shoal = make_shoal(redis_url=redis_url)
    other = make_shoal(redis_url=redis_url)  # another tenant holding the huge value
    shoal.create_data_source(_spec("Forever", 10**400))
    shoal.create_data_source(_spec("Never", -(10**400)))  # a negative retention is none, as -5 is
    other.create_data_source(_spec("Forever", 10**400))
    # ~9 ms: old enough to expire once the clock moved past it, with no simulated `now` (beat's task takes none).
    short = 1e-7
    shoal.create_data_source(_spec("Short", short))
    for client, name in ((shoal, "Forever"), (shoal, "Never"), (other, "Forever"), (shoal, "Short")):
        client.producer(name, "1").upload([DataPoint({"id": i}, [float(i), 0.0]) for i in range(3)])
    ingested = max(shoal.fold("Short", "1")["__ingested_at"].to_pylist())
    wait_for(lambda: dt.datetime.now(dt.UTC) - dt.timedelta(days=short) > ingested, 10, "the short retention to end")

    mine = [(r.tenant, r.spec.name) for r in retention.sources_with_retention(shoal.engine)
            if r.tenant in (shoal.tenant, other.tenant)]
    assert sorted(mine) == sorted([(shoal.tenant, "Forever"), (shoal.tenant, "Short"), (other.tenant, "Forever")])

    worker_env(shoal.settings)
    done = tasks.apply_retention()  # beat's sweep, every tenant (other tests' sources too)
    assert done["expired"] >= 3
    assert _ids(shoal, "Short") == []
    assert _ids(shoal, "Forever") == [0, 1, 2] and _ids(other, "Forever") == [0, 1, 2]
    assert _ids(shoal, "Never") == [0, 1, 2]

    # By hand it answers as a retention of 1e300 days does: nothing older than a cutoff before year 1.
    for client in (shoal, other):
        result = client.apply_retention("Forever", "1", now=dt.datetime.now(dt.UTC) + dt.timedelta(days=10**6))
        assert result.expired == 0 and result.token is None and result.cutoff is None
        assert result.retention_days == sys.float_info.max
    assert shoal.apply_retention("Never", "1").retention_days is None
    assert _ids(shoal, "Forever") == [0, 1, 2]


# -- a tag or as_of on an index made after a compaction --------------------------------------------------


def _brute_force(shoal: Shoal, name: str, seq: int, query: np.ndarray, k: int) -> list[tuple[int, float]]:
    state = shoal.fold(name, "1", seq)
    vectors = np.asarray(state["__vector"].to_pylist(), dtype=np.float32).reshape(-1, DIM)
    ids = state["id"].to_pylist()
    dist, labels = exact_top_k(Metric("euclidean"), query, vectors, k)
    return sorted(((ids[j], round(float(d), 5)) for d, j in zip(dist[0], labels[0], strict=True) if j >= 0),
                  key=lambda hit: (hit[1], hit[0]))


def _hits(rows: list[Any]) -> list[tuple[int, float]]:
    """(id, distance) of the first query's hits, ties in id order (an engine may order ties either way)."""
    hits = ((h.attributes["id"], round(float(h.distance), 5)) for h in rows[0])
    return sorted(hits, key=lambda hit: (hit[1], hit[0]))


def test_a_tag_on_an_index_made_after_a_compaction_answers_before_every_shard_is_built(
    make_shoal: Callable[..., Shoal],
) -> None:
    """A 2-shard index made after a compaction reaching seq 13, shard 0 built and shard 1 not: a tag then pins
    shard 1 with no version (it reads the log from seq 0 up to the tag's seq 13, which is exact, as `fold` at 13
    is). It was refused for good ("take the tag again"); it answers as brute force over the log at seq 13, and so
    does as_of 13. As_of 12, below the compaction's bound, is refused as `fold` at 12 is."""
    shoal = make_shoal(tombstone_retention_s=0)
    shoal.create_data_source(DataSourceSpec("Src", "1", DIM, {"id": "int64"}, ["id"]))
    producer = shoal.producer("Src", "1")
    producer.upload([DataPoint({"id": i}, [float(i), 0.0]) for i in range(8)])  # seqs 1-8
    producer.upload([DataPoint({"id": i}, [float(i), 1.0]) for i in range(4)])  # seqs 9-12 supersede 0..3
    head = producer.upload([Tombstone({"id": 7})]).seq  # seq 13
    compaction = shoal.compact("Src", "1")
    assert compaction.entries_dropped > 0
    shoal.create_index(IndexSpec("New", "1", "Src", "1", algorithm="flat", metric="euclidean", id_attributes=["id"],
                                 shard_attributes=["id"], shard_count=2))
    shards = shoal.get_index("New", "1").shards
    ShardBuilder(shoal.engine, shoal.storage).materialize(shards[0].id)  # shard 1 not built yet
    pinned = shoal.tag_index("New", "1", "t")
    assert pinned[shards[1].id] is None and pinned[shards[0].id] is not None

    query = np.array([[2.5, 0.5]], dtype=np.float32)
    expected = _brute_force(shoal, "Src", head, query, 20)
    assert sorted(i for i, _ in expected) == [0, 1, 2, 3, 4, 5, 6]
    searcher = shoal.searcher(follow=False)
    try:
        assert _hits(searcher.search("New", "1", query, 20, tag="t")) == expected
        assert _hits(searcher.search("New", "1", query, 20, as_of=head)) == expected
        with pytest.raises(NotFoundError, match=f"the log below seq {head} was compacted"):
            shoal.fold("Src", "1", head - 1)
        with pytest.raises(NotFoundError, match=f"the log below seq {head} was compacted"):
            searcher.search("New", "1", query, 20, as_of=head - 1)
    finally:
        searcher.close()


def test_as_of_from_a_version_inside_the_compacted_range_is_still_refused(make_shoal: Callable[..., Shoal]) -> None:
    """A read from seq 0 past the bound is exact, but not one from a version inside the compacted range: as of
    seq 17, shard 0 answers from its version at seq 8 plus the log above it, whose tombstones (seqs 9-16, of every
    key that version holds) compaction dropped, while shard 1 (first built at 20) reads from 0. Refused, not
    answered with the deleted keys back."""
    shoal = make_shoal(tombstone_retention_s=0)
    shoal.create_data_source(DataSourceSpec("Src", "1", DIM, {"id": "int64"}, ["id"]))
    for name, shard_count in (("X", 2), ("Y", 1)):
        shoal.create_index(IndexSpec(name, "1", "Src", "1", algorithm="flat", metric="euclidean",
                                     id_attributes=["id"], shard_attributes=["id"], shard_count=shard_count))
    x0, x1 = (s.id for s in shoal.get_index("X", "1").shards)
    y = shoal.get_index("Y", "1").shards[0].id
    builder = ShardBuilder(shoal.engine, shoal.storage)
    producer = shoal.producer("Src", "1")
    producer.upload([DataPoint({"id": i}, [float(i), 0.0]) for i in range(8)])  # seqs 1-8
    builder.materialize(x0)  # X shard 0 at seq 8
    producer.delete({"id": list(range(8))})  # seqs 9-16
    builder.materialize(y)  # Y at seq 16: compaction stops there
    head = producer.upload([DataPoint({"id": i}, [float(i), 5.0]) for i in range(10, 14)]).seq  # seqs 17-20
    builder.materialize(x0)
    builder.materialize(x1)  # X shard 1's first version, at seq 20
    assert shoal.compact("Src", "1").entries_dropped == 16  # the tombstones of 9-16 and the points they deleted
    searcher = shoal.searcher(follow=False)
    try:
        with pytest.raises(NotFoundError, match="the log below seq 16 was compacted"):
            searcher.search("X", "1", np.zeros((1, DIM), np.float32), 20, as_of=17)
        assert head == 20  # from versions at or past the bound it answers
        assert [i for i, _ in _hits(searcher.search("X", "1", np.zeros((1, DIM), np.float32), 20, as_of=20))] == [
            10, 11, 12, 13]
    finally:
        searcher.close()
