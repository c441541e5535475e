"""Writing vectors into a dataset: checked as a whole, appended all or nothing, acknowledged with a write token."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from shoal.catalog.db import make_engine
from shoal.catalog.locks import lock_timed_out, set_lock_timeout
from shoal.datasets import rules
from shoal.datasets.catalog import DatasetRecord, LogTotals
from shoal.datasets.errors import DatasetError, ErrorCode, invalid, not_found, problems_of
from shoal.datasets.live import live_and_new
from shoal.datasets.results import Upserted
from shoal.datasets.scope import DatasetScope
from shoal.errors import ConflictError, NotFoundError, ValidationError
from shoal.log.records import DataPoint


class Uploads(DatasetScope):
    """Upsert vectors into a dataset."""

    def upsert(self, name: Any, vectors: Sequence[Mapping[str, Any]]) -> Upserted:
        """Append the vectors (an id already there is replaced), all or nothing, once durable; the batch's
        write token. A refused batch writes nothing."""
        record = self.record(name)
        if not vectors:
            raise invalid("vectors must not be empty", field="vectors")
        most = self.shoal.settings.max_batch_points
        if len(vectors) > most:  # before any vector is checked or the quota read, as every upload path does
            raise invalid(f"the batch holds {len(vectors)} vectors, more than the configured maximum {most} "
                          "(SHOAL_MAX_BATCH_POINTS); nothing written", field="vectors")
        for i, v in enumerate(vectors):  # a wrong width is its own code, reported before any other problem
            values = v.get("values")
            if not isinstance(values, list | tuple) or len(values) != record.dimensions:
                got = len(values) if isinstance(values, list | tuple) else None
                raise DatasetError(
                    ErrorCode.INVALID_DIMENSIONS,
                    f"vector {i}: expected {record.dimensions} values, got {got}",
                    {"position": i, "expected": record.dimensions, "got": got},
                )
        problems: list[str] = []
        points = []
        for i, v in enumerate(vectors):
            vid = v.get("id")
            if not rules.is_text(vid) or not 1 <= len(vid) <= rules.MAX_VECTOR_ID:
                problems.append(f"vector {i}: id must be a string of 1 to {rules.MAX_VECTOR_ID} characters")
            for field in ("document_id", "content"):
                if v.get(field) is not None and not rules.is_text(v.get(field)):
                    problems.append(f"vector {i}: {field} must be null or a string")
            meta = v.get("metadata")
            try:
                rules.check_metadata(meta, "metadata", rules.MAX_VECTOR_METADATA_BYTES, nul=True)
            except DatasetError as exc:
                problems.append(f"vector {i}: {exc.message}")
                meta = None
            attrs = {
                "id": vid,
                "document_id": v.get("document_id") or "",
                "content": v.get("content") or "",
                "metadata": rules.json_text(meta),
            }
            points.append(DataPoint(attrs, v["values"]))
        if problems:
            raise invalid(f"invalid vectors, nothing written: {'; '.join(problems[:10])}", problems=problems[:100])
        ids = [v["id"] for v in vectors]
        # Only a dataset with a quota pays for the lock: its check and its commit must be one step, or uploads
        # racing each other each pass against a log the other is about to grow.
        if self._quota_of(record) is None:
            return self._write(record, points)
        with uploading_alone(self.shoal.engine, record.source_id, self.shoal.settings.lock_timeout_ms):
            self._check_quota(record, ids)  # read again under the lock: a PUT may have changed it meanwhile
            return self._write(record, points)

    def _write(self, record: DatasetRecord, points: list[DataPoint]) -> Upserted:
        """Append the checked points; the batch's write token."""
        try:
            self.shoal.check_backpressure(record.name, rules.VERSION)
            token = self.shoal.producer(record.name, rules.VERSION).upload(points)
        except NotFoundError:
            self._forget(record.name)
            raise not_found(record.name) from None
        except ValidationError as exc:
            raise invalid(str(exc), problems=problems_of(exc)[:100]) from None
        return Upserted(record.name, len(points), token.seq)

    def _quota_of(self, record: DatasetRecord) -> int | None:
        """The dataset's quota_limit as the catalog holds it now (DATASET_NOT_FOUND if it went meanwhile)."""
        # Not as a cached entry does: an upload after a PUT that lowered it answered is checked against the
        # lowered one, whatever another process cached.
        return rules.quota_limit(self.catalog.get(record.name).metadata)

    def _check_quota(self, record: DatasetRecord, ids: Sequence[str]) -> None:
        """QUOTA_EXCEEDED (nothing written) when the batch would leave more live vectors than the dataset's
        `metadata.quota_limit`; ids already live are replaced and count once. Exact when called under
        `uploading_alone`, which every dataset upload with a quota holds until its commit answered."""
        limit = self._quota_of(record)
        if limit is None:
            return
        totals = self.catalog.log_totals([record.source_id]).get(record.source_id, LogTotals())
        live, new = live_and_new(self.shoal.engine, self.shoal.storage, record.source_id, totals, ids)
        if live + new > limit:
            # "Already": a quota lowered below the count, or writes outside the dataset API (not counted).
            why = (f"{new} new vectors would exceed it" if live <= limit
                   else "it holds more than its quota already: delete vectors first")
            raise DatasetError(
                ErrorCode.QUOTA_EXCEEDED,
                f"dataset {record.name!r} holds {live} vectors and its quota_limit is {limit}: {why}; "
                "nothing written",
                {"dataset_id": record.name, "field": "metadata.quota_limit", "quota_limit": limit,
                 "vector_count": live, "new_vectors": new},
            )


# Connections of their own for the quota lock, outside the catalog engine's pool (by its URL): a pool of one
# (SHOAL_DB_POOL_SIZE=1) would otherwise have none left for the commit made while the lock is held.
_lock_engines: dict[str, Engine] = {}
LOCK_CONNECTIONS = 10
_lock_engines_guard = threading.Lock()


def _lock_engine(engine: Engine) -> Engine:
    """This process's engine for quota locks on the catalog `engine` reaches: 2 idle connections kept, at most
    LOCK_CONNECTIONS in all (one per dataset whose uploads wait for its lock, as `_Turns` lets one upload of a
    dataset wait in Postgres: unbounded, a burst of datasets would take every connection Postgres allows)."""
    url = engine.url.render_as_string(hide_password=False)
    with _lock_engines_guard:
        own = _lock_engines.get(url)
        if own is None:
            own = make_engine(url, pool_size=2, max_overflow=LOCK_CONNECTIONS - 2)
            _lock_engines[url] = own
        return own


class _Turns:
    """Uploads of this process to one dataset, one at a time: only one of them waits on Postgres for the dataset's
    lock (holding a lock connection), so uploads piling up on one busy dataset leave the other datasets their
    connections. A source's entry lives while an upload to it is in the block."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[int, tuple[threading.Lock, int]] = {}  # source id -> (its lock, uploads using it)

    @contextlib.contextmanager
    def turn(self, source_id: int, timeout_s: float) -> Iterator[None]:
        """Hold the source's turn for the block; ConflictError after `timeout_s` without it."""
        with self._guard:
            lock, users = self._locks.get(source_id, (threading.Lock(), 0))
            self._locks[source_id] = (lock, users + 1)
        try:
            if not lock.acquire(timeout=max(timeout_s, 0.0)):
                raise _lock_timeout(timeout_s * 1000)
            try:
                yield
            finally:
                lock.release()
        finally:
            with self._guard:
                lock, users = self._locks[source_id]
                if users == 1:
                    del self._locks[source_id]
                else:
                    self._locks[source_id] = (lock, users - 1)


_turns = _Turns()


def _lock_timeout(waited_ms: float) -> ConflictError:
    return ConflictError(
        f"other uploads to the dataset held its quota lock for more than {waited_ms:.0f} ms "
        "(SHOAL_LOCK_TIMEOUT_MS); nothing written: retry"
    )


@contextlib.contextmanager
def uploading_alone(engine: Engine, source_id: int, lock_timeout_ms: int) -> Iterator[None]:
    """Hold, for the block, this process's turn of the data source and the Postgres advisory lock of it that
    every dataset API upload with a quota to it takes (in every API process): one at a time, so a quota check and
    its commit see no other upload's commit between them. Waits at most `lock_timeout_ms`
    (SHOAL_LOCK_TIMEOUT_MS) for both, else ConflictError (nothing written; the dataset API answers 503 with
    Retry-After)."""
    started = time.monotonic()
    with _turns.turn(source_id, lock_timeout_ms / 1000):
        left_ms = max(1, int(lock_timeout_ms - (time.monotonic() - started) * 1000))
        with _advisory_lock(engine, source_id, left_ms, lock_timeout_ms):
            yield


@contextlib.contextmanager
def _advisory_lock(engine: Engine, source_id: int, wait_ms: int, lock_timeout_ms: int) -> Iterator[None]:
    """The data source's upload lock in Postgres, waited for at most `wait_ms`; released when the block ends, on
    error too, and by Postgres if the process dies."""
    # A transaction-level lock, on a transaction left open over the block: COMMIT or ROLLBACK (or the
    # connection's loss) releases it, so no connection goes back to the pool still holding it.
    try:
        conn_cm = _lock_engine(engine).connect()
    except PoolTimeout:  # uploads to LOCK_CONNECTIONS other datasets held every connection for the pool's 30 s
        raise ConflictError("too many uploads to datasets with a quota wait for their turn in this process; "
                            "nothing written: retry") from None
    with conn_cm as conn:
        set_lock_timeout(conn, wait_ms)
        try:
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))"),
                         {"k": f"shoal dataset upload {source_id}"})
        except OperationalError as exc:
            if not lock_timed_out(exc):
                raise
            raise _lock_timeout(lock_timeout_ms) from None
        try:
            yield
        finally:
            # A connection lost meanwhile took the lock with it: its error must not turn a landed upload into a
            # failed one (the pool's pre-ping replaces the connection).
            with contextlib.suppress(DBAPIError):
                conn.rollback()
