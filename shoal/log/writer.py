"""Group commit: concurrent uploads to one data source share one segment file and one transaction.

Whichever uploading thread finds no commit in flight becomes the leader: it takes every queued batch (up
to a point limit), commits them together and wakes their callers. Batches that arrive meanwhile queue up
for the next leader, so the batch size grows with the load and no timer adds latency when idle.

A batch with a batch id carries its fingerprint (`batch_fingerprint`, computed by its own caller's thread
before it queues): the commit answers a repeat of the batch with its first token and refuses another batch
under the id, that batch alone.

A caller's batches keep their order in the log: when a commit fails, the batches of the same `submit_many` call
still queued behind it are withdrawn and fail with the same error, never committed (a caller that retries
would otherwise find its later batches landed before its earlier ones).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from sqlalchemy import Engine

from shoal.catalog.repo import SourceRecord
from shoal.errors import ConfigurationError
from shoal.log.commit import BatchSlot, commit_group
from shoal.log.segment_file import WrittenSegment, build_segment_table, store_segment
from shoal.storage import Storage

log = logging.getLogger(__name__)


def batch_fingerprint(table: pa.Table) -> str:
    """`sha256:<hex>` of a validated batch's content: its column names and every value, row by row.

    Equal batches get equal fingerprints however they arrived (points or columns, a JSON or an Arrow body,
    chunked or not) and whatever pyarrow version built them: only values are hashed, never buffer layouts,
    slice offsets, padding or the bytes behind a null (a repeat of a batch must be known as one, months later).
    """
    h = hashlib.sha256()
    h.update(b"shoal-batch/1 %d\0" % table.num_rows)
    for name, column in zip(table.column_names, table.columns, strict=True):
        h.update(name.encode() + b"\0")
        _hash_values(h, column.combine_chunks() if column.num_chunks != 1 else column.chunk(0))
    return "sha256:" + h.hexdigest()


def _hash_values(h: Any, arr: pa.Array) -> None:
    """Feed `arr`'s values to `h`: which rows are null, then the values of the others (a tag per type, the
    lengths of variable-length values, then their bytes as one run)."""
    if arr.null_count:
        valid = arr.is_valid()
        h.update(b"N" + np.packbits(valid.to_numpy(zero_copy_only=False)).tobytes())
        arr = arr.filter(valid)
    kind = arr.type
    n = len(arr)
    if n == 0:  # every row null (a tombstone's vector or other attributes): the null rows said it all
        return
    if pa.types.is_fixed_size_list(kind):
        size = kind.list_size
        h.update(b"F%d" % size)
        _hash_values(h, arr.values.slice(arr.offset * size, n * size))  # a zero-copy view of the rows' values
    elif pa.types.is_list(kind):
        h.update(b"L" + pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype("<i8").tobytes())
        _hash_values(h, arr.flatten())
    elif pa.types.is_string(kind) or pa.types.is_binary(kind):
        offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset : arr.offset + n + 1]
        h.update(b"S" + np.diff(offsets).astype("<i8").tobytes())
        data = arr.buffers()[2]
        if data is not None:  # None when every value is empty
            h.update(memoryview(data)[int(offsets[0]) : int(offsets[-1])])
    elif pa.types.is_boolean(kind):
        h.update(b"B" + np.packbits(arr.to_numpy(zero_copy_only=False)).tobytes())
    elif kind.bit_width % 8 == 0:  # fixed-width numbers and timestamps: their bytes, straight from the buffer
        width = kind.bit_width // 8
        h.update(b"P%d" % width)
        h.update(memoryview(arr.buffers()[1])[arr.offset * width : (arr.offset + n) * width])
    else:  # no validated batch holds another type; hashed by value rather than refused
        h.update(repr(arr.to_pylist()).encode())


# Every live writer of the process, so that a forked child can reset them (`_reset_writers_in_child`).
_WRITERS: weakref.WeakSet[LogWriter] = weakref.WeakSet()


def _reset_writers_in_child() -> None:
    """In a forked child, give every writer a group commit of its own (`LogWriter._reset_after_fork`)."""
    for writer in list(_WRITERS):
        writer._reset_after_fork()


os.register_at_fork(after_in_child=_reset_writers_in_child)


@dataclass
class _Request:
    table: pa.Table
    batch_id: str | None
    fingerprint: str | None = None
    call: int = 0  # which submit_many call queued it (its later batches go when it fails)
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
        self._closed = False
        self._calls = itertools.count(1)
        self.commits = 0  # how many transactions this writer made (observable group-commit effect)
        # Called after each commit that wrote something (never before: DESIGN.md's flow, step 4).
        self.after_commit: Callable[[int], None] | None = None
        # Called with (source id, new head) after each commit and before its writers are acknowledged: the
        # head announcement searchers answer `strong` from (shoal.log.heads).
        self.announce_head: Callable[[int, int], None] | None = None
        _WRITERS.add(self)

    def close(self) -> None:
        """Refuse every later submit (ConfigurationError: its runtime, or Shoal, was closed). Commits in flight
        finish; batches still queued are committed by the callers waiting for them, as ever."""
        self._closed = True

    def _reset_after_fork(self) -> None:
        """Called in a forked child only: the group commit as if nothing were in flight. The parent's state was
        copied mid-commit perhaps: a `_busy` no thread of the child will clear (the next submit would wait for it
        forever) and a condition whose lock may be held. The queued batches are the parent's, whose callers wait
        for the parent's commit: committed by the child too, they would land twice."""
        self._cv = threading.Condition()
        self._queue = deque()
        self._busy = False

    def submit(self, table: pa.Table, batch_id: str | None = None) -> int:
        """Append one validated batch; block until it is durable and committed; return its last seq."""
        return self.submit_many([(table, batch_id)])[0]

    def submit_many(self, batches: list[tuple[pa.Table, str | None]]) -> list[int]:
        """Append several validated batches, each all or nothing with its own batch id, sharing commits
        (as many as fit `group_max_points` per segment); block until every one is committed; their tokens.

        A batch whose id committed before returns its first token and writes nothing; another batch under a
        known id fails alone with BatchIdReusedError. Raises the first failure. When a commit fails as a whole,
        the batches after the failed ones never land (they fail with the same error, uncommitted): those before
        it may have landed, so a retry of them all (their ids make it safe) lands them in their order.
        """
        # Fingerprints only for batches with an id (nothing to compare the others with), here in the caller's
        # thread rather than by the group's leader, which holds the data source's lock.
        if self._closed:  # a bool: the upload's hot path pays no more
            raise ConfigurationError(
                f"this Shoal is closed: data source {self.source.spec.name}/{self.source.spec.version} takes no "
                f"uploads through it (make a new Shoal, and its producers, to upload again)")
        reqs = [
            _Request(table, batch_id, batch_fingerprint(table) if batch_id is not None else None)
            for table, batch_id in batches
        ]
        with self._cv:
            call = next(self._calls)
            for req in reqs:
                req.call = call
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

    def _withdraw_calls_of(self, failed: list[_Request], exc: BaseException) -> None:
        """Fail with `exc`, uncommitted, every queued request of a submit_many call that had one in the failed
        group. Called under the condition lock by the thread that committed, before it ends its commit: no other
        thread can take them first, and commit a caller's later batches before the earlier ones it retries."""
        calls = {r.call for r in failed}
        kept: deque[_Request] = deque()
        for r in self._queue:
            if r.call in calls:
                r.error, r.done = exc, True
            else:
                kept.append(r)
        self._queue = kept

    def _commit(self, group: list[_Request]) -> None:
        src = self.source

        def write(first_seq: int, keep: list[int]) -> WrittenSegment:
            table = build_segment_table([group[i].table for i in keep])
            return store_segment(self.storage, src.tenant, src.spec.name, src.spec.version, first_seq, table)

        try:
            tokens = commit_group(
                self.engine,
                src.id,
                [BatchSlot(r.table.num_rows, r.batch_id, r.fingerprint) for r in group],
                write,
                self.storage.delete_quietly,
                retries=self.retries,
                lock_timeout_ms=self.lock_timeout_ms,
                on_commit=self._on_commit,
            )
        except BaseException as exc:  # every caller in the group learns the same failure
            with self._cv:
                for r in group:
                    r.error, r.done = exc, True
                self._withdraw_calls_of(group, exc)
            return
        self.commits += 1
        for r, outcome in zip(group, tokens, strict=True):
            if isinstance(outcome, int):
                r.token = outcome
            else:  # refused alone (a batch id reused with another batch): the rest of the group committed
                r.error = outcome
            r.done = True
        if self.after_commit is not None:
            try:
                self.after_commit(src.id)
            except Exception:  # noqa: BLE001 - the batch is durable; indexers also catch up by sweeping
                log.exception("after-commit notification failed")
