"""API bench: Shoal's HTTP API (uvicorn in a separate process) against the in-process Python API, same run.

Run by hand, never in CI (see bench/README.md, "API bench"):

    .venv/bin/python bench/api.py                 # the default bench, about 2-3 minutes on 2 cores
    .venv/bin/python bench/api.py --quick         # a scaled-down pass (under a minute)
    .venv/bin/python bench/api.py --profile       # + an untimed py-spy pass per HTTP case (server's GIL time)

Data: /work/shared/data/debian-packages (override with SHOAL_BENCH_DATA): base_f16.npy (59,004 real
all-MiniLM-L6-v2 vectors, 384-d, float16 widened to float32), queries_f16.npy (1,000 held-out queries),
points.parquet (package, installed_size_kb of each base row).

What it measures, each HTTP figure beside the in-process figure of the same work in the same run:

1. Upload points/s: `POST /api/v1/upload/{ds}/1` with Vektonn JSON, batches of 100 and 1,000 points, from 1 and
   8 concurrent clients (threads, one `httpx.Client` each), against `Producer.upload([DataPoint, ...])` of the
   same points from 1 and 8 threads of this process (`Shoal(settings, tenant="bench")`). A point counts when its
   upload is acknowledged (durable and committed).
2. Single-query search QPS: `POST /api/v1/search/{index}/1` with one query vector and k=10, from 1 and 8
   concurrent clients, against `Searcher.search` (`shoal.searcher(follow=False)`) one query per call from 1 and
   8 threads, on an HNSW index (M=16, ef_construction=200, ef_search=64, cosine) over the first 20,000 base
   rows, materialized in this process with `ShardBuilder.materialize` before any search. Recall@10 of both is
   measured against an exact numpy brute force over the same rows.

The API runs as `python -m shoal.cli api` in its own process, on the same catalog (an embedded Postgres in a
temp dir), storage and broker (an embedded Valkey in the same temp dir) as this process. Everything it starts is
stopped and removed at the end, also on errors, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow.parquet as pq
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shoal.catalog.db import resolve_database_url
from shoal.client import Shoal
from shoal.config.settings import Settings
from shoal.indexing.builder import ShardBuilder
from shoal.records import DataPoint, DataSourceSpec, IndexSpec

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "debian-packages"  # ../shared beside the repo
DATA_DIR = Path(os.environ.get("SHOAL_BENCH_DATA", SHARED))
TENANT = "bench"
ATTRIBUTES = {"id": "int64", "package": "string", "installed_size_kb": "int64"}
HNSW_PARAMS = {"M": 16, "ef_construction": 200, "ef_search": 64}
K = 10
UPLOAD_POOL = 20_000  # upload cases cycle through the first rows of the base (their JSON is encoded once)
# Timed points per upload case and side, per batch size; sized so the default bench takes 2-3 minutes on 2 cores.
DEFAULT_UPLOAD_POINTS = {100: 16_000, 1_000: 40_000}
QUICK_UPLOAD_POINTS = {100: 4_000, 1_000: 8_000}
console = Console(width=None if sys.stdout.isatty() else 170)


# -- data -----------------------------------------------------------------------------------------------


@dataclass
class Data:
    base: np.ndarray  # [N, 384] float32
    queries: np.ndarray  # [Q, 384] float32
    gt: np.ndarray  # [Q, 100] exact top-100 row numbers over the whole base
    package: list[str]
    size: np.ndarray  # int64
    coords_json: list[str] = field(default_factory=list)  # JSON of base[i] for i < UPLOAD_POOL
    package_json: list[str] = field(default_factory=list)
    query_bodies: list[bytes] = field(default_factory=list)  # one search request body per query

    def upload_body(self, ids: range, rows: list[int]) -> bytes:
        """Vektonn upload JSON for points (id, row): the vector and attributes of base row `row`."""
        parts = [
            f'{{"attributes":[{{"key":"id","value":{{"int64":{i}}}}},'
            f'{{"key":"package","value":{{"string":{self.package_json[r]}}}}},'
            f'{{"key":"installed_size_kb","value":{{"int64":{self.size[r]}}}}}],'
            f'"vector":{{"isSparse":false,"coordinates":{self.coords_json[r]}}},"isDeleted":false}}'
            for i, r in zip(ids, rows, strict=True)
        ]
        return ("[" + ",".join(parts) + "]").encode()

    def points(self, ids: range, rows: list[int]) -> list[DataPoint]:
        """The same points as `upload_body`, as the Python API takes them."""
        return [
            DataPoint({"id": i, "package": self.package[r], "installed_size_kb": int(self.size[r])}, self.base[r])
            for i, r in zip(ids, rows, strict=True)
        ]


def load_data() -> Data:
    base = np.load(DATA_DIR / "base_f16.npy").astype(np.float32)
    queries = np.load(DATA_DIR / "queries_f16.npy").astype(np.float32)
    gt = np.load(DATA_DIR / "gt.npy")
    table = pq.read_table(DATA_DIR / "points.parquet", columns=["id", "package", "installed_size_kb"])
    if table.num_rows != base.shape[0] or not np.array_equal(table["id"].to_numpy(), np.arange(base.shape[0])):
        raise RuntimeError("points.parquet `id` is not the row number of base_f16.npy")
    data = Data(base, queries, gt, table["package"].to_pylist(), table["installed_size_kb"].to_numpy().astype(np.int64))
    pool = min(UPLOAD_POOL, base.shape[0])
    # float32 -> Python float is exact, and json writes the shortest repr that round-trips: the server parses
    # back exactly the float32 values the in-process side uploads.
    data.coords_json = [json.dumps(v) for v in base[:pool].tolist()]
    data.package_json = [json.dumps(p) for p in data.package[:pool]]
    data.query_bodies = [
        json.dumps({"k": K, "queryVectors": [{"isSparse": False, "coordinates": q}]}).encode() for q in queries.tolist()
    ]
    return data


def truth(data: Data, n: int) -> tuple[np.ndarray, str]:
    """Exact top-K row numbers per query among the first n base rows (cosine, numpy brute force), with a
    cross-check against gt.npy restricted to rows < n."""
    base = data.base[:n] / np.linalg.norm(data.base[:n], axis=1, keepdims=True)
    q = data.queries / np.linalg.norm(data.queries, axis=1, keepdims=True)
    scores = q @ base.T
    top = np.argpartition(-scores, K, axis=1)[:, :K]
    order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1)
    exact = np.take_along_axis(top, order, axis=1)
    checked = agree = 0
    for i, row in enumerate(data.gt):
        keep = row[row < n][:K]
        if len(keep) == K:  # enough of the global top-100 fall in the subset to know its top-K
            checked += 1
            agree += len(set(keep.tolist()) & set(exact[i].tolist()))
    note = (
        f"ground truth: numpy brute force (cosine) over base rows 0..{n - 1:,}; on the {checked} queries whose "
        f"gt.npy top-100 holds at least {K} of those rows, its top-{K} agrees with gt.npy's on "
        f"{agree / max(1, checked * K):.4f} of the ids"
    )
    return exact, note


def recall(found: dict[int, list[int]], exact: np.ndarray) -> float:
    hits = sum(len(set(ids) & set(exact[q].tolist())) for q, ids in found.items())
    return hits / (K * len(found)) if found else float("nan")


# -- CPU accounting -----------------------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    # Fields after the command name: state is [0], ppid [1], utime [11], stime [12], cutime [13], cstime [14].
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_cpu(pid: int) -> float:
    """CPU seconds of a process, all its threads."""
    try:
        f = _stat(pid)
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / TICK


def tree_cpu(root: int) -> float:
    """CPU seconds of `root`, its reaped children and its live children (Postgres: postmaster and backends)."""
    try:
        f = _stat(root)
    except OSError:
        return 0.0
    total = sum(int(x) for x in f[11:15])
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                g = _stat(int(entry.name))
            except OSError:
                continue
            if int(g[1]) == root:
                total += int(g[11]) + int(g[12])
    return total / TICK


class Meter:
    """CPU seconds spent, over a window, by this process, the API server and the embedded Postgres."""

    def __init__(self, server_pid: int | None, postmaster: int | None) -> None:
        self.server_pid = server_pid
        self.postmaster = postmaster

    def _others(self) -> tuple[float, float]:
        return (
            tree_cpu(self.server_pid) if self.server_pid else 0.0,  # uvicorn's worker processes, if any
            tree_cpu(self.postmaster) if self.postmaster else float("nan"),
        )

    def start(self) -> tuple[float, float, float]:
        server, pg = self._others()  # scanning /proc costs this process CPU: before its own clock is read
        return time.process_time(), server, pg

    def stop(self) -> tuple[float, float, float]:
        own = time.process_time()
        return (own, *self._others())


@dataclass
class Side:
    """Accumulated timed work of one side (HTTP or in-process) of a case."""

    requests: int = 0
    points: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    cpu_bench: float = 0.0  # this process (HTTP: the clients; in-process: everything but Postgres)
    cpu_server: float = 0.0  # the API server process (HTTP only)
    cpu_pg: float = 0.0  # embedded Postgres, all its processes
    commits: int = 0
    found: dict[int, list[int]] = field(default_factory=dict)  # search: query number -> ids returned

    def rate(self) -> float:
        return self.points / self.seconds if self.seconds else 0.0

    def pct(self, p: float) -> float:
        return float(np.percentile(self.latencies, p)) * 1e3 if self.latencies else float("nan")

    def cpu_ms(self, what: str) -> float:
        return getattr(self, f"cpu_{what}") / self.requests * 1e3 if self.requests else float("nan")


@dataclass
class Case:
    kind: str  # upload | search
    batch: int  # points per request (1 for search)
    clients: int
    http: Side = field(default_factory=Side)
    local: Side = field(default_factory=Side)
    profile: Counter[str] = field(default_factory=Counter)  # py-spy samples per group (--profile)

    @property
    def label(self) -> str:
        if self.kind == "upload":
            return f"upload × {self.batch:,} ({self.clients} client{'s' if self.clients > 1 else ''})"
        return f"search k={K} ({self.clients} client{'s' if self.clients > 1 else ''})"


def run_round(workers: int, items: list[Any], call: Callable[[int, Any], Any], side: Side, meter: Meter) -> list[Any]:
    """`workers` threads take items from a shared queue and call call(worker, item); each call is one request.
    Adds elapsed wall time, per-request latencies and CPU to `side`; returns the results in item order."""
    results: list[Any] = [None] * len(items)
    latencies = [0.0] * len(items)
    lock = threading.Lock()
    nxt = [0]
    errors: list[BaseException] = []
    barrier = threading.Barrier(workers + 1)
    stop = threading.Event()

    def work(w: int) -> None:
        try:
            barrier.wait()
            while True:
                with lock:
                    j = nxt[0]
                    nxt[0] += 1
                if j >= len(items) or errors or stop.is_set():
                    return
                t0 = time.perf_counter()
                results[j] = call(w, items[j])
                latencies[j] = time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()
    c0 = meter.start()
    try:
        barrier.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
    except BaseException:
        # Ctrl-C or SIGTERM: no new requests, so the server's graceful shutdown has only in-flight ones to finish.
        stop.set()
        barrier.abort()
        raise
    elapsed = time.perf_counter() - t0
    c1 = meter.stop()
    if errors:
        raise errors[0]
    side.seconds += elapsed
    side.requests += len(items)
    side.latencies += latencies
    side.cpu_bench += c1[0] - c0[0]
    side.cpu_server += c1[1] - c0[1]
    side.cpu_pg += c1[2] - c0[2]
    return results


# -- the API server in its own process ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`python -m shoal.cli api` on a loopback port, with the bench's catalog, storage and broker."""

    def __init__(
        self, settings: Settings, database_url: str, storage_uri: str, log: Path, no_access_log: bool, workers: int
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        env = dict(os.environ)
        env.update(
            {
                "SHOAL_DATA_DIR": str(settings.data_dir),
                "SHOAL_DATABASE_URL": database_url,
                "SHOAL_STORAGE_URI": storage_uri,
                "SHOAL_REDIS_URL": str(settings.redis_url),
                "SHOAL_TENANT": TENANT,
                "SHOAL_ANONYMOUS_TENANT": TENANT,
            }
        )
        if no_access_log:
            # The same app, served by uvicorn directly without its per-request access log line.
            cmd = [
                sys.executable,
                "-m",
                "uvicorn",
                "--factory",
                "shoal.api.app:create_app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--no-access-log",
                "--log-level",
                "warning",
                "--workers",
                str(workers),
            ]
        else:
            cmd = [sys.executable, "-m", "shoal.cli", "api", "--host", "127.0.0.1", "--port", str(self.port)]
            if workers > 1:
                cmd += ["--workers", str(workers)]
        self.command = " ".join(cmd[1:])
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[1],
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the API server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the API server did not answer /healthz within {timeout:.0f}s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        self._log.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown (lifespan closes the searchers)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class Clients:
    """One `httpx.Client` per concurrent client, kept for a whole case (keep-alive connections)."""

    def __init__(self, url: str, n: int) -> None:
        self.http = [httpx.Client(base_url=url, timeout=120) for _ in range(n)]

    def post(self, w: int, path: str, body: bytes) -> httpx.Response:
        r = self.http[w].post(path, content=body, headers={"Content-Type": "application/json"})
        if r.status_code != 200:
            raise RuntimeError(f"POST {path}: {r.status_code} {r.text[:500]}")
        return r

    def close(self) -> None:
        for c in self.http:
            c.close()


# -- py-spy ------------------------------------------------------------------------------------------

# Each sample goes to the group of its innermost frame that matches one (checked leaf first).
BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("JSON decode/encode (stdlib json)", ("/json/",)),
    ("access log (logging)", ("/logging/",)),
    (
        "pydantic: request validation, response serialization",
        ("/pydantic/", "/pydantic_core/", "fastapi/_compat", "fastapi/encoders"),
    ),
    ("catalog round trips (SQLAlchemy, psycopg)", ("/sqlalchemy/", "/psycopg/", "/psycopg_pool/")),
    ("log writer: validate, encode, fsync, commit", ("shoal/ingest/", "/pyarrow/")),
    ("search: searcher, hnswlib, merge", ("shoal/searcher/", "shoal/engines/", "shoal/artifacts/")),
    ("DTO <-> records (shoal/api/convert.py)", ("shoal/api/convert",)),
    ("auth, tenant, metrics", ("shoal/auth/", "shoal/api/security", "shoal/api/state", "prometheus_client")),
    ("HTTP parsing and transport (h11, uvicorn)", ("/h11/", "uvicorn/protocols", "uvicorn/server")),
    ("FastAPI/Starlette routing, body read, dependencies", ("/fastapi/", "/starlette/")),
    (
        "event loop, threadpool hand-off (asyncio, anyio)",
        ("/asyncio/", "/anyio/", "/concurrent/", "threading.py", "/selectors"),
    ),
]


def bucket_of(stack: str) -> str:
    frames = stack.split(";")
    for frame in reversed(frames):
        for name, needles in BUCKETS:
            if any(n in frame for n in needles):
                return name
    return "other"


class Profiler:
    """py-spy record of the API server over an untimed extra pass: samples of the thread holding the GIL.

    (`--gil`: py-spy's idle detection does not work in this VM, so without it threads blocked in epoll, queue waits
    and Postgres round trips would count as busy. GIL samples are the server's Python CPU time; native work that
    releases the GIL, such as hnswlib and fsync, does not show.)"""

    def __init__(self, pid: int, out: Path, rate: int, subprocesses: bool) -> None:
        self.out = out
        self.log = out.with_suffix(".log")
        self._log = open(self.log, "wb")  # noqa: SIM115 - closed in stop(); a file, so py-spy never blocks on a pipe
        self.proc = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("py-spy")),
                "record",
                "--pid",
                str(pid),
                "--rate",
                str(rate),
                "--format",
                "raw",
                "--gil",
                "--nonblocking",
                "--full-filenames",
                "--output",
                str(out),
                *(["--subprocesses"] if subprocesses else []),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        time.sleep(1.0)  # py-spy attaches
        if self.proc.poll() is not None:
            self._log.close()
            raise RuntimeError(f"py-spy failed: {self.log.read_text(errors='replace')[:500]}")

    def stop(self) -> Counter[str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        counts: Counter[str] = Counter()
        if self.out.is_file():
            for line in self.out.read_text(errors="replace").splitlines():
                stack, _, n = line.rpartition(" ")
                if n.isdigit():
                    counts[bucket_of(stack)] += int(n)
        return counts


def have_py_spy() -> bool:
    return Path(sys.executable).with_name("py-spy").is_file()


# -- the cases -----------------------------------------------------------------------------------------


class Ids:
    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> range:
        first, self.next = self.next, self.next + n
        return range(first, first + n)


def split_rounds(requests: int, clients: int, rounds: int) -> list[int]:
    """Requests per interleaved round: at most `rounds` rounds of at least 2 requests per client each, every round
    a multiple of `clients` (no round ends with idle clients waiting for a straggler wave); total rounded up."""
    rounds = max(1, min(rounds, requests // (2 * clients)))
    each = -(-requests // (rounds * clients)) * clients
    return [each] * rounds


def upload_case(
    shoal: Shoal,
    data: Data,
    server: Server,
    meter: Meter,
    batch: int,
    clients: int,
    points: int,
    rounds: int,
    args: argparse.Namespace,
    tmp: Path,
) -> Case:
    case = Case("upload", batch, clients)
    tag = uuid.uuid4().hex[:6]
    names = {"http": f"bench-api-http-b{batch}-c{clients}-{tag}", "local": f"bench-api-local-b{batch}-c{clients}-{tag}"}
    for name in names.values():
        shoal.create_data_source(DataSourceSpec(name, "1", data.base.shape[1], ATTRIBUTES, ["id"]))
    producer = shoal.producer(names["local"], "1")
    http = Clients(server.url, clients)
    path = f"/api/v1/upload/{names['http']}/1"
    ids = {"http": Ids(), "local": Ids()}
    pool = len(data.coords_json)
    row = [0]

    def rows(n: int) -> list[int]:
        out = [(row[0] + j) % pool for j in range(n)]
        row[0] = (row[0] + n) % pool
        return out

    def http_items(requests: int) -> list[bytes]:
        return [data.upload_body(ids["http"].take(batch), rows(batch)) for _ in range(requests)]

    def local_items(requests: int) -> list[list[DataPoint]]:
        return [data.points(ids["local"].take(batch), rows(batch)) for _ in range(requests)]

    def http_call(w: int, body: bytes) -> None:
        http.post(w, path, body)

    def local_call(w: int, items: list[DataPoint]) -> None:
        producer.upload(items)

    try:
        # Warm-up, untimed: one request per client and side (connections, threadpool, catalog pools, code paths).
        run_round(clients, http_items(clients), http_call, Side(), meter)
        run_round(clients, local_items(clients), local_call, Side(), meter)
        heads = {k: shoal.get_data_source(n, "1").head_seq for k, n in names.items()}
        per_round = split_rounds(-(-points // batch), clients, rounds)
        for r, n in enumerate(per_round):
            if n == 0:
                continue
            for side in ("http", "local") if r % 2 == 0 else ("local", "http"):
                if side == "http":
                    items: list[Any] = http_items(n)  # request bodies are made before the clock starts
                    run_round(clients, items, http_call, case.http, meter)
                    case.http.points += n * batch
                else:
                    items = local_items(n)
                    run_round(clients, items, local_call, case.local, meter)
                    case.local.points += n * batch
                del items
        # Sanity: each log grew by exactly the acknowledged points.
        for k, name in names.items():
            side_ = case.http if k == "http" else case.local
            grown = shoal.get_data_source(name, "1").head_seq - heads[k]
            if grown != side_.points:
                raise RuntimeError(f"{name}: {side_.points} points acknowledged but the log grew by {grown}")
            side_.commits = sum(1 for s in shoal.log_segments(name, "1") if s.first_seq > heads[k])
        if args.profile:
            prof = Profiler(
                server.pid, tmp / f"pyspy-upload-b{batch}-c{clients}.txt", args.profile_rate, args.workers > 1
            )
            try:
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < args.profile_seconds:
                    run_round(clients, http_items(max(clients, per_round[0])), http_call, Side(), meter)
            finally:
                case.profile = prof.stop()
    finally:
        http.close()
        if not args.keep:
            for name in names.values():
                shoal.drop_data_source(name, "1")
    return case


@dataclass
class SearchSetup:
    index: str
    n: int
    exact: np.ndarray
    ingest_s: float
    materialize_s: float
    note: str


def search_setup(shoal: Shoal, data: Data, n: int) -> SearchSetup:
    name = f"bench-api-search-{uuid.uuid4().hex[:6]}"
    shoal.create_data_source(DataSourceSpec(name, "1", data.base.shape[1], ATTRIBUTES, ["id"]))
    producer = shoal.producer(name, "1")
    t0 = time.perf_counter()
    for s in range(0, n, 10_000):
        e = min(n, s + 10_000)
        producer.upload_columns(
            data.base[s:e],
            {"id": np.arange(s, e, dtype=np.int64), "package": data.package[s:e], "installed_size_kb": data.size[s:e]},
        )
    ingest_s = time.perf_counter() - t0
    index = shoal.create_index(
        IndexSpec(name, "1", name, "1", algorithm="hnsw", metric="cosine", params=HNSW_PARAMS, id_attributes=["id"])
    )
    t0 = time.perf_counter()
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for shard in index.shards:
        builder.materialize(shard.id)
    materialize_s = time.perf_counter() - t0
    exact, note = truth(data, n)
    return SearchSetup(name, n, exact, ingest_s, materialize_s, note)


def search_case(
    shoal: Shoal,
    searcher: Any,
    data: Data,
    setup: SearchSetup,
    server: Server,
    meter: Meter,
    clients: int,
    queries: int,
    rounds: int,
    args: argparse.Namespace,
    tmp: Path,
) -> Case:
    case = Case("search", 1, clients)
    http = Clients(server.url, clients)
    path = f"/api/v1/search/{setup.index}/1"
    nq = len(data.queries)

    def http_call(w: int, q: int) -> list[int]:
        [result] = http.post(w, path, data.query_bodies[q]).json()
        hits = result["nearestDataPoints"]
        return [next(a["value"]["int64"] for a in p["attributes"] if a["key"] == "id") for p in hits]

    def local_call(w: int, q: int) -> list[int]:
        [hits] = searcher.search(setup.index, "1", data.queries[q : q + 1], K)
        return [int(h.attributes["id"]) for h in hits]

    try:
        # Warm-up, untimed: the server's searcher loads the active version on its first search.
        warm = list(range(max(16, 4 * clients)))
        run_round(clients, warm, http_call, Side(), meter)
        run_round(clients, warm, local_call, Side(), meter)
        per_round = split_rounds(queries, clients, rounds)
        done = 0
        for r, n in enumerate(per_round):
            qs = [(done + j) % nq for j in range(n)]
            for side in ("http", "local") if r % 2 == 0 else ("local", "http"):
                target = case.http if side == "http" else case.local
                out = run_round(clients, qs, http_call if side == "http" else local_call, target, meter)
                target.points += n
                for q, found in zip(qs, out, strict=True):
                    target.found.setdefault(q, found)
            done += n
        if args.profile:
            prof = Profiler(server.pid, tmp / f"pyspy-search-c{clients}.txt", args.profile_rate, args.workers > 1)
            try:
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < args.profile_seconds:
                    run_round(clients, [j % nq for j in range(max(per_round))], http_call, Side(), meter)
            finally:
                case.profile = prof.stop()
    finally:
        http.close()
    return case


# -- the server's path, step by step, in this process -------------------------------------------------------


class Counts:
    """Catalog sessions (pool checkouts) and SQL statements on an engine, counted through SQLAlchemy events."""

    def __init__(self, engine: Any) -> None:
        from sqlalchemy import event

        self.checkouts = self.statements = 0
        self._engine = engine
        self._event = event

        def on_checkout(*_: Any) -> None:
            self.checkouts += 1

        def on_execute(*_: Any) -> None:
            self.statements += 1

        self._hooks = [(engine.pool, "checkout", on_checkout), (engine, "before_cursor_execute", on_execute)]
        for target, name, fn in self._hooks:
            event.listen(target, name, fn)

    def close(self) -> None:
        for target, name, fn in self._hooks:
            self._event.remove(target, name, fn)


@dataclass
class Step:
    name: str
    ms: float  # median per request
    checkouts: float = 0.0  # per request
    statements: float = 0.0


@dataclass
class Steps:
    case: str
    steps: list[Step]
    reference: Step  # the in-process call of the same work
    http_p50_ms: float = float("nan")  # from the timed 1-client case, filled in later
    server_cpu_ms: float = float("nan")


def timed_steps(reps: int, steps: list[tuple[str, Callable[[Any], Any]]], counts: Counts, first: Any) -> list[Step]:
    """Run the chain of steps `reps` times (each step gets the previous step's result); median ms per step."""
    times: dict[str, list[float]] = {name: [] for name, _ in steps}
    per: dict[str, list[int]] = {name: [0, 0] for name, _ in steps}
    for r in range(reps):
        value = first(r)
        for name, fn in steps:
            c0, s0 = counts.checkouts, counts.statements
            t0 = time.perf_counter()
            value = fn(value)
            times[name].append(time.perf_counter() - t0)
            per[name][0] += counts.checkouts - c0
            per[name][1] += counts.statements - s0
    return [
        Step(name, float(np.median(times[name])) * 1e3, per[name][0] / reps, per[name][1] / reps) for name, _ in steps
    ]


def upload_steps(shoal: Shoal, data: Data, batch: int, reps: int) -> Steps:
    """What `POST /api/v1/upload` does with one batch, re-timed step by step with the functions the route calls."""
    from pydantic import TypeAdapter

    from shoal.api.convert import points_from_dtos
    from shoal.api.dto import InputDataPointOrTombstoneDto

    name = f"bench-api-steps-b{batch}-{uuid.uuid4().hex[:6]}"
    shoal.create_data_source(DataSourceSpec(name, "1", data.base.shape[1], ATTRIBUTES, ["id"]))
    body_type = TypeAdapter(list[InputDataPointOrTombstoneDto])
    ids = Ids()
    pool = len(data.coords_json)
    counts = Counts(shoal.engine)
    try:
        shoal.producer(name, "1").upload(data.points(ids.take(batch), list(range(batch))))  # warm-up
        rows = [[(r * batch + j) % pool for j in range(batch)] for r in range(reps)]
        bodies = [data.upload_body(ids.take(batch), rows[r]) for r in range(reps)]
        state: dict[str, Any] = {}

        def lookup(dtos: Any) -> Any:
            state["producer"] = shoal.producer(name, "1")  # the route looks the data source up per request
            return dtos

        def convert(dtos: Any) -> Any:
            return points_from_dtos(state["producer"].spec, dtos)

        steps = timed_steps(
            reps,
            [
                ("json.loads(body) (Starlette Request.json)", json.loads),
                ("pydantic: validate list[InputDataPointOrTombstoneDto]", body_type.validate_python),
                ("shoal.producer(name, version): data source lookup", lookup),
                ("points_from_dtos: DTOs -> DataPoints (vectors as lists)", convert),
                ("Producer.upload: validate, encode, fsync, commit", lambda items: state["producer"].upload(items)),
            ],
            counts,
            lambda r: bodies[r],
        )
        producer = shoal.producer(name, "1")
        points = [data.points(ids.take(batch), rows[r]) for r in range(reps)]
        [ref] = timed_steps(
            reps, [("in-process Producer.upload (numpy vectors)", producer.upload)], counts, lambda r: points[r]
        )
    finally:
        counts.close()
        shoal.drop_data_source(name, "1")
    return Steps(f"upload × {batch:,}", steps, ref)


def search_steps(shoal: Shoal, searcher: Any, data: Data, setup: SearchSetup, reps: int) -> Steps:
    """What `POST /api/v1/search` does with one query, re-timed step by step with the functions the route calls."""
    from pydantic import TypeAdapter

    from shoal.api.convert import hit_dto, query_vectors, vector_dto
    from shoal.api.dto import SearchQueryDto, SearchResultDto

    out_type = TypeAdapter(list[SearchResultDto])
    nq = len(data.queries)
    counts = Counts(shoal.engine)
    state: dict[str, Any] = {}

    def parse(body: bytes) -> SearchQueryDto:
        return SearchQueryDto.model_validate(json.loads(body))

    def lookup(query: SearchQueryDto) -> SearchQueryDto:
        index = shoal.get_index(setup.index, "1")
        state["source"] = shoal.get_data_source(index.spec.source_name, index.spec.source_version).spec
        return query

    def search(query: SearchQueryDto) -> Any:
        vectors = query_vectors(state["source"], query.queryVectors)
        state["vectors"] = vectors
        return searcher.search(setup.index, "1", vectors, query.k)

    def dtos(results: Any) -> list[SearchResultDto]:
        return [
            SearchResultDto(queryVector=vector_dto(v), nearestDataPoints=[hit_dto(state["source"], h) for h in hits])
            for v, hits in zip(state["vectors"], results, strict=True)
        ]

    def respond(results: list[SearchResultDto]) -> bytes:
        # FastAPI with response_model: validate the returned value (in the threadpool), then dump_json.
        return out_type.dump_json(out_type.validate_python(results), by_alias=True, exclude_none=True)

    try:
        steps = timed_steps(
            reps,
            [
                ("json.loads + pydantic: validate SearchQueryDto", parse),
                ("get_index + get_data_source: catalog lookups", lookup),
                ("query_vectors + Searcher.search (lists in)", search),
                ("hit_dto / SearchResultDto: results -> DTOs", dtos),
                ("FastAPI response_model: validate + dump_json", respond),
            ],
            counts,
            lambda r: data.query_bodies[r % nq],
        )
        [ref] = timed_steps(
            reps,
            [("in-process Searcher.search (numpy query)", lambda q: searcher.search(setup.index, "1", q, K))],
            counts,
            lambda r: data.queries[r % nq : r % nq + 1],
        )
    finally:
        counts.close()
    return Steps(f"search k={K}", steps, ref)


# -- output --------------------------------------------------------------------------------------------


def fmt(x: float, digits: int = 0) -> str:
    return "n/a" if x != x else f"{x:,.{digits}f}"


def print_tables(cases: list[Case], setup: SearchSetup | None, args: argparse.Namespace) -> None:
    table = Table(title="Shoal HTTP API (uvicorn, separate process) vs in-process Python API, same run")
    table.add_column("case")
    table.add_column("HTTP", justify="right")
    table.add_column("in-process", justify="right")
    table.add_column("ratio\nHTTP/in-proc", justify="right")
    table.add_column("HTTP ms/req\np50 / p99", justify="right")
    table.add_column("in-proc ms/call\np50 / p99", justify="right")
    table.add_column("recall@10\nHTTP / in-proc", justify="right")
    table.add_column("commits\nHTTP / in-proc", justify="right")
    for c in cases:
        unit = "pts/s" if c.kind == "upload" else "QPS"
        ratio = c.http.rate() / c.local.rate() if c.local.rate() else float("nan")
        table.add_row(
            c.label,
            f"{fmt(c.http.rate())} {unit}",
            f"{fmt(c.local.rate())} {unit}",
            f"{ratio:.2f}x",
            f"{fmt(c.http.pct(50), 1)} / {fmt(c.http.pct(99), 1)}",
            f"{fmt(c.local.pct(50), 2)} / {fmt(c.local.pct(99), 2)}",
            f"{recall(c.http.found, setup.exact):.4f} / {recall(c.local.found, setup.exact):.4f}"
            if c.kind == "search" and setup
            else "",
            f"{c.http.commits:,} / {c.local.commits:,}" if c.kind == "upload" else "",
        )
    console.print(table)

    cpu = Table(title="CPU ms per request (per batch for uploads), measured from /proc over the timed windows")
    cpu.add_column("case")
    cpu.add_column("HTTP:\nserver", justify="right")
    cpu.add_column("HTTP:\nclients", justify="right")
    cpu.add_column("HTTP:\nPostgres", justify="right")
    cpu.add_column("HTTP\ntotal", justify="right")
    cpu.add_column("in-proc:\nprocess", justify="right")
    cpu.add_column("in-proc:\nPostgres", justify="right")
    cpu.add_column("in-proc\ntotal", justify="right")
    cpu.add_column("server ÷\nin-proc process", justify="right")
    for c in cases:
        h, lo = c.http, c.local
        pg_h, pg_l = h.cpu_ms("pg"), lo.cpu_ms("pg")
        tot_h = h.cpu_ms("server") + h.cpu_ms("bench") + (0 if pg_h != pg_h else pg_h)
        tot_l = lo.cpu_ms("bench") + (0 if pg_l != pg_l else pg_l)
        cpu.add_row(
            c.label,
            fmt(h.cpu_ms("server"), 2),
            fmt(h.cpu_ms("bench"), 2),
            fmt(pg_h, 2),
            fmt(tot_h, 2),
            fmt(lo.cpu_ms("bench"), 2),
            fmt(pg_l, 2),
            fmt(tot_l, 2),
            f"{h.cpu_ms('server') / lo.cpu_ms('bench'):.2f}x" if lo.cpu_ms("bench") else "n/a",
        )
    console.print(cpu)

    profiled = [c for c in cases if c.profile]
    if profiled:
        prof = Table(
            title="Where the API server's Python time goes: py-spy samples holding the GIL, untimed extra pass (%)"
        )
        prof.add_column("group (innermost matching frame)")
        for c in profiled:
            prof.add_column(c.label.replace(" (", "\n("), justify="right")
        names = [n for n, _ in BUCKETS] + ["other"]
        totals = [sum(c.profile.values()) or 1 for c in profiled]
        for name in names:
            if any(c.profile.get(name) for c in profiled):
                shares = [100 * c.profile.get(name, 0) / t for c, t in zip(profiled, totals, strict=True)]
                prof.add_row(name, *[f"{x:.1f}" for x in shares])
        prof.add_row("samples", *[f"{t:,}" for t in totals])
        console.print(prof)


def print_steps(all_steps: list[Steps]) -> None:
    table = Table(
        title="Where one request's server time goes: the route's steps re-timed one by one in this process "
        "(1 thread, median ms)"
    )
    table.add_column("case")
    table.add_column("step")
    table.add_column("ms", justify="right")
    table.add_column("% of\nsteps", justify="right")
    table.add_column("catalog\nsessions", justify="right")
    table.add_column("SQL\nstatements", justify="right")
    for st in all_steps:
        total = sum(x.ms for x in st.steps)
        r = st.reference
        for i, x in enumerate(st.steps):
            table.add_row(
                st.case if i == 0 else "",
                x.name,
                f"{x.ms:,.2f}",
                f"{100 * x.ms / total:.0f}",
                f"{x.checkouts:.1f}",
                f"{x.statements:.1f}",
            )
        table.add_row(
            "",
            f"[bold]sum of the route's steps ({total / r.ms:.1f}x the in-process call)[/]",
            f"[bold]{total:,.2f}[/]",
            "100",
            f"{sum(x.checkouts for x in st.steps):.1f}",
            f"{sum(x.statements for x in st.steps):.1f}",
        )
        table.add_row(
            "", f"[italic]{r.name}[/]", f"[italic]{r.ms:,.2f}[/]", "", f"{r.checkouts:.1f}", f"{r.statements:.1f}"
        )
        table.add_row(
            "",
            "for scale, from the timed 1-client case: HTTP p50 / server CPU per request",
            f"{fmt(st.http_p50_ms, 1)} / {fmt(st.server_cpu_ms, 1)}",
            "",
            "",
            "",
            end_section=True,
        )
    console.print(table)
    console.print(
        "The steps are timed after the HTTP cases, not interleaved with them: on a noisy machine their sum can land "
        "above or below the HTTP p50. What the route adds beyond its steps (h11 parsing, Starlette body read, "
        "threadpool hops: 2 for upload, 3 for search) shows in the --profile table."
    )


# -- main ----------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a scaled-down pass (under a minute)")
    p.add_argument("--batches", type=_ints, default=[100, 1_000], help="upload batch sizes (default 100,1000)")
    p.add_argument("--clients", type=_ints, default=[1, 8], help="concurrent clients (default 1,8)")
    p.add_argument(
        "--upload-points",
        type=int,
        default=None,
        help="timed points per upload case and side (default 16,000 for batch 100, 40,000 for 1,000)",
    )
    p.add_argument("--search-points", type=int, default=None, help="rows in the searched index (default 20,000)")
    p.add_argument("--queries", type=int, default=None, help="timed queries per search case and side (default 2,500)")
    p.add_argument("--rounds", type=int, default=4, help="interleaved HTTP/in-process rounds per case (default 4)")
    p.add_argument("--skip", type=lambda s: set(s.split(",")), default=set(), help="skip parts: upload,search")
    p.add_argument(
        "--no-access-log",
        action="store_true",
        help="serve with `python -m uvicorn --factory shoal.api.app:create_app --no-access-log` instead "
        "of `python -m shoal.cli api` (which logs a line per request)",
    )
    p.add_argument("--workers", type=int, default=1, help="uvicorn worker processes of the API (default 1)")
    p.add_argument("--profile", action="store_true", help="after each HTTP case, an untimed extra pass under py-spy")
    p.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second (default 250)")
    p.add_argument("--profile-seconds", type=float, default=4.0, help="length of each profiled pass (default 4)")
    p.add_argument("--no-steps", action="store_true", help="skip the step-by-step re-timing of the routes")
    p.add_argument(
        "--step-points",
        type=int,
        default=None,
        help="points per upload batch size for the step-by-step re-timing (default 12,000)",
    )
    p.add_argument("--storage", default=None, help="storage root (default SHOAL_STORAGE_URI or the temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir, data sources and server log")
    args = p.parse_args(argv)
    args.search_points = args.search_points or (10_000 if args.quick else 20_000)
    args.queries = args.queries or (600 if args.quick else 2_500)
    if args.profile and not have_py_spy():
        p.error(f"--profile needs py-spy beside {sys.executable} (.venv/bin/pip install py-spy)")
    return args


def upload_points(batch: int, args: argparse.Namespace) -> int:
    if args.upload_points:
        return args.upload_points
    return (QUICK_UPLOAD_POINTS if args.quick else DEFAULT_UPLOAD_POINTS).get(batch, 20 * batch)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    tmp = Path(tempfile.mkdtemp(prefix="shoal-api-bench-"))
    overrides: dict[str, Any] = {"data_dir": tmp}
    if args.storage:
        overrides["storage_uri"] = args.storage
    console.print(
        f"[bold]shoal API bench[/] python {platform.python_version()}, numpy {np.__version__}, "
        f"{os.cpu_count()} cpus, load average before the bench {_load()}"
    )
    t_start = time.perf_counter()
    cleanup: list[Callable[[], None]] = []
    cases: list[Case] = []
    notes: list[str] = []
    setup: SearchSetup | None = None
    all_steps: list[Steps] = []
    server: Server | None = None
    embedded = False
    try:
        console.print("loading data …")
        data = load_data()
        settings = Settings(**overrides)
        embedded = not settings.database_url
        if not settings.redis_url:
            from shoal.config.embedded import ensure_valkey

            settings = settings.model_copy(update={"redis_url": ensure_valkey(tmp)})
        settings = settings.model_copy(update={"tenant": TENANT})
        database_url = resolve_database_url(settings)  # starts the embedded Postgres
        shoal = Shoal(settings, tenant=TENANT)
        cleanup.append(shoal.close)
        storage_uri = shoal.storage.root if shoal.storage.local else settings.resolved_storage_uri
        postmaster = None
        pidfile = tmp / "postgres" / "postmaster.pid"
        if embedded and pidfile.is_file():
            postmaster = int(pidfile.read_text().split()[0])
        console.print(
            f"catalog: {'embedded Postgres in ' + str(tmp) if embedded else 'SHOAL_DATABASE_URL'}; "
            f"storage: {shoal.storage.root}; broker: {settings.redis_url}"
        )
        server = Server(settings, database_url, storage_uri, tmp / "api.log", args.no_access_log, args.workers)
        cleanup.append(server.stop)
        server.wait_ready()
        console.print(f"API server: pid {server.pid}, `{server.command}` on {server.url}")
        meter = Meter(server.pid, postmaster)

        if "upload" not in args.skip:
            console.print("[bold]1. upload[/] (Vektonn JSON over HTTP vs Producer.upload in this process)")
            for batch in args.batches:
                for clients in args.clients:
                    points = upload_points(batch, args)
                    t0 = time.perf_counter()
                    with console.status(f"upload × {batch:,}, {clients} clients: {points:,} points per side …"):
                        case = upload_case(shoal, data, server, meter, batch, clients, points, args.rounds, args, tmp)
                    cases.append(case)
                    console.print(
                        f"  {case.label}: HTTP {fmt(case.http.rate())} pts/s, in-process {fmt(case.local.rate())} "
                        f"pts/s ({time.perf_counter() - t0:.1f}s)"
                    )
            if not args.no_steps:
                for batch in args.batches:
                    with console.status(f"upload × {batch:,}: the route's steps one by one …"):
                        reps = max(3, (args.step_points or (4_000 if args.quick else 12_000)) // batch)
                        all_steps.append(upload_steps(shoal, data, batch, reps))

        if "search" not in args.skip:
            console.print("[bold]2. search[/] (one query per request, k=10, HNSW M=16 efC=200 ef=64, cosine)")
            with console.status(f"ingesting {args.search_points:,} points and materializing the index …"):
                # No notifications: nothing runs a worker here; the index is built in this process.
                builder_shoal = Shoal(settings, tenant=TENANT, notify=False)
                cleanup.append(builder_shoal.close)
                setup = search_setup(builder_shoal, data, min(args.search_points, data.base.shape[0]))
            if not args.keep:
                index_name = setup.index
                cleanup.append(lambda: builder_shoal.drop_data_source(index_name, "1"))
                cleanup.append(lambda: builder_shoal.drop_index(index_name, "1"))  # runs first: reversed order
            notes.append(setup.note)
            console.print(
                f"  index {setup.index}: {setup.n:,} points ingested in {setup.ingest_s:.1f}s, materialized in "
                f"{setup.materialize_s:.1f}s"
            )
            searcher = builder_shoal.searcher(follow=False)
            cleanup.append(searcher.close)
            for clients in args.clients:
                t0 = time.perf_counter()
                with console.status(f"search, {clients} clients: {args.queries:,} queries per side …"):
                    case = search_case(
                        builder_shoal,
                        searcher,
                        data,
                        setup,
                        server,
                        meter,
                        clients,
                        args.queries,
                        args.rounds,
                        args,
                        tmp,
                    )
                cases.append(case)
                console.print(
                    f"  {case.label}: HTTP {fmt(case.http.rate())} QPS, in-process {fmt(case.local.rate())} QPS "
                    f"({time.perf_counter() - t0:.1f}s)"
                )
            if not args.no_steps:
                with console.status("search: the route's steps one by one …"):
                    all_steps.append(search_steps(builder_shoal, searcher, data, setup, 100 if args.quick else 400))
    finally:
        for fn in reversed(cleanup):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - keep cleaning up
                console.print(f"cleanup: {exc!r}")
        from shoal.config.embedded import stop_embedded

        stop_embedded(tmp)  # the Valkey (and the Postgres, when embedded) under the temp dir
        if args.keep:
            console.print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print_tables(cases, setup, args)
    for st in all_steps:
        match = next((c for c in cases if c.label.split(" (")[0] == st.case and c.clients == 1), None)
        if match is not None:
            st.http_p50_ms, st.server_cpu_ms = match.http.pct(50), match.http.cpu_ms("server")
    if all_steps:
        print_steps(all_steps)
    assert server is not None
    console.print(
        escape(
            f"HTTP = `{server.command}` in its own process (uvicorn, {args.workers} worker(s), h11, sync routes in "
            f"the threadpool); "
            f"clients are threads of this process, one httpx.Client (keep-alive) each; request bodies are encoded "
            f"before the clock starts.\n"
            f"in-process = the same work through the Python API in this process: Producer.upload([DataPoint]) of the "
            f"same points (vectors as float32 numpy rows), Searcher.search(one query) on a searcher(follow=False).\n"
            f"upload: points/s acknowledged (durable + committed), ids unique, {args.rounds} interleaved rounds per "
            f"case; commits = log segments made in the timed part (group commit merges concurrent batches).\n"
            f"search: one query vector per request, k={K}, eventual consistency, attributes returned, no vectors; "
            f"{args.queries:,} queries per case and side, cycling through the {len(data.queries):,} held-out queries.\n"
            f"CPU: server = the API process; clients = this process while the HTTP side runs; Postgres = the embedded "
            f"postmaster and its backends; all over the timed windows only, so background work (the server's "
            f"searcher polling the catalog each second) is included."
        )
    )
    for note in notes:
        console.print(escape(note))
    console.print(f"total bench time {time.perf_counter() - t_start:.0f}s, load average after {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
