"""Bad input gets a clear error naming the point, the attribute and the rule, and writes nothing."""

from __future__ import annotations

import datetime as dt
import uuid
import warnings

import numpy as np
import pytest

from shoal import DataPoint, DataSourceSpec, Shoal, SparseVector, Tombstone
from shoal.errors import BatchTooLargeError, InvalidNameError, NotFoundError, ValidationError

SPEC = DataSourceSpec(
    name="QuickStart.Source",
    version="1.0",
    vector_dimension=3,
    attribute_types={
        "id": "int64",
        "tag": "string",
        "score": "float64",
        "flag": "bool",
        "guid": "guid",
        "at": "datetime",
    },
    permanent_attributes=["id"],
)
SPARSE = DataSourceSpec("Sparse.Source", "1.0", 100, {"id": "int64"}, ["id"], vectors_are_sparse=True)


def good(i: int) -> DataPoint:
    return DataPoint(
        {"id": i, "tag": f"t{i}", "score": 0.5, "flag": True, "guid": uuid.uuid4(), "at": dt.datetime(2024, 1, 1)},
        [0.1, 0.2, 0.3],
    )


def attrs(**changes: object) -> dict[str, object]:
    base = dict(good(1).attributes)
    for k, v in changes.items():
        if v is ...:
            base.pop(k)
        else:
            base[k] = v
    return base


def assert_nothing_written(shoal: Shoal, spec: DataSourceSpec) -> None:
    assert shoal.get_data_source(spec.name, spec.version).head_seq == 0
    assert shoal.log_segments(spec.name, spec.version) == []
    assert shoal.storage.list_files(shoal.log_dir(spec.name, spec.version)) == []


@pytest.mark.parametrize(
    ("bad", "attribute", "rule"),
    [
        (DataPoint(attrs(), [0.1, 0.2]), "vector", "wrong dimension: expected 3, got 2"),
        (DataPoint(attrs(), [0.1, float("nan"), 0.3]), "vector", "must be finite (NaN or infinity at index 1)"),
        (DataPoint(attrs(), [0.1, float("inf"), 0.3]), "vector", "must be finite (NaN or infinity at index 1)"),
        (DataPoint(attrs(), [6e18, -6e18, 6e18]), "vector", "vector norm 1.039e+19 is past the largest allowed"),
        # Finite as sent, infinite as float32: the error says which, not "NaN or infinity".
        (DataPoint(attrs(), [0.1, 0.2, -1e39]), "vector", "-1e+39 at index 2 is past float32's range"),
        (DataPoint(attrs(tag=...), [0, 0, 0]), "tag", "missing attribute"),
        (DataPoint(attrs(extra=1), [0, 0, 0]), "extra", "unknown attribute"),
        (DataPoint(attrs(id="7"), [0, 0, 0]), "id", "expected int64, got str"),
        (DataPoint(attrs(id=True), [0, 0, 0]), "id", "expected int64, got bool"),
        (DataPoint(attrs(flag=1), [0, 0, 0]), "flag", "expected bool, got int"),
        (DataPoint(attrs(score="x"), [0, 0, 0]), "score", "expected float64, got str"),
        (DataPoint(attrs(score=float("nan")), [0, 0, 0]), "score", "float64 value must be finite"),
        (DataPoint(attrs(guid="not-a-guid"), [0, 0, 0]), "guid", "not a guid"),
        (DataPoint(attrs(at="2024-01-01"), [0, 0, 0]), "at", "expected datetime, got str"),
        (DataPoint(attrs(tag=None), [0, 0, 0]), "tag", "value is missing"),
        # Escaped in JSON, a lone surrogate reaches Python; UTF-8 (Arrow, Parquet) cannot hold it.
        (DataPoint(attrs(tag="a\ud800"), [0, 0, 0]), "tag", "a lone surrogate (such as \\ud800) cannot be stored"),
        (Tombstone({"id": 1, "tag": "x"}), "tag", "a tombstone carries only the permanent (key) attributes"),
        (Tombstone({}), "id", "missing key attribute"),
    ],
)
def test_bad_point_is_rejected_naming_position_attribute_and_rule(
    local_shoal: Shoal, bad: DataPoint | Tombstone, attribute: str, rule: str
) -> None:
    local_shoal.create_data_source(SPEC)
    producer = local_shoal.producer(SPEC.name, SPEC.version)
    with pytest.raises(ValidationError) as err:
        producer.upload([good(1), good(2), bad, good(4)])
    problem = err.value.problems[0]
    assert (problem.position, problem.attribute) == (2, attribute)
    assert rule in problem.rule
    assert f"point 2, attribute '{attribute}'" in str(err.value)
    assert_nothing_written(local_shoal, SPEC)


def test_every_problem_of_a_batch_is_reported(local_shoal: Shoal) -> None:
    local_shoal.create_data_source(SPEC)
    producer = local_shoal.producer(SPEC.name, SPEC.version)
    with pytest.raises(ValidationError) as err:
        producer.upload([DataPoint(attrs(id="x"), [1, 2]), good(1), DataPoint(attrs(tag=...), [0, 0, 0])])
    where = {(p.position, p.attribute) for p in err.value.problems}
    assert where == {(0, "id"), (0, "vector"), (2, "tag")}
    assert_nothing_written(local_shoal, SPEC)


@pytest.mark.parametrize(
    ("vector", "rule"),
    [
        (SparseVector([1, 5, 1], [0.1, 0.2, 0.3]), "repeats an index"),
        (SparseVector([1, 100], [0.1, 0.2]), "out of range 0..99"),
        (SparseVector([1, 2], [0.1]), "as many values as indices"),
        (SparseVector([1], [float("nan")]), "must be finite"),
        (SparseVector([1, 2], [0.5, 4e38]), "4e+38 at index 1 is past float32's range"),
        (SparseVector([1, 2], [1e19, 1e19]), "vector norm 1.414e+19 is past the largest allowed"),
        ([0.0] * 100, "give a SparseVector"),
    ],
)
def test_bad_sparse_vector(local_shoal: Shoal, vector: object, rule: str) -> None:
    local_shoal.create_data_source(SPARSE)
    producer = local_shoal.producer(SPARSE.name, SPARSE.version)
    with pytest.raises(ValidationError) as err:
        producer.upload([DataPoint({"id": 1}, SparseVector([0], [1.0])), DataPoint({"id": 2}, vector)])  # type: ignore[arg-type]
    assert (err.value.problems[0].position, err.value.problems[0].attribute) == (1, "vector")
    assert rule in err.value.problems[0].rule
    assert_nothing_written(local_shoal, SPARSE)


def test_columnar_batch_errors_name_the_row(local_shoal: Shoal) -> None:
    local_shoal.create_data_source(SPEC)
    producer = local_shoal.producer(SPEC.name, SPEC.version)
    n = 50
    vectors = np.ones((n, 3), dtype=np.float32)
    vectors[17, 1] = np.inf
    columns = {
        "id": np.arange(n),
        "tag": ["x"] * n,
        "score": np.full(n, 0.5),
        "flag": np.ones(n, dtype=bool),
        "guid": [str(uuid.uuid4()) for _ in range(n)],
        "at": [dt.datetime(2024, 1, 1, tzinfo=dt.UTC)] * n,
    }
    with pytest.raises(ValidationError) as err:
        producer.upload_columns(vectors, columns)
    assert [(p.position, p.attribute) for p in err.value.problems] == [(17, "vector")]
    assert "NaN or infinity at index 1" in err.value.problems[0].rule
    # float64 vectors past float32's range are named as such, with no overflow warning on the way.
    wide = np.ones((n, 3))
    wide[23, 2] = 1e39
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValidationError) as err:
            producer.upload_columns(wide, columns)
    assert [(p.position, p.attribute) for p in err.value.problems] == [(23, "vector")]
    assert "1e+39 at index 2 is past float32's range" in err.value.problems[0].rule
    with pytest.raises(ValidationError, match="wrong dimension"):
        producer.upload_columns(np.ones((n, 4), dtype=np.float32), columns)
    with pytest.raises(ValidationError, match="'tag': column has 49 values, expected 50"):
        producer.upload_columns(np.ones((n, 3)), columns | {"tag": ["x"] * 49})
    with pytest.raises(ValidationError) as err:
        producer.upload_columns(np.ones((n, 3)), columns | {"tag": ["x"] * 10 + [5] + ["x"] * 39})
    assert [(p.position, p.attribute) for p in err.value.problems] == [(10, "tag")]
    # Strings UTF-8 cannot encode (lone surrogates) are named, each at its row; it was a UnicodeEncodeError.
    with pytest.raises(ValidationError) as err:
        tags = ["x"] * 3 + ["\udc00"] + ["é"] * 40 + ["b\ud800"] * 6
        producer.upload_columns(np.ones((n, 3)), columns | {"tag": tags})
    assert [(p.position, p.attribute) for p in err.value.problems] == [(3, "tag"), *((i, "tag") for i in range(44, 50))]
    assert "lone surrogate" in err.value.problems[0].rule
    assert_nothing_written(local_shoal, SPEC)


def test_batch_over_the_configured_size(make_settings) -> None:  # type: ignore[no-untyped-def]
    with Shoal(make_settings(max_batch_points=10)) as shoal:
        shoal.create_data_source(SPEC)
        producer = shoal.producer(SPEC.name, SPEC.version)
        with pytest.raises(BatchTooLargeError, match="11 points, more than the configured maximum 10"):
            producer.upload([good(i) for i in range(11)])
        with pytest.raises(BatchTooLargeError):
            producer.upload_columns(np.zeros((11, 3)), {k: [v] * 11 for k, v in good(1).attributes.items()})
        with pytest.raises(ValidationError, match="batch is empty"):
            producer.upload([])
        assert_nothing_written(shoal, SPEC)
        assert producer.upload([good(i) for i in range(10)]).seq == 10


def test_unknown_data_source(local_shoal: Shoal) -> None:
    with pytest.raises(NotFoundError, match="'Nope' version '1.0' not found"):
        local_shoal.producer("Nope", "1.0")
    with pytest.raises(NotFoundError):
        local_shoal.get_data_source("Nope", "1.0")


@pytest.mark.parametrize(
    ("name", "version"),
    [("..", "1.0"), ("../etc", "1.0"), ("a/b", "1.0"), ("ok", ".."), (".hidden", "1"), ("", "1"),
     ("x" * 101, "1"), ("ok", "1/../../x"), ("sp ace", "1"), ("ok", "1\\2")],
)
def test_names_that_could_escape_the_storage_root_are_refused(local_shoal: Shoal, name: str, version: str) -> None:
    with pytest.raises(InvalidNameError, match="must match"):
        DataSourceSpec(name, version, 3, {"id": "int64"}, ["id"])
    with pytest.raises(InvalidNameError):
        local_shoal.get_data_source(name, version)
    assert local_shoal.list_data_sources() == []


def test_vektonn_names_are_accepted(local_shoal: Shoal) -> None:
    record = local_shoal.create_data_source(SPEC)
    assert (record.spec.name, record.spec.version) == ("QuickStart.Source", "1.0")
    assert local_shoal.get_data_source("QuickStart.Source", "1.0").spec == SPEC


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"permanent_attributes": []}, "permanent attributes must not be empty"),
        ({"permanent_attributes": ["missing"]}, "permanent attribute has no attribute value type"),
        ({"vector_dimension": 0}, "vector dimension must be an integer in 1..10000"),
        ({"vector_dimension": 10_001}, "vector dimension must be an integer in 1..10000"),
        ({"attribute_types": {"id": "int32"}}, "unknown attribute type"),
        ({"attribute_types": {"id": "int64", "__op": "string"}}, "attribute name must match"),
    ],
)
def test_data_source_consistency_rules(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {
        "name": "S", "version": "1", "vector_dimension": 3,
        "attribute_types": {"id": "int64"}, "permanent_attributes": ["id"],
    }
    with pytest.raises(ValidationError, match=message):
        DataSourceSpec(**(base | kwargs))  # type: ignore[arg-type]


def test_vectors_too_long_for_float32_distances_are_refused_and_those_at_the_bound_searched_exactly(
    local_shoal: Shoal,
) -> None:
    """Finite coordinates can still make a vector whose distances overflow float32 (hnswlib ranked such vectors
    wrongly; faiss's k-means aborted the process): a norm past MAX_NORM is refused on upload, in columns as in
    points, and as a query; vectors at the bound are stored and every engine ranks them as float64 brute force."""
    from shoal.index.builder import ShardBuilder
    from shoal.log.records import IndexSpec
    from shoal.log.validation import MAX_NORM

    spec = DataSourceSpec("Long.Source", "1", 3, {"id": "int64"}, ["id"])
    local_shoal.create_data_source(spec)
    producer = local_shoal.producer(spec.name, spec.version)
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((60, 3))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    vectors[:20] *= MAX_NORM * 0.999
    too_long = vectors.copy()
    too_long[41] *= 3 * MAX_NORM
    with pytest.raises(ValidationError) as err:
        producer.upload_columns(too_long.astype(np.float32), {"id": np.arange(60)})
    assert [(p.position, p.attribute) for p in err.value.problems] == [(41, "vector")]
    assert "vector norm" in err.value.problems[0].rule
    assert_nothing_written(local_shoal, spec)

    producer.upload_columns(vectors.astype(np.float32), {"id": np.arange(60)})
    stored = vectors.astype(np.float32).astype(np.float64)
    queries = np.concatenate([stored[:3], -stored[5:6], stored[30:32]])
    for algorithm, metric in [("flat", "euclidean"), ("hnsw", "euclidean"), ("hnsw", "dot_product"),
                              ("hnsw", "cosine"), ("ivf", "euclidean"), ("ivf", "dot_product"), ("ivf", "cosine")]:
        name = f"Long.{algorithm}.{metric}"
        params = {"nlist": 4, "nprobe": 4} if algorithm == "ivf" else {}
        local_shoal.create_index(IndexSpec(name, "1", spec.name, spec.version, algorithm=algorithm, metric=metric,
                                           params=params))
        builder = ShardBuilder(local_shoal.engine, local_shoal.storage)
        for shard in local_shoal.get_index(name, "1").shards:
            builder.materialize(shard.id)
        searcher = local_shoal.searcher(follow=False)
        try:
            for q in queries:
                if metric == "euclidean":
                    exact = np.linalg.norm(stored - q, axis=1)
                elif metric == "dot_product":
                    exact = -(stored @ q)
                else:
                    exact = 1 - (stored @ q) / (np.linalg.norm(stored, axis=1) * np.linalg.norm(q))
                hits = searcher.search(name, "1", q.astype(np.float32)[None, :], 3)[0]
                got = exact[[h.attributes["id"] for h in hits]]  # ties may come in any order: compare distances
                assert np.allclose(got, np.sort(exact)[:3], rtol=1e-5, atol=1e-6), (name, got, np.sort(exact)[:3])
            with pytest.raises(ValidationError, match="vector norm"):
                searcher.search(name, "1", np.array([[1e19, 1e19, 0]], dtype=np.float32), 3)
        finally:
            searcher.close()


def test_an_ivf_build_over_vectors_too_long_raises_instead_of_aborting_the_process() -> None:
    """Vectors written before the intake bounded norms must not take the worker down: faiss's k-means aborts
    (SIGABRT) on them, so the build refuses them first. Run in a child process, which an abort would kill."""
    import subprocess
    import sys

    code = (
        "import numpy as np\n"
        "from shoal.engines.base import get_engine\n"
        "from shoal.errors import ValidationError\n"
        "v = np.random.default_rng(0).standard_normal((200, 4)).astype(np.float32)\n"
        "v[7] = [1e20, 0, 0, 0]\n"
        "try:\n"
        "    get_engine('ivf').build(v, 'euclidean', {'nlist': 8})\n"
        "except ValidationError as exc:\n"
        "    print('refused:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: " in done.stdout and "row 7" in done.stdout and "vector norm" in done.stdout, done.stdout
