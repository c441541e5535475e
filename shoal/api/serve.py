"""Serving the API under uvicorn: uvloop and httptools when installed (uvicorn[standard]), Shoal's HTTP protocol
(shoal.api.http_protocol) and any number of worker processes, each with a listening socket of its own."""

from __future__ import annotations

import collections
import errno
import importlib.util
import logging
import multiprocessing
import multiprocessing.process
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from typing import Any

import uvicorn
from prometheus_client import multiprocess

from shoal.api.http_protocol import NoDelayHttpProtocol
from shoal.api.metrics import MULTIPROC_DIR
from shoal.errors import ConfigurationError
from shoal.servers.parent_death import die_with_parent

APP_FACTORY = "shoal.api.app:create_app"
# Seconds an idle client connection is kept open (uvicorn's timeout_keep_alive, 5 s by default): well above what a
# node fanning searches out keeps its idle connections to the others (fanout.FANOUT_KEEPALIVE_S), so it never
# sends a part on a connection this process is closing at that moment (reset: the part's shards missing, a 503).
NODE_KEEPALIVE_S = 15
log = logging.getLogger(__name__)


def server_options() -> dict[str, Any]:
    """The uvicorn options every Shoal API process uses."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return {"http": NoDelayHttpProtocol, "loop": loop, "log_level": "info", "timeout_keep_alive": NODE_KEEPALIVE_S}


def serve(app: Any, *, host: str, port: int, workers: int = 1, access_log: bool = True) -> None:
    """Serve `app` (with workers > 1: the app factory, once per process) until SIGINT or SIGTERM. Exits with
    status 3 (SystemExit), as uvicorn does when it cannot start, when the workers kept exiting (a crash loop).
    ConfigurationError in one line before anything starts when the port is in use, however many workers."""
    options = server_options() | {"host": host, "port": port, "access_log": access_log}
    if workers > 1:
        if not _Supervisor(workers, options).run():
            raise SystemExit(3)
    else:
        # As with workers: uvicorn alone would log its bind error over several lines and exit 3.
        check_port_free(host, port)
        uvicorn.run(app, **options)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket of this process on host:port, shared with its siblings by SO_REUSEPORT."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def check_port_free(host: str, port: int) -> None:
    """ConfigurationError in one line when host:port is taken, by anyone: probed without SO_REUSEPORT, which
    would bind beside any other SO_REUSEPORT listener of this user (another `shoal api --workers`, which would
    then get half the connections) and fail only on a listener without it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigurationError(f"port {port} on {host} is in use: cannot start the HTTP API (choose "
                                         "another port or stop what uses it)") from None
            raise ConfigurationError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _worker(options: dict[str, Any], supervisor: int) -> None:
    """One API worker process: its own socket on the shared port, the app made by the factory. It ends (SIGTERM:
    a graceful stop) when the supervisor, pid `supervisor`, dies: a supervisor killed with SIGKILL left its
    workers serving the port, and a restart was refused as the port was in use."""
    die_with_parent(supervisor)
    sock = _listen(options["host"], options["port"])
    config = uvicorn.Config(APP_FACTORY, factory=True, **options)
    uvicorn.Server(config).run(sockets=[sock])


class _Supervisor:
    """N API worker processes on one port, each accepting on a socket of its own (SO_REUSEPORT), so the
    kernel spreads connections over them by their addresses. uvicorn's own `--workers` shares one socket,
    and whichever process wakes first takes a whole burst of connections: bench/api.py saw all 8 of its
    connections land on one of 2 workers. A worker that dies is started again; SIGINT or SIGTERM stops all.

    The workers share their counters and histograms through a private directory of prometheus_client's
    multiprocess mode (shoal.api.metrics), made here and removed when they have all stopped."""

    def __init__(self, workers: int, options: dict[str, Any]) -> None:
        self.workers = workers
        self.options = options
        self.stop = threading.Event()
        self.context = multiprocessing.get_context("spawn")  # a fresh interpreter: no state forked from here

    def _start(self) -> multiprocessing.process.BaseProcess:
        process = self.context.Process(target=_worker, args=(self.options, os.getpid()), name="shoal-api-worker")
        process.start()
        return process

    def run(self) -> bool:
        """Start the workers and keep them running until told to stop; False when they were stopped because
        they kept exiting (a crash loop), True when SIGINT or SIGTERM stopped them."""
        # A port in use fails here, once, clearly; then the workers bind it side by side.
        check_port_free(self.options["host"], self.options["port"])
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stop.set())
        # Set before any worker starts: a spawned worker inherits it, and prometheus_client reads it on import.
        metrics_dir = tempfile.mkdtemp(prefix="shoal-api-metrics-")
        previous = os.environ.get(MULTIPROC_DIR)
        os.environ[MULTIPROC_DIR] = metrics_dir
        try:
            return self._supervise(metrics_dir)
        finally:
            if previous is None:
                os.environ.pop(MULTIPROC_DIR, None)
            else:
                os.environ[MULTIPROC_DIR] = previous
            shutil.rmtree(metrics_dir, ignore_errors=True)

    def _supervise(self, metrics_dir: str) -> bool:
        """Run the workers, restarting one that exits, until told to stop or a crash loop (then False)."""
        crash_loop = False
        processes = [self._start() for _ in range(self.workers)]
        log.info("started %d API worker processes on port %s", self.workers, self.options["port"])
        deaths: collections.deque[float] = collections.deque()
        try:
            while not self.stop.wait(0.5):
                for i, process in enumerate(processes):
                    if process.is_alive():
                        continue
                    log.warning("API worker process %s exited (code %s); starting another", process.pid,
                                process.exitcode)
                    if process.pid is not None:
                        multiprocess.mark_process_dead(process.pid, metrics_dir)
                    now = time.monotonic()
                    deaths.append(now)
                    while deaths and now - deaths[0] > 60:
                        deaths.popleft()
                    if len(deaths) > 3 * self.workers:  # a crash loop (bad settings, no catalog): say so, stop
                        log.error("API worker processes keep exiting; stopping")
                        crash_loop = True
                        self.stop.set()
                        break
                    processes[i] = self._start()
        finally:
            for process in processes:
                if process.is_alive():
                    process.terminate()
            for process in processes:
                process.join(15)
                if process.is_alive():
                    process.kill()
                    process.join(5)
        return not crash_loop
