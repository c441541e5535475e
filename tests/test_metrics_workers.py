"""/metrics under `shoal api --workers N`: one total whichever worker answers a scrape, the dataset routes
counted, and a crash loop that ends with a non-zero exit."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
from conftest import api_process, free_port, settings_env, wait_for

from shoal import DataSourceSpec, Shoal
from shoal.auth import create_key
from shoal.config.settings import Settings
from shoal.log.records import IndexSpec

UPLOADS = 8
POINTS = 5
SCRAPES = 16


def _listeners(port: int) -> int:
    """Listening TCP sockets on `port` (each `--workers` process has one of its own, SO_REUSEPORT)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def _figures(url: str) -> tuple[float, float]:
    """(shoal_upload_points_total, shoal_search_seconds_count) from one scrape on a connection of its own, so
    the kernel may hand it to any worker; totals over all tenants, as a keyless caller sees them."""
    text = httpx.get(f"{url}/metrics", headers={"Connection": "close"}, timeout=30).text
    found = []
    for name in ("shoal_upload_points_total", "shoal_search_seconds_count"):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        found.append(float(m.group(1)) if m else 0.0)
    return found[0], found[1]


def _scrapes(url: str) -> list[tuple[float, float]]:
    return [_figures(url) for _ in range(SCRAPES)]


def test_worker_metrics_are_one_total_and_count_dataset_routes(make_settings: Callable[..., Settings]) -> None:
    """Uploads spread over two workers: every scrape shows the same total, never less than an earlier one, and
    dataset upserts and searches (one and several datasets) move the counter and the search histogram."""
    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec("M", "1", 2, {"id": "int64"}, ["id"]))
        shoal.create_index(IndexSpec("M.Index", "1", "M", "1", algorithm="FaissIndex.L2"))
        key = create_key(shoal.engine, settings.tenant, "admin")[1]
    auth = {"Authorization": f"ApiKey {key}", "Connection": "close"}
    port = free_port()
    with api_process(settings, "--workers", "2", port=port) as (_, url):
        wait_for(lambda: _listeners(port) == 2, 60, "both API workers to listen")
        for i in range(UPLOADS):  # a connection each: the kernel spreads them over the workers
            points = [{"attributes": [{"key": "id", "value": {"int64": i * POINTS + j}}],
                       "vector": {"isSparse": False, "coordinates": [float(i), float(j)]}} for j in range(POINTS)]
            r = httpx.post(f"{url}/api/v1/upload/M/1", json=points, headers=auth, timeout=30)
            assert r.status_code == 200, r.text
        seen = _scrapes(url)
        assert [up for up, _ in seen] == [UPLOADS * POINTS] * SCRAPES

        api = f"{url}/api/v1"
        r = httpx.post(f"{api}/datasets", json={"name": "ds", "dimensions": 2}, headers=auth, timeout=30)
        assert r.status_code == 201, r.text
        vectors = [{"id": f"v{i}", "values": [float(i), 1.0]} for i in range(7)]
        r = httpx.post(f"{api}/datasets/ds/vectors", json={"vectors": vectors}, headers=auth, timeout=30)
        assert r.status_code == 200 and r.json()["inserted"] == 7, r.text
        for _ in range(3):
            r = httpx.post(f"{api}/datasets/ds/search", headers=auth, timeout=30,
                           json={"vector": [1.0, 1.0], "top_k": 2, "consistency": "strong"})
            assert r.status_code == 200 and len(r.json()["results"]) == 2, r.text
        for _ in range(2):
            r = httpx.post(f"{api}/search/multi-dataset", headers=auth, timeout=30,
                           json={"query_vector": [1.0, 1.0], "datasets": ["ds"],
                                 "options": {"top_k": 2, "consistency": "strong"}})
            assert r.status_code == 200, r.text
        after = _scrapes(url)
        assert after == [(UPLOADS * POINTS + 7, 5.0)] * SCRAPES


def test_api_with_workers_and_no_catalog_exits_non_zero_before_starting_them(
    make_settings: Callable[..., Settings]
) -> None:
    """`shoal api --workers 2` with no catalog to reach says so in one line and by its exit status, before it
    starts a worker (they used to start, fail and be restarted until the API gave up on them)."""
    settings = make_settings("local", database_url="postgresql+psycopg://postgres@127.0.0.1:1/x")
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "api", "--port", str(free_port()), "--workers", "2", "--no-access-log"],
        env=settings_env(settings), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert out.startswith("error: cannot reach the catalog at ") and out.count("\n") == 1, out[-2000:]
    assert "Traceback" not in out and "starting another" not in out, out[-2000:]
    assert proc.returncode == 1, out[-2000:]
