"""`shoal worker`: a Celery worker of the Shoal app in the foreground, with beat embedded by default.

Also the helpers that start such a worker as a child process (`shoal demo` does) and stop it again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import IO, Annotated

import typer

from shoal.cli.common import err, load_settings, out
from shoal.cli.probes import check_broker
from shoal.config.settings import Settings, mask_url

CELERY_APP = "shoal.workers.app"
SCHEDULE_FILE = "celerybeat-schedule"  # under SHOAL_DATA_DIR; beat's record of when each entry last ran


class LogLevel(StrEnum):
    """Celery's log levels."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


class Pool(StrEnum):
    """Celery's execution pools that suit Shoal's CPU-bound builds."""

    PREFORK = "prefork"
    SOLO = "solo"
    THREADS = "threads"


def worker_argv(
    *,
    beat: bool,
    schedule: Path | None = None,
    concurrency: int | None = None,
    loglevel: str = "info",
    pool: str | None = None,
    hostname: str | None = None,
    events: bool = False,
) -> list[str]:
    """The arguments of `celery -A shoal.workers.app ARGS` (from `worker` on) for these choices.

    Workers never take part in Celery's gossip or mingle: Shoal elects nothing among workers nor revokes tasks
    (leases in the catalog coordinate builds), and on a Redis broker that comes back after a restart, gossip's
    restart logs a traceback in every worker (and mingle slows each start).
    """
    argv = ["worker", "--loglevel", loglevel.upper()]
    if pool:
        argv += ["--pool", pool]
    if concurrency:
        argv += ["--concurrency", str(concurrency)]
    if hostname:
        argv += ["--hostname", hostname]
    if events:
        argv.append("--task-events")
    argv += ["--without-gossip", "--without-mingle"]
    if beat:
        argv.append("--beat")
        if schedule is not None:
            argv += ["--schedule", str(schedule)]
    return argv


def start_worker_process(
    argv: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.Popen[bytes]:
    """Start `python -m celery -A shoal.workers.app ARGV` as a child leading its own session (Ctrl-C at the
    terminal does not reach it; `stop_worker_process` ends the whole session), stdout and stderr appended to
    `log_path`; `preexec_fn` runs in the child before exec (`shoal up`'s signal on its own death)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - the child holds it; ours is closed below
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", CELERY_APP, *argv],
            env=env if env is not None else dict(os.environ),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
    finally:
        log.close()


def kill_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL every process left in the session `proc` leads (all children here are started with
    start_new_session): a worker's beat and pool processes outlive a worker that was killed or died, and an
    orphaned beat would go on scheduling sweeps beside the next one."""
    if proc.pid <= 0:  # killpg(0) would be our own process group
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def stop_worker_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> str:
    """Stop a child leading its own session (a worker, from `start_worker_process`): SIGTERM (Celery's warm
    shutdown), SIGKILL to its whole session if it has not exited in `timeout` s. Whatever is left in its
    session once it ended (or if it had ended already) is killed too: no process of it outlives this call.

    Returns how it ended: "stopped", "killed" or "had exited".
    """
    if proc.poll() is not None:
        kill_session(proc)
        return "had exited"
    proc.terminate()
    try:
        proc.wait(timeout)
        how = "stopped"
    except subprocess.TimeoutExpired:
        kill_session(proc)
        proc.wait(timeout)
        how = "killed"
    kill_session(proc)  # a warm stop ends its beat and pool first; anything still there is a straggler
    return how


def describe_servers(settings: Settings, broker: str) -> list[str]:
    """Where the worker's catalog, broker and storage are, one line each (passwords masked)."""
    catalog = mask_url(settings.database_url) if settings.database_url else f"embedded Postgres in {settings.data_dir}"
    storage = settings.resolved_storage_uri  # an s3:// URI masked (a local path is no URL: shown as it is)
    storage = mask_url(storage) if storage.startswith("s3://") else storage
    return [f"catalog: {catalog}", f"broker:  {mask_url(broker)}", f"storage: {storage}"]


def check_storage(settings: Settings) -> None:
    """Open the configured storage once (ConfigurationError naming the setting if it cannot be used), as
    `shoal api` does at start: a process that started with a broken storage would fail every task instead."""
    from shoal.storage import Storage

    Storage.from_settings(settings)


def check_catalog(settings: Settings) -> None:
    """Reach the catalog and check its schema (the embedded default: migrate it), then that the storage belongs
    to it, as every long-running role does before it starts: ConfigurationError in one line when the catalog
    cannot be reached, its schema is older or newer than this Shoal's, a migration step timed out on a lock
    (`shoal.catalog.db.catalog_error`), or the storage is another catalog's (`shoal.storage.identity`: its
    marker is written here on first use)."""
    from shoal.catalog.db import ensure_schema, make_engine, resolve_database_url
    from shoal.storage import Storage
    from shoal.storage.identity import ensure_storage_identity

    url = resolve_database_url(settings)
    engine = make_engine(url, pool_size=1, max_overflow=0)
    try:
        ensure_schema(engine, url, auto_migrate=settings.database_url is None)
        # A worker on another deployment's storage would fail every build and, worse, its GC would take every
        # file there for unreferenced: refused before it takes a task (every task's runtime checks it again).
        ensure_storage_identity(engine, Storage.from_settings(settings), settings)
    finally:
        engine.dispose()


def worker(
    beat: Annotated[
        bool,
        typer.Option("--beat/--no-beat", help="Run beat (the scheduled sweeps) inside this worker; exactly one "
                     "worker of a deployment should."),
    ] = True,
    concurrency: Annotated[
        int | None,
        typer.Option("--concurrency", "-c", min=1, help="Tasks run at once (default: the number of CPUs)."),
    ] = None,
    loglevel: Annotated[LogLevel, typer.Option("--loglevel", "-l", help="Log level.")] = LogLevel.INFO,
    pool: Annotated[
        Pool | None, typer.Option("--pool", "-P", help="Execution pool (default: Celery's, prefork).")
    ] = None,
    hostname: Annotated[
        str | None, typer.Option("--hostname", "-n", help="Node name, e.g. indexer1@%h (default: celery@HOST).")
    ] = None,
    events: Annotated[
        bool, typer.Option("--events", "-E", help="Send task events (for `celery events` or Flower).")
    ] = False,
    schedule: Annotated[
        Path | None,
        typer.Option("--schedule", help=f"Beat's schedule file (default: SHOAL_DATA_DIR/{SCHEDULE_FILE}).",
                     dir_okay=False),
    ] = None,
) -> None:
    """Run a Celery worker for Shoal in the foreground, with beat (the scheduled sweeps) by default.

    The worker materializes and merges index shards; beat's sweep queues work for every shard behind its
    data source's head (a safety net for triggers a broker outage dropped) and merges that are due.

    Same settings as every other command (SHOAL_*): the catalog, the broker (the embedded Valkey unless
    SHOAL_REDIS_URL is set) and the storage. Stop it with Ctrl-C (a warm shutdown: running tasks finish;
    press it again to abort them; an aborted task is redelivered and is safe to run twice).

    The same worker, started by Celery itself: `celery -A shoal.workers.app worker --beat`. Flower (installed
    with Shoal) can watch the workers: `celery -A shoal.workers.app flower --address=127.0.0.1` (it turns on task
    events; or start the worker with --events; without --address it listens on every interface).
    """
    from shoal.servers.broker import broker_url
    from shoal.servers.embedded import make_data_folder
    from shoal.workers.app import app

    settings = load_settings()
    check_storage(settings)
    check_catalog(settings)  # reachable and migrated before the worker takes tasks
    broker = broker_url(settings)
    check_broker(broker)
    if beat and schedule is None:
        make_data_folder(settings.data_dir)
        schedule = settings.data_dir / SCHEDULE_FILE
    argv = worker_argv(
        beat=beat, schedule=schedule, concurrency=concurrency, loglevel=loglevel.value,
        pool=pool.value if pool else None, hostname=hostname, events=events,
    )
    for line in describe_servers(settings, broker):
        out.print(line)
    if beat:
        every = f"{settings.sweep_interval_s:g} s"
        out.print(f"beat:    a sweep every {every} (SHOAL_SWEEP_INTERVAL_S); schedule file {schedule}")
    else:
        out.print("beat:    off (--no-beat); run it in one other worker")
    err.print("Watch it with Flower: celery -A shoal.workers.app flower --address=127.0.0.1"
              "   (Ctrl-C stops the worker)")
    code = app.worker_main(argv)
    if code:
        raise typer.Exit(code)
