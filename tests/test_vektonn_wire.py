"""shoal.vektonn's upload decoders against the DTO path they replace: the same tables and the same errors.

The old path is what the HTTP routes did before: FastAPI parsed the body with Python's json and validated it with
the pydantic DTOs (python mode), tests/helpers/dto_path.py made records, batch.points_to_table made the table.
Search decoding and result encoding are tested in tests/test_vektonn_search_wire.py.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest
from helpers import dto_path as convert_module
from helpers.arrow_bodies import arrow_stream
from helpers.wire_cases import (
    ALL_TYPES,
    PROPERTY,
    SPARSE,
    assert_same_upload,
    clean_upload,
    old_upload,
    upload,
)
from hypothesis import event, given

from shoal.errors import BatchTooLargeError, Problem, ValidationError
from shoal.intake import codec
from shoal.log.records import AttributeType, DataPoint, DataSourceSpec, SparseVector, Tombstone
from shoal.log.validation import SPARSE_INDICES, VECTOR
from shoal.vektonn import dto as dto_module
from shoal.vektonn import json_fields, simd_upload, upload_json
from shoal.vektonn.arrow_upload import decode_arrow_upload
from shoal.vektonn.upload_json import EmptyUploadError, UploadBodyError, decode_upload

SHARED_DATA = Path(os.environ.get("SHOAL_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"
                                  / "debian-packages"))


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
        assert upload_json._fast_batch(spec, orjson.loads(body), max_points) is not None
        if b'"vector"' in body:
            # ... and with the coordinates read by simdjson, whatever strings the attributes hold.
            read = simd_upload.load_dense(body)
            assert read is not None and upload_json._fast_batch(spec, read[0], max_points, read[1]) is not None


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
    assert upload_json._fast_batch(spec, orjson.loads(body), 1000) is not None  # the fast path takes it
    kind, table = assert_same_upload(spec, body, 1000)
    assert kind == "table" and table.num_rows == 1000
    np.testing.assert_array_equal(
        np.asarray(table[VECTOR].combine_chunks().flatten()).reshape(1000, 384), base
    )
    # Tombstones mixed in: runs of upserts and tombstones, the same table.
    mixed = items[:500] + [{"attributes": [{"key": "id", "value": {"int64": 7}}], "isDeleted": True}] + items[500:]
    body = json.dumps(mixed).encode()
    assert upload_json._fast_batch(spec, orjson.loads(body), 1001) is not None
    kind, table = assert_same_upload(spec, body, 1001)
    assert kind == "table" and table["__op"].to_pylist()[500] == "delete"
    assert all(column.num_chunks == 1 for column in table.columns)
    # A sparse source, or keys in another case, take the exact path: the same table too.
    odd = [{"Attributes": item["attributes"], "Vector": item["vector"]} for item in items[:50]]
    assert upload_json._fast_batch(spec, odd, 1000) is None
    assert_same_upload(spec, json.dumps(odd).encode(), 1000)


def _dense_body(coordinates: str, prefix: bytes = b"", extra: str = "", points: int = 1, second: str = "") -> bytes:
    """An ALL_TYPES body of `points` points with the coordinates given as raw JSON text (`second` for the points
    after the first, when given)."""
    attributes = ('[{"key":"id","value":{"int64":1}},{"key":"tag","value":{"string":"t"}},'
                  '{"key":"score","value":{"float64":0.5}},{"key":"flag","value":{"bool":true}},'
                  '{"key":"uid","value":{"guid":"8d0b6b8e-0c3a-4b8e-9a43-6f1f4d2c2f10"}},'
                  '{"key":"at","value":{"dateTime":"2024-01-02T03:04:05Z"}}]')
    items = []
    for i in range(points):
        vector = f'{{"isSparse":false,"coordinates":{second if i and second else coordinates}}}'
        items.append(f'{{"attributes":{attributes},"vector":{vector}{extra}}}')
    return prefix + f'[{",".join(items)}]'.encode()


@pytest.mark.parametrize("body", [
    _dense_body("[0.1,-2.5e-3,3]"),                       # the simdjson path takes it
    _dense_body("[1,2,3]"),                               # integers only
    _dense_body("[-0.0, 1E5 ,\n3]"),                      # whitespace inside, an exponent, a negative zero
    _dense_body("[0.1,-2.5e-3,3]").replace(b'"coordinates":', b'"coordinates" :\n '),  # whitespace around ':'
    _dense_body("[1,2,3]", points=3),
    _dense_body("[9007199254740993,0.5,18446744073709551615]"),  # beyond a double's integers, beyond int64
    _dense_body("[[1],2,3]"),                             # as_buffer would flatten a nested array
    _dense_body("[[1,2],3]"),
    _dense_body("[1,[2],3]"),
    _dense_body("[]"),
    _dense_body("[true,2,3]"),                            # a boolean (refused, as Vektonn refuses it)
    _dense_body("[null,2,3]"),
    _dense_body('["1",2,3]'),
    _dense_body('[1,2,"]"]'),
    _dense_body("[1e400,2,3]"),                           # beyond a double: Python's json reads inf
    _dense_body("[123456789012345678901234567890,2,3]"),  # a big integer
    _dense_body("0"),                                     # a number where the array belongs (the placeholder 0)
    _dense_body("0", points=2, second="[1,2,3]"),         # ... before an array whose placeholder is 0
    _dense_body("[1,2,3]", points=2, second="1"),
    _dense_body("[1,2,3]", points=2, second="[1,2]"),     # arrays of two lengths
    _dense_body("[1,2,3]", prefix=b"\xef\xbb\xbf"),        # a byte order mark
    _dense_body("[1,2,3]", prefix=b" \n\t"),
    _dense_body("[1,2,3]", extra=',"vector":{"isSparse":false,"coordinates":[4,5,6]}'),  # a key twice: last wins
    _dense_body("[1,2,3]", extra=',"vector":{"isSparse":false,"coordinates":[4,5,6]}', points=2),
    _dense_body("[1,2,3]", extra=',"isDeleted":false'),
    _dense_body("[1,2,3]", extra=',"x\\"coordinates":[4,5,6]'),  # a key that ends in coordinates
    _dense_body("[1,2,3,4]"),                             # the wrong dimension
    _dense_body("[1,2,3]").replace(b'"t"', b'"[t]"'),     # a bracket inside a string
    _dense_body("[1,2,3]").replace(b'"t"', b'"\\"coordinates\\":[1,2,3]"'),  # the key's text inside a string
    _dense_body("[1,2,3]").replace(b'"t"', b'"\\\\"'),  # a string ending in a backslash
    _dense_body("[1,2,3]").replace(b'"t"', b'"\\ud83d\\ude00"'),  # an escaped surrogate pair
    _dense_body("[1,2,3]").replace(b'"t"', b'"\\ud800"'),  # a lone surrogate
    _dense_body("[1,2,3]") + b" x",                       # trailing garbage
])
def test_the_simdjson_reader_changes_no_outcome(body: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    with_reader = outcome_of(lambda: decode_upload(ALL_TYPES, body, 10))
    monkeypatch.setattr(upload_json, "load_dense", lambda body: None)
    without = outcome_of(lambda: decode_upload(ALL_TYPES, body, 10))
    assert with_reader == without
    read = simd_upload.load_dense(body)
    if read is not None and upload_json._fast_batch(ALL_TYPES, read[0], 10, read[1]) is not None:
        # Whatever the fast path takes from the reader is orjson's reading, coordinates as the same doubles.
        items, matrix = read
        loaded = orjson.loads(body)
        expected = [np.asarray(item.pop("vector")["coordinates"], dtype=np.float64) for item in loaded]
        got = [matrix[item.pop("vector")["coordinates"][0]] for item in items]
        assert items == loaded
        assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


def outcome_of(decode: Any) -> tuple[str, Any]:
    """A decode's table, or its error's type and problems."""
    try:
        table = decode()
    except ValidationError as exc:
        return type(exc).__name__, exc.problems
    return "table", table.to_pydict()


def test_clean_dense_batches_take_the_simdjson_reader() -> None:
    for body in (_dense_body("[0.1,-2.5e-3,3]"), _dense_body("[1, 2, 3]", points=3),
                 json.dumps(orjson.loads(_dense_body("[0.1,-2.5e-3,3]", points=2)), indent=2).encode()):
        read = simd_upload.load_dense(body)
        assert read is not None and upload_json._fast_batch(ALL_TYPES, read[0], 10, read[1]) is not None
    # Nested arrays would flatten, and a byte order mark is orjson's refusal: the usual way reads both.
    assert simd_upload.load_dense(_dense_body("[[1],2,3]")) is None
    assert simd_upload.load_dense(_dense_body("[1,2,3]", prefix=b"\xef\xbb\xbf")) is None
    # A number standing where the first array belongs is no placeholder: the fast path refuses the reading.
    read = simd_upload.load_dense(_dense_body("0", points=2, second="[1,2,3]"))
    assert read is not None and upload_json._fast_batch(ALL_TYPES, read[0], 10, read[1]) is None


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
        (point(1, id={"int64": "5.0"}), "id", "int64 value must be a JSON integer, got string '5.0'"),
        (point(1, id={"int64": " 5"}), "id", "int64 value must be a JSON integer, got string ' 5'"),
        (point(1, id={"int64": str(2**63)}), "id", "int64 value out of range"),
        (point(1, id={"int64": True}), "id", "int64 value must be a JSON integer, got boolean"),
        (point(1, id={"int64": 1.0}), "id", "int64 value must be a JSON integer, got number"),
        (point(1, id={"int64": 2**64}), "id", "int64 value out of range"),
        (point(1, flag={"bool": 1}), "flag", "bool value must be a JSON boolean, got integer"),
        (point(1, flag={"bool": "yes"}), "flag", "bool value must be a JSON boolean, got string"),
        (point(1, score={"float64": "NaN"}), "score", "float64 value must be a JSON number, got string 'NaN'"),
        (point(1, score={"float64": "-Infinity"}), "score", "float64 value must be a JSON number, got string"),
        (point(1, score={"float64": "1e400"}), "score", "float64 value must be finite"),
        (point(1, score={"float64": "0x10"}), "score", "float64 value must be a JSON number, got string"),
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
        (point(1, vector={"coordinates": [1, 2, "x"]}), "vector", "got string 'x' at index 2, which spells no decimal"),
        (point(1, vector={"coordinates": [1, 2, True]}), "vector", "coordinates must be JSON numbers, got boolean"),
        (point(1, vector={"coordinates": [1, 2, 1e39]}), "vector",
         "coordinates must be finite float32 values: 1e+39 at index 2 is past float32's range"),
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


def test_numbers_written_as_strings_read_as_vektonn_reads_them() -> None:
    """Vektonn's HttpJson reads numbers from JSON strings (NumberHandling.AllowReadingFromString): an int64 slot
    takes a decimal integer string (one beyond a double's exact integers stays exact), a float64 slot a decimal
    number string; the table is the one the numbers themselves give. Before, both were refused."""
    as_numbers = [point(1, id={"int64": 9007199254740993}, score={"float64": 1500.0}),
                  point(2, id={"int64": -7}, score={"float64": 3})]
    as_strings = [point(1, id={"int64": "9007199254740993"}, score={"float64": "1.5e3"}),
                  point(2, id={"int64": "-7"}, score={"float64": "+3"})]
    table = decode_upload(ALL_TYPES, json.dumps(as_strings).encode(), 10)
    assert table.equals(decode_upload(ALL_TYPES, json.dumps(as_numbers).encode(), 10))
    assert table["id"].to_pylist() == [9007199254740993, -7] and table["score"].to_pylist() == [1500.0, 3.0]
    tombstone = {"attributes": [{"key": "id", "value": {"int64": "3"}}, {"key": "uid", "value": {"guid": str(
        uuid.UUID(int=3))}}], "isDeleted": True}
    assert decode_upload(ALL_TYPES, json.dumps([tombstone]).encode(), 10)["id"].to_pylist() == [3]
    # Not a number however written: a boolean, or a string that spells none.
    assert "int64 value must be a JSON integer, got boolean" in str(refused([point(1, id={"int64": True})]))
    assert "float64 value must be a JSON number, got string 'one'" in str(refused([point(1, score={"float64": "one"})]))


def test_an_empty_sparse_vector_is_refused_where_the_vektonn_routes_ask() -> None:
    """Vektonn's SparseVectorValidator refuses a sparse vector without coordinates ("Vector must have
    coordinates"): the upload route decodes with empty_sparse=False and is refused naming the point. By default
    the decoder takes it as the all-zero vector the records (and the intake publisher's messages) allow."""
    empty = {"attributes": [{"key": "id", "value": {"int64": 1}}, {"key": "tag", "value": {"string": "x"}}],
             "vector": {"isSparse": True, "coordinates": [], "coordinateIndices": []}}
    good = {**empty, "vector": {"isSparse": True, "coordinates": [1.0], "coordinateIndices": [2]}}
    body = json.dumps([good, empty]).encode()
    with pytest.raises(ValidationError) as err:
        decode_upload(SPARSE, body, 10, empty_sparse=False)
    assert err.value.problems == [Problem("a sparse vector must have at least one coordinate", 1, "vector")]
    assert decode_upload(SPARSE, body, 10)[SPARSE_INDICES].to_pylist() == [[2], []]
    assert codec.decode(SPARSE, codec.JSON, codec.encode_json([DataPoint({"id": 1, "tag": "x"}, SparseVector([], []))]),
                        10)[SPARSE_INDICES].to_pylist() == [[]]


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
    for body in ([item], [point(1, score={"float64": 3})], [point(1, vector={"coordinates": [1, 0, 2**70]})]):
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
    # A lone surrogate cannot be stored: refused naming where it is (issue 13), not as a body that is no JSON.
    assert refused(b'["\\ud800"]').problems[0].position == 0
    assert "lone surrogate" in str(refused([point(1, tag={"string": "\ud800"})]))
    assert "attribute 'tag'" in str(refused([point(1, tag={"string": "\ud800"})]))


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
                      (arrow_stream({"id": [1], "tag": ["a"], "is_deleted": [False]}), "missing vector")]:
        with pytest.raises(ValidationError, match=says):
            decode_arrow_upload(CODEC_SPEC, bad, 10)


def test_field_names_match_the_dtos() -> None:
    assert json_fields.CANONICAL == dto_module._CANONICAL
    assert json_fields.VALUE_KINDS == dto_module.VALUE_KINDS
    assert json_fields.SLOT == convert_module.SLOT


def test_the_collector_pause_around_a_decode_restores_the_collector() -> None:
    import gc

    from shoal.api.process_tuning import collector_paused

    assert gc.isenabled()
    with pytest.raises(ValidationError), collector_paused():
        assert not gc.isenabled()
        decode_upload(ALL_TYPES, b"[]", 10)
    assert gc.isenabled()  # back on after a refused body
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()
