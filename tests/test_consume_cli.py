"""`shoal consume` as an operator runs it: it refuses a broker it cannot reach at start, as `shoal worker` does
(it retried for ever, silently), and a closed terminal (SIGHUP) stops it cleanly, handing its lead back (it was
killed outright, and its group waited the visibility timeout for another consumer to lead)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable

from conftest import settings_env, stop_process, wait_for

from shoal.config.settings import Settings


def test_consume_refuses_a_broker_it_cannot_reach(intake_settings: Callable[..., Settings]) -> None:
    settings = intake_settings()
    env = settings_env(settings) | {"SHOAL_REDIS_URL": "redis://127.0.0.1:1/0"}
    try:
        result = subprocess.run([sys.executable, "-m", "shoal.cli", "consume"], env=env, capture_output=True,
                                text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("shoal consume kept running on a broker it cannot reach") from exc
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("error: cannot reach the broker at redis://127.0.0.1:1/0"), result.stderr
    assert "Traceback" not in result.stderr


def test_consume_stops_cleanly_on_sighup(intake_settings: Callable[..., Settings]) -> None:
    settings = intake_settings()
    log = settings.data_dir / "consume.log"
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "consume"], env=settings_env(settings),
                                stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: "consuming queue" in log.read_text(), 60, "the consumer to start")
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        stop_process(proc)
    assert "stopped: 0 messages" in log.read_text()
