"""Catalog bench: commits/s and index-version publishes/s against Postgres, from many processes.

Run by hand, never in CI or tests (see bench/README.md, "Catalog bench"):

    .venv/bin/python bench/catalog.py            # 1, 2, 4, 8, 16 processes, 4 s per case (about 5 minutes)
    .venv/bin/python bench/catalog.py --quick    # 1, 4, 16 processes, 1.5 s per case (about 1.5 minutes)

Every case runs in separate worker processes (multiprocessing, spawn), each with its own Shoal and its own
catalog connections, so the GIL of one process does not cap the figure. The processes start once and stay
for all cases; a case with N processes uses the first N. They start their timed loop together at a given
instant and stop at a deadline; an operation counts when it completed inside the window.

Cases, per process count N:

* upload, full write path: `Shoal(settings).producer(name, "1").upload_columns(...)` of 1 or 100 real 384-d
  vectors (all-MiniLM-L6-v2 from the debian-packages set) per call, to (a) one shared data source (all N
  processes contend on its row lock) or (b) one data source per process. This includes validation, the
  Parquet encode, sha256, temp file, fsync, rename, directory fsync, the catalog transaction and the head
  announcement on the broker (one Redis EVAL per commit).
* catalog only: `shoal.log.commit.commit_group` (the real commit protocol: row lock, segment row, head
  compare-and-swap, COMMIT) with the segment writer replaced by one that returns a made-up WrittenSegment
  and writes no file, and no head announcement. The size of the batch does not matter to it.
* publish: `ShardCatalog.publish_version` (the real path: version row, active-pointer compare-and-swap,
  `index_files` rows, with `shoal.upkeep.gc.publishable` as the precondition, as the builder passes it;
  no lease guard) of a small manifest (4 segments, 8 files, the newest segment replaced each time) on
  (a) one shard per process, or (b) one shard for all N processes. Each attempt first reads the shard's
  active version (one SELECT, as a builder does); a publish that loses the compare-and-swap counts as lost.
* references, bare psycopg (no SQLAlchemy, no pre-ping, no lock_timeout), same processes:
  `insert`: `INSERT ...; COMMIT` per op: the ceiling of commits/s Postgres gives on this machine;
  `lockrow`: `SELECT ... FOR UPDATE; INSERT; UPDATE head; COMMIT`, on one shared row or a row per process:
  the commit protocol's SQL with nothing around it.

The embedded Postgres (and Valkey, for the head announcements) run in a temp data dir and are stopped at the
end, also on errors, Ctrl-C and SIGTERM, unless SHOAL_DATABASE_URL (and SHOAL_REDIS_URL) are set; then the
bench's data sources, index and reference tables are dropped at the end.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import queue
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benches' helpers

from _lifecycle import Lifecycle, children_ignore_sigint, require_data  # noqa: E402
from index import _load, percentile  # noqa: E402
from ingest import DATA_DIR, fmt_rate  # noqa: E402

from shoal.config.settings import Settings  # noqa: E402

DIM = 384
# In every name the run makes; the spawned workers inherit it through the environment.
TAG = os.environ.setdefault("SHOAL_CATALOG_BENCH_TAG", uuid.uuid4().hex[:6])
SHARED_SOURCE = f"cat-shared-{TAG}"
FAKE_SHARED_SOURCE = f"cat-fake-shared-{TAG}"
INDEX_SOURCE = f"cat-idx-src-{TAG}"
INDEX = f"cat-idx-{TAG}"
REF_TABLE = f"bench_catalog_ref_{TAG}"
HEAD_TABLE = f"bench_catalog_head_{TAG}"
console = Console(width=None if sys.stdout.isatty() else 170)


def own_source(rank: int) -> str:
    return f"cat-own-{rank}-{TAG}"


def fake_own_source(rank: int) -> str:
    return f"cat-fake-own-{rank}-{TAG}"


def psycopg_url(sqlalchemy_url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(sqlalchemy_url).set(drivername="postgresql").render_as_string(hide_password=False)


# -- the worker processes -----------------------------------------------------------------------------------


def load_vectors(rows: int) -> np.ndarray:
    """The first `rows` real vectors (the parent checked the file is there: no silent stand-in)."""
    base = np.load(DATA_DIR / "base_f16.npy", mmap_mode="r")
    return np.ascontiguousarray(base[:rows], dtype=np.float32)


class Worker:
    """What one process holds between cases: its Shoal, producers, a psycopg connection, ids."""

    def __init__(self, rank: int, cfg: dict[str, Any]) -> None:
        from shoal.client import Shoal

        self.rank = rank
        self.cfg = cfg
        self.shoal = Shoal(Settings(**cfg["settings"]), notify=False)
        self.vectors = load_vectors(100)
        self.next_id = (rank + 1) * 1_000_000_000
        self.producers: dict[str, Any] = {}
        self.sources: dict[str, int] = {}
        self.pg: Any = None
        self.last_files: dict[int, list[dict[str, Any]]] = {}

    def close(self) -> None:
        if self.pg is not None:
            self.pg.close()
        self.shoal.close()

    # One operation of each kind; each returns (latency seconds, won) for the timed part.

    def op_upload(self, source: str, batch: int) -> tuple[float, bool]:
        producer = self.producers.get(source)
        if producer is None:
            producer = self.producers[source] = self.shoal.producer(source, "1")
        ids = np.arange(self.next_id, self.next_id + batch, dtype=np.int64)
        self.next_id += batch
        vectors = self.vectors[:batch]
        t0 = time.perf_counter()
        producer.upload_columns(vectors, {"id": ids})
        return time.perf_counter() - t0, True

    def op_catalog(self, source: str, batch: int) -> tuple[float, bool]:
        from shoal.log.commit import BatchSlot, commit_group
        from shoal.log.segment_file import WrittenSegment

        source_id = self.sources.get(source)
        if source_id is None:
            source_id = self.sources[source] = self.shoal.get_data_source(source, "1").id
        settings = self.shoal.settings

        def no_file(first_seq: int, keep: list[int]) -> WrittenSegment:
            sid = uuid.uuid4()
            return WrittenSegment(sid, f"bench-no-file/{sid}.parquet", batch * (DIM * 4 + 40), "0" * 64, batch, 0)

        t0 = time.perf_counter()
        commit_group(
            self.shoal.engine, source_id, [BatchSlot(batch, None)], no_file, lambda path: None,
            retries=settings.commit_retries, lock_timeout_ms=settings.lock_timeout_ms,
        )
        return time.perf_counter() - t0, True

    def op_publish(self, shard_id: int, generation: int) -> tuple[float, bool]:
        from sqlalchemy import select

        from shoal.catalog.models import IndexShard
        from shoal.index.segment import manifest_files
        from shoal.upkeep.gc import publishable

        with self.shoal.engine.connect() as conn:
            active, built = conn.execute(
                select(IndexShard.active_version_id, IndexShard.built_watermark).where(IndexShard.id == shard_id)
            ).one()
        segments = list(self.last_files.get(shard_id, []))
        sid = uuid.uuid4().hex
        seg_dir = f"bench/indexes/{INDEX}/1/shard-{shard_id}/seg-{sid}"
        new = {
            "id": sid, "dir": seg_dir, "rows": 100, "min_seq": built + 1, "max_seq": built + 100,
            "rows_checksum": "0" * 64,
            "splits": [{"key": "", "values": {}, "start": 0, "end": 100, "file": "split-0.bin", "checksum": "0" * 64}],
            "deleted": None,
        }
        segments = ([*segments[:3], new] if len(segments) >= 4 else [*segments, new])
        manifest = {"generation": generation, "watermark": built + 100, "segments": segments}
        files = manifest_files([manifest])
        new_files = sorted(manifest_files([{"generation": generation, "watermark": built + 100, "segments": [new]}]))
        t0 = time.perf_counter()
        version_id = self.shoal.shards.publish_version(
            shard_id, active, generation, built + 100, manifest, files=files,
            precondition=lambda c: publishable(c, new_files),
        )
        elapsed = time.perf_counter() - t0
        if version_id is not None:
            self.last_files[shard_id] = segments
        return elapsed, version_id is not None

    def _pg(self) -> Any:
        if self.pg is None:
            import psycopg

            self.pg = psycopg.connect(self.cfg["psycopg_url"], application_name=f"bench-catalog/{os.getpid()}")
        return self.pg

    def op_insert(self, _target: Any, batch: int) -> tuple[float, bool]:
        pg = self._pg()
        t0 = time.perf_counter()
        pg.execute(f"INSERT INTO {REF_TABLE} (rank, n) VALUES (%s, %s)", (self.rank, batch))
        pg.commit()
        return time.perf_counter() - t0, True

    def op_lockrow(self, row: int, batch: int) -> tuple[float, bool]:
        pg = self._pg()
        t0 = time.perf_counter()
        head = pg.execute(f"SELECT head FROM {HEAD_TABLE} WHERE id = %s FOR UPDATE", (row,)).fetchone()[0]
        pg.execute(f"INSERT INTO {REF_TABLE} (rank, n) VALUES (%s, %s)", (self.rank, head + batch))
        pg.execute(f"UPDATE {HEAD_TABLE} SET head = head + %s WHERE id = %s AND head = %s", (batch, row, head))
        pg.commit()
        return time.perf_counter() - t0, True

    def run(self, case: dict[str, Any]) -> dict[str, Any]:
        fn = getattr(self, "op_" + case["kind"])
        target = case["targets"][self.rank]
        arg = case["arg"]
        for _ in range(case["warm"]):
            fn(target, arg)
        while time.monotonic() < case["go_at"]:
            time.sleep(min(0.005, max(0.0, case["go_at"] - time.monotonic())))
        lat: list[float] = []
        lost: list[float] = []
        deadline = case["go_at"] + case["seconds"]
        cpu0, done = time.process_time(), 0
        while True:
            latency, won = fn(target, arg)
            done += 1
            end = time.monotonic()
            if end > deadline:
                break
            (lat if won else lost).append(latency)
        return {"lat": lat, "lost": lost, "cpu": time.process_time() - cpu0, "done": done}


def worker_main(rank: int, cfg: dict[str, Any], cmd_q: Any, res_q: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    parent = os.getppid()
    try:
        worker = Worker(rank, cfg)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        res_q.put((rank, "error", repr(exc)))
        return
    res_q.put((rank, "ready", None))
    try:
        while True:
            try:
                case = cmd_q.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:  # the parent died: do not linger
                    return
                continue
            if case is None:
                return
            try:
                res_q.put((rank, "ok", worker.run(case)))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                res_q.put((rank, "error", repr(exc)))
    finally:
        worker.close()


# -- the parent ------------------------------------------------------------------------------------------


@dataclass
class Result:
    group: str
    case: str
    procs: int
    batch: int
    seconds: float
    lat: list[float] = field(default_factory=list)
    lost: list[float] = field(default_factory=list)
    client_cpu_ms: float = float("nan")  # CPU of the bench processes per operation (all ops they ran)
    pg_cpu_ms: float = float("nan")  # CPU of the Postgres server processes per operation (local server only)

    @property
    def ops(self) -> float:
        return len(self.lat) / self.seconds

    @property
    def attempts(self) -> float:
        return (len(self.lat) + len(self.lost)) / self.seconds

    def p(self, q: float) -> float:
        return percentile(self.lat, q) * 1000


class Pool:
    def __init__(self, n: int, cfg: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.res_q = ctx.Queue()
        self.cmd_qs = [ctx.Queue() for _ in range(n)]
        self.procs = [
            ctx.Process(target=worker_main, args=(r, cfg, self.cmd_qs[r], self.res_q), daemon=True, name=f"cat-{r}")
            for r in range(n)
        ]

    def start(self) -> None:
        """Start the workers and wait until each has its Shoal. Separate from __init__ so that the caller can
        register `stop` first: an interrupt while they start still stops them."""
        with children_ignore_sigint():  # a terminal's Ctrl-C is for this process; it stops the workers
            for p in self.procs:
                p.start()
        for _ in self.procs:
            rank, status, info = self.res_q.get(timeout=180)
            if status != "ready":
                raise RuntimeError(f"worker {rank} failed to start: {info}")

    def run(self, n: int, case: dict[str, Any], pg_cpu: Any) -> tuple[list[dict[str, Any]], float]:
        """Run the case on the first n workers; their results and the Postgres CPU seconds of the window."""
        case = {**case, "go_at": time.monotonic() + case.pop("lead")}
        for r in range(n):
            self.cmd_qs[r].put(case)
        time.sleep(max(0.0, case["go_at"] - time.monotonic()))
        pg0 = pg_cpu()
        out: list[dict[str, Any]] = []
        for _ in range(n):
            rank, status, info = self.res_q.get(timeout=case["seconds"] + 300)
            if status != "ok":
                raise RuntimeError(f"worker {rank}: {info}")
            out.append(info)
        return out, pg_cpu() - pg0

    def stop(self) -> None:
        for q in self.cmd_qs:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        started = [p for p in self.procs if p.pid is not None]  # an interrupt may come before all have started
        deadline = time.monotonic() + 15
        for p in started:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in started:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def setup_catalog(shoal: Any, url: str, procs: int) -> tuple[list[int], int]:
    """Data sources, the index of `procs` shards and the reference tables; return (shard ids, generation)."""
    import psycopg

    from shoal.log.records import DataSourceSpec, IndexSpec

    attrs = {"id": "int64"}
    for name in [SHARED_SOURCE, FAKE_SHARED_SOURCE, INDEX_SOURCE]:
        shoal.create_data_source(DataSourceSpec(name, "1", DIM, attrs, ["id"]))
    for r in range(procs):
        shoal.create_data_source(DataSourceSpec(own_source(r), "1", DIM, attrs, ["id"]))
        shoal.create_data_source(DataSourceSpec(fake_own_source(r), "1", DIM, attrs, ["id"]))
    index = shoal.create_index(IndexSpec(INDEX, "1", INDEX_SOURCE, "1", algorithm="flat", shard_count=procs))
    with psycopg.connect(url) as pg:
        pg.execute(f"CREATE TABLE {REF_TABLE} (id bigserial PRIMARY KEY, rank int, n bigint, "
                   "at timestamptz DEFAULT clock_timestamp())")
        pg.execute(f"CREATE TABLE {HEAD_TABLE} (id int PRIMARY KEY, head bigint NOT NULL)")
        pg.execute(f"INSERT INTO {HEAD_TABLE} SELECT g, 0 FROM generate_series(0, %s) g", (procs,))
    return [s.id for s in sorted(index.shards, key=lambda s: s.shard_no)], index.generation


def drop_catalog(shoal: Any, url: str, procs: int) -> None:
    import psycopg

    for name in [INDEX]:
        try:
            shoal.drop_index(name, "1")
        except Exception as exc:  # noqa: BLE001 - keep cleaning up
            console.print(f"cleanup: {exc!r}")
    for name in [SHARED_SOURCE, FAKE_SHARED_SOURCE, INDEX_SOURCE,
                 *(own_source(r) for r in range(procs)), *(fake_own_source(r) for r in range(procs))]:
        try:
            shoal.drop_data_source(name, "1")
        except Exception as exc:  # noqa: BLE001
            console.print(f"cleanup: {exc!r}")
    with psycopg.connect(url) as pg:
        pg.execute(f"DROP TABLE IF EXISTS {REF_TABLE}")
        pg.execute(f"DROP TABLE IF EXISTS {HEAD_TABLE}")


Case = tuple[str, str, int, int, dict[str, Any]]


def plan(levels: list[int], batches: list[int], shards: list[int], generation: int) -> list[Case]:
    """(group, case label, processes, batch, case) in run order."""
    out = []
    for n in levels:
        ranks = range(n)
        for batch in batches:
            out.append(("upload", "shared source", n, batch,
                        {"kind": "upload", "targets": [SHARED_SOURCE] * n, "arg": batch}))
            out.append(("upload", "source each", n, batch,
                        {"kind": "upload", "targets": [own_source(r) for r in ranks], "arg": batch}))
        out.append(("catalog", "shared source", n, 1,
                    {"kind": "catalog", "targets": [FAKE_SHARED_SOURCE] * n, "arg": 1}))
        out.append(("catalog", "source each", n, 1,
                    {"kind": "catalog", "targets": [fake_own_source(r) for r in ranks], "arg": 1}))
        out.append(("ref", "insert", n, 1, {"kind": "insert", "targets": [0] * n, "arg": 1}))
        out.append(("ref", "lockrow shared", n, 1, {"kind": "lockrow", "targets": [0] * n, "arg": 1}))
        out.append(("ref", "lockrow each", n, 1, {"kind": "lockrow", "targets": [r + 1 for r in ranks], "arg": 1}))
        out.append(("publish", "shard each", n, 0,
                    {"kind": "publish", "targets": [shards[r] for r in ranks], "arg": generation}))
        out.append(("publish", "one shard", n, 0,
                    {"kind": "publish", "targets": [shards[0]] * n, "arg": generation}))
    return out


def pg_cpu_reader(url: str) -> Any:
    """A function returning the CPU seconds used so far by the Postgres server's processes (postmaster and its
    children, read from /proc), or NaN when the server is not on this machine."""
    import psycopg

    with psycopg.connect(url) as pg:
        data_dir = Path(str(pg.execute("SHOW data_directory").fetchone()[0]))
    try:
        postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return lambda: float("nan")
    tick = os.sysconf("SC_CLK_TCK")

    def read() -> float:
        total = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(entry.name) == postmaster or int(fields[1]) == postmaster:
                total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / tick

    return read


def pg_facts(url: str) -> dict[str, str]:
    import psycopg

    keys = ["server_version", "fsync", "synchronous_commit", "wal_sync_method", "commit_delay", "shared_buffers",
            "max_connections", "wal_level"]
    with psycopg.connect(url) as pg:
        return {k: str(pg.execute(f"SHOW {k}").fetchone()[0]) for k in keys}


def print_results(results: list[Result], facts: dict[str, str], header: str) -> None:
    refs = {(r.case, r.procs): r for r in results if r.group == "ref"}

    def ratio(x: float, ref: Result | None) -> str:
        return f"{x / ref.ops:.2f}x" if ref and ref.ops else "-"

    t = Table(title="Catalog bench: commits/s (separate processes; ops counted inside the timed window)")
    for col, j in [("path", "left"), ("target", "left"), ("procs", "right"), ("pts/commit", "right"),
                   ("commits/s", "right"), ("points/s", "right"), ("p50 ms", "right"), ("p99 ms", "right"),
                   ("vs lockrow\n(same sharing)", "right"), ("vs insert\nceiling", "right"),
                   ("CPU ms/op\nclient", "right"), ("CPU ms/op\nPostgres", "right")]:
        t.add_column(col, justify=j)  # type: ignore[arg-type]
    for r in results:
        if r.group not in ("upload", "catalog"):
            continue
        lock = refs.get(("lockrow shared" if r.case == "shared source" else "lockrow each", r.procs))
        path = "upload_columns (full)" if r.group == "upload" else "commit_group (no file)"
        t.add_row(path, r.case, str(r.procs), f"{r.batch:,}", fmt_rate(r.ops), fmt_rate(r.ops * r.batch),
                  f"{r.p(50):.2f}", f"{r.p(99):.2f}", ratio(r.ops, lock), ratio(r.ops, refs.get(("insert", r.procs))),
                  f"{r.client_cpu_ms:.2f}", f"{r.pg_cpu_ms:.2f}")
    console.print(t)

    t = Table(title="References: bare psycopg, same processes (commits/s Postgres gives on this machine)")
    for col in ["reference", "procs", "commits/s", "p50 ms", "p99 ms", "CPU ms/op client", "CPU ms/op Postgres"]:
        t.add_column(col, justify="left" if col == "reference" else "right")
    for r in results:
        if r.group == "ref":
            t.add_row(r.case, str(r.procs), fmt_rate(r.ops), f"{r.p(50):.2f}", f"{r.p(99):.2f}",
                      f"{r.client_cpu_ms:.2f}", f"{r.pg_cpu_ms:.2f}")
    console.print(t)

    t = Table(title="Index version publishes/s: ShardCatalog.publish_version (small manifest: 4 segments, 8 files)")
    for col in ["target", "procs", "published/s", "attempts/s", "lost CAS", "p50 ms", "p99 ms", "vs insert ceiling",
                "CPU ms/attempt client", "CPU ms/attempt Postgres"]:
        t.add_column(col, justify="left" if col == "target" else "right")
    for r in results:
        if r.group == "publish":
            lost = len(r.lost) / max(1, len(r.lat) + len(r.lost))
            t.add_row(r.case, str(r.procs), fmt_rate(r.ops), fmt_rate(r.attempts), f"{lost:.0%}",
                      f"{r.p(50):.2f}", f"{r.p(99):.2f}", ratio(r.ops, refs.get(("insert", r.procs))),
                      f"{r.client_cpu_ms:.2f}", f"{r.pg_cpu_ms:.2f}")
    console.print(t)
    console.print(header)
    console.print(
        "CPU ms/op: process CPU of the bench's worker processes, and of the Postgres server's processes (from "
        "/proc, local server only), over the timed window, divided by every operation run in it (lost publishes "
        "and the one that ran past the deadline included). Client CPU includes Python, SQLAlchemy, psycopg, and "
        "for uploads validation, Parquet encode, sha256, file writes and the Redis head announcement."
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", default=None, help="process counts (default 1,2,4,8,16; --quick 1,4,16)")
    p.add_argument("--batches", default="1,100", help="points per upload for the full path (default 1,100)")
    p.add_argument("--seconds", type=float, default=None, help="timed seconds per case (default 4; --quick 1.5)")
    p.add_argument("--quick", action="store_true", help="a short pass: fewer process counts, shorter cases")
    p.add_argument("--keep", action="store_true", help="keep the temp data dir")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = [int(x) for x in (args.procs or ("1,4,16" if args.quick else "1,2,4,8,16")).split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    seconds = args.seconds or (1.5 if args.quick else 4.0)
    top = max(levels)
    require_data(DATA_DIR, "base_f16.npy")
    results: list[Result] = []
    with Lifecycle() as life:
        tmp = life.temp_dir("shoal-catalog-bench-", keep=args.keep)
        settings = Settings(data_dir=tmp)
        embedded = not settings.database_url
        t_start = time.perf_counter()
        console.print(
            f"[bold]shoal catalog bench[/] python {platform.python_version()}, {os.cpu_count()} cpus, "
            f"load average before {_load()}; processes {levels}, {seconds} s per case"
        )
        from shoal.catalog.db import resolve_database_url
        from shoal.client import Shoal
        from shoal.servers.embedded import ensure_valkey

        life.stop_servers(tmp)  # the embedded Valkey, and Postgres unless SHOAL_DATABASE_URL is set
        with life.starting(tmp):
            redis_url = settings.redis_url or ensure_valkey(tmp)
            # The first Shoal starts the embedded catalog (and migrates it); the workers then reach it by URL.
            shoal = Shoal(Settings(data_dir=tmp, redis_url=redis_url), notify=False)
        life.cleanup("Shoal connections", shoal.close)
        url = resolve_database_url(shoal.settings)
        if not embedded:
            life.cleanup("the bench's objects in the shared catalog",
                         lambda: drop_catalog(shoal, psycopg_url(url), top))
        child = {"data_dir": str(tmp), "database_url": url, "redis_url": redis_url,
                 "storage_uri": shoal.settings.resolved_storage_uri}
        facts = pg_facts(psycopg_url(url))
        pg_cpu = pg_cpu_reader(psycopg_url(url))
        shards, generation = setup_catalog(shoal, psycopg_url(url), top)
        s = shoal.settings
        header = (
            f"machine: {os.cpu_count()} cores ({platform.machine()}), clients and Postgres share them; "
            f"Postgres {facts['server_version']} ({'embedded in ' + str(tmp) if embedded else 'SHOAL_DATABASE_URL'}): "
            f"fsync={facts['fsync']}, synchronous_commit={facts['synchronous_commit']}, "
            f"wal_sync_method={facts['wal_sync_method']}, commit_delay={facts['commit_delay']}, "
            f"shared_buffers={facts['shared_buffers']}, max_connections={facts['max_connections']}\n"
            f"shoal settings: lock_timeout_ms={s.lock_timeout_ms}, commit_retries={s.commit_retries}, "
            f"group_commit_max_points={s.group_commit_max_points}, db_pool_size={s.db_pool_size}; one thread "
            f"per process (no group commit across processes); storage {shoal.storage.root}; "
            f"head announcements to {'embedded Valkey' if not settings.redis_url else 'SHOAL_REDIS_URL'}; "
            f"{dim_note()}"
        )
        console.print(header)
        console.print(f"starting {top} worker processes …")
        pool = Pool(top, {"settings": child, "psycopg_url": psycopg_url(url)})
        life.cleanup("worker processes", pool.stop)
        with life.starting(tmp, f"{top} worker processes"):
            pool.start()
        for group, label, n, batch, case in plan(levels, batches, shards, generation):
            case.update(seconds=seconds, warm=2, lead=0.3 + 0.05 * n)
            per, pg_seconds = pool.run(n, case, pg_cpu)
            r = Result(group, label, n, batch, seconds)
            for w in per:
                r.lat += w["lat"]
                r.lost += w["lost"]
            done = sum(w["done"] for w in per)
            r.client_cpu_ms = sum(w["cpu"] for w in per) / done * 1000
            r.pg_cpu_ms = pg_seconds / done * 1000
            results.append(r)
            extra = f", lost {len(r.lost)}" if r.lost else ""
            console.print(
                f"  {group:8} {label:15} procs {n:2} batch {batch:3}: {fmt_rate(r.ops)} ops/s, "
                f"p50 {r.p(50):.2f} ms, p99 {r.p(99):.2f} ms{extra}, CPU ms/op client {r.client_cpu_ms:.2f} "
                f"Postgres {r.pg_cpu_ms:.2f}  (load {_load()})"
            )
    print_results(results, facts, header)
    console.print(f"total bench time {time.perf_counter() - t_start:.0f}s, load average after {_load()}")
    return 0


def dim_note() -> str:
    return f"vectors {DIM}-d float32 from {DATA_DIR.name}/base_f16.npy"


if __name__ == "__main__":
    sys.exit(main())
