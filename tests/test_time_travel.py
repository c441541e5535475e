"""Time travel: searches of tagged versions and as of a seq answer exactly what the index answered then;
version pruning keeps what time travel, tags and searchers may use, and nothing else."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest

from shoal import DataSourceSpec, Shoal
from shoal.engines.metrics import exact_top_k
from shoal.errors import NotFoundError, ValidationError
from shoal.index.builder import ShardBuilder
from shoal.index.history import prune_versions
from shoal.log.records import AttributeType, IndexSpec

DIM = 4
SPEC = DataSourceSpec("tt", "1", DIM, {"id": AttributeType.INT64}, ["id"])


def _exact_ids(state: dict[int, np.ndarray], queries: np.ndarray, k: int) -> list[list[int]]:
    ids = sorted(state)
    vectors = np.stack([state[i] for i in ids])
    _, labels = exact_top_k("euclidean", queries, vectors, k)
    return [[ids[j] for j in row if j >= 0] for row in labels]


def test_tags_and_as_of_answer_as_the_index_did_then(local_shoal: Shoal) -> None:
    local_shoal.create_data_source(SPEC)
    local_shoal.create_index(IndexSpec("tt", "1", "tt", "1", algorithm="flat", metric="euclidean",
                                       id_attributes=["id"]))
    shard = local_shoal.get_index("tt", "1").shards[0].id
    builder = ShardBuilder(local_shoal.engine, local_shoal.storage)
    producer = local_shoal.producer("tt", "1")
    rng = np.random.default_rng(5)
    state: dict[int, np.ndarray] = {}
    snapshots: dict[int, dict[int, np.ndarray]] = {}
    for step in range(4):
        vectors = rng.normal(size=(50, DIM)).astype(np.float32)
        ids = np.arange(step * 30, step * 30 + 50)  # overlaps: updates of earlier points
        token = producer.upload_columns(vectors, {"id": ids})
        state.update({int(i): v for i, v in zip(ids, vectors, strict=True)})
        gone = [int(step * 30 + 1)]
        token = producer.delete({"id": gone})
        for g in gone:
            state.pop(g, None)
        snapshots[token.seq] = dict(state)
        if step % 2 == 0:
            builder.materialize(shard)  # versions at some seqs only: the others need the log tail
        if step == 1:
            local_shoal.tag_index("tt", "1", "after-step-1")  # pins what the index had built (step 0)
    builder.materialize(shard)
    queries = rng.normal(size=(10, DIM)).astype(np.float32)
    searcher = local_shoal.searcher(follow=False)
    try:
        ids_of = lambda res: [[h.attributes["id"] for h in hits] for hits in res]  # noqa: E731
        for seq, snap in snapshots.items():
            got = ids_of(searcher.search("tt", "1", queries, 5, as_of=seq))
            assert got == _exact_ids(snap, queries, 5), f"as of seq {seq}"
        first = min(snapshots)
        assert ids_of(searcher.search("tt", "1", queries, 5, tag="after-step-1")) == _exact_ids(
            snapshots[first], queries, 5
        )  # built at step 0, tagged at step 1: the tag holds what was built then
        with pytest.raises(NotFoundError, match="tag 'nope'"):
            searcher.search("tt", "1", queries, 5, tag="nope")
        with pytest.raises(ValidationError, match="past the log head"):
            searcher.search("tt", "1", queries, 5, as_of=10**9)
        with pytest.raises(ValidationError, match="not both"):
            searcher.search("tt", "1", queries, 5, as_of=1, tag="after-step-1")

        # Pruning with no keep window: active, tagged and the newest older version stay; searches still work.
        later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
        index_id = local_shoal.get_index("tt", "1").id
        pruned = prune_versions(local_shoal.engine, keep_s=0, grace_s=0, now=later, index_id=index_id)
        assert pruned == 0  # three versions: active (last), tagged (step 0) and the newest before the window
        assert ids_of(searcher.search("tt", "1", queries, 5, tag="after-step-1")) == _exact_ids(
            snapshots[first], queries, 5
        )
        local_shoal.untag_index("tt", "1", "after-step-1")
        assert prune_versions(local_shoal.engine, keep_s=0, grace_s=0, now=later, index_id=index_id) == 1
        with pytest.raises(NotFoundError, match="pruned"):
            searcher.search("tt", "1", queries, 5, as_of=first)
        # Seq 0 is the empty log before any write: no version is needed to answer it (it was refused as pruned).
        assert ids_of(searcher.search("tt", "1", queries, 5, as_of=0)) == [[]] * len(queries)
        last = max(snapshots)
        assert ids_of(searcher.search("tt", "1", queries, 5, as_of=last)) == _exact_ids(snapshots[last], queries, 5)
    finally:
        searcher.close()


def test_time_travel_over_http(make_settings) -> None:  # type: ignore[no-untyped-def]
    import httpx
    from conftest import serve_api

    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(SPEC)
        shoal.create_index(IndexSpec("tt", "1", "tt", "1", algorithm="flat", metric="euclidean",
                                     id_attributes=["id"]))
        producer = shoal.producer("tt", "1")
        first = producer.upload_columns(np.eye(DIM, dtype=np.float32), {"id": np.arange(DIM)})
        builder = ShardBuilder(shoal.engine, shoal.storage)
        builder.materialize(shoal.get_index("tt", "1").shards[0].id)
        shoal.tag_index("tt", "1", "v1")
        producer.delete({"id": [0]})
        builder.materialize(shoal.get_index("tt", "1").shards[0].id)
    with serve_api(settings) as base:
        url = f"{base}/api/v1/search/tt/1"
        body = {"k": 1, "queryVectors": [{"isSparse": False, "coordinates": [1.0, 0.0, 0.0, 0.0]}]}

        def top(**headers: str) -> int:
            found = httpx.post(url, json=body, headers=headers, timeout=30)
            assert found.status_code == 200, found.text
            return found.json()[0]["nearestDataPoints"][0]["attributes"][0]["value"]["int64"]

        assert top() != 0  # deleted now
        assert top(**{"X-Shoal-Tag": "v1"}) == 0
        assert top(**{"X-Shoal-As-Of": str(first.seq)}) == 0
        tags = httpx.get(f"{base}/api/v1/indexes/tt/1/tags", timeout=30).json()
        assert list(tags) == ["v1"]
        assert httpx.post(url, json=body, headers={"X-Shoal-Tag": "nope"}, timeout=30).status_code == 404
        assert httpx.put(f"{base}/api/v1/indexes/tt/1/tags/v2", timeout=30).status_code == 200
        assert httpx.delete(f"{base}/api/v1/indexes/tt/1/tags/v1", timeout=30).status_code == 204
        assert list(httpx.get(f"{base}/api/v1/indexes/tt/1/tags", timeout=30).json()) == ["v2"]


def test_a_tag_answers_as_it_was_after_a_reindex_and_keeps_its_generation(local_shoal: Shoal) -> None:
    """"A tag always works": a reindex swaps in a new generation (another index row), but a tag taken before it
    still answers from the versions it pinned, and the sweep of old generations keeps the tagged one until the
    tag is removed."""
    from shoal.index.reindex import drop_expired_generations

    tenant = local_shoal.catalog.tenant_id  # the sweep of this test's tenant only: the catalog is shared
    local_shoal.create_data_source(SPEC)
    local_shoal.create_index(IndexSpec("tr", "1", "tt", "1", algorithm="flat", metric="euclidean",
                                       id_attributes=["id"], shard_count=2))
    rng = np.random.default_rng(11)
    producer = local_shoal.producer("tt", "1")
    first = rng.normal(size=(60, DIM)).astype(np.float32)
    producer.upload_columns(first, {"id": np.arange(60)})
    builder = ShardBuilder(local_shoal.engine, local_shoal.storage)
    for shard in local_shoal.get_index("tr", "1").shards:
        builder.materialize(shard.id)
    pinned = local_shoal.tag_index("tr", "1", "v1")
    producer.upload_columns(rng.normal(size=(40, DIM)).astype(np.float32), {"id": np.arange(20, 60)})
    queries = rng.normal(size=(8, DIM)).astype(np.float32)
    want = _exact_ids(dict(enumerate(first)), queries, 5)
    searcher = local_shoal.searcher(follow=False)
    try:
        ids_of = lambda res: [[h.attributes["id"] for h in hits] for hits in res]  # noqa: E731
        assert ids_of(searcher.search("tr", "1", queries, 5, tag="v1")) == want
        job = local_shoal.reindex("tr", "1", metric="l2_squared", wait=True)
        assert job.state == "swapped", job
        assert local_shoal.get_index("tr", "1").spec.metric != "euclidean"  # the new generation serves
        assert local_shoal.index_tags("tr", "1") == {"v1": pinned}
        assert ids_of(searcher.search("tr", "1", queries, 5, tag="v1")) == want
        # Past its keep time the old generation would go; the tag keeps it, and so its answers.
        assert drop_expired_generations(local_shoal.engine, local_shoal.storage, keep_s=0, tenant_id=tenant) == 0
        assert ids_of(searcher.search("tr", "1", queries, 5, tag="v1")) == want
        # A tag of the same name on the new generation replaces the old one; once no tag names the old
        # generation, the sweep drops it.
        local_shoal.tag_index("tr", "1", "v1")
        assert local_shoal.index_tags("tr", "1") != {"v1": pinned}
        assert drop_expired_generations(local_shoal.engine, local_shoal.storage, keep_s=0, tenant_id=tenant) == 1
        local_shoal.untag_index("tr", "1", "v1")
        assert local_shoal.index_tags("tr", "1") == {}
        with pytest.raises(NotFoundError, match="tag 'v1' not found"):
            searcher.search("tr", "1", queries, 5, tag="v1")
    finally:
        searcher.close()


def test_time_travel_is_refused_below_what_compaction_dropped_and_only_there(local_shoal: Shoal) -> None:
    """A compaction that merged segments and dropped nothing leaves time travel answering; one that dropped
    superseded entries makes it refuse the seqs below, and keeps refusing them after a later run that reached
    less far (a new index at watermark 0 holds the bound down), rather than answer from the thinned log."""
    local_shoal.create_data_source(SPEC)
    local_shoal.create_index(IndexSpec("ta", "1", "tt", "1", algorithm="flat", metric="euclidean",
                                       id_attributes=["id"]))
    producer = local_shoal.producer("tt", "1")
    point = lambda x: np.array([[x, 0.0, 0.0, 0.0]], dtype=np.float32)  # noqa: E731
    first = producer.upload_columns(point(0.0), {"id": np.array([1])}).seq
    producer.upload_columns(point(1.0), {"id": np.array([2])})
    builder = ShardBuilder(local_shoal.engine, local_shoal.storage)
    builder.materialize(local_shoal.get_index("ta", "1").shards[0].id)
    searcher = local_shoal.searcher(follow=False)
    try:
        at_first = lambda: [h.attributes["id"] for h in  # noqa: E731
                            searcher.search("ta", "1", point(0.0), 5, as_of=first)[0]]
        assert at_first() == [1]
        merged = local_shoal.compact("tt", "1")
        assert merged.changed and merged.entries_dropped == 0  # two small segments merged into one
        assert at_first() == [1]  # every entry is still in the log, at its seq

        producer.upload_columns(point(9.0), {"id": np.array([1])})  # supersedes seq `first`
        builder.materialize(local_shoal.get_index("ta", "1").shards[0].id)
        dropped = local_shoal.compact("tt", "1")
        assert dropped.entries_dropped == 1
        with pytest.raises(NotFoundError, match="compacted"):
            at_first()
        local_shoal.create_index(IndexSpec("tb", "1", "tt", "1", algorithm="flat", metric="euclidean",
                                           id_attributes=["id"]))
        assert local_shoal.compact("tt", "1").bound == 0  # the new index has built nothing: nothing to touch
        with pytest.raises(NotFoundError, match="compacted"):
            at_first()
    finally:
        searcher.close()
