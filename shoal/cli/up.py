"""`shoal up`: everything one machine needs, in the foreground: a worker with beat and task events, the
message consumer, the HTTP API and, on request, Flower, each a supervised child process.

Ctrl-C (or SIGTERM, or SIGHUP: the terminal closed) stops every child, the worker last and warmly, and with
each child every process of its session (each child leads one: a worker's beat and pool processes end with it).
A child that dies on its own is started again after a backoff (1 s, doubling up to 30 s; back to 1 s once a run
lasted a minute), and `shoal up` says so with the tail of its log; with --no-restart it stops the others instead
and ends with status 1.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Annotated

import typer

from shoal.cli.common import err, fail, load_settings, out
from shoal.cli.probes import check_broker
from shoal.cli.worker import (
    CELERY_APP,
    SCHEDULE_FILE,
    LogLevel,
    Pool,
    check_catalog,
    check_storage,
    describe_servers,
    kill_session,
    start_worker_process,
    stop_worker_process,
    worker_argv,
)
from shoal.errors import ConfigurationError
from shoal.servers.parent_death import parent_death_signal, supervised_env

LOG_DIR = "logs"  # under SHOAL_DATA_DIR: one file per child, appended to across runs
TAIL_LINES = 25  # lines of a dead child's log shown
POLL_S = 0.2
RESTART_FIRST_S = 1.0  # the first restart of a dead child waits this long; each quick death doubles it ...
RESTART_MAX_S = 30.0  # ... up to this
RESTART_STABLE_S = 60.0  # a run this long resets the backoff: the child was healthy, its death is news
RESTART_TAIL_LINES = 5  # lines of a dead child's log shown when it is restarted
READY_TIMEOUT_S = 2.0  # the longest a health request waits for a server's answer before it is asked again


@dataclass
class Child:
    """One supervised process: what it is, how to start it again, its log, how long a warm stop may take,
    where it answers, and its restarts."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    stop_timeout: float = 10.0
    ready_at: tuple[str, int, str] | None = None  # (host, port, path): it serves once GET path answers there
    ready_note: str = ""
    announced: bool = field(default=False)
    launch: Callable[[], subprocess.Popen[bytes]] | None = None  # starts it again (None: it is not restarted)
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0
    backoff: float = 0.0  # the wait before its next restart (0: none yet, or reset by a long healthy run)
    restart_at: float | None = None  # when the pending restart of a dead child is due


def _say(text: str) -> None:
    """A line on stdout, taken literally (URLs and paths may hold brackets rich would read as markup)."""
    out.print(text, markup=False, soft_wrap=True)


def _start(argv: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start `argv` in its own session (the terminal's Ctrl-C reaches only `shoal up`), output to `log_path`;
    it gets SIGTERM should `shoal up` die without stopping it (Linux)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - the child holds it; ours is closed below
    try:
        return subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=parent_death_signal(),
        )
    finally:
        log.close()


def _tell(text: str) -> None:
    """A line on stderr, taken literally, that cannot stop the stopping: once the terminal is gone (it hung up:
    EIO; the pipe's reader ended: rich's SystemExit) nothing more is said, and the children are stopped all the
    same."""
    try:
        err.print(text, markup=False, soft_wrap=True)
    except (OSError, SystemExit):
        err.quiet = True
        # What is left in stderr's buffer would fail again at exit: it goes nowhere instead.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())


def _mark(log_path: Path, name: str) -> None:
    """A line in the child's log where this run starts (the files are appended to across runs)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as f:
        f.write(f"\n--- shoal up: {name} starting at {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")


def _port_taken(host: str, port: int) -> bool:
    """Whether binding `host`:`port` fails, as the child's own bind would; the address family is the host's
    (an IPv6 literal such as ::1 or :: needs an IPv6 socket). ConfigurationError when the host does not
    resolve."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ConfigurationError(f"cannot listen on {host!r}: {exc.strerror or exc}") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError:
            return True
    return False


def _answers(host: str, port: int, path: str) -> bool:
    """Whether an HTTP server answers GET `path` at `host`:`port` (any status) within READY_TIMEOUT_S. A
    connection alone proves nothing: a process that holds the port (the child failed to bind it) accepts it."""
    connect_to = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)  # noqa: S104
    conn = http.client.HTTPConnection(connect_to, port, timeout=READY_TIMEOUT_S)
    try:
        conn.request("GET", path)
        conn.getresponse().read()
        return True
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def _serves(child: Child) -> bool:
    """Whether the child serves where it should: its health path answers there and the child still runs after
    (what answered was not another server on a port the child, now exiting, failed to bind)."""
    assert child.ready_at is not None
    return child.proc.poll() is None and _answers(*child.ready_at) and child.proc.poll() is None


def log_tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of a log file ("" when it is missing)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines)).rstrip()
    except OSError:
        return ""


def _stop_all(children: list[Child]) -> None:
    """Stop the children in reverse start order (the worker, started first, last: its running tasks finish).

    A second Ctrl-C or SIGTERM while stopping kills whatever is still running. Each child's session goes with
    it (`stop_worker_process`): nothing a child started outlives `shoal up`.
    """
    pending = list(reversed(children))
    try:
        while pending:
            child = pending[0]
            how = stop_worker_process(child.proc, child.stop_timeout)  # type: ignore[arg-type]
            pending.pop(0)
            _tell(f"{child.name} {how}")
    except KeyboardInterrupt:
        for child in pending:
            kill_session(child.proc)  # the child and everything it started (a worker's beat and pool)
            child.proc.wait()
            _tell(f"{child.name} killed")


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
    restart: Annotated[
        bool,
        typer.Option("--restart/--no-restart", help="Start a child that died on its own again, with backoff "
                     "(--no-restart: stop everything and exit 1 instead)."),
    ] = True,
    allow_anonymous_writes: Annotated[
        bool,
        typer.Option(
            "--allow-anonymous-writes",
            help="Let the HTTP API serve uploads and creates without an API key on an address beyond loopback "
            "(refused otherwise; also SHOAL_ALLOW_ANONYMOUS_WRITES).",
        ),
    ] = False,
) -> None:
    """Run Shoal on this machine in the foreground: a worker (with beat and task events), the message
    consumer, the HTTP API and, with --flower, Flower; each a child process logging to SHOAL_DATA_DIR/logs/.

    Beat sweeps for lagging shards every SHOAL_SWEEP_INTERVAL_S and for due merges every
    SHOAL_MERGE_INTERVAL_S (0: never). Run `shoal up` on one machine only (beat must run once per
    deployment); add workers elsewhere with `shoal worker --no-beat`.

    Ctrl-C, SIGTERM or SIGHUP (the terminal closed) stops everything (the worker last, letting running tasks
    finish; press Ctrl-C again to kill). A child that dies on its own is started again after a backoff (1 s
    doubling to 30 s), and said so; with --no-restart the others are stopped instead and `shoal up` exits with
    status 1.
    """
    from shoal.api.security import check_exposure
    from shoal.searcher.placement import Placement
    from shoal.servers.broker import broker_url

    if api and flower and port == flower_port:
        # Both would bind it: one would fail and be restarted forever while the other was announced ready.
        fail(f"--port and --flower-port are both {port}: the HTTP API and Flower need ports of their own")
    settings = load_settings()
    if allow_anonymous_writes:
        settings = settings.model_copy(update={"allow_anonymous_writes": True})
    if api:
        # The API child would refuse the exposure (or a bad placement) itself, and be restarted forever: refuse
        # it here, before anything starts, with the same message `shoal api` gives.
        check_exposure(settings, host)
        Placement.load(settings.placement_file, settings.node)
    # Every child opens the storage: a broken one would fail each task, message and request instead.
    check_storage(settings)
    for what, wanted, h, p in (("the HTTP API", api, host, port), ("Flower", flower, "127.0.0.1", flower_port)):
        if wanted and _port_taken(h, p):
            fail(f"port {p} on {h} is in use: cannot start {what} (choose another port or stop what uses it)")
    check_catalog(settings)  # reachable and migrated (the embedded Postgres started) before anything starts
    broker = broker_url(settings)  # the embedded Valkey started, if it is the broker; the children find it
    check_broker(broker)

    logs = settings.data_dir / LOG_DIR
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # children's logs are complete up to the moment they die
    for line in describe_servers(settings, broker):
        _say(line)
    _say(f"logs:    {logs}/")

    children: list[Child] = []
    died: Child | None = None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    # SIGTERM ends `shoal up` the way Ctrl-C does (the children get theirs from us, in order), and so does SIGHUP:
    # its terminal closed, and the children, in sessions of their own, would go on without it.
    with contextlib.suppress(ValueError):  # ValueError: not the main thread (then only Ctrl-C stops it)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        if previous[signal.SIGHUP] is not signal.SIG_IGN:  # under nohup it stays ignored, as asked
            signal.signal(signal.SIGHUP, _hung_up)
    try:
        try:
            schedule = settings.data_dir / SCHEDULE_FILE
            argv = worker_argv(
                beat=True, schedule=schedule, concurrency=concurrency, loglevel=loglevel.value,
                pool=pool.value if pool else None, events=True,
            )
            # The worker bounds its own stop by stop_timeout should `shoal up` die (SIGKILL) and not enforce it.
            worker_env = supervised_env(env, stop_timeout)
            children.append(_child(
                "worker", logs,
                lambda: start_worker_process(argv, logs / "worker.log", worker_env, parent_death_signal()),
                stop_timeout=stop_timeout,
            ))
            merges = (f"merges every {settings.merge_interval_s:g} s" if settings.merge_interval_s > 0
                      else "no merge sweep (SHOAL_MERGE_INTERVAL_S=0)")
            _say(f"worker:  celery -A {CELERY_APP} worker --beat --task-events (pid {children[-1].proc.pid}); "
                 f"beat sweeps lagging shards every {settings.sweep_interval_s:g} s, {merges}")
            if consumer:
                children.append(_child("consumer", logs, _consumer_launch(logs / "consumer.log", env)))
                _say(f"intake:  shoal consume (pid {children[-1].proc.pid}), group {settings.intake_group!r} on "
                     f"exchange {settings.intake_exchange!r}")
            if api:
                api_argv = [sys.executable, "-m", "shoal", "api", "--host", host, "--port", str(port),
                            *(["--allow-anonymous-writes"] if allow_anonymous_writes else [])]
                shown = f"[{host}]" if ":" in host else host
                url = f"http://{shown}:{port}"
                children.append(_child("api", logs, lambda: _start(api_argv, logs / "api.log", env),
                                       ready_at=(host, port, "/healthz"), ready_note=f"API ready at {url}"))
                _say(f"api:     {url} (OpenAPI at {url}/docs, metrics at {url}/metrics) "
                     f"(pid {children[-1].proc.pid})")
            if flower:
                flower_argv = [sys.executable, "-m", "shoal", "flower", f"--port={flower_port}",
                               "--address=127.0.0.1"]
                url = f"http://127.0.0.1:{flower_port}"
                children.append(_child("flower", logs, lambda: _start(flower_argv, logs / "flower.log", env),
                                       ready_at=("127.0.0.1", flower_port, "/healthcheck"),
                                       ready_note=f"Flower ready at {url}"))
                _say(f"flower:  {url} (tasks, their arguments and states; workers) (pid {children[-1].proc.pid})")
            err.print("Ctrl-C stops everything" + ("; a child that dies is restarted" if restart else ""))
            died = _supervise(children, restart=restart)
        except KeyboardInterrupt:
            _tell("stopping ...")
        finally:
            # Whatever ended the run (Ctrl-C, SIGTERM, a dead child, a failed start), no child outlives it.
            _stop_all([c for c in children if c is not died])
    finally:
        with contextlib.suppress(ValueError):
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if died is not None:
        _tell(f"last lines of {died.log_path}:")
        _tell(log_tail(died.log_path) or "(empty)")
        raise typer.Exit(1)


def _consumer_launch(log_path: Path, env: dict[str, str]) -> Callable[[], subprocess.Popen[bytes]]:
    """How to start (and restart) the consumer: under an id of `shoal up`'s choosing, and, from the second start
    on, naming the one before it, which `shoal up` saw exit (its session killed with it): the new one frees the
    group's lead at once rather than standing by until the dead one's lease (SHOAL_INTAKE_VISIBILITY_TIMEOUT_S, 300
    s by default) runs out, intake stopped meanwhile."""
    from shoal.intake.delivery import new_consumer_id

    last: list[str] = []

    def launch() -> subprocess.Popen[bytes]:
        consumer_id = new_consumer_id()
        argv = [sys.executable, "-m", "shoal", "consume", "--consumer-id", consumer_id]
        if last:
            argv += ["--replaces", last[-1]]
        proc = _start(argv, log_path, env)
        last[:] = [consumer_id]
        return proc

    return launch


def _hung_up(signum: int, frame: object) -> None:
    """SIGHUP: stop as on SIGTERM. A closing terminal may send it more than once (the kernel and the shell):
    the repeats are ignored, so that they do not kill the children a first one is stopping in order."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    raise KeyboardInterrupt


def _child(name: str, logs: Path, launch: Callable[[], subprocess.Popen[bytes]], **options: object) -> Child:
    """Start a child by `launch` (marking its log first) and return it, ready to be restarted the same way."""
    _mark(logs / f"{name}.log", name)
    return Child(name, launch(), logs / f"{name}.log", launch=launch, **options)  # type: ignore[arg-type]


def _supervise(children: list[Child], *, restart: bool = True) -> Child:
    """Watch the children, announce each server once it answers, and start a child that died again after
    its backoff, saying so. Returns only when a child died and is not to be restarted (`restart` False)."""
    while True:
        now = time.monotonic()
        for child in children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    _relaunch(child)
                continue
            code = child.proc.poll()
            if code is not None:
                if not restart or child.launch is None:
                    kill_session(child.proc)  # what it left running (a worker's beat) goes with it
                    err.print(f"error: the {child.name} exited unexpectedly with code {code}; stopping the others")
                    return child
                _schedule_restart(child, code, now)
                continue
            if child.ready_at and not child.announced and _serves(child):
                child.announced = True
                _say(child.ready_note)
        time.sleep(POLL_S)


def _schedule_restart(child: Child, code: int, now: float) -> None:
    """Plan the restart of a child that died: after its backoff, which doubles with each death that came soon
    after a start and starts over after a long healthy run."""
    # What the dead child left running in its session (a worker's pool processes and beat, should it have ended
    # without stopping them) goes too: the restarted child starts its own.
    kill_session(child.proc)
    healthy = now - child.started_at >= RESTART_STABLE_S
    child.backoff = RESTART_FIRST_S if healthy or not child.backoff else min(child.backoff * 2, RESTART_MAX_S)
    child.restart_at = now + child.backoff
    err.print(f"error: the {child.name} exited unexpectedly with code {code}; restarting it in "
              f"{child.backoff:g} s (restart {child.restarts + 1}); last lines of {child.log_path}:",
              markup=False, soft_wrap=True)
    err.print(log_tail(child.log_path, RESTART_TAIL_LINES) or "(empty)", markup=False, soft_wrap=True)


def _relaunch(child: Child) -> None:
    """Start a dead child again, as it was started first."""
    assert child.launch is not None
    _mark(child.log_path, f"{child.name} (restart {child.restarts + 1})")
    child.proc = child.launch()
    child.started_at = time.monotonic()
    child.restart_at = None
    child.restarts += 1
    child.announced = False  # say again when it answers
    err.print(f"{child.name} restarted (pid {child.proc.pid}, restart {child.restarts})")
