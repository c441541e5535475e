"""`shoal_search_seconds` counts each search request once, and `/metrics` is served while the catalog is down.

- A search refused with 400 adds one observation, as an answered one does, though the fast path tries it before
  the route answers it.
- A search fanned out across nodes is observed once, by the process that fanned it out, for the whole of it (its
  remote parts included); the parts the nodes answer for it (X-Shoal-Shards) are not searches of their own.
- With the catalog (Postgres) stopped, `/metrics` still answers 200 with the counters and the cache gauges; only
  the lag gauges, read from the catalog, are left out (one warning line a scrape in the log).

Real servers and sockets, a real catalog and storage; the catalog outage stops a Postgres of the test's own.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from conftest import api_process, catalog_down, free_port, serve_api, wait_for

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec
from shoal.servers.embedded import stop_embedded

API = "/api/v1"


def _point(i: int, vector: list[float]) -> dict[str, object]:
    return {"attributes": [{"key": "id", "value": {"int64": i}}], "vector": {"isSparse": False, "coordinates": vector}}


def _query(vector: list[float], k: int = 1) -> dict[str, object]:
    return {"k": k, "queryVectors": [{"isSparse": False, "coordinates": vector}]}


def _histogram(url: str, headers: dict[str, str] | None = None) -> tuple[float, float]:
    """(count, sum) of shoal_search_seconds in a keyless scrape (totals over every tenant); 0 when none yet."""
    r = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=30)
    assert r.status_code == 200, r.text
    found = [re.search(rf"^shoal_search_seconds_{part} (\S+)$", r.text, re.M) for part in ("count", "sum")]
    return tuple(float(m.group(1)) if m else 0.0 for m in found)  # type: ignore[return-value]


def _source_and_index(http: httpx.Client, shards: int = 1) -> None:
    r = http.post(f"{API}/data-sources", json={"name": "Docs", "version": "1", "vectorDimension": 2,
                                              "attributeValueTypes": {"id": "Int64"}, "permanentAttributes": ["id"]})
    assert r.status_code == 201, r.text
    r = http.post(f"{API}/indexes", json={"name": "Docs.Flat", "version": "1", "dataSourceName": "Docs",
                                         "dataSourceVersion": "1", "algorithm": "FaissIndex.L2",
                                         "shardCount": shards})
    assert r.status_code == 201, r.text
    r = http.post(f"{API}/upload/Docs/1", json=[_point(1, [0.0, 1.0]), _point(2, [1.0, 0.0])])
    assert r.status_code == 200, r.text


# -- 1. a refused search is one observation -----------------------------------------------------------------------


def test_every_search_adds_one_observation_whether_answered_or_refused(served: tuple[str, Settings]) -> None:
    url, _ = served
    with httpx.Client(base_url=url, timeout=30) as http:
        _source_and_index(http)
        search = f"{API}/search/Docs.Flat/1"
        # The first search loads the index: later ones are answered on the fast path when they can be.
        assert http.post(search, json=_query([0.0, 1.0])).status_code == 200
        count, _ = _histogram(url)
        assert count == 1.0
        searches = [  # (what, path, request, the status it answers)
            ("an answered search", search, {"json": _query([0.0, 1.0])}, 200),
            ("a query vector of the wrong dimension", search, {"json": _query([0.0, 1.0, 2.0])}, 400),
            ("k = 0", search, {"json": _query([0.0, 1.0], k=0)}, 400),
            ("a body that is not JSON", search, {"content": b"not json"}, 400),
            ("an unknown index", f"{API}/search/Nope/1", {"json": _query([0.0, 1.0])}, 404),
        ]
        for what, path, request, status in searches:
            r = http.post(path, **request)  # type: ignore[arg-type]
            assert r.status_code == status, (what, r.text)
            before = count
            count, _ = _histogram(url)
            assert count == before + 1, f"{what} ({status}) changed shoal_search_seconds_count by {count - before}"


# -- 2. a fanned-out search is observed once, whole, by the process that fanned it out ----------------------------


@pytest.fixture
def hung_node() -> Iterator[str]:
    """The URL of a node that takes connections and never answers (a searcher stuck in a long pause)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # the kernel completes the handshakes; nothing ever reads or answers
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.timeout(300)
def test_a_fanned_out_search_is_observed_once_for_the_whole_of_it(
    make_settings: Callable[..., Settings], tmp_path: Path, hung_node: str
) -> None:
    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    rng = np.random.default_rng(3)
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec("Docs", "1", 4, {"id": "int64"}, ["id"]))
        shoal.producer("Docs", "1").upload_columns(rng.random((40, 4), dtype=np.float32), {"id": np.arange(40)})
        for name in ("Docs.Flat", "Docs.Slow"):
            shoal.create_index(IndexSpec(name, "1", "Docs", "1", algorithm="flat", metric="euclidean",
                                         id_attributes=["id"], shard_attributes=["id"], shard_count=2))
            for shard in shoal.get_index(name, "1").shards:
                ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
    ports = {"a": free_port(), "b": free_port()}
    placement = tmp_path / "placement.yaml"
    placement.write_text(yaml.safe_dump({
        "nodes": {n: f"http://127.0.0.1:{p}" for n, p in ports.items()} | {"hung": hung_node},
        "indexes": [
            {"tenant": settings.tenant, "index": "Docs.Flat", "version": "1", "shards": {"a": [0], "b": [1]}},
            # Shard 1 of this one is on the node that never answers: the router waits SHOAL_FANOUT_TIMEOUT_S.
            {"tenant": settings.tenant, "index": "Docs.Slow", "version": "1", "shards": {"a": [0], "hung": [1]}},
        ],
    }))
    timeout_s = 1.0
    query = _query([0.5, 0.5, 0.5, 0.5], k=3)
    with api_process(settings, port=ports["a"], SHOAL_PLACEMENT_FILE=str(placement), SHOAL_NODE="a") as (_, a), \
            api_process(settings, port=ports["b"], SHOAL_PLACEMENT_FILE=str(placement), SHOAL_NODE="b") as (_, b), \
            api_process(settings, SHOAL_PLACEMENT_FILE=str(placement),
                        SHOAL_FANOUT_TIMEOUT_S=str(timeout_s)) as (_, router):  # no node: it serves no shard
        # Each node loads its shards first, asked directly for its parts (which no node observes), so the router's
        # short timeout is spent only on the node that never answers, never on a cold load on a busy machine.
        for node, shard in ((a, "0"), (b, "1")):
            for name in ("Docs.Flat", "Docs.Slow") if node == a else ("Docs.Flat",):
                part = httpx.post(f"{node}{API}/search/{name}/1", json=query, headers={"X-Shoal-Shards": shard},
                                  timeout=60)
                assert part.status_code == 200, part.text
        for _ in range(3):
            r = httpx.post(f"{router}{API}/search/Docs.Flat/1", json=query, timeout=30)
            assert r.status_code == 200, r.text
            assert len(r.json()[0]["nearestDataPoints"]) == 3
        # Three searches, three observations, all on the router: the nodes only answered parts of them.
        assert _histogram(router)[0] == 3.0
        assert _histogram(a)[0] == 0.0
        assert _histogram(b)[0] == 0.0

        # The router's observation covers the remote parts: a search waiting for a node that never answers
        # takes at least the fan-out timeout, and so does what the router records of it.
        _, before = _histogram(router)
        r = httpx.post(f"{router}{API}/search/Docs.Slow/1", json=query, headers={"X-Shoal-Allow-Partial": "true"},
                       timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["X-Shoal-Missing-Shards"] == "1"
        count, total = _histogram(router)
        assert count == 4.0
        waited = total - before
        assert waited >= 0.95 * timeout_s, f"the router observed {waited:.3f}s of a search that waited {timeout_s}s"
        assert _histogram(a)[0] == 0.0


# -- 3. /metrics while the catalog is down -------------------------------------------------------------------------


def test_metrics_are_served_without_the_lag_gauges_while_the_catalog_is_down(
    make_settings: Callable[..., Settings], own_postgres: tuple[Path, str], caplog: pytest.LogCaptureFixture
) -> None:
    home, pg = own_postgres
    token = "scrape-" + "x" * 24
    settings = make_settings("local", database_url=pg, metrics_token=token)
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    scraper = {"Authorization": f"Bearer {token}"}
    with serve_api(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        _source_and_index(http)
        assert http.post(f"{API}/search/Docs.Flat/1", json=_query([0.0, 1.0])).status_code == 200
        r = http.get("/metrics", headers=scraper)
        assert r.status_code == 200, r.text
        assert "shoal_index_served_lag_seqs{" in r.text and "shoal_index_built_lag_seqs_max " in r.text

        stop_embedded(home)
        wait_for(lambda: catalog_down(pg), 30, "the catalog to be down")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shoal.api.metrics"):
            for headers in (scraper, {}):  # the scraper's token, and a keyless caller's totals
                r = http.get("/metrics", headers=headers)
                assert r.status_code == 200, (headers, r.status_code, r.text)
                assert re.search(r"^shoal_upload_points_total\S* 2\.0$", r.text, re.M), r.text
                assert re.search(r"^shoal_search_seconds_count\S* 1\.0$", r.text, re.M), r.text
                assert re.search(r"^shoal_searcher_cache_budget_bytes \S+$", r.text, re.M), r.text
                assert "_lag_seqs" not in r.text, r.text  # unknown, not 0: no shard is claimed up to date
        warnings = [rec for rec in caplog.records if rec.name == "shoal.api.metrics"]
        assert len(warnings) == 2, [rec.getMessage() for rec in warnings]  # one line per scrape
        for rec in warnings:
            assert rec.levelno == logging.WARNING and rec.exc_info is None
            assert "catalog is unavailable" in rec.getMessage() and "\n" not in rec.getMessage()
