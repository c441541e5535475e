"""The concurrency vocabulary, as a user of each module sees it: ConflictError for a lost race or a stale
precondition (nothing written; reload and retry), StateUnknownError for a commit that may have landed, one
row lock per data source, and typed manifests that read and write the JSON the catalog stores."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pytest
from conftest import wait_for
from sqlalchemy import update
from sqlalchemy.exc import OperationalError

from shoal import DataPoint, DataSourceSpec, Shoal, Tombstone
from shoal.catalog.locks import in_tenant, lock_source, lock_sources
from shoal.catalog.models import DataSource
from shoal.config.settings import Settings
from shoal.errors import (
    CommitError,
    ConflictError,
    LeaseBusyError,
    NotFoundError,
    ShoalError,
    StateUnknownError,
)
from shoal.index.builder import LeaseBusyError as BuilderLeaseBusyError
from shoal.index.builder import ShardBuilder
from shoal.index.generations import Generations
from shoal.index.manifest import Manifest, SegmentEntry
from shoal.index.segment import manifest_files, segment_files
from shoal.log.commit import BatchSlot, commit_group
from shoal.log.records import IndexSpec
from shoal.log.segment_file import WrittenSegment, build_segment_table, count_ops, encode_segment
from shoal.log.validation import columns_to_table
from shoal.storage import Storage
from shoal.storage.layout import segment_path

SPEC = DataSourceSpec("Docs", "1", 2, {"id": "int64", "lang": "string"}, ["id", "lang"])


@pytest.fixture
def shoal(make_settings: Callable[..., Settings]) -> Iterator[Shoal]:
    client = Shoal(make_settings("local"), notify=False)  # these tests drive every build themselves
    client.create_data_source(SPEC)
    yield client
    client.close()


def points(ids: range, lang: str = "en") -> list[DataPoint]:
    return [DataPoint({"id": i, "lang": lang}, [float(i), 1.0]) for i in ids]


def tombstone_writer(shoal: Shoal, ids: list[int], calls: list[int]) -> Callable[[int, list[int]], WrittenSegment]:
    """A real segment writer (as retention's): one segment of tombstones for `ids`; records each call."""
    table = columns_to_table(SPEC, None, {"id": ids, "lang": ["en"] * len(ids)}, 100, delete=True)

    def write(first_seq: int, keep: list[int]) -> WrittenSegment:
        calls.append(first_seq)
        seg = build_segment_table([table for _ in keep])
        seg_id = uuid.uuid4()
        path = segment_path(shoal.tenant, SPEC.name, SPEC.version, first_seq, seg_id)
        buf, digest = encode_segment(seg)
        shoal.storage.write_atomic(path, buf)
        upserts, tombstones = count_ops(seg)
        return WrittenSegment(seg_id, path, buf.size, digest, upserts, tombstones)

    return write


def commit(shoal: Shoal, ids: list[int], calls: list[int], **kw: Any) -> list[int]:
    source_id = shoal.get_data_source(SPEC.name, SPEC.version).id
    return commit_group(
        shoal.engine, source_id, [BatchSlot(len(ids), kw.pop("batch_id", None))], tombstone_writer(shoal, ids, calls),
        shoal.storage.delete_quietly, retries=2, lock_timeout_ms=2000, **kw,
    )


# -- the error classes --------------------------------------------------------------------------------------


def test_the_vocabulary_is_two_errors_under_shoal_error() -> None:
    assert issubclass(ConflictError, ShoalError) and issubclass(StateUnknownError, ShoalError)
    # A lost lease is a conflict; the old import path still names the same class.
    assert issubclass(LeaseBusyError, ConflictError) and BuilderLeaseBusyError is LeaseBusyError
    # An unknown outcome is a commit that was not acknowledged: existing `except CommitError` still catch it.
    assert issubclass(StateUnknownError, CommitError) and not issubclass(StateUnknownError, ConflictError)
    err = ConflictError("head moved", expected=3, actual=7)
    assert (err.expected, err.actual, str(err)) == (3, 7, "head moved")


# -- expect_head: the commit's precondition ----------------------------------------------------------------


def test_a_commit_with_a_stale_expect_head_raises_conflict_with_the_actual_head_and_writes_nothing(
    shoal: Shoal,
) -> None:
    producer = shoal.producer(SPEC.name, SPEC.version)
    decided_at = producer.upload(points(range(5))).seq
    head = producer.upload(points(range(2, 3))).seq  # key 2 updated after the decision
    files = shoal.storage.list_files(shoal.log_dir(SPEC.name, SPEC.version))
    calls: list[int] = []

    with pytest.raises(ConflictError) as refused:
        commit(shoal, [0, 1, 2], calls, expect_head=decided_at)
    assert (refused.value.expected, refused.value.actual) == (decided_at, head)
    # Refused under the lock before any file was written: the log is as it was.
    assert calls == []
    assert shoal.get_data_source(SPEC.name, SPEC.version).head_seq == head
    assert shoal.storage.list_files(shoal.log_dir(SPEC.name, SPEC.version)) == files
    assert sorted(shoal.fold(SPEC.name, SPEC.version)["id"].to_pylist()) == [0, 1, 2, 3, 4]

    # Reloaded, the same commit goes through.
    assert commit(shoal, [0, 1], calls, expect_head=head) == [head + 2]
    assert sorted(shoal.fold(SPEC.name, SPEC.version)["id"].to_pylist()) == [2, 3, 4]


def test_a_replayed_batch_id_gets_its_token_even_when_its_expect_head_is_stale(shoal: Shoal) -> None:
    # The batch id proves the decision landed already: a replay is answered, not refused.
    head = shoal.producer(SPEC.name, SPEC.version).upload(points(range(3))).seq
    calls: list[int] = []
    token = commit(shoal, [0], calls, expect_head=head, batch_id="expire-once")
    assert commit(shoal, [0], calls, expect_head=head, batch_id="expire-once") == [token[0]]
    assert calls == [head + 1]


# -- the data source's row lock ----------------------------------------------------------------------------


def test_lock_source_returns_the_locked_row_and_refuses_missing_and_trashed_sources(shoal: Shoal) -> None:
    record = shoal.get_data_source(SPEC.name, SPEC.version)
    head = shoal.producer(SPEC.name, SPEC.version).upload(points(range(4))).seq
    with shoal.engine.begin() as conn:
        locked = lock_source(conn, record.id, lock_timeout_ms=1000)
        assert (locked.id, locked.name, locked.version, locked.head_seq, locked.deleted_at) == (
            record.id, SPEC.name, SPEC.version, head, None
        )
    with shoal.engine.begin() as conn:
        with pytest.raises(NotFoundError, match="not found"):
            lock_source(conn, 10**12)
    with shoal.engine.begin() as conn:
        assert lock_source(conn, 10**12, missing_ok=True) is None
    with shoal.engine.begin() as conn:
        conn.execute(update(DataSource).where(DataSource.id == record.id).values(deleted_at=DataSource.created_at))
        assert lock_source(conn, record.id).deleted_at is not None  # found: the caller decides
        with pytest.raises(NotFoundError, match="in the trash"):
            lock_source(conn, record.id, live=True)
        conn.rollback()


def test_lock_source_waits_at_most_its_timeout_for_a_holder(shoal: Shoal) -> None:
    record = shoal.get_data_source(SPEC.name, SPEC.version)
    with shoal.engine.begin() as holder:
        lock_source(holder, record.id)
        with shoal.engine.begin() as waiter, pytest.raises(OperationalError, match="lock"):
            lock_source(waiter, record.id, lock_timeout_ms=100)
        # A sweep passes over a held row instead of waiting for it.
        with shoal.engine.begin() as sweep:
            assert lock_sources(sweep, in_tenant(shoal.tenant), skip_locked=True) == []
        # A commit waits on the same lock: it fails (after its bounded retries) rather than slipping past.
        with pytest.raises(CommitError):
            commit_group(shoal.engine, record.id, [BatchSlot(1, None)], tombstone_writer(shoal, [1], []),
                         shoal.storage.delete_quietly, retries=1, lock_timeout_ms=100)
    with shoal.engine.begin() as sweep:
        assert [r.id for r in lock_sources(sweep, in_tenant(shoal.tenant), skip_locked=True)] == [record.id]


# -- typed manifests ---------------------------------------------------------------------------------------


def test_a_manifest_round_trips_the_json_of_a_real_built_version(shoal: Shoal) -> None:
    shoal.create_index(IndexSpec("Docs.Index", "1", "Docs", "1", split_attributes=["lang"]))
    producer = shoal.producer(SPEC.name, SPEC.version)
    producer.upload(points(range(10)) + points(range(10, 14), "de"))
    builder = ShardBuilder(shoal.engine, shoal.storage)
    (shard,) = shoal.get_index("Docs.Index", "1").shards
    builder.materialize(shard.id)
    producer.upload([Tombstone({"id": 3, "lang": "en"}), *points(range(20, 22))])
    builder.materialize(shard.id)  # a second segment, and deletions in the first
    version = shoal.shards.active_version(shard.id)
    assert version is not None
    stored = version.manifest

    manifest = Manifest.from_json(stored)
    assert manifest.to_json() == stored  # byte-compatible: what the catalog holds, key for key
    assert (manifest.generation, manifest.watermark) == (stored["generation"], version.watermark)
    first, second = manifest.segments
    assert first.deleted is not None and first.deleted_count == 1 and second.deleted is None
    assert {s.values["lang"] for s in first.splits} == {"de", "en"}
    # Either form lists the same files; every one of them exists.
    assert manifest.files() == manifest_files([stored]) == manifest_files([manifest])
    assert segment_files(stored["segments"][0]) == segment_files(first) == first.files()
    assert all(shoal.storage.exists(p) for p in manifest.files())
    # Frozen: a version's manifest cannot be changed in place.
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.rows = 0  # type: ignore[misc]
    assert SegmentEntry.of(stored["segments"][1]) == second and Manifest.of(manifest) is manifest


# -- lost races report ConflictError -----------------------------------------------------------------------


class PausingStorage(Storage):
    """Real storage whose first write waits for `go`: holds a build between reading the active version and
    publishing, as a slow worker would."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner.fs, inner.root, local=inner.local)
        self.paused = threading.Event()
        self.go = threading.Event()

    def write_atomic(self, relative: str, data: pa.Buffer) -> None:
        if not self.paused.is_set():
            self.paused.set()
            assert self.go.wait(30)
        super().write_atomic(relative, data)


def test_of_two_concurrent_builders_the_loser_gets_a_conflict_and_publishes_nothing(shoal: Shoal) -> None:
    shoal.create_index(IndexSpec("Docs.Index", "1", "Docs", "1"))
    shoal.producer(SPEC.name, SPEC.version).upload(points(range(6)))
    (shard,) = shoal.get_index("Docs.Index", "1").shards
    slow_storage = PausingStorage(shoal.storage)
    # Its lease (no heartbeat here) outlasts however long a busy machine takes between its pause and the attempt.
    slow = ShardBuilder(shoal.engine, slow_storage, owner="slow", lease_seconds=10.0)
    fast = ShardBuilder(shoal.engine, shoal.storage, owner="fast")
    outcome: dict[str, BaseException | object] = {}

    def run_slow() -> None:
        try:
            outcome["slow"] = slow.materialize(shard.id)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome["slow"] = exc

    thread = threading.Thread(target=run_slow)
    thread.start()
    assert slow_storage.paused.wait(30)
    # While the slow builder holds the lease, the other one loses at once.
    with pytest.raises(ConflictError):
        fast.materialize(shard.id)

    def fast_wins() -> bool:
        try:
            outcome["fast"] = fast.materialize(shard.id)
            return True
        except LeaseBusyError:
            return False

    wait_for(fast_wins, 30, "the slow builder's lease to expire")
    slow_storage.go.set()
    thread.join(30)
    lost = outcome["slow"]
    assert isinstance(lost, ConflictError), lost
    assert lost.expected is None  # it built on "no version yet"; the fast one published meanwhile
    active = shoal.shards.active_version(shard.id)
    assert active is not None and active.id == outcome["fast"].version_id  # type: ignore[union-attr]
    assert active.watermark == shoal.get_data_source(SPEC.name, SPEC.version).head_seq


def test_a_swap_of_a_job_that_is_not_building_is_a_conflict(shoal: Shoal) -> None:
    with pytest.raises(ConflictError) as lost:
        Generations(shoal.engine).swap(10**12, 1.0)
    assert (lost.value.expected, lost.value.actual) == ("building", None)

