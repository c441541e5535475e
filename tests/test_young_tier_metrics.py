"""`/metrics` shows the bytes of the young tiers the process holds (`shoal_searcher_young_tier_bytes`), the share of
SHOAL_SEARCHER_CACHE_BYTES that `shoal_searcher_cache_bytes` (segments only) leaves out: above 0 while a served
index has writes no built version reflects, back to 0 once a build takes them in. A served API (real sockets),
real catalog and storage; the build runs in the test, as a worker would run it."""

from __future__ import annotations

import re

import httpx
from conftest import wait_for

from shoal import Shoal
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder

API = "/api/v1"


def _gauge(url: str, name: str) -> float:
    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200, r.text
    found = re.search(rf"^{name} (\S+)$", r.text, re.M)
    assert found, f"{name} missing from /metrics"
    return float(found.group(1))


def _point(i: int) -> dict[str, object]:
    return {"attributes": [{"key": "id", "value": {"int64": i}}],
            "vector": {"isSparse": False, "coordinates": [float(i), 1.0]}}


def test_young_tier_bytes_show_unbuilt_writes_and_drop_once_built(served: tuple[str, Settings]) -> None:
    url, settings = served
    with httpx.Client(base_url=url, timeout=30) as http:
        source = {"name": "Docs", "version": "1", "vectorDimension": 2, "attributeValueTypes": {"id": "Int64"},
                  "permanentAttributes": ["id"]}
        r = http.post(f"{API}/data-sources", json=source)
        assert r.status_code == 201, r.text
        r = http.post(f"{API}/indexes", json={"name": "Docs.Flat", "version": "1", "dataSourceName": "Docs",
                                             "dataSourceVersion": "1", "algorithm": "FaissIndex.L2"})
        assert r.status_code == 201, r.text
        assert _gauge(url, "shoal_searcher_young_tier_bytes") == 0  # nothing served yet
        r = http.post(f"{API}/upload/Docs/1", json=[_point(i) for i in range(200)])
        assert r.status_code == 200, r.text
        query = {"k": 3, "queryVectors": [{"isSparse": False, "coordinates": [5.0, 1.0]}]}
        r = http.post(f"{API}/search/Docs.Flat/1", json=query)  # eventual: served from the young tier, no build yet
        assert r.status_code == 200, r.text
        assert len(r.json()[0]["nearestDataPoints"]) == 3
        held = _gauge(url, "shoal_searcher_young_tier_bytes")
        # At least the 200 vectors' float32 coordinates (its entries carry their keys and seqs besides).
        assert held >= 200 * 2 * 4, held
        assert _gauge(url, "shoal_searcher_cache_bytes") == 0  # no segment: the young tier is all it holds

        with Shoal(settings, notify=False) as shoal:
            for shard in shoal.get_index("Docs.Flat", "1").shards:
                ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
        # The searcher's poll loads the built version; its young tier then holds nothing.
        wait_for(lambda: _gauge(url, "shoal_searcher_young_tier_bytes") == 0, 60, "the young tier to empty")
        assert _gauge(url, "shoal_searcher_cache_bytes") > 0
