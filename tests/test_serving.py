"""The serving path as an operator runs it: `shoal api` processes, many tenants, indexes that go away."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psycopg
import pytest
from conftest import api_process, wait_for

from shoal import DataSourceSpec, Shoal
from shoal.auth import create_key, create_tenant
from shoal.catalog.db import make_engine
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec

ROOT = Path(__file__).resolve().parents[1]


def _pg(settings: Settings) -> str:
    assert settings.database_url is not None
    return settings.database_url.replace("postgresql+psycopg://", "postgresql://")


def _connections(settings: Settings, pid: int) -> int:
    """Catalog connections the process `pid` holds (its engines name them shoal/<pid>)."""
    with psycopg.connect(_pg(settings), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (f"shoal/{pid}",)
        ).fetchone()
    assert row is not None
    return int(row[0])


def _point(i: int, vector: list[float]) -> dict[str, object]:
    return {"attributes": [{"key": "id", "value": {"int64": i}}], "vector": {"isSparse": False, "coordinates": vector}}


@pytest.mark.slow
def test_fifty_tenants_share_one_catalog_pool(make_settings: Callable[..., Settings]) -> None:
    """50 tenants upload and search through one API process, 8 at a time: the process holds at most its pool
    (SHOAL_DB_POOL_SIZE + SHOAL_DB_MAX_OVERFLOW) of Postgres connections, and every tenant gets its own answers."""
    settings = make_settings("local", db_pool_size=3, db_max_overflow=2, anonymous_tenant="")
    limit = settings.db_pool_size + settings.db_max_overflow
    engine = make_engine(settings.database_url or "")
    run = uuid.uuid4().hex[:8]
    keys: dict[str, str] = {}
    try:
        for i in range(50):
            tenant = f"pool-{run}-{i}"
            create_tenant(engine, tenant)
            keys[tenant] = create_key(engine, tenant, "write", "pool test")[1]
    finally:
        engine.dispose()

    with api_process(settings) as (proc, url):
        seen: list[int] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                seen.append(_connections(settings, proc.pid))
                done.wait(0.05)

        def tenant_work(tenant: str) -> tuple[str, list[int], list[int]]:
            vectors = np.random.default_rng(int(tenant.rsplit("-", 1)[1])).normal(size=(20, 4)).round(3)
            with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"ApiKey {keys[tenant]}"}) as http:
                r = http.post("/api/v1/data-sources", json={
                    "name": "Docs", "version": "1", "vectorDimension": 4, "attributeValueTypes": {"id": "int64"},
                    "permanentAttributes": ["id"]})
                assert r.status_code == 201, r.text
                r = http.post("/api/v1/indexes", json={
                    "name": "Docs.Flat", "version": "1", "dataSourceName": "Docs", "dataSourceVersion": "1",
                    "algorithm": "FaissIndex.L2"})
                assert r.status_code == 201, r.text
                # Ids differ per tenant: an answer holding another tenant's ids would show a leak.
                base = int(tenant.rsplit("-", 1)[1]) * 1000
                body = [_point(base + j, v.tolist()) for j, v in enumerate(vectors)]
                r = http.post("/api/v1/upload/Docs/1", json=body)
                assert r.status_code == 200, r.text
                query = vectors[3] + 0.001
                r = http.post("/api/v1/search/Docs.Flat/1", json={
                    "k": 3, "queryVectors": [{"isSparse": False, "coordinates": query.tolist()}]},
                    headers={"X-Shoal-Consistency": "strong"})
                assert r.status_code == 200, r.text
                found = [p["attributes"][0]["value"]["int64"] for p in r.json()[0]["nearestDataPoints"]]
                exact = np.argsort(((vectors - query) ** 2).sum(axis=1), kind="stable")[:3]
                return tenant, found, [base + int(j) for j in exact]

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(tenant_work, keys))
        finally:
            done.set()
            sampler.join(10)
        held_after = _connections(settings, proc.pid)

    assert len(results) == 50
    for tenant, found, exact in results:
        assert found == exact, tenant
    assert seen and max(seen) >= 1, "the sampler never saw the API's connections (are they named shoal/<pid>?)"
    assert max(seen) <= limit, f"the API process held up to {max(seen)} catalog connections, its pool is {limit}"
    assert held_after <= limit


@pytest.mark.slow
@pytest.mark.parametrize("announce", [True, False], ids=["announced", "polled"])
def test_dropped_index_stops_answering_within_the_bound(
    make_settings: Callable[..., Settings], redis_url: str, announce: bool
) -> None:
    """An API process that served an index answers 404 once another process dropped it: at once when the drop
    is announced on the broker, else within the documented bound (SHOAL_SEARCHER_POLL_S, plus one refresh)."""
    poll = 1.0
    broker = redis_url if announce else "redis://127.0.0.1:1/0"  # nothing listens there: polling only
    settings = make_settings("local", redis_url=broker, searcher_poll_s=poll)
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    query = {"k": 1, "queryVectors": [{"isSparse": False, "coordinates": [0.0, 1.0]}]}
    with Shoal(settings) as shoal, api_process(settings) as (_, url):
        shoal.create_data_source(DataSourceSpec("Gone", "1", 2, {"id": "int64"}, ["id"]))
        index = shoal.create_index(IndexSpec("Gone.Index", "1", "Gone", "1", algorithm="FaissIndex.L2"))
        shoal.producer("Gone", "1").upload_columns(np.array([[0.0, 1.0], [1.0, 0.0]]), {"id": [1, 2]})
        for shard in index.shards:
            ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
        with httpx.Client(base_url=url, timeout=30) as http:
            r = http.post("/api/v1/search/Gone.Index/1", json=query)
            assert r.status_code == 200 and r.json()[0]["nearestDataPoints"], r.text
            shoal.drop_index("Gone.Index", "1")
            wait_for(lambda: http.post("/api/v1/search/Gone.Index/1", json=query).status_code == 404,
                     2 * poll + 5.0, "the dropped index to answer 404")  # slack for a busy machine's round trips
            r = http.post("/api/v1/search/Gone.Index/1", json=query)
            assert r.status_code == 404 and "not found" in r.json()["errorMessages"][0]


def test_the_package_has_no_import_cycle() -> None:
    """Modules import one way (DESIGN.md): the shared checker, function-level imports included, finds no cycle."""
    tool = ROOT.parent / "shared" / "tools" / "import_cycles.py"
    assert tool.is_file(), f"{tool} is missing: CI lays ../shared out beside the repository"
    out = subprocess.run([sys.executable, str(tool), "shoal"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.stdout.strip() == "no import cycles", out.stdout + out.stderr


def _api_workers(pid: int) -> set[int]:
    """The API worker processes `shoal api --workers N` (pid) runs: its spawned children, not the resource
    tracker multiprocessing starts beside them."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    found = set()
    for child in children:
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            found.add(int(child))
    return found


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie, left to a parent that does not reap, has)."""
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_api_workers_share_one_port_and_are_restarted(make_settings: Callable[..., Settings]) -> None:
    """`shoal api --workers 2`: two processes answer on one port; one that dies is replaced; stopping the API
    stops them all."""
    import os
    import signal

    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    query = {"k": 1, "queryVectors": [{"isSparse": False, "coordinates": [0.0, 1.0]}]}
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec("W", "1", 2, {"id": "int64"}, ["id"]))
        shoal.create_index(IndexSpec("W.Index", "1", "W", "1", algorithm="FaissIndex.L2"))
        shoal.producer("W", "1").upload_columns(np.array([[0.0, 1.0], [1.0, 0.0]]), {"id": [1, 2]})
    with api_process(settings, "--workers", "2") as (proc, url):
        wait_for(lambda: len(_api_workers(proc.pid)) == 2, 30, "two API worker processes")
        workers = _api_workers(proc.pid)
        headers = {"X-Shoal-Consistency": "strong"}  # no index built: the exact scan of the log answers

        def answers() -> bool:
            with httpx.Client(base_url=url, timeout=30) as http:
                r = http.post("/api/v1/search/W.Index/1", json=query, headers=headers)
                return r.status_code == 200 and r.json()[0]["nearestDataPoints"][0]["attributes"][0]["value"] == {
                    "int64": 1}

        assert all(answers() for _ in range(8))
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: len(_api_workers(proc.pid) - workers) == 1 and len(_api_workers(proc.pid)) == 2, 30,
                 "the killed worker to be replaced")
        wait_for(answers, 30, "the API to answer after a worker died")
        everyone = _api_workers(proc.pid)
        proc.terminate()  # what `shoal up` or a service manager sends
        assert proc.wait(30) == 0

        wait_for(lambda: all(_gone(pid) for pid in everyone), 30, "every API worker to stop with the API")


@pytest.mark.slow
def test_api_workers_end_with_a_supervisor_killed_and_the_port_is_free_again(
    make_settings: Callable[..., Settings],
) -> None:
    """A `shoal api --workers 2` supervisor killed with SIGKILL (a crash, the OOM killer) takes its workers with it:
    they went on serving the port, and a restart on it was refused ("port ... is in use") until someone killed
    them by hand."""
    import os
    import signal

    from conftest import free_port

    settings = make_settings("local")
    port = free_port()
    with api_process(settings, "--workers", "2", port=port) as (proc, _):
        wait_for(lambda: len(_api_workers(proc.pid)) == 2, 30, "two API worker processes")
        workers = _api_workers(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

        wait_for(lambda: all(_gone(pid) for pid in workers), 30, "the workers to end with their supervisor")
    with api_process(settings, "--workers", "2", port=port) as (proc, url):  # the port is free: it starts
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
