"""Bounds of the log's upkeep meeting its readers:

- a `retention_days` integer past the float range (the dataset API takes any non-negative integer) is a retention
  longer than the calendar: it keeps every point, and never stops the retention sweep of the other sources (every
  tenant's);
- a tag (or as_of) on an index made after a compaction, with a shard not built yet, reads the log from seq 0 up to
  a seq at or past the compaction's bound: it answers exactly, while a read that needs compacted entries refuses;
- retention completes while uploads keep landing (commits between its decision and its commit no longer make it
  start over until it gives up), and still never deletes a point upserted after its decision.
"""

from __future__ import annotations

import datetime as dt
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import use_settings_env, wait_for
from sqlalchemy import text

from shoal import DataPoint, DataSourceSpec, Shoal, Tombstone
from shoal.catalog.repo import SourceRecord
from shoal.config.settings import Settings
from shoal.engines.metrics import Metric, exact_top_k
from shoal.errors import NotFoundError
from shoal.index.builder import ShardBuilder
from shoal.log import retention
from shoal.log.commit import BatchSlot, _attempt
from shoal.log.records import IndexSpec
from shoal.log.segment_file import build_segment_table, store_segment
from shoal.log.validation import points_to_table
from shoal.workers.base import ShoalTask

DIM = 2


def _spec(name: str, retention_days: object) -> DataSourceSpec:
    return DataSourceSpec(name, "1", DIM, {"id": "int64"}, ["id"], custom_metadata={"retention_days": retention_days})


def _ids(shoal: Shoal, name: str) -> list[int]:
    return sorted(shoal.fold(name, "1")["id"].to_pylist())


# -- retention_days past the float range ------------------------------------------------------------------


@pytest.fixture
def worker_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Settings], None]]:
    """Give this process a worker's environment for `settings`, so beat's task functions run here directly."""

    def use(settings: Settings) -> None:
        use_settings_env(monkeypatch, settings)
        ShoalTask.reset_context()

    yield use
    ShoalTask.reset_context()


def test_a_retention_past_the_float_range_keeps_its_points_and_never_stops_the_sweep(
    make_shoal: Callable[..., Shoal], worker_env: Callable[[Settings], None], redis_url: str,
) -> None:
    """One source with retention_days 10**400 (float() overflows on it) made every run of the beat sweep fail
    with OverflowError before any source was looked at: no tenant expired anything."""
    from shoal.workers import tasks

    shoal = make_shoal(redis_url=redis_url)
    other = make_shoal(redis_url=redis_url)  # another tenant holding the huge value
    shoal.create_data_source(_spec("Forever", 10**400))
    shoal.create_data_source(_spec("Never", -(10**400)))  # a negative retention is none, as -5 is
    other.create_data_source(_spec("Forever", 10**400))
    # ~9 ms: old enough to expire once the clock moved past it, with no simulated `now` (beat's task takes none).
    short = 1e-7
    shoal.create_data_source(_spec("Short", short))
    for client, name in ((shoal, "Forever"), (shoal, "Never"), (other, "Forever"), (shoal, "Short")):
        client.producer(name, "1").upload([DataPoint({"id": i}, [float(i), 0.0]) for i in range(3)])
    ingested = max(shoal.fold("Short", "1")["__ingested_at"].to_pylist())
    wait_for(lambda: dt.datetime.now(dt.UTC) - dt.timedelta(days=short) > ingested, 10, "the short retention to end")

    mine = [(r.tenant, r.spec.name) for r in retention.sources_with_retention(shoal.engine)
            if r.tenant in (shoal.tenant, other.tenant)]
    assert sorted(mine) == sorted([(shoal.tenant, "Forever"), (shoal.tenant, "Short"), (other.tenant, "Forever")])

    worker_env(shoal.settings)
    done = tasks.apply_retention()  # beat's sweep, every tenant (other tests' sources too)
    assert done["expired"] >= 3
    assert _ids(shoal, "Short") == []
    assert _ids(shoal, "Forever") == [0, 1, 2] and _ids(other, "Forever") == [0, 1, 2]
    assert _ids(shoal, "Never") == [0, 1, 2]

    # By hand it answers as a retention of 1e300 days does: nothing older than a cutoff before year 1.
    for client in (shoal, other):
        result = client.apply_retention("Forever", "1", now=dt.datetime.now(dt.UTC) + dt.timedelta(days=10**6))
        assert result.expired == 0 and result.token is None and result.cutoff is None
        assert result.retention_days == sys.float_info.max
    assert shoal.apply_retention("Never", "1").retention_days is None
    assert _ids(shoal, "Forever") == [0, 1, 2]


# -- a tag or as_of on an index made after a compaction --------------------------------------------------


def _brute_force(shoal: Shoal, name: str, seq: int, query: np.ndarray, k: int) -> list[tuple[int, float]]:
    state = shoal.fold(name, "1", seq)
    vectors = np.asarray(state["__vector"].to_pylist(), dtype=np.float32).reshape(-1, DIM)
    ids = state["id"].to_pylist()
    dist, labels = exact_top_k(Metric("euclidean"), query, vectors, k)
    return sorted(((ids[j], round(float(d), 5)) for d, j in zip(dist[0], labels[0], strict=True) if j >= 0),
                  key=lambda hit: (hit[1], hit[0]))


def _hits(rows: list[Any]) -> list[tuple[int, float]]:
    """(id, distance) of the first query's hits, ties in id order (an engine may order ties either way)."""
    hits = ((h.attributes["id"], round(float(h.distance), 5)) for h in rows[0])
    return sorted(hits, key=lambda hit: (hit[1], hit[0]))


def test_a_tag_on_an_index_made_after_a_compaction_answers_before_every_shard_is_built(
    make_shoal: Callable[..., Shoal],
) -> None:
    """A 2-shard index made after a compaction reaching seq 13, shard 0 built and shard 1 not: a tag then pins
    shard 1 with no version (it reads the log from seq 0 up to the tag's seq 13, which is exact, as `fold` at 13
    is). It was refused for good ("take the tag again"); it answers as brute force over the log at seq 13, and so
    does as_of 13. As_of 12, below the compaction's bound, is refused as `fold` at 12 is."""
    shoal = make_shoal(tombstone_retention_s=0)
    shoal.create_data_source(DataSourceSpec("Src", "1", DIM, {"id": "int64"}, ["id"]))
    producer = shoal.producer("Src", "1")
    producer.upload([DataPoint({"id": i}, [float(i), 0.0]) for i in range(8)])  # seqs 1-8
    producer.upload([DataPoint({"id": i}, [float(i), 1.0]) for i in range(4)])  # seqs 9-12 supersede 0..3
    head = producer.upload([Tombstone({"id": 7})]).seq  # seq 13
    compaction = shoal.compact("Src", "1")
    assert compaction.entries_dropped > 0
    shoal.create_index(IndexSpec("New", "1", "Src", "1", algorithm="flat", metric="euclidean", id_attributes=["id"],
                                 shard_attributes=["id"], shard_count=2))
    shards = shoal.get_index("New", "1").shards
    ShardBuilder(shoal.engine, shoal.storage).materialize(shards[0].id)  # shard 1 not built yet
    pinned = shoal.tag_index("New", "1", "t")
    assert pinned[shards[1].id] is None and pinned[shards[0].id] is not None

    query = np.array([[2.5, 0.5]], dtype=np.float32)
    expected = _brute_force(shoal, "Src", head, query, 20)
    assert sorted(i for i, _ in expected) == [0, 1, 2, 3, 4, 5, 6]
    searcher = shoal.searcher(follow=False)
    try:
        assert _hits(searcher.search("New", "1", query, 20, tag="t")) == expected
        assert _hits(searcher.search("New", "1", query, 20, as_of=head)) == expected
        with pytest.raises(NotFoundError, match=f"the log below seq {head} was compacted"):
            shoal.fold("Src", "1", head - 1)
        with pytest.raises(NotFoundError, match=f"the log below seq {head} was compacted"):
            searcher.search("New", "1", query, 20, as_of=head - 1)
    finally:
        searcher.close()


def test_as_of_from_a_version_inside_the_compacted_range_is_still_refused(make_shoal: Callable[..., Shoal]) -> None:
    """A read from seq 0 past the bound is exact, but not one from a version inside the compacted range: as of
    seq 17, shard 0 answers from its version at seq 8 plus the log above it, whose tombstones (seqs 9-16, of every
    key that version holds) compaction dropped, while shard 1 (first built at 20) reads from 0. Refused, not
    answered with the deleted keys back."""
    shoal = make_shoal(tombstone_retention_s=0)
    shoal.create_data_source(DataSourceSpec("Src", "1", DIM, {"id": "int64"}, ["id"]))
    for name, shard_count in (("X", 2), ("Y", 1)):
        shoal.create_index(IndexSpec(name, "1", "Src", "1", algorithm="flat", metric="euclidean",
                                     id_attributes=["id"], shard_attributes=["id"], shard_count=shard_count))
    x0, x1 = (s.id for s in shoal.get_index("X", "1").shards)
    y = shoal.get_index("Y", "1").shards[0].id
    builder = ShardBuilder(shoal.engine, shoal.storage)
    producer = shoal.producer("Src", "1")
    producer.upload([DataPoint({"id": i}, [float(i), 0.0]) for i in range(8)])  # seqs 1-8
    builder.materialize(x0)  # X shard 0 at seq 8
    producer.delete({"id": list(range(8))})  # seqs 9-16
    builder.materialize(y)  # Y at seq 16: compaction stops there
    head = producer.upload([DataPoint({"id": i}, [float(i), 5.0]) for i in range(10, 14)]).seq  # seqs 17-20
    builder.materialize(x0)
    builder.materialize(x1)  # X shard 1's first version, at seq 20
    assert shoal.compact("Src", "1").entries_dropped == 16  # the tombstones of 9-16 and the points they deleted
    searcher = shoal.searcher(follow=False)
    try:
        with pytest.raises(NotFoundError, match="the log below seq 16 was compacted"):
            searcher.search("X", "1", np.zeros((1, DIM), np.float32), 20, as_of=17)
        assert head == 20  # from versions at or past the bound it answers
        assert [i for i, _ in _hits(searcher.search("X", "1", np.zeros((1, DIM), np.float32), 20, as_of=20))] == [
            10, 11, 12, 13]
    finally:
        searcher.close()


# -- retention while uploads keep landing ------------------------------------------------------------------

BULK = 50_000  # large enough that deciding the expiry takes far longer than an upload's commit


def _expiring_source(shoal: Shoal, name: str, days: float) -> dt.datetime:
    """A source of BULK points under `days` of retention; returns a `now` whose cutoff lies just after their
    ingestion, so that exactly they expire and every later upload is fresh."""
    shoal.create_data_source(_spec(name, days))
    shoal.producer(name, "1").upload_columns(np.zeros((BULK, DIM), np.float32), {"id": np.arange(BULK)})
    ingested = max(shoal.fold(name, "1")["__ingested_at"].to_pylist())
    return ingested + dt.timedelta(days=days, microseconds=1)


def _live(shoal: Shoal, name: str) -> dict[int, list[float]]:
    state = shoal.fold(name, "1")
    return dict(zip(state["id"].to_pylist(), state["__vector"].to_pylist(), strict=True))


class _Uploader(threading.Thread):
    """A real producer committing one small batch after another until stopped: each re-upserts a key of the
    bulk (walking through it) and adds a key of its own. `acked` holds every acknowledged point's last vector."""

    def __init__(self, shoal: Shoal, name: str) -> None:
        super().__init__(daemon=True)
        self.producer = shoal.producer(name, "1")
        self.acked: dict[int, list[float]] = {}
        self.commits = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        i = 0
        try:
            while not self.stop.is_set():
                points = {(i * 97) % BULK: [float(i), 1.0], BULK + i: [float(i), 2.0]}
                self.producer.upload([DataPoint({"id": k}, v) for k, v in points.items()])
                self.acked.update(points)
                self.commits += 1
                i += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def test_retention_completes_while_uploads_keep_landing(make_shoal: Callable[..., Shoal]) -> None:
    """50,000 expired points and a producer committing small batches without pause: every run of retention was
    refused (CommitError "the log kept moving") because a commit landed between its decision and its own, and
    the points stayed forever. Now the first run expires every point not upserted since, and every acknowledged
    upload (during the run too) stays live with its latest vector."""
    shoal = make_shoal()
    now = _expiring_source(shoal, "Busy", 1.0)
    uploader = _Uploader(shoal, "Busy")
    uploader.start()
    try:
        wait_for(lambda: uploader.commits >= 5 or uploader.error is not None, 30, "the uploads to start")
        before = uploader.commits
        result = shoal.apply_retention("Busy", "1", now=now)
        during = uploader.commits - before
    finally:
        uploader.stop.set()
        uploader.join(30)
    assert uploader.error is None, uploader.error
    assert during > 0  # the producer kept committing while retention ran
    live = _live(shoal, "Busy")
    # Every bulk point the producer did not upsert again expired; every acknowledged point is live, as uploaded.
    assert live == uploader.acked
    reupserted = sum(1 for k in uploader.acked if k < BULK)
    assert BULK - reupserted <= result.expired <= BULK
    assert shoal.apply_retention("Busy", "1", now=now).expired == 0


def _commit_while_locked(shoal: Shoal, source: SourceRecord, conn: Any, key: int, vector: list[float]) -> int:
    """Upsert one point through the commit protocol on `conn`, whose transaction holds the source's row lock
    (the test's window: retention waits for that lock with its decision made). Returns its seq."""
    spec = source.spec
    table = points_to_table(spec, [DataPoint({"id": key}, vector)], 10)

    def write(first_seq: int, keep: list[int]) -> Any:
        return store_segment(shoal.storage, source.tenant, spec.name, spec.version, first_seq,
                             build_segment_table([table]))

    [token] = _attempt(conn, source.id, [BatchSlot(1, None)], write, lock_timeout_ms=10_000, expect_head=None,
                       made=[])
    assert isinstance(token, int)
    return token


def test_a_point_upserted_between_the_decision_and_the_commit_is_never_expired(
    make_shoal: Callable[..., Shoal],
) -> None:
    """The race made deterministic: the test holds the source's row lock, so retention decides its expiry and
    then waits for the lock; inside that window the test re-upserts key 2 and commits. Retention must not
    tombstone key 2 (its decision saw the old, expired upsert) yet expire every other expired point, and finish
    however often the window repeats (each of its attempts meets a fresh commit)."""
    shoal = make_shoal()
    now = _expiring_source(shoal, "Raced", 1.0)
    source = shoal.get_data_source("Raced", "1")
    outcome: dict[str, Any] = {}

    def expire() -> None:
        try:
            outcome["result"] = shoal.apply_retention("Raced", "1", now=now)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            outcome["error"] = exc

    runner = threading.Thread(target=expire, daemon=True)
    windows, vector = 0, [0.0, 0.0]
    with shoal.engine.connect() as locker, shoal.engine.connect() as watcher:
        pid = locker.execute(text("SELECT pg_backend_pid()")).scalar_one()

        def retention_waits() -> bool:
            blocked = watcher.execute(
                text("SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"), {"pid": pid}
            ).scalar_one()
            watcher.rollback()  # pg_stat_activity is a snapshot per transaction: look again next time
            return bool(blocked) or not runner.is_alive()

        def lock() -> None:
            locker.execute(text("SELECT id FROM data_sources WHERE id = :id FOR UPDATE"), {"id": source.id})

        lock()  # before retention starts: its first decision meets the window
        runner.start()
        while True:
            wait_for(retention_waits, 60, "retention to wait for the source's lock")
            if not runner.is_alive():
                locker.rollback()
                break
            windows += 1
            vector = [2.0, float(windows)]
            _commit_while_locked(shoal, source, locker, 2, vector)
            locker.commit()
            lock()  # waits while retention holds the lock; retention's next attempt, if any, meets the window
        runner.join(60)
    assert "error" not in outcome, outcome.get("error")
    assert windows >= 1
    assert _live(shoal, "Raced") == {2: vector}
    assert outcome["result"].expired == BULK - 1
