"""Arrow uploads and the JSON fast path, hardened: control columns that an attribute's name cannot hijack, bytes
after an Arrow stream's end, the JSON reader's placeholders, dictionary-encoded columns, guid texts and the
wording of vector errors. Every case goes through the HTTP upload route, as clients send it."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
import pytest

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.errors import ValidationError
from shoal.intake import codec
from shoal.intake.codec import ARROW, encode_arrow
from shoal.log.records import DataPoint

SPEC = DataSourceSpec("Ar", "1", 3, {"id": "int64", "title": "string"}, ["id"])
# Attributes named as the Arrow form's control columns (attribute names may be; only `__` is reserved).
NAMED = DataSourceSpec("Named", "1", 3, {"id": "int64", "is_deleted": "bool", "vector": "string"}, ["id"])
TIMES = DataSourceSpec("Times", "1", 3, {"id": "int64", "at": "datetime"}, ["id"])
GUIDS = DataSourceSpec("Guids", "1", 3, {"id": "int64", "uid": "guid"}, ["id"])


def _ipc(columns: dict[str, Any], *, end: bool = True) -> bytes:
    """The columns as one Arrow IPC stream; `end=False` leaves out the end-of-stream marker."""
    table = pa.table(columns)
    sink = pa.BufferOutputStream()
    writer = pa.ipc.new_stream(sink, table.schema)
    writer.write_table(table)
    if end:
        writer.close()
    return sink.getvalue().to_pybytes()


def _vectors(rows: Sequence[Sequence[float | None]], kind: pa.DataType = pa.float32()) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array([x for row in rows for x in row], kind), 3)


def _post(http: httpx.Client, spec: DataSourceSpec, body: bytes, content_type: str = ARROW) -> httpx.Response:
    return http.post(f"/api/v1/upload/{spec.name}/{spec.version}", content=body,
                     headers={"Content-Type": content_type})


def _refused(response: httpx.Response, *fragments: str) -> list[str]:
    """The messages of a 400 answer, each fragment found in one of them."""
    assert response.status_code == 400, response.text
    messages = response.json()["errorMessages"]
    for fragment in fragments:
        assert any(fragment in m for m in messages), (fragment, messages)
    return list(messages)


def _head(shoal: Shoal, spec: DataSourceSpec) -> int:
    return shoal.get_data_source(spec.name, spec.version).head_seq


# -- 1. attributes named `is_deleted` and `vector` ------------------------------------------------------------


def test_attributes_named_is_deleted_and_vector_are_uploaded_as_attributes(served: tuple[str, Settings]) -> None:
    url, settings = served
    vectors = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=np.float32)
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(NAMED)
        # The publisher's columns form: the attributes keep their names, the vectors and the flags go in the
        # reserved `__vector` / `__is_deleted` columns.
        body = encode_arrow(vectors, {"id": [1, 2, 3], "is_deleted": [True, False, True], "vector": ["a", "b", "c"]})
        assert _post(http, NAMED, body).status_code == 200
        state = {row["id"]: row for row in shoal.fold("Named", "1").to_pylist()}
        assert sorted(state) == [1, 2, 3]  # a soft-delete flag stays an attribute: nothing deleted
        assert [(state[i]["is_deleted"], state[i]["vector"], state[i]["__vector"]) for i in (1, 2, 3)] == [
            (True, "a", [1.0, 0.0, 0.0]), (False, "b", [0.0, 1.0, 0.0]), (True, "c", [0.0, 0.0, 1.0])]
        # The same columns hand-made with the plain names too: `is_deleted` and `vector` are the attributes.
        plain = _ipc({"__vector": _vectors([[2.0, 0.0, 0.0]]), "id": [1], "is_deleted": [False], "vector": ["a2"]})
        assert _post(http, NAMED, plain).status_code == 200
        # Tombstones ride in `__is_deleted`, with the attribute column beside it.
        body = encode_arrow(vectors[:2], {"id": [2, 3], "is_deleted": [False, False], "vector": ["b", "c"]},
                            deleted=[True, False])
        assert _post(http, NAMED, body).status_code == 200
        state = {row["id"]: row for row in shoal.fold("Named", "1").to_pylist()}
        assert sorted(state) == [1, 3]
        assert (state[1]["is_deleted"], state[1]["vector"], state[1]["__vector"]) == (False, "a2", [2.0, 0.0, 0.0])
        assert (state[3]["is_deleted"], state[3]["__vector"]) == (False, [0.0, 1.0, 0.0])
        # The vectors are asked for under the name that carries them here.
        head = _head(shoal, NAMED)
        missing = _ipc({"id": [1], "is_deleted": [False], "vector": ["x"]})
        _refused(_post(http, NAMED, missing), "'__vector': missing vector column")
        assert _head(shoal, NAMED) == head
        # The broker intake decodes a published message with the same decoder.
        table = codec.decode(NAMED, ARROW, encode_arrow(vectors[:1], {"id": [9], "is_deleted": [True],
                                                                      "vector": ["z"]}), 10)
        assert table.to_pylist()[0]["is_deleted"] is True and table["__op"].to_pylist() == ["upsert"]


def test_reserved_control_columns_are_taken_by_every_data_source(served: tuple[str, Settings]) -> None:
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(SPEC)
        body = _ipc({"__vector": _vectors([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]), "id": [1, 2], "title": ["a", "b"]})
        assert _post(http, SPEC, body).status_code == 200
        body = _ipc({"__vector": _vectors([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]), "id": [3, 1], "title": ["c", None],
                     "__is_deleted": [False, True]})
        assert _post(http, SPEC, body).status_code == 200
        assert {r["id"]: r["__vector"] for r in shoal.fold("Ar", "1").to_pylist()} == {
            2: [0.0, 1.0, 0.0], 3: [0.0, 0.0, 1.0]}
        head = _head(shoal, SPEC)
        # The plain names still work; both names of one control column at once are refused naming them.
        twice = _ipc({"vector": _vectors([[1.0, 0.0, 0.0]]), "__vector": _vectors([[0.0, 1.0, 0.0]]), "id": [5],
                      "title": ["e"]})
        _refused(_post(http, SPEC, twice), "the columns '__vector' and 'vector' both carry the vectors")
        flags = _ipc({"vector": _vectors([[1.0, 0.0, 0.0]]), "id": [5], "title": ["e"], "is_deleted": [False],
                      "__is_deleted": [True]})
        _refused(_post(http, SPEC, flags), "the columns '__is_deleted' and 'is_deleted' both carry")
        assert _head(shoal, SPEC) == head


# -- 2. bytes after the stream's end --------------------------------------------------------------------------


def test_bytes_after_an_arrow_streams_end_are_refused(served: tuple[str, Settings]) -> None:
    url, settings = served
    vectors = np.eye(3, dtype=np.float32)
    first = encode_arrow(vectors, {"id": [1, 2, 3], "title": ["a", "b", "c"]})
    second = encode_arrow(vectors, {"id": [4, 5, 6], "title": ["d", "e", "f"]})
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(SPEC)
        # Two streams in one body: the second would never be read. Refused whole, nothing written.
        _refused(_post(http, SPEC, first + second), f"not an Arrow IPC stream: {len(second)} bytes after its end")
        _refused(_post(http, SPEC, first + b"\x00junk"), "not an Arrow IPC stream: 5 bytes after its end")
        assert _head(shoal, SPEC) == 0
        # A stream without its end-of-stream marker is whole all the same.
        unended = _ipc({"vector": _vectors(vectors.tolist()), "id": [1, 2, 3], "title": ["a", "b", "c"]}, end=False)
        assert _post(http, SPEC, unended).status_code == 200
        assert sorted(r["id"] for r in shoal.fold("Ar", "1").to_pylist()) == [1, 2, 3]


# -- 3. the JSON reader's placeholders ------------------------------------------------------------------------


def _point(i: int, vector: str) -> str:
    return f'{{"attributes":[{{"key":"id","value":{{"int64":{i}}}}},{{"key":"title","value":{{"string":"t"}}}}],' \
           f'"vector":{vector}}}'


@pytest.mark.parametrize(("body", "message"), [
    # A number where point 0's coordinates belong, and a tombstone's vector given twice (its array dropped, as
    # the last key wins): the number passed for the placeholder of the tombstone's array, stored as point 0's.
    ("[" + _point(1, '{"isSparse":false,"coordinates":0}') + ","
     + _point(2, '{"isSparse":false,"coordinates":[9,9,9]},"vector":null,"isDeleted":true') + "]",
     "point 0, attribute 'vector': coordinates must be a JSON array of numbers, got integer"),
    # A one-element array under the key spelled with an escape, the last of two: orjson reads it, not the array
    # (it would pass for the placeholder `[0]` of the array before it, were escaped keys not looked for).
    ("[" + _point(1, '{"isSparse":false,"coordinates":[9,9,9],"coordinat\\u0065s":[0]}') + "]",
     "point 0, attribute 'vector': wrong dimension: expected 3, got 1"),
], ids=["a-number-for-a-placeholder", "an-escaped-key"])
def test_json_bodies_the_fast_reader_cannot_prove_take_the_exact_path(
    served: tuple[str, Settings], body: str, message: str
) -> None:
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(SPEC)
        # What json.loads (and so the exact path) reads: no array of three numbers where point 0's vector is.
        assert json.loads(body)[0]["vector"]["coordinates"] in (0, [0])
        _refused(_post(http, SPEC, body.encode(), "application/json"), message)
        assert _head(shoal, SPEC) == 0
        # An escaped key alone is read as orjson reads it, with its coordinates.
        alone = "[" + _point(4, '{"isSparse":false,"coordinat\\u0065s":[1,2,3]}') + "]"
        assert _post(http, SPEC, alone.encode(), "application/json").status_code == 200
        assert {r["id"]: r["__vector"] for r in shoal.fold("Ar", "1").to_pylist()} == {4: [1.0, 2.0, 3.0]}


# -- 4. dictionary-encoded timestamps --------------------------------------------------------------------------


def test_dictionary_encoded_timestamps_are_checked_as_plain_ones(served: tuple[str, Settings]) -> None:
    url, settings = served
    vectors = _vectors([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    year_0 = -62135596800 * 10**6 - 1  # a microsecond before 0001-01-01
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(TIMES)
        out_of_range = pa.array([year_0, 0], pa.timestamp("us")).dictionary_encode()
        for column, message in [
            (out_of_range, "point 0, attribute 'at': date and time out of range in UTC (years 1..9999)"),
            (pa.array([1, 1], pa.timestamp("ns", tz="UTC")).dictionary_encode(),
             "point 1, attribute 'at': has sub-microsecond precision"),
        ]:
            _refused(_post(http, TIMES, _ipc({"vector": vectors, "id": [1, 2], "at": column})), message)
        # A tombstone's other attribute is checked for its range all the same (never stored, so a nanosecond
        # part would lose nothing).
        full = _ipc({"vector": vectors, "id": [1, 2], "at": out_of_range, "is_deleted": [True, True]})
        _refused(_post(http, TIMES, full), "point 0, attribute 'at': date and time out of range")
        assert _head(shoal, TIMES) == 0
        moment = dt.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=dt.UTC)
        good = pa.array([moment, moment], pa.timestamp("us", tz="UTC")).dictionary_encode()
        assert _post(http, TIMES, _ipc({"vector": vectors, "id": [1, 2], "at": good})).status_code == 200
        assert [r["at"] for r in shoal.fold("Times", "1").to_pylist()] == [moment, moment]


# -- 5. guid texts ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["12-345678123412341234123456789abc", "1234-5678-1234-1234-1234-1234-5678-9abc"])
def test_guid_text_the_json_route_refuses_is_refused_everywhere(served: tuple[str, Settings], text: str) -> None:
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(GUIDS)
        as_json = [{"attributes": [{"key": "id", "value": {"int64": 1}}, {"key": "uid", "value": {"guid": text}}],
                    "vector": {"isSparse": False, "coordinates": [1, 0, 0]}}]
        rule = f"point 0, attribute 'uid': not a guid: {text!r}"
        _refused(http.post("/api/v1/upload/Guids/1", json=as_json), rule)
        _refused(_post(http, GUIDS, encode_arrow(np.eye(3, dtype=np.float32)[:1], {"id": [1], "uid": [text]})), rule)
        with pytest.raises(ValidationError, match="not a guid"):
            shoal.producer("Guids", "1").upload([DataPoint({"id": 1, "uid": text}, [1.0, 0.0, 0.0])])
        assert _head(shoal, GUIDS) == 0
        # The forms both take, canonical (lower case, hyphenated) once stored.
        forms = ["12345678-1234-1234-1234-123456789ABC", "12345678123412341234123456789abc",
                 "{12345678-1234-1234-1234-123456789abc}", "urn:uuid:12345678-1234-1234-1234-123456789abc"]
        body = encode_arrow(np.ones((4, 3), dtype=np.float32), {"id": [1, 2, 3, 4], "uid": forms})
        assert _post(http, GUIDS, body).status_code == 200
        assert {r["uid"] for r in shoal.fold("Guids", "1").to_pylist()} == {"12345678-1234-1234-1234-123456789abc"}


# -- 6. what the errors say ------------------------------------------------------------------------------------


def test_arrow_errors_say_what_was_sent_and_name_the_point(served: tuple[str, Settings]) -> None:
    url, settings = served
    vectors = _vectors([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    bad_text = pa.DictionaryArray.from_arrays(pa.array([0, 1], pa.int32()),
                                              pa.array([b"ok", b"\xff"], pa.binary()).view(pa.string()))
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(SPEC)
        for columns, message in [
            ({"vector": vectors, "id": [1, 2], "title": bad_text},
             "point 1, attribute 'title': text must be valid UTF-8"),
            ({"vector": _vectors([[1.0, 0.0, 0.0], [0.0, 1e39, 0.0]], pa.float64()), "id": [1, 2], "title": ["a", "b"]},
             "point 1, attribute 'vector': coordinates must be finite float32 values: 1e+39 at index 1 is past "
             "float32's range"),
            ({"vector": _vectors([[1.0, 0.0, 0.0], [0.0, None, 0.0]]), "id": [1, 2], "title": ["a", "b"]},
             "point 1, attribute 'vector': coordinates must be numbers, got null at index 1"),
            ({"vector": pa.array([[1.0, 0.0, 0.0], [0.0, 0.0, None]], pa.list_(pa.float64())), "id": [1, 2],
              "title": ["a", "b"]}, "point 1, attribute 'vector': coordinates must be numbers, got null at index 2"),
        ]:
            messages = _refused(_post(http, SPEC, _ipc(columns)), message)
            assert not any("NaN or infinity" in m for m in messages), messages
        assert _head(shoal, SPEC) == 0


def test_a_dictionary_of_wide_fixed_size_values_is_bounded_before_it_is_decoded(
    served: tuple[str, Settings],
) -> None:
    """Only text dictionaries were bounded: a 1 MiB fixed-size binary value referenced by every row made a body
    of about a megabyte decode to a gigabyte (600 rows grew the server by 1.2 GB) before the type was refused.
    Every dictionary is bounded by what it decodes to, and one of nested values is refused outright."""
    url, settings = served
    rows = settings.body_limit_bytes // (1 << 20) + 2  # decodes past the body limit by a couple of MiB
    wide = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, dtype=np.int32)),
                                          pa.array([b"x" * (1 << 20)], pa.binary(1 << 20)))
    vectors = _vectors([[1.0, 0.0, 0.0]] * rows)
    nested = pa.DictionaryArray.from_arrays(pa.array([0, 0], pa.int32()), pa.array([[1, 2]], pa.list_(pa.int8())))
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=60) as http:
        shoal.create_data_source(GUIDS)
        body = _ipc({"vector": vectors, "id": list(range(rows)), "uid": wide})
        assert len(body) < 2 << 20
        _refused(_post(http, GUIDS, body), "attribute 'uid'", "decodes to", "SHOAL_MAX_BODY_BYTES")
        body = _ipc({"vector": _vectors([[1.0, 0.0, 0.0]] * 2), "id": [1, 2], "uid": nested})
        _refused(_post(http, GUIDS, body), "attribute 'uid'", "no attribute's type")
        assert _head(shoal, GUIDS) == 0


# -- 7. tombstones-only bodies beside an attribute named `is_deleted` ----------------------------------------

# A soft-delete flag kept as an attribute, as the upgrade found it: the key `id` and a non-key `is_deleted`.
SOFT = DataSourceSpec("Soft", "1", 3, {"id": "int64", "is_deleted": "bool"}, ["id"])


def _deletes(table: pa.Table) -> list[tuple[str, int]]:
    """The batch's rows as (operation, id)."""
    return list(zip(table["__op"].to_pylist(), table["id"].to_pylist(), strict=True))


def test_a_body_without_vectors_takes_a_plain_is_deleted_as_the_tombstone_flags() -> None:
    """`encode_arrow(None, {"id": ...})` (and the earlier releases' `publish_columns`) writes the flags as a plain
    `is_deleted`: the consumer dead-lettered such a message ("missing vector column") on a data source with an
    attribute of that name, and the deletes were lost. A body with no vectors can hold tombstones only."""
    body = encode_arrow(None, {"id": [1, 2, 3]})
    assert pa.ipc.open_stream(body).schema.names == ["id", "is_deleted"]  # the form earlier releases wrote
    assert _deletes(codec.decode(SOFT, ARROW, body, 10)) == [("delete", 1), ("delete", 2), ("delete", 3)]
    # Hand-made in that form, with a row left an upsert: refused for its missing vector, as on any data source.
    mixed = _ipc({"id": [1, 2], "is_deleted": [True, False]})
    with pytest.raises(ValidationError, match="attribute 'vector': missing vector column"):
        codec.decode(SOFT, ARROW, mixed, 10)
    # Beside `__is_deleted`, or beside vectors, the plain column is still the attribute.
    flagged = _ipc({"id": [4], "is_deleted": [True], "__is_deleted": [True]})
    assert codec.decode(SOFT, ARROW, flagged, 10).to_pylist()[0]["__op"] == "delete"
    upsert = codec.decode(SOFT, ARROW, _ipc({"__vector": _vectors([[1.0, 0.0, 0.0]]), "id": [5],
                                             "is_deleted": [True]}), 10)
    assert (upsert["__op"].to_pylist(), upsert["is_deleted"].to_pylist()) == (["upsert"], [True])
    # A key attribute named `is_deleted`: the tombstone needs its value, so encode_arrow sends the flags in
    # `__is_deleted` and the plain column stays the key's.
    keyed = DataSourceSpec("Keyed", "1", 3, {"is_deleted": "bool", "id": "int64"}, ["id", "is_deleted"])
    table = codec.decode(keyed, ARROW, encode_arrow(None, {"id": [1, 1], "is_deleted": [True, False]}), 10)
    assert table.select(["__op", "id", "is_deleted"]).to_pylist() == [
        {"__op": "delete", "id": 1, "is_deleted": True}, {"__op": "delete", "id": 1, "is_deleted": False}]


def test_tombstones_in_the_earlier_form_delete_over_http(served: tuple[str, Settings]) -> None:
    url, settings = served
    vectors = np.eye(3, dtype=np.float32)
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(SOFT)
        body = encode_arrow(vectors, {"id": [1, 2, 3], "is_deleted": [False, True, False]})
        assert _post(http, SOFT, body).status_code == 200
        # The tombstones-only body an earlier release's publisher wrote: the key and a plain `is_deleted` flag.
        old = _ipc({"id": [1, 2], "is_deleted": [True, True]})
        response = _post(http, SOFT, old)
        assert response.status_code == 200, response.text
        state = {row["id"]: row for row in shoal.fold("Soft", "1").to_pylist()}
        assert sorted(state) == [3]
        assert (state[3]["is_deleted"], state[3]["__vector"]) == (False, [0.0, 0.0, 1.0])
        # Today's encode_arrow writes the same form for tombstones only.
        assert _post(http, SOFT, encode_arrow(None, {"id": [3]})).status_code == 200
        assert shoal.fold("Soft", "1").num_rows == 0
