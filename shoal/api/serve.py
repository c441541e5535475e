"""Serving the API under uvicorn: uvloop and httptools when installed (uvicorn[standard]), TCP_NODELAY on every
accepted connection, and any number of worker processes, each with a listening socket of its own.

Why TCP_NODELAY by hand: with `--workers N` uvicorn binds the listening socket itself, without naming the
protocol, and asyncio's own loop then never sets TCP_NODELAY on accepted connections; every keep-alive request
after the first waits for a delayed ACK (~40 ms on Linux). uvloop sets it, but the fix must not depend on
which loop is installed.
"""

from __future__ import annotations

import asyncio
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

if importlib.util.find_spec("httptools") is not None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Http
else:  # pragma: no cover - uvicorn[standard] brings httptools on every platform Shoal supports
    from uvicorn.protocols.http.h11_impl import H11Protocol as _Http  # type: ignore[assignment]

APP_FACTORY = "shoal.api.app:create_app"
log = logging.getLogger(__name__)


class CoalescingTransport:
    """A transport whose writes of one event-loop iteration leave in one send.

    uvicorn writes a response's head and its body in two calls, and each is a send syscall at once: on
    loopback, a small search answer cost two sends and two wake-ups of the client (15% of the API's GIL time
    in bench/api.py). Writes are gathered and sent together at the end of the iteration they were made in, so
    nothing waits for more than that; everything else is the real transport's.
    """

    __slots__ = ("_loop", "_pending", "_scheduled", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._scheduled = False

    def write(self, data: bytes) -> None:
        """Queue `data`; it is sent, with whatever else this iteration writes, once the iteration ends."""
        self._pending.append(data)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def writelines(self, lines: Any) -> None:
        """Queue several buffers, as `write` does."""
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Send what is queued now."""
        self._scheduled = False
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def get_write_buffer_size(self) -> int:
        """Bytes not yet sent: queued here and buffered by the real transport."""
        return sum(map(len, self._pending)) + self._transport.get_write_buffer_size()

    def close(self) -> None:
        """Send what is queued, then close."""
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        """Drop what is queued and close at once."""
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class NoDelayHttpProtocol(_Http):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol with TCP_NODELAY set on the connection's socket, and a response's writes sent
    in one go (CoalescingTransport)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # a socket that is already gone: the protocol will see it closed
                pass
        super().connection_made(transport)
        # Responses write through the wrapper; flow control and the connection's own calls reach the real
        # transport through it unchanged.
        self.transport = CoalescingTransport(transport, self.loop)


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
