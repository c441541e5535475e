"""Serving the API under uvicorn: uvloop and httptools when installed (uvicorn[standard]), Shoal's HTTP protocol
(shoal.api.http_protocol) and any number of worker processes, each with a listening socket of its own."""

from __future__ import annotations

import collections
import importlib.util
import logging
import multiprocessing
import multiprocessing.process
import signal
import socket
import threading
import time
from typing import Any

import uvicorn

from shoal.api.http_protocol import NoDelayHttpProtocol

APP_FACTORY = "shoal.api.app:create_app"
log = logging.getLogger(__name__)


def server_options() -> dict[str, Any]:
    """The uvicorn options every Shoal API process uses."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return {"http": NoDelayHttpProtocol, "loop": loop, "log_level": "info"}


def serve(app: Any, *, host: str, port: int, workers: int = 1, access_log: bool = True) -> None:
    """Serve `app` (with workers > 1: the app factory, once per process) until SIGINT or SIGTERM."""
    options = server_options() | {"host": host, "port": port, "access_log": access_log}
    if workers > 1:
        _Supervisor(workers, options).run()
    else:
        uvicorn.run(app, **options)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket of this process on host:port, shared with its siblings by SO_REUSEPORT."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _worker(options: dict[str, Any]) -> None:
    """One API worker process: its own socket on the shared port, the app made by the factory."""
    sock = _listen(options["host"], options["port"])
    config = uvicorn.Config(APP_FACTORY, factory=True, **options)
    uvicorn.Server(config).run(sockets=[sock])


class _Supervisor:
    """N API worker processes on one port, each accepting on a socket of its own (SO_REUSEPORT), so the
    kernel spreads connections over them by their addresses. uvicorn's own `--workers` shares one socket,
    and whichever process wakes first takes a whole burst of connections: bench/api.py saw all 8 of its
    connections land on one of 2 workers. A worker that dies is started again; SIGINT or SIGTERM stops all."""

    def __init__(self, workers: int, options: dict[str, Any]) -> None:
        self.workers = workers
        self.options = options
        self.stop = threading.Event()
        self.context = multiprocessing.get_context("spawn")  # a fresh interpreter: no state forked from here

    def _start(self) -> multiprocessing.process.BaseProcess:
        process = self.context.Process(target=_worker, args=(self.options,), name="shoal-api-worker")
        process.start()
        return process

    def run(self) -> None:
        """Start the workers and keep them running until told to stop."""
        _listen(self.options["host"], self.options["port"]).close()  # a port in use fails here, once, clearly
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stop.set())
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
                    now = time.monotonic()
                    deaths.append(now)
                    while deaths and now - deaths[0] > 60:
                        deaths.popleft()
                    if len(deaths) > 3 * self.workers:  # a crash loop (bad settings, no catalog): say so, stop
                        log.error("API worker processes keep exiting; stopping")
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
