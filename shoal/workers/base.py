"""The base of every Shoal task: acknowledged late, redelivered when a worker dies, retried with backoff on
transient errors only, and owner of the process's WorkerContext.

Celery makes one instance of each task per process; the context they share lives on this class, made on
the first task that needs it, in the process that runs it (so a pool process forked from the main one
never uses the parent's database or broker connections).
"""

from __future__ import annotations

import os
import threading
from typing import Any, ClassVar

import redis
from celery import Task
from celery.signals import worker_process_init
from sqlalchemy.exc import OperationalError

from shoal.errors import ConflictError, LeaseBusyError, StorageUnavailableError
from shoal.workers.context import WorkerContext

# A retry of a task that found a shard's lease held waits at most until that lease ends, plus this margin: by
# then the holder renewed it (alive: wait again) or it expired (dead: take it over), so a dead worker's shard
# is built again within about one lease period, not after the retry's whole backoff.
LEASE_RETRY_MARGIN_S = 0.5

# The retry map: errors worth a retry, because the catalog, broker or storage was briefly away or the task lost a
# race (a ConflictError: another worker holds the shard's lease, or moved a pointer first; a retry reloads).
# Anything else fails the task at once (and is logged by Celery). StateUnknownError is not here on purpose: a
# commit that may have landed must be checked, not blindly repeated.
TRANSIENT: tuple[type[BaseException], ...] = (
    OperationalError,  # the catalog (Postgres) refused or dropped the connection
    redis.ConnectionError,  # the broker / Redis is away
    redis.TimeoutError,
    # The storage is away: pyarrow raises a plain OSError for S3's network errors, which `shoal.storage` raises as
    # StorageUnavailableError (a ConnectionError, named for clarity); other OSErrors (a full or forbidden local
    # disk, refused credentials) fail at once: a retry cannot fix them, and beat's sweep queues the work again.
    StorageUnavailableError,
    ConnectionError,  # any socket
    TimeoutError,
    ConflictError,  # lost a race, e.g. LeaseBusyError: another worker builds the shard right now
)


class ShoalTask(Task):
    """Base of every Shoal task (`@app.task(base=ShoalTask, bind=True, name=...)`): late acks, redelivery on
    worker loss, retries with backoff on TRANSIENT, and `self.context`, the process's WorkerContext."""

    acks_late = True
    reject_on_worker_lost = True
    autoretry_for = TRANSIENT
    retry_backoff = 1
    retry_backoff_max = 30
    retry_jitter = True
    max_retries = 50

    # One context per process, shared by every task class (each task is a subclass made by `app.task`).
    _context: ClassVar[WorkerContext | None] = None
    _context_pid: ClassVar[int | None] = None
    _context_lock: ClassVar[threading.Lock] = threading.Lock()

    def retry(self, *args: Any, exc: BaseException | None = None, countdown: float | None = None,
              **options: Any) -> Any:
        """Celery's retry, waiting no longer than a busy shard lease has left (see LEASE_RETRY_MARGIN_S)."""
        if isinstance(exc, LeaseBusyError) and exc.retry_in is not None and countdown is not None:
            countdown = min(countdown, max(exc.retry_in, 0.0) + LEASE_RETRY_MARGIN_S)
        return super().retry(*args, exc=exc, countdown=countdown, **options)

    @property
    def context(self) -> WorkerContext:
        """This process's context, created on first use (after fork, so connections are never shared)."""
        return ShoalTask.process_context()

    @staticmethod
    def process_context() -> WorkerContext:
        """The context of this process (the one `self.context` returns), made now if there is none yet."""
        with ShoalTask._context_lock:
            if ShoalTask._context is None or ShoalTask._context_pid != os.getpid():
                ShoalTask._context = WorkerContext.create()
                ShoalTask._context_pid = os.getpid()
            return ShoalTask._context

    @staticmethod
    def reset_context() -> None:
        """Forget this process's context: the next task makes a new one from the environment's settings
        (a freshly forked pool process does this; so do tests that change the environment)."""
        ShoalTask._context_lock = threading.Lock()  # a lock held in the parent at fork time stays held here
        ShoalTask._context = None
        ShoalTask._context_pid = None


@worker_process_init.connect
def _fresh_context(**_: Any) -> None:
    # Forked pool processes must not share the parent's database connections.
    ShoalTask.reset_context()
