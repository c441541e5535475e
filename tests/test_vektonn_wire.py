"""shoal.vektonn.wire against the DTO path it replaces: the same tables, the same errors, the same response bytes.

The old path is what the HTTP routes did before: FastAPI parsed the body with Python's json and validated it with
the pydantic DTOs (python mode), tests/helpers/dto_path.py made records, batch.points_to_table made the table; search
results go through hit_dto/vector_dto and FastAPI's dump_json(by_alias=True, exclude_none=True).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pydantic
import pytest
from helpers import dto_path as convert_module
from helpers.dto_path import hit_dto, points_from_dtos, vector_dto
from helpers.dto_path import query_vectors as old_query_vectors
from helpers.dto_path import split_filter as old_split_filter
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shoal.vektonn import dto as dto_module
from shoal.vektonn.dto import InputDataPointOrTombstoneDto, SearchQueryDto, SearchResultDto
from shoal.errors import BatchTooLargeError, Problem, ValidationError
from shoal.log.validation import ARROW_TYPES, SPARSE_INDICES, SPARSE_VALUES, VECTOR, points_to_table
from shoal.intake import codec
from shoal.log.records import AttributeType, DataPoint, DataSourceSpec, SparseVector, Tombstone
from shoal.searcher.hits import Hit, Hits, RowSource
from shoal.vektonn import wire
from shoal.vektonn.wire import (
    EmptyUploadError,
    SearchQuery,
    UploadBodyError,
    decode_arrow_upload,
    decode_search,
    decode_upload,
    encode_search_results,
    query_vectors,
    split_filter,
)

SHARED_DATA = Path(os.environ.get("SHOAL_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"
                                  / "debian-packages"))
EXAMPLES = int(os.environ.get("SHOAL_WIRE_EXAMPLES", "150"))
# Derandomised (the same examples on every run) unless SHOAL_WIRE_RANDOM is set, to explore further.
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    derandomize="SHOAL_WIRE_RANDOM" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

_DTOS = pydantic.TypeAdapter(list[InputDataPointOrTombstoneDto])
_RESULTS = pydantic.TypeAdapter(list[SearchResultDto])

ALL_TYPES = DataSourceSpec(
    "All.Types", "1", 3,
    {"id": "int64", "tag": "string", "score": "float64", "flag": "bool", "uid": "guid", "at": "datetime"},
    ["id", "uid"],
)
SPARSE = DataSourceSpec("Sparse", "1", 6, {"id": "int64", "tag": "string"}, ["id"], vectors_are_sparse=True)


# -- the old path -----------------------------------------------------------------------------------------------


def old_upload(spec: DataSourceSpec, body: bytes, max_points: int) -> pa.Table:
    """What POST /upload did: json.loads, the DTOs in python mode (FastAPI), points_from_dtos, points_to_table."""
    return points_to_table(spec, points_from_dtos(spec, _DTOS.validate_python(json.loads(body))), max_points)


def outcome(call: Any) -> tuple[str, Any]:
    """('table', table) | ('shape', positions of DTO errors) | ('rules', (error type, problems))."""
    try:
        return "table", call()
    except pydantic.ValidationError as exc:
        return "shape", {e["loc"][0] for e in exc.errors()}
    except ValidationError as exc:
        return "rules", (type(exc), exc.problems)


def assert_same_upload(spec: DataSourceSpec, body: bytes, max_points: int) -> tuple[str, Any]:
    old_kind, old = outcome(lambda: old_upload(spec, body, max_points))
    try:
        new: Any = decode_upload(spec, body, max_points)
    except ValidationError as exc:
        assert old_kind != "table", f"old path accepted, new refused: {exc}"
        if old_kind == "shape":
            # The DTOs' errors become problems naming the same points.
            assert {p.position for p in exc.problems} == old, (exc.problems, old)
        else:
            old_type, old_problems = old
            assert isinstance(exc, old_type)
            assert exc.problems == old_problems
        return old_kind, exc
    assert old_kind == "table", f"old path refused ({old}), new accepted"
    assert new.schema.equals(old.schema, check_metadata=True)
    assert new.equals(old)
    return old_kind, new


# -- generated batches ------------------------------------------------------------------------------------------

_CASES = (str, str.lower, str.upper, lambda k: k[:1].upper() + k[1:])


@st.composite
def odd_case(draw: st.DrawFn, key: str) -> str:
    """Vektonn matches keys ignoring case: mostly as written, sometimes not."""
    if draw(st.integers(0, 4)):
        return key
    return draw(st.sampled_from(_CASES))(key)


def json_datetime(draw: st.DrawFn) -> str:
    moment = draw(st.datetimes(min_value=dt.datetime(1970, 1, 2), max_value=dt.datetime(2200, 1, 1)))
    style = draw(st.integers(0, 4))
    if style == 0:
        return moment.isoformat()  # naive: taken as UTC
    if style == 1:
        return moment.date().isoformat()  # a date alone: midnight, as pydantic reads it
    if style == 2:
        return moment.replace(tzinfo=dt.UTC).isoformat().replace("+00:00", "Z")
    offset = dt.timedelta(minutes=draw(st.integers(-14 * 60, 14 * 60)))
    return moment.replace(tzinfo=dt.timezone(offset)).isoformat()


def json_guid(draw: st.DrawFn) -> str:
    value = draw(st.uuids(allow_nil=True))
    return draw(st.sampled_from([str(value), str(value).upper(), value.hex, "{" + str(value) + "}", value.urn]))


def good_value(draw: st.DrawFn, kind: AttributeType) -> Any:
    rare = draw(st.integers(0, 15)) == 0
    if kind is AttributeType.INT64:  # now and then beyond int64 (orjson reads those as floats)
        return draw(st.integers(-(2**70), 2**70) if rare else st.integers(-(2**63), 2**63 - 1))
    if kind is AttributeType.FLOAT64:  # now and then NaN or infinity (which only Python's json writes)
        return draw(st.floats() if rare else st.floats(allow_nan=False, allow_infinity=False) | st.integers())
    if kind is AttributeType.BOOL:
        return draw(st.booleans())
    if kind is AttributeType.STRING:
        return draw(st.text(max_size=8))
    if kind is AttributeType.GUID:
        return json_guid(draw)
    return json_datetime(draw)


# JSON values that the DTOs refuse in each slot too (the lax coercions the DTOs made are not generated here).
_REFUSED = {
    "string": [5, True, 1.5, ["x"], {"a": 1}],
    "guid": [5, "not-a-guid", "1234-5678123456781234567812345678", [1]],
    "bool": ["maybe", 2, 0.5, [True], {}],
    "int64": ["x", 1.5, [1], {"a": 1}],
    "float64": ["x", [1.0], {"a": 1}],
    "dateTime": ["not a date", True, [1], "2024-13-40"],
}


@st.composite
def attribute_value(draw: st.DrawFn, kind: AttributeType) -> dict[str, Any]:
    slot = wire.SLOT[kind]
    mutation = draw(st.integers(0, 100))
    if mutation == 0:  # another type's slot
        other = draw(st.sampled_from([t for t in AttributeType if t is not kind]))
        return {draw(odd_case(wire.SLOT[other])): good_value(draw, other)}
    if mutation == 1:  # a JSON value the slot refuses
        return {slot: draw(st.sampled_from(_REFUSED[slot]))}
    if mutation == 2:  # two slots, or none
        return draw(st.sampled_from([{slot: good_value(draw, kind), "string": "x", "int64": 1}, {}, {slot: None}]))
    if mutation == 3:
        return {slot: None, "string": "x"} if kind is not AttributeType.STRING else {"bool_": True}
    return {draw(odd_case(slot)): good_value(draw, kind)}


@st.composite
def vector(draw: st.DrawFn, spec: DataSourceSpec) -> dict[str, Any] | None:
    dim = spec.vector_dimension
    sparse = spec.vectors_are_sparse if draw(st.integers(0, 60)) else not spec.vectors_are_sparse
    mutation = draw(st.integers(0, 60))
    coordinate = st.floats(-1e6, 1e6, width=32) | st.integers(-1000, 1000)
    if mutation == 0:
        coordinate = st.sampled_from([float("nan"), float("inf"), 1e39, -1e300, 2**64 + 1, True])
    out: dict[str, Any]
    if sparse:
        count = draw(st.integers(0, dim))
        indices = draw(st.lists(st.integers(0, dim - 1), min_size=count, max_size=count, unique=mutation != 1))
        if mutation == 2:
            indices = [*indices, dim]
        values = draw(st.lists(coordinate, min_size=len(indices), max_size=len(indices)))
        out = {"isSparse": True, "coordinates": values}
        if mutation != 3:
            out["coordinateIndices"] = indices
    else:
        length = dim if mutation != 4 else draw(st.integers(0, dim + 2))
        out = {"coordinates": draw(st.lists(coordinate, min_size=length, max_size=length))}
        if draw(st.booleans()):
            out["isSparse"] = False
        if mutation == 5:
            out["coordinates"] = [*out["coordinates"][:-1], draw(st.sampled_from(["x", None, [1.0]]))]
    if mutation == 6:
        out = {"isSparse": "maybe", "coordinates": out["coordinates"]}
    if mutation == 7:
        return draw(st.sampled_from([None, 5, [1.0], {"isSparse": False}]))  # type: ignore[return-value]
    return {draw(odd_case(k)): v for k, v in out.items()}


@st.composite
def data_point(draw: st.DrawFn, spec: DataSourceSpec) -> Any:
    deleted = draw(st.integers(0, 3)) == 0
    # A tombstone carrying every attribute (as Vektonn clients send them) is refused by points_to_table today.
    names = list(spec.permanent_attributes if deleted and draw(st.integers(0, 5)) else spec.attribute_types)
    mutation = draw(st.integers(0, 60))
    if mutation == 0 and names:
        names.remove(draw(st.sampled_from(names)))  # missing attribute
    if mutation == 1:
        names.append("unknown")
    if mutation == 2 and names:
        names.append(names[0])  # given twice
    attributes = []
    for name in draw(st.permutations(names)):
        kind = spec.attribute_types.get(name, AttributeType.STRING)
        attributes.append({draw(odd_case("key")): name, draw(odd_case("value")): draw(attribute_value(kind))})
    item: dict[str, Any] = {draw(odd_case("attributes")): attributes}
    with_vector = (not deleted) != (mutation == 3)  # a tombstone with a vector, an upsert without one
    if with_vector:
        item[draw(odd_case("vector"))] = draw(vector(spec))
    if deleted or draw(st.booleans()):
        item[draw(odd_case("isDeleted"))] = deleted
    if mutation == 4:
        item["isDeleted"] = draw(st.sampled_from(["maybe", 2, None, [True]]))
    if mutation == 5:
        item["attributes"] = draw(st.sampled_from([None, {}, "x", [1], [{"key": "id"}], [{"value": {"int64": 1}}]]))
    if mutation == 6:
        item["extra"] = draw(st.sampled_from([True, {"true": False}, "false"]))  # ignored, as the DTO ignores it
    return item


@st.composite
def source_spec(draw: st.DrawFn) -> DataSourceSpec:
    if draw(st.integers(0, 2)) == 0:
        return draw(st.sampled_from([ALL_TYPES, SPARSE]))
    names = draw(st.lists(st.sampled_from(["id", "tag", "score", "flag", "uid", "at", "Name.x", "k_2"]),
                          min_size=1, max_size=6, unique=True))
    types = {name: draw(st.sampled_from(list(AttributeType))) for name in names}
    permanent = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    return DataSourceSpec("S", "1", draw(st.integers(1, 5)), types, permanent, vectors_are_sparse=draw(st.booleans()))


@st.composite
def upload(draw: st.DrawFn) -> tuple[DataSourceSpec, bytes, int]:
    spec = draw(source_spec())
    items = draw(st.lists(data_point(spec), max_size=8))
    # Python's json writes NaN, Infinity and integers of any size, as a client may send them.
    return spec, json.dumps(items).encode(), draw(st.integers(1, 10) | st.just(8))


@st.composite
def clean_upload(draw: st.DrawFn) -> tuple[DataSourceSpec, bytes, int]:
    """Only valid dense upserts and tombstones, attributes of every type in any order: the fast path's batches."""
    spec = draw(st.just(ALL_TYPES) | source_spec().filter(lambda s: not s.vectors_are_sparse))
    n = draw(st.integers(1, 12))
    items = []
    for _ in range(n):
        deleted = draw(st.integers(0, 4)) == 0
        names = spec.permanent_attributes if deleted else list(spec.attribute_types)
        attributes = [{"key": name, "value": {wire.SLOT[spec.attribute_types[name]]:
                                              good_value(draw, spec.attribute_types[name])}}
                      for name in draw(st.permutations(names))]
        if deleted:
            items.append({"attributes": attributes, "isDeleted": True})
            continue
        coordinates = draw(st.lists(st.floats(-1e30, 1e30) | st.integers(-(2**62), 2**62),
                                    min_size=spec.vector_dimension, max_size=spec.vector_dimension))
        items.append({"attributes": attributes, "vector": {"isSparse": False, "coordinates": coordinates}})
    return spec, json.dumps(items).encode(), 100


# -- upload: equivalence ----------------------------------------------------------------------------------------


@PROPERTY
@given(upload())
def test_decode_upload_equals_the_dto_path(case: tuple[DataSourceSpec, bytes, int]) -> None:
    kind, _ = assert_same_upload(*case)
    event(kind)


@PROPERTY
@given(clean_upload())
def test_valid_dense_batches_take_the_fast_path_and_equal_the_dto_path(case: tuple[DataSourceSpec, bytes, int]) -> None:
    spec, body, max_points = case
    kind, _ = assert_same_upload(spec, body, max_points)
    if kind == "table":
        # A clean batch that the DTO path takes, the fast path takes (no value outside int64, none non-finite).
        assert wire._fast_batch(spec, orjson.loads(body), max_points) is not None


def test_real_data_1000_points_of_384_dimensions() -> None:
    base = np.load(SHARED_DATA / "base_f16.npy", mmap_mode="r")[:1000].astype(np.float32)
    rows = pq.read_table(SHARED_DATA / "points.parquet").slice(0, 1000).to_pylist()
    types = {"id": "int64", "package": "string", "section": "string", "priority": "string",
             "installed_size_kb": "int64", "version": "string", "architecture": "string", "description": "string"}
    spec = DataSourceSpec("Debian.Packages", "1", 384, types, ["id"])
    slot = {"int64": "int64", "string": "string"}
    items = [
        {"attributes": [{"key": k, "value": {slot[types[k]]: row[k]}} for k in types],
         "vector": {"isSparse": False, "coordinates": v.tolist()}}
        for row, v in zip(rows, base, strict=True)
    ]
    body = json.dumps(items).encode()
    assert wire._fast_batch(spec, orjson.loads(body), 1000) is not None  # the fast path takes it
    kind, table = assert_same_upload(spec, body, 1000)
    assert kind == "table" and table.num_rows == 1000
    np.testing.assert_array_equal(
        np.asarray(table[VECTOR].combine_chunks().flatten()).reshape(1000, 384), base
    )
    # Tombstones mixed in: runs of upserts and tombstones, the same table.
    mixed = items[:500] + [{"attributes": [{"key": "id", "value": {"int64": 7}}], "isDeleted": True}] + items[500:]
    body = json.dumps(mixed).encode()
    assert wire._fast_batch(spec, orjson.loads(body), 1001) is not None
    kind, table = assert_same_upload(spec, body, 1001)
    assert kind == "table" and table["__op"].to_pylist()[500] == "delete"
    assert all(column.num_chunks == 1 for column in table.columns)
    # A sparse source, or keys in another case, take the exact path: the same table too.
    odd = [{"Attributes": item["attributes"], "Vector": item["vector"]} for item in items[:50]]
    assert wire._fast_batch(spec, odd, 1000) is None
    assert_same_upload(spec, json.dumps(odd).encode(), 1000)


# -- upload: errors by name ---------------------------------------------------------------------------------------


def point(i: int, **values: Any) -> dict[str, Any]:
    attributes = {"id": {"int64": i}, "tag": {"string": "t"}, "score": {"float64": 0.5}, "flag": {"bool": True},
                  "uid": {"guid": str(uuid.UUID(int=i))}, "at": {"dateTime": "2024-01-02T03:04:05"}}
    vector_ = values.pop("vector", {"isSparse": False, "coordinates": [0.1, 0.2, 0.3]})
    attributes.update(values)
    item: dict[str, Any] = {"attributes": [{"key": k, "value": v} for k, v in attributes.items() if v is not ...]}
    if vector_ is not ...:
        item["vector"] = vector_
    return item


def refused(batch: Any, spec: DataSourceSpec = ALL_TYPES, max_points: int = 100) -> ValidationError:
    body = batch if isinstance(batch, bytes) else json.dumps(batch).encode()
    with pytest.raises(ValidationError) as err:
        decode_upload(spec, body, max_points)
    return err.value


@pytest.mark.parametrize(
    ("item", "attribute", "rule"),
    [
        (point(1, id={"string": "1"}), "id", "expected a int64 value, got string"),
        (point(1, id={"int64": "x"}), "id", "int64 value must be a JSON integer, got string"),
        (point(1, id={"int64": "5"}), "id", "int64 value must be a JSON integer, got string"),
        (point(1, id={"int64": True}), "id", "int64 value must be a JSON integer, got boolean"),
        (point(1, id={"int64": 1.0}), "id", "int64 value must be a JSON integer, got number"),
        (point(1, id={"int64": 2**64}), "id", "int64 value out of range"),
        (point(1, flag={"bool": 1}), "flag", "bool value must be a JSON boolean, got integer"),
        (point(1, flag={"bool": "yes"}), "flag", "bool value must be a JSON boolean, got string"),
        (point(1, score={"float64": "1.5"}), "score", "float64 value must be a JSON number, got string"),
        (point(1, uid={"guid": "nope"}), "uid", "not a guid: 'nope'"),
        (point(1, at={"dateTime": 1700000000}), "at", "dateTime value must be a JSON string, got integer"),
        (point(1, at={"dateTime": "yesterday"}), "at", "not an ISO 8601 date and time"),
        # The DTO path failed on this one with a server error (OverflowError in batch.check_value).
        (point(1, at={"dateTime": "0001-01-01T00:00:00+01:00"}), "at", "date and time out of range in UTC"),
        (point(1, id={"int64": 1, "string": "x"}), "id", "an attribute value needs exactly one of"),
        (point(1, tag=...), "tag", "missing attribute"),
        (point(1, extra={"int64": 1}), "extra", "unknown attribute"),
        (point(1, vector=...), "vector", "a data point needs a vector"),
        (point(1, vector={"coordinates": [1, 2]}), "vector", "wrong dimension: expected 3, got 2"),
        (point(1, vector={"coordinates": [1, 2, "3"]}), "vector", "coordinates must be JSON numbers, got string"),
        (point(1, vector={"coordinates": [1, 2, 1e39]}), "vector", "coordinates must be finite"),
        (point(1, vector={"isSparse": True, "coordinates": [1], "coordinateIndices": [0]}), "vector",
         "the data source holds dense vectors"),
        (point(1, vector={"isSparse": "false", "coordinates": [1, 2, 3]}), "vector",
         "isSparse must be a JSON boolean, got string"),
        ({**point(1), "isDeleted": "yes"}, "isDeleted", "isDeleted must be a JSON boolean, got string"),
        ({**point(1), "isDeleted": True}, "vector", "a tombstone carries no vector"),
        ({"attributes": [{"key": "id", "value": {"int64": 1}}, {"key": "uid", "value": {"guid": str(uuid.UUID(int=1))}},
                         {"key": "tag", "value": {"string": "x"}}], "isDeleted": True}, "tag",
         "a tombstone carries only the permanent (key) attributes"),
        ({"vector": {"coordinates": [0, 0, 0]}}, "attributes", "a data point needs attributes"),
    ],
)
def test_a_bad_point_is_refused_naming_position_and_attribute(item: dict[str, Any], attribute: str, rule: str) -> None:
    err = refused([point(0), point(1), item, point(3)])
    assert not isinstance(err, UploadBodyError)
    problem = err.problems[0]
    assert (problem.position, problem.attribute) == (2, attribute), err.problems
    assert rule in problem.rule
    assert f"point 2, attribute '{attribute}'" in str(err)


def test_an_attribute_given_twice() -> None:
    item = point(2)
    item["attributes"].append({"key": "tag", "value": {"string": "again"}})
    err = refused([point(1), item])
    assert err.problems == [Problem("attribute given twice", 1, "tag")]


def test_every_problem_of_every_phase_is_reported_as_the_dto_path_does() -> None:
    # A shape problem stops before record rules (as pydantic's 400 came before them), record rules before
    # batch rules: the same problems as the DTO path.
    batch = [point(0, id={"string": "x"}), point(1, vector=...), point(2, tag=...)]
    assert refused(batch).problems == [
        Problem("expected a int64 value, got string", 0, "id"), Problem("a data point needs a vector", 1, "vector")
    ]
    assert refused([point(0, tag=...), point(1, vector={"coordinates": [1.0]})]).problems == [
        Problem("missing attribute", 0, "tag"), Problem("wrong dimension: expected 3, got 1", 1, "vector")
    ]
    assert [p.position for p in refused([point(0, id={"int64": "x"}), point(1, vector=...)]).problems] == [0]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"[{", "the body is not JSON"),
        (b"", "the body is not JSON"),
        (b'{"attributes": []}', "the body must be a JSON array of data points, got object"),
        (b"5", "got integer"),
        (b'[{"attributes": []}, 5, "x"]', "point 1: a data point must be a JSON object, got integer"),
    ],
)
def test_a_body_that_is_no_upload_is_refused_by_name(body: bytes, says: str) -> None:
    err = refused(body)
    assert isinstance(err, UploadBodyError)
    assert says in str(err)


def test_empty_and_oversized_batches_as_points_to_table_refuses_them() -> None:
    err = refused([])
    assert isinstance(err, EmptyUploadError) and err.problems == [Problem("batch is empty")]
    err = refused([point(i) for i in range(3)], max_points=2)
    assert isinstance(err, BatchTooLargeError)
    assert "batch holds 3 points, more than the configured maximum 2" in str(err)


def test_keys_match_ignoring_case() -> None:
    uid = str(uuid.UUID(int=1))
    odd = {"ATTRIBUTES": [{"Key": "id", "VALUE": {"Int64": 1}}, {"kEY": "uid", "value": {"GUID": uid}}],
           "IsDeleted": True}
    plain = {"attributes": [{"key": "id", "value": {"int64": 1}}, {"key": "uid", "value": {"guid": uid}}],
             "isDeleted": True}
    vectors = point(5, vector={"IsSparse": False, "COORDINATES": [1, 2, 3]})
    a = decode_upload(ALL_TYPES, json.dumps([odd, vectors]).encode(), 10)
    b = decode_upload(ALL_TYPES, json.dumps([plain, point(5, vector={"coordinates": [1, 2, 3]})]).encode(), 10)
    assert a.equals(b)
    assert_same_upload(ALL_TYPES, json.dumps([odd, vectors]).encode(), 10)


def test_values_parse_as_the_dtos_parsed_them() -> None:
    item = point(1, uid={"guid": "{0000000A-0000-0000-0000-00000000000B}"},
                 at={"dateTime": "2024-01-02T03:04:05+01:00"})
    table = decode_upload(ALL_TYPES, json.dumps([item]).encode(), 10)
    assert table["uid"].to_pylist() == ["0000000a-0000-0000-0000-00000000000b"]
    assert table["at"].to_pylist() == [dt.datetime(2024, 1, 2, 2, 4, 5, tzinfo=dt.UTC)]
    naive = decode_upload(ALL_TYPES, json.dumps([point(1)]).encode(), 10)
    assert naive["at"].to_pylist() == [dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.UTC)]  # naive is UTC
    for body in ([item], [point(1, score={"float64": 3})], [point(1, vector={"coordinates": [True, 0, 2**70]})]):
        assert_same_upload(ALL_TYPES, json.dumps(body).encode(), 10)


def test_sparse_sources() -> None:
    def sp(i: int, **vec: Any) -> dict[str, Any]:
        return {"attributes": [{"key": "id", "value": {"int64": i}}, {"key": "tag", "value": {"string": "x"}}],
                "vector": {"isSparse": True, **vec}}

    good = [sp(1, coordinates=[0.5, 2], coordinateIndices=[5, 0]),
            {"attributes": [{"key": "id", "value": {"int64": 1}}], "isDeleted": True}]
    kind, table = assert_same_upload(SPARSE, json.dumps(good).encode(), 10)
    assert kind == "table" and table[SPARSE_INDICES].to_pylist() == [[5, 0], None]
    assert refused([sp(1, coordinates=[1.0])], SPARSE).problems == [
        Problem("a sparse vector needs coordinateIndices", 0, "vector")
    ]
    assert "repeats an index" in str(refused([sp(1, coordinates=[1, 2], coordinateIndices=[1, 1])], SPARSE))
    assert "out of range 0..5" in str(refused([sp(1, coordinates=[1], coordinateIndices=[2**64])], SPARSE))
    assert "coordinateIndices[0] must be a JSON integer, got boolean" in str(
        refused([sp(1, coordinates=[1], coordinateIndices=[True])], SPARSE)
    )


def test_nan_and_infinity_as_python_json_writes_them() -> None:
    # orjson refuses NaN; the route took it (Python's json) and refused the point: still so.
    body = json.dumps([point(1, vector={"coordinates": [0.0, float("nan"), 1.0]})]).encode()
    kind, err = assert_same_upload(ALL_TYPES, body, 10)
    assert kind == "rules" and "NaN or infinity at index 1" in str(err)
    kind, err = assert_same_upload(ALL_TYPES, json.dumps([point(1, score={"float64": float("inf")})]).encode(), 10)
    assert kind == "rules" and "float64 value must be finite" in str(err)
    assert "the body is not JSON" in str(refused(b'["\\ud800"]'))  # a lone surrogate cannot be stored


# -- search -------------------------------------------------------------------------------------------------------


def test_decode_search_reads_vektonn_queries() -> None:
    query = decode_search(b'{"K": 2, "QueryVectors": [{"IsSparse": false, "Coordinates": [0, 2.5]}], '
                          b'"splitFilter": [{"key": "tag", "value": {"string": "a"}}], "RETRIEVEVECTORS": true}')
    assert (query.k, query.split_filter, query.retrieve_vectors) == (
        2, [{"key": "tag", "value": {"string": "a"}}], True)
    [vector] = query.query_vectors
    assert (vector["isSparse"], list(vector["coordinates"]), vector["coordinateIndices"]) == (False, [0.0, 2.5], None)
    spec = DataSourceSpec("S", "1", 2, {"tag": "string", "id": "int64"}, ["id"])
    vectors = query_vectors(spec, query)
    assert isinstance(vectors, np.ndarray) and vectors.dtype == np.float32 and vectors.tolist() == [[0.0, 2.5]]
    assert split_filter(spec, query) == {"tag": "a"}
    assert decode_search(b'{"k": 1, "queryVectors": []}').split_filter is None


@pytest.mark.parametrize(
    ("body", "attribute", "says"),
    [
        (b'{"queryVectors": []}', "k", "a search query needs k"),
        (b'{"k": 1}', "queryVectors", "a search query needs queryVectors"),
        (b'{"k": true, "queryVectors": []}', "k", "k must be a JSON integer, got boolean"),
        (b'{"k": "3", "queryVectors": []}', "k", "k must be a JSON integer, got string"),
        (b'{"k": 3.0, "queryVectors": []}', "k", "k must be a JSON integer, got number"),
        (b'{"k": 3, "queryVectors": {}}', "queryVectors", "must be a JSON array"),
        (b'{"k": 3, "queryVectors": [{"coordinates": ["a"]}]}', "queryVectors", "coordinates must be JSON numbers"),
        (b'{"k": 3, "queryVectors": [], "retrieveVectors": "yes"}', "retrieveVectors", "must be a JSON boolean"),
        (b'{"k": 3, "queryVectors": [], "splitFilter": [{"key": "t", "value": {"int64": "x"}}]}', "t",
         "int64 value must be a JSON integer, got string"),
        (b"[]", None, "a search query must be a JSON object, got array"),
        (b"{", None, "the body is not JSON"),
    ],
)
def test_bad_search_queries_name_the_field(body: bytes, attribute: str | None, says: str) -> None:
    with pytest.raises(ValidationError) as err:
        decode_search(body)
    assert err.value.problems[0].attribute == attribute
    assert says in str(err.value)


def test_search_values_are_checked_as_convert_checks_them() -> None:
    spec = DataSourceSpec("S", "1", 2, {"tag": "string", "id": "int64", "g": "guid"}, ["id"])
    query = decode_search(b'{"k": 1, "queryVectors": [{"coordinates": [1, 2]}, {"isSparse": true, "coordinates": [1],'
                          b' "coordinateIndices": [0]}], "splitFilter": [{"key": "tag", "value": {"int64": 1}},'
                          b' {"key": "g", "value": {"guid": "0000000A-0000-0000-0000-00000000000B"}}]}')
    with pytest.raises(ValidationError) as err:
        query_vectors(spec, query)
    assert err.value.problems == [Problem("the data source holds dense vectors", 1, "queryVectors")]
    with pytest.raises(ValidationError) as err:
        split_filter(spec, query)
    assert err.value.problems == [Problem("expected a string value, got int64", None, "tag")]
    ragged = decode_search(b'{"k": 1, "queryVectors": [{"coordinates": [1, 2]}, {"coordinates": [1]}]}')
    # the searcher refuses these by name
    assert [list(v) for v in query_vectors(spec, ragged)] == [[1.0, 2.0], [1.0]]


@st.composite
def search_body(draw: st.DrawFn) -> tuple[DataSourceSpec, bytes]:
    spec = draw(source_spec())
    vectors = draw(st.lists(vector(spec), max_size=3).filter(lambda vs: all(type(v) is dict for v in vs)))
    # Query vectors take the DTO's shape rules only: drop the values the DTOs coerced or NaN (none in a query).
    vectors = [v for v in vectors if all(type(c) in (int, float) and math.isfinite(c)
                                         for k, c_list in v.items() if k.lower() == "coordinates"
                                         for c in (c_list if type(c_list) is list else []))
               and all(type(s) is bool for k, s in v.items() if k.lower() == "issparse")]
    query: dict[str, Any] = {draw(odd_case("k")): draw(st.integers(-2, 100)), draw(odd_case("queryVectors")): vectors}
    if draw(st.booleans()):
        names = [*spec.attribute_types, "unknown"]
        entries = []
        for name in draw(st.lists(st.sampled_from(names), max_size=3)):
            kind = spec.attribute_types.get(name, draw(st.sampled_from(list(AttributeType))))
            value = draw(attribute_value(kind))
            if all(v is None or type(v) is not str or k.lower() not in ("int64", "bool", "float64")
                   for k, v in value.items()):
                entries.append({"key": name, "value": value})
        query[draw(odd_case("splitFilter"))] = entries
    if draw(st.booleans()):
        query["retrieveVectors"] = draw(st.booleans())
    return spec, json.dumps(query).encode()


@PROPERTY
@given(search_body())
def test_search_decoding_equals_the_dto_path(case: tuple[DataSourceSpec, bytes]) -> None:
    spec, body = case
    try:
        dto = SearchQueryDto.model_validate(json.loads(body))
    except pydantic.ValidationError:
        with pytest.raises(ValidationError):
            decode_search(body)
        return
    query = decode_search(body)
    assert (query.k, query.retrieve_vectors) == (dto.k, dto.retrieveVectors)
    old_kind, old = outcome(lambda: old_query_vectors(spec, dto.queryVectors))
    new_kind, new = outcome(lambda: query_vectors(spec, query))
    assert old_kind == new_kind
    if old_kind == "table":
        if isinstance(new, np.ndarray):
            np.testing.assert_array_equal(new, np.asarray(old, dtype=np.float32))
            assert new.dtype == np.float32 and new.flags.c_contiguous
        else:
            assert new == old
    else:
        assert new == old
    assert outcome(lambda: split_filter(spec, query)) == outcome(lambda: old_split_filter(spec, dto.splitFilter))


# -- search results -------------------------------------------------------------------------------------------

RESULT_SPEC = DataSourceSpec(
    "Results", "1", 3,
    {"id": "int64", "tag": "string", "score": "float64", "flag": "bool", "uid": "guid", "at": "datetime"}, ["id"],
)


def old_results(spec: DataSourceSpec, vectors: list[Any], results: list[Any]) -> bytes:
    """What the search routes answered: SearchResultDto through FastAPI's dump_json(by_alias, exclude_none)."""
    dtos = [SearchResultDto(queryVector=vector_dto(v), nearestDataPoints=[hit_dto(spec, h) for h in hits])
            for v, hits in zip(vectors, results, strict=True)]
    return _RESULTS.dump_json(_RESULTS.validate_python(dtos, from_attributes=True), by_alias=True, exclude_none=True)


def row_values(draw: st.DrawFn, kind: AttributeType, n: int) -> list[Any]:
    def one() -> Any:
        if draw(st.integers(0, 5)) == 0:
            return None  # left out of the hit's attributes
        if kind is AttributeType.INT64:
            return draw(st.integers(-(2**63), 2**63 - 1))
        if kind is AttributeType.FLOAT64:
            return draw(st.floats(allow_nan=False))
        if kind is AttributeType.BOOL:
            return draw(st.booleans())
        if kind is AttributeType.STRING:
            return draw(st.text(max_size=6))
        if kind is AttributeType.GUID:
            return str(draw(st.uuids()))
        return draw(st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31)))
    return [one() for _ in range(n)]


def source_table(draw: st.DrawFn, spec: DataSourceSpec, n: int) -> pa.Table:
    columns: dict[str, pa.Array] = {}
    if spec.vectors_are_sparse:
        indices = [sorted(draw(st.sets(st.integers(0, spec.vector_dimension - 1), max_size=3))) for _ in range(n)]
        columns[SPARSE_INDICES] = pa.array(indices, pa.list_(pa.int32()))
        columns[SPARSE_VALUES] = pa.array([draw(st.lists(st.floats(-10, 10, width=32), min_size=len(i),
                                                         max_size=len(i))) for i in indices], pa.list_(pa.float32()))
    else:
        flat = np.array(draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=3 * n, max_size=3 * n)), np.float32)
        columns[VECTOR] = pa.FixedSizeListArray.from_arrays(pa.array(flat), 3)
    for name, kind in spec.attribute_types.items():
        columns[name] = pa.array(row_values(draw, kind, n), ARROW_TYPES[kind])
    return pa.table(columns)


@st.composite
def search_results(draw: st.DrawFn) -> tuple[DataSourceSpec, SearchQuery, list[Any], bool]:
    sparse = draw(st.booleans())
    spec = RESULT_SPEC if not sparse else DataSourceSpec("R", "1", 3, RESULT_SPEC.attribute_types, ["id"],
                                                          vectors_are_sparse=True)
    n = draw(st.integers(1, 8))
    stored = tuple(draw(st.permutations(list(spec.attribute_types)))[: draw(st.integers(1, 6))])
    retrieve = draw(st.booleans())
    sources = tuple(RowSource(source_table(draw, spec, n), stored) for _ in range(draw(st.integers(1, 2))))
    vectors = []
    for _ in range(draw(st.integers(1, 3))):
        if sparse:
            idx = draw(st.lists(st.integers(0, 2), max_size=3, unique=True))
            vectors.append({"isSparse": True, "coordinates": draw(st.lists(st.floats(-5, 5) | st.integers(-5, 5),
                                                                            min_size=len(idx), max_size=len(idx))),
                            "coordinateIndices": idx})
        else:
            vectors.append({"coordinates": draw(st.lists(st.floats(-5, 5) | st.integers(-5, 5), min_size=3,
                                                         max_size=3))})
    query = decode_search(orjson.dumps({"k": 5, "queryVectors": vectors, "retrieveVectors": retrieve}))
    results: list[Any] = []
    for _ in vectors:
        k = draw(st.integers(0, 5))
        rows = draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k))
        distances = draw(st.lists(st.floats(allow_nan=False, width=32), min_size=k, max_size=k))
        style = draw(st.integers(0, 2))
        if style == 0 or len(sources) == 1:
            results.append(Hits(rows, distances, sources[:1], None, retrieve))
        elif style == 1:
            owners = draw(st.lists(st.integers(0, len(sources) - 1), min_size=k, max_size=k))
            results.append(Hits(rows, distances, sources, owners, retrieve))
        else:
            results.append(list(Hits(rows, distances, sources[:1], None, retrieve)))  # plain Hit objects
    return spec, query, results, retrieve


@PROPERTY
@given(search_results())
def test_encode_search_results_writes_the_bytes_pydantic_wrote(case: tuple[DataSourceSpec, SearchQuery, list[Any],
                                                                            bool]) -> None:
    spec, query, results, retrieve = case
    old_vectors = old_query_vectors(spec, SearchQueryDto.model_validate({"k": 1, "queryVectors": query.query_vectors})
                                    .queryVectors)
    expected = old_results(spec, old_vectors, results)
    assert encode_search_results(spec, query.query_vectors, results, retrieve) == expected
    # The decoded vectors (a float32 array for dense ones) echo their float32 values.
    decoded = query_vectors(spec, query)
    assert orjson.loads(encode_search_results(spec, decoded, results, retrieve)) == orjson.loads(
        old_results(spec, [np.asarray(v, np.float32).tolist() if not isinstance(v, SparseVector) else v
                           for v in old_vectors], results))


def test_search_results_as_the_quick_start_shows_them() -> None:
    table = pa.table({
        VECTOR: pa.FixedSizeListArray.from_arrays(pa.array(np.array([0, 1, 0, 1, 0, 0], np.float32)), 3),
        "id": pa.array([1, 2]), "tag": pa.array(["first", None]), "score": pa.array([0.5, 2.0]),
        "flag": pa.array([True, False]), "uid": pa.array([str(uuid.UUID(int=7))] * 2),
        "at": pa.array([dt.datetime(2024, 1, 2, 3, 4, 5), dt.datetime(2024, 1, 2, 3, 4, 5, 500000)],
                       pa.timestamp("us", tz="UTC")),
    })
    source = RowSource(table, ("id", "tag", "score", "flag", "uid", "at"))
    query = decode_search(b'{"k": 2, "queryVectors": [{"coordinates": [0, 2, 0.1]}], "retrieveVectors": true}')
    out = orjson.loads(encode_search_results(RESULT_SPEC, query.query_vectors,
                                             [Hits([0, 1], [1.0, 4.25], (source,), None, True)], True))
    [result] = out
    assert result["queryVector"] == {"isSparse": False, "coordinates": [0.0, 2.0, 0.1]}
    first, second = result["nearestDataPoints"]
    assert list(first) == ["vector", "attributes", "distance"]
    assert first["vector"] == {"isSparse": False, "coordinates": [0.0, 1.0, 0.0]}
    assert first["attributes"] == [
        {"key": "id", "value": {"int64": 1}}, {"key": "tag", "value": {"string": "first"}},
        {"key": "score", "value": {"float64": 0.5}}, {"key": "flag", "value": {"bool": True}},
        {"key": "uid", "value": {"guid": "00000000-0000-0000-0000-000000000007"}},
        {"key": "at", "value": {"dateTime": "2024-01-02T03:04:05Z"}},
    ]
    assert [a["key"] for a in second["attributes"]] == ["id", "score", "flag", "uid", "at"]  # the null tag left out
    assert second["attributes"][-1]["value"]["dateTime"] == "2024-01-02T03:04:05.500000Z"
    assert second["distance"] == 4.25
    without = orjson.loads(encode_search_results(RESULT_SPEC, query.query_vectors,
                                                 [Hits([0], [1.0], (source,), None, False)], False))
    assert list(without[0]["nearestDataPoints"][0]) == ["attributes", "distance"]


# -- the intake codec -----------------------------------------------------------------------------------------

CODEC_SPEC = DataSourceSpec("events", "1", 4, {"id": AttributeType.INT64, "tag": AttributeType.STRING}, ["id"])


def test_codec_json_uses_the_wire_decoder_with_its_own_wording() -> None:
    items: list[DataPoint | Tombstone] = [DataPoint({"id": i, "tag": "a"}, [float(i)] * 4) for i in range(5)]
    items.append(Tombstone({"id": 2}))
    body = codec.encode_json(items)
    assert codec.decode(CODEC_SPEC, codec.JSON, body, 100).equals(decode_upload(CODEC_SPEC, body, 100))
    assert codec.decode(CODEC_SPEC, codec.JSON, body, 100).equals(old_upload(CODEC_SPEC, body, 100))
    for bad, says in [(b"[{", "not a Vektonn upload body: the body is not JSON"), (b"[]", "no data point"),
                      (b'{"a": 1}', "not a Vektonn upload body: the body must be a JSON array"),
                      (b"[1]", "not a Vektonn upload body: point 0: a data point must be a JSON object")]:
        with pytest.raises(ValidationError, match=says):
            codec.decode(CODEC_SPEC, codec.JSON, bad, 100)
    with pytest.raises(ValidationError, match="point 0, attribute 'tag': missing attribute"):
        codec.decode(CODEC_SPEC, codec.JSON, codec.encode_json([DataPoint({"id": 1}, [0.0] * 4)]), 100)


def test_arrow_upload_is_the_one_implementation() -> None:
    vectors = np.arange(12, dtype=np.float32).reshape(3, 4)
    body = codec.encode_arrow(vectors, {"id": [1, 2, 1], "tag": ["a", "b", "c"]}, deleted=[False, True, False])
    table = decode_arrow_upload(CODEC_SPEC, body, 10)
    assert table["__op"].to_pylist() == ["upsert", "delete", "upsert"]
    assert table.equals(codec.decode(CODEC_SPEC, codec.ARROW, body, 10))
    same = [DataPoint({"id": 1, "tag": "a"}, vectors[0]), Tombstone({"id": 2}),
            DataPoint({"id": 1, "tag": "c"}, vectors[2])]
    json_table = decode_upload(CODEC_SPEC, codec.encode_json(same), 10)
    assert table.equals(json_table)
    for bad, says in [(b"garbage", "not an Arrow IPC stream"),
                      (codec.encode_arrow(np.ones((2, 3)), {"id": [1, 2], "tag": ["a", "b"]}), "dimension"),
                      (codec.encode_arrow(None, {"id": [1], "tag": ["a"]}, deleted=[False]), "missing vector")]:
        with pytest.raises(ValidationError, match=says):
            decode_arrow_upload(CODEC_SPEC, bad, 10)


def test_field_names_match_the_dtos() -> None:
    assert wire._CANONICAL == dto_module._CANONICAL
    assert wire.VALUE_KINDS == dto_module.VALUE_KINDS
    assert wire.SLOT == convert_module.SLOT


def test_hits_without_sources_and_plain_hit_lists() -> None:
    assert encode_search_results(RESULT_SPEC, [[1.0, 2.0, 3.0]], [Hits([], [], ())], False) == (
        b'[{"queryVector":{"isSparse":false,"coordinates":[1.0,2.0,3.0]},"nearestDataPoints":[]}]'
    )
    hits = [Hit({"id": 3, "tag": None}, 0.5, SparseVector([1], [2.0]))]
    assert orjson.loads(encode_search_results(RESULT_SPEC, [SparseVector([0], [1])], [hits], True)) == [{
        "queryVector": {"isSparse": True, "coordinates": [1.0], "coordinateIndices": [0]},
        "nearestDataPoints": [{"vector": {"isSparse": True, "coordinates": [2.0], "coordinateIndices": [1]},
                               "attributes": [{"key": "id", "value": {"int64": 3}}], "distance": 0.5}],
    }]
