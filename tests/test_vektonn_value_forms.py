"""Vektonn JSON values read as Vektonn's server reads them (System.Text.Json with its web defaults, which include
NumberHandling.AllowReadingFromString), over real HTTP (a served uvicorn app, the session's Postgres).

dateTime: only the ISO 8601 extended form System.Text.Json reads into a DateTime (JsonHelpers.TryParseAsISO):
YYYY-MM-DD alone (midnight), or followed by THH:MM, then optionally :SS and a fraction of 1 to 16 digits (.NET
keeps the first 7 and reads the rest as zeros; Shoal keeps 6, see below), then optionally Z or an offset +HH or
+HH:MM of at most 14 hours. Refused, as .NET refuses them: digit strings pydantic read as Unix seconds ("2021",
"20210101", which were stored as instants in 1970), a space for the T, a lower-case t or z, a basic-form offset
("+0300"), hour 24 ("T24:00"), a fraction of 17 digits or more, an offset past 14 hours. Choices: the offset of
hours alone ("+03") and the 8 to 16 digit fractions are accepted, as .NET's parser accepts them; an offset's range
(+14:00 at most) is .NET's DateTimeOffset's.

Below the microsecond (.NET's DateTime.UtcNow is written with 7 fraction digits): a payload attribute (neither
id nor split, so not part of the point's key) is floored to the microsecond, where Shoal stores it; a permanent
attribute's (a data point's or a tombstone's) and a split filter's is still refused, since flooring it could make
two keys 100 ns apart one point, or compare another instant.

Coordinates: a JSON boolean is no coordinate (Vektonn: 400, a double cannot be read from true); a decimal string
("1.5", or "7" for a sparse index) is read, as AllowReadingFromString reads double[] and int[], with the rules of
the int64/float64 slots (no "NaN" or "Infinity", no spaces) and every coordinate rule after it (finite float32).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.log.records import IndexSpec

STRONG = {"X-Shoal-Consistency": "strong"}
KEY_DAY = "2021-01-01T00:00:00Z"


@pytest.fixture
def http(served: tuple[str, Settings]) -> Iterator[httpx.Client]:
    """A client of a served API with two data sources and their indexes: `Forms` (dense, 2-d, key id + split
    attribute `day`, payload `at`) and `Bag` (sparse, 10-d, key id)."""
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as client:
        shoal.create_data_source(DataSourceSpec(
            "Forms", "1", 2, {"id": "int64", "day": "datetime", "at": "datetime"}, ["id", "day"]
        ))
        shoal.create_index(IndexSpec("Forms.Index", "1", "Forms", "1", algorithm="FaissIndex.L2",
                                     id_attributes=["id"], split_attributes=["day"]))
        shoal.create_data_source(DataSourceSpec("Bag", "1", 10, {"id": "int64"}, ["id"], vectors_are_sparse=True))
        shoal.create_index(IndexSpec("Bag.Index", "1", "Bag", "1", algorithm="SparnnIndex.Cosine"))
        yield client


def point(i: int, at: str = "2021-06-01T12:00:00Z", day: str = KEY_DAY, coordinates: Any = (0.0, 0.0),
          deleted: bool = False) -> dict[str, Any]:
    attributes = {"id": {"int64": i}, "day": {"dateTime": day}, "at": {"dateTime": at}}
    out: dict[str, Any] = {"attributes": [{"key": k, "value": v} for k, v in attributes.items()]}
    if deleted:
        return {**out, "isDeleted": True}
    return {**out, "vector": {"isSparse": False, "coordinates": list(coordinates)}}


def refused(r: httpx.Response) -> str:
    """The one error message of a 400 answer, without the prefix an upload's carries."""
    assert r.status_code == 400, r.text
    messages = r.json()["errorMessages"]
    assert len(messages) == 1, messages
    return str(messages[0]).removeprefix("invalid input, nothing written: ")


def stored(http: httpx.Client, day: str = KEY_DAY, k: int = 20,
           coordinates: Any = (0.0, 0.0)) -> dict[int, dict[str, Any]]:
    """{id: {attribute: value, "vector": coordinates}} for the points of split `day` a strong search finds."""
    query = {"k": k, "retrieveVectors": True, "queryVectors": [{"isSparse": False, "coordinates": list(coordinates)}],
             "splitFilter": [{"key": "day", "value": {"dateTime": day}}]}
    r = http.post("/api/v1/search/Forms.Index/1", json=query, headers=STRONG)
    assert r.status_code == 200, r.text
    out = {}
    for hit in r.json()[0]["nearestDataPoints"]:
        values = {a["key"]: next(iter(a["value"].values())) for a in hit["attributes"]}
        out[values["id"]] = {**values, "vector": hit["vector"]["coordinates"]}
    return out


@pytest.mark.parametrize("text", [
    "2021", "20210101", "1609459200", "2021-01-01 00:00:00", "2021-01-01t00:00:00z", "2021-01-01T00:00:00+0300",
    "2021-01-01T24:00", "2021-01-01T00:00:00.12345678901234567Z", "2021-01-01T00:00+14:30", "2021-01-01T10",
])
def test_a_datetime_vektonn_would_not_read_is_refused(http: httpx.Client, text: str) -> None:
    """Before: 200, "2021" stored as 1970-01-01T00:33:41Z and "20210101" as 1970-08-22T21:55:01Z (Unix seconds),
    the other forms taken as pydantic read them."""
    message = refused(http.post("/api/v1/upload/Forms/1", json=[point(1), point(2, at=text)]))
    assert message == f"point 1, attribute 'at': not an ISO 8601 date and time: {text!r}"
    assert stored(http) == {}  # nothing written


def test_the_datetime_forms_vektonn_reads_are_stored_as_the_instant_they_name(http: httpx.Client) -> None:
    sent = {1: "2021-01-02", 2: "2021-01-02T03:04", 3: "2021-01-02T03:04Z", 4: "2021-01-02T06:04+03",
            5: "2021-01-02T06:04:00.5+03:00", 6: "2021-01-01T13:04-14:00", 7: "2021-01-02T03:04:05.123456789012Z"}
    r = http.post("/api/v1/upload/Forms/1", json=[point(i, at=text) for i, text in sent.items()])
    assert r.status_code == 200, r.text
    assert {i: p["at"] for i, p in stored(http).items()} == {
        1: "2021-01-02T00:00:00Z", 2: "2021-01-02T03:04:00Z", 3: "2021-01-02T03:04:00Z", 4: "2021-01-02T03:04:00Z",
        5: "2021-01-02T03:04:00.500000Z", 6: "2021-01-02T03:04:00Z", 7: "2021-01-02T03:04:05.123456Z",
    }


def test_a_payload_datetime_below_the_microsecond_is_floored_a_key_one_refused(http: httpx.Client) -> None:
    """.NET's client writes DateTime.UtcNow with 7 fraction digits. Before: refused (400) in any attribute."""
    r = http.post("/api/v1/upload/Forms/1", json=[point(1, at="2026-11-28T12:49:45.1234567Z"),
                                                  point(2, at="2026-11-28T12:49:45.9999999Z")])
    assert r.status_code == 200, r.text
    assert {i: p["at"] for i, p in stored(http).items()} == {
        1: "2026-11-28T12:49:45.123456Z", 2: "2026-11-28T12:49:45.999999Z"
    }
    # The split attribute is part of the key: two such points 100 ns apart must not become one.
    day = "2021-01-01T00:00:00.0000001Z"
    for body in ([point(3, day=day)], [point(3, day=day, deleted=True)]):
        message = refused(http.post("/api/v1/upload/Forms/1", json=body))
        assert message == ("point 0, attribute 'day': has sub-microsecond precision; datetimes are stored in "
                           "microseconds")
    query = {"k": 1, "queryVectors": [{"isSparse": False, "coordinates": [0, 0]}],
             "splitFilter": [{"key": "day", "value": {"dateTime": day}}]}
    assert "sub-microsecond" in refused(http.post("/api/v1/search/Forms.Index/1", json=query))


def test_booleans_are_no_coordinates(http: httpx.Client) -> None:
    """Before: 200, true and false stored (and searched with) as 1 and 0."""
    for coordinates in ([True, False], [0.5, True], [1, False]):
        message = refused(http.post("/api/v1/upload/Forms/1", json=[point(1, coordinates=coordinates)]))
        index = 0 if coordinates[0] is True else 1
        assert message == f"point 0, attribute 'vector': coordinates must be JSON numbers, got boolean at index {index}"
    sparse = {"attributes": [{"key": "id", "value": {"int64": 1}}],
              "vector": {"isSparse": True, "coordinates": [True], "coordinateIndices": [3]}}
    assert "got boolean at index 0" in refused(http.post("/api/v1/upload/Bag/1", json=[sparse]))
    query = {"k": 1, "queryVectors": [{"isSparse": False, "coordinates": [True, False]}]}
    assert refused(http.post("/api/v1/search/Forms.Index/1", json=query)) == (
        "invalid query: point 0, attribute 'queryVectors': coordinates must be JSON numbers, got boolean at index 0"
    )
    assert stored(http) == {}
    # 0 and 1 as numbers are coordinates, of course.
    assert http.post("/api/v1/upload/Forms/1", json=[point(1, coordinates=[1, 0.0])]).status_code == 200
    assert stored(http)[1]["vector"] == [1.0, 0.0]


def test_coordinates_written_as_strings_are_read_as_numbers(http: httpx.Client) -> None:
    """Before: 400 "coordinates must be JSON numbers, got string" for each of these."""
    body = [point(1, coordinates=["1.5", "2"]), point(2, coordinates=[3, "-4e0"])]
    r = http.post("/api/v1/upload/Forms/1", json=body)
    assert r.status_code == 200, r.text
    assert {i: p["vector"] for i, p in stored(http).items()} == {1: [1.5, 2.0], 2: [3.0, -4.0]}
    query = {"k": 1, "queryVectors": [{"isSparse": False, "coordinates": ["3", "-4"]}],
             "splitFilter": [{"key": "day", "value": {"dateTime": KEY_DAY}}]}
    r = http.post("/api/v1/search/Forms.Index/1", json=query, headers=STRONG)
    assert r.status_code == 200, r.text
    assert r.json()[0]["nearestDataPoints"][0]["attributes"][0] == {"key": "id", "value": {"int64": 2}}

    sparse = {"attributes": [{"key": "id", "value": {"int64": 1}}],
              "vector": {"isSparse": True, "coordinates": ["0.5", 2], "coordinateIndices": ["7", 1]}}
    assert http.post("/api/v1/upload/Bag/1", json=[sparse]).status_code == 200
    query = {"k": 1, "retrieveVectors": True,
             "queryVectors": [{"isSparse": True, "coordinates": ["1"], "coordinateIndices": ["7"]}]}
    r = http.post("/api/v1/search/Bag.Index/1", json=query, headers=STRONG)
    assert r.status_code == 200, r.text
    hit = r.json()[0]["nearestDataPoints"][0]
    assert sorted(zip(hit["vector"]["coordinateIndices"], hit["vector"]["coordinates"], strict=True)) == [
        (1, 2.0), (7, 0.5)
    ]


@pytest.mark.parametrize(("coordinates", "says"), [
    (["NaN", "1"], "coordinates must be JSON numbers, got string 'NaN' at index 0, which spells no decimal number"),
    (["1", "Infinity"], "got string 'Infinity' at index 1, which spells no decimal number"),
    ([" 1", "2"], "got string ' 1' at index 0"),
    (["1", "0x10"], "got string '0x10' at index 1"),
    (["1e400", "1"], "coordinates must be finite (NaN or infinity at index 0)"),
    (["1e39", "1"], "1e+39 at index 0 is past float32's range"),
])
def test_a_coordinate_string_that_spells_no_finite_number_is_refused(http: httpx.Client, coordinates: list[str],
                                                                     says: str) -> None:
    message = refused(http.post("/api/v1/upload/Forms/1", json=[point(1, coordinates=coordinates)]))
    assert message.startswith("point 0, attribute 'vector': ") and says in message, message


def test_a_sparse_index_string_that_spells_no_integer_is_refused(http: httpx.Client) -> None:
    for indices, says in ((["1.0"], "coordinateIndices[0] must be a JSON integer, got string '1.0', which spells "
                                    "no decimal integer"),
                          ([True], "coordinateIndices[0] must be a JSON integer, got boolean"),
                          (["11"], "sparse index out of range 0..9")):
        query = {"k": 1, "queryVectors": [{"isSparse": True, "coordinates": [1.0], "coordinateIndices": indices}]}
        assert says in refused(http.post("/api/v1/search/Bag.Index/1", json=query))
