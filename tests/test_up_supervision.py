"""`shoal up` leaves nothing behind and refuses what cannot work; `shoal api --workers` takes no port in use.

Each child of `shoal up` leads a session of its own; a worker's beat and pool processes are in it. Once `shoal up`
has exited, however it was stopped (SIGTERM with a worker killed at its stop timeout, a dead child under
--no-restart, SIGHUP from a closed terminal), no process of any child's session may be left: an orphaned beat
went on scheduling sweeps beside the next `shoal up`'s. Real processes, a real catalog and broker throughout.
"""

from __future__ import annotations

import contextlib
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import api_process, free_port, settings_env, wait_for
from helpers.long_build import building, built, queue_a_long_build

from shoal import Shoal
from shoal.config.settings import Settings


def _session(sid: int) -> list[int]:
    """The live processes of session `sid` (a zombie, ended but not reaped yet, counts as gone)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended while we looked
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            found.append(int(entry.name))
    return found


def _pids(text: str) -> dict[str, int]:
    """The children's pids as `shoal up` printed them at start: {"worker": 123, ...}."""
    return {name: int(pid) for name, pid in re.findall(r"^(\w+):.*\(pid (\d+)\)", text, re.MULTILINE)}


@contextlib.contextmanager
def _shoal_up(settings: Settings, *args: str, output: int | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """`shoal up ARGS` in a session of its own, its output to `output` (a file descriptor) or to up.log in the data
    dir; when the block ends whatever is left of it and of its children's sessions is killed (the old code left
    them)."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    log_path = settings.data_dir / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "shoal", "up", *args], env=settings_env(settings),
                              stdout=output or log, stderr=subprocess.STDOUT, start_new_session=True)
    up.log_path = log_path  # type: ignore[attr-defined]
    sessions: list[int] = []
    up.sessions = sessions  # type: ignore[attr-defined]
    try:
        yield up
    finally:
        if up.poll() is None:
            up.terminate()
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        for sid in [up.pid, *sessions]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(sid, signal.SIGKILL)


def _started(up: subprocess.Popen[bytes], text: Callable[[], str], *names: str) -> dict[str, int]:
    """Wait until `shoal up` printed the pids of the children `names`; remember their sessions for the cleanup."""

    def printed() -> bool:
        assert up.poll() is None, text()
        return set(names) <= set(_pids(text()))

    wait_for(printed, 60, f"shoal up to start {', '.join(names)}")
    pids = _pids(text())
    up.sessions.extend(pids.values())  # type: ignore[attr-defined]
    return pids


def _beat_running(worker: int) -> Callable[[], bool]:
    """The worker's session holds its main process, its pool process (-c 1) and beat."""
    return lambda: len(_session(worker)) >= 3


@pytest.fixture
def up_settings(make_settings: Callable[..., Settings], redis_url: str, worker_catalog: str) -> Settings:
    """A catalog of the test's own (beat sweeps every shard of it), the test broker, no merge sweep."""
    return make_settings("local", database_url=worker_catalog, redis_url=redis_url, merge_interval_s=0)


def test_a_worker_killed_at_its_stop_timeout_takes_its_beat_along(up_settings: Settings) -> None:
    """SIGTERM to `shoal up --stop-timeout 0.1`: the worker does not finish its warm stop in time and is killed;
    its beat was left running, sending sweeps, forever."""
    with _shoal_up(up_settings, "--no-api", "--no-consumer", "-c", "1", "--stop-timeout", "0.1") as up:
        text = up.log_path.read_text  # type: ignore[attr-defined]
        worker = _started(up, text, "worker")["worker"]
        wait_for(_beat_running(worker), 60, "the worker's pool process and beat to start")
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0, text()
        assert "worker killed" in text(), text()  # what this test is about: the kill, not a warm stop
        wait_for(lambda: not _session(worker), 10, "no process of the worker's session to be left")


def test_a_dead_worker_under_no_restart_takes_its_beat_along(up_settings: Settings) -> None:
    """`shoal up --no-restart` whose worker's main process is SIGKILLed exits 1, as documented; its beat stayed."""
    with _shoal_up(up_settings, "--no-api", "--no-consumer", "-c", "1", "--no-restart") as up:
        text = up.log_path.read_text  # type: ignore[attr-defined]
        worker = _started(up, text, "worker")["worker"]
        wait_for(_beat_running(worker), 60, "the worker's pool process and beat to start")
        os.kill(worker, signal.SIGKILL)
        assert up.wait(60) == 1, text()
        assert "the worker exited unexpectedly with code -9" in text(), text()
        wait_for(lambda: not _session(worker), 10, "no process of the worker's session to be left")


def test_sighup_from_a_closed_terminal_stops_every_child(
    intake_settings: Callable[..., Settings], worker_catalog: str
) -> None:
    """The terminal of `shoal up` closes (its output then fails, and SIGHUP comes, maybe twice): every child is
    stopped and `shoal up` exits as on SIGTERM. SIGHUP killed `shoal up` alone, and the worker, beat, consumer and
    API went on running, the API answering."""
    settings = intake_settings(database_url=worker_catalog, merge_interval_s=0)
    port = free_port()
    terminal, tty = pty.openpty()
    try:
        with _shoal_up(settings, "--port", str(port), "-c", "1", "--stop-timeout", "20", output=tty) as up:
            os.close(tty)
            seen = bytearray()

            def text() -> str:
                with contextlib.suppress(OSError):  # nothing to read yet (EAGAIN), or the terminal closed
                    while chunk := os.read(terminal, 65536):
                        seen.extend(chunk)
                return seen.decode(errors="replace")

            os.set_blocking(terminal, False)
            pids = _started(up, text, "worker", "intake", "api")
            wait_for(lambda: "API ready at" in text(), 60, "shoal up to announce the API")
            wait_for(_beat_running(pids["worker"]), 60, "the worker's pool process and beat to start")
            os.close(terminal)  # the terminal is gone: what `shoal up` writes now fails
            terminal = -1
            up.send_signal(signal.SIGHUP)
            up.send_signal(signal.SIGHUP)  # the kernel's and the shell's: the second must not kill the children
            assert up.wait(60) == 0
            wait_for(lambda: not any(_session(pid) for pid in pids.values()), 10,
                     "no process of any child's session to be left")
    finally:
        if terminal >= 0:
            os.close(terminal)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_of_a_killed_up_stop_by_themselves(up_settings: Settings) -> None:
    """SIGKILL to `shoal up` (the OOM killer; a supervisor's kill -9) gives it no chance to stop its children: the
    kernel sends each SIGTERM, and the worker's warm stop takes its beat along."""
    port = free_port()
    with _shoal_up(up_settings, "--port", str(port), "--no-consumer", "-c", "1") as up:
        text = up.log_path.read_text  # type: ignore[attr-defined]
        pids = _started(up, text, "worker", "api")
        wait_for(lambda: "API ready at" in text(), 60, "shoal up to announce the API")
        wait_for(_beat_running(pids["worker"]), 60, "the worker's pool process and beat to start")
        up.kill()
        up.wait(10)
        wait_for(lambda: not any(_session(pid) for pid in pids.values()), 30,
                 "no process of any child's session to be left")


def test_up_refuses_one_port_for_the_api_and_flower(up_settings: Settings) -> None:
    """`--port P --flower --flower-port P` started everything (the catalog and broker are there); the API
    crash-looped on the port Flower held, and was announced ready (Flower answered there)."""
    settings = up_settings
    port = str(free_port())
    with _shoal_up(settings, "--port", port, "--flower", "--flower-port", port, "--no-consumer") as up:
        text = up.log_path.read_text  # type: ignore[attr-defined]
        wait_for(lambda: up.poll() is not None, 60, "shoal up to refuse")
        assert up.returncode == 1
        assert text().strip().splitlines() == [
            f"error: --port and --flower-port are both {port}: the HTTP API and Flower need ports of their own"
        ]
    assert not (settings.data_dir / "logs").exists()  # no child was started


def test_api_workers_refuse_a_port_another_api_with_workers_serves(make_settings: Callable[..., Settings]) -> None:
    """A second `shoal api --workers 2` on the port of a first one started too, its processes listening beside the
    first one's (SO_REUSEPORT), and the kernel split the connections between two deployments."""
    settings = make_settings("local")
    port = free_port()
    with api_process(settings, "--workers", "2", port=port):
        second = subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "api", "--port", str(port), "--workers", "2", "--no-access-log"],
            env=settings_env(settings), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        try:
            out, err = second.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(second.pid, signal.SIGTERM)
            out, err = second.communicate(timeout=30)
            pytest.fail(f"the second API started on port {port}: {out}{err}")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(second.pid, signal.SIGKILL)
        assert second.returncode == 1, out + err
        assert out == "", out  # no "Shoal API on ..." banner above the refusal: nothing started
        assert err.strip().splitlines() == [
            f"error: port {port} on 127.0.0.1 is in use: cannot start the HTTP API (choose another port or stop "
            "what uses it)"
        ], err


# -- a `shoal up` killed unannounced, children that cannot serve -------------------------------------------------
# SIGKILL to `shoal up` while its worker runs a long build: the worker got SIGTERM from the kernel (a warm stop) and
# went on until the build ended, minutes, its embedded beat scheduling beside the next `shoal up`'s; it now stops
# within `shoal up`'s stop timeout by itself, and the build is done by the next worker. An API child that cannot
# bind its port because another process holds it was announced "API ready" on every restart. Flower's Broker page
# answered 404 "'redis' broker is not supported" (the app names its own transport).

DIM = 64
POINTS = 80_000  # an HNSW build of these takes a minute or more here: far longer than the stop timeout below
STOP_TIMEOUT_S = 3
GONE_WITHIN_S = 40  # generous beside the stop timeout, and well short of the build (the old code waited for it)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_the_worker_of_a_killed_up_stops_within_its_stop_timeout(up_settings: Settings) -> None:
    """SIGKILL to `shoal up` mid-build: every process of its worker's session (main, pool, beat) is gone well
    before the build could have ended, the build unfinished; the next `shoal up`'s worker builds the shard."""
    up_settings = up_settings.model_copy(update={  # a dead worker's lease runs out soon, builds at full quality
        "lease_seconds": 9.0, "lease_heartbeat_s": 3.0, "sweep_interval_s": 3.0, "quick_build_backlog_seqs": 0})
    with Shoal(up_settings) as shoal:
        with _shoal_up(up_settings, "--no-api", "--no-consumer", "-c", "1",
                       "--stop-timeout", str(STOP_TIMEOUT_S)) as up:
            worker = _started(up, up.log_path.read_text, "worker")["worker"]  # type: ignore[attr-defined]
            wait_for(lambda: len(_session(worker)) >= 3, 60, "the worker's pool process and beat to start")
            index, head = queue_a_long_build(shoal, prefix="orphan", dim=DIM, points=POINTS, seed=11)
            wait_for(lambda: building(shoal, index), 120, "the worker to start the build")
            up.kill()
            up.wait(10)
            wait_for(lambda: not _session(worker), GONE_WITHIN_S,
                     "no process of the worker's session to be left (it waited for its build)")
            assert built(shoal, index) < head  # it was stopped mid-build: the premise of this test
        log = (up_settings.data_dir / "logs" / "worker.log").read_text()
        assert "the supervisor (pid" in log, log[-3000:]
        with _shoal_up(up_settings, "--no-api", "--no-consumer", "-c", "1") as up:
            _started(up, up.log_path.read_text, "worker")  # type: ignore[attr-defined]
            wait_for(lambda: built(shoal, index) == head, 600, "the next worker to build the shard")


def _hold(port: int, until: float) -> socket.socket:
    """A plain listening socket on 127.0.0.1:`port`, bound as soon as the port is free (before `until`)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    while True:
        try:
            s.bind(("127.0.0.1", port))
            break
        except OSError:
            if time.monotonic() > until:
                s.close()
                raise
            time.sleep(0.01)
    s.listen()
    return s


def test_an_api_that_cannot_bind_is_not_announced_ready(up_settings: Settings) -> None:
    """After start, the API child is killed and a plain socket takes its port: each restart fails to bind;
    `shoal up` said "API ready" for every one of them."""
    port = free_port()
    with _shoal_up(up_settings, "--no-consumer", "--port", str(port), "-c", "1") as up:
        text = up.log_path.read_text  # type: ignore[attr-defined]
        api = _started(up, text, "worker", "api")["api"]
        wait_for(lambda: text().count("API ready at") == 1, 60, "shoal up to announce the API")
        os.kill(api, signal.SIGKILL)
        squatter = _hold(port, time.monotonic() + 10)
        try:
            # The first restarts come after 1, 2 and 4 s: three of them fail here.
            wait_for(lambda: text().count("api restarted") >= 3 and text().count("exited unexpectedly") >= 4,
                     60, "three restarts of the API to fail")
            assert text().count("API ready at") == 1, text()
            assert "is in use" in text(), text()  # the failure is told (from the child's log)
        finally:
            squatter.close()
        wait_for(lambda: text().count("API ready at") == 2, 90, "the API to be announced once it serves again")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - a loopback URL of the test
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def test_flowers_broker_page_shows_the_queues(up_settings: Settings) -> None:
    """Flower's Broker page answered 404 "'redis' broker is not supported": Flower read the app's own transport
    name for the broker's scheme."""
    port = free_port()
    with _shoal_up(up_settings, "--no-api", "--no-consumer", "--flower", "--flower-port", str(port), "-c",
                   "1") as up:
        text = up.log_path.read_text  # type: ignore[attr-defined]
        _started(up, text, "worker", "flower")
        wait_for(lambda: "Flower ready at" in text(), 60, "shoal up to announce Flower")
        status, body = _get(f"http://127.0.0.1:{port}/broker")
        assert status == 200, body[-2000:]
        assert "not supported" not in body, body[-2000:]
        assert "redis://" in body  # the page, naming the broker by its URL
