"""Child processes that end with the process that started them: on Linux the kernel sends them SIGTERM when
their parent dies (PR_SET_PDEATHSIG), so a supervisor killed with SIGKILL (a crash, the OOM killer) leaves no
child holding its port or its work. Elsewhere (no prctl) the children of a killed supervisor go on.

SIGTERM asks a Celery worker for a warm stop, which waits for its running task however long that takes, its
embedded beat scheduling meanwhile. A supervisor that bounds that wait (`shoal up`'s stop timeout) passes the
bound in the worker's environment (`supervised_env`); the worker then watches for its death itself
(`supervisor_from_env`, `watch_parent`) and bounds its own stop.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping

__all__ = ["die_with_parent", "parent_death_signal", "supervised_env", "supervisor_from_env", "watch_parent"]

PR_SET_PDEATHSIG = 1  # linux/prctl.h
SUPERVISOR_ENV = "SHOAL_SUPERVISOR"  # "PID:STOP_TIMEOUT_S": the supervisor a worker is to watch, and its bound
WATCH_POLL_S = 0.5  # how often a watched parent is looked for


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def parent_death_signal() -> Callable[[], None] | None:
    """A subprocess `preexec_fn` that has the kernel send the child SIGTERM when this process dies (SIGTERM: a
    worker still stops its beat and pool); None where prctl is not available."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        # Runs in the forked child before exec: the prctl call, resolved above, and two system calls only.
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def die_with_parent(parent: int) -> None:
    """In a child already running (a multiprocessing `spawn` child: no preexec_fn there), have the kernel send it
    SIGTERM when its parent, pid `parent`, dies; SIGTERM at once if it died already. No-op without prctl."""
    prctl = _prctl()
    if prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def supervised_env(env: Mapping[str, str], stop_timeout: float) -> dict[str, str]:
    """`env` plus what tells a worker started with it that this process supervises it: should this process
    die, the worker stops within `stop_timeout` s by itself (`supervisor_from_env`)."""
    return {**env, SUPERVISOR_ENV: f"{os.getpid()}:{stop_timeout!r}"}


def supervisor_from_env() -> tuple[int, float] | None:
    """The supervisor's pid and stop timeout that `supervised_env` set, taken out of this process's environment
    (the processes it starts have no such supervisor); None when it set none. ValueError naming the variable
    when its value is not PID:SECONDS."""
    value = os.environ.pop(SUPERVISOR_ENV, None)
    if value is None:
        return None
    try:
        pid, timeout = value.split(":")
        return int(pid), float(timeout)
    except ValueError:
        raise ValueError(f"{SUPERVISOR_ENV}={value!r} is not PID:STOP_TIMEOUT_S") from None


def watch_parent(parent: int, on_death: Callable[[], None], poll_s: float = WATCH_POLL_S) -> threading.Thread:
    """Call `on_death` once, in a daemon thread, as soon as process `parent` is no longer this process's parent
    (it died and this one was handed to init or a subreaper), at once if it is not now; works without prctl."""

    def watch() -> None:
        # getppid is a system call that cannot block or fail: polling it is cheap, and sees a death the kernel's
        # signal would report too late (a warm stop waiting on a long task) or not at all (no prctl).
        while os.getppid() == parent:
            time.sleep(poll_s)
        on_death()

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread
