"""A worker's CPU priority. Index builds and merges are background work: on a host they share with searchers,
the HTTP API or producers, they should take the CPU those leave, not half of it (SHOAL_WORKER_NICE).

Linux's scheduler, with autogroups on (the default of most distributions), first shares the CPU between
sessions and only then between the processes of one session, so a nice value alone orders a worker only against
processes of its own session. A worker that leads its own session (`shoal up`, `shoal demo`, a supervisor that
starts it with setsid) therefore also lowers its session's autogroup, which holds nothing but itself and its
children. A worker sharing a terminal's session leaves the session's autogroup alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

AUTOGROUP = Path("/proc/self/autogroup")
TASKS = "/proc/self/task"


def lower_priority(nice: int, autogroup: Path = AUTOGROUP) -> int:
    """Raise the nice value of this process's threads to `nice` where it is lower (raising it back needs
    privileges, so a higher value is kept), and its autogroup's too when this process leads its own session; the
    calling thread's nice value after. Threads started later inherit the value of the thread that starts them,
    so call it early; threads already running (a library's, started on import) are lowered one by one."""
    if not hasattr(os, "nice"):
        return 0  # not a Unix: nothing to lower
    if nice > os.nice(0):
        try:
            tasks = [int(t) for t in os.listdir(TASKS)]
        except OSError:  # no /proc: this thread alone (and the threads it starts)
            tasks = []
        try:
            if not tasks:
                os.nice(nice - os.nice(0))
            for tid in tasks:
                with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                    if os.getpriority(os.PRIO_PROCESS, tid) < nice:  # on Linux a thread id names one thread
                        os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError as exc:  # a sandbox may forbid it; the worker runs as it is
            log.warning("could not lower the worker's CPU priority to nice %d: %s", nice, exc)
    if nice > 0 and os.getsid(0) == os.getpid():
        _lower_autogroup(nice, autogroup)
    return os.nice(0)


def _lower_autogroup(nice: int, autogroup: Path) -> None:
    try:
        text = autogroup.read_text()  # e.g. "/autogroup-123 nice 0"
    except OSError:
        return  # no autogroups here (another OS, or a kernel built without them)
    if not text.strip():
        # Empty: the process is in the default autogroup, init's (a process descended from init without a
        # session of its own, like some CI runners, or a first process that inherited it): that is the root
        # task group, shared with everything there, and not ours to lower.
        return
    try:
        if int(text.split()[-1]) >= nice:
            return
        autogroup.write_text(str(nice))
    except (OSError, ValueError) as exc:
        log.warning("could not lower the worker session's autogroup to nice %d: %s", nice, exc)
