"""Shoal's Celery app for one test (`celery -A failing_worker_app worker`, with tests/helpers on the path): it
adds a task that holds a pool process, and makes the worker's event loop raise once the file named by
$SHOAL_TEST_FAIL_FILE exists, as kombu's result reader did when it read half a message after a broker restart."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import bootsteps

from shoal.workers.app import app

__all__ = ["app"]


@app.task(name="tests.hold")
def hold(started: str, seconds: float) -> None:
    """Say it started (by writing `started`), then keep its pool process busy for `seconds`."""
    Path(started).write_text(str(os.getpid()))
    time.sleep(seconds)


class FailWhenAsked(bootsteps.StartStopStep):  # type: ignore[misc]
    """A consumer step whose tick raises once the trigger file exists: an error the worker cannot recover from."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def start(self, consumer: Any) -> None:
        trigger = Path(os.environ["SHOAL_TEST_FAIL_FILE"])

        def tick() -> None:
            if trigger.exists():
                raise RuntimeError("the test asked this worker's event loop to fail")

        consumer.hub.on_tick.add(tick)


app.steps["consumer"].add(FailWhenAsked)
