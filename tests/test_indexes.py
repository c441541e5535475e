"""Index definitions (Vektonn's rules), versions, merges, freshness and dropping, against a real catalog."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

import numpy as np
import pytest

from shoal import DataPoint, DataSourceSpec, Shoal, SparseVector, Tombstone
from shoal.errors import AlreadyExistsError, NotFoundError, ValidationError
from shoal.index.builder import MergePolicy, ShardBuilder
from shoal.index.manifest import DeletionEntry, SegmentEntry
from shoal.index.merge_policy import pick
from shoal.log.records import IndexSpec
from shoal.searcher.consistency import Consistency

SOURCE = DataSourceSpec(
    "Docs", "1", 2, {"id": "int64", "lang": "string", "payload": "string", "score": "float64"}, ["id", "lang"]
)
SPARSE = DataSourceSpec("Words", "1", 100, {"id": "int64"}, ["id"], vectors_are_sparse=True)


@pytest.fixture
def shoal(make_settings):  # type: ignore[no-untyped-def]
    client = Shoal(make_settings("local"), notify=False)  # these tests drive the builds themselves
    client.create_data_source(SOURCE)
    client.create_data_source(SPARSE)
    yield client
    client.close()


def spec(**kw: object) -> IndexSpec:
    base: dict[str, object] = {"name": "Docs.Index", "version": "1", "source_name": "Docs", "source_version": "1"}
    return IndexSpec(**(base | kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"id_attributes": ["payload"]}, "id attribute must be a permanent attribute of the source"),
        ({"split_attributes": ["score"]}, "split attribute must be a permanent attribute of the source"),
        ({"shard_attributes": ["payload"], "shard_count": 2}, "shard attribute must be a permanent attribute"),
        ({"id_attributes": ["lang"], "split_attributes": ["lang"]}, "id attributes minus split attributes"),
        ({"algorithm": "flat_sparse"}, "is for sparse vectors, but the source holds dense ones"),
        ({"algorithm": "hnsw", "params": {"M": 8}}, "all or none"),
        ({"algorithm": "hnsw", "metric": "manhattan"}, "does not support metric"),
        ({"algorithm": "ivf", "metric": "manhattan"}, "does not support metric"),
        ({"algorithm": "annoy"}, "unknown"),
        ({"metric": "hamming"}, "unknown metric"),
        ({"payload_attributes": ["nope"]}, "payload attribute is not an attribute of the source"),
        ({"shard_count": 0}, "shard count must be an integer in 1..1024"),
        ({"algorithm": "FaissIndex.L2", "params": {"M": "8"}}, "all or none"),
        ({"algorithm": "SparnnIndex.Cosine"}, "is for sparse vectors"),
    ],
)
def test_vektonn_rules_reject_bad_definitions(shoal: Shoal, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        shoal.create_index(spec(**kwargs))
    assert shoal.list_indexes() == []


def test_definitions_defaults_and_vektonn_names(shoal: Shoal) -> None:
    flat = shoal.create_index(spec(algorithm="FaissIndex.L2"))
    assert (flat.spec.algorithm, flat.spec.metric) == ("flat", "l2_squared")
    assert flat.spec.id_attributes == ("id", "lang")  # default: the permanent attributes minus splits
    assert flat.spec.payload_attributes == ("id", "lang", "payload", "score")
    hnsw = shoal.create_index(
        spec(name="Docs.Hnsw", algorithm="FaissIndex.IP", params={"M": "8", "EfConstruction": "64", "EfSearch": "32"},
             split_attributes=["lang"], id_attributes=["id"])
    )
    assert (hnsw.spec.algorithm, hnsw.spec.metric) == ("hnsw", "dot_product")
    assert hnsw.spec.params == {"M": 8, "ef_construction": 64, "ef_search": 32}
    sparse = shoal.create_index(
        IndexSpec("Words.Index", "1", "Words", "1", algorithm="SparnnIndex.Cosine")
    )
    assert (sparse.spec.algorithm, sparse.spec.metric) == ("flat_sparse", "cosine")
    # Several indexes may serve one data source.
    assert [i.spec.name for i in shoal.list_indexes()] == ["Docs.Hnsw", "Docs.Index", "Words.Index"]
    with pytest.raises(AlreadyExistsError):
        shoal.create_index(spec(algorithm="FaissIndex.L2"))
    assert shoal.create_index(spec(algorithm="FaissIndex.L2"), exist_ok=True).id == flat.id
    with pytest.raises(NotFoundError):
        shoal.create_index(IndexSpec("X", "1", "Missing", "1"))


def _materialize(shoal: Shoal, name: str, builder: ShardBuilder | None = None) -> None:
    builder = builder or ShardBuilder(shoal.engine, shoal.storage)
    for shard in shoal.get_index(name, "1").shards:
        builder.materialize(shard.id)


def test_quick_start_distances_and_tombstones(shoal: Shoal) -> None:
    shoal.create_index(spec(algorithm="FaissIndex.L2", id_attributes=["id"], split_attributes=["lang"]))
    producer = shoal.producer("Docs", "1")
    producer.upload([
        DataPoint({"id": 1, "lang": "en", "payload": "first", "score": 1.0}, [0.0, 1.0]),
        DataPoint({"id": 2, "lang": "en", "payload": "second", "score": 2.0}, [0.5, 0.0]),
        DataPoint({"id": 3, "lang": "de", "payload": "third", "score": 3.0}, [3.0, 3.0]),
    ])
    _materialize(shoal, "Docs.Index")
    searcher = shoal.searcher(follow=False)
    hits = searcher.search("Docs.Index", "1", [[0.0, 2.0]], 2)[0]
    assert [(h.attributes["payload"], h.distance) for h in hits] == [("first", 1.0), ("second", 4.25)]
    # A full split filter touches one split; a missing one searches them all.
    assert [h.attributes["id"] for h in searcher.search("Docs.Index", "1", [[0.0, 2.0]], 5,
                                                         split_filter={"lang": "de"})[0]] == [3]
    with pytest.raises(ValidationError, match="split filter key is not a split attribute"):
        searcher.search("Docs.Index", "1", [[0.0, 2.0]], 5, split_filter={"payload": "x"})
    with pytest.raises(ValidationError, match="wrong query dimension: expected 2, got 3"):
        searcher.search("Docs.Index", "1", [[0.0, 2.0, 1.0]], 5)
    with pytest.raises(ValidationError, match="k must be a positive integer"):
        searcher.search("Docs.Index", "1", [[0.0, 2.0]], 0)
    with pytest.raises(ValidationError, match="at least one query vector"):
        searcher.search("Docs.Index", "1", [], 2)

    token = producer.upload([Tombstone({"id": 1, "lang": "en"})])
    # Not materialized yet: eventual still serves the old version; at_least(token) and strong see the delete.
    assert searcher.search("Docs.Index", "1", [[0.0, 2.0]], 1)[0][0].attributes["id"] == 1
    for consistency in (Consistency.at_least(token), Consistency.strong()):
        hits = searcher.search("Docs.Index", "1", [[0.0, 2.0]], 2, consistency=consistency, retrieve_vectors=True)[0]
        assert [(h.attributes["id"], h.distance, h.vector) for h in hits] == [(2, 4.25, [0.5, 0.0]), (3, 10.0, [3, 3])]
    _materialize(shoal, "Docs.Index")
    searcher.refresh()
    assert [h.attributes["id"] for h in searcher.search("Docs.Index", "1", [[0.0, 2.0]], 3)[0]] == [2, 3]
    searcher.close()


def test_sparse_index(shoal: Shoal) -> None:
    shoal.create_index(IndexSpec("Words.Index", "1", "Words", "1", algorithm="SparnnIndex.Cosine"))
    shoal.producer("Words", "1").upload([
        DataPoint({"id": 1}, SparseVector([1, 2], [1.0, 1.0])),
        DataPoint({"id": 2}, SparseVector([50], [2.0])),
    ])
    _materialize(shoal, "Words.Index")
    searcher = shoal.searcher(follow=False)
    hits = searcher.search("Words.Index", "1", [SparseVector([1], [1.0])], 2)[0]
    assert [h.attributes["id"] for h in hits] == [1, 2]
    np.testing.assert_allclose([h.distance for h in hits], [1 - 1 / np.sqrt(2), 1.0], atol=1e-6)
    with pytest.raises(ValidationError, match="query with sparse vectors"):
        searcher.search("Words.Index", "1", [[0.0] * 100], 2)
    searcher.close()


def test_merges_keep_segments_and_dead_rows_bounded(shoal: Shoal) -> None:
    shoal.create_index(spec(shard_count=2))
    producer = shoal.producer("Docs", "1")
    builder = ShardBuilder(shoal.engine, shoal.storage, policy=MergePolicy(max_segments=3, max_deleted_ratio=0.3))
    rng = np.random.default_rng(5)
    for round_no in range(8):
        ids = rng.choice(60, 20, replace=False)
        producer.upload_columns(rng.random((20, 2)), {"id": ids, "lang": ["en"] * 20,
                                                       "payload": [f"r{round_no}"] * 20, "score": np.ones(20)})
        _materialize(shoal, "Docs.Index", builder)
        for shard in shoal.get_index("Docs.Index", "1").shards:
            while builder.needs_merge(shard.id):
                builder.merge(shard.id)
    for shard in shoal.get_index("Docs.Index", "1").shards:
        version = shoal.shards.active_version(shard.id)
        assert version is not None
        segments = version.manifest["segments"]
        assert len(segments) <= 3
        for seg in segments:
            assert (seg["deleted"] or {}).get("count", 0) <= 0.3 * seg["rows"]
    # Merging changed no answer: the index still equals brute force over the log.
    state = shoal.fold("Docs", "1")
    vectors = np.asarray(state["__vector"].to_pylist())
    searcher = shoal.searcher(follow=False)
    hits = searcher.search("Docs.Index", "1", [[0.5, 0.5]], len(vectors))[0]
    cos = 1 - vectors @ np.array([0.5, 0.5]) / (np.linalg.norm(vectors, axis=1) * np.linalg.norm([0.5, 0.5]))
    np.testing.assert_allclose([h.distance for h in hits], np.sort(cos), atol=1e-6)
    searcher.close()


def test_a_merge_the_segment_count_makes_due_takes_the_smallest_min_merge_segments() -> None:
    """Merging only two segments whenever the bound is passed rewrites each row about twice as often: a merge
    the count makes due takes the `min_merge` smallest. Dead-row merges are not widened."""
    policy = MergePolicy(max_segments=4, min_merge=3)
    sizes = [500, 40, 90, 10, 70]
    entries = [SegmentEntry(f"s{i}", f"d{i}", rows, 0, 0, "", ()) for i, rows in enumerate(sizes)]
    assert pick(policy, entries) == [1, 3, 4]  # 10, 40 and 70 rows: two would have done for the bound
    assert pick(policy, entries[:4]) == []  # within the bound: nothing is due
    assert pick(policy, entries[:2], force=True) == [0, 1]
    dead = replace(entries[0], deleted=DeletionEntry("x", 400, ""))
    assert pick(policy, [dead, *entries[1:4]]) == [0]  # dead rows alone: that segment, rebuilt alone
    assert pick(MergePolicy(max_segments=4, min_merge=2), entries) == [1, 3]


def test_served_watermarks_are_marked_together_and_never_move_back(shoal: Shoal) -> None:
    """A searcher that loads new versions of several shards marks them in one go; a mark below what a shard
    already shows (an older searcher, a late mark) leaves that shard as it is and still moves the others."""
    index = shoal.create_index(spec(shard_count=3))
    a, b, c = (sh.id for sh in index.shards)
    shoal.shards.mark_served_many({a: 10, b: 5})
    shoal.shards.mark_served_many({a: 3, b: 7, c: 0})
    shoal.shards.mark_served_many({})
    got = {sh.id: (sh.served_watermark, sh.served_at is not None) for sh in shoal.get_index("Docs.Index", "1").shards}
    assert got == {a: (10, True), b: (7, True), c: (0, True)}


def test_freshness_status_and_drop(shoal: Shoal) -> None:
    shoal.create_index(spec(shard_count=3))
    producer = shoal.producer("Docs", "1")
    producer.upload_columns(np.ones((30, 2)), {"id": np.arange(30), "lang": ["en"] * 30,
                                                "payload": ["p"] * 30, "score": np.ones(30)})
    status = shoal.index_status("Docs.Index", "1")
    assert [(s.shard, s.head, s.built_watermark, s.served_watermark, s.lag_seqs) for s in status] == [
        (0, 30, 0, 0, 30), (1, 30, 0, 0, 30), (2, 30, 0, 0, 30)
    ]
    assert all(s.lag_seconds >= 0 for s in status)
    _materialize(shoal, "Docs.Index")
    assert [(s.built_watermark, s.served_watermark) for s in shoal.index_status("Docs.Index", "1")] == [(30, 0)] * 3
    searcher = shoal.searcher(follow=False)
    searcher.view("Docs.Index", "1")  # loading marks the versions as served
    status = shoal.index_status("Docs.Index", "1")
    assert [(s.served_watermark, s.lag_seqs, s.lag_seconds) for s in status] == [(30, 0, 0.0)] * 3
    assert sum(s.segments for s in status) == 3  # 30 keys hashed over 3 shards: every shard got some
    searcher.close()

    folder = f"tenants/{shoal.tenant}/indexes/Docs.Index"
    assert shoal.storage.list_files(folder)
    assert shoal.drop_index("Docs.Index", "1") > 0
    # The drop queued the files; GC deletes them once the grace period (searchers may still read them) ends.
    shoal.collect_garbage(now=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=shoal.settings.gc_grace_s + 1))
    assert shoal.storage.list_files(folder) == []
    with pytest.raises(NotFoundError):
        shoal.index_status("Docs.Index", "1")
