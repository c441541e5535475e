"""Per-process state stays bounded however many data sources and segments a deployment makes: a builder's key
cache charges each entry what it really costs, so its byte budget bounds the entries it keeps; a following
searcher keeps heads only of the data sources its served indexes use, and forgets them when the index goes."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs
import pytest
from conftest import wait_for

import shoal.runtime as runtime_module
from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.errors import ConfigurationError
from shoal.index.builder import ShardBuilder
from shoal.index.manifest import SegmentEntry
from shoal.index.segment import build_segment
from shoal.index.segment_cache import KeyCache
from shoal.intake.consumer import IntakeConsumer
from shoal.intake.producer import Producer as LogProducer
from shoal.intake.topology import Target
from shoal.log.records import IndexSpec
from shoal.log.validation import KEY, SEQ, VECTOR
from shoal.searcher.consistency import Consistency
from shoal.storage import Storage

DIM = 4
# What a cached key list of a tiny segment really takes, at least (RSS per KeyCache entry of 1 to 10 keys, measured
# at 860 to 870 bytes past its Arrow buffers): a budget of B bytes must not keep more than B / this entries.
REAL_ENTRY_BYTES = 850


def _tiny_segments(storage: Storage, count: int, start: int, rows: int = 8) -> list[SegmentEntry]:
    """`count` real segments of `rows` points each (ids from `start`), written as a build writes them (keys file
    included)."""
    spec = IndexSpec("tiny", "1", "src", "1", algorithm="flat", metric="cosine", id_attributes=["id"])
    entries = []
    for n in range(count):
        ids = np.arange(start + n * rows, start + (n + 1) * rows)
        vectors = np.random.default_rng(n).standard_normal((rows, DIM)).astype(np.float32)
        table = pa.table({
            KEY: pa.array([f"k{i}".encode() for i in ids], pa.binary()),
            SEQ: pa.array(ids + 1, pa.int64()),
            "id": pa.array(ids, pa.int64()),
            VECTOR: pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), DIM),
        })
        entries.append(build_segment(storage, f"shard-{n % 4}", spec, False, DIM, table))
    return entries


def test_key_cache_budget_bounds_the_entries_of_tiny_segments(tmp_path: Path) -> None:
    storage = Storage(pa.fs.LocalFileSystem(), str(tmp_path), local=True)
    entries = _tiny_segments(storage, 300, 100_000)  # keys of one length: entries of one size
    budget = 64 << 10
    cache = KeyCache(budget)
    for entry in entries:
        keys = cache.get(storage, entry)
        assert len(keys) == entry.rows
    kept = list(cache._items)
    # Counting Arrow bytes alone (about 100 an entry), all 300 fitted 64 KiB: 300 KB of real memory.
    assert 1 <= len(kept) <= budget // REAL_ENTRY_BYTES, (len(kept), cache.bytes)
    assert cache.bytes <= budget
    # Least recently used go first: what is kept is the newest read.
    assert kept == [e.id for e in entries[-len(kept):]]

    # A hit makes an entry the most recent: it outlives entries read before it once new ones come in.
    oldest = entries[-len(kept)]
    cache.get(storage, oldest)
    more = _tiny_segments(storage, len(kept) - 1, 200_000)
    for entry in more:
        cache.get(storage, entry)
    assert oldest.id in cache._items
    assert not any(e.id in cache._items for e in entries[-len(kept) + 1:])

    # Entries a merge replaced are forgotten (the builder discards them after publishing).
    before = cache.bytes
    cache.discard([oldest.id, "no-such-segment"])
    assert oldest.id not in cache._items and cache.bytes < before


def _announce_many(shoal: Shoal, first: int, count: int) -> None:
    """Announce a head for `count` data source ids no index uses, as every commit does (runtime.heads)."""
    for source_id in range(first, first + count):
        shoal.runtime.heads.announce(source_id, 7)


def test_following_searcher_keeps_heads_of_served_sources_only(
    make_settings: Callable[..., Settings], redis_url: str,
) -> None:
    settings = make_settings("local", redis_url=redis_url)
    shoal = Shoal(settings, notify=False)
    other = Shoal(settings, notify=False)  # another instance (runtime, searcher) on the same tenant
    try:
        tag = f"{time.monotonic_ns() % 10**9}"
        source = DataSourceSpec(f"bounds-{tag}", "1", DIM, {"id": "int64"}, ["id"])
        shoal.create_data_source(source)
        index = f"bounds-{tag}-idx"
        shoal.create_index(IndexSpec(index, "1", source.name, "1", algorithm="flat", metric="cosine"))
        ids = np.arange(20)
        vectors = np.random.default_rng(1).standard_normal((20, DIM)).astype(np.float32)
        shoal.producer(source.name, "1").upload_columns(vectors, {"id": ids.astype(np.int64)})
        ShardBuilder(shoal.engine, shoal.storage).materialize(shoal.get_index(index, "1").shards[0].id)
        searcher = shoal.searcher(follow=True, poll_interval=30.0)
        service = searcher.service
        wait_for(lambda: service.heads_followed, 15, "the searcher to follow announced heads")
        searcher.search(index, "1", vectors[:1], 1, consistency=Consistency.strong())
        source_id = shoal.get_index(index, "1").source_id
        assert source_id in service._heads and source_id in service._floors

        _announce_many(shoal, 10_000_000 + int(tag), 2000)
        shoal.runtime.heads.announce(source_id, 10**9)  # after the others on the channel: seen last
        wait_for(lambda: service._heads.get(source_id) == 10**9, 30, "the searcher to see the announcements")
        assert set(service._heads) == {source_id}, len(service._heads)

        other.drop_index(index, "1")  # another instance drops it: this searcher learns it at its poll
        service.refresh()
        assert not service._views
        assert source_id not in service._heads and source_id not in service._floors
        searcher.close()
    finally:
        other.close()
        shoal.close()


def _upload(producer: LogProducer, first: int) -> int:
    ids = np.arange(first, first + 3)
    vectors = np.random.default_rng(first).standard_normal((3, DIM)).astype(np.float32)
    return producer.upload_columns(vectors, {"id": ids.astype(np.int64)}).seq


def test_runtime_and_consumer_forget_sources_idle_or_dropped_elsewhere(
    make_settings: Callable[..., Settings], redis_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = make_settings("local", redis_url=redis_url)
    shoal = Shoal(settings, notify=False)
    dropper = Shoal(settings, notify=False)  # another instance: the writing runtime's forget_source never runs
    consumer = IntakeConsumer(settings)
    consumer.recent_writes_s = 0.5  # what backpressure counts as recent: kept that long past the idle TTL
    try:
        tag = f"{time.monotonic_ns() % 10**9}"
        names = [f"idle-{tag}-{n}" for n in range(12)]
        for name in names:
            shoal.create_data_source(DataSourceSpec(name, "1", DIM, {"id": "int64"}, ["id"]))
            _upload(shoal.producer(name, "1"), 0)
            consumer._producer(Target(settings.tenant, name, "1"))
        live, dropped = names[0], names[1:]
        live_id = shoal.get_data_source(live, "1").id
        held = shoal.producer(live, "1")  # a producer kept across the idle time, as an application keeps one
        consumer._written_sources.update({(settings.tenant, shoal.get_data_source(n, "1").id): time.monotonic()
                                          for n in names})  # as `_commit` records each write
        runtime = shoal.runtime
        assert len(runtime._writers) == len(consumer._producers) == len(names)
        for name in dropped:
            dropper.drop_data_source(name, "1")

        monkeypatch.setattr(runtime_module, "IDLE_FORGET_S", 0.5, raising=False)
        time.sleep(2.1)  # past the TTL, and past SOURCE_TTL_S: the consumer reads the live definition again
        assert _upload(held, 10) > 0  # a write to the live source: the others are forgotten on its path
        assert set(runtime._writers) == {live_id}, len(runtime._writers)
        assert set(runtime._written) == {live_id}
        assert {r.id for _, r in runtime._sources.values()} <= {live_id}
        assert set(runtime._shards_of) <= {live_id}
        consumer._producer(Target(settings.tenant, live, "1"))
        assert set(consumer._producers) == {Target(settings.tenant, live, "1")}
        assert not consumer._written_sources

        time.sleep(0.6)
        runtime.forget_idle()  # the live source idle past the TTL: forgotten too
        assert not runtime._writers
        assert _upload(held, 20) > 0  # its producer still writes through the writer it holds
        assert _upload(shoal.producer(live, "1"), 30) > 0  # and a new one through a new writer
        assert len(runtime._writers) == 1
    finally:
        consumer.close()
        dropper.close()
        shoal.close()
    with pytest.raises(ConfigurationError):  # a writer forgotten while idle is refused after the close too
        _upload(held, 40)
