"""Ingest throughput bench: durable points per second of Shoal's log writer against raw pyarrow.

Run by hand, never in CI (see bench/README.md):

    .venv/bin/python bench/ingest.py                       # 384-d and 1536-d, batches 1, 100, 10,000
    .venv/bin/python bench/ingest.py --dims 1536 --batches 10000 --points 200000

For every (dimension, batch size) case it measures, in the same run and on the same disk:

* ours: points acknowledged per second by `Producer.upload` / `Producer.upload_columns` (acknowledged means
  durable: segment written, fsynced, renamed, directory fsynced, catalog transaction committed).
  Batch size 1 runs `--threads` producer threads sharing one `Shoal`, each uploading one-point batches,
  so group commit can merge them; larger batches run one producer calling `upload_columns`.
* raw: plain pyarrow writing the same rows (id int64, package string, installed_size_kb int64, vector
  fixed_size_list<float32>[dim]) as one Parquet file per batch into the same storage directory: temp
  file, `os.fsync`, rename, which is what a careful raw writer does per batch. For batch size 1 that is
  one file per point, written by the same number of threads (a naive per-upload writer).
  Two raw references are timed: `pq.write_table` with its defaults (snappy and dictionary on every
  column), and the same call with the encoding Shoal uses for segments (vector column uncompressed and
  without dictionary; attribute columns snappy + dictionary), which isolates Shoal's own overhead.

The embedded Postgres is started in a temporary data directory and stopped at the end, unless
SHOAL_DATABASE_URL is set. SHOAL_STORAGE_URI (or --storage) chooses where the segments and raw files go.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from sqlalchemy import text

from shoal.client import Producer, Shoal
from shoal.config.settings import Settings
from shoal.log.records import DataPoint, DataSourceSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benches' helpers
from _lifecycle import Lifecycle, require_data  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "debian-packages"  # ../shared beside the repo
DATA_DIR = Path(os.environ.get("SHOAL_BENCH_DATA", SHARED))
ATTRIBUTES = {"id": "int64", "package": "string", "installed_size_kb": "int64"}
POOL_1536 = 20_000  # distinct 1536-d vectors built from the 384-d ones (batches cycle through them)
# Default total points per case: sized so the whole default bench takes about two minutes on 2 cores.
DEFAULT_POINTS = {1: 4_000, 100: 30_000, 10_000: 150_000}
# Wide enough for the table when the output is piped to a file or a log.
console = Console(width=None if sys.stdout.isatty() else 160)


# -- data ---------------------------------------------------------------------------------------------


@dataclass
class Pool:
    """Real rows to cycle through: vectors [P, dim] float32 and the attribute columns of the same rows."""

    dim: int
    vectors: np.ndarray
    package: pa.Array  # string
    package_py: list[str]
    size: np.ndarray  # int64
    origin: str

    @property
    def rows(self) -> int:
        return self.vectors.shape[0]

    def start(self, k: int, n: int) -> int:
        """First pool row of the k-th batch of n points: contiguous slices, wrapping to 0."""
        s = (k * n) % self.rows
        return 0 if s + n > self.rows else s


def load_pools(dims: list[int]) -> dict[int, Pool]:
    base = np.load(DATA_DIR / "base_f16.npy").astype(np.float32)  # [N, 384] float16 widened
    points = pq.read_table(DATA_DIR / "points.parquet", columns=["package", "installed_size_kb"])
    n = base.shape[0]
    pools: dict[int, Pool] = {}
    for dim in dims:
        if dim == base.shape[1]:
            vectors, rows = base, np.arange(n)
            origin = f"debian-packages base_f16.npy ({n} real all-MiniLM-L6-v2 vectors, widened to float32)"
        elif dim % base.shape[1] == 0:
            # Concatenate `reps` consecutive real vectors (rows reps*i .. reps*i+reps-1, wrapping) and scale
            # by 1/sqrt(reps): unit norm again, real value distribution, no two pool rows alike.
            reps = dim // base.shape[1]
            rows = np.arange(POOL_1536)
            idx = (rows[:, None] * reps + np.arange(reps)[None, :]) % n
            vectors = np.ascontiguousarray(base[idx].reshape(POOL_1536, dim) / np.float32(np.sqrt(reps)))
            origin = (
                f"{reps} consecutive real 384-d vectors concatenated and renormalised "
                f"({POOL_1536} distinct rows, cycled)"
            )
        else:
            rng = np.random.default_rng(20261122)
            vectors = rng.standard_normal((POOL_1536, dim), dtype=np.float32)
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
            rows = np.arange(POOL_1536)
            origin = f"random normalised vectors ({POOL_1536} rows, cycled)"
        take = pa.array(rows % n)
        package = points["package"].take(take).combine_chunks()
        size = points["installed_size_kb"].take(take).to_numpy().astype(np.int64)
        pools[dim] = Pool(dim, vectors, package, package.to_pylist(), size, origin)
    return pools


# -- raw pyarrow reference ---------------------------------------------------------------------------

# The encoding Shoal's segment writer uses (shoal/log/segment_file.py), applied to the raw columns.
MATCHED_OPTIONS: dict[str, Any] = {
    "compression": {"id": "snappy", "package": "snappy", "installed_size_kb": "snappy", "vector": "none"},
    "use_dictionary": ["id", "package", "installed_size_kb"],
    "write_statistics": ["id", "package", "installed_size_kb"],
}
RAW_KINDS = {"default": {}, "matched": MATCHED_OPTIONS}


class RawWriter:
    """A careful hand-rolled writer: one Parquet file per batch, temp name, fsync, rename (or one PUT)."""

    def __init__(self, shoal: Shoal, folder: str, options: dict[str, Any], dir_fsync: bool) -> None:
        self.storage = shoal.storage
        self.folder = self.storage.path(folder)
        self.options = options
        self.dir_fsync = dir_fsync
        self.storage.fs.create_dir(self.folder, recursive=True)
        self.bytes = 0
        self._lock = threading.Lock()

    def write(self, ids: np.ndarray, package: pa.Array, size: np.ndarray, vectors: np.ndarray) -> None:
        dim = vectors.shape[1]
        flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1))
        table = pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "package": package,
                "installed_size_kb": pa.array(size, pa.int64()),
                "vector": pa.FixedSizeListArray.from_arrays(flat, dim),
            }
        )
        name = f"{self.folder}/{uuid.uuid4().hex}.parquet"
        if not self.storage.local:
            with self.storage.fs.open_output_stream(name) as out:
                pq.write_table(table, out, **self.options)
                written = out.tell()
        else:
            tmp = f"{self.folder}/.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                pq.write_table(table, f, **self.options)
                f.flush()
                os.fsync(f.fileno())
                written = f.tell()
            os.rename(tmp, name)
            if self.dir_fsync:
                fd = os.open(self.folder, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        with self._lock:
            self.bytes += written

    def remove(self) -> None:
        try:
            self.storage.fs.delete_dir(self.folder)
        except OSError:
            pass


# -- drivers -----------------------------------------------------------------------------------------


@dataclass
class Side:
    """Accumulated timed work of one side (ours or a raw reference) of a case."""

    points: int = 0
    seconds: float = 0.0
    bytes: int = 0
    files: int = 0

    @property
    def pps(self) -> float:
        return self.points / self.seconds if self.seconds else 0.0

    @property
    def mbps(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds else 0.0


@dataclass
class Case:
    dim: int
    batch: int
    threads: int
    ours: Side = field(default_factory=Side)
    raw: dict[str, Side] = field(default_factory=dict)
    segments: int = 0


class IdSource:
    """Unique ids across every upload of a case (id is the permanent attribute)."""

    def __init__(self) -> None:
        self.next = 0
        self.lock = threading.Lock()

    def take(self, n: int) -> int:
        with self.lock:
            first, self.next = self.next, self.next + n
        return first


def run_batched(
    pool: Pool,
    batch: int,
    batches: int,
    first_batch: int,
    ids: IdSource,
    upload: Callable[[np.ndarray, pa.Array, np.ndarray, np.ndarray], None],
) -> float:
    """One producer uploading `batches` batches of `batch` points; return the elapsed seconds."""
    t0 = time.perf_counter()
    for k in range(first_batch, first_batch + batches):
        s = pool.start(k, batch)
        first = ids.take(batch)
        upload(
            np.arange(first, first + batch, dtype=np.int64),
            pool.package.slice(s, batch),
            pool.size[s : s + batch],
            pool.vectors[s : s + batch],
        )
    return time.perf_counter() - t0


def run_single(
    pool: Pool, points: int, threads: int, first_point: int, ids: IdSource, upload_one: Callable[[int, int], None]
) -> float:
    """`threads` producers uploading one-point batches, `points` in all; return the elapsed seconds.

    upload_one(id, pool_row) uploads one point.
    """
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []
    share = [points // threads + (1 if t < points % threads else 0) for t in range(threads)]

    def work(t: int) -> None:
        try:
            barrier.wait()
            for j in range(share[t]):
                k = first_point + t + j * threads
                upload_one(ids.take(1), k % pool.rows)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
    for w in workers:
        w.start()
    barrier.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed


def ours_single(producer: Producer, pool: Pool, api: str) -> Callable[[int, int], None]:
    if api == "upload":

        def upload_one(point_id: int, row: int) -> None:
            producer.upload(
                [
                    DataPoint(
                        {"id": point_id, "package": pool.package_py[row], "installed_size_kb": int(pool.size[row])},
                        pool.vectors[row],
                    )
                ]
            )
    else:

        def upload_one(point_id: int, row: int) -> None:
            producer.upload_columns(
                pool.vectors[row : row + 1],
                {
                    "id": np.array([point_id], dtype=np.int64),
                    "package": pool.package.slice(row, 1),
                    "installed_size_kb": pool.size[row : row + 1],
                },
            )

    return upload_one


def raw_single(raw: RawWriter, pool: Pool) -> Callable[[int, int], None]:
    def upload_one(point_id: int, row: int) -> None:
        raw.write(
            np.array([point_id], dtype=np.int64),
            pa.array([pool.package_py[row]], pa.string()),
            np.array([pool.size[row]], dtype=np.int64),
            pool.vectors[row : row + 1],
        )

    return upload_one


def ours_batched(producer: Producer) -> Callable[[np.ndarray, pa.Array, np.ndarray, np.ndarray], None]:
    def upload(ids: np.ndarray, package: pa.Array, size: np.ndarray, vectors: np.ndarray) -> None:
        producer.upload_columns(vectors, {"id": ids, "package": package, "installed_size_kb": size})

    return upload


def run_case(shoal: Shoal, pool: Pool, batch: int, points: int, args: argparse.Namespace) -> Case:
    threads = args.threads if batch == 1 else 1
    case = Case(pool.dim, batch, threads)
    tag = uuid.uuid4().hex[:8]
    name = f"bench-{pool.dim}-b{batch}-{tag}"
    shoal.create_data_source(DataSourceSpec(name, "1", pool.dim, ATTRIBUTES, ["id"]))
    producer = shoal.producer(name, "1")
    writer = shoal.runtime.writer(producer.source)
    raws = {
        kind: RawWriter(shoal, f"bench-raw/{name}-{kind}", RAW_KINDS[kind], args.raw_dir_fsync) for kind in args.raw
    }
    case.raw = {kind: Side() for kind in raws}
    ids = IdSource()
    # Work units: points for batch size 1, whole batches otherwise; spread over interleaved rounds.
    units = points if batch == 1 else max(1, -(-points // batch))
    # Batched cases alternate the sides batch by batch (up to 50 rounds); batch size 1 in 5 rounds.
    wanted = args.rounds or (50 if batch > 1 else 5)
    rounds = max(1, min(wanted, units if batch > 1 else units // threads or 1))
    try:
        if batch == 1:
            ours_fn = ours_single(producer, pool, args.single_api)
            raw_fns = {kind: raw_single(raw, pool) for kind, raw in raws.items()}
            # Warm-up: every thread once (threads, catalog connections, pyarrow and numpy code paths).
            run_single(pool, threads, threads, 0, ids, ours_fn)
            for fn in raw_fns.values():
                run_single(pool, threads, threads, 0, ids, fn)
        else:
            ours_fn_b = ours_batched(producer)
            raw_fns_b = {kind: raw.write for kind, raw in raws.items()}
            run_batched(pool, batch, 1, 0, ids, ours_fn_b)
            for fn_b in raw_fns_b.values():
                run_batched(pool, batch, 1, 0, ids, fn_b)
        raw_bytes0 = {kind: raw.bytes for kind, raw in raws.items()}
        head0 = shoal.get_data_source(name, "1").head_seq
        commits0 = writer.commits
        # Interleave the sides so drift of the machine (page cache, writeback, TRIM, neighbours) hits both
        # alike; the order within a round alternates too.
        per_round = [units // rounds + (1 if r < units % rounds else 0) for r in range(rounds)]
        done = 0  # units uploaded by each side so far
        for r, n in enumerate(per_round):
            order: list[str | None] = [None, *raws] if r % 2 == 0 else [*raws, None]
            for kind in order:
                side = case.ours if kind is None else case.raw[kind]
                if batch == 1:
                    fn = ours_fn if kind is None else raw_fns[kind]
                    side.seconds += run_single(pool, n, threads, threads + done, ids, fn)
                    side.points += n
                    side.files += n
                else:
                    fnb = ours_fn_b if kind is None else raw_fns_b[kind]
                    side.seconds += run_batched(pool, batch, n, 1 + done, ids, fnb)
                    side.points += n * batch
                    side.files += n
            done += n
        case.segments = writer.commits - commits0
        segs = [s for s in shoal.log_segments(name, "1") if s.first_seq > head0]
        case.ours.bytes = sum(s.bytes for s in segs)
        case.ours.files = len(segs)
        # Sanity: the log holds exactly the points that were acknowledged, in that many segments.
        logged = shoal.get_data_source(name, "1").head_seq - head0
        if logged != case.ours.points or len(segs) != case.segments:
            raise RuntimeError(
                f"{name}: acknowledged {case.ours.points} points in {case.segments} commits, "
                f"but the log grew by {logged} seqs in {len(segs)} segments"
            )
        for kind, raw in raws.items():
            case.raw[kind].bytes = raw.bytes - raw_bytes0[kind]
    finally:
        if not args.keep:
            shoal.drop_data_source(name, "1")
            for raw in raws.values():
                raw.remove()
    return case


# -- main --------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dims", type=_ints, default=[384, 1536], help="vector dimensions (default 384,1536)")
    p.add_argument("--batches", type=_ints, default=[1, 100, 10_000], help="batch sizes (default 1,100,10000)")
    p.add_argument(
        "--points",
        type=int,
        default=None,
        help="total timed points per case and side (default: 1 -> 4000, 100 -> 30000, "
        "10000 -> 150000, otherwise 20 batches)",
    )
    p.add_argument("--storage", default=None, help="storage root (default SHOAL_STORAGE_URI or a temp dir)")
    p.add_argument("--threads", type=int, default=64, help="producer threads for batch size 1 (default 64)")
    p.add_argument(
        "--single-api",
        choices=["upload", "columns"],
        default="upload",
        help="API of the batch-1 producers: upload([DataPoint]) or upload_columns (default upload)",
    )
    p.add_argument(
        "--raw",
        type=lambda s: [k for k in s.split(",") if k],
        default=["default", "matched"],
        help="raw references to time: default (pq.write_table defaults), matched (Shoal's "
        "segment encoding); default both",
    )
    p.add_argument(
        "--raw-dir-fsync",
        action="store_true",
        help="raw writer also fsyncs the directory after the rename, as Shoal does",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="interleaved ours/raw rounds per case (default: batch by batch up to 50 rounds; 5 for batch size 1)",
    )
    p.add_argument("--keep", action="store_true", help="keep the data sources, files and temp data dir")
    args = p.parse_args(argv)
    bad = [k for k in args.raw if k not in RAW_KINDS]
    if bad:
        p.error(f"unknown raw reference {bad}; choose from {list(RAW_KINDS)}")
    return args


def default_points(batch: int) -> int:
    return DEFAULT_POINTS.get(batch, 20 * batch)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_data(DATA_DIR, "base_f16.npy", "points.parquet")
    cases: list[Case] = []
    with Lifecycle() as life:
        tmp = life.temp_dir("shoal-bench-", keep=args.keep)
        overrides: dict[str, Any] = {"data_dir": tmp}
        if args.storage:
            overrides["storage_uri"] = args.storage
        settings = Settings(**overrides)
        embedded = not settings.database_url
        console.print(
            f"[bold]shoal ingest bench[/] python {platform.python_version()}, pyarrow {pa.__version__}, "
            f"numpy {np.__version__}, {os.cpu_count()} cpus, load average before the bench {_load()}"
        )
        console.print("loading data …")
        pools = load_pools(args.dims)
        t_start = time.perf_counter()
        life.stop_servers(tmp)  # the embedded Postgres (unless SHOAL_DATABASE_URL is set) and Valkey
        with life.starting(tmp):
            shoal = Shoal(settings)
        life.cleanup("Shoal connections", shoal.close)
        with shoal.engine.connect() as conn:
            pg = {k: conn.execute(text(f"SHOW {k}")).scalar() for k in ("fsync", "synchronous_commit")}
        console.print(
            f"catalog: {'embedded Postgres in ' + str(tmp) if embedded else 'SHOAL_DATABASE_URL'} "
            f"(fsync={pg['fsync']}, synchronous_commit={pg['synchronous_commit']})"
        )
        console.print(f"storage: {shoal.storage.root}" + ("" if shoal.storage.local else " (object store)"))
        for dim in args.dims:
            console.print(f"{dim}-d vectors: {pools[dim].origin}")
        for dim in args.dims:
            for batch in args.batches:
                points = args.points or default_points(batch)
                points = max(points, batch)
                with console.status(f"{dim}-d × batch {batch:,}: {points:,} points per side …"):
                    t0 = time.perf_counter()
                    case = run_case(shoal, pools[dim], batch, points, args)
                cases.append(case)
                ref = " / ".join(f"{k} {fmt_rate(s.pps)}" for k, s in case.raw.items())
                console.print(
                    f"  {dim}-d × batch {batch:,}: ours {fmt_rate(case.ours.pps)} pts/s, raw {ref} pts/s, "
                    f"{case.segments} segments ({time.perf_counter() - t0:.1f}s)"
                )
    print_table(cases, args, local=shoal.storage.local)
    console.print(f"total bench time {time.perf_counter() - t_start:.0f}s")
    return 0


def print_table(cases: list[Case], args: argparse.Namespace, *, local: bool) -> None:
    table = Table(title="Shoal ingest: durable points/s vs raw pyarrow + fsync (same run, same disk)")
    table.add_column("case")
    table.add_column("ours pts/s", justify="right")
    for kind in args.raw:
        table.add_column(f"raw {kind}\npts/s", justify="right")
        table.add_column(f"ratio vs\n{kind}", justify="right")
    table.add_column("segments\n(pts/seg)", justify="right")
    table.add_column("ours\nMB/s", justify="right")
    table.add_column("raw\nfiles", justify="right")
    for c in cases:
        label = f"{c.dim}-d × {c.batch:,}"
        label += f" ({c.threads} thr)" if c.batch == 1 else " (1 producer)"
        row = [label, fmt_rate(c.ours.pps)]
        for kind in args.raw:
            raw = c.raw[kind]
            ratio = c.ours.pps / raw.pps if raw.pps else float("nan")
            colour = "green" if ratio >= 0.8 else "red"
            row += [fmt_rate(raw.pps), f"[{colour}]{ratio:.2f}x[/]"]
        per = c.ours.points / c.segments if c.segments else 0
        files = c.raw[args.raw[0]].files if args.raw else 0
        row += [
            f"{c.segments:,} ({per:,.1f})",
            f"{c.ours.mbps:,.1f}",
            f"{files:,}" + (" (1/point)" if c.batch == 1 else " (1/batch)"),
        ]
        table.add_row(*row)
    console.print(table)
    if not local:
        dirsync = "one object PUT"
    elif args.raw_dir_fsync:
        dirsync = "temp file, fsync, rename, directory fsync"
    else:
        dirsync = "temp file, fsync, rename"
    console.print(
        escape(
            f"raw = pyarrow pq.write_table of the same rows (id, package, installed_size_kb, "
            f"vector fixed_size_list<float32>[dim]) per batch: {dirsync}.\n"
            f"  default: pq.write_table defaults (snappy + dictionary on every column); matched: Shoal's segment "
            f"encoding (vector uncompressed, no dictionary).\n"
            f"  Batch-1 rows: the reference writes ONE FILE PER POINT (a naive per-upload writer) from the same "
            f"{args.threads} threads; ours shares commits between the {args.threads} producer threads "
            f"(group commit), see segments.\n"
            "ours = acknowledged (durable + committed) points/s: validation, segment encode, sha256, temp file, "
            "fsync, rename, directory fsync, catalog transaction.\n"
            "MB/s = segment bytes written per second. Target: 10,000-point batches at >= 0.8x raw."
        )
    )


if __name__ == "__main__":
    sys.exit(main())
