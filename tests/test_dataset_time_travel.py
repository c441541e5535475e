"""Time travel on the dataset API: `X-Shoal-Tag` and `X-Shoal-As-Of` on `POST /api/v1/datasets/{id}/search`
answer the tagged / as-of state, as the Vektonn search of the dataset's own index does; bad values are 400s in
the dataset API's shape, and multi-dataset search (a tag or a seq belongs to one data source) refuses both
headers, naming them. A real served API (conftest's `served`), the real catalog and storage."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import wait_for

from shoal import Shoal
from shoal.auth import create_key
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder

TAG = "X-Shoal-Tag"
AS_OF = "X-Shoal-As-Of"


@pytest.fixture
def http(served: tuple[str, Settings]) -> Iterator[httpx.Client]:
    """A client of the served API with an admin key of its tenant."""
    url, settings = served
    with Shoal(settings, notify=False) as shoal:
        key = create_key(shoal.engine, settings.tenant, "admin")[1]
    with httpx.Client(base_url=f"{url}/api/v1", headers={"Authorization": f"ApiKey {key}"}, timeout=30) as client:
        yield client


def _build(settings: Settings, name: str) -> None:
    """Build the dataset's index up to the log head (no worker runs in these tests)."""
    with Shoal(settings, notify=False) as shoal:
        for shard in shoal.get_index(name, "1").shards:
            ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)


def _upsert(http: httpx.Client, name: str, *vectors: tuple[str, list[float]]) -> int:
    r = http.post(f"/datasets/{name}/vectors", json={"vectors": [{"id": i, "values": v} for i, v in vectors]})
    assert r.status_code == 200, r.text
    return int(r.json()["write_token"])


def _dataset_hits(http: httpx.Client, name: str, body: dict[str, Any] | None = None,
                  **headers: str) -> list[tuple[str, float]]:
    r = http.post(f"/datasets/{name}/search", json={"vector": [0, 0], "top_k": 10, **(body or {})},
                  headers=headers)
    assert r.status_code == 200, r.text
    return [(m["id"], m["score"]) for m in r.json()["results"]]


def _vektonn_hits(http: httpx.Client, name: str, **headers: str) -> list[tuple[str, float]]:
    query = {"k": 10, "queryVectors": [{"isSparse": False, "coordinates": [0.0, 0.0]}]}
    r = http.post(f"/search/{name}/1", json=query, headers=headers)
    assert r.status_code == 200, r.text
    return [(next(a["value"]["string"] for a in p["attributes"] if a["key"] == "id"), p["distance"])
            for p in r.json()[0]["nearestDataPoints"]]


def _error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["success", "error_code", "message", "details"], body
    assert body["success"] is False and body["error_code"] == code, body
    return body  # type: ignore[no-any-return]


@pytest.fixture
def history(http: httpx.Client, served: tuple[str, Settings]) -> tuple[str, int]:
    """Dataset `tt`: a and b uploaded and built, tagged `v1` (at write token t1), then c uploaded and b deleted,
    built again. Its name and t1."""
    _, settings = served
    r = http.post("/datasets", json={"name": "tt", "dimensions": 2, "metric_type": "euclidean",
                                     "index_type": "flat"})
    assert r.status_code == 201, r.text
    t1 = _upsert(http, "tt", ("a", [0.0, 0.0]), ("b", [1.0, 0.0]))
    _build(settings, "tt")
    assert http.put("/indexes/tt/1/tags/v1").status_code == 200
    _upsert(http, "tt", ("c", [0.1, 0.0]))
    with Shoal(settings, notify=False) as shoal:
        shoal.producer("tt", "1").delete({"id": ["b"]})
    _build(settings, "tt")
    return "tt", t1


def test_dataset_search_answers_the_tagged_and_as_of_state(http: httpx.Client, history: tuple[str, int]) -> None:
    name, t1 = history
    present = _dataset_hits(http, name, {"consistency": "strong"})
    assert [i for i, _ in present] == ["a", "c"]
    for headers in ({TAG: "v1"}, {AS_OF: str(t1)}):
        then = _dataset_hits(http, name, **headers)
        assert [i for i, _ in then] == ["a", "b"], headers
        # The same hits, in the same order at the same distances, as the Vektonn route on the dataset's index.
        vektonn = _vektonn_hits(http, name, **headers)
        assert [i for i, _ in then] == [i for i, _ in vektonn], headers
        assert [d for _, d in then] == pytest.approx([d for _, d in vektonn]), headers
    assert _dataset_hits(http, name, {"filters": {"id": "b"}}, **{TAG: "v1"}) == [("b", 1.0)]


def test_bad_time_travel_headers_answer_400_in_the_dataset_shape(
    http: httpx.Client, history: tuple[str, int]
) -> None:
    name, t1 = history
    search = {"vector": [0, 0], "top_k": 3}
    for raw in ("-1", "1.0", "", "0x1", "1_0", "99999999999999999999"):
        body = _error(http.post(f"/datasets/{name}/search", json=search, headers={AS_OF: raw}),
                      400, "VALIDATION_ERROR")
        assert body["details"]["field"] == AS_OF and AS_OF in body["message"], body
    body = _error(http.post(f"/datasets/{name}/search", json=search, headers={AS_OF: "1000000"}),
                  400, "VALIDATION_ERROR")
    assert "as_of seq 1000000 is past the log head" in body["message"], body
    for raw in ("nope", "Bad Tag!"):
        body = _error(http.post(f"/datasets/{name}/search", json=search, headers={TAG: raw}),
                      400, "VALIDATION_ERROR")
        assert body["details"]["field"] == TAG and repr(raw) in body["message"], body
    body = _error(http.post(f"/datasets/{name}/search", json=search, headers={TAG: "v1", AS_OF: str(t1)}),
                  400, "VALIDATION_ERROR")
    assert TAG in body["message"] and AS_OF in body["message"], body
    # An older state is answered exactly as it was: no consistency level applies to it.
    _error(http.post(f"/datasets/{name}/search", json={**search, "consistency": "strong"}, headers={TAG: "v1"}),
           400, "VALIDATION_ERROR")
    # A dataset that does not exist is still that, whatever the headers.
    _error(http.post("/datasets/missing/search", json=search, headers={TAG: "v1"}), 404, "DATASET_NOT_FOUND")


def test_multi_dataset_search_refuses_time_travel_headers(http: httpx.Client, history: tuple[str, int]) -> None:
    name, t1 = history
    body = {"query_vector": [0, 0], "datasets": [name]}
    assert http.post("/search/multi-dataset", json=body).status_code == 200
    for header, value in ((TAG, "v1"), (AS_OF, str(t1))):
        error = _error(http.post("/search/multi-dataset", json=body, headers={header: value}),
                       400, "VALIDATION_ERROR")
        assert error["details"]["field"] == header and header in error["message"], error


def test_a_tag_from_before_a_metric_change_answers_with_its_own_metric(
    http: httpx.Client, history: tuple[str, int], served: tuple[str, Settings]
) -> None:
    """A search answers the metric of the generation that answered: a tag taken before a reindex that changed
    the metric searches the old generation, and says so (its scores are that metric's distances)."""
    name, t1 = history
    _, settings = served
    with Shoal(settings, notify=False) as shoal:
        shoal.reindex(name, "1", metric="dot_product", wait=True)

    def serving_dot_product() -> bool:
        r = http.post(f"/datasets/{name}/search", json={"vector": [1, 0], "top_k": 3})
        return r.status_code == 200 and r.json()["metric_type"] == "dot_product"

    wait_for(serving_dot_product, 30, "the API to serve the reindexed generation")
    r = http.post(f"/datasets/{name}/search", json={"vector": [0, 0], "top_k": 3}, headers={TAG: "v1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["metric_type"], body["higher_is_better"]) == ("euclidean", False), body
    assert [(m["id"], m["score"]) for m in body["results"]] == [("a", 0.0), ("b", 1.0)]
    # A seq is answered as the generation serving now defines the index (README, "Time travel and tags").
    r = http.post(f"/datasets/{name}/search", json={"vector": [1, 0], "top_k": 3}, headers={AS_OF: str(t1)})
    assert r.status_code == 200, r.text
    assert (r.json()["metric_type"], r.json()["higher_is_better"]) == ("dot_product", True), r.text
