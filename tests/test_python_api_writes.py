"""Writes through the Python API: bad input raises ValidationError naming what is wrong and writes nothing; it is
never stored as something else than was given, and never fails another producer's batch."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from shoal import DataPoint, DataSourceSpec, Shoal, SparseVector
from shoal.errors import ValidationError
from shoal.log.records import IndexSpec
from shoal.log.validation import SPARSE_INDICES, SPARSE_VALUES, VECTOR

DENSE = DataSourceSpec("Py.Dense", "1", 2, {"id": "int64", "f": "float64"}, ["id"])
SPARSE = DataSourceSpec("Py.Sparse", "1", 8, {"id": "int64"}, ["id"], vectors_are_sparse=True)
V = np.zeros((2, 2), np.float32)


def assert_nothing_written(shoal: Shoal, spec: DataSourceSpec) -> None:
    assert shoal.get_data_source(spec.name, spec.version).head_seq == 0
    assert shoal.log_segments(spec.name, spec.version) == []


def assert_refused(err: pytest.ExceptionInfo[ValidationError], attribute: str, rule: str) -> None:
    problem = err.value.problems[0]
    assert problem.attribute == attribute, str(err.value)
    assert rule in problem.rule, str(err.value)


def point(vector: Any) -> DataPoint:
    return DataPoint({"id": 1, "f": 1.0}, vector)


@pytest.mark.parametrize(
    ("vector", "rule"),
    [
        ([10**400, 0], "an integer of 401 digits at index 0 is past float32's range"),
        (np.array([3 + 4j, 1j]), "got complex128"),
        ([3 + 4j, 1.0], "got complex"),
        (np.array(["2024-01-01", "2024-01-02"], "M8[D]"), "got datetime64[D]"),
        (np.array([1, 2], "m8[s]"), "got timedelta64[s]"),
        (["1", "2"], "got <U1"),
        (np.array(["a", 0], object), "got str"),
        (np.ma.masked_array([5.0, 1.0], mask=[True, False]), "masked array"),
        ({0: 1.0, 1: 2.0}, "got dict"),
        ([[1.0], [1.0, 2.0]], "in rows of one length"),
        (SparseVector([0], [1.0]), "got a sparse one"),
    ],
)
def test_malformed_dense_vector_is_refused(local_shoal: Shoal, vector: Any, rule: str) -> None:
    local_shoal.create_data_source(DENSE)
    producer = local_shoal.producer(DENSE.name, DENSE.version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ComplexWarning either: refused, not cast
        with pytest.raises(ValidationError) as err:
            producer.upload([point([0.0, 1.0]), point(vector)])
    assert err.value.problems[0].position == 1
    assert_refused(err, "vector", rule)
    assert_nothing_written(local_shoal, DENSE)


@pytest.mark.parametrize(
    ("vector", "rule"),
    [
        (SparseVector([1.7, 5.2], [1.0, 2.0]), "sparse indices must be integers"),
        (SparseVector([3.0], [1.0]), "sparse indices must be integers"),  # integral floats too: as over JSON
        (SparseVector(["3"], [4.0]), "sparse indices must be numbers"),
        (SparseVector([True, False], [1.0, 2.0]), "sparse indices must be integers"),
        (SparseVector([3], ["4"]), "sparse values must be numbers"),
        (SparseVector([3], [4j]), "sparse values must be numbers"),
        (SparseVector([3], [10**400]), "past float32's range"),
        (SparseVector(np.ma.masked_array([1, 2], mask=[False, True]), [1.0, 2.0]), "masked array"),
        (SparseVector([2**70], [1.0]), "out of range 0..7"),
        (SparseVector(np.array([2**64 - 1], np.uint64), [1.0]), "out of range 0..7"),
    ],
)
def test_malformed_sparse_vector_is_refused(local_shoal: Shoal, vector: SparseVector, rule: str) -> None:
    local_shoal.create_data_source(SPARSE)
    producer = local_shoal.producer(SPARSE.name, SPARSE.version)
    with pytest.raises(ValidationError) as err:
        producer.upload([DataPoint({"id": 0}, SparseVector([0], [1.0])), DataPoint({"id": 1}, vector)])
    assert err.value.problems[0].position == 1
    assert_refused(err, "vector", rule)
    assert_nothing_written(local_shoal, SPARSE)


def test_numbers_of_every_real_kind_are_stored_as_given(local_shoal: Shoal) -> None:
    local_shoal.create_data_source(DENSE)
    local_shoal.create_data_source(SPARSE)
    dense = local_shoal.producer(DENSE.name, DENSE.version)
    dense.upload([
        DataPoint({"id": 1, "f": 1.0}, [True, 2]),
        DataPoint({"id": 2, "f": 1.0}, np.array([3, 4], np.uint8)),
        DataPoint({"id": 3, "f": 1.0}, np.array([5, np.float64(6.5)], object)),
    ])
    dense.upload_columns(np.array([[7, 8]], np.int64), {"id": np.array([4], np.uint64), "f": [2.0]})
    stored = {r["id"]: r[VECTOR] for r in local_shoal.fold(DENSE.name, DENSE.version).to_pylist()}
    assert stored == {1: [1.0, 2.0], 2: [3.0, 4.0], 3: [5.0, 6.5], 4: [7.0, 8.0]}
    local_shoal.producer(SPARSE.name, SPARSE.version).upload([
        DataPoint({"id": 1}, SparseVector(np.array([7, 2], np.uint64), np.array([1, 2], np.int32))),
        DataPoint({"id": 2}, SparseVector([], [])),
    ])
    rows = {r["id"]: (r[SPARSE_INDICES], r[SPARSE_VALUES]) for r in local_shoal.fold(SPARSE.name, "1").to_pylist()}
    assert rows == {1: ([7, 2], [1.0, 2.0]), 2: ([], [])}


def test_an_iterable_batch_is_read_once_and_a_non_iterable_refused(local_shoal: Shoal) -> None:
    local_shoal.create_data_source(DENSE)
    producer = local_shoal.producer(DENSE.name, DENSE.version)
    for bad in (None, 7, {"id": 1}):
        with pytest.raises(ValidationError) as err:
            producer.upload(bad)  # type: ignore[arg-type]
        assert_refused(err, "items", "the batch must be a list of DataPoints and Tombstones")
    assert_nothing_written(local_shoal, DENSE)
    token = producer.upload(DataPoint({"id": i, "f": 1.0}, [0, 1]) for i in range(3))
    assert token.seq == 3
    assert sorted(local_shoal.fold(DENSE.name, DENSE.version).column("id").to_pylist()) == [0, 1, 2]


@pytest.mark.parametrize(
    ("call", "attribute", "rule"),
    [
        (lambda p: p.upload_columns(V, {"id": np.array([2**63, 0], np.uint64), "f": np.ones(2)}), "id",
         "int64 value out of range"),
        (lambda p: p.upload_columns(V, {"id": np.zeros((2, 2), np.int64), "f": np.ones(2)}), "id",
         "column must be 1-dimensional"),
        (lambda p: p.upload_columns(V, {"id": np.arange(2), "f": None}), "f", "column must be a list"),
        (lambda p: p.upload_columns(V, {"id": {10: "a", 11: "b"}, "f": np.ones(2)}), "id", "got dict"),
        (lambda p: p.upload_columns(V, {"id": np.arange(2), "f": "ab"}), "f", "got str"),
        (lambda p: p.upload_columns(V, {"id": np.ma.masked_array([1, 2], mask=[True, False]), "f": np.ones(2)}),
         "id", "masked array"),
        (lambda p: p.upload_columns(V, None), "attributes", "columns must be a mapping"),
        (lambda p: p.upload_columns([[0, 0], [1]], {"id": np.arange(2), "f": np.ones(2)}), "vector",
         "in rows of one length"),
        (lambda p: p.upload_columns(np.array([["a", 0], [0, 0]], object), {"id": np.arange(2), "f": np.ones(2)}),
         "vector", "got str"),
        (lambda p: p.upload_columns(np.array([[10**400, 0], [0, 0]], object), {"id": np.arange(2), "f": np.ones(2)}),
         "vector", "past float32's range"),
        (lambda p: p.upload_columns(np.array([[3 + 4j, 1j]]), {"id": [1], "f": [1.0]}), "vector", "got complex128"),
        (lambda p: p.upload_columns(np.array([["2024-01-01", "2024-01-02"]], "M8[D]"), {"id": [1], "f": [1.0]}),
         "vector", "got datetime64[D]"),
        (lambda p: p.upload_columns(np.ma.masked_array([[5.0, 1.0]], mask=[[True, False]]), {"id": [3], "f": [1.0]}),
         "vector", "masked array"),
        (lambda p: p.delete({"id": None}), "id", "column must be a list"),
        (lambda p: p.delete({"id": np.array([2**64 - 1], np.uint64)}), "id", "int64 value out of range"),
        (lambda p: p.delete({"id": [1], "f": None}), "f", "column must be a list"),
        (lambda p: p.delete(None), "keys", "columns must be a mapping"),
    ],
)
def test_malformed_columns_are_refused(
    local_shoal: Shoal, call: Callable[[Any], object], attribute: str, rule: str
) -> None:
    local_shoal.create_data_source(DENSE)
    with pytest.raises(ValidationError) as err:
        call(local_shoal.producer(DENSE.name, DENSE.version))
    assert_refused(err, attribute, rule)
    assert_nothing_written(local_shoal, DENSE)


def test_a_uint64_key_past_int64_among_tombstone_attributes_is_refused(local_shoal: Shoal) -> None:
    spec = DataSourceSpec("Py.Full", "1", 2, {"id": "int64", "n": "int64"}, ["id"])
    local_shoal.create_data_source(spec)
    with pytest.raises(ValidationError) as err:
        local_shoal.producer(spec.name, spec.version).delete({"id": [1], "n": np.array([2**63], np.uint64)})
    assert (err.value.problems[0].position, err.value.problems[0].attribute) == (0, "n")
    assert_nothing_written(local_shoal, spec)


SOURCE = {"name": "S", "version": "1", "vector_dimension": 2, "attribute_types": {"id": "int64"},
          "permanent_attributes": ["id"]}
INDEX = {"name": "I", "version": "1", "source_name": "S", "source_version": "1"}


@pytest.mark.parametrize(
    ("changes", "rule"),
    [
        ({"vectors_are_sparse": "no"}, "vectors_are_sparse must be a bool, got str"),
        ({"vectors_are_sparse": None}, "vectors_are_sparse must be a bool, got NoneType"),
        ({"vectors_are_sparse": 1}, "vectors_are_sparse must be a bool, got int"),
        ({"attribute_types": None}, "attribute_types must be a mapping"),
        ({"attribute_types": [("id", "int64")]}, "attribute_types must be a mapping"),
        ({"attribute_types": {1: "int64"}}, "attribute names must be strings"),
        ({"attribute_types": {"id": ["int64"]}}, "unknown attribute type"),
        ({"permanent_attributes": None}, "permanent_attributes must be a list of attribute names"),
        ({"permanent_attributes": "id"}, "permanent_attributes must be a list of attribute names, got str"),
        ({"permanent_attributes": [["id"]]}, "permanent_attributes must hold attribute names (strings), got list"),
        ({"custom_metadata": None}, "custom_metadata must be a mapping"),
        ({"custom_metadata": [[["k"], 1]]}, "custom_metadata must be a mapping"),
    ],
)
def test_data_source_spec_of_wrong_types_is_refused(local_shoal: Shoal, changes: dict[str, Any], rule: str) -> None:
    with pytest.raises(ValidationError) as err:
        local_shoal.create_data_source(DataSourceSpec(**(SOURCE | changes)))
    assert rule in str(err.value)
    assert local_shoal.list_data_sources() == []


@pytest.mark.parametrize(
    ("changes", "rule"),
    [
        ({"version": None}, "invalid index version None"),
        ({"version": 1}, "invalid index version 1"),
        ({"algorithm": ["flat"]}, "algorithm must be a string, got list"),
        ({"metric": None}, "metric must be a string"),
        ({"source_name": None}, "source_name must be a string"),
        ({"params": None}, "params must be a mapping"),
        ({"id_attributes": None}, "id_attributes must be a list of attribute names"),
        ({"split_attributes": None}, "split_attributes must be a list of attribute names"),
        ({"shard_attributes": "id"}, "shard_attributes must be a list of attribute names, got str"),
        ({"payload_attributes": [{"id"}]}, "payload_attributes must hold attribute names (strings), got set"),
    ],
)
def test_index_spec_of_wrong_types_is_refused(local_shoal: Shoal, changes: dict[str, Any], rule: str) -> None:
    local_shoal.create_data_source(DataSourceSpec(**SOURCE))
    with pytest.raises(ValidationError) as err:
        local_shoal.create_index(IndexSpec(**(INDEX | changes)))
    assert rule in str(err.value)
    assert local_shoal.list_indexes() == []


@pytest.mark.parametrize("batch_id", ["bad\x00id", "\ud800", "", 7])
def test_an_unstorable_batch_id_is_refused_naming_it(local_shoal: Shoal, batch_id: Any) -> None:
    local_shoal.create_data_source(DENSE)
    producer = local_shoal.producer(DENSE.name, DENSE.version)
    with pytest.raises(ValidationError) as err:
        producer.upload([point([0, 1])], batch_id=batch_id)
    assert_refused(err, "batch_id", "batch id must be")
    with pytest.raises(ValidationError) as err:
        producer.upload_columns(V, {"id": [1, 2], "f": [1.0, 1.0]}, batch_id=batch_id)
    assert_refused(err, "batch_id", "batch id must be")
    assert_nothing_written(local_shoal, DENSE)


def test_a_nul_batch_id_never_fails_another_producers_uploads_in_the_same_commit(local_shoal: Shoal) -> None:
    """Two producers of one client share its log writer, and so its group commits: one uploading with a batch
    id Postgres cannot store, the other's uploads are all acknowledged and stored, the bad ones refused."""
    local_shoal.create_data_source(DENSE)
    good = local_shoal.producer(DENSE.name, DENSE.version)
    bad = local_shoal.producer(DENSE.name, DENSE.version)
    done = threading.Event()
    good_errors: list[BaseException] = []
    bad_outcomes: list[BaseException | None] = []
    count = 150

    def upload_good() -> None:
        try:
            for i in range(count):
                try:
                    good.upload([DataPoint({"id": i, "f": 1.0}, [0.0, 1.0])], batch_id=f"good-{i}")
                except Exception as exc:  # noqa: BLE001 - every failure is what the test reports
                    good_errors.append(exc)
        finally:
            done.set()

    def upload_bad() -> None:
        while not done.is_set():
            try:
                bad.upload([DataPoint({"id": -1, "f": 1.0}, [0.0, 1.0])], batch_id="bad\x00id")
                bad_outcomes.append(None)
            except Exception as exc:  # noqa: BLE001
                bad_outcomes.append(exc)

    threads = [threading.Thread(target=upload_good), threading.Thread(target=upload_bad)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert good_errors == []
    assert bad_outcomes
    assert all(isinstance(e, ValidationError) and e.problems[0].attribute == "batch_id" for e in bad_outcomes), (
        {type(e).__name__ for e in bad_outcomes})
    ids = local_shoal.fold(DENSE.name, DENSE.version).column("id").to_pylist()
    assert sorted(ids) == list(range(count))
    assert local_shoal.get_data_source(DENSE.name, DENSE.version).head_seq == count
