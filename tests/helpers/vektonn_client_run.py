"""Drives Shoal's HTTP API with the real Vektonn Python client (the `vektonn` package, unchanged), in a venv of
its own: the client needs pydantic 1, the project pydantic 2. Run as `python vektonn_client_run.py BASE_URL`;
prints one JSON document of what the client got, for tests/test_vektonn_client.py to check.

The data source it expects: `Client.Source/1` (2-d, key `id` int64 + `region` string; also `uid` guid, `flag`
bool, `score` float64, `at` datetime), indexed flat/euclidean by `Client.Index/1` with split attribute `region`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sys
import time
import uuid
from typing import Any

from vektonn import Vektonn, VektonnApiError, VektonnAsync
from vektonn.dtos import Attribute, AttributeValue, InputDataPoint, SearchQuery, Vector

SOURCE, INDEX = ("Client.Source", "1"), ("Client.Index", "1")
UID = uuid.UUID("5f0c8b0e-3c1a-4d2e-9a7b-0123456789ab")
AT = dt.datetime(2024, 3, 1, 12, 30, tzinfo=dt.UTC)


def key(i: int, region: str) -> list[Attribute]:
    return [Attribute(key="id", value=AttributeValue(int64=i)),
            Attribute(key="region", value=AttributeValue(string=region))]


def point(i: int, x: float, region: str = "eu") -> InputDataPoint:
    return InputDataPoint(
        attributes=key(i, region) + [
            Attribute(key="uid", value=AttributeValue(guid=UID)),
            Attribute(key="flag", value=AttributeValue(bool=i % 2 == 0)),
            Attribute(key="score", value=AttributeValue(float64=i / 4)),
            Attribute(key="at", value=AttributeValue(date_time=AT)),
        ],
        vector=Vector(is_sparse=False, coordinates=[x, 0.0]),
    )


def dense(*coordinates: float) -> Vector:
    return Vector(is_sparse=False, coordinates=list(coordinates))


def hits(results: list[Any]) -> list[list[dict[str, Any]]]:
    """Each query's hits as the client parsed them: attributes by key (typed values made JSON), distance, vector."""
    out = []
    for result in results:
        found = []
        for p in result.nearest_data_points:
            attrs = {a.key: a.value.dict(exclude_none=True) for a in p.attributes}
            found.append({
                "id": attrs["id"]["int64"], "region": attrs["region"]["string"],
                "uid_ok": attrs["uid"]["guid"] == UID, "flag": attrs["flag"]["bool"],
                "score": attrs["score"]["float64"], "at_ok": attrs["at"]["date_time"] == AT,
                "distance": p.distance, "vector": None if p.vector is None else p.vector.coordinates,
            })
        out.append(found)
    return out


def until(what: Any, done: Any, timeout_s: float = 30.0) -> Any:
    """`what()` once `done(result)` holds (eventual searches catch up within a poll), or its last result."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = what()
        if done(result) or time.monotonic() > deadline:
            return result
        time.sleep(0.02)


def error(call: Any) -> dict[str, Any]:
    try:
        call()
    except VektonnApiError as exc:
        return {"status": exc.status, "messages": exc.error.error_messages if exc.error else None}
    return {"status": 200}


def main(url: str) -> None:
    client = Vektonn(url)
    report: dict[str, Any] = {}
    client.upload(*SOURCE, [point(i, float(i)) for i in range(5)] + [point(10, 0.5, "us")])
    query = SearchQuery(query_vectors=[dense(0.0, 0.0), dense(4.0, 0.0)], k=3, retrieveVectors=True)
    report["first"] = hits(client.search(*INDEX, query))
    report["split"] = hits(client.search(*INDEX, SearchQuery(
        split_filter=[Attribute(key="region", value=AttributeValue(string="us"))],
        query_vectors=[dense(0.0, 0.0)], k=3), request_timeout_seconds=10))
    # Vektonn tombstones: the key alone, and every attribute as its own server requires (no vector).
    client.upload(*SOURCE, [InputDataPoint(attributes=key(0, "eu"), is_deleted=True)])
    full = point(1, 1.0)
    client.upload(*SOURCE, [InputDataPoint(attributes=full.attributes, is_deleted=True)])
    report["after_delete"] = hits(until(lambda: client.search(*INDEX, query),
                                        lambda r: all(h.attributes[0].value.int64 not in (0, 1)
                                                      for h in r[0].nearest_data_points)))
    report["errors"] = {
        "unknown_index": error(lambda: client.search("Client.Nope", "1", query)),
        "unknown_source": error(lambda: client.upload("Client.Nope", "1", [point(1, 1.0)])),
        "dimension": error(lambda: client.search(*INDEX, SearchQuery(query_vectors=[dense(1.0)], k=1))),
        "k": error(lambda: client.search(*INDEX, SearchQuery(query_vectors=[dense(1.0, 0.0)], k=0))),
        "missing_attribute": error(lambda: client.upload(*SOURCE, [InputDataPoint(
            attributes=key(7, "eu"), vector=dense(7.0, 0.0))])),
    }

    async def run_async() -> dict[str, Any]:
        aclient = VektonnAsync(url)
        await aclient.upload(*SOURCE, [point(20, 40.0)])
        far = SearchQuery(query_vectors=[dense(40.0, 0.0)], k=1)
        deadline = time.monotonic() + 30
        while True:
            found = hits(await aclient.search(*INDEX, far))
            if (found[0] and found[0][0]["id"] == 20) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        try:
            await aclient.search("Client.Nope", "1", far)
            refused: dict[str, Any] = {"status": 200}
        except VektonnApiError as exc:
            refused = {"status": exc.status, "messages": exc.error.error_messages if exc.error else None}
        return {"found": found, "unknown_index": refused}

    report["async"] = asyncio.run(run_async())
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
