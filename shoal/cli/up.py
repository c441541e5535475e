"""`shoal up`: everything one machine needs, in the foreground: a worker with beat and task events, the
message consumer, the HTTP API and, on request, Flower, each a supervised child process.

Ctrl-C (or SIGTERM) stops every child, the worker last and warmly; a child that dies on its own stops the
others and ends `shoal up` with status 1, naming the child and printing the tail of its log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Annotated

import typer

from shoal.cli.common import err, fail, load_settings, out
from shoal.cli.probes import redis_status
from shoal.cli.worker import (
    CELERY_APP,
    SCHEDULE_FILE,
    LogLevel,
    Pool,
    _check_catalog,
    describe_servers,
    start_worker_process,
    stop_worker_process,
    worker_argv,
)
from shoal.config.settings import mask_url

LOG_DIR = "logs"  # under SHOAL_DATA_DIR: one file per child, appended to across runs
TAIL_LINES = 25  # lines of a dead child's log shown
POLL_S = 0.2


@dataclass
class Child:
    """One supervised process: what it is, its log, how long a warm stop may take, where it answers."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    stop_timeout: float = 10.0
    ready_at: tuple[str, int] | None = None  # (host, port) that accepts connections once it serves
    ready_note: str = ""
    announced: bool = field(default=False)


def _say(text: str) -> None:
    """A line on stdout, taken literally (URLs and paths may hold brackets rich would read as markup)."""
    out.print(text, markup=False, soft_wrap=True)


def _start(argv: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start `argv` in its own session (the terminal's Ctrl-C reaches only `shoal up`), output to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - the child holds it; ours is closed below
    try:
        return subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    finally:
        log.close()


def _mark(log_path: Path, name: str) -> None:
    """A line in the child's log where this run starts (the files are appended to across runs)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as f:
        f.write(f"\n--- shoal up: {name} starting at {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")


def _port_taken(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _answers(host: str, port: int) -> bool:
    connect_to = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)  # noqa: S104
    try:
        with socket.create_connection((connect_to, port), timeout=0.2):
            return True
    except OSError:
        return False


def log_tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of a log file ("" when it is missing)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines)).rstrip()
    except OSError:
        return ""


def _stop_all(children: list[Child]) -> None:
    """Stop the children in reverse start order (the worker, started first, last: its running tasks finish).

    A second Ctrl-C or SIGTERM while stopping kills whatever is still running.
    """
    pending = list(reversed(children))
    try:
        while pending:
            child = pending[0]
            how = stop_worker_process(child.proc, child.stop_timeout)  # type: ignore[arg-type]
            pending.pop(0)
            err.print(f"{child.name} {how}")
    except KeyboardInterrupt:
        for child in pending:
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
            err.print(f"{child.name} killed")


def up(
    api: Annotated[bool, typer.Option("--api/--no-api", help="Serve the HTTP API.")] = True,
    host: Annotated[str, typer.Option(help="Address the HTTP API listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port of the HTTP API.")] = 8080,
    consumer: Annotated[
        bool, typer.Option("--consumer/--no-consumer", help="Run the message consumer (`shoal consume`).")
    ] = True,
    flower: Annotated[
        bool, typer.Option("--flower/--no-flower", help="Run Flower, the Celery monitor (on 127.0.0.1).")
    ] = False,
    flower_port: Annotated[int, typer.Option(min=1, max=65535, help="Port of Flower.")] = 5555,
    concurrency: Annotated[
        int | None,
        typer.Option("--concurrency", "-c", min=1, help="Tasks the worker runs at once (default: the number of CPUs)."),
    ] = None,
    pool: Annotated[
        Pool | None, typer.Option("--pool", "-P", help="The worker's execution pool (default: Celery's, prefork).")
    ] = None,
    loglevel: Annotated[LogLevel, typer.Option("--loglevel", "-l", help="Log level of the worker.")] = LogLevel.INFO,
    stop_timeout: Annotated[
        float,
        typer.Option(min=0.1, help="Seconds the worker may take to finish its running tasks on Ctrl-C before it "
                     "is killed."),
    ] = 60.0,
) -> None:
    """Run Shoal on this machine in the foreground: a worker (with beat and task events), the message
    consumer, the HTTP API and, with --flower, Flower; each a child process logging to SHOAL_DATA_DIR/logs/.

    Beat sweeps for lagging shards every SHOAL_SWEEP_INTERVAL_S and for due merges every
    SHOAL_MERGE_INTERVAL_S (0: never). Run `shoal up` on one machine only (beat must run once per
    deployment); add workers elsewhere with `shoal worker --no-beat`.

    Ctrl-C or SIGTERM stops everything (the worker last, letting running tasks finish; press it again to
    kill). If a child dies on its own, the others are stopped and `shoal up` exits with status 1.
    """
    from shoal.servers.broker import broker_url

    settings = load_settings()
    for what, wanted, h, p in (("the HTTP API", api, host, port), ("Flower", flower, "127.0.0.1", flower_port)):
        if wanted and _port_taken(h, p):
            fail(f"port {p} on {h} is in use: cannot start {what} (choose another port or stop what uses it)")
    _check_catalog(settings)  # reachable and migrated (the embedded Postgres started) before anything starts
    broker = broker_url(settings)  # the embedded Valkey started, if it is the broker; the children find it
    reachable = redis_status(broker)
    if reachable != "reachable":
        fail(f"cannot reach the broker at {mask_url(broker)}: {reachable.removeprefix('unreachable: ')}")

    logs = settings.data_dir / LOG_DIR
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # children's logs are complete up to the moment they die
    for line in describe_servers(settings, broker):
        _say(line)
    _say(f"logs:    {logs}/")

    children: list[Child] = []
    died: Child | None = None
    previous_term = signal.getsignal(signal.SIGTERM)
    # SIGTERM ends `shoal up` the way Ctrl-C does (the children get theirs from us, in order).
    with contextlib.suppress(ValueError):  # ValueError: not the main thread (then only Ctrl-C stops it)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        try:
            schedule = settings.data_dir / SCHEDULE_FILE
            argv = worker_argv(
                beat=True, schedule=schedule, concurrency=concurrency, loglevel=loglevel.value,
                pool=pool.value if pool else None, events=True,
            )
            _mark(logs / "worker.log", "worker")
            children.append(Child("worker", start_worker_process(argv, logs / "worker.log", env),
                                  logs / "worker.log", stop_timeout))
            merges = (f"merges every {settings.merge_interval_s:g} s" if settings.merge_interval_s > 0
                      else "no merge sweep (SHOAL_MERGE_INTERVAL_S=0)")
            _say(f"worker:  celery -A {CELERY_APP} worker --beat --task-events (pid {children[-1].proc.pid}); "
                 f"beat sweeps lagging shards every {settings.sweep_interval_s:g} s, {merges}")
            if consumer:
                _mark(logs / "consumer.log", "consumer")
                proc = _start([sys.executable, "-m", "shoal", "consume"], logs / "consumer.log", env)
                children.append(Child("consumer", proc, logs / "consumer.log"))
                _say(f"intake:  shoal consume (pid {proc.pid}), group {settings.intake_group!r} on exchange "
                     f"{settings.intake_exchange!r}")
            if api:
                _mark(logs / "api.log", "api")
                argv = [sys.executable, "-m", "shoal", "api", "--host", host, "--port", str(port)]
                proc = _start(argv, logs / "api.log", env)
                shown = f"[{host}]" if ":" in host else host
                url = f"http://{shown}:{port}"
                children.append(Child("api", proc, logs / "api.log", ready_at=(host, port),
                                      ready_note=f"API ready at {url}"))
                _say(f"api:     {url} (OpenAPI at {url}/docs, metrics at {url}/metrics) (pid {proc.pid})")
            if flower:
                _mark(logs / "flower.log", "flower")
                argv = [sys.executable, "-m", "celery", "-A", CELERY_APP, "flower", f"--port={flower_port}",
                        "--address=127.0.0.1"]
                proc = _start(argv, logs / "flower.log", env)
                url = f"http://127.0.0.1:{flower_port}"
                children.append(Child("flower", proc, logs / "flower.log", ready_at=("127.0.0.1", flower_port),
                                      ready_note=f"Flower ready at {url}"))
                _say(f"flower:  {url} (tasks, their arguments and states; workers) (pid {proc.pid})")
            err.print("Ctrl-C stops everything")
            died = _supervise(children)
        except KeyboardInterrupt:
            err.print("stopping ...")
        finally:
            # Whatever ended the run (Ctrl-C, SIGTERM, a dead child, a failed start), no child outlives it.
            _stop_all([c for c in children if c is not died])
    finally:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, previous_term)
    if died is not None:
        err.print(f"last lines of {died.log_path}:", markup=False, soft_wrap=True)
        err.print(log_tail(died.log_path) or "(empty)", markup=False, soft_wrap=True)
        raise typer.Exit(1)


def _supervise(children: list[Child]) -> Child:
    """Watch the children until one exits and return it; announce each server once it answers."""
    while True:
        for child in children:
            code = child.proc.poll()
            if code is not None:
                err.print(f"error: the {child.name} exited unexpectedly with code {code}; stopping the others")
                return child
            if child.ready_at and not child.announced and _answers(*child.ready_at):
                child.announced = True
                _say(child.ready_note)
        time.sleep(POLL_S)
