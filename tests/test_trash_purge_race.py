"""A purge of a dataset in the trash racing its restore: exactly one of them wins.

`DELETE /api/v1/trash/{id}` ends the retention in a commit of its own, then deletes the rows under the data
source's row lock. It skipped a locked row (beat's sweep's choice): a restore holding the lock found the retention
ended and answered 404, and the purge, having skipped, answered 404 too ("no longer in the trash"), leaving the
dataset in the trash with its retention ended, every later restore refused, until beat's hourly purge. The purge
asked for now waits for the lock now: either it wins (the restore answers 404, the dataset is gone) or the restore
had committed first (the purge answers 404, the dataset is back). A lock held past the lock timeout (a commit, a
GC run) answers 503 with Retry-After, the dataset left in the trash as it was, restorable.

The race is made deterministic by a transaction of the test's own holding the row lock (`SELECT ... FOR UPDATE`)
from the moment the purge's retention commit is done; the API server runs in this process, so the test can hook
there (`due_sources`, which the purge calls right after that commit).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import httpx
import pytest
from conftest import serve_api, wait_for
from sqlalchemy import Connection, Engine, text
from test_storage_outages2 import _anonymous, _client, _create

import shoal.upkeep.trash as trash_module
from shoal import Shoal
from shoal.config.settings import Settings

ROUNDS = 20


class RowLock:
    """A transaction of the test's own holding a data source's row lock, as a commit or a GC run would."""

    def __init__(self, engine: Engine, source_id: int) -> None:
        self.engine = engine
        self.source_id = source_id
        self.conn: Connection | None = None

    def take(self) -> None:
        self.conn = self.engine.connect()
        self.conn.execute(text("SELECT id FROM data_sources WHERE id = :i FOR UPDATE"), {"i": self.source_id})

    def release(self) -> None:
        if self.conn is not None:
            self.conn.rollback()
            self.conn.close()
            self.conn = None


def _lock_waiters(engine: Engine) -> int:
    """How many transactions wait for a data source's row lock (a restore's, a purge's `SELECT ... FOR UPDATE`)."""
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' "
            "AND query ILIKE '%FROM data_sources%FOR UPDATE%'"
        )).scalar_one())


def _in_thread(call: Callable[[], httpx.Response], answers: dict[str, httpx.Response], key: str) -> threading.Thread:
    def run() -> None:
        answers[key] = call()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _trashed(http: httpx.Client, name: str) -> int:
    """A new dataset `name` with two vectors, moved to the trash; its trash id."""
    _create(http, name, ("a", [1.0, 0.0]), ("b", [0.0, 1.0]))
    deleted = http.delete(f"/datasets/{name}")
    assert deleted.status_code == 200, deleted.text
    return int(deleted.json()["trash_id"])


def _trash_ids(http: httpx.Client) -> list[int]:
    listed = http.get("/trash")
    assert listed.status_code == 200, listed.text
    return [d["trash_id"] for d in listed.json()["datasets"]]


def _assert_purge_won(http: httpx.Client, name: str, purge: httpx.Response, restore: httpx.Response) -> None:
    assert purge.status_code == 200, (purge.text, restore.text)
    assert restore.status_code == 404, (purge.text, restore.text)
    assert http.get(f"/datasets/{name}").status_code == 404
    assert _trash_ids(http) == []


def _assert_restore_won(http: httpx.Client, name: str, purge: httpx.Response, restore: httpx.Response) -> None:
    assert restore.status_code == 200, (purge.text, restore.text)
    assert purge.status_code == 404, (purge.text, restore.text)
    assert purge.json()["error_code"] == "DATASET_NOT_FOUND", purge.text
    assert http.get(f"/datasets/{name}").json()["vector_count"] == 2
    assert _trash_ids(http) == []


@pytest.fixture
def api(make_settings: Callable[..., Settings]) -> Iterator[tuple[httpx.Client, Engine]]:
    """An admin client of an API served in this process, and the catalog's engine."""
    settings = _anonymous(make_settings("local"))
    with serve_api(settings) as url, _client(settings, url) as http, Shoal(settings, notify=False) as shoal:
        yield http, shoal.engine


def _lock_after_expire(monkeypatch: pytest.MonkeyPatch, holder: RowLock, expired: threading.Event) -> None:
    """Have `holder` take the row lock once the purge's retention commit is done, before it deletes the rows."""
    original = trash_module.due_sources

    def due_sources(engine: Engine, source_ids: Sequence[int] | None = None) -> list[int]:
        holder.take()
        expired.set()
        return original(engine, source_ids)

    monkeypatch.setattr(trash_module, "due_sources", due_sources)


def test_a_restore_holding_the_row_lock_after_the_purge_ended_the_retention_lets_the_purge_win(
    api: tuple[httpx.Client, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hunter's interleaving: the purge ends the retention; the restore takes the row lock, finds it ended and
    refuses (404). The purge skipped the locked row and answered 404 too, the dataset stuck in the trash; it waits
    for the lock now and deletes the dataset."""
    http, engine = api
    trash_id = _trashed(http, "raced")
    holder, expired = RowLock(engine, trash_id), threading.Event()
    _lock_after_expire(monkeypatch, holder, expired)
    answers: dict[str, httpx.Response] = {}
    try:
        purging = _in_thread(lambda: http.delete(f"/trash/raced?trash_id={trash_id}"), answers, "purge")
        assert expired.wait(30), "the purge never ended the retention"
        restoring = _in_thread(lambda: http.post(f"/trash/raced/restore?trash_id={trash_id}"), answers, "restore")
        wait_for(lambda: _lock_waiters(engine) >= 1, 30, "the restore to wait for the row lock")
        # The purge queues behind the restore (the fix), or it has answered already (skipped the locked row).
        wait_for(lambda: _lock_waiters(engine) >= 2 or not purging.is_alive(), 30, "the purge to wait or answer")
    finally:
        holder.release()
    purging.join(30)
    restoring.join(30)
    _assert_purge_won(http, "raced", answers["purge"], answers["restore"])


def test_a_restore_queued_first_for_the_row_lock_wins_and_the_purge_answers_not_found(
    api: tuple[httpx.Client, Engine],
) -> None:
    """The other order: the restore waits for the row lock before the purge ends the retention; it restores the
    dataset, with its vectors, and the purge finds it no longer in the trash."""
    http, engine = api
    trash_id = _trashed(http, "first")
    holder = RowLock(engine, trash_id)
    answers: dict[str, httpx.Response] = {}
    holder.take()
    try:
        restoring = _in_thread(lambda: http.post(f"/trash/first/restore?trash_id={trash_id}"), answers, "restore")
        wait_for(lambda: _lock_waiters(engine) >= 1, 30, "the restore to wait for the row lock")
        purging = _in_thread(lambda: http.delete(f"/trash/first?trash_id={trash_id}"), answers, "purge")
        wait_for(lambda: _lock_waiters(engine) >= 2, 30, "the purge to wait for the row lock")
    finally:
        holder.release()
    restoring.join(30)
    purging.join(30)
    _assert_restore_won(http, "first", answers["purge"], answers["restore"])
    assert "no longer in the trash" in answers["purge"].json()["message"], answers["purge"].text


def test_a_row_lock_held_past_the_lock_timeout_answers_503_and_leaves_the_dataset_restorable(
    make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another holder (a commit, a GC run) keeps the row lock past the lock timeout: the purge answers 503 with
    Retry-After, not 404; the trash lists the dataset with its retention as it was (given back once the holder
    let go), and it restores."""
    settings = _anonymous(make_settings("local", lock_timeout_ms=300))
    with serve_api(settings) as url, _client(settings, url) as http, Shoal(settings, notify=False) as shoal:
        trash_id = _trashed(http, "held")
        before = http.get("/trash").json()["datasets"][0]["purge_after"]
        holder, expired = RowLock(shoal.engine, trash_id), threading.Event()
        _lock_after_expire(monkeypatch, holder, expired)
        # Held well past the purge's 300 ms wait, then let go (as a long commit would).
        releaser = threading.Thread(target=lambda: (expired.wait(30), time.sleep(2), holder.release()), daemon=True)
        releaser.start()
        purged = http.delete(f"/trash/held?trash_id={trash_id}")
        releaser.join(30)
        assert expired.is_set()
        assert purged.status_code == 503, purged.text
        assert purged.json()["error_code"] == "SERVICE_UNAVAILABLE", purged.text
        assert "retry the purge" in purged.json()["message"], purged.text
        assert purged.headers.get("Retry-After") == "1"
        assert [(d["trash_id"], d["purge_after"]) for d in http.get("/trash").json()["datasets"]] == [
            (trash_id, before)
        ]
        restored = http.post(f"/trash/held/restore?trash_id={trash_id}")
        assert restored.status_code == 200, restored.text
        assert http.get("/datasets/held").json()["vector_count"] == 2


def test_a_row_lock_held_before_the_purge_began_answers_503_within_the_lock_timeout(
    make_settings: Callable[..., Settings],
) -> None:
    """The row lock is held before the purge asks (the retention not yet ended): the purge's first step is bounded
    by the lock timeout too (it waited as long as the holder did), answers 503, and changes nothing."""
    settings = _anonymous(make_settings("local", lock_timeout_ms=300))
    with serve_api(settings) as url, _client(settings, url) as http, Shoal(settings, notify=False) as shoal:
        trash_id = _trashed(http, "early")
        before = http.get("/trash").json()["datasets"][0]["purge_after"]
        holder = RowLock(shoal.engine, trash_id)
        holder.take()
        try:
            purged = http.delete(f"/trash/early?trash_id={trash_id}", timeout=20)
        finally:
            holder.release()
        assert purged.status_code == 503, purged.text
        assert "retry the purge" in purged.json()["message"], purged.text
        assert [(d["trash_id"], d["purge_after"]) for d in http.get("/trash").json()["datasets"]] == [
            (trash_id, before)
        ]
        assert http.delete(f"/trash/early?trash_id={trash_id}").status_code == 200


def _race_round(http: httpx.Client, name: str, trash_id: int) -> dict[str, httpx.Response]:
    """The purge and the restore of `trash_id` sent at once (the restore up to 15 ms later: the window the
    hunter hit lies between the purge's two commits)."""
    barrier, answers = threading.Barrier(2), {}
    delay = random.uniform(0, 0.015)

    def purge() -> httpx.Response:
        barrier.wait()
        return http.delete(f"/trash/{name}?trash_id={trash_id}")

    def restore() -> httpx.Response:
        barrier.wait()
        time.sleep(delay)
        return http.post(f"/trash/{name}/restore?trash_id={trash_id}")

    threads = [_in_thread(purge, answers, "purge"), _in_thread(restore, answers, "restore")]
    for thread in threads:
        thread.join(60)
    return answers


def test_a_purge_and_a_restore_sent_at_once_end_with_exactly_one_winner(
    api: tuple[httpx.Client, Engine],
) -> None:
    """Round after round, never both 404 with the dataset left in the trash: the purge won (dataset gone) or the
    restore did (dataset back, the purge answers 404)."""
    http, _ = api
    name, outcomes = "race", []
    trash_id = _trashed(http, name)
    for _ in range(ROUNDS):
        answers = _race_round(http, name, trash_id)
        purge, restore = answers["purge"], answers["restore"]
        if purge.status_code == 200:
            _assert_purge_won(http, name, purge, restore)
            trash_id = _trashed(http, name)
        else:
            _assert_restore_won(http, name, purge, restore)
            deleted = http.delete(f"/datasets/{name}")
            assert deleted.status_code == 200, deleted.text
            trash_id = int(deleted.json()["trash_id"])
        outcomes.append(purge.status_code)
    assert set(outcomes) <= {200, 404}, outcomes
