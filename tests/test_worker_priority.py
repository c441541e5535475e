"""Workers lower their own CPU priority (SHOAL_WORKER_NICE), so that builds and merges yield the CPU to the
searchers and producers on the same host: a real Celery worker process, and the rule in child processes (a
nice value cannot be raised back, so it is never changed in the test process itself)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import start_worker, stop_process, wait_for

# Whether a process that starts a session gets an autogroup of its own here: not without /proc/self/autogroup
# (another OS, a kernel without them), and not where the file reads empty.
AUTOGROUP_ON = Path("/proc/self/autogroup").exists() and bool(subprocess.run(
    [sys.executable, "-c", "print(open('/proc/self/autogroup').read())"], capture_output=True, text=True,
    timeout=60, start_new_session=True).stdout.strip())


def _nice_of(pid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, pid)


def _autogroup_nice(pid: int) -> int | None:
    """The nice value of the process's autogroup; None in the default autogroup, init's (the file reads empty
    there, as for a CI runner descended from init without a session of its own)."""
    text = Path(f"/proc/{pid}/autogroup").read_text().split()
    return int(text[-1]) if text else None


@pytest.mark.slow
def test_a_worker_runs_at_the_configured_nice_value(make_settings, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    settings = make_settings("local", redis_url=redis_url, worker_nice=7)
    mine = _nice_of(0)
    proc = start_worker(settings)
    try:
        wait_for(lambda: _nice_of(proc.pid) == max(7, mine) or proc.poll() is not None, 60, "the worker's nice value")
        assert proc.poll() is None, Path(proc.log_path).read_text()  # type: ignore[attr-defined]
        assert _nice_of(proc.pid) == max(7, mine)
        if AUTOGROUP_ON:  # the worker leads its own session (start_new_session), so its autogroup is lowered too
            assert _autogroup_nice(proc.pid) == 7
            assert _autogroup_nice(os.getpid()) != 7 or mine == 7  # ours is untouched
        wait_for(lambda: "ready" in Path(proc.log_path).read_text(), 60, "the worker to be ready")  # type: ignore[attr-defined]
        # Every thread it started since (beat's, the broker's, the pool's) inherited the value.
        tids = [int(t.name) for t in Path(f"/proc/{proc.pid}/task").iterdir()]
        assert len(tids) > 1
        names = {t: Path(f"/proc/{proc.pid}/task/{t}/comm").read_text().strip() for t in tids}
        assert {names[t]: _nice_of(t) for t in tids if _nice_of(t) != max(7, mine)} == {}
    finally:
        stop_process(proc)


CHILD = """
import os, sys, threading
from pathlib import Path
from shoal.workers.priority import lower_priority
# A thread already running (as a library's, started on import) is lowered too.
go, done, tid = threading.Event(), threading.Event(), []
t = threading.Thread(target=lambda: (tid.append(threading.get_native_id()), go.set(), done.wait()))
t.start()
go.wait()
got = [lower_priority(int(n), Path(sys.argv[1])) for n in sys.argv[2:]]
print(*got, os.nice(0), os.getpriority(os.PRIO_PROCESS, tid[0]))
done.set()
t.join()
"""


def _lower_in_child(group: Path, *nices: int, session: bool) -> list[int]:
    """lower_priority(n, group) for each n in a child process (its own session or ours): what each call
    returned, then the nice value of its main thread and of a thread started before the calls."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(group), *map(str, nices)], capture_output=True,
                         text=True, timeout=60, start_new_session=session)
    assert out.returncode == 0, out.stderr
    return [int(x) for x in out.stdout.split()]


def test_lower_priority_raises_the_nice_value_and_never_lowers_it(tmp_path: Path) -> None:
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-1 nice 0\n")
    want = max(5, _nice_of(0))
    # Asking for less priority than in force (3, 0) changes nothing.
    assert _lower_in_child(group, 5, 3, 0, session=True) == [want] * 5
    # It led its session: the autogroup went to 5 (and was not lowered again by 3).
    assert group.read_text().strip() == "5"

    group.write_text("/autogroup-1 nice 0\n")
    assert _lower_in_child(group, 5, 3, 0, session=False) == [want] * 5
    # Not a session leader: a terminal's session (and everything in it) keeps its autogroup.
    assert group.read_text().strip() == "/autogroup-1 nice 0"


def test_zero_leaves_the_worker_as_it_was_started(tmp_path: Path) -> None:
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-1 nice 0\n")
    base = _nice_of(0)
    assert _lower_in_child(group, 0, session=True) == [base, base, base]
    assert group.read_text() == "/autogroup-1 nice 0\n"


def test_a_process_outside_any_autogroup_keeps_its_nice_value_and_logs_nothing(tmp_path: Path) -> None:
    group = tmp_path / "autogroup"
    group.write_text("")  # what /proc/<pid>/autogroup reads in the root task group
    out = subprocess.run([sys.executable, "-c", CHILD, str(group), "5"], capture_output=True, text=True,
                         timeout=60, start_new_session=True)
    assert out.returncode == 0, out.stderr
    assert [int(x) for x in out.stdout.split()][:2] == [max(5, _nice_of(0))] * 2
    assert group.read_text() == ""
    assert "could not" not in out.stderr


def test_the_setting_is_bounded(make_settings) -> None:  # type: ignore[no-untyped-def]
    from pydantic import ValidationError

    for bad in (-1, 20):
        with pytest.raises(ValidationError, match="worker_nice"):
            make_settings("local", worker_nice=bad)
