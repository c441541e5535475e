"""Task coalescing with real workers: while a shard's build lease is held by a live process, commits and beat's
sweeps leave at most one materialization of the shard waiting for it (not one more per commit and per sweep),
and the shard is built up to the last commit once the lease is free; a merge that runs longer than
SHOAL_PENDING_TTL_S keeps its pending mark, so no second merge of the same segments starts beside it; beat's
runs expire after their interval, so a worker that was away drops the stale ones instead of running them all, and
go to a queue of their own, so a backlog of builds does not expire every one of them."""

from __future__ import annotations

import datetime as dt
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
from shoal.catalog.indexes import ShardCatalog
from shoal.config.settings import Settings
from shoal.index.builder import MergePolicy, ShardBuilder
from shoal.index.lease import default_owner
from shoal.index.manifest import Manifest
from shoal.log.records import IndexSpec
from shoal.workers.app import beat_schedule
from shoal.workers.names import (
    COLLECT_GARBAGE,
    MATERIALIZE_SHARD,
    MERGE_SHARD,
    QUEUE,
    QUEUES,
    SWEEP,
    SWEEP_MERGES,
    UPKEEP_QUEUE,
)

DIM = 8
SPEC = DataSourceSpec("docs", "1", DIM, {"id": "int64"}, ["id"])


@pytest.fixture
def wsettings(
    make_settings: Callable[..., Settings], redis_url: str, worker_catalog: str
) -> Iterator[Callable[..., Settings]]:
    """Settings on a catalog of the test's own (beat sweeps all of it) with the real broker and a sweep every
    second; keyword arguments override. The broker is a database of the session's server that is emptied before
    and after: these tests count the tasks their worker receives, and a task another test left queued on the
    shared database would be counted too."""
    url = redis_url.rsplit("/", 1)[0] + "/12"
    client = redis.Redis.from_url(url)
    client.flushdb()

    def make(**overrides: object) -> Settings:
        values: dict[str, object] = {"database_url": worker_catalog, "redis_url": url, "sweep_interval_s": 1.0,
                                     "merge_interval_s": 0.0, **overrides}
        return make_settings("local", **values)

    try:
        yield make
    finally:
        client.flushdb()
        client.close()


def _index(shoal: Shoal) -> int:
    """An empty data source with a flat index `ix`/`1` over it; returns its shard's id."""
    shoal.create_data_source(SPEC)
    index = shoal.create_index(IndexSpec("ix", "1", "docs", "1", algorithm="flat", metric="euclidean",
                                         id_attributes=["id"]))
    return index.shards[0].id


def _upload(shoal: Shoal, ids: range) -> int:
    """Commit points with these ids; returns the commit's seq."""
    vectors = np.random.default_rng(ids.start).normal(size=(len(ids), DIM)).astype(np.float32)
    return shoal.producer("docs", "1").upload_columns(vectors, {"id": np.asarray(ids, dtype=np.int64)}).seq


def _started(settings: Settings, *, beat: bool = False) -> subprocess.Popen[str]:
    """A real worker (with an embedded beat when `beat`), returned once it takes tasks."""
    worker = start_worker(settings, beat=beat)
    wait_for(lambda: " ready." in _log(worker) or worker.poll() is not None, 60, "the worker to start")
    assert worker.poll() is None, _log(worker)[-3000:]
    return worker


def _log(worker: subprocess.Popen[str]) -> str:
    """The worker's log so far."""
    return Path(worker.log_path).read_text()  # type: ignore[attr-defined]


def _received(workers: list[subprocess.Popen[str]], task: str) -> set[str]:
    """The ids of the `task` runs these workers received (a Celery retry keeps its task's id)."""
    return {m for w in workers for m in re.findall(rf"{re.escape(task)}\[([0-9a-f-]+)\] received", _log(w))}


def _succeeded(workers: list[subprocess.Popen[str]], task: str) -> int:
    """How many runs of `task` these workers finished without an error."""
    return sum(len(re.findall(rf"{re.escape(task)}\[[0-9a-f-]+\] succeeded", _log(w))) for w in workers)


def test_a_long_build_elsewhere_leaves_one_materialization_waiting_and_the_shard_built_after_it(
    wsettings: Callable[..., Settings],
) -> None:
    """A live process holds the shard's lease (a long build) while five commits land and beat sweeps the lagging
    shard every second: the worker receives at most two materializations of the shard (one waits, retrying, for
    the lease; a commit may slip in as it starts a retry), not one per commit and sweep; once the lease is
    released, the shard is built up to the last commit."""
    settings = wsettings()
    with Shoal(settings) as shoal:
        shard_id = _index(shoal)
        shards = ShardCatalog(shoal.engine)
        holder = default_owner()  # this test process: alive, so its lease is never taken over
        assert shards.acquire_lease(shard_id, holder, 600.0)
        worker = _started(settings, beat=True)
        try:
            last = 0
            for i in range(5):  # each commit queues a materialization of the shard (coalesced)
                last = _upload(shoal, range(10 * i, 10 * i + 10))
            sweeps = _succeeded([worker], SWEEP)
            wait_for(lambda: _succeeded([worker], SWEEP) >= sweeps + 5, 60, "five sweeps of the lagging shard")
            received = _received([worker], MATERIALIZE_SHARD)
            assert 1 <= len(received) <= 2, received
            assert shoal.index_status("ix", "1")[0].built_watermark == 0  # the holder's lease kept the worker out

            shards.release_lease(shard_id, holder)
            wait_for(lambda: shoal.index_status("ix", "1")[0].built_watermark == last, 90,
                     "the shard to be built up to the last commit once the lease is free")
            assert len(_received([worker], MATERIALIZE_SHARD)) <= 2
            assert " raised unexpected" not in _log(worker), _log(worker)[-3000:]
        finally:
            stop_process(worker)
            shards.release_lease(shard_id, holder)


def test_a_merge_longer_than_the_pending_ttl_is_not_started_twice(wsettings: Callable[..., Settings]) -> None:
    """One merge is due; it builds and then waits to publish while this process holds the shard's lease, far
    longer than SHOAL_PENDING_TTL_S (1 s), as beat's merge sweep runs every second and a second worker stands
    idle: no second merge of the shard is queued or started; the one merge publishes once the lease is free."""
    settings = wsettings(merge_interval_s=1.0, pending_ttl_s=1.0, max_segments=2, min_merge_segments=2,
                         quick_build_backlog_seqs=0)
    with Shoal(settings, notify=False) as shoal:
        shard_id = _index(shoal)
        builder = ShardBuilder(shoal.engine, shoal.storage, policy=MergePolicy(2, 0.3, 2))
        for i in range(3):  # three segments, two allowed: one merge is due
            _upload(shoal, range(100 * i, 100 * i + 100))
            builder.materialize(shard_id)
        shards = ShardCatalog(shoal.engine)
        holder = default_owner()
        assert shards.acquire_lease(shard_id, holder, 600.0)
        workers = [_started(settings, beat=True), _started(settings)]

        def merges() -> set[str]:
            return _received(workers, MERGE_SHARD)

        try:
            built = f"merge of shard {shard_id}:"
            wait_for(lambda: any(built in _log(w) for w in workers), 60, "the merge to build (it then waits)")
            sweeps = _succeeded(workers, SWEEP_MERGES)
            # Four merge sweeps later (over 3 s: the mark, unrenewed, would have expired) the merge still waits,
            # alone (a second merge would also keep the idle worker busy, so the sweeps would stop).
            wait_for(lambda: _succeeded(workers, SWEEP_MERGES) >= sweeps + 4 or len(merges()) > 1, 60,
                     "four more merge sweeps")
            assert len(merges()) == 1, merges()

            shards.release_lease(shard_id, holder)
            wait_for(lambda: _succeeded(workers, MERGE_SHARD) == 1, 60, "the merge to publish")
            active = shards.active_version(shard_id)
            # The two smallest merged into one (min_merge_segments=2): two segments are left, as max_segments allows.
            assert active is not None and len(Manifest.of(active.manifest).segments) == 2
            assert len(merges()) == 1
            assert sum(_log(w).count(built) for w in workers) == 1  # one build of the merged segment
        finally:
            for worker in workers:
                stop_process(worker)
            shards.release_lease(shard_id, holder)


def test_every_beat_entry_expires_after_its_interval(make_settings: Callable[..., Settings]) -> None:
    """Beat's runs are idempotent sweeps: one still queued when the next is due is dropped, not run late."""
    schedule = beat_schedule(make_settings(sweep_interval_s=2.5, merge_interval_s=30, generations_interval_s=600,
                                           purge_interval_s=3600, compaction_interval_s=300,
                                           retention_interval_s=3600, gc_interval_s=600))
    assert len(schedule) == 7, schedule
    for name, entry in schedule.items():
        assert entry["options"] == {"expires": entry["schedule"]}, name
    assert schedule["sweep-lagging-shards"]["options"] == {"expires": 2.5}


def test_a_worker_back_after_beat_ran_alone_drops_the_stale_sweeps(wsettings: Callable[..., Settings]) -> None:
    """Beat runs with no worker: its sweeps queue up, each expiring after its interval (1 s). A worker that
    starts once they expired discards them instead of running them one by one."""
    settings = wsettings()
    client = redis.Redis.from_url(str(settings.redis_url))

    def queued_sweeps() -> list[dict[str, object]]:
        messages = [json.loads(m) for m in client.lrange(UPKEEP_QUEUE, 0, -1)]  # beat's runs: not behind builds
        return [m["headers"] for m in messages if m["headers"]["task"] == SWEEP]

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    with open(settings.data_dir / "beat.log", "w") as out:
        beat = subprocess.Popen([sys.executable, "-m", "celery", "-A", "shoal.workers.app", "beat", "--loglevel",
                                 "INFO", "--schedule", str(settings.data_dir / "beat-schedule")],
                                env=settings_env(settings), stdout=out, stderr=subprocess.STDOUT, text=True)
    worker = None
    try:
        try:
            wait_for(lambda: len(queued_sweeps()) >= 3, 60, "beat to queue three sweeps with no worker")
        finally:
            stop_process(beat)
        stale = queued_sweeps()
        assert all(h.get("expires") for h in stale), stale
        latest = max(dt.datetime.fromisoformat(str(h["expires"])) for h in stale)
        wait_for(lambda: dt.datetime.now(dt.UTC) > latest, 30, "the queued sweeps to expire")
        worker = started = _started(settings)
        wait_for(lambda: _log(started).count(f"Discarding revoked task: {SWEEP}[") >= len(stale), 60,
                 "the worker to discard every stale sweep")
        assert _succeeded([started], SWEEP) == 0, _log(started)[-3000:]
    finally:
        if worker is not None:
            stop_process(worker)
        client.close()


# -- beat's runs on a queue of their own ----------------------------------------------------------------------------
# Every worker consumes `shoal.upkeep` besides `shoal`: with a backlog of builds in `shoal` longer than an upkeep
# entry's interval, the upkeep still runs while the backlog lasts. Before, beat's runs waited behind the builds in
# one FIFO queue and each expired (its interval) before a worker reached it, so pruning, GC, compaction and merges
# stopped for as long as the builds were backed up.

BACKLOG_DIM = 32
SHARDS = 32
POINTS = 6_400  # 200 a shard: what counts is how many builds wait ahead of the run, not how long each takes
BACKLOG_SPEC = DataSourceSpec("backlog", "1", BACKLOG_DIM, {"id": "int64"}, ["id"])


def _succeeded_at(log: str, task: str) -> list[int]:
    """Where in the worker's log each run of `task` finished without an error (the solo pool runs one task at
    a time, so the order of these lines is the order the runs ran in)."""
    return [m.start() for m in re.finditer(rf"{re.escape(task)}\[[0-9a-f-]+\] succeeded", log)]


def _backlog(shoal: Shoal) -> None:
    """A flat index of SHARDS shards over POINTS committed points: the commit queues one materialization of
    every shard in QUEUE, and no worker runs yet."""
    shoal.create_data_source(BACKLOG_SPEC)
    shoal.create_index(IndexSpec("ix", "1", "backlog", "1", algorithm="flat", metric="euclidean",
                                 id_attributes=["id"], shard_count=SHARDS))
    vectors = np.random.default_rng(7).normal(size=(POINTS, BACKLOG_DIM)).astype(np.float32)
    shoal.producer("backlog", "1").upload_columns(vectors, {"id": np.arange(POINTS, dtype=np.int64)})


# A GC run sent as beat sends it (the app's routes, an expiry), from a process of its own: the app is configured
# from the environment at its first use, and this test process's may be another test's by now.
SEND_AS_BEAT = """
import sys
from shoal.workers.app import app
app.send_task(sys.argv[1], expires=float(sys.argv[2]))
"""


def test_upkeep_runs_while_a_backlog_of_builds_lasts(wsettings: Callable[..., Settings]) -> None:
    """SHARDS builds wait in QUEUE, then a GC run is sent as beat sends one, before any worker runs. One worker (solo
    pool: one task at a time) starts: it takes from the upkeep queue between builds, so GC runs before the last
    build. In one FIFO queue the run waited behind every build (here it would run last; with a backlog longer than
    its expiry, beat's interval, it was discarded: every run was, while the backlog lasted). No clock decides
    this: the run is queued behind the builds, and expires long after they are done."""
    settings = wsettings()
    client = redis.Redis.from_url(str(settings.redis_url))
    with Shoal(settings) as shoal:
        _backlog(shoal)
        assert client.llen(QUEUE) >= SHARDS, "the commit did not queue the builds"
        sent = subprocess.run([sys.executable, "-c", SEND_AS_BEAT, COLLECT_GARBAGE, "600"],
                              env=settings_env(settings), capture_output=True, text=True, timeout=120)
        assert sent.returncode == 0, sent.stderr
        worker = start_worker(settings)
        try:
            wait_for(lambda: (all(s.built_watermark == s.head for s in shoal.index_status("ix", "1"))
                              and COLLECT_GARBAGE in _log(worker)) or worker.poll() is not None, 600,
                     "every shard to be built and the GC run to be taken")
            log = _log(worker)
            assert worker.poll() is None, log[-3000:]
            wait_for(lambda: _succeeded_at(_log(worker), COLLECT_GARBAGE), 120, "the GC run to end")
            log = _log(worker)
            builds, gcs = _succeeded_at(log, MATERIALIZE_SHARD), _succeeded_at(log, COLLECT_GARBAGE)
            assert len(builds) >= SHARDS, log[-3000:]
            # The upkeep ran while builds were still waiting, not only once the backlog drained.
            assert gcs[0] < builds[-1], f"GC ran after all {len(builds)} builds: it waited behind them"
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
