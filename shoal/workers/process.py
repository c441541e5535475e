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

A worker whose supervisor bounds its stop (`shoal up`: `shoal.servers.parent_death.supervised_env`) watches it:
should it die unannounced (SIGKILL, the OOM killer), nobody would enforce that bound, and the warm stop its
death signal asks for would wait for the running build, the embedded beat scheduling beside the next `shoal up`'s
meanwhile. So the worker stops its beat at once, stops warmly within the supervisor's stop timeout, then cold
(Celery's SIGQUIT: running tasks are handed back, acks_late), and after EXIT_GRACE_S more its whole process group
(beat, pool) is killed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from celery.apps.worker import Worker as CeleryWorker
from celery.apps.worker import install_worker_int_handler
from celery.platforms import EX_OK

from shoal.config.settings import Settings
from shoal.servers.parent_death import supervisor_from_env, watch_parent
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


def _after(seconds: float, action: Callable[[], None]) -> None:
    """Run `action` in a daemon thread after `seconds`, unless the process ended first."""
    timer = threading.Timer(seconds, action)
    timer.daemon = True
    timer.start()


def _cold_stop() -> None:
    """Celery's cold stop (running tasks handed back to the broker), and the whole process group killed if it
    has not ended within EXIT_GRACE_S."""
    log.critical("the worker's stop timeout ran out: stopping it cold; running tasks are left to be redelivered")
    os.kill(os.getpid(), signal.SIGQUIT)
    _after(EXIT_GRACE_S, _kill_group)


def _kill_group() -> None:
    """SIGKILL to this process's group if it leads one (a supervisor started it so): the worker, its beat and
    pool processes; to this process alone otherwise (the group is someone else's)."""
    log.critical("the worker did not stop within %.0f s of its cold stop; killing it and its processes",
                 EXIT_GRACE_S)
    logging.shutdown()
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


class Worker(CeleryWorker):  # type: ignore[misc]
    """Celery's worker at SHOAL_WORKER_NICE, whose stop after a failure is cold and ends the process within
    EXIT_GRACE_S."""

    def on_before_init(self, **kwargs: Any) -> None:
        """Lower the CPU priority first, before Celery starts any thread: the pool, beat and hnswlib's build
        threads inherit it (the threads libraries started on import are lowered one by one)."""
        lower_priority(Settings().worker_nice)
        super().on_before_init(**kwargs)
        supervisor = supervisor_from_env()
        if supervisor is not None:
            parent, stop_timeout = supervisor
            watch_parent(parent, lambda: self._orphaned(parent, stop_timeout))

    def _orphaned(self, parent: int, stop_timeout: float) -> None:
        """The supervisor died: stop beat now, and the worker warmly, cold after `stop_timeout` s, killed with
        its process group EXIT_GRACE_S after that (the supervisor would have done the same, and is gone)."""
        log.warning("the supervisor (pid %d) is gone: stopping beat now and this worker within %g s (warm, then "
                    "cold)", parent, stop_timeout)
        beat = getattr(self, "beat", None)  # set by the worker's Beat step, absent before it ran
        if beat is not None:
            try:
                beat.stop()  # its own process (prefork) or thread: it schedules nothing beside a new supervisor's
            except Exception:  # noqa: BLE001 - the stop below must be asked for, and bounded, whatever this did
                log.exception("stopping the embedded beat failed; the worker's stop ends it")
        # The warm stop, should the kernel's death signal not come (no prctl); a repeated SIGTERM changes nothing.
        os.kill(os.getpid(), signal.SIGTERM)
        _after(stop_timeout, _cold_stop)


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
