"""Operating Shoal: a real worker with task events watched by a real Flower (task names namespaced by module,
arguments plain ids), beat's schedule from the settings, and `shoal up` supervising its children."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import settings_env, start_worker, stop_process, wait_for
from typer.testing import CliRunner

from shoal import DataSourceSpec, Shoal
from shoal.cli import app as cli_app
from shoal.log.records import IndexSpec
from shoal.workers.app import beat_schedule

DIM = 8
TASKS = "shoal.workers.tasks."
MATERIALIZE = TASKS + "materialize_shard"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    """The JSON at `url`, or None while the server is not answering (yet)."""
    try:
        response = httpx.get(url, timeout=2.0)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=30.0).status_code == 200  # a health check may take seconds on a busy machine
    except httpx.HTTPError:
        return False


@pytest.fixture
def fshoal(make_settings, redis_url: str, worker_catalog: str):  # type: ignore[no-untyped-def]
    """A Shoal on a catalog of its own and the real broker, with quick beat sweeps of both kinds."""
    settings = make_settings(
        "local", database_url=worker_catalog, redis_url=redis_url, sweep_interval_s=0.5, merge_interval_s=0.5,
        pending_ttl_s=2.0, lease_seconds=3.0, task_visibility_timeout_s=5.0,
    )
    client = Shoal(settings)
    yield client
    client.close()


def _source_and_index(shoal: Shoal, shards: int = 2) -> tuple[DataSourceSpec, str, list[int]]:
    spec = DataSourceSpec(f"f-{uuid.uuid4().hex[:8]}", "1", DIM, {"id": "int64"}, ["id"])
    shoal.create_data_source(spec)
    index = f"{spec.name}-idx"
    record = shoal.create_index(
        IndexSpec(index, "1", spec.name, "1", algorithm="flat", metric="euclidean", shard_count=shards)
    )
    return spec, index, [shard.id for shard in record.shards]


def _upload(shoal: Shoal, spec: DataSourceSpec, ids: np.ndarray) -> int:
    vectors = np.random.default_rng(int(ids[0])).standard_normal((len(ids), DIM)).astype(np.float32)
    return shoal.producer(spec.name, "1").upload_columns(vectors, {"id": ids}).seq


def _caught_up(shoal: Shoal, index: str, head: int) -> bool:
    return all(s.built_watermark >= head for s in shoal.index_status(index, "1"))


def _start_flower(settings, port: int) -> subprocess.Popen[str]:  # type: ignore[no-untyped-def]
    path = settings.data_dir / f"flower-{uuid.uuid4().hex[:6]}.log"
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    log = open(path, "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "shoal.workers.app", "flower", f"--port={port}",
         "--address=127.0.0.1"],
        env=settings_env(settings) | {"FLOWER_UNAUTHENTICATED_API": "true"},
        stdout=log, stderr=subprocess.STDOUT, text=True,
    )
    proc.log_path = path  # type: ignore[attr-defined]
    return proc


def _tasks(base: str, name: str, state: str | None = None) -> dict[str, dict[str, Any]]:
    """Flower's list of the tasks called `name` (in `state`), by task id; {} while Flower is not answering."""
    params = f"?taskname={name}" + (f"&state={state}" if state else "")
    return _get(f"{base}/api/tasks{params}") or {}


def _ids(args_repr: str) -> list[int]:
    """Flower shows arguments as their repr: they must read back as a list (a tuple when beat sent the task)
    of plain ints (ids)."""
    args = ast.literal_eval(args_repr)
    assert isinstance(args, list | tuple) and all(type(a) is int for a in args), args_repr
    return list(args)


@pytest.mark.slow
def test_flower_shows_namespaced_tasks_with_id_arguments(fshoal: Shoal) -> None:
    spec, index, shard_ids = _source_and_index(fshoal)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    worker = start_worker(fshoal.settings, "--task-events", beat=True)
    flower = _start_flower(fshoal.settings, port)
    try:
        def fail_if_dead() -> None:
            for proc, what in ((worker, "worker"), (flower, "flower")):
                if proc.poll() is not None:
                    raise AssertionError(f"the {what} exited: {proc.log_path.read_text()[-3000:]}")  # type: ignore

        def wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
            try:
                wait_for(predicate, timeout, what)
            except AssertionError as exc:
                tail = worker.log_path.read_text()[-3000:]  # type: ignore[attr-defined]
                raise AssertionError(f"{exc}; the worker's log ends:\n{tail}") from None

        def seen(name: str) -> bool:
            fail_if_dead()
            return bool(_tasks(base, name, "SUCCESS"))

        # Beat's sweeps run every 0.5 s: once Flower lists them, its event receiver is live.
        wait(lambda: seen(TASKS + "sweep"), 90, "Flower to list a successful beat sweep")
        wait(lambda: seen(TASKS + "sweep_merges"), 30, "Flower to list a successful merge sweep")

        head = _upload(fshoal, spec, np.arange(300))
        wait(lambda: _caught_up(fshoal, index, head), 90, "the worker to materialize the upload")

        def ours() -> dict[str, dict[str, Any]]:
            fail_if_dead()
            return {
                tid: t for tid, t in _tasks(base, MATERIALIZE, "SUCCESS").items()
                if t.get("args") and set(_ids(t["args"])) <= set(shard_ids)
            }

        wait(lambda: {_ids(t["args"])[0] for t in ours().values()} == set(shard_ids), 60,
                 "Flower to list a successful materialization of every shard")
        listed = ours()
        for task_id, task in listed.items():
            assert task["name"] == MATERIALIZE and task["state"] == "SUCCESS"
            info = _get(f"{base}/api/task/info/{task_id}")
            assert info is not None, task_id
            assert info["name"] == MATERIALIZE and info["state"] == "SUCCESS"
            assert info["uuid"] == task_id
            assert len(_ids(info["args"])) == 1 and _ids(info["args"])[0] in shard_ids
            assert ast.literal_eval(info["kwargs"]) == {}
            assert len(info["args"]) < 32  # an id, never a batch of points
            assert info["worker"].startswith("celery@")
        # Every task the worker ran is named shoal.workers.tasks.<function>, and takes ids or nothing.
        every = _get(f"{base}/api/tasks") or {}
        names = {t["name"] for t in every.values() if t.get("name")}
        assert {MATERIALIZE, TASKS + "sweep", TASKS + "sweep_merges"} <= names
        assert all(re.fullmatch(r"shoal\.workers\.tasks\.[a-z_]+", n) for n in names), names
        for task in every.values():
            if task.get("args") is not None:
                _ids(task["args"])
    finally:
        stop_process(flower)
        stop_process(worker)


# -- beat's schedule ---------------------------------------------------------------------------------------


def test_beat_schedule_follows_the_settings(make_settings) -> None:  # type: ignore[no-untyped-def]
    schedule = beat_schedule(make_settings(sweep_interval_s=2.5, merge_interval_s=30))
    assert schedule["sweep-lagging-shards"] == {"task": TASKS + "sweep", "schedule": 2.5, "options": {"expires": 2.5}}
    assert schedule["sweep-due-merges"] == {"task": TASKS + "sweep_merges", "schedule": 30.0,
                                          "options": {"expires": 30.0}}
    # Other upkeep may have entries of its own, each a task of the same module.
    assert all(re.fullmatch(r"shoal\.workers\.tasks\.[a-z_]+", e["task"]) for e in schedule.values()), schedule
    no_merges = beat_schedule(make_settings(sweep_interval_s=10, merge_interval_s=0))
    assert no_merges["sweep-lagging-shards"] == {"task": TASKS + "sweep", "schedule": 10.0,
                                                 "options": {"expires": 10.0}}
    assert "sweep-due-merges" not in no_merges
    assert all(e["task"] != TASKS + "sweep_merges" for e in no_merges.values())
    assert set(schedule) - set(no_merges) == {"sweep-due-merges"}


CONF_PROBE = """
import json
from shoal.workers.app import app
app.loader.import_default_modules()
print(json.dumps({
    "events": [app.conf.worker_send_task_events, app.conf.task_send_sent_event],
    "schedule": {k: [v["task"], v["schedule"]] for k, v in app.conf.beat_schedule.items()},
    "registered": sorted(t for t in app.tasks if t.startswith("shoal.")),
}))
"""


def test_celery_app_sends_events_and_schedules_registered_tasks(make_settings, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    # In a child: the app configures itself once per process, from that process's settings.
    settings = make_settings(redis_url=redis_url, sweep_interval_s=3, merge_interval_s=7)
    probe = subprocess.run([sys.executable, "-c", CONF_PROBE], env=settings_env(settings), capture_output=True,
                           text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    conf = json.loads(probe.stdout.strip().splitlines()[-1])
    assert conf["events"] == [True, True]
    assert conf["schedule"]["sweep-lagging-shards"] == [TASKS + "sweep", 3.0]
    assert conf["schedule"]["sweep-due-merges"] == [TASKS + "sweep_merges", 7.0]
    # Every scheduled task is registered in the worker's app.
    assert {task for task, _ in conf["schedule"].values()} <= set(conf["registered"])
    assert {TASKS + n for n in ("sweep", "sweep_merges", "materialize_shard", "merge_shard")} <= set(
        conf["registered"])
    assert all(re.fullmatch(r"shoal\.workers\.tasks\.[a-z_]+", n) for n in conf["registered"])


# -- shoal up ----------------------------------------------------------------------------------------------


def test_up_help_lists_its_options() -> None:
    result = CliRunner().invoke(cli_app, ["up", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for option in ("--api", "--no-api", "--port", "--host", "--no-consumer", "--flower", "--flower-port",
                   "--concurrency", "--pool", "--loglevel", "--stop-timeout"):
        assert option in result.output, option
    assert "SHOAL_MERGE_INTERVAL_S" in result.output


def test_python_dash_m_shoal_runs_the_cli() -> None:
    result = subprocess.run([sys.executable, "-m", "shoal", "up", "--help"], capture_output=True, text=True,
                            env=dict(os.environ, COLUMNS="200"), timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Usage: shoal up" in result.stdout


def _start_up(settings, log_path: Path, *args: str) -> subprocess.Popen[bytes]:  # type: ignore[no-untyped-def]
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "shoal", "up", *args], env=settings_env(settings),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _pids(text: str) -> dict[str, int]:
    """The children's pids as `shoal up` printed them: {"worker": 123, "api": 456, ...}."""
    return {name: int(pid) for name, pid in re.findall(r"^(\w+):.*\(pid (\d+)\)", text, re.MULTILINE)}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # Not ours to reap: a zombie counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
def test_up_runs_worker_api_and_flower_and_stops_them_on_sigterm(fshoal: Shoal) -> None:
    spec, index, _ = _source_and_index(fshoal, shards=1)
    api_port, flower_port = _free_port(), _free_port()
    log_path = fshoal.settings.data_dir / "up.log"
    fshoal.settings.data_dir.mkdir(parents=True, exist_ok=True)
    up = _start_up(fshoal.settings, log_path, "--no-consumer", "--port", str(api_port), "--flower",
                   "--flower-port", str(flower_port), "--pool", "solo", "--stop-timeout", "20")
    try:
        def ready() -> bool:
            assert up.poll() is None, log_path.read_text()
            text = log_path.read_text()
            return "API ready at" in text and "Flower ready at" in text

        wait_for(ready, 120, "shoal up to report the API and Flower ready")
        text = log_path.read_text()
        assert f"http://127.0.0.1:{api_port}" in text and f"http://127.0.0.1:{flower_port}" in text
        pids = _pids(text)
        assert set(pids) == {"worker", "api", "flower"}, text
        assert _answers(f"http://127.0.0.1:{api_port}/healthz")
        assert _answers(f"http://127.0.0.1:{flower_port}/healthcheck")
        head = _upload(fshoal, spec, np.arange(100))
        logs = fshoal.settings.data_dir / "logs"
        try:
            wait_for(lambda: _caught_up(fshoal, index, head), 90, "the worker of shoal up to materialize")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; worker.log ends:\n{(logs / 'worker.log').read_text()[-3000:]}") from None
        assert {p.name for p in logs.iterdir()} >= {"worker.log", "api.log", "flower.log"}

        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0, log_path.read_text()
        wait_for(lambda: all(_gone(pid) for pid in pids.values()), 10, "every child to be gone")
        text = log_path.read_text()
        assert "worker stopped" in text and "api stopped" in text and "flower stopped" in text
    finally:
        stop_process(up)  # type: ignore[arg-type]


@pytest.mark.slow
def test_up_exits_non_zero_naming_a_child_that_died(fshoal: Shoal) -> None:
    api_port = _free_port()
    log_path = fshoal.settings.data_dir / "up-dies.log"
    fshoal.settings.data_dir.mkdir(parents=True, exist_ok=True)
    # --no-restart: the supervisor's restarts of a dead child are tested in test_recovery.py.
    up = _start_up(fshoal.settings, log_path, "--no-consumer", "--port", str(api_port), "--pool", "solo",
                   "--no-restart")
    try:
        def ready() -> bool:
            assert up.poll() is None, log_path.read_text()
            return "API ready at" in log_path.read_text()

        wait_for(ready, 120, "shoal up to report the API ready")
        pids = _pids(log_path.read_text())
        os.kill(pids["api"], signal.SIGKILL)
        assert up.wait(60) == 1, log_path.read_text()
        text = log_path.read_text()
        assert "the api exited unexpectedly with code -9" in text, text
        assert f"last lines of {fshoal.settings.data_dir / 'logs' / 'api.log'}" in text
        assert "Uvicorn running on" in text or "Application startup complete" in text  # the log's tail
        wait_for(lambda: _gone(pids["worker"]), 10, "the worker to be stopped too")
    finally:
        stop_process(up)  # type: ignore[arg-type]
