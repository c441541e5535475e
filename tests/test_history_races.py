"""Races of a searcher's loads and time travel against other processes' work, made to happen in a set order
(events hold one step where the race would interleave; no sleeps):

- a searcher loading an index (its first search, a rollback) serves the view only together with its young tier,
  so a search that finds the index loaded shows every write acknowledged before the load;
- an as_of search racing a compaction refuses instead of answering from the thinned log;
- a tag on a sharded index whose shards were built to different seqs answers one state the log had.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder
from shoal.log.compaction_swap import lowest_watermark
from shoal.log.records import IndexSpec
from shoal.searcher.consistency import Consistency

DIM = 8


def _vectors(ids: np.ndarray) -> np.ndarray:
    """A distinct unit vector per id (its own nearest neighbour by far)."""
    v = np.stack([np.random.default_rng(int(n)).standard_normal(DIM) for n in ids]).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _ids(hits: Any) -> list[int]:
    return [h.attributes["id"] for h in hits]


@pytest.fixture
def shoal(make_settings: Callable[..., Settings], redis_url: str) -> Iterator[Shoal]:
    sh = Shoal(make_settings("local", redis_url=redis_url), notify=False)  # no worker: the test builds
    try:
        yield sh
    finally:
        sh.close()


def _flat_index(sh: Shoal, **index_options: Any) -> tuple[str, str]:
    """A data source and a flat index over it, named uniquely; returns (source name, index name)."""
    tag = f"{time.monotonic_ns() % 10**9}"
    source = DataSourceSpec(f"races-{tag}", "1", DIM, {"id": "int64"}, ["id"])
    sh.create_data_source(source)
    index = f"races-{tag}-idx"
    sh.create_index(IndexSpec(index, "1", source.name, "1", algorithm="flat", metric="euclidean",
                              id_attributes=["id"], **index_options))
    return source.name, index


class _HeldRead:
    """Holds every young tier read of a view of the index `index_id` made outside the test's main thread (the
    loader's, the follower's) until `go` is set, after telling `held`; the main thread's searches pass."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, index_id: int) -> None:
        import shoal.searcher.searcher as searcher_module

        self.held = threading.Event()
        self.go = threading.Event()
        real = searcher_module.extend

        def held_extend(cache: Any, view: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not threading.main_thread() and view.index.id == index_id:
                self.held.set()
                assert self.go.wait(30), "the test never let the load go on"
            return real(cache, view, *args, **kwargs)

        monkeypatch.setattr(searcher_module, "extend", held_extend)


def test_a_search_racing_the_first_load_of_an_index_shows_every_acknowledged_write(
    shoal: Shoal, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two first searches of an index at once in a following searcher, nothing built: the loader's young tier
    read is held; a search that finds the index loaded meanwhile answers with the acknowledged writes (it used
    to answer with none: the view was served before its young tier was read), and one that does not waits for
    the loader."""
    source, index = _flat_index(shoal)
    shoal.producer(source, "1").upload_columns(_vectors(np.arange(50)), {"id": np.arange(50, dtype=np.int64)})
    searcher = shoal.searcher(follow=True, poll_interval=30.0)
    hold = _HeldRead(monkeypatch, shoal.get_index(index, "1").id)
    answers: dict[str, list[int]] = {}

    def first(name: str) -> None:
        answers[name] = _ids(searcher.search(index, "1", _vectors(np.array([7])), 3)[0])

    loader = threading.Thread(target=first, args=("loader",), name="first-search")
    other = threading.Thread(target=first, args=("other",), name="second-search")
    try:
        loader.start()
        assert hold.held.wait(30), "the first search never read the young tier"
        other.start()
        if searcher.loaded(index, "1"):  # an eventual search of a loaded index neither waits nor reads anything
            assert _ids(searcher.search(index, "1", _vectors(np.array([7])), 3)[0])[:1] == [7], (
                "a search of the index being loaded answered without the writes acknowledged before it")
    finally:
        hold.go.set()
        loader.join(30)
        other.join(30)
        searcher.close()
    assert answers["loader"][:1] == [7] and len(answers["loader"]) == 3
    assert answers["other"][:1] == [7] and len(answers["other"]) == 3


def test_searches_racing_the_reload_of_a_rolled_back_generation_show_no_point_deleted_before(
    shoal: Shoal, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rollback serves generation 1 again, whose built version still holds a point deleted (while generation 2
    served) after it was built. While the searcher reloads it, the young tier read is held: searches meanwhile
    answer from what was served before, never from generation 1 without its young tier (the deleted point
    back)."""
    source, index = _flat_index(shoal)
    producer = shoal.producer(source, "1")
    producer.upload_columns(_vectors(np.arange(50)), {"id": np.arange(50, dtype=np.int64)})
    ShardBuilder(shoal.engine, shoal.storage).materialize(shoal.get_index(index, "1").shards[0].id)
    first = shoal.get_index(index, "1").id
    searcher = shoal.searcher(follow=True, poll_interval=30.0)
    try:
        assert _ids(searcher.search(index, "1", _vectors(np.array([7])), 1)[0]) == [7]
        shoal.reindex(index, "1", metric="cosine", wait=True)
        searcher.refresh()
        assert shoal.get_index(index, "1").id != first
        producer.delete({"id": np.array([7], dtype=np.int64)})
        strong = Consistency.strong()
        assert 7 not in _ids(searcher.search(index, "1", _vectors(np.array([7])), 3, consistency=strong)[0])
        assert 7 not in _ids(searcher.search(index, "1", _vectors(np.array([7])), 3)[0])
        hold = _HeldRead(monkeypatch, first)  # before the rollback: its announcement may wake the poller
        shoal.rollback(index, "1")
        assert shoal.get_index(index, "1").id == first
        loader = threading.Thread(target=searcher.refresh, name="rollback-load")
        loader.start()
        try:
            assert hold.held.wait(30), "the reload never read the young tier"
            during = _ids(searcher.search(index, "1", _vectors(np.array([7])), 3)[0])
        finally:
            hold.go.set()
            loader.join(30)
        assert 7 not in during, "a search during the rollback's reload showed a point deleted before it"
        assert searcher.view(index, "1").index.id == first
        after = _ids(searcher.search(index, "1", _vectors(np.array([7])), 3)[0])
        assert 7 not in after and len(after) == 3
    finally:
        searcher.close()


def test_an_as_of_search_racing_a_compaction_refuses_rather_than_answer_from_the_thinned_log(
    shoal: Shoal, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An as_of search picks its versions (the log above them not compacted yet), then reads the log: a compaction
    committing in between (run here right before the read) dropped an entry the answer needs. The search refuses
    as one made after the compaction does, instead of answering a state the log never had."""
    import shoal.searcher.searcher as searcher_module
    from shoal.errors import NotFoundError

    source, index = _flat_index(shoal)
    shard = shoal.get_index(index, "1").shards[0].id
    builder = ShardBuilder(shoal.engine, shoal.storage)
    producer = shoal.producer(source, "1")
    producer.upload_columns(_vectors(np.array([1])), {"id": np.array([1], dtype=np.int64)})  # seq 1
    builder.materialize(shard)  # a version at watermark 1
    appeared = producer.upload_columns(_vectors(np.array([2])), {"id": np.array([2], dtype=np.int64)}).seq
    producer.upload_columns(_vectors(np.array([1_002])), {"id": np.array([2], dtype=np.int64)})  # 2 moves
    builder.materialize(shard)  # a version at watermark 3: compaction may drop seq 2 (superseded)
    searcher = shoal.searcher(follow=False)
    query = _vectors(np.array([2]))
    try:
        assert _ids(searcher.search(index, "1", query, 1, as_of=appeared)[0]) == [2]
        real = searcher_module.read_log
        dropped: list[int] = []

        def compaction_first(*args: Any, **kwargs: Any) -> Any:
            monkeypatch.setattr(searcher_module, "read_log", real)
            dropped.append(shoal.compact(source, "1").entries_dropped)
            return real(*args, **kwargs)

        monkeypatch.setattr(searcher_module, "read_log", compaction_first)
        with pytest.raises(NotFoundError, match=r"the log below seq \d+ was compacted"):
            searcher.search(index, "1", query, 1, as_of=appeared)
        assert dropped == [1]  # the race happened: the compaction dropped the entry the answer needed
        with pytest.raises(NotFoundError, match=r"the log below seq \d+ was compacted") as refused:
            searcher.search(index, "1", query, 1, as_of=appeared)  # as a search after the compaction
        # What would answer, said as it is: a version above the bound never answers a seq below it (the message
        # asked for "a version at or above" the bound).
        assert "or later, a seq a kept version was built to exactly, or a tag" in str(refused.value)
    finally:
        searcher.close()


def test_a_tag_on_shards_built_to_different_seqs_answers_one_state_the_log_had(shoal: Shoal) -> None:
    """Two shards, 8 points in one commit, both built; all 8 deleted in one commit and only shard 0 built: a tag
    taken then stands for the deletion's seq, so it answers no point (it answered shard 1's four, a state no
    seq of the log had), and writes after it do not show."""
    source, index = _flat_index(shoal, shard_attributes=["id"], shard_count=2)
    shards = [s.id for s in shoal.get_index(index, "1").shards]
    builder = ShardBuilder(shoal.engine, shoal.storage)
    producer = shoal.producer(source, "1")
    ids = np.arange(8, dtype=np.int64)
    producer.upload_columns(_vectors(ids), {"id": ids})
    for shard in shards:
        builder.materialize(shard)
    deleted = producer.delete({"id": ids}).seq
    builder.materialize(shards[0])  # shard 1 stays at the upload's seq
    pinned = shoal.tag_index(index, "1", "snap")
    assert len({v for v in pinned.values()}) == 2
    later = np.array([100, 101], dtype=np.int64)
    producer.upload_columns(_vectors(later), {"id": later})
    for shard in shards:
        builder.materialize(shard)
    searcher = shoal.searcher(follow=False)
    try:
        query = _vectors(np.array([3]))
        assert shoal.fold(source, "1", deleted).num_rows == 0  # the state at the tag's seq: no point
        assert _ids(searcher.search(index, "1", query, 10, tag="snap")[0]) == []
        assert sorted(_ids(searcher.search(index, "1", query, 10)[0])) == [100, 101]
    finally:
        searcher.close()


def test_compaction_keeps_the_log_a_tag_reads(shoal: Shoal) -> None:
    """A tag pinning shard 1 below the seq it stands for reads the log between them (three commits below). A
    compaction that dropped entries there (the tombstones of the second, superseded by the points written again by
    the third) would make that read show shard 1's points the tag's state had deleted, and the search refuse:
    compaction holds back for the tag, which answers its state; once the tag is gone it reaches past."""
    source, index = _flat_index(shoal, shard_attributes=["id"], shard_count=2)
    shards = [s.id for s in shoal.get_index(index, "1").shards]
    builder = ShardBuilder(shoal.engine, shoal.storage)
    producer = shoal.producer(source, "1")
    ids = np.arange(8, dtype=np.int64)
    first = producer.upload_columns(_vectors(ids), {"id": ids}).seq  # seqs 1-8
    for shard in shards:
        builder.materialize(shard)
    producer.delete({"id": ids})  # seqs 9-16
    builder.materialize(shards[0])
    shoal.tag_index(index, "1", "snap")  # stands for seq 16; shard 1 pinned at seq 8
    head = producer.upload_columns(_vectors(ids), {"id": ids}).seq  # seqs 17-24: the tombstones superseded
    for shard in shards:
        builder.materialize(shard)
    assert lowest_watermark(shoal.engine, shoal.get_data_source(source, "1").id) == first  # shard 1's pin
    shoal.compact(source, "1")
    searcher = shoal.searcher(follow=False)
    try:
        assert _ids(searcher.search(index, "1", _vectors(np.array([3])), 10, tag="snap")[0]) == []
        shoal.untag_index(index, "1", "snap")
        assert lowest_watermark(shoal.engine, shoal.get_data_source(source, "1").id) == head
    finally:
        searcher.close()
