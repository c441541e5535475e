"""Datetimes are kept to the microsecond: a key with non-zero digits below it (as .NET writes DateTime: seven
fractional digits, 100 ns ticks) is refused, never floored into another instant, in a Vektonn JSON upload (two
keys 100 ns apart became one point), and so is a filter operand (`$lt` the next microsecond missed the stored
one); a value that is no key is floored. Trailing zeros are whole microseconds and are taken. A tombstone's
non-key values are never stored: only their type counts.
Dataset metadata is schemaless: a stored string with such digits compares as the instant it spells."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from shoal import DataPoint, DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.errors import QueryError, ValidationError
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec
from shoal.log.validation import SUB_MICROSECOND
from shoal.searcher.consistency import Consistency
from shoal.vektonn import upload_json
from shoal.vektonn.upload_json import decode_upload

SPEC = DataSourceSpec("Ev", "1", 2, {"at": "datetime", "n": "int64", "when": "datetime"}, ["at"])
UPLOAD = "/api/v1/upload/Ev/1"
AT = dt.datetime(2024, 1, 1, 0, 0, 0, 123456, tzinfo=dt.UTC)  # "2024-01-01T00:00:00.123456Z"
DAY = "2024-01-01T00:00:00."
BELOW_US = "filter value {!r} has sub-microsecond precision; datetimes are kept to the microsecond"


def point(at: str, n: int, when: str = "2024-02-01T00:00:00Z") -> dict[str, Any]:
    """A Vektonn input data point keyed by the dateTime text `at`."""
    return {"attributes": [{"key": "at", "value": {"dateTime": at}}, {"key": "n", "value": {"int64": n}},
                           {"key": "when", "value": {"dateTime": when}}],
            "vector": {"isSparse": False, "coordinates": [float(n), 1.0]}}


def tombstone(at: str, when: str | None = None) -> dict[str, Any]:
    """A tombstone keyed by `at`; with `when`, in Vektonn's form (every attribute)."""
    attributes = [{"key": "at", "value": {"dateTime": at}}]
    if when is not None:
        attributes += [{"key": "n", "value": {"int64": 0}}, {"key": "when", "value": {"dateTime": when}}]
    return {"attributes": attributes, "isDeleted": True}


def stored(shoal: Shoal) -> list[tuple[dt.datetime, int]]:
    return sorted((r["at"], r["n"]) for r in shoal.fold("Ev", "1").select(["at", "n"]).to_pylist())


def head(shoal: Shoal) -> int:
    return shoal.get_data_source("Ev", "1").head_seq


def errors(r: httpx.Response) -> list[str]:
    assert r.status_code == 400, r.text
    return [m.removeprefix("invalid input, nothing written: ") for m in r.json()["errorMessages"]]


@pytest.fixture
def api(served: tuple[str, Settings]) -> Iterator[tuple[Shoal, httpx.Client]]:
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(SPEC)
        shoal.create_index(IndexSpec("EvI", "1", "Ev", "1", algorithm="flat", metric="euclidean"))
        yield shoal, http


# -- uploads ----------------------------------------------------------------------------------------------------


def test_an_upload_of_two_keys_apart_below_a_microsecond_is_refused_and_writes_nothing(
    api: tuple[Shoal, httpx.Client],
) -> None:
    shoal, http = api
    r = http.post(UPLOAD, json=[point(DAY + "1234561Z", 1), point(DAY + "1234569Z", 2)])
    assert errors(r) == [f"point 0, attribute 'at': {SUB_MICROSECOND}", f"point 1, attribute 'at': {SUB_MICROSECOND}"]
    assert (head(shoal), stored(shoal)) == (0, [])
    # A key in nanoseconds (nine digits) too; a comma is no decimal mark to .NET's reader, nor here.
    r = http.post(UPLOAD, json=[point(DAY + "1234560Z", 1), point(DAY + "123457001Z", 2)])
    assert errors(r) == [f"point 1, attribute 'at': {SUB_MICROSECOND}"]
    r = http.post(UPLOAD, json=[point(DAY + "1234560Z", 1), point("2024-01-01T00:00:00,1234579+01:00", 3)])
    assert errors(r) == ["point 1, attribute 'at': not an ISO 8601 date and time: '2024-01-01T00:00:00,1234579+01:00'"]
    assert (head(shoal), stored(shoal)) == (0, [])
    # Trailing zeros spell whole microseconds (.NET writes seven digits): taken, each as its own instant.
    r = http.post(UPLOAD, json=[point(DAY + "1234560Z", 1), point(DAY + "123457000Z", 2)])
    assert r.status_code == 200, r.text
    assert stored(shoal) == [(AT, 1), (AT + dt.timedelta(microseconds=1), 2)]


def test_a_payload_value_below_a_microsecond_is_floored(api: tuple[Shoal, httpx.Client]) -> None:
    """A value that is no key (no point's identity hangs on it) is floored to the microsecond, as .NET's client
    writes DateTime.UtcNow with seven digits: refused, nine uploads in ten of a current time failed."""
    shoal, http = api
    r = http.post(UPLOAD, json=[point(DAY + "123456Z", 1, when=DAY + "1234569Z"),
                                point(DAY + "123457Z", 2, when=DAY + "000000001Z")])
    assert r.status_code == 200, r.text
    whens = sorted(row["when"] for row in shoal.fold("Ev", "1").select(["when"]).to_pylist())
    assert whens == [AT - dt.timedelta(microseconds=123456), AT]


def test_the_fast_and_the_exact_decoder_judge_digits_below_a_microsecond_alike() -> None:
    """A clean batch takes the column-wise fast path; keys spelled in another case take the exact path (the
    former DTO path's rules): the same table, or the same problems, either way."""

    def body(*ats: str, case: Any = str) -> bytes:
        return orjson.dumps([{case("attributes"): point(at, i)["attributes"], "vector": point(at, i)["vector"]}
                             for i, at in enumerate(ats)])

    def decoded(raw: bytes) -> Any:
        try:
            return decode_upload(SPEC, raw, 100)
        except ValidationError as exc:
            return [(p.position, p.attribute, p.rule) for p in exc.problems]

    whole = (DAY + "1234560Z", DAY + "123457000+00:00", "2024-01-01T00:00:00.1234580")
    assert upload_json._fast_batch(SPEC, orjson.loads(body(*whole)), 100) is not None  # still the fast path
    table = decoded(body(*whole))
    assert table["at"].to_pylist() == [AT + dt.timedelta(microseconds=i) for i in range(3)]
    assert decoded(body(*whole, case=str.upper)).equals(table)
    # Seven digits and nine.
    below = (DAY + "1234560Z", DAY + "1234561Z", DAY + "123456001Z", DAY + "123456Z")
    assert upload_json._fast_batch(SPEC, orjson.loads(body(*below)), 100) is None
    refused = [(i, "at", SUB_MICROSECOND) for i in (1, 2)]
    assert decoded(body(*below)) == decoded(body(*below, case=str.upper)) == refused
    # A Unix time in seconds (or milliseconds) sent as a string is no ISO 8601 text: pydantic read it as one.
    unix = (DAY + "1234560Z", "1704067200.1234569", "1704067200123.4569", "1704067200.123456")
    refused = [(i, "at", f"not an ISO 8601 date and time: {unix[i]!r}") for i in (1, 2, 3)]
    assert decoded(body(*unix)) == decoded(body(*unix, case=str.upper)) == refused


def test_a_tombstone_is_judged_by_the_instant_its_key_spells(api: tuple[Shoal, httpx.Client]) -> None:
    shoal, http = api
    r = http.post(UPLOAD, json=[point(DAY + "123456Z", 1), point(DAY + "123457Z", 2)])
    assert r.status_code == 200, r.text
    before = head(shoal)
    # A key 100 ns past the first point's: it is no stored key, and flooring it deleted the first point.
    for item in (tombstone(DAY + "1234561Z"), tombstone(DAY + "1234561Z", when="2024-02-01T00:00:00Z")):
        assert errors(http.post(UPLOAD, json=[item])) == [f"point 0, attribute 'at': {SUB_MICROSECOND}"]
    assert head(shoal) == before and len(stored(shoal)) == 2
    # The first point's key in seven digits deletes it; a non-key value of a tombstone is never stored, so only
    # its type is checked (as for an Arrow tombstone column), digits below a microsecond included.
    r = http.post(UPLOAD, json=[tombstone(DAY + "1234560Z", when=DAY + "0000001Z")])
    assert r.status_code == 200, r.text
    assert stored(shoal) == [(AT + dt.timedelta(microseconds=1), 2)]


# -- filters ----------------------------------------------------------------------------------------------------


def test_filter_operands_below_a_microsecond_are_refused_naming_the_operand(make_shoal: Any) -> None:
    """Through the Python API, over a built segment (as p4 of the review found it) and a log tail."""
    shoal = make_shoal()
    shoal.create_data_source(SPEC)
    index = shoal.create_index(IndexSpec("EvI", "1", "Ev", "1", algorithm="flat", metric="euclidean"))
    later = dt.datetime(2024, 2, 1, tzinfo=dt.UTC)
    shoal.producer("Ev", "1").upload([DataPoint({"at": AT, "n": 1, "when": later}, [1.0, 0.0])])
    for shard in index.shards:
        ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
    token = shoal.producer("Ev", "1").upload([DataPoint({"at": AT + dt.timedelta(seconds=1), "n": 2,
                                                         "when": later}, [0.0, 1.0])])
    searcher = shoal.searcher()

    def hits(filters: Any) -> list[int]:
        [found] = searcher.search("EvI", "1", [[1.0, 0.0]], 5, filters=filters,
                                  consistency=Consistency.at_least(token))
        return sorted(found.column("n"))

    # Floored, the first three answered 0, 1 and 1 hits of the first point: it is before ...1234569, not ...1234561.
    for name, operand, flt in (
        ("at", DAY + "1234569Z", {"at": {"$lt": DAY + "1234569Z"}}),
        ("at", DAY + "1234561Z", {"at": {"$gte": DAY + "1234561Z"}}),
        ("at", DAY + "1234561Z", {"at": DAY + "1234561Z"}),
        ("at", DAY + "123456001+00:00", {"$or": [{"n": 2}, {"at": {"$in": [DAY + "123456001+00:00"]}}]}),
        ("when", DAY + "1234561", {"$not": {"when": {"$ne": DAY + "1234561"}}}),
    ):
        with pytest.raises(QueryError) as refused:
            hits(flt)
        assert f"attribute '{name}': {BELOW_US.format(operand)}" in str(refused.value), flt
    # Whole microseconds in seven or nine digits compare as the instant they spell.
    assert hits({"at": DAY + "1234560Z"}) == [1]
    assert hits({"at": {"$lt": DAY + "123457000Z"}}) == [1]
    assert hits({"at": {"$gte": DAY + "1234570Z"}}) == [2]
    assert hits({"at": {"$in": [DAY + "1234560+00:00", "2024-01-01T00:00:01.1234560Z"]}}) == [1, 2]


def test_vektonn_search_filters_below_a_microsecond_are_refused(api: tuple[Shoal, httpx.Client]) -> None:
    """The search body's `filter` (Shoal's) and `splitFilter` (Vektonn's): 400 naming the attribute."""
    shoal, http = api
    # A split attribute is part of the key, next to another.
    shoal.create_data_source(DataSourceSpec("Sp", "1", 2, {"at": "datetime", "n": "int64"}, ["at", "n"]))
    shoal.create_index(IndexSpec("SpI", "1", "Sp", "1", algorithm="flat", metric="euclidean", split_attributes=["at"]))
    tokens = {}
    for source, index in (("Ev", "EvI"), ("Sp", "SpI")):
        attributes = point(DAY + "1234560Z", 1)["attributes"][: 3 if source == "Ev" else 2]
        r = http.post(f"/api/v1/upload/{source}/1", json=[{"attributes": attributes,
                                                          "vector": {"isSparse": False, "coordinates": [1.0, 1.0]}}])
        assert r.status_code == 200, r.text
        tokens[index] = r.headers["X-Shoal-Write-Token"]  # the search reads the log up to it

    def search(index: str, **extra: Any) -> httpx.Response:
        query = {"k": 5, "queryVectors": [{"isSparse": False, "coordinates": [1.0, 1.0]}]}
        return http.post(f"/api/v1/search/{index}/1", json=query | extra,
                         headers={"X-Shoal-Required-Token": tokens[index]})

    def refused(r: httpx.Response) -> str:
        assert r.status_code == 400, r.text
        [message] = r.json()["errorMessages"]
        return str(message)

    def found(r: httpx.Response) -> list[int]:
        assert r.status_code == 200, r.text
        return [next(a["value"]["int64"] for a in p["attributes"] if a["key"] == "n")
                for p in r.json()[0]["nearestDataPoints"]]

    operand = DAY + "1234561Z"
    assert f"attribute 'at': {BELOW_US.format(operand)}" in refused(search("EvI", filter={"at": {"$lte": operand}}))
    split = [{"key": "at", "value": {"dateTime": operand}}]
    assert f"attribute 'at': {SUB_MICROSECOND}" in refused(search("SpI", splitFilter=split))
    # Whole microseconds written in seven digits find the point, as filter and as split.
    assert found(search("EvI", filter={"at": DAY + "1234560Z"})) == [1]
    assert found(search("SpI", splitFilter=[{"key": "at", "value": {"dateTime": DAY + "1234560Z"}}])) == [1]


def test_dataset_metadata_datetimes_compare_to_the_digit(served: tuple[str, Settings]) -> None:
    """Metadata is schemaless: stored strings with digits below a microsecond compare as the instants they spell
    (they were floored), and a filter operand with such digits is refused naming the field."""
    url, _ = served
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/api/v1/datasets", json={"name": "dd", "dimensions": 2, "metric_type": "euclidean",
                                                "index_type": "flat"})
        assert r.status_code == 201, r.text
        published = [DAY + "123456Z", DAY + "1234569Z", DAY + "1234570Z"]
        vectors = [{"id": f"v{i}", "values": [float(i), 0.0], "metadata": {"published": p}}
                   for i, p in enumerate(published)]
        r = http.post("/api/v1/datasets/dd/vectors", json={"vectors": vectors})
        assert r.status_code == 200, r.text
        token = int(r.json()["write_token"])

        def search(filters: Any) -> httpx.Response:
            return http.post("/api/v1/datasets/dd/search", json={"vector": [0.0, 0.0], "top_k": 5,
                                                                 "min_write_token": token, "filters": filters})

        def ids(filters: Any) -> list[str]:
            r = search(filters)
            assert r.status_code == 200, r.text
            return sorted(h["id"] for h in r.json()["results"])

        assert ids({"published": {"$gt": DAY + "123456Z"}}) == ["v1", "v2"]
        assert ids({"published": {"$lte": DAY + "123456Z"}}) == ["v0"]
        assert ids({"published": DAY + "123456Z"}) == ["v0"]
        assert ids({"published": {"$ne": DAY + "123456Z"}}) == ["v1", "v2"]
        assert ids({"metadata.published": {"$lt": DAY + "1234570Z"}}) == ["v0", "v1"]
        assert ids({"published": {"$in": [DAY + "123457Z", DAY + "1234560Z"]}}) == ["v0", "v2"]
        for flt in ({"published": {"$gte": DAY + "1234561Z"}}, {"published": {"$nin": [DAY + "1234569Z"]}}):
            r = search(flt)
            assert r.status_code == 400 and r.json()["error_code"] == "VALIDATION_ERROR", r.text
            operand = DAY + ("1234561Z" if "$gte" in flt["published"] else "1234569Z")
            assert f"'published': {BELOW_US.format(operand)}" in r.json()["message"], r.text


def test_a_cli_split_value_below_a_microsecond_is_refused() -> None:
    """`shoal search --split at=...`: fromisoformat floored the digits past the sixth, naming another instant."""
    from shoal.cli.search import split_value
    from shoal.errors import ValidationError
    from shoal.log.records import AttributeType

    whole = split_value(AttributeType.DATETIME, "at", "2024-01-01T00:00:00.1234560+00:00")
    assert whole.microsecond == 123456
    with pytest.raises(ValidationError, match="sub-microsecond"):
        split_value(AttributeType.DATETIME, "at", "2024-01-01T00:00:00.1234561+00:00")


@pytest.mark.parametrize("zone", ["Asia/Tokyo", "America/New_York"])
def test_naive_extremes_are_utc_whatever_the_hosts_zone(zone: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """.NET's DateTime.MinValue and MaxValue, naive: taken as UTC on both decoders. The exact one converted them
    through the host's zone first: east of UTC year 1 raised ValueError (a 500), west of it year 9999 was
    refused as out of range, while the fast path took both."""
    import time

    monkeypatch.setenv("TZ", zone)
    time.tzset()
    try:
        ats = ("0001-01-01T00:00:00", "9999-12-31T23:59:59")
        items = [point(at, i) for i, at in enumerate(ats)]
        for case in (str, str.upper):  # the fast path, and the exact one (keys in another case)
            body = orjson.dumps([{case(k): v for k, v in item.items()} for item in items])
            table = decode_upload(SPEC, body, 10)
            assert table["at"].to_pylist() == [dt.datetime(1, 1, 1, tzinfo=dt.UTC),
                                               dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC)]
    finally:
        monkeypatch.undo()  # the zone the process had
        time.tzset()
