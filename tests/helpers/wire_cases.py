"""The oracle and the generated bodies the wire tests share: the DTO path's upload (what the routes did before
shoal.vektonn's decoders) and hypothesis strategies for Vektonn upload bodies, valid and not.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from typing import Any

import pyarrow as pa
import pydantic
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from helpers.dto_path import points_from_dtos
from shoal.errors import BatchTooLargeError, Problem, ValidationError
from shoal.log.records import AttributeType, DataSourceSpec
from shoal.log.validation import points_to_table
from shoal.vektonn import json_fields
from shoal.vektonn.dto import InputDataPointOrTombstoneDto
from shoal.vektonn.upload_json import decode_upload

EXAMPLES = int(os.environ.get("SHOAL_WIRE_EXAMPLES", "150"))
# Derandomised (the same examples on every run) unless SHOAL_WIRE_RANDOM is set, to explore further.
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    derandomize="SHOAL_WIRE_RANDOM" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_DTOS = pydantic.TypeAdapter(list[InputDataPointOrTombstoneDto])

ALL_TYPES = DataSourceSpec(
    "All.Types", "1", 3,
    {"id": "int64", "tag": "string", "score": "float64", "flag": "bool", "uid": "guid", "at": "datetime"},
    ["id", "uid"],
)
SPARSE = DataSourceSpec("Sparse", "1", 6, {"id": "int64", "tag": "string"}, ["id"], vectors_are_sparse=True)


# -- the old path -----------------------------------------------------------------------------------------------


def old_upload(spec: DataSourceSpec, body: bytes, max_points: int) -> pa.Table:
    """What POST /upload did: json.loads, the DTOs in python mode (FastAPI), points_from_dtos, points_to_table;
    except that an array of objects holding more than `max_points` is refused first, before any point is read
    (as the route does since issue 13: checking every point of an oversized batch cost seconds)."""
    items = json.loads(body)
    if type(items) is list and len(items) > max_points and all(type(item) is dict for item in items):
        raise BatchTooLargeError(
            Problem(f"batch holds {len(items)} points, more than the configured maximum {max_points}")
        )
    return points_to_table(spec, points_from_dtos(spec, _DTOS.validate_python(items)), max_points)


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
    slot = json_fields.SLOT[kind]
    mutation = draw(st.integers(0, 100))
    if mutation == 0:  # another type's slot
        other = draw(st.sampled_from([t for t in AttributeType if t is not kind]))
        return {draw(odd_case(json_fields.SLOT[other])): good_value(draw, other)}
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
        # No boolean: the DTOs read one as 1, Vektonn and Shoal refuse it (tests/test_vektonn_value_forms.py).
        coordinate = st.sampled_from([float("nan"), float("inf"), 1e39, -1e300, 2**64 + 1])
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
        attributes = [{"key": name, "value": {json_fields.SLOT[spec.attribute_types[name]]:
                                              good_value(draw, spec.attribute_types[name])}}
                      for name in draw(st.permutations(names))]
        if deleted:
            items.append({"attributes": attributes, "isDeleted": True})
            continue
        coordinates = draw(st.lists(st.floats(-1e30, 1e30) | st.integers(-(2**62), 2**62),
                                    min_size=spec.vector_dimension, max_size=spec.vector_dimension))
        items.append({"attributes": attributes, "vector": {"isSparse": False, "coordinates": coordinates}})
    return spec, json.dumps(items).encode(), 100
