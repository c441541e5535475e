"""A commit interrupted after it landed keeps its files: Ctrl-C on `shoal import` while the new head was being
announced (a slow broker) removed the segment file of a committed row, and the data source's log could never be
read again ("segment ... referenced by the catalog is missing"). Real Postgres, storage and CLI process; the
broker is a socket that accepts connections and never answers."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from conftest import settings_env, wait_for

from shoal import Shoal
from shoal.config.settings import Settings
from shoal.log.records import AttributeType, DataSourceSpec

DIM = 4
POINTS = 500


def test_ctrl_c_while_a_landed_commit_is_announced_keeps_the_log_readable(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings("local")
    path = settings.data_dir / "points.parquet"
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    vectors = np.random.default_rng(7).random((POINTS, DIM), dtype=np.float32)
    pq.write_table(pa.table({"id": np.arange(POINTS), "vector": list(vectors)}), path)
    with Shoal(settings, notify=False) as shoal, socket.create_server(("127.0.0.1", 0)) as silent:
        shoal.create_data_source(DataSourceSpec("Sil", "1", DIM, {"id": AttributeType.INT64}, ["id"]))
        env = settings_env(settings) | {"SHOAL_REDIS_URL": f"redis://127.0.0.1:{silent.getsockname()[1]}/0"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "import", "Sil", "1", str(path), "--vectors-column", "vector"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        try:
            # The commit landed; the announcement of its head now waits on the silent broker (2 s timeout).
            wait_for(lambda: shoal.get_data_source("Sil", "1").head_seq > 0, 60, "the import's commit")
            assert proc.poll() is None, "the import ended before it could be interrupted"
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert shoal.get_data_source("Sil", "1").head_seq == POINTS
        state = shoal.fold("Sil", "1")  # reads every segment the catalog references, each checked
        assert sorted(state["id"].to_pylist()) == list(range(POINTS))
