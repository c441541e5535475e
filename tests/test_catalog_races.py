"""Catalog operations racing a drop, made to interleave at the worst moment (no sleeps):

- a drop held uncommitted in another connection while the operation runs in a thread, released once Postgres
  shows the operation waiting for the drop's locks;
- or the racing operation run at a chosen point of the other (a hook on the call or statement it reaches there).

Each answers what a user expects (NotFoundError, 404; a dataset create losing to another request: 409), never a
foreign key violation, an AssertionError or a deadlock (500, 503).
"""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from conftest import wait_for
from sqlalchemy import Connection, Engine, delete, event, text

from shoal import DataSourceSpec, Shoal
from shoal.catalog.locks import lock_source
from shoal.catalog.models import Index
from shoal.datasets.errors import DatasetError, ErrorCode
from shoal.datasets.service import DatasetService
from shoal.errors import NotFoundError
from shoal.log.records import IndexSpec
from shoal.upkeep import drops
from shoal.upkeep import gc_queue as garbage

DIM = 4


@pytest.fixture
def sh(make_shoal: Callable[..., Shoal]) -> Shoal:
    return make_shoal()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as executor:
        yield executor


def _source_and_index(sh: Shoal, *, create_index: bool = True) -> tuple[str, IndexSpec]:
    """A data source and (unless told not to) a flat index over it, named uniquely; (source name, index spec)."""
    name = "race-" + uuid.uuid4().hex[:8]
    sh.create_data_source(DataSourceSpec(name, "1", DIM, {"id": "int64"}, ["id"]))
    spec = IndexSpec(name + "-idx", "1", name, "1", algorithm="flat", metric="euclidean", id_attributes=["id"])
    if create_index:
        sh.create_index(spec)
    return name, spec


def _backend_pid(conn: Connection) -> int:
    return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _someone_waits_on(engine: Engine, pid: int) -> bool:
    """Whether a session of the catalog waits for a lock the backend `pid` holds."""
    with engine.connect() as conn:
        waiting = conn.execute(
            text("SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"), {"pid": pid}
        ).scalar_one()
    return int(waiting) > 0


def _run_blocked_behind(
    engine: Engine, holder: Connection, pool: ThreadPoolExecutor, operation: Callable[[], Any]
) -> Future[Any]:
    """Start `operation` in a thread and return once it waits for a lock `holder`'s open transaction holds."""
    future = pool.submit(operation)
    pid = _backend_pid(holder)
    wait_for(lambda: future.done() or _someone_waits_on(engine, pid), 30, "the operation to wait for the drop")
    assert not future.done(), f"the operation ended before the drop committed: {future.result()!r}"
    return future


def _grace_end() -> dt.datetime:
    return dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)


# -- defect 2: creating an index while its data source is dropped ----------------------------------------------


def test_an_index_created_while_its_data_source_is_dropped_is_not_found(
    sh: Shoal, pool: ThreadPoolExecutor
) -> None:
    """The drop is in flight (source locked, rows deleted, not committed) when the create inserts: the create
    waits for it, then answers NotFoundError (404), not a foreign key violation (500), and leaves nothing."""
    name, spec = _source_and_index(sh, create_index=False)
    source_id = sh.get_data_source(name, "1").id
    with sh.engine.connect() as holder:
        with holder.begin():
            lock_source(holder, source_id, live=True)
            drops.delete_source_rows(holder, source_id, drops.SOURCE_DROPPED, _grace_end())
            create = _run_blocked_behind(sh.engine, holder, pool, lambda: sh.create_index(spec))
        # The drop committed.
        with pytest.raises(NotFoundError, match=name):
            create.result(timeout=30)
    assert sh.list_indexes() == []
    with pytest.raises(NotFoundError):
        sh.get_index(spec.name, spec.version)


@pytest.mark.parametrize("racer", ["overwrite", "hard delete"])
def test_a_dataset_create_losing_its_data_source_to_another_request_answers_409(
    make_shoal: Callable[..., Shoal], monkeypatch: pytest.MonkeyPatch, racer: str
) -> None:
    """Two processes use one dataset name: a plain create made its data source, and before it creates its index
    another request replaces the dataset (an overwrite create, which answers 201) or hard-deletes it. The plain
    create answers 409 (not 500, nor a 409 after dropping the other's dataset), and its undo leaves what the
    other request made: the overwrite's dataset whole, or nothing at all after the delete."""
    sh_a = make_shoal()
    sh_b = make_shoal(tenant=sh_a.settings.tenant)  # another process of the same tenant
    searchers = [sh_a.searcher(follow=False), sh_b.searcher(follow=False)]
    plain, other = (DatasetService(s, searcher) for s, searcher in zip((sh_a, sh_b), searchers, strict=True))
    name = "ds" + uuid.uuid4().hex[:8]
    real = sh_a.indexes.create_index
    raced: list[Any] = []

    def other_first(*args: Any, **kwargs: Any) -> Any:
        # The plain create read its data source and is about to insert its index: the other request runs now.
        if not raced:
            raced.append(other.create(name, 8, metric_type="cosine", index_type="hnsw", overwrite=True)
                         if racer == "overwrite" else other.delete(name, hard=True))
        return real(*args, **kwargs)

    monkeypatch.setattr(sh_a.indexes, "create_index", other_first)
    try:
        with pytest.raises(DatasetError) as lost:
            plain.create(name, DIM, metric_type="euclidean", index_type="flat")
        assert raced, "the other request never ran"
        if racer == "overwrite":
            kept = other.get(name)  # the dataset the overwrite answered 201 for, with its own source and index
            assert (kept.dimensions, kept.index_type, kept.metric_type) == (8, "hnsw", "cosine")
            assert sh_b.get_data_source(name, "1").spec.vector_dimension == 8
            assert sh_b.get_index(name, "1").spec.algorithm == "hnsw"
        else:
            with pytest.raises(DatasetError) as gone:
                other.get(name)
            assert gone.value.code is ErrorCode.DATASET_NOT_FOUND
            assert sh_b.list_data_sources() == [] and sh_b.list_indexes() == []
        assert lost.value.code is ErrorCode.DATASET_ALREADY_EXISTS, lost.value
        assert "another request" in str(lost.value)
    finally:
        for searcher in searchers:
            searcher.close()


def test_an_overwrite_create_meeting_a_dataset_created_meanwhile_says_so(
    make_shoal: Callable[..., Shoal], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An overwrite create found no dataset of the name, and another process then created one: the 409 names a
    dataset created meanwhile, not "a data source ... that is not a dataset"."""
    sh_a = make_shoal()
    sh_b = make_shoal(tenant=sh_a.settings.tenant)
    searchers = [sh_a.searcher(follow=False), sh_b.searcher(follow=False)]
    plain, overwrite = (DatasetService(s, searcher) for s, searcher in zip((sh_a, sh_b), searchers, strict=True))
    name = "ds" + uuid.uuid4().hex[:8]
    real = overwrite._refuse_foreign

    def created_meanwhile(n: str) -> None:
        plain.create(n, DIM, metric_type="euclidean", index_type="flat")
        real(n)

    monkeypatch.setattr(overwrite, "_refuse_foreign", created_meanwhile)
    try:
        with pytest.raises(DatasetError) as refused:
            overwrite.create(name, 8, metric_type="cosine", index_type="hnsw", overwrite=True)
        assert refused.value.code is ErrorCode.DATASET_ALREADY_EXISTS
        assert "not a dataset" not in str(refused.value), refused.value
        assert f"dataset {name!r}" in str(refused.value)
        assert plain.get(name).dimensions == DIM  # the dataset made meanwhile stays
    finally:
        for searcher in searchers:
            searcher.close()


# -- defect 3: tagging an index while it is dropped ------------------------------------------------------------


def test_a_tag_taken_while_its_index_is_dropped_is_not_found(sh: Shoal, pool: ThreadPoolExecutor) -> None:
    """The drop has deleted the index row but not committed when the tag is written: the tag waits, then
    answers NotFoundError (404), not a foreign key violation (500)."""
    _, spec = _source_and_index(sh)
    index_id = sh.get_index(spec.name, spec.version).id
    with sh.engine.connect() as holder:
        with holder.begin():
            holder.execute(delete(Index).where(Index.id == index_id))
            tag = _run_blocked_behind(sh.engine, holder, pool, lambda: sh.tag_index(spec.name, spec.version, "t1"))
        with pytest.raises(NotFoundError, match="t1"):
            tag.result(timeout=30)
    with pytest.raises(NotFoundError):
        sh.index_tags(spec.name, spec.version)


# -- defect 4: reading an index while its data source is dropped -----------------------------------------------


@pytest.mark.parametrize("read", ["get_index", "index_status", "drop_index"])
def test_reading_an_index_while_its_data_source_is_dropped_is_not_found(
    make_shoal: Callable[..., Shoal], read: str
) -> None:
    """Another process drops the data source just as this one goes to read it for the index (its first
    statement naming `data_sources`): GET index, its status and DELETE answer NotFoundError (404), not an
    AssertionError (a plain-text 500 and a reset connection)."""
    sh = make_shoal()
    other = make_shoal(tenant=sh.settings.tenant)
    name, spec = _source_and_index(sh)
    main = threading.current_thread()
    dropped: list[int] = []

    def drop_first(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if threading.current_thread() is main and not dropped and "data_sources" in statement:
            dropped.append(other.drop_data_source(name, "1"))

    event.listen(sh.engine, "before_cursor_execute", drop_first)
    try:
        with pytest.raises(NotFoundError):
            getattr(sh, read)(spec.name, spec.version)
    finally:
        event.remove(sh.engine, "before_cursor_execute", drop_first)
    assert dropped, "the drop never ran"
    assert sh.list_indexes() == []


# -- defect 5: dropping an index and its data source at once ---------------------------------------------------


def test_an_index_dropped_while_its_data_source_is_dropped_waits_instead_of_deadlocking(
    sh: Shoal, pool: ThreadPoolExecutor
) -> None:
    """The data source's drop holds the source's row and the index's shards when the index's own drop starts,
    then deletes the source (and with it the index). The index's drop waits for it and answers NotFoundError
    (404); neither side deadlocks (which answered 503 "the catalog is unavailable")."""
    name, spec = _source_and_index(sh)
    source_id = sh.get_data_source(name, "1").id
    index_id = sh.get_index(spec.name, spec.version).id
    with sh.engine.connect() as holder:
        with holder.begin():
            lock_source(holder, source_id, live=True)  # drop_data_source's first locks
            garbage.lock_shards(holder, [index_id])
            drop_index = _run_blocked_behind(
                sh.engine, holder, pool,
                lambda: drops.drop_index(sh.engine, index_id, delete_after=_grace_end(), generations=True),
            )
            drops.delete_source_rows(holder, source_id, drops.SOURCE_DROPPED, _grace_end())  # the rest of it
        with pytest.raises(NotFoundError):
            drop_index.result(timeout=30)
    with pytest.raises(NotFoundError):
        sh.get_data_source(name, "1")
    assert sh.list_indexes() == []


def _sessions_waiting_on_locks(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )).scalar_one())


def test_a_rollback_racing_a_drop_of_its_index_waits_instead_of_deadlocking(sh: Shoal) -> None:
    """A rollback locked the reindex job, then the index rows; a drop of the index locks the source and the index
    row, then the job (its DELETE clears the job's index ids): each waited for the other, and the rollback failed
    with a deadlock (503 "the catalog is unavailable"). The rollback takes the source first too: it waits for
    the drop, then answers NotFoundError (404)."""
    name, spec = _source_and_index(sh)
    sh.producer(name, "1").upload_columns(np.ones((3, DIM), np.float32), {"id": np.arange(3)})
    job = sh.reindex(spec.name, spec.version, metric="cosine", wait=True)
    assert job.state == "swapped"
    live = sh.get_index(spec.name, spec.version).id
    with ThreadPoolExecutor(2) as two, sh.engine.connect() as holder:
        with holder.begin():
            # Lines the two up as a slow moment would: the drop waits at the index row, holding the source.
            holder.execute(text("SELECT id FROM indexes WHERE id = :id FOR SHARE"), {"id": live})
            dropped = two.submit(sh.drop_index, spec.name, spec.version)
            wait_for(lambda: _sessions_waiting_on_locks(sh.engine) >= 1, 30, "the drop to wait")
            rolled = two.submit(sh.rollback, spec.name, spec.version)
            wait_for(lambda: _sessions_waiting_on_locks(sh.engine) >= 2, 30, "the rollback to wait")
        dropped.result(timeout=60)
        with pytest.raises(NotFoundError):
            rolled.result(timeout=60)
    with pytest.raises(NotFoundError):
        sh.get_index(spec.name, spec.version)
