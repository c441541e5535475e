"""GC's reads of `garbage_files` go through indexes of their own rows. The table is both GC's queue and its
deletion log (a row per deleted file, kept 30 days), and the log is most of it: with only an index on
`delete_after`, finding the due files, counting the pending ones and pruning the log each scanned the whole table
(183-195 ms a GC run at 2 million rows, about a month of a modest load). Real Postgres; the plans are those of
the statements GC itself sends, captured as it runs them."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine

from shoal.catalog.db import migrate
from shoal.upkeep import gc_queue

LOGGED, QUEUED = 50_000, 20


@pytest.fixture
def gc_catalog(fresh_db: str) -> Iterator[Engine]:
    """A migrated catalog whose garbage_files holds LOGGED deleted files (the log) and QUEUED due ones."""
    migrate(fresh_db)
    engine = create_engine(fresh_db)
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO garbage_files (path, reason, delete_after, deleted_at) "
            "SELECT 'tenants/t/gone/' || g, 'compaction', now() - interval '2 days', now() - interval '1 day' "
            "FROM generate_series(1, :n) g"), {"n": LOGGED})
        conn.execute(text(
            "INSERT INTO garbage_files (path, reason, delete_after) "
            "SELECT 'tenants/t/due/' || g, 'compaction', now() - interval '1 hour' FROM generate_series(1, :n) g"),
            {"n": QUEUED})
        conn.execute(text("ANALYZE garbage_files"))
    yield engine
    engine.dispose()


def _plans_of(engine: Engine, run: Any) -> list[str]:
    """The plans (JSON text) of the statements on garbage_files that `run()` sends."""
    sent: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if "garbage_files" in statement and not statement.lstrip().upper().startswith("EXPLAIN"):
            sent.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", capture)
    try:
        run()
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    assert sent, "GC sent no statement on garbage_files"
    plans = []
    with engine.connect() as conn:
        for statement, parameters in sent:
            raw = conn.connection.dbapi_connection.cursor()  # the driver's own cursor: the statement as sent
            raw.execute("EXPLAIN (FORMAT JSON) " + statement, parameters)
            plans.append(json.dumps(raw.fetchone()[0]))
            conn.rollback()  # an EXPLAIN of a DELETE runs nothing, but end its transaction all the same
    return plans


def test_due_and_pending_read_the_queue_through_its_index(gc_catalog: Engine) -> None:
    now = dt.datetime.now(dt.UTC)
    found: list[Any] = []
    plans = _plans_of(gc_catalog, lambda: found.extend(gc_queue.due(gc_catalog, now)))
    assert len(found) == QUEUED and all("/due/" in r.path for r in found)
    assert all("ix_garbage_files_queued" in p and "Seq Scan" not in p for p in plans), plans
    counted: list[int] = []
    plans = _plans_of(gc_catalog, lambda: counted.append(gc_queue.pending(gc_catalog)))
    assert counted == [QUEUED]
    assert all("ix_garbage_files_queued" in p and "Seq Scan" not in p for p in plans), plans


def test_pruning_the_deletion_log_reads_the_log_through_its_index(gc_catalog: Engine) -> None:
    # Nothing is older than the log's 30 days here: the plan is what is checked, and the rows stay.
    pruned: list[int] = []
    plans = _plans_of(gc_catalog, lambda: pruned.append(gc_queue.prune_log(gc_catalog, dt.datetime.now(dt.UTC))))
    assert pruned == [0]
    assert all("ix_garbage_files_deleted_at" in p and "Seq Scan" not in p for p in plans), plans
