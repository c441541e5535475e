"""API bench: Shoal's HTTP API (uvicorn in a separate process) against the in-process Python API, same run.

Run by hand, never in CI (see bench/README.md, "API bench"):

    .venv/bin/python bench/api.py                 # the default bench, a few minutes on 2 cores
    .venv/bin/python bench/api.py --quick         # a scaled-down pass (under 2 minutes)
    .venv/bin/python bench/api.py --client httpx  # the clients as httpx.Client threads instead of http.client
    .venv/bin/python bench/api.py --profile       # + an untimed py-spy pass per HTTP case (server's GIL time)
    .venv/bin/python bench/api.py --load wrk --skip upload,arrow,idempotency   # search with wrk only

Data: /work/shared/data/debian-packages (override with SHOAL_BENCH_DATA): base_f16.npy (59,004 real
all-MiniLM-L6-v2 vectors, 384-d, float16 widened to float32), queries_f16.npy (1,000 held-out queries),
points.parquet (package, installed_size_kb of each base row).

What it measures, each HTTP figure beside the in-process figure of the same work in the same run:

1. Upload points/s: `POST /api/v1/upload/{ds}/1` with Vektonn JSON, batches of 100 and 1,000 points, from 1 and
   8 concurrent clients, against `Producer.upload([DataPoint, ...])` of the same points from 1 and 8 threads of
   this process (`Shoal(settings, tenant="bench")`); and the same route with an Arrow IPC stream body
   (`Content-Type: application/vnd.apache.arrow.stream`, as `shoal.intake.codec.encode_arrow` makes it),
   batches of 1,000, against `Producer.upload_columns(vectors, {id, package, installed_size_kb})`. A point
   counts when its upload is acknowledged (durable and committed). Then an untimed check of `Idempotency-Key`.
2. Single-query search QPS: `POST /api/v1/search/{index}/1` with one query vector and k=10, from 1 and 8
   concurrent clients, against `Searcher.search` (`shoal.searcher(follow=False)`) one query per call from 1 and
   8 threads, on an HNSW index (M=16, ef_construction=200, ef_search=64, cosine) over the first 20,000 base
   rows, materialized in this process with `ShardBuilder.materialize` before any search. Recall@10 of both is
   measured against an exact numpy brute force over the same rows. Then the 8-client case again against a
   second server, `shoal api --workers 2` (`--scale-workers`), for the scaling figure, and then the 8-client JSON
   upload of 1,000-point batches against that server (one process decodes one JSON body at a time).
   Each search case runs twice over HTTP (`--load stdlib,wrk`): with the Python clients below (they check
   recall), and with wrk (`wrk -t1 -c<clients> -d8s -s <lua> --latency`, a C load generator whose own CPU per
   request is a few µs, against about 0.3 ms for an `http.client` request: with 1 client the round trip is
   serial, so the client's CPU would weigh on the figure). The Lua script rotates through the same query
   bodies. Each wrk case runs `--rounds-wrk` times (default 3), each run between two in-process runs of half its
   length; a run's ratio is its QPS ÷ the mean of its two brackets, and the row shows the median (min-max).
   The search targets are judged on the wrk rows when there are any.

Clients are threads of this process, each with one keep-alive connection of the standard library's
`http.client` (TCP_NODELAY), or one `httpx.Client` with `--client httpx`; or the wrk process (wrk rows).

The API runs as `python -m shoal.cli api` in its own process, on the same catalog (an embedded Postgres in a
temp dir), storage and broker (an embedded Valkey in the same temp dir) as this process. Everything it starts is
stopped and removed at the end, also on errors, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
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
from shoal.config.settings import Settings, mask_url
from shoal.index.builder import ShardBuilder
from shoal.intake.codec import ARROW, JSON, encode_arrow
from shoal.log.records import DataPoint, DataSourceSpec, IndexSpec
from shoal.vektonn import wire

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benches' helpers
from _lifecycle import Lifecycle, require_data  # noqa: E402

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
DEFAULT_ARROW_POINTS = {1_000: 80_000}  # Arrow bodies cost the server far less than JSON: more points, same time
QUICK_ARROW_POINTS = {1_000: 16_000}
TOKEN_HEADER = "X-Shoal-Write-Token"
IDEMPOTENCY_HEADER = "Idempotency-Key"
# The issue's targets (ratios measured in one run of the default bench).
TARGET_SEARCH_1 = 0.35  # HTTP search QPS, 1 client, ÷ in-process
TARGET_SCALE = 1.6  # HTTP search QPS, 8 clients on --workers 2, ÷ 1 client on 1 worker
TARGET_JSON_1000 = 0.4  # HTTP JSON upload of 1,000-point batches ÷ in-process
TARGET_ARROW_1000 = 0.8  # HTTP Arrow IPC upload of 1,000-point batches ÷ in-process
TARGET_POINTS = 20_000  # the searched index holds at least this many real points
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
class WrkRound:
    """One timed wrk run of a search case and the in-process runs just before and just after it."""

    requests: int
    seconds: float  # wrk's own measured duration
    p50_ms: float
    p99_ms: float
    local_before: float  # in-process QPS of the run just before
    local_after: float  # and just after (the next round's "before")
    socket_errors: dict[str, int] = field(default_factory=dict)  # wrk's connect/read/write/timeout counts

    @property
    def qps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def local_qps(self) -> float:
        return (self.local_before + self.local_after) / 2

    @property
    def ratio(self) -> float:
        return self.qps / self.local_qps if self.local_qps else float("nan")


@dataclass
class Case:
    kind: str  # upload | search
    batch: int  # points per request (1 for search)
    clients: int
    body: str = "json"  # upload bodies: json | arrow
    workers: int = 1  # uvicorn worker processes of the server the HTTP side ran against
    http: Side = field(default_factory=Side)
    local: Side = field(default_factory=Side)
    profile: Counter[str] = field(default_factory=Counter)  # py-spy samples per group (--profile)
    note: str = ""  # e.g. how the clients' connections spread over the server's worker processes
    load: str = "stdlib"  # who sent the HTTP requests: stdlib (the Python client threads, --client) | wrk
    rounds: list[WrkRound] = field(default_factory=list)  # load == "wrk": each timed wrk run and its brackets
    wrk_threads: int = 0  # load == "wrk": wrk's -t

    @property
    def name(self) -> str:
        """The case without its client count (also the step table's case name)."""
        return f"upload {self.body} × {self.batch:,}" if self.kind == "upload" else f"search k={K}"

    @property
    def label(self) -> str:
        who = f"{self.clients} client{'s' if self.clients > 1 else ''}"
        if self.load == "wrk":
            who += ", wrk"
        if self.workers > 1:
            who += f", --workers {self.workers}"
        return f"{self.name} ({who})"

    def http_rate(self) -> float:
        """HTTP QPS (pts/s for uploads); wrk: the median over its rounds."""
        if self.rounds:
            return float(np.median([r.qps for r in self.rounds]))
        return self.http.rate()

    def local_rate(self) -> float:
        """In-process QPS (pts/s); wrk: the median over its rounds of the mean of each run's two brackets."""
        if self.rounds:
            return float(np.median([r.local_qps for r in self.rounds]))
        return self.local.rate()

    def ratio(self) -> float:
        """HTTP ÷ in-process; wrk: the median of the per-round ratios."""
        if self.rounds:
            return float(np.median([r.ratio for r in self.rounds]))
        return self.http.rate() / self.local.rate() if self.local.rate() else float("nan")

    def spread(self) -> tuple[float, float]:
        """wrk: the lowest and highest per-round ratio."""
        ratios = [r.ratio for r in self.rounds] or [self.ratio()]
        return min(ratios), max(ratios)

    def ratio_text(self) -> str:
        if not self.rounds:
            return f"{self.ratio():.2f}x"
        lo, hi = self.spread()
        return f"{self.ratio():.2f}x ({lo:.2f}-{hi:.2f})" if len(self.rounds) > 1 else f"{self.ratio():.2f}x"

    def http_pct(self, p: int) -> float:
        """HTTP latency percentile in ms; wrk: the median over its rounds of wrk's own percentile."""
        if self.rounds:
            return float(np.median([r.p50_ms if p == 50 else r.p99_ms for r in self.rounds]))
        return self.http.pct(p)


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


def warm_each(clients: int, each: int, call: Callable[[int, int], Any]) -> None:
    """Untimed: every client thread w calls call(w, j) for j < each, on its own connection."""
    errors: list[BaseException] = []

    def work(w: int) -> None:
        try:
            for j in range(each):
                call(w, j)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def run_for(
    workers: int, seconds: float, call: Callable[[int, int], Any], side: Side, meter: Meter, first: int, nq: int
) -> float:
    """`workers` threads call call(worker, q) for q = first, first + 1, ... (mod nq) until `seconds` have passed
    (a call started before the deadline finishes). Adds wall time, latencies and CPU to `side`; returns the QPS."""
    lock = threading.Lock()
    nxt = [first]
    lat: list[list[float]] = [[] for _ in range(workers)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(workers + 1)
    deadline = [0.0]
    stop = threading.Event()

    def work(w: int) -> None:
        try:
            barrier.wait()
            mine = lat[w]
            while not errors and not stop.is_set():
                t0 = time.perf_counter()
                if t0 >= deadline[0]:
                    return
                with lock:
                    q = nxt[0] % nq
                    nxt[0] += 1
                call(w, q)
                mine.append(time.perf_counter() - t0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()
    c0 = meter.start()
    try:
        t0 = time.perf_counter()
        deadline[0] = t0 + seconds
        barrier.wait()
        for t in threads:
            t.join()
    except BaseException:
        stop.set()
        barrier.abort()
        raise
    elapsed = time.perf_counter() - t0
    c1 = meter.stop()
    if errors:
        raise errors[0]
    done = sum(len(x) for x in lat)
    side.seconds += elapsed
    side.requests += done
    side.points += done
    for x in lat:
        side.latencies += x
    side.cpu_bench += c1[0] - c0[0]
    side.cpu_server += c1[1] - c0[1]
    side.cpu_pg += c1[2] - c0[2]
    return done / elapsed if elapsed else 0.0


# -- the API server in its own process ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`python -m shoal.cli api` on a loopback port, with the bench's catalog, storage and broker."""

    def __init__(
        self,
        settings: Settings,
        database_url: str,
        storage_uri: str,
        log: Path,
        no_access_log: bool,
        workers: int,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self.workers = workers
        env = dict(os.environ)
        env.update(
            {
                "SHOAL_DATA_DIR": str(settings.data_dir),
                "SHOAL_DATABASE_URL": database_url,
                "SHOAL_STORAGE_URI": storage_uri,
                "SHOAL_REDIS_URL": str(settings.redis_url),
                "SHOAL_TENANT": TENANT,
                "SHOAL_ANONYMOUS_TENANT": TENANT,
                **(extra_env or {}),
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
        """Wait until /healthz answers and, with several workers, until every worker process has answered it."""
        deadline = time.monotonic() + timeout
        seen: set[int] = set()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the API server exited with {self.proc.returncode}:\n{self.tail()}")
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            try:
                conn.request("GET", "/healthz")
                answer = conn.getresponse()
                answer.read()
                if answer.status == 200:
                    if self.workers == 1:
                        return
                    # uvicorn's workers share one listening socket, and each starts on its own: the one that
                    # accepted this connection is ready. Done when each has accepted one.
                    me = conn.sock.getsockname()[1]
                    seen.update(pid for pid, ports in self.connections().items() if me in ports)
                    if len(seen) >= self.workers and seen >= set(self.worker_pids()):
                        return
            except (OSError, http.client.HTTPException):
                pass
            finally:
                conn.close()
            time.sleep(0.05 if seen else 0.1)
        raise RuntimeError(
            f"the API server's {self.workers} worker(s) did not all answer /healthz within {timeout:.0f}s "
            f"(answered: {len(seen)}):\n{self.tail()}"
        )

    def worker_pids(self) -> list[int]:
        """The processes that serve requests: the server itself, or uvicorn's spawned worker processes."""
        if self.workers == 1:
            return [self.pid]
        return sorted(pid for pid in children(self.pid) if b"spawn_main" in cmdline(pid))

    def connections(self) -> dict[int, list[int]]:
        """Per worker process, the client-side ports of the established connections it holds."""
        established = established_on(self.port)
        return {
            pid: sorted(established[i] for i in socket_inodes(pid) if i in established) for pid in self.worker_pids()
        }

    def spread(self) -> str:
        """How many connections each worker process holds, e.g. "4 + 4"."""
        return " + ".join(str(len(ports)) for ports in self.connections().values())

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
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: no worker process outlives it
        except (ProcessLookupError, PermissionError):
            pass
        if not self._log.closed:
            self._log.close()


def children(pid: int) -> list[int]:
    """Live child processes of `pid`."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if int(_stat(int(entry.name))[1]) == pid:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets a process holds open."""
    out: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def established_on(port: int) -> dict[int, int]:
    """Socket inode -> remote port of the established TCP connections whose local port is `port`."""
    out: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "01" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 01: ESTABLISHED
                out[int(f[9])] = int(f[2].rsplit(":", 1)[1], 16)
    return out


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS), 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# -- HTTP clients ----------------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: Any  # case-insensitive .get (http.client's HTTPMessage or httpx's Headers)
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class HttpError(RuntimeError):
    """A request answered with a status other than 200."""

    def __init__(self, what: str, status: int, body: bytes) -> None:
        super().__init__(f"{what}: {status} {body[:500].decode(errors='replace')}")
        self.status = status


class LightClient:
    """One keep-alive HTTP/1.1 connection of the standard library (`http.client.HTTPConnection`), TCP_NODELAY on
    its socket, reused for every request; reopened when it idled long enough for the server to close it
    (uvicorn: after 5 s) or when the server closed it. Not thread-safe: one per client thread."""

    IDLE_S = 3.0

    def __init__(self, url: str, timeout: float = 120) -> None:
        host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
        self.host, self.port, self.timeout = host, int(port), timeout
        self.conn: http.client.HTTPConnection | None = None
        self.last = 0.0

    def _open(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        conn.connect()
        assert conn.sock is not None
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    @property
    def local_port(self) -> int | None:
        """This connection's port (how the server's side of it is found in /proc), None when closed."""
        sock = self.conn.sock if self.conn is not None else None
        return int(sock.getsockname()[1]) if sock is not None else None

    def connect(self) -> None:
        if self.conn is None:
            self.conn = self._open()
            self.last = time.monotonic()

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> Reply:
        if self.conn is not None and time.monotonic() - self.last > self.IDLE_S:
            self.close()
        for _ in range(2):
            fresh = self.conn is None
            if self.conn is None:
                self.conn = self._open()
            try:
                self.conn.request(method, path, body=body, headers=headers or {})
                answer = self.conn.getresponse()
                data = answer.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                if fresh:
                    raise
                continue  # the server closed the kept-alive connection before reading: once more, on a new one
            except BaseException:
                self.close()
                raise
            if answer.will_close:
                self.close()
            self.last = time.monotonic()
            return Reply(answer.status, answer.headers, data)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class HttpxClient:
    """One `httpx.Client` (its own keep-alive pool), the bench's client before the light one (`--client httpx`)."""

    local_port = None

    def __init__(self, url: str, timeout: float = 120) -> None:
        self.client = httpx.Client(base_url=url, timeout=timeout)

    def connect(self) -> None:
        pass

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> Reply:
        r = self.client.request(method, path, content=body, headers=headers)
        return Reply(r.status_code, r.headers, r.content)

    def close(self) -> None:
        self.client.close()


CLIENT_KINDS = {
    "stdlib": "http.client.HTTPConnection, keep-alive, TCP_NODELAY",
    "httpx": "httpx.Client, keep-alive",
}


class Clients:
    """One client per concurrent client thread, kept for a whole case (keep-alive connections)."""

    def __init__(self, url: str, n: int, kind: str = "stdlib") -> None:
        self.kind = kind
        self.each: list[LightClient | HttpxClient] = [
            LightClient(url) if kind == "stdlib" else HttpxClient(url) for _ in range(n)
        ]

    def post(
        self, w: int, path: str, body: bytes, content_type: str = JSON, headers: dict[str, str] | None = None
    ) -> Reply:
        sent = {"Content-Type": content_type, **(headers or {})}
        r = self.each[w].request("POST", path, body, sent)
        if r.status != 200:
            raise HttpError(f"POST {path}", r.status, r.body)
        return r

    def close(self) -> None:
        for c in self.each:
            c.close()


# -- wrk ------------------------------------------------------------------------------------------------

WRK = shutil.which("wrk")
WRK_MARK = "SHOAL_WRK"
# Loaded by every wrk thread (its own Lua state). args: the bodies file (one JSON request body per line) and the
# thread count. The requests are formatted once in init(), so request() only hands the next one out; each thread
# starts at its own offset and cycles through all the bodies. response() counts answers other than 200 (wrk's
# summary.errors.status counts only >= 400); done() runs in the main Lua state and prints one line to parse.
WRK_LUA = """
local threads = {}
local made = 0

function setup(thread)
  thread:set("tid", made)
  made = made + 1
  table.insert(threads, thread)
end

function init(args)
  reqs = {}
  for line in io.lines(args[1]) do
    reqs[#reqs + 1] = wrk.format("POST", nil, {["Content-Type"] = "application/json"}, line)
  end
  at = math.floor(tid * #reqs / tonumber(args[2]))
  bad = 0
end

function request()
  at = at % #reqs + 1
  return reqs[at]
end

function response(status, headers, body)
  if status ~= 200 then
    bad = bad + 1
  end
end

function done(summary, latency, requests)
  local non200 = 0
  for _, thread in ipairs(threads) do
    non200 = non200 + thread:get("bad")
  end
  local e = summary.errors
  io.write(string.format(
    "%s requests=%d duration_us=%d non200=%d status=%d connect=%d read=%d write=%d timeout=%d p50_us=%d p99_us=%d\\n",
    "SHOAL_WRK", summary.requests, summary.duration, non200, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


@dataclass
class WrkRun:
    requests: int
    seconds: float
    non200: int
    p50_ms: float
    p99_ms: float
    socket_errors: dict[str, int]  # connect / read / write / timeout, only the non-zero ones
    cpu_wrk: float  # CPU seconds of the wrk process (getrusage of the child)
    cpu_server: float
    cpu_pg: float
    spread: str = ""  # connections per worker process, read while it ran (servers with several workers)


class Wrk:
    """wrk (a C HTTP load generator, a few µs of CPU per request) with a Lua script that rotates through the
    bench's search bodies; one process per run."""

    def __init__(self, data: Data, tmp: Path) -> None:
        self.bodies = tmp / "wrk-bodies.txt"
        self.script = tmp / "wrk-search.lua"
        with open(self.bodies, "wb") as f:
            for body in data.query_bodies:
                if b"\n" in body or b"\r" in body:
                    raise RuntimeError("a search body holds a line break: it cannot go one per line")
                f.write(body + b"\n")
        self.script.write_text(WRK_LUA)

    def run(
        self,
        server: Server,
        path: str,
        conns: int,
        threads: int,
        seconds: float,
        meter: Meter,
        spread: bool = False,
    ) -> WrkRun:
        assert WRK is not None
        cmd = [
            WRK,
            f"-t{threads}",
            f"-c{conns}",
            f"-d{seconds:g}s",
            "--timeout",
            "10s",
            "-s",
            str(self.script),
            "--latency",
            server.url + path,
            "--",
            str(self.bodies),
            str(threads),
        ]
        c0 = meter.start()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        seen = ""
        try:
            if spread:
                time.sleep(min(1.0, seconds / 4))  # the connections are open; reading /proc costs a few ms of CPU
                seen = server.spread()
            assert proc.stdout is not None
            out = proc.stdout.read().decode(errors="replace")
            _, status, usage = os.wait4(proc.pid, 0)  # the child's own CPU: nothing else of ours is reaped here
            proc.returncode = os.waitstatus_to_exitcode(status)
        except BaseException:
            if proc.returncode is None:
                proc.kill()
                proc.wait(10)
            raise
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
        c1 = meter.stop()
        line = next((x for x in out.splitlines() if x.startswith(WRK_MARK + " ")), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode}:\n{out[-2000:]}")
        f = {k: int(v) for k, v in (x.split("=", 1) for x in line.split()[1:])}
        if f["non200"]:
            raise RuntimeError(
                f"wrk: {f['non200']:,} of {f['requests']:,} answers were not 200 (POST {path}); "
                f"server log:\n{server.tail()}"
            )
        return WrkRun(
            requests=f["requests"],
            seconds=f["duration_us"] / 1e6,
            non200=f["non200"],
            p50_ms=f["p50_us"] / 1e3,
            p99_ms=f["p99_us"] / 1e3,
            socket_errors={k: f[k] for k in ("connect", "read", "write", "timeout") if f[k]},
            cpu_wrk=usage.ru_utime + usage.ru_stime,
            cpu_server=c1[1] - c0[1],
            cpu_pg=c1[2] - c0[2],
            spread=seen,
        )


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
    ("wire: Vektonn JSON / Arrow <-> columns (shoal/vektonn/)", ("shoal/vektonn/",)),
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
    body: str = "json",
) -> Case:
    """HTTP uploads of `body` (json: Vektonn JSON, against Producer.upload([DataPoint]); arrow: an Arrow IPC
    stream, against Producer.upload_columns) and their in-process reference, interleaved."""
    case = Case("upload", batch, clients, body=body, workers=server.workers)
    tag = uuid.uuid4().hex[:6]
    names = {
        "http": f"bench-api-http-{body}-b{batch}-c{clients}-{tag}",
        "local": f"bench-api-local-{body}-b{batch}-c{clients}-{tag}",
    }
    for name in names.values():
        shoal.create_data_source(DataSourceSpec(name, "1", data.base.shape[1], ATTRIBUTES, ["id"]))
    producer = shoal.producer(names["local"], "1")
    http = Clients(server.url, clients, args.client)
    path = f"/api/v1/upload/{names['http']}/1"
    content_type = ARROW if body == "arrow" else JSON
    ids = {"http": Ids(), "local": Ids()}
    pool = len(data.coords_json)
    row = [0]

    def rows(n: int) -> list[int]:
        out = [(row[0] + j) % pool for j in range(n)]
        row[0] = (row[0] + n) % pool
        return out

    def columns(taken: range, at: list[int]) -> tuple[np.ndarray, dict[str, Any]]:
        """The columnar form of points (id, row): the vectors [n, dim] float32 and the attribute columns."""
        return data.base[at], {
            "id": np.arange(taken.start, taken.stop, dtype=np.int64),
            "package": [data.package[r] for r in at],
            "installed_size_kb": data.size[at],
        }

    def http_items(requests: int) -> list[bytes]:
        if body == "arrow":
            return [encode_arrow(*columns(ids["http"].take(batch), rows(batch))) for _ in range(requests)]
        return [data.upload_body(ids["http"].take(batch), rows(batch)) for _ in range(requests)]

    def local_items(requests: int) -> list[Any]:
        if body == "arrow":
            return [columns(ids["local"].take(batch), rows(batch)) for _ in range(requests)]
        return [data.points(ids["local"].take(batch), rows(batch)) for _ in range(requests)]

    def http_call(w: int, item: bytes) -> None:
        http.post(w, path, item, content_type)

    def local_call(w: int, item: Any) -> None:
        if body == "arrow":
            producer.upload_columns(*item)
        else:
            producer.upload(item)

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
                server.pid,
                tmp / f"pyspy-upload-{body}-b{batch}-c{clients}.txt",
                args.profile_rate,
                server.workers > 1,
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
class Idempotency:
    """The untimed Idempotency-Key check: one batch sent twice with the same key."""

    status: tuple[int, int] = (0, 0)
    tokens: tuple[str | None, str | None] = (None, None)
    grown: tuple[int, int] = (0, 0)  # log growth after the first and after the repeat
    points: int = 0

    @property
    def met(self) -> bool:
        return (
            self.status == (200, 200)
            and self.tokens[0] is not None
            and self.tokens[0] == self.tokens[1]
            and self.grown == (self.points, 0)
        )

    def describe(self) -> str:
        return (
            f"one {self.points}-point JSON batch sent twice with the same key: statuses "
            f"{self.status[0]} / {self.status[1]}, {TOKEN_HEADER} {self.tokens[0]} / {self.tokens[1]}, "
            f"the log grew by {self.grown[0]} then {self.grown[1]}: {'ok' if self.met else 'NOT MET'}"
        )


def idempotency_check(
    shoal: Shoal, data: Data, server: Server, kind: str, keep: bool, points: int = 100
) -> Idempotency:
    """Send one batch twice with the same Idempotency-Key: the repeat must write nothing and return the same token."""
    name = f"bench-api-idem-{uuid.uuid4().hex[:6]}"
    shoal.create_data_source(DataSourceSpec(name, "1", data.base.shape[1], ATTRIBUTES, ["id"]))
    client = LightClient(server.url) if kind == "stdlib" else HttpxClient(server.url)
    out = Idempotency(points=points)
    try:
        body = data.upload_body(range(points), list(range(points)))
        sent = {"Content-Type": JSON, IDEMPOTENCY_HEADER: f"bench-{uuid.uuid4().hex}"}
        path = f"/api/v1/upload/{name}/1"
        h0 = shoal.get_data_source(name, "1").head_seq
        first = client.request("POST", path, body, sent)
        h1 = shoal.get_data_source(name, "1").head_seq
        again = client.request("POST", path, body, sent)
        h2 = shoal.get_data_source(name, "1").head_seq
        out.status = (first.status, again.status)
        out.tokens = (first.headers.get(TOKEN_HEADER), again.headers.get(TOKEN_HEADER))
        out.grown = (h1 - h0, h2 - h1)
    finally:
        client.close()
        if not keep:
            shoal.drop_data_source(name, "1")
    return out


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
    case = Case("search", 1, clients, workers=server.workers)
    http = Clients(server.url, clients, args.client)
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
        # Warm-up, untimed: the server's searcher loads the active version on its first search, in each worker
        # process. Every client sends its own few requests on its own kept-alive connection, so every worker
        # process holding one of the connections has loaded the index before the clock starts.
        each = 8 if server.workers > 1 else 4
        warm_each(clients, each, lambda w, j: http_call(w, (w * each + j) % nq))
        run_round(clients, list(range(max(16, 4 * clients))), local_call, Side(), meter)
        if server.workers > 1:
            case.note = f"connections per worker process: {server.spread()}"
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
            prof = Profiler(
                server.pid,
                tmp / f"pyspy-search-c{clients}-w{server.workers}.txt",
                args.profile_rate,
                server.workers > 1,
            )
            try:
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < args.profile_seconds:
                    run_round(clients, [j % nq for j in range(max(per_round))], http_call, Side(), meter)
            finally:
                case.profile = prof.stop()
    finally:
        http.close()
    return case


def warm_workers(server: Server, path: str, data: Data, each: int = 4, timeout: float = 60) -> None:
    """Untimed: `each` searches on fresh connections until every worker process of the server has answered some
    (its searcher loads the active version on its first search). The kernel picks the worker that accepts a
    connection; the bench finds it in /proc."""
    if server.workers == 1:
        client = LightClient(server.url)
        try:
            for j in range(each):
                r = client.request("POST", path, data.query_bodies[j % len(data.query_bodies)], {"Content-Type": JSON})
                if r.status != 200:
                    raise HttpError(f"POST {path}", r.status, r.body)
        finally:
            client.close()
        return
    want = set(server.worker_pids())
    warmed: set[int] = set()
    deadline = time.monotonic() + timeout
    j = 0
    while not want <= warmed:
        if time.monotonic() > deadline:
            raise RuntimeError(f"warm-up: only worker processes {sorted(warmed)} of {sorted(want)} answered a search")
        client = LightClient(server.url)
        try:
            client.connect()
            port = client.local_port
            owner = next((pid for pid, ports in server.connections().items() if port in ports), None)
            if owner is not None and owner not in warmed:
                for _ in range(each):
                    body = data.query_bodies[j % len(data.query_bodies)]
                    j += 1
                    r = client.request("POST", path, body, {"Content-Type": JSON})
                    if r.status != 200:
                        raise HttpError(f"POST {path}", r.status, r.body)
                warmed.add(owner)
        finally:
            client.close()


def wrk_case(
    searcher: Any,
    data: Data,
    setup: SearchSetup,
    server: Server,
    meter: Meter,
    wrk: Wrk,
    conns: int,
    args: argparse.Namespace,
) -> Case:
    """The search case with wrk as the client: in-process, wrk, in-process, wrk, ..., in-process. Each wrk run's
    ratio is its QPS ÷ the mean of the in-process runs just before and just after it."""
    threads = 1 if conns == 1 else max(1, min(args.wrk_threads, conns))
    case = Case("search", 1, conns, workers=server.workers, load="wrk", wrk_threads=threads)
    path = f"/api/v1/search/{setup.index}/1"
    nq = len(data.queries)
    local_s = args.wrk_seconds / 2  # the two brackets of a wrk run add up to its length

    def local_call(w: int, q: int) -> None:
        searcher.search(setup.index, "1", data.queries[q : q + 1], K)

    # Warm-up, untimed: every worker process has searched (the searcher loads the index on first use), a short
    # wrk run with the case's connections (the server's threadpool), and the in-process side.
    warm_workers(server, path, data)
    wrk.run(server, path, conns, threads, min(1.0, args.wrk_seconds), meter)
    run_round(conns, list(range(max(16, 4 * conns))), lambda w, q: local_call(w, q % nq), Side(), meter)
    before = run_for(conns, local_s, local_call, case.local, meter, 0, nq)
    spreads: list[str] = []
    errors: Counter[str] = Counter()
    for r in range(args.rounds_wrk):
        run = wrk.run(server, path, conns, threads, args.wrk_seconds, meter, spread=server.workers > 1)
        after = run_for(conns, local_s, local_call, case.local, meter, case.local.requests % nq, nq)
        case.rounds.append(
            WrkRound(run.requests, run.seconds, run.p50_ms, run.p99_ms, before, after, run.socket_errors)
        )
        case.http.requests += run.requests
        case.http.points += run.requests
        case.http.seconds += run.seconds
        case.http.cpu_bench += run.cpu_wrk
        case.http.cpu_server += run.cpu_server
        case.http.cpu_pg += run.cpu_pg
        errors.update(run.socket_errors)
        if run.spread:
            spreads.append(run.spread)
        last = case.rounds[-1]
        console.print(
            f"    round {r + 1}: in-process {fmt(before)} QPS, wrk {fmt(last.qps)} QPS (p50 {last.p50_ms:.2f} ms), "
            f"in-process {fmt(after)} QPS: {last.ratio:.2f}x"
        )
        before = after
    notes = [f"wrk -t{threads} -c{conns}, {args.rounds_wrk} x {args.wrk_seconds:g} s"]
    if spreads:
        notes.append(f"wrk's connections per worker process, per round: {', '.join(spreads)}")
    if errors:
        notes.append("wrk socket errors: " + ", ".join(f"{k} {v:,}" for k, v in sorted(errors.items())))
    case.note = "; ".join(notes)
    return case


def run_wrk_case(
    searcher: Any,
    data: Data,
    setup: SearchSetup,
    server: Server,
    meter: Meter,
    wrk: Wrk,
    conns: int,
    args: argparse.Namespace,
) -> Case:
    """wrk_case with its progress lines."""
    t0 = time.perf_counter()
    label = Case("search", 1, conns, workers=server.workers, load="wrk").label
    console.print(
        f"  {label}: {args.rounds_wrk} x {args.wrk_seconds:g} s of wrk, each between two in-process runs of "
        f"{args.wrk_seconds / 2:g} s …"
    )
    case = wrk_case(searcher, data, setup, server, meter, wrk, conns, args)
    console.print(
        f"  {case.label}: HTTP {fmt(case.http_rate())} QPS, in-process {fmt(case.local_rate())} QPS, ratio "
        f"{case.ratio_text()} ({time.perf_counter() - t0:.1f}s); {case.note}"
    )
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


def upload_steps(shoal: Shoal, data: Data, batch: int, reps: int, body: str = "json") -> Steps:
    """What `POST /api/v1/upload` does with one batch, re-timed step by step with the functions the route calls:
    shoal.vektonn.wire's decoder and Producer.append_tables."""
    name = f"bench-api-steps-{body}-b{batch}-{uuid.uuid4().hex[:6]}"
    shoal.create_data_source(DataSourceSpec(name, "1", data.base.shape[1], ATTRIBUTES, ["id"]))
    ids = Ids()
    pool = len(data.coords_json)
    counts = Counts(shoal.engine)
    max_points = shoal.settings.max_batch_points

    def columns(taken: range, at: list[int]) -> tuple[np.ndarray, dict[str, Any]]:
        return data.base[at], {
            "id": np.arange(taken.start, taken.stop, dtype=np.int64),
            "package": [data.package[r] for r in at],
            "installed_size_kb": data.size[at],
        }

    try:
        shoal.producer(name, "1").upload(data.points(ids.take(batch), list(range(batch))))  # warm-up
        rows = [[(r * batch + j) % pool for j in range(batch)] for r in range(reps)]
        if body == "arrow":
            bodies = [encode_arrow(*columns(ids.take(batch), rows[r])) for r in range(reps)]
            decode, what = wire.decode_arrow_upload, "wire.decode_arrow_upload: Arrow IPC body -> validated table"
        else:
            bodies = [data.upload_body(ids.take(batch), rows[r]) for r in range(reps)]
            decode, what = wire.decode_upload, "wire.decode_upload: JSON body (orjson) -> validated table"
        state: dict[str, Any] = {}

        def lookup(raw: bytes) -> bytes:
            state["producer"] = shoal.producer(name, "1")  # the route looks the data source up per request
            return raw

        steps = timed_steps(
            reps,
            [
                ("shoal.producer(name, version): data source lookup", lookup),
                (what, lambda raw: decode(state["producer"].spec, raw, max_points)),
                (
                    "Producer.append_tables: encode, fsync, commit",
                    lambda table: state["producer"].append_tables([(table, None)]),
                ),
            ],
            counts,
            lambda r: bodies[r],
        )
        producer = shoal.producer(name, "1")
        if body == "arrow":
            cols = [columns(ids.take(batch), rows[r]) for r in range(reps)]
            [ref] = timed_steps(
                reps,
                [("in-process Producer.upload_columns (numpy vectors)", lambda c: producer.upload_columns(*c))],
                counts,
                lambda r: cols[r],
            )
        else:
            points = [data.points(ids.take(batch), rows[r]) for r in range(reps)]
            [ref] = timed_steps(
                reps, [("in-process Producer.upload (numpy vectors)", producer.upload)], counts, lambda r: points[r]
            )
    finally:
        counts.close()
        shoal.drop_data_source(name, "1")
    return Steps(f"upload {body} × {batch:,}", steps, ref)


def search_steps(shoal: Shoal, searcher: Any, data: Data, setup: SearchSetup, reps: int) -> Steps:
    """What `POST /api/v1/search` does with one query, re-timed step by step with the functions the route calls:
    shoal.vektonn.wire's decoder and encoder and the searcher's view."""
    nq = len(data.queries)
    counts = Counts(shoal.engine)
    state: dict[str, Any] = {}

    def view(query: Any) -> Any:
        state["source"] = searcher.view(setup.index, "1").source.spec  # no catalog round trip
        return query

    def search(query: Any) -> Any:
        state["vectors"] = vectors = wire.query_vectors(state["source"], query)
        state["query"] = query
        return searcher.search(setup.index, "1", vectors, query.k)

    def encode(results: Any) -> bytes:
        return wire.encode_search_results(state["source"], state["vectors"], results, state["query"].retrieve_vectors)

    try:
        steps = timed_steps(
            reps,
            [
                ("wire.decode_search: JSON body (orjson) -> query", wire.decode_search),
                ("searcher.view: index and source definitions", view),
                ("wire.query_vectors + Searcher.search", search),
                ("wire.encode_search_results: hits -> JSON", encode),
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


def fmt(x: float, digits: int = 0) -> str:
    return "n/a" if x != x else f"{x:,.{digits}f}"


def print_tables(cases: list[Case], setup: SearchSetup | None, args: argparse.Namespace) -> None:
    wrk_rows = [c for c in cases if c.load == "wrk"]
    title = (
        "Shoal HTTP API (uvicorn, separate process) vs in-process Python API, same run; "
        f"clients: {args.client} ({CLIENT_KINDS[args.client]})"
    )
    if wrk_rows:
        title += f"; wrk rows: median of {args.rounds_wrk} rounds (min-max ratio)"
    table = Table(title=title)
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
        if c.load == "wrk":
            found = "- / -"  # wrk does not read the hits: recall is the Python clients' rows
        elif c.kind == "search" and setup:
            found = f"{recall(c.http.found, setup.exact):.4f} / {recall(c.local.found, setup.exact):.4f}"
        else:
            found = ""
        digits = 2 if c.load == "wrk" else 1
        table.add_row(
            c.label,
            f"{fmt(c.http_rate())} {unit}",
            f"{fmt(c.local_rate())} {unit}",
            c.ratio_text(),
            f"{fmt(c.http_pct(50), digits)} / {fmt(c.http_pct(99), digits)}",
            f"{fmt(c.local.pct(50), 2)} / {fmt(c.local.pct(99), 2)}",
            found,
            f"{c.http.commits:,} / {c.local.commits:,}" if c.kind == "upload" else "",
        )
    console.print(table)
    if wrk_rows:
        console.print(
            escape(
                f"wrk rows: `wrk -t<T> -c<clients> -d{args.wrk_seconds:g}s -s <lua> --latency <url>`, one connection "
                f"per client, the Python clients' query bodies in rotation; {args.rounds_wrk} timed runs per "
                f"case, each between two in-process runs of {args.wrk_seconds / 2:g} s with as many threads as "
                "connections. HTTP = median of the runs' QPS, in-process = median of the runs' bracket means, ratio "
                "= median of the per-run ratios (min-max), p50 / p99 = median of wrk's per-run percentiles."
            )
        )

    for c in cases:
        if c.note:
            console.print(escape(f"{c.label}: {c.note}"))

    cpu = Table(
        title="CPU ms per request (per batch for uploads), measured from /proc over the timed windows; "
        f"HTTP clients: {args.client} threads in this process"
        + ("; wrk rows: the wrk process (its rusage)" if wrk_rows else "")
    )
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
            fmt(h.cpu_ms("bench"), 3),
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
        "threadpool hops, authentication) shows in the --profile table."
    )


@dataclass
class Target:
    what: str
    goal: str
    measured: str
    met: bool | None  # None: not measured in this run


def targets(
    cases: list[Case], setup: SearchSetup | None, idem: Idempotency | None, args: argparse.Namespace
) -> list[Target]:
    """The issue's targets against this run's figures."""
    out: list[Target] = []

    def find(
        kind: str, clients: int, *, batch: int = 1, body: str = "json", workers: int = 1, load: str = "stdlib"
    ) -> Case | None:
        return next(
            (
                c
                for c in cases
                if c.kind == kind
                and c.clients == clients
                and c.batch == batch
                and c.body == body
                and c.workers == workers
                and c.load == load
            ),
            None,
        )

    n = setup.n if setup else 0
    out.append(
        Target(
            "searched index: real points",
            f">= {TARGET_POINTS:,}",
            f"{n:,}" if setup else "n/a",
            n >= TARGET_POINTS if setup else None,
        )
    )
    # The search targets are judged on the wrk rows when there are any (a C client: the figure is the server's),
    # with the Python clients' figures beside them for information.
    one = {load: find("search", 1, load=load) for load in ("wrk", "stdlib")}
    judge = "wrk" if one["wrk"] else "stdlib"

    def search_one(load: str) -> str:
        c = one[load]
        if c is None:
            return ""
        if c.rounds and len(c.rounds) > 1:
            lo, hi = c.spread()
            return f"{load} {c.ratio():.2f}x (median of {len(c.rounds)}, {lo:.2f}-{hi:.2f})"
        return f"{load} {c.ratio():.2f}x"

    judged = one[judge]
    shown = [search_one(judge)] + ([search_one("stdlib")] if judge == "wrk" and one["stdlib"] else [])
    out.append(
        Target(
            f"search, 1 client: HTTP ÷ in-process QPS (judged on {judge})",
            f">= {TARGET_SEARCH_1:.2f}x",
            "; ".join(x for x in shown if x) or "n/a",
            judged.ratio() >= TARGET_SEARCH_1 if judged else None,
        )
    )
    workers = sorted({c.workers for c in cases if c.kind == "search" and c.workers > 1})
    for w in workers:
        clients = sorted({c.clients for c in cases if c.kind == "search" and c.workers == w})
        for k in clients:
            scaled = {load: find("search", k, workers=w, load=load) for load in ("wrk", "stdlib")}
            judge = "wrk" if scaled["wrk"] and one["wrk"] else "stdlib"
            ratios: dict[str, float] = {}
            parts: list[str] = []
            for load in (judge, "stdlib") if judge == "wrk" else ("stdlib",):
                c, base = scaled[load], one[load]
                if c is None or base is None or not base.http_rate():
                    continue
                ratios[load] = c.http_rate() / base.http_rate()
                text = f"{load} {ratios[load]:.2f}x ({fmt(c.http_rate())} ÷ {fmt(base.http_rate())}"
                if c.rounds and base.rounds and len(c.rounds) + len(base.rounds) > 2:
                    # the two cases ran a minute or more apart: every pairing of their runs, for the drift
                    lo = min(r.qps for r in c.rounds) / max(r.qps for r in base.rounds)
                    hi = max(r.qps for r in c.rounds) / min(r.qps for r in base.rounds)
                    text += f", runs paired {lo:.2f}-{hi:.2f}"
                parts.append(text + ")")
            r = ratios.get(judge, float("nan"))
            out.append(
                Target(
                    f"search, {k} clients on --workers {w} ÷ 1 client on 1 worker (HTTP QPS, judged on {judge})",
                    f">= {TARGET_SCALE:.1f}x",
                    "; ".join(parts) or "n/a",
                    r >= TARGET_SCALE if r == r else None,
                )
            )
    if not workers:
        out.append(
            Target(
                f"search, {args.scale_clients} clients on --workers {args.scale_workers} ÷ 1 client on 1 worker",
                f">= {TARGET_SCALE:.1f}x",
                "not run",
                None,
            )
        )
    for body, goal in (("json", TARGET_JSON_1000), ("arrow", TARGET_ARROW_1000)):
        found = [c for c in cases if c.kind == "upload" and c.body == body and c.batch == 1_000]
        spread = any(c.workers > 1 for c in found)
        for c in found:
            if body == "json" and c.clients > 1 and c.workers == 1 and spread:
                # One process decodes one JSON body at a time (the GIL) while the in-process reference's threads
                # use every core: concurrent JSON uploads are judged against several worker processes, as the
                # search scaling target is.
                out.append(Target(f"{c.label}: HTTP ÷ in-process (for information: concurrent JSON is judged on "
                                  f"--workers {args.scale_workers})", f">= {goal:.1f}x", f"{c.ratio():.2f}x", None))
                continue
            out.append(
                Target(f"{c.label}: HTTP ÷ in-process", f">= {goal:.1f}x", f"{c.ratio():.2f}x", c.ratio() >= goal)
            )
        if not found:
            why = getattr(args, f"{body}_refused", None) or "not run"
            out.append(Target(f"upload {body} × 1,000: HTTP ÷ in-process", f">= {goal:.1f}x", why, None))
    for c in cases:
        if c.kind == "search" and c.load == "stdlib" and setup:
            h, lo = recall(c.http.found, setup.exact), recall(c.local.found, setup.exact)
            same = sum(1 for q, ids in c.http.found.items() if c.local.found.get(q) == ids)
            out.append(
                Target(
                    f"{c.label}: recall@10 HTTP = in-process",
                    "identical",
                    f"{h:.4f} / {lo:.4f}; same ids on {same}/{len(c.http.found)} queries",
                    h == lo,
                )
            )
    out.append(
        Target(
            "Idempotency-Key: repeat writes nothing, same token",
            "same token, log +0",
            (
                f"tokens {idem.tokens[0]} / {idem.tokens[1]}, log +{idem.grown[0]} / +{idem.grown[1]}, statuses "
                f"{idem.status[0]} / {idem.status[1]}"
            )
            if idem
            else "not run",
            idem.met if idem else None,
        )
    )
    return out


def print_targets(found: list[Target]) -> None:
    table = Table(title="The issue's targets, this run")
    table.add_column("target")
    table.add_column("goal", justify="right")
    table.add_column("measured", justify="right")
    table.add_column("")
    for t in found:
        verdict = "n/a" if t.met is None else ("[green]met[/]" if t.met else "[red]not met[/]")
        table.add_row(escape(t.what), escape(t.goal), escape(t.measured), verdict)
    console.print(table)


# -- main ----------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a scaled-down pass (under 2 minutes)")
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
    p.add_argument(
        "--skip",
        type=lambda s: set(s.split(",")),
        default=set(),
        help="skip parts: upload,arrow,idempotency,search,scale",
    )
    p.add_argument(
        "--no-access-log",
        action="store_true",
        help="serve with `python -m uvicorn --factory shoal.api.app:create_app --no-access-log` instead "
        "of `python -m shoal.cli api` (which logs a line per request)",
    )
    p.add_argument("--workers", type=int, default=1, help="uvicorn worker processes of the API (default 1)")
    p.add_argument(
        "--client",
        choices=sorted(CLIENT_KINDS),
        default="stdlib",
        help="the clients: stdlib (one http.client.HTTPConnection per thread, keep-alive, TCP_NODELAY; default) "
        "or httpx (one httpx.Client per thread)",
    )
    p.add_argument(
        "--arrow-batches",
        type=_ints,
        default=[1_000],
        help="batch sizes of the Arrow IPC upload cases (default 1000; empty to skip)",
    )
    p.add_argument(
        "--arrow-points",
        type=int,
        default=None,
        help="timed points per Arrow upload case and side (default 80,000; 16,000 with --quick)",
    )
    p.add_argument(
        "--scale-workers",
        type=int,
        default=2,
        help="after the search cases, the search case again against `shoal api --workers N` (default 2; 0 to skip)",
    )
    p.add_argument("--scale-clients", type=int, default=8, help="concurrent clients of that scaling case (default 8)")
    p.add_argument(
        "--load",
        type=lambda s: {x.strip() for x in s.split(",") if x.strip()},
        default=None,
        help="who loads the search route: stdlib (the Python client threads of --client; they also check recall) "
        "and/or wrk (a C load generator); default stdlib,wrk when wrk is installed, else stdlib",
    )
    p.add_argument(
        "--wrk-seconds", type=float, default=None, help="length of each timed wrk run (default 8; 3 with --quick)"
    )
    p.add_argument(
        "--rounds-wrk",
        type=int,
        default=3,
        help="timed wrk runs per wrk case, each between two in-process runs; median and min-max reported (default 3)",
    )
    p.add_argument(
        "--wrk-threads",
        type=int,
        default=1,
        help="wrk threads (-t) for the cases with several connections (default 1, which cost less CPU per request "
        "than 2 here; 1 connection always runs -t1)",
    )
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
    args.wrk_seconds = args.wrk_seconds or (3.0 if args.quick else 8.0)
    args.load_note = ""
    if args.load is None:
        args.load = {"stdlib", "wrk"} if WRK else {"stdlib"}
        if not WRK:
            args.load_note = (
                "wrk is not installed: the search cases ran with the Python clients only, whose own CPU per request "
                "weighs on the 1-client figure (apt-get install wrk, then run again)"
            )
    if not args.load or not args.load <= {"stdlib", "wrk"}:
        p.error(f"--load takes stdlib and/or wrk, not {','.join(sorted(args.load)) or 'nothing'}")
    if "wrk" in args.load and not WRK:
        p.error("--load wrk: no wrk on PATH (apt-get install wrk)")
    if args.rounds_wrk < 1 or args.wrk_seconds <= 0 or args.wrk_threads < 1:
        p.error("--rounds-wrk, --wrk-seconds and --wrk-threads must be positive")
    if args.profile and not have_py_spy():
        p.error(f"--profile needs py-spy beside {sys.executable} (.venv/bin/pip install py-spy)")
    return args


def upload_points(batch: int, args: argparse.Namespace, body: str = "json") -> int:
    if body == "arrow":
        if args.arrow_points:
            return int(args.arrow_points)
        return (QUICK_ARROW_POINTS if args.quick else DEFAULT_ARROW_POINTS).get(batch, 40 * batch)
    if args.upload_points:
        return int(args.upload_points)
    return (QUICK_UPLOAD_POINTS if args.quick else DEFAULT_UPLOAD_POINTS).get(batch, 20 * batch)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_data(DATA_DIR, "base_f16.npy", "queries_f16.npy", "gt.npy", "points.parquet")
    cases: list[Case] = []
    notes: list[str] = []
    setup: SearchSetup | None = None
    all_steps: list[Steps] = []
    server: Server | None = None
    scaled: Server | None = None
    idem: Idempotency | None = None
    with Lifecycle() as life:
        tmp = life.temp_dir("shoal-api-bench-", keep=args.keep)
        overrides: dict[str, Any] = {"data_dir": tmp}
        if args.storage:
            overrides["storage_uri"] = args.storage
        console.print(
            f"[bold]shoal API bench[/] python {platform.python_version()}, numpy {np.__version__}, "
            f"{os.cpu_count()} cpus, load average before the bench {_load()}"
        )
        if args.load_note:
            console.print(escape(args.load_note))
        t_start = time.perf_counter()
        life.stop_servers(tmp)  # the Valkey (and the Postgres, when embedded) under the temp dir
        console.print("loading data …")
        data = load_data()
        settings = Settings(**overrides)
        embedded = not settings.database_url
        with life.starting(tmp):
            if not settings.redis_url:
                from shoal.servers.embedded import ensure_valkey

                settings = settings.model_copy(update={"redis_url": ensure_valkey(tmp)})
            settings = settings.model_copy(update={"tenant": TENANT})
            database_url = resolve_database_url(settings)  # starts the embedded Postgres
            shoal = Shoal(settings, tenant=TENANT)
        life.cleanup("Shoal connections", shoal.close)
        storage_uri = shoal.storage.root if shoal.storage.local else settings.resolved_storage_uri
        postmaster = None
        pidfile = tmp / "postgres" / "postmaster.pid"
        if embedded and pidfile.is_file():
            postmaster = int(pidfile.read_text().split()[0])
        console.print(
            f"catalog: {'embedded Postgres in ' + str(tmp) if embedded else 'SHOAL_DATABASE_URL'}; "
            f"storage: {shoal.storage.root}; broker: {mask_url(str(settings.redis_url))}"
        )
        with life.starting(tmp, "the API server"):
            server = Server(settings, database_url, storage_uri, tmp / "api.log", args.no_access_log, args.workers)
            life.cleanup("the API server", server.stop)
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
                        try:
                            all_steps.append(upload_steps(shoal, data, batch, reps))
                        except (ImportError, AttributeError, TypeError) as exc:
                            notes.append(f"upload steps not re-timed: the route's helpers changed ({exc!r})")
                            break

        if "arrow" not in args.skip and args.arrow_batches:
            console.print(
                "[bold]1b. upload, Arrow IPC[/] (application/vnd.apache.arrow.stream over HTTP vs "
                "Producer.upload_columns in this process)"
            )
            refused = False
            for batch in args.arrow_batches:
                for clients in args.clients:
                    if refused:
                        break
                    points = upload_points(batch, args, "arrow")
                    t0 = time.perf_counter()
                    try:
                        with console.status(
                            f"upload arrow × {batch:,}, {clients} clients: {points:,} points per side …"
                        ):
                            case = upload_case(
                                shoal, data, server, meter, batch, clients, points, args.rounds, args, tmp, "arrow"
                            )
                    except HttpError as exc:
                        refused = True  # the route does not take Arrow bodies (yet): say so, go on
                        notes.append(f"upload arrow: not measured, the server refused an Arrow IPC body: {exc}")
                        args.arrow_refused = f"not measured: the server answered {exc.status} to an Arrow body"
                        console.print(escape(f"  upload arrow × {batch:,}: the server refused the body: {exc}"))
                        continue
                    cases.append(case)
                    console.print(
                        f"  {case.label}: HTTP {fmt(case.http.rate())} pts/s, in-process {fmt(case.local.rate())} "
                        f"pts/s ({time.perf_counter() - t0:.1f}s)"
                    )
            if not args.no_steps and not refused:
                for batch in args.arrow_batches:
                    with console.status(f"upload arrow × {batch:,}: the route's steps one by one …"):
                        reps = max(3, (args.step_points or (4_000 if args.quick else 12_000)) // batch)
                        try:
                            all_steps.append(upload_steps(shoal, data, batch, reps, "arrow"))
                        except (ImportError, AttributeError, TypeError) as exc:
                            notes.append(f"Arrow upload steps not re-timed: the route's helpers changed ({exc!r})")
                            break

        if "idempotency" not in args.skip:
            idem = idempotency_check(shoal, data, server, args.client, args.keep)
            console.print("[bold]1c. Idempotency-Key[/] (untimed): " + escape(idem.describe()), highlight=False)

        if "search" not in args.skip:
            console.print("[bold]2. search[/] (one query per request, k=10, HNSW M=16 efC=200 ef=64, cosine)")
            with console.status(f"ingesting {args.search_points:,} points and materializing the index …"):
                # No notifications: nothing runs a worker here; the index is built in this process.
                builder_shoal = Shoal(settings, tenant=TENANT, notify=False)
                life.cleanup("Shoal connections", builder_shoal.close)
                setup = search_setup(builder_shoal, data, min(args.search_points, data.base.shape[0]))
            if not args.keep:
                index_name = setup.index
                life.cleanup("the bench's data source", lambda: builder_shoal.drop_data_source(index_name, "1"))
                life.cleanup("the bench's index", lambda: builder_shoal.drop_index(index_name, "1"))  # runs first
            notes.append(setup.note)
            console.print(
                f"  index {setup.index}: {setup.n:,} points ingested in {setup.ingest_s:.1f}s, materialized in "
                f"{setup.materialize_s:.1f}s"
            )
            searcher = builder_shoal.searcher(follow=False)
            life.cleanup("searchers", searcher.close)
            wrk = Wrk(data, tmp) if "wrk" in args.load else None
            for clients in args.clients:
                if "stdlib" in args.load:
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
                if wrk is not None:
                    cases.append(run_wrk_case(searcher, data, setup, server, meter, wrk, clients, args))
            if not args.no_steps:
                with console.status("search: the route's steps one by one …"):
                    try:
                        all_steps.append(search_steps(builder_shoal, searcher, data, setup, 100 if args.quick else 400))
                    except (ImportError, AttributeError, TypeError) as exc:
                        notes.append(f"search steps not re-timed: the route's helpers changed ({exc!r})")

            if args.scale_workers > 1 and "scale" not in args.skip:
                server.stop()  # its searcher would otherwise poll the catalog and hold memory during the case
                scaled = Server(
                    settings,
                    database_url,
                    storage_uri,
                    tmp / f"api-workers{args.scale_workers}.log",
                    args.no_access_log,
                    args.scale_workers,
                )
                life.cleanup("the API server", scaled.stop)
                with life.starting(tmp, f"the API server with {args.scale_workers} workers"):
                    scaled.wait_ready()  # every worker process answered /healthz
                console.print(
                    f"[bold]2b. search, scaling[/]: `{scaled.command}` on {scaled.url}, pid {scaled.pid}, worker "
                    f"processes {', '.join(map(str, scaled.worker_pids()))}"
                )
                scaled_meter = Meter(scaled.pid, postmaster)
                if "stdlib" in args.load:
                    t0 = time.perf_counter()
                    with console.status(
                        f"search, {args.scale_clients} clients, --workers {args.scale_workers}: "
                        f"{args.queries:,} queries per side …"
                    ):
                        case = search_case(
                            builder_shoal,
                            searcher,
                            data,
                            setup,
                            scaled,
                            scaled_meter,
                            args.scale_clients,
                            args.queries,
                            args.rounds,
                            args,
                            tmp,
                        )
                    cases.append(case)
                    console.print(
                        f"  {case.label}: HTTP {fmt(case.http.rate())} QPS, in-process {fmt(case.local.rate())} QPS "
                        f"({time.perf_counter() - t0:.1f}s); {case.note}"
                    )
                if wrk is not None:  # after the Python clients' case: its per-connection warm-up came first
                    cases.append(
                        run_wrk_case(searcher, data, setup, scaled, scaled_meter, wrk, args.scale_clients, args)
                    )
                if "upload" not in args.skip and 1_000 in args.batches:
                    # JSON bodies are decoded one at a time per process (the GIL): the concurrent case the issue's
                    # scaling target uses, many clients on several worker processes, is measured here too.
                    t0 = time.perf_counter()
                    points = upload_points(1_000, args)
                    with console.status(f"upload × 1,000, {args.scale_clients} clients, --workers "
                                        f"{args.scale_workers}: {points:,} points per side …"):
                        case = upload_case(shoal, data, scaled, scaled_meter, 1_000, args.scale_clients, points,
                                           args.rounds, args, tmp)
                    cases.append(case)
                    console.print(
                        f"  {case.label}: HTTP {fmt(case.http.rate())} pts/s, in-process {fmt(case.local.rate())} "
                        f"pts/s ({time.perf_counter() - t0:.1f}s)"
                    )
    print_tables(cases, setup, args)
    for st in all_steps:
        ones = [c for c in cases if c.name == st.case and c.clients == 1 and c.workers == 1]
        match = next((c for c in ones if c.load == "stdlib"), ones[0] if ones else None)
        if match is not None:
            st.http_p50_ms, st.server_cpu_ms = match.http_pct(50), match.http.cpu_ms("server")
    if all_steps:
        print_steps(all_steps)
    assert server is not None
    scale_note = (
        f" The `--workers {scaled.workers}` case ran against `{scaled.command}` (the 1-worker server stopped first)."
        if scaled
        else ""
    )
    console.print(
        escape(
            f"HTTP = `{server.command}` in its own process (uvicorn, {args.workers} worker(s), h11, sync routes in "
            f"the threadpool).{scale_note}\n"
            f"clients: threads of this process, one {CLIENT_KINDS[args.client]} each (--client {args.client}); "
            f"request bodies are encoded before the clock starts.\n"
            + (
                f"wrk rows: {WRK} as the client (one process per run, its CPU from getrusage), the same query "
                f"bodies; the search targets are judged on them.\n"
                if "wrk" in args.load
                else ""
            )
            + f"in-process = the same work through the Python API in this process: Producer.upload([DataPoint]) of the "
            f"same points (vectors as float32 numpy rows) for JSON, Producer.upload_columns(vectors, "
            f"{{id, package, installed_size_kb}}) of the same rows for Arrow, Searcher.search(one query) on a "
            f"searcher(follow=False).\n"
            f"upload: points/s acknowledged (durable + committed), ids unique, {args.rounds} interleaved rounds per "
            f"case; commits = log segments made in the timed part (group commit merges concurrent batches).\n"
            f"search: one query vector per request, k={K}, eventual consistency, attributes returned, no vectors; "
            f"{args.queries:,} queries per case and side, cycling through the {len(data.queries):,} held-out queries.\n"
            f"CPU: server = the API process (and its worker processes); clients = this process while the HTTP side "
            f"runs; Postgres = the embedded postmaster and its backends; all over the timed windows only, so "
            f"background work (the server's searcher polling the catalog each second) is included."
        )
    )
    if args.load_note:
        notes.append(args.load_note)
    for note in notes:
        console.print(escape(note))
    print_targets(targets(cases, setup, idem, args))
    console.print(f"total bench time {time.perf_counter() - t_start:.0f}s, load average after {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
