"""How a bench of this folder starts and ends: signals, cleanup, a missing data set, servers that do not start.

A bench's `main` runs inside a `Lifecycle`:

    require_data(DATA_DIR, "base_f16.npy")             # before anything starts: one line and exit 2
    with Lifecycle() as life:
        tmp = life.temp_dir("shoal-x-bench-", keep=args.keep)   # removed last
        life.stop_servers(tmp)                           # the embedded Postgres and Valkey of tmp
        with life.starting(tmp):                         # an error here: one line naming tmp, exit 1
            shoal = Shoal(Settings(data_dir=tmp))
        life.cleanup("Shoal connections", shoal.close)   # steps run last-registered first
        ...

* While the bench runs, SIGINT and SIGTERM raise KeyboardInterrupt in the main thread (SIGINT too when a shell
  started the bench in the background with it ignored), so Ctrl-C, `kill` and `timeout` all reach the cleanup.
* The cleanup steps run each on its own (one failing does not skip the rest), and a signal arriving meanwhile is
  held until they are done: a second Ctrl-C or SIGTERM cannot cut the cleanup short.
* An interrupted run ends with one line and exit 130. It says "cleaned up" only when every step did its job, and
  otherwise names what was left and why.
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import NoReturn

from shoal.servers.embedded import stop_embedded

SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_STARTUP = 1  # a server the bench needs did not start
EXIT_NO_DATA = 2  # the data set is not where the bench looks
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM, as a shell reports a SIGINT death
# Bounded waits of the cleanup: signals are held meanwhile, so none of them may hang.
SERVER_EXIT_S = 20.0  # Valkey exits on its own after stop_embedded's SIGTERM; pg_ctl already waited
TREE_REMOVAL_S = 5.0  # a server's last file (Valkey's dump) may land just after its stop


def say(line: str) -> None:
    """Print one line to stderr, after whatever the bench printed to stdout (both may go to one file)."""
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


def interrupt(signum: int, frame: FrameType | None) -> NoReturn:
    """Signal handler: the signal as Ctrl-C, so `finally` blocks and the cleanup run."""
    raise KeyboardInterrupt(f"signal {signum}")


def require_data(data_dir: Path, *files: str) -> None:
    """Return when every one of `files` is in `data_dir`; otherwise print one line and exit 2.

    Call it before anything starts: there is nothing to clean up yet."""
    missing = [name for name in files if not (data_dir / name).is_file()]
    if not missing:
        return
    if data_dir.is_dir():
        say(f"data set not found at {data_dir}: no {', '.join(missing)} there (set SHOAL_BENCH_DATA)")
    else:
        say(f"data set not found at {data_dir} (set SHOAL_BENCH_DATA)")
    raise SystemExit(EXIT_NO_DATA)


class StartupError(Exception):
    """A server the bench needs did not start: `line` says what, where and why; `detail` holds the rest of the
    cause's message (e.g. a server log's last lines), shown indented below it."""

    def __init__(self, line: str, detail: list[str]) -> None:
        super().__init__(line)
        self.line = line
        self.detail = detail


@contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Processes started (spawned or exec'd) inside the block begin with SIGINT ignored: an ignored disposition
    survives fork and exec (a handler does not). A terminal's Ctrl-C goes to the whole process group; children
    started this way leave it to this process, which stops them, instead of each dying with a traceback (even in
    the middle of its imports).

    Keep the block to the starts alone (milliseconds each): a SIGINT to this process inside it is ignored too."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass
class _Step:
    what: str | None  # what stays behind if the step fails; None: a step that removes nothing ("kept ...")
    fn: Callable[[], object]
    early: bool = False  # runs before every other step (a stop flag for the bench's threads)


class StepList:
    """For helpers that take a cleanup list: `append(fn)` registers `fn` as a step named `what`."""

    def __init__(self, life: Lifecycle, what: str) -> None:
        self.life = life
        self.what = what

    def append(self, fn: Callable[[], object]) -> None:
        self.life.cleanup(self.what, fn)


class Lifecycle:
    """Signals as Ctrl-C while the bench runs; at the end every cleanup step runs, with signals held."""

    def __init__(self) -> None:
        self._steps: list[_Step] = []
        self._previous: dict[int, object] = {}
        self._held: list[int] = []  # signals that arrived during the cleanup

    # -- what to clean up -----------------------------------------------------------------------------------

    def cleanup(self, what: str | None, fn: Callable[[], object], *, early: bool = False) -> None:
        """Run `fn` when the bench ends, before every step registered earlier (with `early`, before every step not
        early). `what` names what stays behind if `fn` raises (None: a step that removes nothing, never reported)."""
        self._steps.append(_Step(what, fn, early))

    def steps(self, what: str) -> StepList:
        """A list-like whose `append(fn)` registers `fn` as a cleanup step named `what`."""
        return StepList(self, what)

    def temp_dir(self, prefix: str, *, keep: bool = False, kept: str = "") -> Path:
        """A new temp dir, removed (and checked gone) when the bench ends, after the steps registered later; with
        `keep` it is kept and its path printed (with `kept` in brackets after it, when given)."""
        path = Path(tempfile.mkdtemp(prefix=prefix))
        if keep:
            self.cleanup(None, lambda: print(f"kept {path}" + (f" ({kept})" if kept else ""), flush=True))
        else:
            self.cleanup("temp files", lambda: remove_tree(path))
        return path

    def stop_servers(self, data_dir: Path) -> None:
        """Stop the embedded Postgres and Valkey of `data_dir` when the bench ends, and check that they exited (a
        no-op for servers never started there)."""
        self.cleanup("embedded servers", lambda: stop_servers(data_dir))

    @contextmanager
    def starting(self, data_dir: Path, what: str = "the servers") -> Iterator[None]:
        """An error inside the block becomes a StartupError: at the end, one line naming `data_dir` and the cause,
        and exit 1 (after the cleanup)."""
        try:
            yield
        except Exception as exc:
            detail = [line for line in str(exc).splitlines()[1:] if line.strip()]
            raise StartupError(f"{what} did not start (data dir {data_dir}): {cause(exc)}", detail) from exc

    # -- the run --------------------------------------------------------------------------------------------

    def __enter__(self) -> Lifecycle:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, interrupt)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        for sig in SIGNALS:  # first: a signal from here on waits until the cleanup is done
            signal.signal(sig, self._hold)
        try:
            done, failed = self._run_steps()
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
        if isinstance(exc, StartupError):
            say(exc.line + (f"; {not_cleaned(failed)}" if failed else ""))
            for line in exc.detail:
                say(f"  {line}")
            raise SystemExit(EXIT_STARTUP) from None
        if isinstance(exc, KeyboardInterrupt) or (exc is None and self._held):
            why = (str(exc) or "Ctrl-C") if exc is not None else f"signal {self._held[0]}, during the cleanup"
            say(f"interrupted ({why}); {outcome(done, failed)}")
            raise SystemExit(EXIT_INTERRUPTED) from None
        if failed:
            say(f"cleanup: {not_cleaned(failed)}")
        return False  # any other error goes on, traceback and all: it is a bug to see

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        self._held.append(signum)

    def _run_steps(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Every step, last registered first; (what was cleaned up, [(what was not, why)])."""
        done: list[str] = []
        failed: list[tuple[str, str]] = []
        order = [s for s in reversed(self._steps) if s.early] + [s for s in reversed(self._steps) if not s.early]
        for step in order:
            try:
                step.fn()
            except Exception as exc:  # noqa: BLE001 - the next steps still run; reported at the end
                failed.append((step.what or "cleanup", cause(exc)))
            else:
                if step.what is not None and step.what not in done:
                    done.append(step.what)
        done = [what for what in done if what not in {f for f, _ in failed}]
        return done, failed


# -- cleanup steps ------------------------------------------------------------------------------------------


def stop_servers(data_dir: Path) -> None:
    """Stop the embedded servers of `data_dir`; raise naming any still running after SERVER_EXIT_S."""
    stop_embedded(data_dir)
    pidfiles = {"Valkey": data_dir / "valkey" / "valkey.pid", "Postgres": data_dir / "postgres" / "postmaster.pid"}
    deadline = time.monotonic() + SERVER_EXIT_S
    while True:
        running = {name: pid for name, path in pidfiles.items() if (pid := _running_pid(path)) is not None}
        if not running:
            return
        if time.monotonic() > deadline:
            names = ", ".join(f"{name} (pid {pid})" for name, pid in running.items())
            raise RuntimeError(f"{names} of {data_dir} still running {SERVER_EXIT_S:.0f}s after the stop")
        time.sleep(0.1)


def _running_pid(pidfile: Path) -> int | None:
    """The pid a server's pid file names, if that process still exists (a server removes the file on exit)."""
    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if Path(f"/proc/{pid}").exists() else None


def remove_tree(path: Path) -> None:
    """Remove `path` and everything in it; raise naming the first error if it is still there after TREE_REMOVAL_S."""
    errors: list[str] = []

    def note(function: object, name: str, info: tuple[type[BaseException], BaseException, object]) -> None:
        errors.append(f"{name}: {info[1]}")

    deadline = time.monotonic() + TREE_REMOVAL_S
    while True:
        errors.clear()
        shutil.rmtree(path, onerror=note)
        if not path.exists():
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} is still there ({errors[0] if errors else 'no error reported'})")
        time.sleep(0.1)


# -- the one-line messages ----------------------------------------------------------------------------------


def cause(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] + (" …" if len(lines) > 1 else "") if lines else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def joined(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def not_cleaned(failed: list[tuple[str, str]]) -> str:
    return "NOT cleaned up: " + "; ".join(f"{what} ({why})" for what, why in failed)


def outcome(done: list[str], failed: list[tuple[str, str]]) -> str:
    """'X, Y and Z cleaned up', or what was not (and what was)."""
    if not failed:
        return f"{joined(done)} cleaned up" if done else "nothing to clean up"
    return not_cleaned(failed) + (f"; {joined(done)} cleaned up" if done else "")
