"""What a `shoal up` leaves when it dies unannounced, or when its children cannot serve.

- SIGKILL to `shoal up` while its worker runs a long build: the worker got SIGTERM from the kernel (a warm stop)
  and went on until the build ended, minutes, its embedded beat scheduling beside the next `shoal up`'s. It now
  stops within `shoal up`'s stop timeout by itself, and the build is done by the next worker.
- An API child that cannot bind its port because another process holds it was announced "API ready" on every
  restart: something answered there.
- Flower's Broker page answered 404 "'redis' broker is not supported" (the app names its own transport).

Real processes, a real catalog and broker throughout.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port, settings_env, wait_for
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from shoal import DataSourceSpec, Shoal
from shoal.catalog.models import IndexShard
from shoal.config.settings import Settings
from shoal.log.records import IndexSpec

DIM = 64
POINTS = 80_000  # an HNSW build of these takes a minute or more here: far longer than the stop timeout below
STOP_TIMEOUT_S = 3
GONE_WITHIN_S = 40  # generous beside the stop timeout, and well short of the build (the old code waited for it)


def _session(sid: int) -> list[int]:
    """The live processes of session `sid` (a zombie counts as gone)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended while we looked
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _pids(text: str) -> dict[str, int]:
    """The children's pids as `shoal up` printed them at start: {"worker": 123, ...}."""
    return {name: int(pid) for name, pid in re.findall(r"^(\w+):.*\(pid (\d+)\)", text, re.MULTILINE)}


@contextlib.contextmanager
def _shoal_up(settings: Settings, log_name: str, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """`shoal up ARGS` in a session of its own, its output to `log_name` in the data dir; when the block ends
    whatever is left of it and of its children's sessions is killed."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    log_path = settings.data_dir / log_name
    with open(log_path, "wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "shoal", "up", *args], env=settings_env(settings),
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    up.log_path = log_path  # type: ignore[attr-defined]
    sessions: list[int] = []
    up.sessions = sessions  # type: ignore[attr-defined]
    try:
        yield up
    finally:
        if up.poll() is None:
            up.terminate()
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        for sid in [up.pid, *sessions]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(sid, signal.SIGKILL)


def _started(up: subprocess.Popen[bytes], *names: str) -> dict[str, int]:
    """Wait until `shoal up` printed the pids of the children `names`; remember their sessions for the cleanup."""
    text = up.log_path.read_text  # type: ignore[attr-defined]

    def printed() -> bool:
        assert up.poll() is None, text()
        return set(names) <= set(_pids(text()))

    wait_for(printed, 60, f"shoal up to start {', '.join(names)}")
    pids = {name: pid for name, pid in _pids(text()).items() if name in names}
    up.sessions.extend(pids.values())  # type: ignore[attr-defined]
    return pids


@pytest.fixture
def up_settings(make_settings: Callable[..., Settings], redis_url: str, worker_catalog: str) -> Settings:
    """A catalog of the test's own (beat sweeps every shard of it), the test broker, no merge sweep; a dead
    worker's lease runs out soon, and every build is at the index's own parameters."""
    return make_settings("local", database_url=worker_catalog, redis_url=redis_url, merge_interval_s=0,
                         lease_seconds=9.0, lease_heartbeat_s=3.0, sweep_interval_s=3.0, quick_build_backlog_seqs=0)


def _queue_a_long_build(shoal: Shoal) -> tuple[str, int]:
    """An HNSW index over POINTS points, its build queued (the upload's trigger): its name and the log head."""
    tag = uuid.uuid4().hex[:8]
    spec = DataSourceSpec(f"orphan-{tag}", "1", DIM, {"id": "int64"}, ["id"])
    shoal.create_data_source(spec)
    index = f"orphan-{tag}-ix"
    shoal.create_index(IndexSpec(index, "1", spec.name, "1", algorithm="hnsw", metric="euclidean"))
    vectors = np.random.default_rng(11).standard_normal((POINTS, DIM)).astype(np.float32)
    head = shoal.producer(spec.name, "1").upload_columns(vectors, {"id": np.arange(POINTS)}).seq
    return index, head


def _built(shoal: Shoal, index: str) -> int:
    return min(s.built_watermark for s in shoal.index_status(index, "1"))


def _building(shoal: Shoal, index: str) -> bool:
    """Whether a worker holds a live build lease on a shard of the index: its build runs."""
    shards = [s.id for s in shoal.get_index(index, "1").shards]
    with Session(shoal.engine) as s:
        return bool(s.scalar(select(func.count()).select_from(IndexShard).where(
            IndexShard.id.in_(shards), IndexShard.lease_owner.is_not(None),
            IndexShard.lease_expires_at > func.clock_timestamp())))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_the_worker_of_a_killed_up_stops_within_its_stop_timeout(up_settings: Settings) -> None:
    """SIGKILL to `shoal up` mid-build: every process of its worker's session (main, pool, beat) is gone well
    before the build could have ended, the build unfinished; the next `shoal up`'s worker builds the shard."""
    with Shoal(up_settings) as shoal:
        with _shoal_up(up_settings, "up1.log", "--no-api", "--no-consumer", "-c", "1",
                       "--stop-timeout", str(STOP_TIMEOUT_S)) as up:
            worker = _started(up, "worker")["worker"]
            wait_for(lambda: len(_session(worker)) >= 3, 60, "the worker's pool process and beat to start")
            index, head = _queue_a_long_build(shoal)
            wait_for(lambda: _building(shoal, index), 120, "the worker to start the build")
            up.kill()
            up.wait(10)
            wait_for(lambda: not _session(worker), GONE_WITHIN_S,
                     "no process of the worker's session to be left (it waited for its build)")
            assert _built(shoal, index) < head  # it was stopped mid-build: the premise of this test
        log = (up_settings.data_dir / "logs" / "worker.log").read_text()
        assert "the supervisor (pid" in log, log[-3000:]
        with _shoal_up(up_settings, "up2.log", "--no-api", "--no-consumer", "-c", "1") as up:
            _started(up, "worker")
            wait_for(lambda: _built(shoal, index) == head, 600, "the next worker to build the shard")


def _hold(port: int, until: float) -> socket.socket:
    """A plain listening socket on 127.0.0.1:`port`, bound as soon as the port is free (before `until`)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    while True:
        try:
            s.bind(("127.0.0.1", port))
            break
        except OSError:
            if time.monotonic() > until:
                s.close()
                raise
            time.sleep(0.01)
    s.listen()
    return s


def test_an_api_that_cannot_bind_is_not_announced_ready(up_settings: Settings) -> None:
    """After start, the API child is killed and a plain socket takes its port: each restart fails to bind;
    `shoal up` said "API ready" for every one of them."""
    port = free_port()
    with _shoal_up(up_settings, "up.log", "--no-consumer", "--port", str(port), "-c", "1") as up:
        text = up.log_path.read_text  # type: ignore[attr-defined]
        api = _started(up, "worker", "api")["api"]
        wait_for(lambda: text().count("API ready at") == 1, 60, "shoal up to announce the API")
        os.kill(api, signal.SIGKILL)
        squatter = _hold(port, time.monotonic() + 10)
        try:
            # The first restarts come after 1, 2 and 4 s: three of them fail here.
            wait_for(lambda: text().count("api restarted") >= 3 and text().count("exited unexpectedly") >= 4,
                     60, "three restarts of the API to fail")
            assert text().count("API ready at") == 1, text()
            assert "is in use" in text(), text()  # the failure is told (from the child's log)
        finally:
            squatter.close()
        wait_for(lambda: text().count("API ready at") == 2, 90, "the API to be announced once it serves again")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - a loopback URL of the test
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def test_flowers_broker_page_shows_the_queues(up_settings: Settings) -> None:
    """Flower's Broker page answered 404 "'redis' broker is not supported": Flower read the app's own transport
    name for the broker's scheme."""
    port = free_port()
    with _shoal_up(up_settings, "up.log", "--no-api", "--no-consumer", "--flower", "--flower-port", str(port),
                   "-c", "1") as up:
        text = up.log_path.read_text  # type: ignore[attr-defined]
        _started(up, "worker", "flower")
        wait_for(lambda: "Flower ready at" in text(), 60, "shoal up to announce Flower")
        status, body = _get(f"http://127.0.0.1:{port}/broker")
        assert status == 200, body[-2000:]
        assert "not supported" not in body, body[-2000:]
        assert "redis://" in body  # the page, naming the broker by its URL
