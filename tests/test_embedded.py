"""The embedded default: with no URLs configured, shoal processes on one data dir share one server each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from shoal.servers.embedded import stop_embedded

pytestmark = pytest.mark.slow  # starts its own embedded servers from fresh processes

PROBE = """
import json
from shoal import Shoal
from shoal.servers.embedded import ensure_postgres
s = Shoal()
with s.engine.connect() as c:
    pid = c.exec_driver_sql("SELECT pg_postmaster_start_time()::text").scalar()
print(json.dumps({"postgres": pid, "broker": s.broker_url(), "sources": len(s.list_data_sources())}))
"""


def test_processes_on_one_data_dir_share_embedded_servers(tmp_path: Path) -> None:
    data_dir = tmp_path / "shoal-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")} | {"SHOAL_DATA_DIR": str(data_dir)}
    try:
        procs = [
            subprocess.Popen([sys.executable, "-c", PROBE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for _ in range(3)
        ]
        seen = []
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err.decode()
            seen.append(json.loads(out))
        assert len({s["postgres"] for s in seen}) == 1, seen
        assert len({s["broker"] for s in seen}) == 1, seen
        client = redis.Redis.from_url(seen[0]["broker"])
        assert client.ping()
        client.close()
        # Storage defaults to the data dir too.
        assert (data_dir / "storage").is_dir()
        # A later process finds the same servers running.
        again = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, timeout=120, check=True)
        assert json.loads(again.stdout)["postgres"] == seen[0]["postgres"]
    finally:
        stopped = stop_embedded(data_dir)
    assert set(stopped) == {"postgres", "valkey"}
    assert not (data_dir / "postgres" / "postmaster.pid").exists()
