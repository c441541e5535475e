"""Ctrl-C on `shoal worker`: the first SIGINT is a warm shutdown (the running build finishes, exit 0), as
`shoal worker --help` promises; it used to reach Shoal's unrecoverable-error path and abort the build.

A real `shoal worker` process (its default prefork pool) on the session's catalog and broker, building a real
HNSW index big enough to take a few seconds.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import settings_env, stop_process, wait_for
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from shoal import DataSourceSpec, Shoal
from shoal.catalog.models import IndexShard
from shoal.config.settings import Settings
from shoal.log.records import IndexSpec

DIM = 32
POINTS = 20_000  # an HNSW build of these takes seconds: long enough to signal the worker in the middle of it


def _shoal_command() -> list[str]:
    """The `shoal` console script of this environment (or `python -m shoal.cli`)."""
    shoal_bin = Path(sys.executable).parent / "shoal"
    return [str(shoal_bin)] if shoal_bin.exists() else [sys.executable, "-m", "shoal.cli"]


def _queue_a_long_build(shoal: Shoal, points: int = POINTS) -> tuple[str, int]:
    """An HNSW index over `points` points, its build queued (the upload's trigger): its name and the log head."""
    tag = uuid.uuid4().hex[:8]
    spec = DataSourceSpec(f"sigint-{tag}", "1", DIM, {"id": "int64"}, ["id"])
    shoal.create_data_source(spec)
    index = f"sigint-{tag}-ix"
    shoal.create_index(IndexSpec(index, "1", spec.name, "1", algorithm="hnsw", metric="euclidean"))
    vectors = np.random.default_rng(7).standard_normal((points, DIM)).astype(np.float32)
    head = shoal.producer(spec.name, "1").upload_columns(vectors, {"id": np.arange(points)}).seq
    return index, head


def _built(shoal: Shoal, index: str) -> int:
    return min(s.built_watermark for s in shoal.index_status(index, "1"))


def _building(shoal: Shoal, index: str) -> bool:
    """Whether a worker holds a live build lease on a shard of the index: its task runs (a task only received
    waits in the worker's prefetch, and a warm shutdown hands it back rather than running it)."""
    shards = [s.id for s in shoal.get_index(index, "1").shards]
    with Session(shoal.engine) as s:
        return bool(s.scalar(select(func.count()).select_from(IndexShard).where(
            IndexShard.id.in_(shards), IndexShard.lease_owner.is_not(None),
            IndexShard.lease_expires_at > func.clock_timestamp())))


@pytest.mark.slow
def test_one_sigint_lets_the_running_build_finish_and_exits_0(
    make_settings: Callable[..., Settings], redis_url: str, tmp_path: Path
) -> None:
    settings = make_settings("local", redis_url=redis_url)
    log_path = tmp_path / "worker.log"
    with Shoal(settings) as shoal:
        index, head = _queue_a_long_build(shoal)
        with open(log_path, "w") as log:
            worker = subprocess.Popen([*_shoal_command(), "worker", "-c", "1", "--no-beat"], env=settings_env(settings),
                                      stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        worker.own_session = True  # type: ignore[attr-defined]  # stop_process then ends its pool too
        try:
            wait_for(lambda: _building(shoal, index), 60, "the worker to start the build")
            wait_for(lambda: _built(shoal, index) < head and "succeeded" not in log_path.read_text(), 1,
                     "the build to be still running")
            worker.send_signal(signal.SIGINT)
            code = worker.wait(120)
            text = log_path.read_text()
            assert "unrecoverable" not in text, text[-3000:]
            assert re.search(r"materialize_shard\[.*\] succeeded", text), text[-3000:]
            assert code == 0, text[-3000:]
            assert _built(shoal, index) == head  # the build was not lost
        finally:
            stop_process(worker)  # type: ignore[arg-type]

