"""Searches check what they are given and answer one log state: a sparse query vector follows the rules of a dense
one (finite float32 values, a norm of at most MAX_NORM, one-dimensional indices and values of one length: else a
QueryError naming queryVectors, never a raw TypeError or a ranking by infinite distances); an empty dense query
vector is refused by its dimension; `at_least(token)` over shards built to different seqs never shows half of a
batch; and a write token of another data source is refused."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from shoal import DataPoint, DataSourceSpec, Shoal, SparseVector
from shoal.config.settings import Settings
from shoal.errors import QueryError
from shoal.index.builder import ShardBuilder
from shoal.index.sharding import shard_numbers
from shoal.log.records import IndexSpec, WriteToken
from shoal.searcher.consistency import Consistency

LEVELS = [Consistency.strong(), Consistency.eventual()]


def ids_and_distances(hits: Any) -> list[tuple[int, float]]:
    return [(h.attributes["id"], h.distance) for h in hits]


# -- sparse query vectors ------------------------------------------------------------------------------------

@pytest.fixture
def sparse(local_shoal: Shoal) -> Iterator[Shoal]:
    """A sparse data source with an exact l2_squared index: point 1 built into a segment, point 2 in the log."""
    local_shoal.create_data_source(DataSourceSpec("S", "1", 10, {"id": "int64"}, ["id"], vectors_are_sparse=True))
    local_shoal.create_index(IndexSpec("I", "1", "S", "1", algorithm="flat_sparse", metric="l2_squared"))
    producer = local_shoal.producer("S", "1")
    producer.upload([DataPoint({"id": 1}, SparseVector([0], [-5e18]))])
    ShardBuilder(local_shoal.engine, local_shoal.storage).materialize(local_shoal.get_index("I", "1").shards[0].id)
    producer.upload([DataPoint({"id": 2}, SparseVector([0], [5e18]))])
    yield local_shoal


@pytest.mark.parametrize("consistency", LEVELS, ids=lambda c: c.level)
@pytest.mark.parametrize(("query", "says"), [
    # Was answered [(1, inf), (2, inf)]: both distances overflow float32, and the far point came first.
    (SparseVector([0], [1e20]), "query vector norm 1e+20 is past the largest allowed"),
    # Was "sparse values must be finite" after a numpy overflow warning.
    (SparseVector([0], [1e39]), "1e+39 at index 0 is past float32's range"),
    (SparseVector([3, 0], [0.0, 10**400]), "an integer of 401 digits at index 1 is past float32's range"),
], ids=["norm past the bound", "past float32", "past float64"])
def test_a_sparse_query_past_float32_or_the_norm_bound_is_refused_naming_it(
    sparse: Shoal, query: SparseVector, says: str, consistency: Consistency
) -> None:
    searcher = sparse.searcher(follow=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # named by the check, not noticed after a numpy overflow warning
            with pytest.raises(QueryError, match="queryVectors") as err:
                searcher.search("I", "1", [query], 2, consistency=consistency)
        assert says in str(err.value), str(err.value)
    finally:
        searcher.close()


def test_a_sparse_query_within_the_bound_ranks_by_its_true_distances(sparse: Shoal) -> None:
    searcher = sparse.searcher(follow=False)
    try:
        hits = searcher.search("I", "1", [SparseVector([0], [4e18])], 2, consistency=Consistency.strong())[0]
        assert ids_and_distances(hits) == [(2, pytest.approx(1e36, rel=1e-6)), (1, pytest.approx(8.1e37, rel=1e-6))]
    finally:
        searcher.close()


@pytest.mark.parametrize("consistency", LEVELS, ids=lambda c: c.level)
@pytest.mark.parametrize(("query", "says"), [
    (SparseVector([5], None), "sparse query vector needs its indices and values as two lists of one length"),
    (SparseVector(5, 1.0), "sparse query vector needs its indices and values as two lists of one length"),
    (SparseVector([[1], [2]], [[1.0], [2.0]]), "two lists of one length"),  # was "all keys need to be the same shape"
    (SparseVector([1, 2], [1.0]), "two lists of one length"),
    (SparseVector([True], [1.0]), "sparse indices must be integers"),
    (SparseVector([1, 1], [1.0, 2.0]), "repeats an index"),
], ids=["values None", "scalars", "2-d", "lengths differ", "bool index", "repeated index"])
def test_a_malformed_sparse_query_is_refused_naming_query_vectors(
    sparse: Shoal, query: SparseVector, says: str, consistency: Consistency
) -> None:
    """These raised TypeError, ValueError or OverflowError out of Searcher.search."""
    searcher = sparse.searcher(follow=False)
    try:
        with pytest.raises(QueryError, match="queryVectors") as err:
            searcher.search("I", "1", [query], 1, consistency=consistency)
        assert says in str(err.value), str(err.value)
    finally:
        searcher.close()


def test_sparse_queries_given_as_arrays_are_searched_as_given(sparse: Shoal) -> None:
    searcher = sparse.searcher(follow=False)
    try:
        queries = [SparseVector(np.array([5, 0], dtype=object), np.array([0.0, 4e18], np.float32)),
                   SparseVector((), ()),
                   SparseVector(np.array([0], np.uint64), [-4e18])]
        found = [[h.attributes["id"] for h in hits]
                 for hits in searcher.search("I", "1", queries, 2, consistency=Consistency.strong())]
        assert found == [[2, 1], [1, 2], [1, 2]]
    finally:
        searcher.close()


# -- an empty dense query vector --------------------------------------------------------------------------------

@pytest.mark.parametrize("queries", [[[]], np.zeros((1, 0), np.float32), [[], []]], ids=["list", "array", "two"])
def test_an_empty_dense_query_vector_is_refused_by_its_dimension(local_shoal: Shoal, queries: Any) -> None:
    """It was refused with "at least one query vector is required", although one was given."""
    local_shoal.create_data_source(DataSourceSpec("D", "1", 2, {"id": "int64"}, ["id"]))
    local_shoal.create_index(IndexSpec("DI", "1", "D", "1", algorithm="flat"))
    local_shoal.producer("D", "1").upload([DataPoint({"id": 1}, [0.0, 1.0])])
    searcher = local_shoal.searcher(follow=False)
    try:
        with pytest.raises(QueryError, match="wrong query dimension: expected 2, got 0"):
            searcher.search("DI", "1", queries, 1, consistency=Consistency.strong())
        with pytest.raises(QueryError, match="at least one query vector is required"):
            searcher.search("DI", "1", [], 1, consistency=Consistency.strong())
    finally:
        searcher.close()


# -- at_least over shards built to different seqs -----------------------------------------------------------------

@pytest.mark.parametrize("mode", ["not following", "no young tier"])
def test_at_least_never_shows_half_of_a_batch_across_shards(
    make_settings: Callable[..., Settings], mode: str
) -> None:
    """Shard 0 is built past a batch that updates a key on each shard, shard 1 is not: `at_least` of the token
    before that batch answered shard 0 after it and shard 1 before it, a state the log never had."""
    settings = make_settings("local", young_tier_max_seqs=0) if mode == "no young tier" else make_settings("local")
    shoal = Shoal(settings, notify=False)
    try:
        shoal.create_data_source(DataSourceSpec("S", "1", 2, {"id": "int64", "payload": "string"}, ["id"]))
        shoal.create_index(IndexSpec("I", "1", "S", "1", algorithm="flat", id_attributes=["id"], shard_count=2))
        candidates = np.arange(50)
        on = shard_numbers(pa.table({"id": pa.array(candidates, pa.int64())}), ["id"], 2)
        a, b = int(candidates[on == 0][0]), int(candidates[on == 1][0])
        producer = shoal.producer("S", "1")
        shard_ids = {s.shard_no: s.id for s in shoal.get_index("I", "1").shards}
        builder = ShardBuilder(shoal.engine, shoal.storage)
        before = producer.upload([DataPoint({"id": a, "payload": "old"}, [0, 0]),
                                  DataPoint({"id": b, "payload": "old"}, [0, 1])])
        builder.materialize(shard_ids[0])
        builder.materialize(shard_ids[1])
        after = producer.upload([DataPoint({"id": a, "payload": "new"}, [0, 0]),
                                 DataPoint({"id": b, "payload": "new"}, [0, 1])])
        builder.materialize(shard_ids[0])  # shard 0 reflects the second batch, shard 1 not yet
        assert {s.shard: s.built_watermark for s in shoal.index_status("I", "1")} == {0: after.seq, 1: before.seq}
        searcher = shoal.searcher(follow=mode != "not following")
        try:
            for token in (before, after):
                hits = searcher.search("I", "1", [[0, 0]], 5, consistency=Consistency.at_least(token))[0]
                # The log had (old, old) and (new, new); every shard answers at one seq, here the second batch's.
                assert sorted((h.attributes["id"], h.attributes["payload"]) for h in hits) == sorted(
                    [(a, "new"), (b, "new")])
        finally:
            searcher.close()
    finally:
        shoal.close()


# -- a write token of another data source ----------------------------------------------------------------------

def test_a_write_token_of_another_data_source_is_refused(local_shoal: Shoal) -> None:
    for name in ("A", "B"):
        local_shoal.create_data_source(DataSourceSpec(name, "1.0", 2, {"id": "int64"}, ["id"]))
    local_shoal.create_index(IndexSpec("IB", "1.0", "B", "1.0", algorithm="flat"))
    token_b = local_shoal.producer("B", "1.0").upload([DataPoint({"id": 1}, [0.0, 0.0])])
    token_a = local_shoal.producer("A", "1.0").upload([DataPoint({"id": 7}, [0.0, 0.0])])
    searcher = local_shoal.searcher(follow=False)
    try:
        for token in (token_a, WriteToken(1, "A", "1.0"), WriteToken(1, "B", "2.0")):
            with pytest.raises(QueryError, match="write token of data source") as err:
                searcher.search("IB", "1.0", [[0.0, 0.0]], 3, consistency=Consistency.at_least(token))
            assert "over data source B/1.0" in str(err.value), str(err.value)
        # Its own data source's token, and a bare seq (taken as the searched data source's), are answered.
        for given in (token_b, token_b.seq, WriteToken(token_b.seq)):
            hits = searcher.search("IB", "1.0", [[0.0, 0.0]], 3, consistency=Consistency.at_least(given))[0]
            assert [h.attributes["id"] for h in hits] == [1]
    finally:
        searcher.close()
    assert Consistency.at_least(token_a) == Consistency("at_least", token_a.seq)  # equality compares seqs, as tokens
