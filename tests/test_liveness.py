"""Saying when nothing indexes: `/healthz`, `shoal status` and the API's log tell a user who runs `shoal api`
alone that no worker will build the indexes their uploads lag behind, and stop saying so once one runs.

Real parts only: the embedded Postgres and Valkey of conftest, a real Celery worker process, the API
(create_app, with its lifespan's Runtime and health monitor) over real HTTP.
"""

from __future__ import annotations

import json
import logging
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import serve_api, start_worker, stop_process, wait_for
from typer.testing import CliRunner

from shoal import DataSourceSpec, Shoal
from shoal.api import health
from shoal.cli import app as cli_app
from shoal.config.settings import Settings
from shoal.log.records import IndexSpec
from shoal.runtime import Runtime
from shoal.servers.broker import broker_url
from shoal.workers import liveness

DIM = 8
NO_WORKER = "no indexer worker is alive"
BROKER_DOWN = "cannot reach the broker"


def healthz(base: str) -> tuple[int, dict[str, Any], str]:
    """GET /healthz: status code, decoded body and the raw body text."""
    with urllib.request.urlopen(f"{base}/healthz", timeout=30) as response:
        text = response.read().decode()
        return int(response.status), json.loads(text), text


def shoal_status(settings: Settings, *args: str) -> tuple[str, str]:
    """`shoal status ARGS` in process with these settings as its environment; its stdout and its stderr (where
    its warnings go)."""
    result = CliRunner().invoke(cli_app, ["status", *args], env=settings.child_env())
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout, result.stderr


def _lagging_index(settings: Settings) -> tuple[Shoal, str, int]:
    """A data source with a flat index and 200 uploaded points nothing has built yet: (client, index, head)."""
    client = Shoal(settings)
    name = f"live-{uuid.uuid4().hex[:8]}"
    client.create_data_source(DataSourceSpec(name, "1", DIM, {"id": "int64"}, ["id"]))
    client.create_index(IndexSpec(f"{name}.flat", "1", name, "1", algorithm="flat", metric="euclidean"))
    vectors = np.random.default_rng(3).standard_normal((200, DIM)).astype(np.float32)
    head = client.producer(name, "1").upload_columns(vectors, {"id": np.arange(200)}).seq
    return client, f"{name}.flat", head


@pytest.mark.slow
def test_healthz_and_status_say_nothing_indexes_until_a_worker_runs(
    make_settings: Callable[..., Settings], redis_url: str
) -> None:
    settings = make_settings(redis_url=redis_url)
    client, index, head = _lagging_index(settings)
    worker = None
    try:
        with serve_api(settings) as base:
            code, body, _ = healthz(base)
            assert code == 200
            assert body["status"] == "degraded" and body["workers"] == 0
            assert body["lagging_shards"] >= 1 and body["max_lag_seqs"] >= head  # other tenants may lag too
            assert any(p.startswith(NO_WORKER) and "`shoal worker`" in p for p in body["problems"])

            table, warnings = (" ".join(text.split()) for text in shoal_status(settings))  # rich wraps lines
            assert f"{index}/1" in table and f"warning: {NO_WORKER}" in warnings and "`shoal up`" in warnings
            rows = json.loads(shoal_status(settings, index, "1", "--json")[0])
            assert rows[0]["built_watermark"] == 0
            assert rows[0]["health"]["status"] == "degraded" and rows[0]["health"]["workers"] == 0

            worker = start_worker(settings)
            wait_for(lambda: all(s.built_watermark == head for s in client.index_status(index, "1")), 120,
                     "the worker to build the index up to the head")
            wait_for(lambda: healthz(base)[1]["status"] == "ok", 30, "/healthz to say ok")
            code, body, _ = healthz(base)
            assert code == 200 and body["workers"] >= 1 and body["problems"] == []

            rows = json.loads(shoal_status(settings, index, "1", "--json")[0])
            assert rows[0]["built_watermark"] == head and rows[0]["health"]["workers"] >= 1
            assert "warning" not in "".join(shoal_status(settings, index, "1"))
    finally:
        if worker is not None:
            stop_process(worker)
        client.close()


def test_a_worker_consuming_no_index_queue_is_no_indexer(
    make_settings: Callable[..., Settings], redis_url: str
) -> None:
    """A worker that answers pings but consumes other queues only (`-Q`; another application's worker on the same
    broker) builds nothing: counted as alive, it hid the stall ("ok", no warning, lag growing)."""
    settings = make_settings(redis_url=redis_url)
    client, index, _ = _lagging_index(settings)
    name = f"elsewhere-{uuid.uuid4().hex[:6]}@localhost"
    worker = start_worker(settings, "-Q", "elsewhere", "-n", name)
    try:
        control = liveness._control_app(broker_url(settings)).control
        wait_for(lambda: any(name in reply for reply in control.ping(timeout=1) or []), 60, "the worker to answer")
        with serve_api(settings) as base:
            code, body, _ = healthz(base)
        assert code == 200 and body["status"] == "degraded" and body["workers"] == 0, body
        assert any(p.startswith(NO_WORKER) for p in body["problems"]), body
        assert client.index_status(index, "1")[0].built_watermark == 0  # indeed: nothing was built
    finally:
        stop_process(worker)
        client.close()


def test_healthz_with_unreachable_broker_answers_degraded_without_internals(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings(redis_url="redis://127.0.0.1:1/0")  # nothing listens on port 1
    with serve_api(settings) as base:
        code, body, text = healthz(base)
    assert code == 200
    assert body["status"] == "degraded" and body["workers"] == 0
    assert any(p.startswith(BROKER_DOWN) for p in body["problems"])
    for internal in ("127.0.0.1", "redis://", "Error", "refused", "Traceback"):
        assert internal not in text


def test_monitor_logs_once_per_change_of_state(
    make_settings: Callable[..., Settings], caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(redis_url="redis://127.0.0.1:1/0")
    caplog.set_level(logging.INFO, logger="shoal.api.health")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "shoal.api.health" and r.levelname == "WARNING"]

    with Runtime(settings) as runtime:
        monitor = health.HealthMonitor(runtime, interval_s=0.1)
        monitor.start()
        try:
            wait_for(lambda: len(warnings()) >= 1, 30, "the monitor to warn that the broker is down")
        finally:
            monitor.stop()
        assert BROKER_DOWN in warnings()[0] and "127.0.0.1" not in warnings()[0]
        # The same state checked again: no second warning (it repeats only after repeat_s, 5 minutes).
        checks = [monitor.check(), monitor.check()]
        assert all(r.status == "degraded" for r in checks)
        assert len(warnings()) == 1
