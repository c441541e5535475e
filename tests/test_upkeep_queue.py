"""Beat's runs have a queue of their own (`shoal.upkeep`) that every worker consumes besides `shoal`: with a backlog
of builds in `shoal` longer than an upkeep entry's interval, the upkeep still runs while the backlog lasts. Before,
beat's runs waited behind the builds in one FIFO queue and each expired (its interval) before a worker reached it,
so pruning, GC, compaction and merges stopped for as long as the builds were backed up."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from conftest import settings_env, start_worker, stop_process, wait_for

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.log.records import IndexSpec
from shoal.workers.names import COLLECT_GARBAGE, MATERIALIZE_SHARD, QUEUE, QUEUES, UPKEEP_QUEUE

DIM = 32
SHARDS = 32
POINTS = 64_000  # about 2,000 a shard: each build takes well under GC_EVERY_S, the backlog many times it
GC_EVERY_S = 3.0
SPEC = DataSourceSpec("docs", "1", DIM, {"id": "int64"}, ["id"])


@pytest.fixture
def usettings(
    make_settings: Callable[..., Settings], redis_url: str, worker_catalog: str
) -> Iterator[Callable[..., Settings]]:
    """Settings on a catalog of the test's own with the real broker, on a database of the session's server
    emptied before and after (the test reads its queues); beat's only due entry is GC every GC_EVERY_S."""
    url = redis_url.rsplit("/", 1)[0] + "/14"
    client = redis.Redis.from_url(url)
    client.flushdb()

    def make(**overrides: object) -> Settings:
        values: dict[str, object] = {
            "database_url": worker_catalog, "redis_url": url, "sweep_interval_s": 3600.0, "merge_interval_s": 0.0,
            "generations_interval_s": 0.0, "purge_interval_s": 0.0, "compaction_interval_s": 0.0,
            "retention_interval_s": 0.0, "gc_interval_s": GC_EVERY_S, "quick_build_backlog_seqs": 0, **overrides,
        }
        return make_settings("local", **values)

    try:
        yield make
    finally:
        client.flushdb()
        client.close()


def _log(worker: subprocess.Popen[str]) -> str:
    return Path(worker.log_path).read_text()  # type: ignore[attr-defined]


def _succeeded_at(log: str, task: str) -> list[int]:
    """Where in the worker's log each run of `task` finished without an error (the solo pool runs one task at
    a time, so the order of these lines is the order the runs ran in)."""
    return [m.start() for m in re.finditer(rf"{re.escape(task)}\[[0-9a-f-]+\] succeeded", log)]


def _backlog(shoal: Shoal) -> None:
    """A flat index of SHARDS shards over POINTS committed points: the commit queues one materialization of
    every shard in QUEUE, and no worker runs yet."""
    shoal.create_data_source(SPEC)
    shoal.create_index(IndexSpec("ix", "1", "docs", "1", algorithm="flat", metric="euclidean", id_attributes=["id"],
                                 shard_count=SHARDS))
    vectors = np.random.default_rng(7).normal(size=(POINTS, DIM)).astype(np.float32)
    shoal.producer("docs", "1").upload_columns(vectors, {"id": np.arange(POINTS, dtype=np.int64)})


def test_upkeep_runs_while_a_backlog_of_builds_lasts(usettings: Callable[..., Settings]) -> None:
    """SHARDS builds wait in QUEUE when one worker (solo pool: one task at a time) with its embedded beat starts;
    beat sends GC every GC_EVERY_S, expiring after as long. GC runs before the last build does: the worker takes
    from the upkeep queue between builds instead of reaching each GC run only after the builds ahead of it."""
    settings = usettings()
    client = redis.Redis.from_url(str(settings.redis_url))
    with Shoal(settings) as shoal:
        _backlog(shoal)
        assert client.llen(QUEUE) >= SHARDS, "the commit did not queue the builds"
        worker = start_worker(settings, beat=True)
        try:
            wait_for(lambda: all(s.built_watermark == s.head for s in shoal.index_status("ix", "1"))
                     or worker.poll() is not None, 600, "every shard to be built")
            log = _log(worker)
            assert worker.poll() is None, log[-3000:]
            builds, gcs = _succeeded_at(log, MATERIALIZE_SHARD), _succeeded_at(log, COLLECT_GARBAGE)
            assert len(builds) >= SHARDS, log[-3000:]
            discarded = log.count(f"Discarding revoked task: {COLLECT_GARBAGE}[")
            # The upkeep ran while builds were still waiting, not only once the backlog drained.
            assert gcs and gcs[0] < builds[-1], (
                f"GC ran {len(gcs)} times, none before the last of {len(builds)} builds; {discarded} runs were "
                "discarded as expired")
        finally:
            stop_process(worker)
            client.close()


QUEUES_PROBE = """
import json
from shoal.workers.app import app
app.loader.import_default_modules()
router = app.amqp.router
print(json.dumps({
    "consumed": sorted(app.amqp.queues.consume_from),
    "routes": {e["task"]: router.route(dict(e["options"]), e["task"])["queue"].name
               for e in app.conf.beat_schedule.values()},
    "options": [e["options"] for e in app.conf.beat_schedule.values()],
    "build": router.route({}, "shoal.workers.tasks.materialize_shard")["queue"].name,
    "explicit": router.route({"queue": "shoal"}, "shoal.workers.tasks.purge_trash")["queue"].name,
}))
"""


def test_every_beat_entry_goes_to_the_upkeep_queue_that_every_worker_consumes(
    make_settings: Callable[..., Settings], redis_url: str,
) -> None:
    """With every entry on, each of beat's runs is routed to UPKEEP_QUEUE (still expiring after its interval); the
    builds stay in QUEUE; a worker started without -Q consumes both; a sender's explicit queue wins."""
    settings = make_settings(redis_url=redis_url, sweep_interval_s=3, merge_interval_s=7, generations_interval_s=600,
                             purge_interval_s=3600, compaction_interval_s=300, retention_interval_s=3600,
                             gc_interval_s=600)
    probe = subprocess.run([sys.executable, "-c", QUEUES_PROBE], env=settings_env(settings), capture_output=True,
                           text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    conf = json.loads(probe.stdout.strip().splitlines()[-1])
    assert conf["consumed"] == sorted(QUEUES) == sorted([QUEUE, UPKEEP_QUEUE])
    assert len(conf["routes"]) == 7 and set(conf["routes"].values()) == {UPKEEP_QUEUE}, conf["routes"]
    assert all(set(o) == {"expires"} for o in conf["options"]), conf["options"]
    assert conf["build"] == QUEUE and conf["explicit"] == QUEUE
