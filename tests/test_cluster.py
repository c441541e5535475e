"""The production topology of docker/docker-compose.yml, run without Docker (issue 16).

These machines have no container engine, so the test reads the compose file and the Dockerfile's entrypoint and
starts every Shoal service's command as local processes, with that service's environment from config/*.example
(the endpoint variables mapped to servers on loopback, as Docker's service names would resolve): a Postgres that
Shoal did not start, a Redis-protocol server, an S3-compatible server (moto), the one-shot `migrate`, 2 API
processes, 2 workers, 1 beat, 2 consumers and Flower. A service whose command or environment does not work fails
the test. Then, as a deployment would be used: uploads through both API processes and the broker into a 4-shard
HNSW index, built by both workers (Flower lists tasks of both), one worker SIGKILLed in the middle of a build while
the other finishes, beat scheduling from its one process, both API processes giving the same answer at
at_least(token), and the final folded state exactly what was acknowledged.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
import numpy as np
import pytest
import yaml
from conftest import stop_process, wait_for

from shoal import Shoal
from shoal.config.settings import Settings
from shoal.intake import Publisher
from shoal.log.validation import VECTOR
from shoal.servers.embedded import ensure_valkey, stop_embedded

pytestmark = pytest.mark.slow  # a dozen real processes

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker" / "docker-compose.yml"
CONFIG = ROOT / "config"
DIM = 64
BATCH = 1_000
BATCHES_PER_WAY = 14  # through API 1, API 2 and the broker each
# The servers of the compose file, by service name, and the variables that point at them.
ENDPOINTS = {"SHOAL_DATABASE_URL": "postgres", "SHOAL_REDIS_URL": "redis", "SHOAL_S3_ENDPOINT_URL": "minio"}


@dataclass
class Service:
    name: str
    argv: list[str]  # as the container runs it: entrypoint + command
    replicas: int
    env: dict[str, str]


def _env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a compose env file (its committed .example: the real one is the operator's)."""
    example = path.with_name(path.name + ".example")
    out = {}
    for line in example.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def _entrypoint() -> list[str]:
    """The image's ENTRYPOINT, from the Dockerfile the services build."""
    text = (ROOT / "docker" / "Dockerfile").read_text()
    match = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, re.MULTILINE)
    assert match, "the Dockerfile names no ENTRYPOINT"
    return list(json.loads(match.group(1)))


def shoal_services() -> dict[str, Service]:
    """Every service built from Shoal's image, as the compose file describes it."""
    compose = yaml.safe_load(COMPOSE.read_text())
    out = {}
    for name, spec in compose["services"].items():
        if "build" not in spec:
            continue  # a server Shoal stands on: the test brings its own
        env: dict[str, str] = {}
        for file in spec.get("env_file", []):
            env |= _env_file((COMPOSE.parent / file).resolve())
        env |= {k: str(v) for k, v in (spec.get("environment") or {}).items()}
        argv = list(spec.get("entrypoint") or _entrypoint()) + [str(a) for a in spec.get("command", [])]
        out[name] = Service(name, argv, int((spec.get("deploy") or {}).get("replicas", 1)), env)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """The services' processes, each in a session of its own, logging to files under `root`."""

    def __init__(self, root: Path, servers: dict[str, str]) -> None:
        self.root = root
        self.servers = servers
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def env(self, service: Service, replica: str) -> dict[str, str]:
        env = dict(service.env)
        for key, host in ENDPOINTS.items():
            assert host in env.get(key, ""), f"{service.name}: {key} does not point at the {host} service"
            env[key] = self.servers[host]
        data = self.root / replica
        data.mkdir(parents=True, exist_ok=True)
        # The image's SHOAL_DATA_DIR=/data, one per container.
        base = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
        return base | env | {"SHOAL_DATA_DIR": str(data)}

    def argv(self, service: Service, replica: str, *, port: int | None = None) -> list[str]:
        """The container's argv as a local command: the same program and arguments, a port of its own where
        containers would each have their own address, and /data at the replica's own folder."""
        program, *args = service.argv
        args = [a.replace("/data", str(self.root / replica)) if a.startswith("/data") else a for a in args]
        if port is not None:
            args = [re.sub(r"^(--port=)\d+$", rf"\g<1>{port}", a) for a in args]
            if "--port" in args:
                args[args.index("--port") + 1] = str(port)
        return [sys.executable, "-m", program, *args]

    def start(self, service: Service, replica: str, *extra: str, port: int | None = None) -> subprocess.Popen[str]:
        log = open(self.root / f"{replica}.log", "w")  # noqa: SIM115
        proc = subprocess.Popen([*self.argv(service, replica, port=port), *extra], env=self.env(service, replica),
                                stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        proc.log_path = self.root / f"{replica}.log"  # type: ignore[attr-defined]
        proc.own_session = True  # type: ignore[attr-defined]
        self.procs[replica] = proc
        return proc

    def log(self, replica: str) -> str:
        return (self.root / f"{replica}.log").read_text(errors="replace")

    def check_alive(self) -> None:
        for replica, proc in self.procs.items():
            if proc.poll() is not None and not getattr(proc, "killed_on_purpose", False):
                raise AssertionError(f"{replica} exited ({proc.returncode}): {self.log(replica)[-3000:]}")

    def wait(self, predicate: Any, timeout: float, what: str) -> None:
        def ok() -> bool:
            self.check_alive()
            return bool(predicate())

        wait_for(ok, timeout, what)

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_process(proc)


@pytest.fixture
def servers(fresh_db: str, s3_endpoint: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The servers the compose file runs, here on loopback: a Postgres database Shoal did not start, a Valkey of
    this test's own, moto with the bucket made (the compose file's `bucket` service)."""
    boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="x", aws_secret_access_key="x",
                 region_name="us-east-1").create_bucket(Bucket="shoal")
    valkey = tmp_path / "valkey"
    try:
        yield {"postgres": fresh_db, "redis": ensure_valkey(valkey), "minio": s3_endpoint}
    finally:
        stop_embedded(valkey)


def test_the_compose_topology_runs_as_local_processes(servers: dict[str, str], tmp_path: Path) -> None:
    services = shoal_services()
    assert {"migrate", "api", "worker", "beat", "consumer", "flower"} <= services.keys()
    assert (services["api"].replicas, services["worker"].replicas, services["beat"].replicas,
            services["consumer"].replicas) == (2, 2, 1, 2)
    cluster = Cluster(tmp_path / "cluster", servers)
    try:
        _run(cluster, services)
    finally:
        cluster.stop()


def _run(cluster: Cluster, services: dict[str, Service]) -> None:
    one_shot = services["migrate"]
    migrate = subprocess.run(cluster.argv(one_shot, "migrate"), env=cluster.env(one_shot, "migrate"),
                             capture_output=True, text=True, timeout=120)
    assert migrate.returncode == 0, migrate.stdout + migrate.stderr

    # The operator's first steps: a tenant and an admin key, with the same environment.
    operator = cluster.env(services["migrate"], "operator")
    shoal_cli = [sys.executable, "-m", "shoal"]
    run = subprocess.run([*shoal_cli, "tenant", "create", "acme"], env=operator, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    run = subprocess.run([*shoal_cli, "key", "create", "--tenant", "acme", "--role", "admin", "--name", "test"],
                         env=operator, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    key = run.stdout.strip().splitlines()[-1]
    auth = {"Authorization": f"ApiKey {key}"}

    apis = []
    for i in range(services["api"].replicas):
        port = _free_port()
        cluster.start(services["api"], f"api-{i + 1}", port=port)
        apis.append(f"http://127.0.0.1:{port}")
    workers = [cluster.start(services["worker"], f"worker-{i + 1}", "--hostname", f"worker-{i + 1}@%h")
               for i in range(services["worker"].replicas)]  # each container has a host name of its own
    cluster.start(services["beat"], "beat")
    for i in range(services["consumer"].replicas):
        cluster.start(services["consumer"], f"consumer-{i + 1}")
    flower_port = _free_port()
    cluster.start(services["flower"], "flower", port=flower_port)
    flower_auth = tuple(services["flower"].env["FLOWER_BASIC_AUTH"].split(":", 1))

    def answers(url: str) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url, timeout=2).status_code == 200
        return False

    for url in apis:
        cluster.wait(lambda url=url: answers(f"{url}/healthz"), 120, f"{url} to answer")
    flower = f"http://127.0.0.1:{flower_port}"
    cluster.wait(lambda: answers(f"{flower}/healthcheck"), 120, "Flower to answer")

    # A data source and a 4-shard HNSW index, through the first API.
    source = {"name": "Docs", "version": "1", "vectorDimension": DIM, "attributeValueTypes": {"id": "int64"},
              "permanentAttributes": ["id"]}
    assert httpx.post(f"{apis[0]}/api/v1/data-sources", json=source, headers=auth).status_code == 201
    index = {"name": "Docs.Index", "version": "1", "dataSourceName": "Docs", "dataSourceVersion": "1",
             "algorithm": "hnsw", "metric": "euclidean", "shardCount": 4,
             "params": {"M": 16, "ef_construction": 200, "ef_search": 64}}
    r = httpx.post(f"{apis[1]}/api/v1/indexes", json=index, headers=auth)
    assert r.status_code == 201, r.text

    # One worker is SIGKILLed as soon as Flower shows it building a shard, while the uploads go on.
    host = socket.gethostname()
    names = [f"worker-{i + 1}@{host}" for i in range(len(workers))]
    killed: list[str] = []

    def kill_a_builder() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            started = {t.get("worker") for t in _flower_tasks(flower, flower_auth, "STARTED").values()}
            for name, proc in zip(names, workers, strict=True):
                if name in started:
                    proc.killed_on_purpose = True  # type: ignore[attr-defined]
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
                    killed.append(name)
                    return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_a_builder, daemon=True)
    killer.start()

    # Uploads through both API processes and the broker, interleaved.
    rng = np.random.default_rng(16)
    total = 3 * BATCHES_PER_WAY * BATCH
    vectors = rng.standard_normal((total, DIM)).astype(np.float32)
    tokens: list[int] = []
    published: list[str] = []
    settings = Settings(**{k.removeprefix("SHOAL_").lower(): v for k, v in operator.items()
                           if k.startswith("SHOAL_") and v != ""} | {"tenant": "acme"})
    with Publisher(settings, tenant="acme") as publisher:
        for b in range(3 * BATCHES_PER_WAY):
            ids = np.arange(b * BATCH, (b + 1) * BATCH)
            way = b % 3
            if way == 2:
                published.append(publisher.publish_columns("Docs", "1", vectors[ids], {"id": ids}))
                continue
            body = [{"attributes": [{"key": "id", "value": {"int64": int(i)}}],
                     "vector": {"isSparse": False, "coordinates": vectors[i].tolist()}} for i in ids]
            for _ in range(120):
                r = httpx.post(f"{apis[way]}/api/v1/upload/Docs/1", json=body, headers=auth, timeout=60)
                if r.status_code != 429:
                    break
                time.sleep(float(r.headers.get("Retry-After", "1")))  # backpressure: retry as the answer says
            assert r.status_code == 200, r.text
            tokens.append(int(r.headers["X-Shoal-Write-Token"]))
    killer.join(300)
    assert killed, "no worker was seen building a shard"

    with Shoal(settings, notify=False) as shoal:
        def consumed() -> bool:
            found = [shoal.message_token("Docs", "1", m) for m in published]
            if all(found):
                tokens.extend(t.seq for t in found)  # type: ignore[union-attr]
                return True
            return False

        cluster.wait(consumed, 120, "the consumers to commit every published message")
        head = max(tokens)

        # The surviving worker finishes the index.
        def built() -> bool:
            return all(s.built_watermark >= head for s in shoal.index_status("Docs.Index", "1"))

        cluster.wait(built, 600, "the surviving worker to build every shard up to the head")

        # Flower lists materialization tasks of both workers.
        hosts = {t.get("worker") for t in _flower_tasks(flower, flower_auth, None).values()}
        assert set(names) <= hosts, hosts

        # Beat runs its schedule from its one process; the workers run none.
        cluster.wait(lambda: "Sending due task" in cluster.log("beat"), 120, "beat to send a scheduled task")
        for w in ("worker-1", "worker-2"):
            assert "beat: Starting" not in cluster.log(w)

        # Both API processes answer the same at at_least(token).
        query = {"k": 10, "queryVectors": [{"isSparse": False, "coordinates": vectors[7].tolist()}]}
        headers = auth | {"X-Shoal-Required-Token": str(head)}

        def same_answer() -> bool:
            got = [httpx.post(f"{url}/api/v1/search/Docs.Index/1", json=query, headers=headers, timeout=30)
                   for url in apis]
            assert all(r.status_code == 200 for r in got), [r.text for r in got]
            return got[0].content == got[1].content  # equal once both serve the same version

        cluster.wait(same_answer, 60, "both API processes to give the same answer")
        [result] = httpx.post(f"{apis[0]}/api/v1/search/Docs.Index/1", json=query, headers=headers).json()
        assert result["nearestDataPoints"][0]["attributes"][0]["value"]["int64"] == 7

        # The folded state is exactly what was acknowledged.
        folded = shoal.fold("Docs", "1")
        ids = folded["id"].to_numpy()
        order = np.argsort(ids)
        assert np.array_equal(ids[order], np.arange(total))
        stored = np.stack(folded[VECTOR].to_numpy(zero_copy_only=False)[order]).astype(np.float32)
        assert np.array_equal(stored, vectors)


def _flower_tasks(base: str, auth: Any, state: str | None) -> dict[str, dict[str, Any]]:
    """Flower's materialization tasks (in `state`), by task id; {} while Flower does not answer."""
    params = {"taskname": "shoal.workers.tasks.materialize_shard"} | ({"state": state} if state else {})
    try:
        r = httpx.get(f"{base}/api/tasks", params=params, auth=auth, timeout=5)
    except httpx.HTTPError:
        return {}
    return r.json() if r.status_code == 200 else {}


def test_the_compose_file_keeps_secrets_out_of_the_image() -> None:
    """Every Shoal service reads its settings at run time from the operator's env file, and the committed examples
    hold placeholders only."""
    services = shoal_services()
    for service in services.values():
        assert service.env.get("SHOAL_DATABASE_URL"), service.name
    # The image sets no setting but where its data lives.
    instructions = [line.split(None, 1) for line in (ROOT / "docker" / "Dockerfile").read_text().splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    settings = [rest for word, *rest in instructions if word.upper() in ("ENV", "ARG")]
    assert settings == [["SHOAL_DATA_DIR=/data"]], settings
    for example in CONFIG.glob("*.example"):
        text = example.read_text()
        for line in text.splitlines():
            if any(word in line.upper() for word in ("PASSWORD=", "SECRET_KEY=", "TOKEN=", "BASIC_AUTH=")):
                assert "CHANGE-ME" in line, f"{example.name}: {line}"
