"""Bulk import through the Python API (shoal.intake.bulk), against a real Postgres and local storage.

Planning reads only files, so its checks run without a catalog; every upload test works in its own tenant.
"""

from __future__ import annotations

import datetime as dt
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.errors import BatchTooLargeError, ValidationError
from shoal.intake.bulk import (
    BatchOutcome,
    default_batch_prefix,
    plan_import,
    read_batches,
    run_import,
)

DIM = 8
SPEC = DataSourceSpec(
    name="items",
    version="1",
    vector_dimension=DIM,
    attribute_types={
        "id": "int64", "name": "string", "score": "float64", "at": "datetime", "flag": "bool", "ref": "guid",
    },  # type: ignore[arg-type]
    permanent_attributes=["id"],
)
KEYED = DataSourceSpec(name="keyed", version="1", vector_dimension=DIM, attribute_types={"id": "int64"},  # type: ignore[arg-type]
                       permanent_attributes=["id"])
START = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)


def vectors16(n: int, seed: int = 0) -> np.ndarray:
    """n random float16 vectors: values a float32 holds exactly, so a round trip compares equal."""
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float16)


def items_file(path: Path, n: int, *, row_group_size: int = 13) -> tuple[np.ndarray, list[str]]:
    """A Parquet file in types a data frame library would write: int32 ids, dictionary strings, int32 scores,
    millisecond timestamps, upper-case guids, float16 vectors in column `emb`, plus an extra column."""
    vectors = vectors16(n)
    refs = [str(uuid.UUID(int=i + 1)).upper() for i in range(n)]
    table = pa.table({
        "id": pa.array(range(n), pa.int32()),
        "name": pa.array([f"item-{i % 7}" for i in range(n)]).dictionary_encode(),
        "score": pa.array([i * 3 for i in range(n)], pa.int32()),
        "at": pa.array([START + dt.timedelta(seconds=i) for i in range(n)], pa.timestamp("ms", tz="UTC")),
        "flag": pa.array([i % 2 == 0 for i in range(n)]),
        "ref": pa.array(refs),
        "extra": pa.array(["ignored"] * n),
        "emb": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float16()), DIM),
    })
    pq.write_table(table, path, row_group_size=row_group_size)
    return vectors, refs


def keyed_files(folder: Path, n: int) -> tuple[Path, Path, np.ndarray]:
    """A .npy file of float16 vectors and a Parquet file whose `key` column holds the ids."""
    vectors = vectors16(n, seed=1)
    npy, attrs = folder / "vectors.npy", folder / "attrs.parquet"
    np.save(npy, vectors)
    pq.write_table(pa.table({"key": pa.array(range(n), pa.int64())}), attrs, row_group_size=9)
    return npy, attrs, vectors


def fold_vectors(state: pa.Table) -> np.ndarray:
    return np.asarray(state["__vector"].combine_chunks().flatten().to_numpy(), dtype=np.float32).reshape(-1, DIM)


def head(client: Shoal, spec: DataSourceSpec) -> int:
    return client.get_data_source(spec.name, spec.version).head_seq


# -- uploading ------------------------------------------------------------------------------------------


def test_parquet_import_converts_columns_and_a_rerun_writes_nothing(local_shoal: Shoal, tmp_path: Path) -> None:
    path = tmp_path / "items.parquet"
    vectors, refs = items_file(path, 95)
    local_shoal.create_data_source(SPEC)

    plan = plan_import(SPEC, path, vectors_column="emb")
    assert plan.rows == 95 and plan.vector_column == "emb" and plan.attributes_path is None
    assert dict(plan.columns) == {a: a for a in SPEC.attribute_types}  # `extra` is ignored
    assert plan.batch_prefix == default_batch_prefix(path)

    seen: list[BatchOutcome] = []
    result = run_import(local_shoal.producer("items", "1"), plan, 20, on_batch=seen.append)
    # Batches of exactly 20 whatever the file's row groups (13): ids depend on the bounds only.
    assert [(o.offset, o.points, o.written) for o in seen] == [(0, 20, True), (20, 20, True), (40, 20, True),
                                                               (60, 20, True), (80, 15, True)]
    assert [o.batch_id for o in seen][-1] == f"{plan.batch_prefix}:80+15"
    assert (result.points, result.new_points, result.batches, result.skipped_batches) == (95, 95, 5, 0)
    assert result.token is not None and result.token.seq == 95 and result.seconds > 0

    state = local_shoal.fold("items", "1")
    assert state["id"].to_pylist() == list(range(95))
    assert state["name"].to_pylist() == [f"item-{i % 7}" for i in range(95)]
    assert state["score"].to_pylist() == [float(i * 3) for i in range(95)]
    assert state["at"].to_pylist()[1] == START + dt.timedelta(seconds=1)
    assert state["flag"].to_pylist()[:3] == [True, False, True]
    assert state["ref"].to_pylist() == [r.lower() for r in refs]  # guids stored canonical
    np.testing.assert_array_equal(fold_vectors(state), vectors.astype(np.float32))

    again = run_import(local_shoal.producer("items", "1"), plan, 20)
    assert (again.points, again.new_points, again.skipped_batches, again.skipped_points) == (95, 0, 5, 95)
    assert again.token == result.token
    assert head(local_shoal, SPEC) == 95


def test_npy_import_with_limit_then_a_changed_limit_or_batch_size(local_shoal: Shoal, tmp_path: Path) -> None:
    npy, attrs, vectors = keyed_files(tmp_path, 60)
    local_shoal.create_data_source(KEYED)

    def run(limit: int, size: int) -> tuple[int, int, int]:
        plan = plan_import(KEYED, npy, attributes=attrs, attr_map={"key": "id"}, limit=limit)
        result = run_import(local_shoal.producer("keyed", "1"), plan, size)
        return result.points, result.new_points, result.skipped_batches

    assert run(25, 10) == (25, 25, 0)  # batches 0+10, 10+10, 20+5
    assert run(25, 10) == (25, 0, 3)
    assert head(local_shoal, KEYED) == 25
    # A larger limit: the first two batches match and are skipped; 20+10 is a new id and is written.
    assert run(30, 10) == (30, 10, 2)
    assert head(local_shoal, KEYED) == 35
    state = local_shoal.fold("keyed", "1")
    assert sorted(state["id"].to_pylist()) == list(range(30))  # rows 20..24 twice: the last write wins
    np.testing.assert_array_equal(fold_vectors(state.sort_by("id")), vectors[:30].astype(np.float32))
    # Another batch size makes other ids: everything is written again (same state, longer log).
    assert run(30, 25) == (30, 30, 0)
    assert head(local_shoal, KEYED) == 65 and local_shoal.fold("keyed", "1").num_rows == 30
    # Limit 0 plans nothing and uploads nothing.
    assert run(0, 10) == (0, 0, 0)


def test_a_bad_batch_names_the_file_row_and_earlier_batches_stay(local_shoal: Shoal, tmp_path: Path) -> None:
    path = tmp_path / "items.parquet"
    items_file(path, 40)
    table = pq.read_table(path)
    emb = table["emb"].combine_chunks()
    values = np.asarray(emb.flatten().to_numpy(zero_copy_only=False), dtype=np.float32)
    values[25 * DIM + 3] = np.nan
    bad = tmp_path / "bad.parquet"
    pq.write_table(table.set_column(7, "emb", pa.FixedSizeListArray.from_arrays(pa.array(values), DIM)), bad)
    local_shoal.create_data_source(SPEC)

    with pytest.raises(ValidationError) as caught:
        run_import(local_shoal.producer("items", "1"), plan_import(SPEC, bad, vectors_column="emb"), 10)
    assert [p.position for p in caught.value.problems] == [25]
    message = str(caught.value)
    assert message.startswith("bad.parquet, batch at row 20: ") and "finite" in message
    assert "20 rows before row 20 were imported" in message
    assert head(local_shoal, SPEC) == 20

    # A problem found while reading (a null vector in a list column) is counted in file rows too.
    lists = pa.array([[0.5] * DIM if i != 13 else None for i in range(40)], pa.list_(pa.float64()))
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(table.drop_columns(["emb"]).append_column("vector", lists), nulls)
    with pytest.raises(ValidationError) as caught:
        run_import(local_shoal.producer("items", "1"), plan_import(SPEC, nulls), 10)
    assert [p.position for p in caught.value.problems] == [13] and "missing" in str(caught.value)

    # A float64 coordinate past float32's range is named as such, with no overflow warning on the way (the read
    # cast it to infinity, which the upload then called "NaN or infinity").
    wide = pa.array([[0.5] * DIM if i != 31 else [0.5] * 5 + [-3e40, 0.5, 0.5] for i in range(40)],
                    pa.list_(pa.float64()))
    huge = tmp_path / "huge.parquet"
    pq.write_table(table.drop_columns(["emb"]).append_column("vector", wide), huge)
    before = head(local_shoal, SPEC)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValidationError) as caught:
            run_import(local_shoal.producer("items", "1"), plan_import(SPEC, huge), 10)
    assert [p.position for p in caught.value.problems] == [31]
    assert "-3e+40 at index 5 is past float32's range" in str(caught.value)
    assert "30 rows before row 30 were imported" in str(caught.value) and head(local_shoal, SPEC) == before + 30


def test_run_import_refuses_another_definition_and_bad_batch_sizes(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    npy, attrs, _ = keyed_files(tmp_path, 5)
    plan = plan_import(KEYED, npy, attributes=attrs, attr_map={"key": "id"})
    with Shoal(make_settings("local", max_batch_points=3)) as client:
        client.create_data_source(SPEC)
        client.create_data_source(KEYED)
        with pytest.raises(ValidationError, match="another definition"):
            run_import(client.producer("items", "1"), plan)
        with pytest.raises(ValidationError, match="batch size"):
            run_import(client.producer("keyed", "1"), plan, 0)
        with pytest.raises(BatchTooLargeError, match="more than the configured maximum 3"):  # the class is kept
            run_import(client.producer("keyed", "1"), plan, 5)
        assert head(client, KEYED) == 0


# -- planning and reading (no catalog) -----------------------------------------------------------------


def test_read_batches_ignores_row_groups_and_widens_vectors(tmp_path: Path) -> None:
    path = tmp_path / "items.parquet"
    vectors, _ = items_file(path, 50, row_group_size=7)
    plan = plan_import(SPEC, path, vectors_column="emb", limit=33, batch_prefix="mine")
    batches = list(read_batches(plan, 10))
    assert [(b.offset, len(b.vectors)) for b in batches] == [(0, 10), (10, 10), (20, 10), (30, 3)]
    assert all(b.vectors.dtype == np.float32 for b in batches)
    np.testing.assert_array_equal(np.vstack([b.vectors for b in batches]), vectors[:33].astype(np.float32))
    assert batches[0].attributes["id"].type == pa.int64() and batches[0].attributes["score"].type == pa.float64()
    assert batches[0].attributes["name"].type == pa.string()
    assert plan.batch_id(30, 3) == "mine:30+3"


def test_default_batch_prefix_follows_the_files(tmp_path: Path) -> None:
    npy, attrs, _ = keyed_files(tmp_path, 5)
    prefix = default_batch_prefix(npy, attrs)
    assert prefix.startswith("import:vectors.npy:") and ":attrs.parquet:" in prefix
    np.save(npy, vectors16(6))  # a changed file has another size, hence other batch ids
    assert default_batch_prefix(npy, attrs) != prefix


def test_plan_rejects_what_does_not_fit(tmp_path: Path) -> None:
    path = tmp_path / "items.parquet"
    items_file(path, 10)
    npy, attrs, _ = keyed_files(tmp_path, 10)

    def refused(match: str, *args: object, **kwargs: object) -> None:
        with pytest.raises(ValidationError, match=match):
            plan_import(*args, **kwargs)  # type: ignore[arg-type]

    refused("no vector column 'vector'", SPEC, path)
    refused(r"no column for attribute\(s\) id", KEYED, npy, attributes=attrs)
    refused("has no attribute 'nope'", KEYED, npy, attributes=attrs, attr_map={"key": "nope"})
    refused("has no column 'nope'", KEYED, npy, attributes=attrs, attr_map={"nope": "id"})
    refused("8-d vectors; the data source is 4-d",
            DataSourceSpec("four", "1", 4, SPEC.attribute_types, ["id"]), path, vectors_column="emb")
    refused("must be a list of numbers", SPEC, path, vectors_column="name")
    refused("give the Parquet file of attributes", KEYED, npy)
    refused("only for Parquet files", KEYED, npy, attributes=attrs, vectors_column="emb")
    refused("only with a .npy file", SPEC, path, attributes=attrs)
    refused("limit must not be negative", KEYED, npy, attributes=attrs, limit=-1)
    sparse = DataSourceSpec("sp", "1", DIM, {"id": "int64"}, ["id"], vectors_are_sparse=True)  # type: ignore[arg-type]
    refused("dense data sources only", sparse, path)

    np.save(tmp_path / "flat.npy", np.zeros(DIM, dtype=np.float32))
    refused(r"shape \[8\]; expected \[n, 8\]", KEYED, tmp_path / "flat.npy", attributes=attrs)
    np.save(tmp_path / "short.npy", vectors16(4))
    refused("row i must belong to vector i", KEYED, tmp_path / "short.npy", attributes=attrs)
    (tmp_path / "junk.parquet").write_text("not parquet")
    refused("cannot read junk.parquet", SPEC, tmp_path / "junk.parquet")
