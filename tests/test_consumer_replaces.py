"""A consumer started in place of one that ended (`shoal up` restarting a consumer it saw exit) leads its group at
once, rather than after the dead one's lease (SHOAL_INTAKE_VISIBILITY_TIMEOUT_S, 300 s by default) runs out, and
what the dead one held is committed before anything published after it.

Real `shoal consume` processes, a real broker (Valkey) and catalog; the lease is an hour here, so a consumer
that waited it out would fail every wait below.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import settings_env, stop_process, wait_for

from shoal import Shoal
from shoal.catalog.repo import head_of
from shoal.config.settings import Settings
from shoal.intake.publisher import Publisher
from shoal.log.records import AttributeType, DataPoint, DataSourceSpec, Tombstone
from shoal.log.validation import VECTOR

SPEC = DataSourceSpec("events", "1", 2, {"id": AttributeType.INT64}, ["id"])


def _consume(settings: Settings, log: Path, *options: str) -> subprocess.Popen[str]:
    out = open(log, "a")  # noqa: SIM115 - the child writes to it until it ends
    return subprocess.Popen([sys.executable, "-m", "shoal.cli", "consume", *options], env=settings_env(settings),
                            stdout=out, stderr=subprocess.STDOUT, text=True)


def _head(shoal: Shoal) -> int:
    return head_of(shoal.engine, shoal.get_data_source(SPEC.name, SPEC.version).id)[0]


def test_a_consumer_replacing_a_dead_one_leads_at_once(
    intake_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    settings = intake_settings(intake_visibility_timeout_s=3600)
    first, second = "host-a:1:0000000a", "host-a:2:0000000b"
    log = tmp_path / "consume.log"
    with Shoal(settings, notify=False) as shoal, Publisher(settings) as publisher:
        shoal.create_data_source(SPEC)
        dead = _consume(settings, log, "--consumer-id", first)
        try:
            publisher.publish("events", "1", [DataPoint({"id": 1}, [1.0, 0.0])])
            wait_for(lambda: _head(shoal) == 1, 60, "the first consumer to lead and commit")
        finally:
            dead.send_signal(signal.SIGKILL)
            dead.wait(30)
        # Published while no consumer runs: the tombstone of the point, then the point again.
        publisher.publish("events", "1", [Tombstone({"id": 1})])
        publisher.publish("events", "1", [DataPoint({"id": 1}, [2.0, 0.0])])
        replacing = _consume(settings, log, "--consumer-id", second, "--replaces", first)
        try:
            wait_for(lambda: _head(shoal) == 3, 60, "the replacing consumer to lead within a minute (lease: 1 h)")
        finally:
            stop_process(replacing)
        # In the order published: the point is there, at its last vector.
        folded = shoal.fold("events", "1")
        assert folded["id"].to_pylist() == [1]
        assert [list(v) for v in folded[VECTOR].to_pylist()] == [[2.0, 0.0]]


def test_shoal_up_restarts_a_killed_consumer_that_leads_at_once(
    intake_settings: Callable[..., Settings], worker_catalog: str, tmp_path: Path
) -> None:
    """`shoal up` saw its consumer die: the one it starts in its place takes the next message at once."""
    settings = intake_settings(intake_visibility_timeout_s=3600, database_url=worker_catalog, merge_interval_s=0)
    log = tmp_path / "up.log"
    with Shoal(settings, notify=False) as shoal, Publisher(settings) as publisher:
        shoal.create_data_source(SPEC)
        with open(log, "wb") as out:
            up = subprocess.Popen([sys.executable, "-m", "shoal", "up", "--no-api", "--pool", "solo"],
                                  env=settings_env(settings), stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            publisher.publish("events", "1", [DataPoint({"id": 1}, [1.0, 0.0])])
            wait_for(lambda: _head(shoal) == 1, 90, "shoal up's consumer to lead and commit")
            pid = int(re.search(r"^intake:.*\(pid (\d+)\)", log.read_text(), re.MULTILINE).group(1))  # type: ignore[union-attr]
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: "consumer restarted (pid" in log.read_text(), 60, "shoal up to restart the consumer")
            publisher.publish("events", "1", [DataPoint({"id": 2}, [2.0, 0.0])])
            wait_for(lambda: _head(shoal) == 2, 60, "the restarted consumer to lead within a minute (lease: 1 h)")
        finally:
            stop_process(up)  # type: ignore[arg-type]
            try:
                os.killpg(up.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("option", ["--consumer-id", "--replaces"])
def test_a_malformed_consumer_id_is_refused_in_one_line(
    intake_settings: Callable[..., Settings], tmp_path: Path, option: str
) -> None:
    settings = intake_settings()
    done = subprocess.run([sys.executable, "-m", "shoal.cli", "consume", option, "not an id"],
                          env=settings_env(settings), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "is no consumer id" in done.stderr and "Traceback" not in done.stderr
