"""Group commit: concurrent uploads to one data source share one segment file and one transaction.

Whichever uploading thread finds no commit in flight becomes the leader: it takes every queued batch (up
to a point limit), commits them together and wakes their callers. Batches that arrive meanwhile queue up
for the next leader, so the batch size grows with the load and no timer adds latency when idle.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
from sqlalchemy import Engine

from shoal.catalog.repo import SourceRecord
from shoal.log.commit import BatchSlot, commit_group
from shoal.log.segment_file import WrittenSegment, build_segment_table, store_segment
from shoal.storage import Storage

log = logging.getLogger(__name__)


@dataclass
class _Request:
    table: pa.Table
    batch_id: str | None
    done: bool = False
    token: int | None = None
    error: BaseException | None = None


class LogWriter:
    """Appends validated batches to one data source's log, sharing commits between concurrent callers."""

    def __init__(
        self,
        engine: Engine,
        storage: Storage,
        source: SourceRecord,
        *,
        group_max_points: int,
        retries: int,
        lock_timeout_ms: int,
    ) -> None:
        self.engine = engine
        self.storage = storage
        self.source = source
        self.group_max_points = group_max_points
        self.retries = retries
        self.lock_timeout_ms = lock_timeout_ms
        self._cv = threading.Condition()
        self._queue: deque[_Request] = deque()
        self._busy = False
        self.commits = 0  # how many transactions this writer made (observable group-commit effect)
        # Called after each commit that wrote something (never before: DESIGN.md's flow, step 4).
        self.after_commit: Callable[[int], None] | None = None
        # Called with (source id, new head) after each commit and before its writers are acknowledged: the
        # head announcement searchers answer `strong` from (shoal.log.heads).
        self.announce_head: Callable[[int, int], None] | None = None

    def submit(self, table: pa.Table, batch_id: str | None = None) -> int:
        """Append one validated batch; block until it is durable and committed; return its last seq."""
        return self.submit_many([(table, batch_id)])[0]

    def submit_many(self, batches: list[tuple[pa.Table, str | None]]) -> list[int]:
        """Append several validated batches, each all or nothing with its own batch id, sharing commits
        (as many as fit `group_max_points` per segment); block until every one is committed; their tokens.

        Raises the first failure; batches of other commits may have landed (their ids make a retry safe).
        """
        reqs = [_Request(table, batch_id) for table, batch_id in batches]
        with self._cv:
            self._queue.extend(reqs)
        for req in reqs:
            self._wait(req)
        for req in reqs:
            if req.error is not None:
                raise req.error
        return [req.token for req in reqs]  # type: ignore[misc]

    def _wait(self, req: _Request) -> None:
        while True:
            with self._cv:
                while not req.done and self._busy:
                    self._cv.wait()
                if req.done:
                    break
                self._busy = True
                group = self._take_group()
            try:
                self._commit(group)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _on_commit(self, head: int) -> None:
        if self.announce_head is not None:
            self.announce_head(self.source.id, head)

    def _take_group(self) -> list[_Request]:
        group = [self._queue.popleft()]
        points = group[0].table.num_rows
        while self._queue and points + self._queue[0].table.num_rows <= self.group_max_points:
            req = self._queue.popleft()
            points += req.table.num_rows
            group.append(req)
        return group

    def _commit(self, group: list[_Request]) -> None:
        src = self.source

        def write(first_seq: int, keep: list[int]) -> WrittenSegment:
            table = build_segment_table([group[i].table for i in keep])
            return store_segment(self.storage, src.tenant, src.spec.name, src.spec.version, first_seq, table)

        try:
            tokens = commit_group(
                self.engine,
                src.id,
                [BatchSlot(r.table.num_rows, r.batch_id) for r in group],
                write,
                self.storage.delete_quietly,
                retries=self.retries,
                lock_timeout_ms=self.lock_timeout_ms,
                on_commit=self._on_commit,
            )
        except BaseException as exc:  # every caller in the group learns the same failure
            for r in group:
                r.error, r.done = exc, True
            return
        self.commits += 1
        for r, token in zip(group, tokens, strict=True):
            r.token, r.done = token, True
        if self.after_commit is not None:
            try:
                self.after_commit(src.id)
            except Exception:  # noqa: BLE001 - the batch is durable; indexers also catch up by sweeping
                log.exception("after-commit notification failed")
