"""The embedded servers of a data directory are its own: a copy of the directory (its password, port and pid files
came along) starts servers of its own instead of sharing the original's; `shoal server stop` signals only a process
that is this directory's server, never one that took the pid of a server that died; a server of the directory that
runs but does not answer (paused, stalled) is waited for, within a bound, never joined by a second one on the same
folder; and a data directory whose path holds a space runs, while one whose path pg_ctl cannot pass is refused in
one line."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import psycopg
import pytest
import redis
from conftest import wait_for
from typer.testing import CliRunner

from shoal import DataPoint, DataSourceSpec, Shoal
from shoal.cli import app
from shoal.config.settings import Settings
from shoal.errors import ConfigurationError
from shoal.log.records import IndexSpec
from shoal.servers.embedded import ensure_postgres, ensure_valkey, stop_embedded

runner = CliRunner()

# A process that is no server of ours: it blocks SIGTERM and SIGINT, so a signal sent to it stays pending where
# the test can see it (instead of racing its exit).
STRANGER = ("import signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT}); "
            "print('ready', flush=True); sys.stdin.read()")


@pytest.fixture
def data_dirs() -> Iterator[Callable[[str], Path]]:
    """Data directories named under one fresh folder, outside pytest's temp root (the embedded Postgres runs as
    another user, see conftest.pg_url); their embedded servers stopped and the folder removed after the test."""
    root = Path(tempfile.mkdtemp(prefix="shoal-test-identity-"))
    made: list[Path] = []

    def make(name: str) -> Path:
        made.append(root / name)
        return root / name

    try:
        yield make
    finally:
        for data_dir in made:
            stop_embedded(data_dir)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[str]]:
    """An unrelated process of this user, running until the test ends."""
    proc = subprocess.Popen([sys.executable, "-c", STRANGER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def signals_pending(pid: int) -> set[int]:
    """The signals sent to `pid` that it has not taken (it blocks them)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    mask = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


def valkey_folder(url: str) -> Path:
    client = redis.Redis.from_url(url)
    try:
        return Path(client.config_get("dir")["dir"]).resolve()
    finally:
        client.close()


def postgres_folder(url: str) -> Path:
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), connect_timeout=5) as conn:
        return Path(conn.execute("SHOW data_directory").fetchone()[0]).resolve()  # type: ignore[index]


def answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5, retry=None)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def shoal_cli(data_dir: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str]:
    """`shoal ARGS` in process on `data_dir` alone (no other SHOAL_ variable, no ./shoal.toml): (exit code, output)."""
    with monkeypatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("SHOAL_")]:
            mp.delenv(key)
        mp.setenv("SHOAL_DATA_DIR", str(data_dir))
        mp.chdir(data_dir.parent)
        result = runner.invoke(app, list(args))
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def postgres_pid_taken(data_dir: Path, stranger: subprocess.Popen[str]) -> Path:
    """`data_dir` with an embedded Postgres started, then killed, its postmaster.pid naming `stranger` (a process
    that took the dead server's pid)."""
    data_dir.mkdir()
    ensure_postgres(data_dir)
    lines = kill_postgres(data_dir)
    (data_dir / "postgres" / "postmaster.pid").write_text("\n".join([str(stranger.pid), *lines[1:]]) + "\n")
    return data_dir


def kill_postgres(data_dir: Path) -> list[str]:
    """SIGKILL the embedded Postgres of `data_dir` (as the OOM killer would) and wait until its processes are gone;
    return the lines of the postmaster.pid it left."""
    pgdata = (data_dir / "postgres").resolve()
    lines = (pgdata / "postmaster.pid").read_text().splitlines()
    os.kill(int(lines[0]), signal.SIGKILL)

    def gone() -> bool:
        for proc in psutil.process_iter(["name", "cwd"]):
            if proc.info["name"] == "postgres" and proc.info["cwd"] and Path(proc.info["cwd"]) == pgdata:
                return False
        return True

    wait_for(gone, 30, "the killed Postgres and its backends to end")
    return lines


# -- 1. a copied data directory ----------------------------------------------------------------------------

def test_a_copy_of_a_running_data_dir_starts_servers_of_its_own(data_dirs: Callable[[str], Path]) -> None:
    """A copy taken while the servers run (a backup, a trial upgrade) holds the original's password, port and pid
    files: it used the original's Valkey and Postgres, and stopping the copy stopped the original's."""
    original, copy = data_dirs("original"), data_dirs("copy")
    original.mkdir()
    original_pg, original_redis = ensure_postgres(original), ensure_valkey(original)
    subprocess.run(["cp", "-a", str(original), str(copy)], check=True)

    copy_pg, copy_redis = ensure_postgres(copy), ensure_valkey(copy)
    assert copy_redis != original_redis
    assert valkey_folder(copy_redis) == (copy / "valkey").resolve()
    assert postgres_folder(copy_pg) == (copy / "postgres").resolve()
    assert valkey_folder(original_redis) == (original / "valkey").resolve()
    assert postgres_folder(original_pg) == (original / "postgres").resolve()

    # Stopping the copy stops the copy's servers, and only them.
    assert set(stop_embedded(copy)) == {"valkey", "postgres"}
    wait_for(lambda: not answers(copy_redis), 15, "the copy's Valkey to stop")
    assert answers(original_redis)
    assert postgres_folder(original_pg) == (original / "postgres").resolve()


# -- 2. a pid file naming a process that is not our server --------------------------------------------------

def test_server_stop_leaves_alone_a_process_that_took_a_dead_valkeys_pid(
    data_dirs: Callable[[str], Path], stranger: subprocess.Popen[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Valkey killed -9 leaves its pid file; once its pid is another process's, `shoal server stop` signalled
    that process and said "Stopped valkey"."""
    data_dir = data_dirs("stale-valkey")
    data_dir.mkdir()
    url = ensure_valkey(data_dir)
    pidfile = data_dir / "valkey" / "valkey.pid"
    os.kill(int(pidfile.read_text()), signal.SIGKILL)
    wait_for(lambda: not answers(url), 15, "the killed Valkey to be gone")
    pidfile.write_text(f"{stranger.pid}\n")  # the dead server's pid, now an unrelated process's

    code, output = shoal_cli(data_dir, monkeypatch, "server", "stop")
    assert code == 0, output
    assert "Stopped" not in output and "valkey: not running (stale pid file removed)" in output
    assert signals_pending(stranger.pid) == set() and stranger.poll() is None
    assert not pidfile.exists()  # the stale pid file is gone: the next stop does not meet it again
    assert ensure_valkey(data_dir) == url  # and the next start starts it again, on its port


def test_stop_leaves_alone_a_process_that_took_a_dead_postgres_pid(
    data_dirs: Callable[[str], Path], stranger: subprocess.Popen[str]
) -> None:
    """The same for the embedded Postgres: pg_ctl stop signals whatever process its postmaster.pid names."""
    data_dir = postgres_pid_taken(data_dirs("stale-postgres"), stranger)
    pidfile = data_dir / "postgres" / "postmaster.pid"

    stale: list[str] = []
    assert stop_embedded(data_dir, stale=stale) == []
    assert stale == ["postgres"]
    assert signals_pending(stranger.pid) == set() and stranger.poll() is None
    assert not pidfile.exists()


def test_a_postgres_whose_pid_another_process_took_starts_again(
    data_dirs: Callable[[str], Path], stranger: subprocess.Popen[str]
) -> None:
    """Its pid running, the library took the dead server for running and the catalog was unreachable."""
    data_dir = postgres_pid_taken(data_dirs("restart-postgres"), stranger)

    url = ensure_postgres(data_dir)
    assert postgres_folder(url) == (data_dir / "postgres").resolve()
    assert signals_pending(stranger.pid) == set() and stranger.poll() is None


# -- 3. paths with a space, and paths pg_ctl cannot pass ------------------------------------------------------

def test_a_data_dir_whose_path_holds_a_space_runs(data_dirs: Callable[[str], Path]) -> None:
    """pg_ctl passed the socket folder unquoted: `postgres: invalid argument` and a traceback."""
    data_dir = data_dirs("a dir")
    settings = Settings(data_dir=data_dir, database_url=None, redis_url=None, storage_uri=None, tenant="spaced")
    client = Shoal(settings)
    try:
        client.create_data_source(DataSourceSpec(name="ds", version="1", vector_dimension=2,
                                                 attribute_types={"id": "int64"}, permanent_attributes=["id"]))
        client.create_index(IndexSpec(name="ix", version="1", source_name="ds", source_version="1",
                                      id_attributes=["id"]))
        client.producer("ds", "1").upload([DataPoint({"id": 1}, [0.0, 1.0]), DataPoint({"id": 2}, [1.0, 0.0])])
        searcher = client.searcher()
        try:
            hits = searcher.search("ix", "1", [[1.0, 0.1]], 1, consistency="strong")[0]
        finally:
            searcher.close()
        assert [h.attributes["id"] for h in hits] == [2]
        assert valkey_folder(client.broker_url()) == (data_dir / "valkey").resolve()
    finally:
        client.close()
    assert set(stop_embedded(data_dir)) == {"valkey", "postgres"}


def test_a_data_dir_pg_ctl_cannot_pass_is_refused_in_one_line(
    data_dirs: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """pg_ctl quotes the data folder for the shell in double quotes, in which `$` is still read."""
    data_dir = data_dirs("costs$HOME")
    data_dir.mkdir()
    with pytest.raises(ConfigurationError, match=r"cannot run in .*costs\$HOME.*'\$'"):
        ensure_postgres(data_dir)
    code, output = shoal_cli(data_dir, monkeypatch, "server", "start")
    assert code == 1 and "costs$HOME" in output and "'$'" in output, output


# -- 4. a server that runs but does not answer ------------------------------------------------------------------

def valkey_servers(data_dir: Path) -> set[int]:
    """The pids of the valkey-servers working in `data_dir`'s Valkey folder (paused ones too)."""
    home = (data_dir / "valkey").resolve()
    return {proc.pid for proc in psutil.process_iter(["name", "cwd"])
            if proc.info["name"] == "valkey-server" and proc.info["cwd"] and Path(proc.info["cwd"]) == home}


def end_valkeys(data_dir: Path) -> None:
    """Resume and end every valkey-server of `data_dir` (a second one the defect started is no pid file's)."""
    for pid in valkey_servers(data_dir):
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not valkey_servers(data_dir), 30, f"the valkey-servers of {data_dir} to end")


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def clients_queued(port: int) -> int:
    """Connections to the server listening on 127.0.0.1:`port` that it has not accepted yet (a paused server
    accepts none): the accept queue of its listening socket, which /proc/net/tcp shows as rx_queue."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[1] == f"0100007F:{port:04X}":  # LISTEN, on 127.0.0.1:port
            return int(fields[4].split(":")[1], 16)
    return 0


def test_a_paused_valkey_is_waited_for_not_joined_by_a_second_one(data_dirs: Callable[[str], Path]) -> None:
    """A Valkey paused (SIGSTOP here; stalled by load, an AOF rewrite or swapping in a real run) while a process
    looked for it: after half a second the process started a second valkey-server on the same folder and its
    appendonlydir, every later process went to that one, and `shoal server stop` stopped only it."""
    data_dir = data_dirs("paused-valkey")
    data_dir.mkdir()
    url = ensure_valkey(data_dir)
    [pid] = valkey_servers(data_dir)
    try:
        with ThreadPoolExecutor(1) as pool:
            os.kill(pid, signal.SIGSTOP)
            try:
                found = pool.submit(ensure_valkey, data_dir)
                # Resumed once the caller's first probe went unanswered and it probed again: two connections wait
                # on the paused server.
                wait_for(lambda: clients_queued(port_of(url)) >= 2 or found.done(), 30,
                         "the caller to probe the paused Valkey twice")
            finally:
                os.kill(pid, signal.SIGCONT)
            wait_for(found.done, 60, "ensure_valkey to return once the Valkey is resumed")
        assert valkey_servers(data_dir) == {pid}
        assert found.result() == url  # the original server, on its port
        assert stop_embedded(data_dir) == ["valkey"]
        wait_for(lambda: not valkey_servers(data_dir), 30, "the Valkey of the data dir to end")
    finally:
        end_valkeys(data_dir)


def test_a_valkey_that_never_answers_is_reported_not_replaced(data_dirs: Callable[[str], Path]) -> None:
    """A Valkey that stays paused is an error naming it, after the wait given; no second server is started."""
    data_dir = data_dirs("stuck-valkey")
    data_dir.mkdir()
    url = ensure_valkey(data_dir)
    [pid] = valkey_servers(data_dir)
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(ConfigurationError, match=rf"the embedded Valkey \(pid {pid}, port {port_of(url)}\) "
                                                         rf"of .*stuck-valkey is running but not answering"):
                ensure_valkey(data_dir, stall_timeout=2)
            assert valkey_servers(data_dir) == {pid}
        finally:
            os.kill(pid, signal.SIGCONT)
        assert ensure_valkey(data_dir) == url  # resumed, it is found again
    finally:
        end_valkeys(data_dir)


def test_a_postgres_that_never_answers_is_reported_within_the_wait(data_dirs: Callable[[str], Path]) -> None:
    """A paused postmaster held every process that looked for the catalog (and `shoal server stop`, on the same
    lock) for as long as it stayed paused: no error, no end. It is an error naming it after the wait given."""
    data_dir = data_dirs("stuck-postgres")
    data_dir.mkdir()
    url = ensure_postgres(data_dir)
    pidfile = data_dir / "postgres" / "postmaster.pid"
    pid = int(pidfile.read_text().split()[0])
    with ThreadPoolExecutor(1) as pool:
        os.kill(pid, signal.SIGSTOP)
        try:
            attempt = pool.submit(ensure_postgres, data_dir, stall_timeout=3)
            wait_for(attempt.done, 60, "ensure_postgres to give up on the paused Postgres")
        finally:
            os.kill(pid, signal.SIGCONT)
    with pytest.raises(ConfigurationError, match=rf"the embedded Postgres \(pid {pid}\) of .*stuck-postgres is "
                                                 rf"running but not answering"):
        attempt.result()
    assert ensure_postgres(data_dir) == url  # resumed, it is found again: the same server
    assert int(pidfile.read_text().split()[0]) == pid


def test_a_postgres_that_refuses_the_connection_is_reported_as_a_refusal(pg_url: str, tmp_path: Path) -> None:
    """Every connection error was waited on for the whole bound, then called a stall ("running but not
    answering"): a refused login or a database that does not exist is the server's answer, said as it is."""
    from sqlalchemy.engine import make_url

    from shoal.servers.embedded import _connect_postgres

    missing = make_url(pg_url).set(drivername="postgresql", database="shoal_no_such_db")
    with pytest.raises(ConfigurationError, match=r"refused the connection \(.*shoal_no_such_db.*does not exist"):
        _connect_postgres(missing.render_as_string(hide_password=False), tmp_path, None, 30.0)
