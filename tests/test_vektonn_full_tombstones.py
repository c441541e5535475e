"""Vektonn's tombstones carry every attribute of the data source (its server wants all of them, and no other,
on every input data point): the upload route takes them, the key decides what is deleted, the other values
are checked for their type and otherwise ignored. Key-only tombstones keep working (HTTP and Python API)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import httpx
import numpy as np
import pytest

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.errors import ValidationError
from shoal.intake.codec import ARROW, encode_arrow
from shoal.log.records import DataPoint, Tombstone

# Two permanent attributes (the key) and one of every other type.
SPEC = DataSourceSpec(
    "Tomb", "1", 2,
    {"id": "int64", "region": "string", "title": "string", "score": "float64", "flag": "bool",
     "uid": "guid", "at": "datetime"},
    ["id", "region"],
)
URL = "/api/v1/upload/Tomb/1"


def _values(i: int, **changes: Any) -> dict[str, dict[str, Any]]:
    """The Vektonn attribute values of point `i` (one key per value slot), with `changes` applied."""
    values: dict[str, dict[str, Any]] = {
        "id": {"int64": i}, "region": {"string": "eu"}, "title": {"string": f"t{i}"},
        "score": {"float64": i / 2}, "flag": {"bool": i % 2 == 0}, "uid": {"guid": str(uuid.UUID(int=i))},
        "at": {"dateTime": "2026-01-02T03:04:05+00:00"},
    }
    values.update(changes)
    return values


def _attributes(values: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"key": k, "value": v} for k, v in values.items()]


def point(i: int) -> dict[str, Any]:
    return {"attributes": _attributes(_values(i)), "vector": {"isSparse": False, "coordinates": [float(i), 1.0]}}


def full_tombstone(i: int, **changes: Any) -> dict[str, Any]:
    """A tombstone as a Vektonn client sends it: every attribute, no vector."""
    return {"attributes": _attributes(_values(i, **changes)), "isDeleted": True}


def key_tombstone(i: int) -> dict[str, Any]:
    return {"attributes": _attributes({k: v for k, v in _values(i).items() if k in SPEC.permanent_attributes}),
            "isDeleted": True}


def live_ids(shoal: Shoal) -> list[int]:
    return sorted(shoal.fold("Tomb", "1")["id"].to_pylist())


def head(shoal: Shoal) -> int:
    return shoal.get_data_source("Tomb", "1").head_seq


@pytest.fixture
def api(served: tuple[str, Settings]) -> Any:
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(SPEC)
        yield shoal, http


def test_a_tombstone_with_every_attribute_deletes_by_its_key(api: Any) -> None:
    shoal, http = api
    r = http.post(URL, json=[point(i) for i in range(1, 7)])
    assert r.status_code == 200, r.text
    # Other values than the stored ones (another title, score, flag, guid, date): only the key decides.
    r = http.post(URL, json=[
        full_tombstone(2, title={"string": "whatever"}, score={"float64": -1.5}, flag={"bool": True},
                       uid={"guid": str(uuid.uuid4())}, at={"dateTime": "1999-12-31T23:59:59Z"}),
        full_tombstone(4),
    ])
    assert r.status_code == 200, r.text
    assert live_ids(shoal) == [1, 3, 5, 6]
    # Mixed in one batch with upserts and key-only tombstones, order kept.
    r = http.post(URL, json=[full_tombstone(5), point(2), key_tombstone(6), full_tombstone(1), point(7)])
    assert r.status_code == 200, r.text
    assert live_ids(shoal) == [2, 3, 7]
    # A tombstone whose key differs in one permanent attribute deletes nothing.
    r = http.post(URL, json=[full_tombstone(3, region={"string": "us"})])
    assert r.status_code == 200, r.text
    assert live_ids(shoal) == [2, 3, 7]


@pytest.mark.parametrize(
    ("changes", "attribute"),
    [
        ({"title": {"int64": 5}}, "title"),
        ({"score": {"string": "high"}}, "score"),
        ({"flag": {"bool": "yes"}}, "flag"),
        ({"uid": {"guid": "not-a-guid"}}, "uid"),
        ({"at": {"dateTime": "yesterday"}}, "at"),
    ],
)
def test_a_non_key_value_of_the_wrong_type_is_refused_naming_it(
    api: Any, changes: dict[str, Any], attribute: str
) -> None:
    shoal, http = api
    assert http.post(URL, json=[point(1), point(2)]).status_code == 200
    before = head(shoal)
    r = http.post(URL, json=[full_tombstone(1), full_tombstone(2, **changes)])
    assert r.status_code == 400, r.text
    messages = r.json()["errorMessages"]
    assert any(f"attribute '{attribute}'" in m for m in messages), messages
    assert head(shoal) == before and live_ids(shoal) == [1, 2]  # nothing written
    # The same tombstones with every value of its type are taken.
    assert http.post(URL, json=[full_tombstone(1), full_tombstone(2)]).status_code == 200
    assert live_ids(shoal) == []


def test_unknown_or_partial_attributes_stay_refused(api: Any) -> None:
    shoal, http = api
    assert http.post(URL, json=[point(1)]).status_code == 200
    before = head(shoal)
    unknown = full_tombstone(1)
    unknown["attributes"].append({"key": "colour", "value": {"string": "red"}})
    partial = key_tombstone(1)
    partial["attributes"].append({"key": "title", "value": {"string": "t1"}})
    for body, attribute in ((unknown, "colour"), (partial, "title")):
        r = http.post(URL, json=[body])
        assert r.status_code == 400, r.text
        assert any(f"attribute '{attribute}'" in m for m in r.json()["errorMessages"]), r.json()
    assert head(shoal) == before and live_ids(shoal) == [1]
    # Every attribute and no other: taken.
    assert http.post(URL, json=[full_tombstone(1)]).status_code == 200
    assert live_ids(shoal) == []


def test_arrow_tombstones_with_every_attribute(api: Any) -> None:
    shoal, http = api
    assert http.post(URL, json=[point(i) for i in range(1, 5)]).status_code == 200
    n = 2
    columns: dict[str, Any] = {
        "id": [1, 3], "region": ["eu"] * n, "title": ["x", "y"], "score": [0.5, 9.0], "flag": [True, False],
        "uid": [str(uuid.uuid4()) for _ in range(n)],
        "at": [dt.datetime(2020, 1, 1, tzinfo=dt.UTC)] * n,
    }
    body = encode_arrow(np.zeros((n, 2), dtype=np.float32), columns, deleted=[True] * n)
    r = http.post(URL, content=body, headers={"Content-Type": ARROW})
    assert r.status_code == 200, r.text
    assert live_ids(shoal) == [2, 4]
    # The same form with a non-key column of the wrong type: refused naming it, nothing written.
    before = head(shoal)
    bad = encode_arrow(np.zeros((1, 2), dtype=np.float32), {**{k: v[:1] for k, v in columns.items()},
                                                           "id": [2], "score": ["high"]}, deleted=[True])
    r = http.post(URL, content=bad, headers={"Content-Type": ARROW})
    assert r.status_code == 400, r.text
    assert any("score" in m for m in r.json()["errorMessages"]), r.json()
    assert head(shoal) == before and live_ids(shoal) == [2, 4]


def test_python_api_takes_both_forms_and_checks_types(local_shoal: Shoal) -> None:
    local_shoal.create_data_source(SPEC)
    producer = local_shoal.producer("Tomb", "1")
    attrs = {"id": 0, "region": "eu", "title": "t", "score": 1.0, "flag": True, "uid": str(uuid.UUID(int=1)),
             "at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC)}
    producer.upload([DataPoint({**attrs, "id": i}, [float(i), 0.0]) for i in range(1, 5)])
    producer.upload([Tombstone({"id": 1, "region": "eu"}), Tombstone({**attrs, "id": 2, "title": "other"})])
    producer.delete({"id": [3], "region": ["eu"]})
    assert sorted(local_shoal.fold("Tomb", "1")["id"].to_pylist()) == [4]
    with pytest.raises(ValidationError) as err:
        producer.upload([Tombstone({**attrs, "id": 4, "score": "high"})])
    assert (err.value.problems[0].position, err.value.problems[0].attribute) == (0, "score")
    assert sorted(local_shoal.fold("Tomb", "1")["id"].to_pylist()) == [4]
