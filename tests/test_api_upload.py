"""The upload route's other bodies and guarantees: Arrow IPC streams, Idempotency-Key, sources dropped between
uploads (the route reuses a source's definition for a moment)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from shoal import DataSourceSpec, Shoal, runtime
from shoal.config.settings import Settings
from shoal.intake.codec import ARROW, encode_arrow
from shoal.log.records import IndexSpec

SPEC = DataSourceSpec("Up", "1", 3, {"id": "int64", "title": "string"}, ["id"])


def _json_points(ids: list[int]) -> list[dict[str, object]]:
    return [
        {"attributes": [{"key": "id", "value": {"int64": i}}, {"key": "title", "value": {"string": f"t{i}"}}],
         "vector": {"isSparse": False, "coordinates": [float(i), 0.5, -1.0]}}
        for i in ids
    ]


def _state(shoal: Shoal) -> dict[int, tuple[str, list[float]]]:
    table = shoal.fold("Up", "1")
    vectors = table["__vector"].to_pylist()
    return {i: (t, v) for i, t, v in zip(table["id"].to_pylist(), table["title"].to_pylist(), vectors, strict=True)}


def test_idempotency_key_makes_a_retried_upload_write_nothing(served: tuple[str, Settings]) -> None:
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(SPEC)
        first = http.post("/api/v1/upload/Up/1", json=_json_points([1, 2, 3]), headers={"Idempotency-Key": "job-7"})
        assert first.status_code == 200, first.text
        again = http.post("/api/v1/upload/Up/1", json=_json_points([1, 2, 3]), headers={"Idempotency-Key": "job-7"})
        assert again.status_code == 200
        assert again.headers["X-Shoal-Write-Token"] == first.headers["X-Shoal-Write-Token"] == "3"
        assert shoal.get_data_source("Up", "1").head_seq == 3  # written once
        other = http.post("/api/v1/upload/Up/1", json=_json_points([4]), headers={"Idempotency-Key": "job-8"})
        assert other.headers["X-Shoal-Write-Token"] == "4"
        plain = http.post("/api/v1/upload/Up/1", json=_json_points([4]))  # no key: an ordinary second write
        assert plain.headers["X-Shoal-Write-Token"] == "5"
        bad = http.post("/api/v1/upload/Up/1", json=_json_points([9]), headers={"Idempotency-Key": "x" * 201})
        assert bad.status_code == 400 and "batch id" in bad.json()["errorMessages"][0]
        assert shoal.get_data_source("Up", "1").head_seq == 5


def test_arrow_ipc_upload(served: tuple[str, Settings]) -> None:
    url, settings = served
    vectors = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=np.float32)
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(SPEC)
        body = encode_arrow(vectors, {"id": [1, 2, 3], "title": ["a", "b", "c"]})
        r = http.post("/api/v1/upload/Up/1", content=body, headers={"Content-Type": ARROW})
        assert (r.status_code, r.content, r.headers["X-Shoal-Write-Token"]) == (200, b"", "3")
        # Tombstones ride in the same form: an is_deleted column, the key decides.
        body = encode_arrow(np.vstack([vectors[:1] * 2, vectors[:1]]), {"id": [1, 2], "title": ["a2", "x"]},
                            deleted=[False, True])
        r = http.post("/api/v1/upload/Up/1", content=body, headers={"Content-Type": ARROW})
        assert r.status_code == 200, r.text
        state = _state(shoal)
        assert sorted(state) == [1, 3]
        assert state[1] == ("a2", [2.0, 0.0, 0.0]) and state[3] == ("c", [0.0, 0.0, 1.0])

        head = shoal.get_data_source("Up", "1").head_seq
        for content, content_type, message in [
            (b"not arrow", ARROW, "not an Arrow IPC stream"),
            (encode_arrow(vectors[:, :2].copy(), {"id": [1, 2, 3], "title": ["a", "b", "c"]}), ARROW, "dimension"),
            (encode_arrow(vectors, {"id": [1, 2, 3]}), ARROW, "title"),
            (b"id,title\n1,a\n", "text/csv", "unsupported Content-Type"),
        ]:
            r = http.post("/api/v1/upload/Up/1", content=content, headers={"Content-Type": content_type})
            assert r.status_code == 400, (message, r.text)
            assert any(message in m for m in r.json()["errorMessages"]), (message, r.json())
        assert shoal.get_data_source("Up", "1").head_seq == head  # nothing written by any of them


def test_upload_to_a_source_dropped_and_made_again(served: tuple[str, Settings]) -> None:
    """The route reuses a source's definition for up to 2 s; a source dropped meanwhile is refused by the commit
    (404), and one made again under the same name takes the upload, at once."""
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(SPEC)
        assert http.post("/api/v1/upload/Up/1", json=_json_points([1])).status_code == 200
        shoal.drop_data_source("Up", "1")
        r = http.post("/api/v1/upload/Up/1", json=_json_points([2]))
        assert r.status_code == 404, r.text
        shoal.create_data_source(SPEC)
        r = http.post("/api/v1/upload/Up/1", json=_json_points([3]))
        assert (r.status_code, r.headers.get("X-Shoal-Write-Token")) == (200, "1"), r.text
        assert sorted(_state(shoal)) == [3]


def test_a_source_made_again_with_another_definition_checks_the_upload_by_its_own(
    served: tuple[str, Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The route checked an upload against the definition it reused, and when the commit found that source
    dropped and one made again under the name, wrote the batch there unchecked: 3-d vectors into a 2-d source.
    The batch is checked again against the new definition: refused (400), nothing written."""
    monkeypatch.setattr(runtime, "SOURCE_TTL_S", 600.0)  # the route surely reuses the first definition
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(SPEC)
        assert http.post("/api/v1/upload/Up/1", json=_json_points([1])).status_code == 200
        shoal.drop_data_source("Up", "1")
        shoal.create_data_source(DataSourceSpec("Up", "1", 2, {"id": "int64", "title": "string"}, ["id"]))
        r = http.post("/api/v1/upload/Up/1", json=_json_points([2]))  # 3-d points: the old definition's
        assert r.status_code == 400 and "wrong dimension: expected 2, got 3" in r.text, r.text
        assert shoal.get_data_source("Up", "1").head_seq == 0


def test_search_echoes_the_query_vector_as_sent(served: tuple[str, Settings]) -> None:
    """Vektonn's answer repeats each query vector: the numbers the client sent, not their float32 rounding."""
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(SPEC)
        shoal.create_index(IndexSpec("Up.Index", "1", "Up", "1", algorithm="FaissIndex.L2"))
        assert http.post("/api/v1/upload/Up/1", json=_json_points([1, 2])).status_code == 200
        query = {"k": 1, "queryVectors": [{"isSparse": False, "coordinates": [0.1, 0.2, 1e-7]}]}
        r = http.post("/api/v1/search/Up.Index/1", json=query, headers={"X-Shoal-Consistency": "strong"})
        assert r.status_code == 200, r.text
        assert r.json()[0]["queryVector"] == {"isSparse": False, "coordinates": [0.1, 0.2, 1e-7]}
        assert r.json()[0]["nearestDataPoints"][0]["attributes"][0] == {"key": "id", "value": {"int64": 1}}
