"""Is the catalog or the broker up? Quick probes for `shoal server status` that never start a server.

Each probe answers with a state to print, never by raising: an unreachable server is a status, not a crash.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from shoal.cli.common import fail, first_line
from shoal.config.settings import Settings, mask_url


def embedded_postgres_status(data_dir: Path) -> tuple[str, str]:
    """(state, address) of the embedded Postgres of `data_dir`, read from its pid file and one connection."""
    import psycopg

    pidfile = data_dir / "postgres" / "postmaster.pid"
    if not pidfile.is_file():
        return "stopped", str(data_dir / "postgres")
    lines = pidfile.read_text().splitlines()
    try:
        pid, port, socket_dir = int(lines[0]), int(lines[3]), lines[4].strip()
        os.kill(pid, 0)
    except (IndexError, ValueError, ProcessLookupError):
        return "stopped (stale pid file)", str(data_dir / "postgres")
    except PermissionError:
        pass  # alive, owned by another user (the embedded server runs as another user under root)
    url = f"postgresql+psycopg://postgres@/shoal?host={socket_dir}"
    try:
        with psycopg.connect(host=socket_dir, port=port, user="postgres", dbname="postgres", connect_timeout=3):
            return "running", url
    except psycopg.Error as exc:
        return f"not answering: {first_line(exc)}", url


def database_status(settings: Settings) -> str:
    """"reachable" or "unreachable: why" for the configured catalog (SHOAL_DATABASE_URL)."""
    from sqlalchemy import create_engine, text

    from shoal.catalog.db import resolve_database_url

    engine = create_engine(resolve_database_url(settings), connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return "reachable"
    except Exception as exc:  # any failure is a status to report, not a crash
        return f"unreachable: {first_line(exc)}"
    finally:
        engine.dispose()


def check_broker(url: str) -> None:
    """End the command with one line and status 1 when the broker at `url` cannot be reached (one PING): what
    every long-running role checks before it starts."""
    reachable = redis_status(url)
    if reachable != "reachable":
        fail(f"cannot reach the broker at {mask_url(url)}: {reachable.removeprefix('unreachable: ')}")


def redis_status(url: str) -> str:
    """"reachable" or "unreachable: why" for the broker at `url` (one PING, short timeouts)."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
        try:
            client.ping()
        finally:
            client.close()
        return "reachable"
    except (redis.RedisError, ValueError) as exc:
        return f"unreachable: {first_line(exc)}"


def embedded_valkey_status(data_dir: Path) -> tuple[str, str]:
    """(state, address) of the embedded Valkey of `data_dir`, read from its state file and one PING."""
    state = data_dir / "valkey" / "server.json"
    if not state.is_file():
        return "stopped", str(data_dir / "valkey")
    try:
        port = int(json.loads(state.read_text())["port"])
    except (ValueError, KeyError, TypeError):
        return "stopped (unreadable state file)", str(state)
    from shoal.config.settings import mask_url
    from shoal.servers.embedded import valkey_url

    # The server requires the password kept beside it (one started by an older Shoal may have none yet).
    has_password = (data_dir / "valkey" / "password").is_file()
    url = valkey_url(data_dir, port) if has_password else f"redis://127.0.0.1:{port}/0"
    return ("running" if redis_status(url) == "reachable" else "stopped"), mask_url(url)
