"""Soak bench: sustained uploads for minutes, a following API process searching throughout; its memory at the end
against a fresh API process serving the same index.

Run by hand, never in CI (see bench/README.md, "API bench", "`bench/soak.py`"):

    .venv/bin/python bench/soak.py                          # 10 minutes at 200 points/s
    .venv/bin/python bench/soak.py --minutes 1 --rate 100   # a short pass that checks it works
    .venv/bin/python bench/soak.py --cache-mb 64            # a searcher cache budget smaller than the index

What it does:

1. Brings up an embedded Postgres and Valkey in a temp dir (`Settings(data_dir=tmp)`), preloads a data source
   (`id` int64 key, `package` string, `installed_size_kb` int64, 384-d real vectors) with `--preload` points,
   creates an HNSW index (M=16, ef_construction=200, ef_search=64, cosine) and materializes it in this process;
   then starts a real Celery worker (solo pool, beat embedded) and the API (`python -m shoal.cli api`, 1 worker),
   and waits until the index status route shows the built and served watermarks at the log head.
2. For `--minutes`: `--batch`-entry uploads at `--rate` entries/s through the API (Vektonn JSON by default):
   new ids on vectors reused cyclically, plus updates (`--update-share`) and deletes (`--delete-share`) of live
   ids, so segments get superseded; meanwhile one client thread searches the API continuously (1 query at a
   time, k=10, eventual consistency), and every `--sample-s` the bench samples the API process's RSS, its
   `/metrics` gauges `shoal_searcher_cache_bytes` / `shoal_searcher_cache_budget_bytes`, and the index lag.
3. Waits for the index to catch up, starts a fresh API process on the same settings, searches it until its
   answers equal the old one's, and compares the two processes' RSS (target: old <= 1.3x fresh).

Everything it starts is stopped and removed at the end, also on errors, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shoal.catalog.db import resolve_database_url
from shoal.cli.worker import start_worker_process, stop_worker_process, worker_argv
from shoal.client import Shoal
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder
from shoal.intake.codec import ARROW, JSON, encode_arrow
from shoal.log.records import DataPoint, DataSourceSpec, IndexSpec, Tombstone

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benches' helpers
from _lifecycle import Lifecycle, require_data  # noqa: E402


def _load_api_bench() -> Any:
    """bench/api.py as a module (its Server, light HTTP client and /proc helpers), under a name of its own."""
    spec = importlib.util.spec_from_file_location("shoal_bench_api", Path(__file__).with_name("api.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


apibench = _load_api_bench()
Server = apibench.Server
LightClient = apibench.LightClient
rss_bytes: Callable[[int], int] = apibench.rss_bytes
_load = apibench._load  # the load average, for the report

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "debian-packages"
DATA_DIR = Path(os.environ.get("SHOAL_BENCH_DATA", SHARED))
TENANT = apibench.TENANT
ATTRIBUTES = {"id": "int64", "package": "string", "installed_size_kb": "int64"}
HNSW_PARAMS = {"M": 16, "ef_construction": 200, "ef_search": 64}
K = 10
TARGET_RSS = 1.3  # old API's RSS at the end ÷ a fresh API's serving the same index
CACHE_BYTES = "shoal_searcher_cache_bytes"
CACHE_BUDGET = "shoal_searcher_cache_budget_bytes"
console = Console(width=None if sys.stdout.isatty() else 170)
MB = 1 << 20


# -- data --------------------------------------------------------------------------------------------------


@dataclass
class Data:
    base: np.ndarray  # [N, 384] float32
    queries: np.ndarray  # [Q, 384] float32
    package: list[str]
    size: np.ndarray  # int64


def load_data() -> Data:
    base = np.load(DATA_DIR / "base_f16.npy").astype(np.float32)
    queries = np.load(DATA_DIR / "queries_f16.npy").astype(np.float32)
    table = pq.read_table(DATA_DIR / "points.parquet", columns=["package", "installed_size_kb"])
    if table.num_rows != base.shape[0]:
        raise RuntimeError("points.parquet and base_f16.npy do not have the same rows")
    return Data(base, queries, table["package"].to_pylist(), table["installed_size_kb"].to_numpy().astype(np.int64))


class Writes:
    """The soak's stream of entries: new ids on rows taken cyclically, updates and deletes of live ids."""

    def __init__(self, data: Data, preload: int, update_share: float, delete_share: float, seed: int = 7) -> None:
        self.data = data
        self.rng = np.random.default_rng(seed)
        self.live: list[int] = list(range(preload))  # ids written and not deleted
        self.where: dict[int, int] = {i: i for i in self.live}  # id -> its position in self.live
        self.next_id = preload
        self.next_row = preload % data.base.shape[0]
        self.update_share = update_share
        self.delete_share = delete_share

    def _remove(self, ident: int) -> None:
        at = self.where.pop(ident)
        last = self.live.pop()
        if last != ident:
            self.live[at] = last
            self.where[last] = at

    def _row(self) -> int:
        row = self.next_row
        self.next_row = (self.next_row + 1) % self.data.base.shape[0]
        return row

    def batch(self, n: int) -> tuple[list[tuple[int, int]], list[int]]:
        """The next n entries: upserts (id, base row) then deletes (id), no id twice."""
        n_del = min(int(round(n * self.delete_share)), max(0, len(self.live) - n))
        n_upd = min(int(round(n * self.update_share)), max(0, len(self.live) - n_del))
        picked = self.rng.choice(len(self.live), size=n_upd + n_del, replace=False) if n_upd + n_del else []
        chosen = [self.live[int(i)] for i in picked]
        updates, deletes = chosen[:n_upd], chosen[n_upd:]
        upserts = [(ident, self._row()) for ident in updates]
        for _ in range(n - n_upd - n_del):
            upserts.append((self.next_id, self._row()))
            self.where[self.next_id] = len(self.live)
            self.live.append(self.next_id)
            self.next_id += 1
        for ident in deletes:
            self._remove(ident)
        return upserts, deletes

    def json_body(self, upserts: list[tuple[int, int]], deletes: list[int]) -> bytes:
        """Vektonn upload JSON: the upserts, then tombstones of the deletes."""
        d = self.data
        parts = [
            f'{{"attributes":[{{"key":"id","value":{{"int64":{i}}}}},'
            f'{{"key":"package","value":{{"string":{json.dumps(d.package[r])}}}}},'
            f'{{"key":"installed_size_kb","value":{{"int64":{d.size[r]}}}}}],'
            f'"vector":{{"isSparse":false,"coordinates":{json.dumps(d.base[r].tolist())}}},"isDeleted":false}}'
            for i, r in upserts
        ]
        parts += [f'{{"attributes":[{{"key":"id","value":{{"int64":{i}}}}}],"isDeleted":true}}' for i in deletes]
        return ("[" + ",".join(parts) + "]").encode()

    def arrow_body(self, upserts: list[tuple[int, int]], deletes: list[int]) -> bytes:
        """The same entries as an Arrow IPC stream (`is_deleted` marks the tombstones, whose vectors are ignored)."""
        rows = [r for _, r in upserts] + [0] * len(deletes)
        ids = np.array([i for i, _ in upserts] + deletes, dtype=np.int64)
        return encode_arrow(
            self.data.base[rows],
            {"id": ids, "package": [self.data.package[r] for r in rows], "installed_size_kb": self.data.size[rows]},
            deleted=np.array([False] * len(upserts) + [True] * len(deletes)),
        )

    def items(self, upserts: list[tuple[int, int]], deletes: list[int]) -> list[DataPoint | Tombstone]:
        d = self.data
        out: list[DataPoint | Tombstone] = [
            DataPoint({"id": i, "package": d.package[r], "installed_size_kb": int(d.size[r])}, d.base[r])
            for i, r in upserts
        ]
        return out + [Tombstone({"id": i}) for i in deletes]


# -- reading the API ----------------------------------------------------------------------------------------


def parse_metrics(text: str, names: tuple[str, ...]) -> dict[str, float | None]:
    """The largest sample of each named metric in Prometheus text (None when the metric is absent)."""
    out: dict[str, float | None] = {n: None for n in names}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line[: line.index("{")], line[line.rindex("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        if name in out:
            try:
                value = float(rest.split()[0])
            except (IndexError, ValueError):
                continue
            seen = out[name]
            out[name] = value if seen is None else max(seen, value)
    return out


@dataclass
class Status:
    head: int
    built: int
    served: int

    @property
    def caught_up(self) -> bool:
        return self.built >= self.head and self.served >= self.head


def index_status(client: Any, index: str) -> Status:
    """The index status route, reduced over shards: head, the lowest built and served watermarks."""
    r = client.request("GET", f"/api/v1/indexes/{index}/1/status")
    if r.status != 200:
        raise apibench.HttpError(f"GET /api/v1/indexes/{index}/1/status", r.status, r.body)
    shards = r.json()
    return Status(
        max(s["head"] for s in shards),
        min(s["built_watermark"] for s in shards),
        min(s["served_watermark"] for s in shards),
    )


def search_ids(client: Any, index: str, body: bytes) -> list[int]:
    """One search; the ids of the hits, nearest first."""
    r = client.request("POST", f"/api/v1/search/{index}/1", body, {"Content-Type": JSON})
    if r.status != 200:
        raise apibench.HttpError("POST search", r.status, r.body)
    [result] = r.json()
    return [next(a["value"]["int64"] for a in p["attributes"] if a["key"] == "id") for p in result["nearestDataPoints"]]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, check: Callable[[], None]) -> float:
    """Poll `predicate` until true; seconds it took. `check` raises if a process it needs has died."""
    t0 = time.monotonic()
    while not predicate():
        check()
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)
    return time.monotonic() - t0


# -- the soak ------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    t: float  # seconds since the soak started
    rss: int
    cache: float | None
    budget: float | None
    status: Status | None
    acked: int
    searches: int


@dataclass
class Soak:
    samples: list[Sample] = field(default_factory=list)
    acked: int = 0  # entries (points and tombstones) acknowledged
    batches: int = 0
    late: int = 0  # batches that started more than one interval after their due time
    backpressure: int = 0  # 429/503 answers, retried
    upload_errors: int = 0
    upload_seconds: float = 0.0
    searches: int = 0
    search_errors: int = 0
    search_seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the first few error messages
    metrics_absent: set[str] = field(default_factory=set)
    sample_errors: int = 0

    def note_error(self, what: str) -> None:
        if len(self.errors) < 8:
            self.errors.append(what)


def run_soak(
    args: argparse.Namespace,
    data: Data,
    server: Any,
    writes: Writes,
    index: str,
    shoal: Shoal,
    check: Callable[[], None],
) -> Soak:
    """Uploads at the set rate, one searching client and the sampler, for args.minutes."""
    res = Soak()
    stop = threading.Event()
    lock = threading.Lock()
    duration = args.minutes * 60
    interval = args.batch / args.rate
    producer = shoal.producer(index, "1")
    upload_path = f"/api/v1/upload/{index}/1"
    query_bodies = [
        json.dumps({"k": K, "queryVectors": [{"isSparse": False, "coordinates": q}]}).encode()
        for q in data.queries.tolist()
    ]
    failures: list[BaseException] = []

    def upload_one(client: Any) -> int:
        upserts, deletes = writes.batch(args.batch)
        n = len(upserts) + len(deletes)
        if args.upload_via == "inproc":
            producer.upload(writes.items(upserts, deletes))
            return n
        if args.upload_via == "http-arrow":
            body, kind = writes.arrow_body(upserts, deletes), ARROW
        else:
            body, kind = writes.json_body(upserts, deletes), JSON
        for _ in range(50):
            r = client.request("POST", upload_path, body, {"Content-Type": kind})
            if r.status == 200:
                return n
            if r.status in (429, 503):  # backpressure: the index lags; retry after the server's hint
                with lock:
                    res.backpressure += 1
                try:
                    wait = float(r.headers.get("Retry-After") or 1)
                except ValueError:
                    wait = 1.0
                if stop.wait(min(5.0, max(0.1, wait))):
                    return 0
                continue
            raise apibench.HttpError(f"POST {upload_path}", r.status, r.body)
        raise RuntimeError("upload: still refused after 50 backpressure retries")

    def uploader() -> None:
        client = LightClient(server.url)
        t0 = time.perf_counter()
        i = 0
        consecutive = 0
        try:
            while not stop.is_set():
                due = t0 + i * interval
                if due - t0 >= duration:
                    break
                now = time.perf_counter()
                if now < due:
                    if stop.wait(due - now):
                        break
                elif now - due > interval:
                    res.late += 1
                try:
                    n = upload_one(client)
                    consecutive = 0
                    with lock:
                        res.acked += n
                        res.batches += 1
                except (OSError, apibench.HttpError, RuntimeError) as exc:
                    consecutive += 1
                    with lock:
                        res.upload_errors += 1
                    res.note_error(f"upload: {exc}")
                    if consecutive >= 20:
                        raise RuntimeError(f"20 uploads in a row failed, the last: {exc}") from exc
                i += 1
            res.upload_seconds = time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)
        finally:
            client.close()

    def searcher() -> None:
        client = LightClient(server.url)
        t0 = time.perf_counter()
        q = 0
        try:
            while not stop.is_set() and time.perf_counter() - t0 < duration:
                s0 = time.perf_counter()
                try:
                    search_ids(client, index, query_bodies[q % len(query_bodies)])
                    with lock:
                        res.searches += 1
                    res.latencies.append(time.perf_counter() - s0)
                except (OSError, apibench.HttpError, ValueError, KeyError) as exc:
                    with lock:
                        res.search_errors += 1
                    res.note_error(f"search: {exc}")
                    stop.wait(0.1)
                q += 1
                if args.search_pause_ms:
                    stop.wait(args.search_pause_ms / 1e3)
            res.search_seconds = time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=f, daemon=True, name=f.__name__) for f in (uploader, searcher)]
    client = LightClient(server.url)
    start = time.perf_counter()
    for t in threads:
        t.start()
    last = 0.0
    try:
        while any(t.is_alive() for t in threads):
            check()
            if failures:
                raise failures[0]
            now = time.perf_counter() - start
            if now - last >= args.sample_s or not res.samples:
                last = now
                res.samples.append(sample(client, server, index, res, now, lock))
                s = res.samples[-1]
                lag = f"built lag {s.status.head - s.status.built:,}, served lag {s.status.head - s.status.served:,}"
                console.print(
                    f"  {now:6.0f}s  RSS {s.rss / MB:,.0f} MB, cache {fmt_mb(s.cache)} / {fmt_mb(s.budget)}, "
                    f"{lag if s.status else 'status n/a'}, acked {s.acked:,}, searches {s.searches:,}",
                    highlight=False,
                )
            time.sleep(0.2)
        if failures:
            raise failures[0]
        res.samples.append(sample(client, server, index, res, time.perf_counter() - start, lock))
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        client.close()
    return res


def sample(client: Any, server: Any, index: str, res: Soak, now: float, lock: threading.Lock) -> Sample:
    """RSS, cache gauges and index status of the API, now."""
    cache = budget = None
    status = None
    try:
        r = client.request("GET", "/metrics")
        if r.status == 200:
            found = parse_metrics(r.body.decode(errors="replace"), (CACHE_BYTES, CACHE_BUDGET))
            cache, budget = found[CACHE_BYTES], found[CACHE_BUDGET]
            res.metrics_absent.update(name for name, v in found.items() if v is None)
        else:
            res.sample_errors += 1
            res.note_error(f"GET /metrics: {r.status}")
        status = index_status(client, index)
    except (OSError, apibench.HttpError, ValueError, KeyError) as exc:
        res.sample_errors += 1
        res.note_error(f"sample: {exc}")
    with lock:
        acked, searches = res.acked, res.searches
    return Sample(now, rss_bytes(server.pid), cache, budget, status, acked, searches)


def fmt_mb(x: float | None) -> str:
    return "absent" if x is None else f"{x / MB:,.0f} MB"


# -- main ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="length of the soak (default 10)")
    p.add_argument("--rate", type=float, default=200.0, help="entries uploaded per second (default 200)")
    p.add_argument("--batch", type=int, default=100, help="entries per upload (default 100)")
    p.add_argument("--update-share", type=float, default=0.3, help="share of each batch updating live ids (0.3)")
    p.add_argument("--delete-share", type=float, default=0.1, help="share of each batch deleting live ids (0.1)")
    p.add_argument(
        "--upload-via",
        choices=["http-json", "http-arrow", "inproc"],
        default="http-json",
        help="uploads through the API with Vektonn JSON (default) or an Arrow IPC body, or in this process",
    )
    p.add_argument("--preload", type=int, default=20_000, help="points in the index before the soak (default 20,000)")
    p.add_argument("--cache-mb", type=int, default=None, help="SHOAL_SEARCHER_CACHE_BYTES of the API, in MB")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples (default 5)")
    p.add_argument("--search-pause-ms", type=float, default=0.0, help="pause between searches (default 0)")
    p.add_argument("--fresh-queries", type=int, default=300, help="searches on the fresh API before its RSS (300)")
    p.add_argument("--catchup-timeout", type=float, default=600.0, help="seconds to wait for the index to catch up")
    p.add_argument("--storage", default=None, help="storage root (default SHOAL_STORAGE_URI or the temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, catalog, storage)")
    args = p.parse_args(argv)
    if not 0 <= args.update_share + args.delete_share < 1:
        p.error("--update-share + --delete-share must be in [0, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_data(DATA_DIR, "base_f16.npy", "queries_f16.npy", "points.parquet")
    worker_log: Path | None = None
    with Lifecycle() as life:
        tmp = life.temp_dir("shoal-soak-bench-", keep=args.keep)
        overrides: dict[str, Any] = {"data_dir": tmp}
        if args.storage:
            overrides["storage_uri"] = args.storage
        if args.cache_mb:
            overrides["searcher_cache_bytes"] = args.cache_mb * MB
        console.print(
            f"[bold]shoal soak bench[/] python {platform.python_version()}, {os.cpu_count()} cpus, load average "
            f"{_load()}; {args.minutes:g} min at {args.rate:g} entries/s in {args.batch}-entry batches "
            f"({args.upload_via}), {args.update_share:.0%} updates, {args.delete_share:.0%} deletes"
        )
        t_start = time.perf_counter()
        life.stop_servers(tmp)
        try:
            data = load_data()
            settings = Settings(**overrides)
            with life.starting(tmp):
                if not settings.redis_url:
                    from shoal.servers.embedded import ensure_valkey

                    settings = settings.model_copy(update={"redis_url": ensure_valkey(tmp)})
                settings = settings.model_copy(update={"tenant": TENANT})
                database_url = resolve_database_url(settings)  # starts the embedded Postgres
                shoal = Shoal(settings, tenant=TENANT, notify=False)  # the preload is built here, not queued
            life.cleanup("Shoal connections", shoal.close)
            storage_uri = shoal.storage.root if shoal.storage.local else settings.resolved_storage_uri
            budget = getattr(settings, "searcher_cache_bytes", None)
            extra_env = {"SHOAL_SEARCHER_CACHE_BYTES": str(budget)} if budget else {}

            # 1. preload, index, materialize here; then the worker and the API.
            name = f"bench-soak-{uuid.uuid4().hex[:6]}"
            n = min(args.preload, data.base.shape[0])
            shoal.create_data_source(DataSourceSpec(name, "1", data.base.shape[1], ATTRIBUTES, ["id"]))
            t0 = time.perf_counter()
            producer = shoal.producer(name, "1")
            for s in range(0, n, 10_000):
                e = min(n, s + 10_000)
                producer.upload_columns(
                    data.base[s:e],
                    {
                        "id": np.arange(s, e, dtype=np.int64),
                        "package": data.package[s:e],
                        "installed_size_kb": data.size[s:e],
                    },
                )
            index = shoal.create_index(
                IndexSpec(name, "1", name, "1", algorithm="hnsw", metric="cosine", params=HNSW_PARAMS,
                          id_attributes=["id"])
            )
            for shard in index.shards:
                ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
            console.print(f"preload: {n:,} points ingested and materialized in {time.perf_counter() - t0:.1f}s")

            worker_log = tmp / "worker.log"
            argv = worker_argv(beat=True, schedule=tmp / "beat-schedule", pool="solo", loglevel="info", quick=True)
            worker = start_worker_process(argv, worker_log, settings.child_env())

            def stop_worker() -> None:
                stop_worker_process(worker, 20)
                try:
                    os.killpg(worker.pid, signal.SIGKILL)  # its own session: the embedded beat goes with it
                except (ProcessLookupError, PermissionError):
                    pass

            life.cleanup("the worker processes", stop_worker)
            with life.starting(tmp, "the API server"):
                server = Server(settings, database_url, storage_uri, tmp / "api.log", False, 1, extra_env)
                life.cleanup("the API server", server.stop)
                server.wait_ready()

            def check() -> None:
                if worker.poll() is not None:
                    raise RuntimeError(f"the worker exited with {worker.returncode}; log: {worker_log}")
                if server.proc.poll() is not None:
                    raise RuntimeError(f"the API exited with {server.proc.returncode}:\n{server.tail()}")

            probe = LightClient(server.url)
            life.cleanup("HTTP clients", probe.close)
            warm_body = json.dumps(
                {"k": K, "queryVectors": [{"isSparse": False, "coordinates": data.queries[0].tolist()}]}
            )
            search_ids(probe, name, warm_body.encode())  # the API's searcher loads the index and reports it served
            waited = wait_until(lambda: index_status(probe, name).caught_up, 180, "the preload to be served", check)
            console.print(
                f"worker pid {worker.pid}, API pid {server.pid} on {server.url} (`{server.command}`); the index is "
                f"served at the head after {waited:.1f}s; API RSS {rss_bytes(server.pid) / MB:,.0f} MB"
            )
            head0 = shoal.get_data_source(name, "1").head_seq

            # 2. the soak.
            console.print(f"[bold]soak[/]: {args.minutes:g} min, sampling every {args.sample_s:g}s")
            writes = Writes(data, n, args.update_share, args.delete_share)
            res = run_soak(args, data, server, writes, name, shoal, check)

            # 3. catch up, then a fresh API on the same settings.
            caught = wait_until(
                lambda: index_status(probe, name).caught_up, args.catchup_timeout, "the catch-up", check
            )
            final = index_status(probe, name)
            grown = shoal.get_data_source(name, "1").head_seq - head0
            old_rss_end = rss_bytes(server.pid)
            old_metrics = parse_metrics(
                probe.request("GET", "/metrics").body.decode(), (CACHE_BYTES, CACHE_BUDGET)
            )
            fresh = Server(settings, database_url, storage_uri, tmp / "api-fresh.log", False, 1, extra_env)
            life.cleanup("the API server", fresh.stop)
            fresh.wait_ready()
            fresh_client = LightClient(fresh.url)
            life.cleanup("HTTP clients", fresh_client.close)
            checks = [
                json.dumps({"k": K, "queryVectors": [{"isSparse": False, "coordinates": q}]}).encode()
                for q in data.queries[:5].tolist()
            ]
            expected = [search_ids(probe, name, b) for b in checks]
            same = wait_until(
                lambda: [search_ids(fresh_client, name, b) for b in checks] == expected,
                120,
                "the fresh API's answers to equal the old one's",
                check,
            )
            for q in range(args.fresh_queries):
                coordinates = data.queries[q % len(data.queries)].tolist()
                b = json.dumps({"k": K, "queryVectors": [{"isSparse": False, "coordinates": coordinates}]})
                search_ids(fresh_client, name, b.encode())
            fresh_rss = rss_bytes(fresh.pid)
            old_rss = rss_bytes(server.pid)
            fresh_metrics = parse_metrics(
                fresh_client.request("GET", "/metrics").body.decode(), (CACHE_BYTES, CACHE_BUDGET)
            )
            print_report(
                args,
                res,
                final,
                grown,
                caught,
                same,
                old_rss_end,
                old_rss,
                fresh_rss,
                old_metrics,
                fresh_metrics,
                len(writes.live),
                server,
                fresh,
            )
        except KeyboardInterrupt:
            raise  # Lifecycle reports it, after the cleanup
        except BaseException:
            if worker_log is not None and worker_log.is_file():  # read before the cleanup removes the temp dir
                console.print(
                    escape(
                        "worker log, last lines:\n"
                        + "\n".join(worker_log.read_text(errors="replace").splitlines()[-15:])
                    )
                )
            raise
    console.print(f"total bench time {time.perf_counter() - t_start:.0f}s, load average after {_load()}")
    return 0


def print_report(
    args: argparse.Namespace,
    res: Soak,
    final: Status,
    grown: int,
    caught: float,
    same: float,
    old_rss_end: int,
    old_rss: int,
    fresh_rss: int,
    old_metrics: dict[str, float | None],
    fresh_metrics: dict[str, float | None],
    live: int,
    server: Any,
    fresh: Any,
) -> None:
    """The timeline (at most ~15 samples) and the summary with the targets."""
    timeline = Table(title="Soak timeline (API process, sampled)")
    for col in ("t s", "RSS MB", "cache MB", "budget MB", "head", "built lag", "served lag", "acked", "searches"):
        timeline.add_column(col, justify="right")
    step = max(1, len(res.samples) // 15)
    shown = res.samples[::step]
    if shown[-1] is not res.samples[-1]:
        shown.append(res.samples[-1])
    for s in shown:
        st = s.status
        timeline.add_row(
            f"{s.t:,.0f}",
            f"{s.rss / MB:,.0f}",
            fmt_mb(s.cache).removesuffix(" MB"),
            fmt_mb(s.budget).removesuffix(" MB"),
            f"{st.head:,}" if st else "n/a",
            f"{st.head - st.built:,}" if st else "n/a",
            f"{st.head - st.served:,}" if st else "n/a",
            f"{s.acked:,}",
            f"{s.searches:,}",
        )
    console.print(timeline)

    caches = [s.cache for s in res.samples if s.cache is not None]
    budgets = [s.budget for s in res.samples if s.budget is not None]
    over = [s for s in res.samples if s.cache is not None and s.budget is not None and s.cache > s.budget]
    ratio = old_rss / fresh_rss if fresh_rss else float("nan")
    lags = [s.status.head - s.status.served for s in res.samples if s.status]
    lat = np.array(res.latencies) * 1e3 if res.latencies else np.array([float("nan")])
    summary = Table(title="Soak summary")
    summary.add_column("what")
    summary.add_column("figure", justify="right")
    summary.add_column("target", justify="right")
    summary.add_column("")

    def row(what: str, figure: str, target: str = "", met: bool | None = None) -> None:
        verdict = (
            ""
            if met is None and not target
            else ("n/a" if met is None else ("[green]met[/]" if met else "[red]not met[/]"))
        )
        summary.add_row(escape(what), escape(figure), escape(target), verdict)

    row("old API RSS at the end of the soak (after the catch-up)", f"{old_rss_end / MB:,.0f} MB")
    row("old API RSS beside the fresh one", f"{old_rss / MB:,.0f} MB")
    row(f"fresh API RSS (same index, after {args.fresh_queries} searches)", f"{fresh_rss / MB:,.0f} MB")
    row("old ÷ fresh RSS", f"{ratio:.2f}x", f"<= {TARGET_RSS:.1f}x", ratio <= TARGET_RSS if ratio == ratio else None)
    if caches and budgets:
        row(
            "searcher cache: max bytes seen ÷ budget",
            f"{max(caches) / MB:,.1f} MB / {max(budgets) / MB:,.1f} MB ({len(over)} samples over)",
            "never above",
            not over,
        )
    else:
        row(
            "searcher cache: max bytes seen ÷ budget",
            f"gauges absent from /metrics: {', '.join(sorted(res.metrics_absent)) or 'n/a'}",
            "never above",
            None,
        )
    row(
        "cache bytes at the end: old / fresh API",
        f"{fmt_mb(old_metrics.get(CACHE_BYTES))} / {fmt_mb(fresh_metrics.get(CACHE_BYTES))}",
    )
    qps = res.searches / res.search_seconds if res.search_seconds else float("nan")
    row(
        "search during the soak: QPS, p50 / p99 ms",
        f"{qps:,.1f} QPS, {np.percentile(lat, 50):,.1f} / {np.percentile(lat, 99):,.1f} ms, {res.searches:,} searches",
    )
    row("search errors", f"{res.search_errors:,}", "0", res.search_errors == 0)
    rate = res.acked / res.upload_seconds if res.upload_seconds else float("nan")
    row(
        f"upload rate achieved ({args.upload_via}, {args.batch}-entry batches)",
        f"{rate:,.1f} entries/s of {args.rate:g}; {res.batches:,} batches, {res.late} late",
    )
    row(
        "upload errors / backpressure answers (retried)",
        f"{res.upload_errors:,} / {res.backpressure:,}",
        "0 errors",
        res.upload_errors == 0,
    )
    row("entries in the log vs acknowledged", f"{grown:,} / {res.acked:,}", "equal", grown == res.acked)
    row(
        "served lag during the soak: max / last sample (seqs)",
        f"{max(lags, default=0):,} / {lags[-1] if lags else 0:,}",
    )
    row(
        "catch-up after the soak", f"{caught:.1f}s; head {final.head:,}, built {final.built:,}, served {final.served:,}"
    )
    row("fresh API: answers equal the old one's after", f"{same:.1f}s")
    row("live points at the end", f"{live:,}")
    console.print(summary)
    if res.errors:
        console.print(escape("first errors:\n  " + "\n  ".join(res.errors)))
    if res.metrics_absent:
        console.print(escape(f"absent from the API's /metrics: {', '.join(sorted(res.metrics_absent))}"))
    console.print(
        escape(
            f"API: `{server.command}` (1 worker), RSS = VmRSS of /proc/PID/status; the fresh API `{fresh.command}` "
            f"ran on the same catalog, storage and settings. Cache gauges: the largest sample of each metric."
        )
    )


if __name__ == "__main__":
    sys.exit(main())
