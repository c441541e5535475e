"""A dataset upload under backpressure answers as README promises for HTTP uploads: 429 with Retry-After (here
in the dataset API's shape, TOO_MANY_REQUESTS), nothing written. It answered 500 INTERNAL_ERROR: the dataset
routes had no code for the backpressure error. Real Postgres and Valkey, the served API, no worker (so the
dataset's index lags its head)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from conftest import serve_api, wait_for

from shoal import Shoal
from shoal.auth import create_key
from shoal.config.settings import Settings

DIM = 4


def _vectors(start: int, n: int) -> list[dict[str, object]]:
    return [{"id": f"v{i}", "values": [float(i), 1.0, 0.0, 0.5]} for i in range(start, start + n)]


def test_a_dataset_upload_past_the_lag_bound_answers_429_and_writes_nothing(
    make_settings: Callable[..., Settings], redis_url: str,
) -> None:
    settings = make_settings("local", redis_url=redis_url, max_index_lag_seqs=5, backpressure_retry_after_s=7)
    with Shoal(settings, notify=False) as shoal, serve_api(settings) as url:
        key = create_key(shoal.engine, settings.tenant, "admin")[1]
        with httpx.Client(base_url=url, headers={"Authorization": f"ApiKey {key}"}, timeout=60) as http:
            assert http.post("/api/v1/datasets", json={"name": "lagging", "dimensions": DIM}).status_code == 201
            # No worker builds, so the index's lag (head minus built watermark) grows with every upload; the
            # lag the check reads is cached for a second, so uploads go on until one is refused.
            accepted, answers = 0, []

            def refused() -> bool:
                nonlocal accepted
                r = http.post("/api/v1/datasets/lagging/vectors", json={"vectors": _vectors(accepted, 10)})
                answers.append(r)
                if r.status_code == 200:
                    accepted += 10
                return r.status_code != 200

            wait_for(refused, 30, "an upload to be refused for the lag")
            r = answers[-1]
            assert r.status_code == 429, r.text
            body = r.json()
            assert (body["success"], body["error_code"]) == (False, "TOO_MANY_REQUESTS")
            assert "lag" in body["message"]
            assert r.headers["retry-after"] == "7"
            source = shoal.get_data_source("lagging", "1")

            def counted() -> bool:
                stats = http.get("/api/v1/datasets/lagging/stats")
                assert stats.status_code == 200, stats.text
                return stats.json()["vector_count"] == accepted

            wait_for(counted, 30, "the dataset's stats to count the accepted uploads only")
            assert shoal.get_data_source("lagging", "1").head_seq == source.head_seq  # the refused one: no commit
