"""Shared fixtures: one real Postgres (embedded) and one S3-compatible server (moto) per test session.

Every test gets its own tenant and its own storage root, so tests never see each other's data.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
import redis

from shoal import Shoal
from shoal.catalog.db import migrate
from shoal.config.settings import Settings
from shoal.intake.consumer import IntakeConsumer
from shoal.servers.embedded import ensure_postgres, stop_embedded

HERE = Path(__file__).resolve().parent
# The real embedding data set lives in ../shared beside the repository (CI lays it out the same way).
SHARED_DATA = Path(os.environ.get("SHOAL_SHARED_DATA", HERE.parent.parent / "shared" / "data" / "debian-packages"))
S3_BUCKET = "shoal-test"


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A real Postgres: SHOAL_TEST_DATABASE_URL if given, else an embedded one stopped after the session."""
    given = os.environ.get("SHOAL_TEST_DATABASE_URL")
    if given:
        migrate(given)  # a configured catalog is migrated explicitly (`shoal migrate`), as in production
        yield given
        return
    # Not under pytest's own temp root: every pytest session that starts takes group and other access away from
    # /tmp/pytest-of-<user>, and the embedded Postgres runs as another user, so a second session on the machine
    # (a developer's, beside a CI run) would leave this server unable to reach its own data directory.
    data_dir = Path(tempfile.mkdtemp(prefix="shoal-test-pg-"))
    try:
        url = ensure_postgres(data_dir)
        migrate(url)
        yield url
    finally:
        stop_embedded(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture
def own_postgres() -> Iterator[tuple[Path, str]]:
    """A Postgres of one test alone (the test may stop and start it), migrated: (its home, its URL). Outside
    pytest's temp root, as `pg_url`'s is."""
    home = Path(tempfile.mkdtemp(prefix="shoal-test-own-pg-"))
    url = ensure_postgres(home)
    try:
        migrate(url)
        yield home, url
    finally:
        stop_embedded(home)
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def new_database(pg_url: str) -> Iterator[str]:
    """A new, empty database on the test server (its URL), dropped when the block ends."""
    name = "m" + uuid.uuid4().hex[:10]
    admin = pg_url.replace("postgresql+psycopg://", "postgresql://").replace("/shoal?", "/postgres?")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield pg_url.replace("/shoal?", f"/{name}?")
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@pytest.fixture
def fresh_db(pg_url: str) -> Iterator[str]:
    """A new, empty database on the test server, dropped afterwards."""
    with new_database(pg_url) as url:
        yield url


def catalog_down(url: str) -> bool:
    """True when the Postgres at `url` refuses connections (a test stopped it)."""
    try:
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), connect_timeout=2):
            return False
    except psycopg.Error:
        return True


@pytest.fixture
def worker_catalog(fresh_db: str) -> str:
    """A new, migrated catalog (as `shoal migrate` leaves one before a deployment starts), for tests that run
    beat: its sweeps go over every shard of the catalog, and the session's shared one holds hundreds of other
    tests' shards, behind their heads, whose files lie under other storage roots. A worker on it spent its time
    failing those (in one CI run, 140 s before it reached the test's own shard)."""
    migrate(fresh_db)
    return fresh_db


def dead_count(settings: Settings) -> int:
    """Messages in the dead-letter queue of the settings' intake exchange and group."""
    client = redis.Redis.from_url(str(settings.redis_url))
    try:
        return int(client.llen(f"{settings.intake_exchange}.{settings.intake_group}.dead"))
    finally:
        client.close()


@pytest.fixture
def intake_settings(make_settings: Callable[..., Settings], redis_url: str) -> Callable[..., Settings]:
    """Settings with the test broker and an exchange and group of the test's own (the broker is shared)."""

    def make(**overrides: object) -> Settings:
        tag = uuid.uuid4().hex[:8]
        values: dict[str, object] = {
            "redis_url": redis_url,
            "intake_exchange": f"x{tag}.intake",
            "intake_group": f"g{tag}",
            "intake_max_wait_ms": 50,
            "intake_visibility_timeout_s": 3,
            **overrides,
        }
        return make_settings("local", **values)

    return make


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis-protocol server (embedded Valkey), stopped after the session."""
    from shoal.servers.embedded import ensure_valkey

    data_dir = tmp_path_factory.mktemp("valkey")
    try:
        yield ensure_valkey(data_dir)
    finally:
        stop_embedded(data_dir)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """An S3-compatible server (moto in server mode) on loopback, with the test bucket created."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1"
    ).create_bucket(Bucket=S3_BUCKET)
    try:
        yield endpoint
    finally:
        server.stop()


@pytest.fixture(params=["local", "s3"])
def storage_kind(request: pytest.FixtureRequest) -> str:
    """Run the test once on a local directory and once on S3."""
    return str(request.param)


@pytest.fixture
def make_settings(
    pg_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Callable[..., Settings]:
    """Build Settings for a fresh tenant and storage root; `kind` picks local or S3 storage."""

    def make(kind: str = "local", **overrides: object) -> Settings:
        tenant = "t" + uuid.uuid4().hex[:12]
        values: dict[str, object] = {
            "data_dir": tmp_path / "data",
            "database_url": pg_url,
            "redis_url": "redis://127.0.0.1:1/0",  # never used by the log; must not start a server
            "tenant": tenant,
        }
        if kind == "s3":
            endpoint = request.getfixturevalue("s3_endpoint")
            values.update(
                storage_uri=f"s3://{S3_BUCKET}/{tenant}",
                s3_endpoint_url=endpoint,
                s3_access_key="test",
                s3_secret_key="test",
            )
        else:
            values["storage_uri"] = str(tmp_path / "storage")
        values.update(overrides)
        return Settings(**values)  # type: ignore[arg-type]

    return make


@pytest.fixture
def shoal(make_settings: Callable[..., Settings], storage_kind: str) -> Iterator[Shoal]:
    """A Shoal client on a fresh tenant, once per storage kind."""
    client = Shoal(make_settings(storage_kind))
    yield client
    client.close()


@pytest.fixture
def local_shoal(make_settings: Callable[..., Settings]) -> Iterator[Shoal]:
    """A Shoal client on a fresh tenant with local storage (for tests about validation, not storage)."""
    client = Shoal(make_settings("local"))
    yield client
    client.close()


@pytest.fixture
def make_shoal(make_settings: Callable[..., Settings]) -> Iterator[Callable[..., Shoal]]:
    """Shoals on fresh tenants that queue no Celery work (the tests build indexes themselves), closed after the
    test: `make_shoal(kind="local", **settings_overrides)`."""
    made: list[Shoal] = []

    def make(kind: str = "local", **overrides: object) -> Shoal:
        client = Shoal(make_settings(kind, **overrides), notify=False)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@contextlib.contextmanager
def module_cli_env(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """SHOAL_* variables for a CLI test module: only a fresh data dir, its storage and the test catalog (every
    other SHOAL_ variable removed, no stray ./shoal.toml read); its embedded servers stopped at the end."""
    data_dir = tmp_path_factory.mktemp(name)
    given = os.environ.get("SHOAL_TEST_DATABASE_URL") or os.environ.get("SHOAL_DATABASE_URL")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(data_dir)
        for key in [k for k in os.environ if k.startswith("SHOAL_") and k != "SHOAL_TEST_DATABASE_URL"]:
            mp.delenv(key)
        mp.setenv("SHOAL_DATA_DIR", str(data_dir))
        mp.setenv("SHOAL_STORAGE_URI", str(data_dir / "storage"))
        if given:
            mp.setenv("SHOAL_DATABASE_URL", given)
        try:
            yield data_dir
        finally:
            stop_embedded(data_dir)


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that makes a child process build the same Settings."""
    return settings.child_env()


def use_settings_env(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    """Make this process's environment name `settings` alone (every other SHOAL_ variable removed), as a
    worker's would: for tasks run in the test's own process."""
    for key in [k for k in os.environ if k.startswith("SHOAL_")]:
        monkeypatch.delenv(key)
    for key, value in settings_env(settings).items():
        if key.startswith("SHOAL_"):
            monkeypatch.setenv(key, value)


def start_worker(settings: Settings, *extra: str, beat: bool = False, **env: str) -> subprocess.Popen[str]:
    """A real Celery worker process (solo pool: the task runs in the process a test may SIGKILL), in a session
    of its own so that `kill_worker` takes its embedded beat (a child process) down with it."""
    args = [sys.executable, "-m", "celery", "-A", "shoal.workers.app", "worker", "--pool", "solo",
            "--loglevel", "INFO", "--without-gossip", "--without-mingle", *extra]
    if beat:
        args.append("--beat")
        args += ["--schedule", str(settings.data_dir / f"beat-{uuid.uuid4().hex[:6]}")]
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    path = settings.data_dir / f"worker-{uuid.uuid4().hex[:6]}.log"
    log = open(path, "w")  # noqa: SIM115
    proc = subprocess.Popen(args, env=settings_env(settings) | env, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    proc.log_path = path  # type: ignore[attr-defined]
    proc.own_session = True  # type: ignore[attr-defined]
    return proc


def kill_worker(proc: subprocess.Popen[str], timeout: float = 10) -> None:
    """SIGKILL a worker from `start_worker` and every process of its session, as a machine crash would: killing
    only the worker would orphan its beat child, which would go on scheduling tasks after the test."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout)


def stop_process(proc: subprocess.Popen[str], timeout: float = 20) -> None:
    """Terminate a child, killing it if it does not exit in time."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    if getattr(proc, "own_session", False):
        # A worker's session: its beat child ends with it, except when the worker was killed; never leave one.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def run_helper(script: str, args: list[str], settings: Settings, **kwargs: object) -> subprocess.Popen[str]:
    """Start tests/helpers/<script> in a child Python process with the settings in its environment."""
    return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
        [sys.executable, str(HERE / "helpers" / script), *args],
        env=settings_env(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `predicate` until true; fail the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextlib.contextmanager
def serve_api(settings: Settings, log_level: str = "warning") -> Iterator[str]:
    """The HTTP API on a free loopback port, in a thread of this process (a real server, real sockets)."""
    with serve_api_server(settings, log_level) as (url, _):
        yield url


@contextlib.contextmanager
def serve_api_server(settings: Settings, log_level: str = "warning") -> Iterator[tuple[str, Any]]:
    """`serve_api`, with its uvicorn.Server besides its URL: for a test that reaches the server's side of its
    connections or shuts it down itself."""
    import uvicorn

    from shoal.api.app import create_app
    from shoal.api.serve import server_options

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    # The options `shoal api` serves with (Shoal's HTTP protocol among them), so tests meet what users run.
    options = server_options() | {"log_level": log_level}
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "the API server to start")
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def served(make_settings: Callable[..., Settings]) -> Iterator[tuple[str, Settings]]:
    """The API on a loopback port, in a thread of this process (a real server, real sockets), for a fresh
    tenant that is also the anonymous one: Vektonn clients send no key, as the embedded default serves them."""
    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with serve_api(settings) as url:
        yield url, settings


def free_port() -> int:
    """A loopback port free now (for a server started right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def api_process(
    settings: Settings, *extra: str, port: int | None = None, **env: str
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`shoal api` as a child process (a real server process, as users run it) on `port` (default: a free loopback
    port); its output goes to a log file in the data dir. Stopped (SIGTERM, then SIGKILL) when the block ends."""
    import urllib.request

    port = port or free_port()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    path = settings.data_dir / f"api-{uuid.uuid4().hex[:6]}.log"
    log = open(path, "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "api", "--port", str(port), "--no-access-log", *extra],
        env=settings_env(settings) | env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    proc.log_path = path  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, f"shoal api exited: {path.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_for(up, 60, "shoal api to answer /healthz")
        yield proc, url
    finally:
        stop_process(proc)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # uvicorn's worker processes, if any
        log.close()


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def started_under(folder: Path) -> list[int]:
    """Pids of live processes whose command line names `folder` (the demo's worker names its schedule file)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(folder).encode() in cmdline.read_bytes() and alive(int(cmdline.parent.name)):
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


@pytest.fixture
def demo_dir(tmp_path: Path) -> Iterator[Path]:
    """A data directory of the demo's own; at the end no worker of it is left and its servers are stopped."""
    data_dir = tmp_path / "demo-data"
    try:
        yield data_dir
    finally:
        for pid in started_under(data_dir / "demo"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stop_embedded(data_dir)


@pytest.fixture
def consumer_in_thread() -> Iterator[Callable[[Settings], tuple[IntakeConsumer, threading.Thread]]]:
    """Start message consumers (shoal.intake.consumer.IntakeConsumer) in threads of this process: the consumer and
    its thread; each stopped (cleanly) at teardown."""
    started: list[tuple[IntakeConsumer, threading.Thread]] = []

    def start(settings: Settings) -> tuple[IntakeConsumer, threading.Thread]:
        consumer = IntakeConsumer(settings)
        thread = threading.Thread(target=consumer.run, daemon=True)
        thread.start()
        started.append((consumer, thread))
        return consumer, thread

    yield start
    for consumer, thread in started:
        consumer.stop.set()
        thread.join(30)


T = TypeVar("T")


def race(*calls: Callable[[], T], timeout: float = 180) -> list[T]:
    """Run the calls at once (each in its own thread, released together by a barrier); their results in order.
    An exception in any of them fails the caller."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(30)
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), f"a call took over {timeout} s"
    return results
