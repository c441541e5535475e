"""Ctrl-C on `shoal worker`: the first SIGINT is a warm shutdown (the running build finishes, exit 0), as
`shoal worker --help` promises; it used to reach Shoal's unrecoverable-error path and abort the build.

A real `shoal worker` process (its default prefork pool) on the session's catalog and broker, building a real
HNSW index big enough to take a few seconds.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import settings_env, stop_process, wait_for
from helpers.long_build import building, built, queue_a_long_build

from shoal import Shoal
from shoal.config.settings import Settings

DIM = 32
POINTS = 20_000  # an HNSW build of these takes seconds: long enough to signal the worker in the middle of it


def _shoal_command() -> list[str]:
    """The `shoal` console script of this environment (or `python -m shoal.cli`)."""
    shoal_bin = Path(sys.executable).parent / "shoal"
    return [str(shoal_bin)] if shoal_bin.exists() else [sys.executable, "-m", "shoal.cli"]


@pytest.mark.slow
def test_one_sigint_lets_the_running_build_finish_and_exits_0(
    make_settings: Callable[..., Settings], redis_url: str, tmp_path: Path
) -> None:
    settings = make_settings("local", redis_url=redis_url)
    log_path = tmp_path / "worker.log"
    with Shoal(settings) as shoal:
        index, head = queue_a_long_build(shoal, prefix="sigint", dim=DIM, points=POINTS)
        with open(log_path, "w") as log:
            worker = subprocess.Popen([*_shoal_command(), "worker", "-c", "1", "--no-beat"], env=settings_env(settings),
                                      stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        worker.own_session = True  # type: ignore[attr-defined]  # stop_process then ends its pool too
        try:
            wait_for(lambda: building(shoal, index), 60, "the worker to start the build")
            wait_for(lambda: built(shoal, index) < head and "succeeded" not in log_path.read_text(), 1,
                     "the build to be still running")
            worker.send_signal(signal.SIGINT)
            code = worker.wait(120)
            text = log_path.read_text()
            assert "unrecoverable" not in text, text[-3000:]
            assert re.search(r"materialize_shard\[.*\] succeeded", text), text[-3000:]
            assert code == 0, text[-3000:]
            assert built(shoal, index) == head  # the build was not lost
        finally:
            stop_process(worker)  # type: ignore[arg-type]

