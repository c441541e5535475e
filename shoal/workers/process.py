"""The worker process of Shoal's Celery app: Celery's worker, made to exit promptly after an error it cannot
recover from, so that a supervisor (`shoal up`, systemd, a container runtime) starts a fresh one.

Celery answers an unrecoverable error with a warm shutdown: it waits for the pool to finish and hand back
what its children hold. After a broker restart the prefork pool's result pipe can be left mid-message (the
event loop was reset while a result was half read); the next read then fails to unpickle ("invalid load
key"), Celery calls that unrecoverable, and the warm shutdown waits on that same broken pipe forever: the
process neither works nor exits, and nothing restarts it. Here such a stop is cold (running tasks are
abandoned; every task is idempotent, its message is unacknowledged and its lease names a dead process) and
bounded: if it has not returned after EXIT_GRACE_S, the process ends anyway.

Ctrl-C is no such error. Celery's SIGINT handler asks for a warm shutdown with exit code EX_FAILURE, which
reaches `stop` exactly as an unrecoverable error does; here the first SIGINT asks for it with EX_OK instead, so
it stays warm (running tasks finish, exit 0) and the second one still aborts them (Celery's cold shutdown).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from celery.apps.worker import Worker as CeleryWorker
from celery.apps.worker import install_worker_int_handler
from celery.platforms import EX_OK

from shoal.config.settings import Settings
from shoal.workers.priority import lower_priority

log = logging.getLogger(__name__)

EXIT_GRACE_S = 15.0  # the longest a failing worker may take to stop before it ends regardless


def _exit_after(seconds: float, code: int) -> None:
    """End this process with `code` after `seconds`, whatever the main thread is waiting on."""

    def _end() -> None:
        log.critical("the worker did not stop within %.0f s of an unrecoverable error; exiting with code %d",
                     seconds, code)
        logging.shutdown()
        os._exit(code)

    timer = threading.Timer(seconds, _end)
    timer.daemon = True
    timer.start()


class Worker(CeleryWorker):  # type: ignore[misc]
    """Celery's worker at SHOAL_WORKER_NICE, whose stop after a failure is cold and ends the process within
    EXIT_GRACE_S."""

    def on_before_init(self, **kwargs: Any) -> None:
        """Lower the CPU priority first, before Celery starts any thread: the pool, beat and hnswlib's build
        threads inherit it (the threads libraries started on import are lowered one by one)."""
        lower_priority(Settings().worker_nice)
        super().on_before_init(**kwargs)

    def install_platform_tweaks(self, worker: Any) -> None:
        """Celery's signal handlers, but a first SIGINT (Ctrl-C) is a warm shutdown that exits 0: with Celery's
        EX_FAILURE it would arrive at `stop` as a failure and be made cold. A second SIGINT aborts the running
        tasks, as Celery's does (its handler installs that one)."""
        super().install_platform_tweaks(worker)
        install_worker_int_handler(worker, exitcode=EX_OK)

    def stop(self, in_sighandler: bool = False, exitcode: int | None = None) -> Any:
        """Stop as Celery does, except that a stop with a failure exit code (an unrecoverable error) is cold
        and bounded in time, so the process exits and can be restarted."""
        if not exitcode or in_sighandler:
            return super().stop(in_sighandler=in_sighandler, exitcode=exitcode)
        self.exitcode = exitcode
        log.critical("stopping the worker at once after an unrecoverable error (exit code %d); running tasks "
                     "are left to be redelivered", exitcode)
        _exit_after(EXIT_GRACE_S, exitcode)
        self.terminate()
        return None
