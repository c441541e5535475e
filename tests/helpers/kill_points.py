"""Crash tests kill a process inside a window they can observe (a file appeared in storage, a catalog row
changed), not after a sleep: freeze it there with SIGSTOP, confirm it is still inside, then SIGKILL it."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from conftest import wait_for


def freeze_inside(
    pid: int,
    inside: Callable[[], bool],
    timeout: float,
    what: str,
    *,
    group: bool = False,
    tick: Callable[[], None] | None = None,
    narrow: bool = False,
) -> None:
    """Return with process `pid` (its whole process group with `group`) stopped by SIGSTOP while `inside()`
    holds; fail the test naming `what` after `timeout` seconds.

    `inside()` is polled; once it holds the process is stopped and `inside()` asked again, because the window
    may have closed between the poll and the stop: then the process is resumed and polling goes on. A SIGKILL
    sent after this returns therefore lands inside the window (short of a catalog commit the server was
    already finishing when the process stopped). `tick` runs before every poll, e.g. to drain the process's
    stdout so that a full pipe never blocks it.

    `narrow` is for a window shorter than one poll (a few milliseconds between a file's rename and its
    COMMIT): polling a running process would rarely see it open, so the process is stopped first and
    `inside()` asked while it stands still, sampling its state at every poll until one lands inside.
    """
    send = os.killpg if group else os.kill

    def stop() -> None:
        send(pid, signal.SIGSTOP)
        # The signal is delivered asynchronously: look only once the process really is stopped.
        wait_for(lambda: _stopped(pid), 10, f"process {pid} to stop")

    def sampled_inside() -> bool:
        if tick is not None:
            tick()
        stop()
        if inside():
            return True
        send(pid, signal.SIGCONT)
        return False

    def stopped_inside() -> bool:
        if tick is not None:
            tick()
        if not inside():
            return False
        stop()
        if inside():
            return True
        send(pid, signal.SIGCONT)  # the window closed before the stop: wait for the next one
        return False

    wait_for(sampled_inside if narrow else stopped_inside, timeout, what)


def _stopped(pid: int) -> bool:
    """True when Linux reports the process stopped (state T in /proc/<pid>/stat) or gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The state follows the command name, which is in parentheses and may itself hold spaces.
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t", "Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True
