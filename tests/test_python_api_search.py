"""The Python API's search and management calls refuse bad arguments with a Shoal error naming the parameter
(QueryError or InvalidNameError for searches, ValidationError or ConfigurationError elsewhere), never a raw
TypeError, AttributeError, OverflowError or database error, and change nothing; a searcher's poll interval is
checked before any thread starts, and a valid one keeps following new versions."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import wait_for

from shoal import DataPoint, DataSourceSpec, Shoal, SparseVector
from shoal.config.settings import MAX_DURATION_S, Settings
from shoal.errors import ConfigurationError, InvalidNameError, QueryError, ShoalError, ValidationError
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec, WriteToken
from shoal.runtime import Runtime
from shoal.searcher.consistency import Consistency

SOURCE = DataSourceSpec(name="ds", version="1", vector_dimension=2, attribute_types={"id": "int64", "cat": "string"},
                        permanent_attributes=["id", "cat"])
Q = [[0.0, 1.0]]


@pytest.fixture
def api(local_shoal: Shoal) -> Iterator[Shoal]:
    """A tenant with a data source holding one point, a flat index with a split attribute and an HNSW one."""
    local_shoal.create_data_source(SOURCE)
    local_shoal.create_index(IndexSpec(name="fl", version="1", source_name="ds", source_version="1",
                                       id_attributes=["id"], split_attributes=["cat"]))
    local_shoal.create_index(IndexSpec(name="hn", version="1", source_name="ds", source_version="1",
                                       algorithm="hnsw", params={"M": 8, "ef_construction": 50, "ef_search": 20}))
    local_shoal.producer("ds", "1").upload([DataPoint({"id": 1, "cat": "a"}, [0.0, 1.0])])
    yield local_shoal


def poll_threads() -> int:
    return sum(t.name == "shoal-searcher-poll" and t.is_alive() for t in threading.enumerate())


# -- 1. the searcher's poll interval ------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "x", "1", True, 2**70, 1e300,
                                 10**400, MAX_DURATION_S + 1])
def test_searcher_refuses_a_poll_interval_it_could_not_follow_with(local_shoal: Shoal, bad: Any) -> None:
    before = poll_threads()
    with pytest.raises(ValidationError, match="poll_interval"):
        local_shoal.searcher(poll_interval=bad)
    assert poll_threads() == before  # refused before any thread started: none left behind, dead or spinning


def test_a_valid_poll_interval_still_follows_new_versions(local_shoal: Shoal) -> None:
    local_shoal.create_data_source(SOURCE)
    local_shoal.create_index(IndexSpec(name="fl", version="1", source_name="ds", source_version="1",
                                       id_attributes=["id"]))
    shard = local_shoal.get_index("fl", "1").shards[0].id
    builder = ShardBuilder(local_shoal.engine, local_shoal.storage)
    producer = local_shoal.producer("ds", "1")
    producer.upload([DataPoint({"id": 1, "cat": "a"}, [0.0, 1.0])])
    builder.materialize(shard)
    searcher = local_shoal.searcher(poll_interval=0.05)  # no broker here: polling is what follows
    try:
        first = searcher.served_watermarks("fl", "1")[0]
        token = producer.upload([DataPoint({"id": 2, "cat": "a"}, [1.0, 0.0])])
        builder.materialize(shard)
        wait_for(lambda: searcher.served_watermarks("fl", "1")[0] == token.seq, 20,
                 "the poller to load the new version")
        assert first < token.seq
        hits = searcher.search("fl", "1", [[1.0, 0.0]], 1)[0]
        assert [h.attributes["id"] for h in hits] == [2]
    finally:
        searcher.close()


# -- 2. consistency ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("token", [1.9, None, "abc", "5", float("nan"), float("inf"), True, -1, 2**63])
def test_at_least_refuses_a_token_that_is_no_seq(token: Any) -> None:
    with pytest.raises(ValidationError, match="at_least token"):
        Consistency.at_least(token)


@pytest.mark.parametrize("make", [lambda: Consistency("bogus"), lambda: Consistency("at_least", None),  # type: ignore[arg-type]
                                  lambda: Consistency("at_least", 1.5), lambda: Consistency("strong", 4)],  # type: ignore[arg-type]
                         ids=["unknown level", "seq None", "seq float", "seq with strong"])
def test_consistency_refuses_an_unknown_level_or_a_bad_seq(make: Callable[[], Consistency]) -> None:
    with pytest.raises(ValidationError, match="consistency"):
        make()


def test_at_least_keeps_a_whole_token() -> None:
    assert Consistency.at_least(WriteToken(7, "ds", "1")) == Consistency("at_least", 7)
    assert Consistency.at_least(0).seq == 0


@pytest.mark.parametrize("bad", ["bogus", "at_least", 5, {"level": "strong"}])
def test_search_refuses_a_consistency_that_is_no_level(api: Shoal, bad: Any) -> None:
    searcher = api.searcher(follow=False)
    try:
        with pytest.raises(QueryError, match="consistency"):
            searcher.search("fl", "1", Q, 1, consistency=bad)
    finally:
        searcher.close()


@pytest.mark.parametrize("level", ["eventual", "strong"])
def test_search_takes_the_level_names(api: Shoal, level: str) -> None:
    searcher = api.searcher(follow=False)
    try:
        named = searcher.search("fl", "1", Q, 1, consistency=level)
        assert named == searcher.search("fl", "1", Q, 1, consistency=Consistency(level))  # type: ignore[arg-type]
        if level == "strong":  # nothing is built: eventual serves the (empty) loaded state, strong the log
            assert [h.attributes["id"] for h in named[0]] == [1]
    finally:
        searcher.close()


# -- 3. searches and management calls ------------------------------------------------------------------------

SEARCHES: dict[str, tuple[Callable[[Any], Any], type[ShoalError], str]] = {
    "queries None": (lambda r: r.search("fl", "1", None, 1), QueryError, "queries"),
    "queries a number": (lambda r: r.search("fl", "1", 5, 1), QueryError, "queries"),
    "split_filter pairs": (lambda r: r.search("fl", "1", Q, 1, split_filter=[("cat", "a")]), QueryError,
                           "split_filter"),
    "search_params int key": (lambda r: r.search("hn", "1", Q, 1, search_params={1: 5, "x": 2}), QueryError,
                              "search_params"),
    "as_of negative": (lambda r: r.search("fl", "1", Q, 1, as_of=-1), QueryError, "as_of"),
    "as_of past bigint": (lambda r: r.search("fl", "1", Q, 1, as_of=2**63), QueryError, "as_of"),
    "tag int": (lambda r: r.search("fl", "1", Q, 1, tag=5), InvalidNameError, "tag"),
    "tag NUL": (lambda r: r.search("fl", "1", Q, 1, tag="a\x00"), InvalidNameError, "tag"),
    "index NUL": (lambda r: r.search("fl\x00", "1", Q, 1), InvalidNameError, "index name"),
    "index surrogate": (lambda r: r.search("\ud800", "1", Q, 1), InvalidNameError, "index name"),
    "index list": (lambda r: r.search(["fl"], "1", Q, 1), InvalidNameError, "index name"),
    "version int": (lambda r: r.search("fl", 1, Q, 1), InvalidNameError, "index version"),
    "version int, as_of": (lambda r: r.search("fl", 1, Q, 1, as_of=1), InvalidNameError, "index version"),
    "alias NUL": (lambda r: r.search_alias("a\x00", Q, 1), InvalidNameError, "alias"),
    "alias int": (lambda r: r.search_alias(5, Q, 1), InvalidNameError, "alias"),
}


@pytest.mark.parametrize("case", SEARCHES)
def test_search_refuses_bad_arguments_naming_them(api: Shoal, case: str) -> None:
    call, error, named = SEARCHES[case]
    searcher = api.searcher(follow=False)
    try:
        with pytest.raises(error, match=named) as raised:
            call(searcher)
        assert type(raised.value) is error
    finally:
        searcher.close()


NOW = dt.datetime.now(dt.UTC)
CALLS: dict[str, tuple[Callable[[Shoal], Any], type[ShoalError], str]] = {
    "reindex name NUL": (lambda s: s.reindex("fl\x00", "1"), InvalidNameError, "index name"),
    "reindex params list": (lambda s: s.reindex("fl", "1", params=[("M", 8)]), ValidationError, "params"),
    "rollback version int": (lambda s: s.rollback("fl", 1), InvalidNameError, "index version"),
    "cancel_reindex surrogate": (lambda s: s.cancel_reindex("\ud800", "1"), InvalidNameError, "index name"),
    "set_alias index NUL": (lambda s: s.set_alias("al", "fl\x00", "1"), InvalidNameError, "index name"),
    "set_alias alias int": (lambda s: s.set_alias(5, "fl", "1"), InvalidNameError, "alias"),
    "get_alias NUL": (lambda s: s.get_alias("a\x00"), InvalidNameError, "alias"),
    "drop_alias int": (lambda s: s.drop_alias(5), InvalidNameError, "alias"),
    "untag_index NUL": (lambda s: s.untag_index("fl", "1", "a\x00"), InvalidNameError, "tag"),
    "message_token None": (lambda s: s.message_token("ds", "1", None), ValidationError, "message_id"),
    "message_token NUL": (lambda s: s.message_token("ds", "1", "a\x00"), ValidationError, "message_id"),
    "read_log up_to 2**63": (lambda s: list(s.read_log("ds", "1", up_to_seq=2**63)), ValidationError, "up_to_seq"),
    "read_log after None": (lambda s: list(s.read_log("ds", "1", after_seq=None)), ValidationError, "after_seq"),
    "read_log up_to True": (lambda s: list(s.read_log("ds", "1", up_to_seq=True)), ValidationError, "up_to_seq"),
    "fold up_to str": (lambda s: s.fold("ds", "1", up_to_seq="5"), ValidationError, "up_to_seq"),
    "fold up_to -1": (lambda s: s.fold("ds", "1", up_to_seq=-1), ValidationError, "up_to_seq"),
    "compact now str": (lambda s: s.compact("ds", "1", now="2020"), ValidationError, "now"),
    "compact now min": (lambda s: s.compact("ds", "1", now=dt.datetime.min.replace(tzinfo=dt.UTC)),
                        ValidationError, "now"),
    "compact now naive": (lambda s: s.compact("ds", "1", now=dt.datetime.min), ValidationError, "now"),
    "apply_retention now max": (lambda s: s.apply_retention("ds", "1", now=dt.datetime.max.replace(tzinfo=dt.UTC)),
                                ValidationError, "now"),
    "collect_garbage now int": (lambda s: s.collect_garbage(now=5), ValidationError, "now"),
}


@pytest.mark.parametrize("case", CALLS)
def test_management_refuses_bad_arguments_naming_them(api: Shoal, case: str) -> None:
    call, error, named = CALLS[case]
    head = api.get_data_source("ds", "1").head_seq
    with pytest.raises(error, match=named) as raised:
        call(api)
    assert type(raised.value) is error
    assert api.get_data_source("ds", "1").head_seq == head  # nothing written
    assert api.list_aliases() == [] and api.reindex_jobs("fl", "1") == []


def test_valid_seqs_and_clock_still_work(api: Shoal) -> None:
    head = api.get_data_source("ds", "1").head_seq
    assert api.fold("ds", "1", up_to_seq=head).num_rows == 1
    assert sum(b.num_rows for b in api.read_log("ds", "1", after_seq=0, up_to_seq=2**63 - 1)) == 1
    api.compact("ds", "1", now=NOW)
    api.collect_garbage(now=NOW)


def test_shoal_refuses_settings_and_a_runtime_of_other_settings(make_settings: Callable[..., Settings]) -> None:
    runtime = Runtime(make_settings("local"), notify=False)
    try:
        with pytest.raises(ConfigurationError, match="not both"):
            Shoal(make_settings("local"), runtime=runtime)
        with pytest.raises(ConfigurationError, match="runtime"):
            Shoal(runtime="x")  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="settings"):
            Shoal({"tenant": "x"})  # type: ignore[arg-type]
        shared = Shoal(runtime.settings, runtime=runtime)  # its own settings: fine
        assert shared.settings is runtime.settings
    finally:
        runtime.close()


@pytest.mark.parametrize(("queries", "says"), [
    ([[10**400, 0.0]], "an integer of 401 digits at index 0 is past float32's range"),
    ([[3 + 4j, 1j]], "query vectors must be numbers (bool, integer or float), got complex"),
    (np.array([["2024-01-01", "2024-01-02"]], dtype="datetime64[D]"), "got datetime64"),
    (np.zeros((1, 1, 2), np.float32), "must be one vector or a list of vectors, got an array of shape [1, 1, 2]"),
    (np.array(1.0, np.float32), "at least one query vector"),
    ([[0.0], [0.0, 1.0]], "query vectors must be numbers, in rows of one length"),
])
def test_dense_queries_of_other_kinds_are_refused_naming_them(local_shoal: Shoal, queries: object, says: str) -> None:
    """Query vectors follow the stored vectors' rule: numbers only (complex and datetime queries were cast
    silently), of one shape; an integer past float64's range raised OverflowError, a 0-d array IndexError."""
    local_shoal.create_data_source(DataSourceSpec("Q", "1", 2, {"id": "int64"}, ["id"]))
    local_shoal.create_index(IndexSpec("Q.Index", "1", "Q", "1", algorithm="flat", metric="euclidean"))
    local_shoal.producer("Q", "1").upload_columns(np.ones((3, 2), np.float32), {"id": np.arange(3)})
    searcher = local_shoal.searcher(follow=False)
    try:
        with pytest.raises(QueryError) as err:
            searcher.search("Q.Index", "1", queries, 1, consistency=Consistency.strong())
        assert says in str(err.value), str(err.value)
    finally:
        searcher.close()


@pytest.mark.parametrize(("vector", "says"), [
    (SparseVector([5.9], [1.0]), "sparse indices must be integers"),  # was searched as index 5
    (SparseVector([2**70], [1.0]), "sparse index out of range 0..99"),  # was OverflowError
    (SparseVector([1], ["x"]), "sparse values must be numbers"),  # was ValueError
])
def test_sparse_queries_of_other_kinds_are_refused_naming_them(local_shoal: Shoal, vector: SparseVector,
                                                               says: str) -> None:
    local_shoal.create_data_source(DataSourceSpec("S", "1", 100, {"id": "int64"}, ["id"], vectors_are_sparse=True))
    local_shoal.create_index(IndexSpec("S.Index", "1", "S", "1", algorithm="SparnnIndex.Cosine"))
    local_shoal.producer("S", "1").upload([DataPoint({"id": 1}, SparseVector([5], [1.0]))])
    searcher = local_shoal.searcher(follow=False)
    try:
        with pytest.raises(QueryError) as err:
            searcher.search("S.Index", "1", [vector], 1, consistency=Consistency.strong())
        assert says in str(err.value), str(err.value)
    finally:
        searcher.close()


def test_closing_a_shoal_stops_the_searchers_it_made(make_settings: Callable[..., Settings]) -> None:
    """`with Shoal(...) as s: s.searcher().search(...)` left the searcher's threads polling the catalog after the
    Shoal closed, each reconnecting through a fresh pool: a process opening a Shoal per task ran Postgres out of
    connections. Closing the Shoal stops them."""
    settings = make_settings("local")

    def searcher_threads() -> int:
        return sum(t.name.startswith("shoal-searcher-") for t in threading.enumerate())

    before = searcher_threads()
    for _ in range(3):
        with Shoal(settings, notify=False) as shoal:
            shoal.create_data_source(DataSourceSpec("S", "1", 2, {"id": "int64"}, ["id"]), exist_ok=True)
            shoal.create_index(IndexSpec("F", "1", "S", "1", algorithm="flat", metric="euclidean"), exist_ok=True)
            shoal.producer("S", "1").upload([DataPoint({"id": 1}, [1.0, 0.0])])
            kept = shoal.searcher(poll_interval=0.05)
            hits = kept.search("F", "1", [[1.0, 0.0]], 1, consistency=Consistency.strong())
            assert hits[0][0].attributes["id"] == 1
            # One used once and dropped: its service runs on its own threads all the same.
            hits = shoal.searcher(poll_interval=0.05).search("F", "1", [[1.0, 0.0]], 1)
            assert searcher_threads() > before
        wait_for(lambda: searcher_threads() == before, timeout=10, what="the searcher's threads to stop")
