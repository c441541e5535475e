"""Child processes that end with the process that started them: on Linux the kernel sends them SIGTERM when
their parent dies (PR_SET_PDEATHSIG), so a supervisor killed with SIGKILL (a crash, the OOM killer) leaves no
child holding its port or its work. Elsewhere (no prctl) the children of a killed supervisor go on."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

__all__ = ["die_with_parent", "parent_death_signal"]

PR_SET_PDEATHSIG = 1  # linux/prctl.h


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
