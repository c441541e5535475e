"""Intake bench: points per second and commit lag of message intake (publisher -> broker -> `shoal consume` ->
log) beside the direct producer, on real data.

Run by hand, never in CI (see bench/README.md, "Intake bench"):

    .venv/bin/python bench/intake.py                   # the default bench, about 70-90 s on 2 cores
    .venv/bin/python bench/intake.py --quick           # a scaled-down pass (under half a minute)
    .venv/bin/python bench/intake.py --format json --publishers 4 --publisher-mode process --skip 2

Data: ../shared/data/debian-packages beside the repository (override with SHOAL_BENCH_DATA): base_f16.npy
(all-MiniLM-L6-v2, 384-d, float16 widened to float32) and points.parquet (`package`, `installed_size_kb`;
row i <-> vector i). Every data source has `id` int64 (permanent), `package` string, `installed_size_kb`
int64 and the 384-d vector.

What it measures, each beside a reference measured in the same run:

1. Throughput: N points split into messages of P points, published by `--publishers` threads (or processes)
   with `Publisher.publish_columns` (Arrow IPC, default) or `Publisher.publish` (Vektonn JSON) to the
   intake exchange on the embedded Valkey; one consumer (`python -m shoal.cli consume` in a subprocess, or
   `IntakeConsumer.run()` in a thread of the bench) gathers them into group commits. Points per second from
   the first publish to the moment the data source's log head (polled in the catalog) covers all N points.
   References: the direct producer `Producer.upload_columns` writing the same points (a) in batches of the
   consumer's commit size (SHOAL_INTAKE_MAX_POINTS), one thread, and (b) in P-point batches from as many
   threads as there are publishers (what the upstream processors would do without the broker).
2. Commit lag under a sustained rate: one publisher sends P-point messages at `--rate` points/s for
   `--lag-seconds`; for every message, the time from the start of its publish call to the first poll of
   the log head that covers the message's last seq (read back from the catalog by its message id).
   Reference: the direct producer uploading the same P-point batches at the same rate (upload latency, and
   the same head poll).
3. (optional, --index) Index lag under the same sustained rate with a flat index over the data source and a
   real Celery worker (solo pool + beat): from publish to the first time the index's built watermark covers
   the message. No reference: n/a.

The embedded Postgres and Valkey run in a temporary data dir and are stopped at the end, also on errors and
Ctrl-C; SHOAL_DATABASE_URL / SHOAL_REDIS_URL / SHOAL_STORAGE_URI are honoured (names carry a run tag).
"""

from __future__ import annotations

import argparse
import bisect
import importlib.metadata
import multiprocessing as mp
import os
import platform
import re
import signal
import subprocess
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
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from shoal.catalog.db import resolve_database_url
from shoal.catalog.models import IndexShard, ProducerBatch
from shoal.catalog.repo import head_of
from shoal.cli.worker import start_worker_process, stop_worker_process, worker_argv
from shoal.client import Shoal
from shoal.config.settings import Settings
from shoal.intake.topology import BATCH_ID_PREFIX
from shoal.log.records import DataPoint, DataSourceSpec, IndexSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benches' helpers
from _lifecycle import Lifecycle, children_ignore_sigint, require_data  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "debian-packages"  # ../shared beside the repo
DATA_DIR = Path(os.environ.get("SHOAL_BENCH_DATA", SHARED))
ATTRIBUTES = {"id": "int64", "package": "string", "installed_size_kb": "int64"}
DIM = 384
TAG = uuid.uuid4().hex[:6]  # in every data source name: a shared catalog never sees a clash
console = Console(width=None if sys.stdout.isatty() else 170)


# -- data ---------------------------------------------------------------------------------------------


@dataclass
class Data:
    base: np.ndarray  # float32 [total, 384]
    package: pa.Array  # string, row i <-> vector i
    package_py: list[str]
    size: np.ndarray  # int64

    @property
    def total(self) -> int:
        return self.base.shape[0]

    def columns(self, start: int, end: int) -> tuple[np.ndarray, dict[str, Any]]:
        """Points with ids start..end-1: vector and attributes of base row id % total (ids stay unique when
        more points than rows are asked for)."""
        rows = np.arange(start, end) % self.total
        if end <= self.total:
            vectors = self.base[start:end]
            package = self.package.slice(start, end - start)
            size = self.size[start:end]
        else:
            vectors = self.base[rows]
            package = self.package.take(pa.array(rows))
            size = self.size[rows]
        return vectors, {"id": np.arange(start, end, dtype=np.int64), "package": package, "installed_size_kb": size}

    def points(self, start: int, end: int) -> list[DataPoint]:
        out = []
        for i in range(start, end):
            r = i % self.total
            attrs = {"id": i, "package": self.package_py[r], "installed_size_kb": int(self.size[r])}
            out.append(DataPoint(attrs, self.base[r]))
        return out


def load_data() -> Data:
    base = np.load(DATA_DIR / "base_f16.npy").astype(np.float32)
    points = pq.read_table(DATA_DIR / "points.parquet", columns=["package", "installed_size_kb"])
    if points.num_rows != base.shape[0] or base.shape[1] != DIM:
        raise RuntimeError(f"points.parquet has {points.num_rows} rows, base_f16.npy {base.shape}")
    package = points["package"].combine_chunks()
    return Data(base, package, package.to_pylist(), points["installed_size_kb"].to_numpy().astype(np.int64))


def source_spec(name: str) -> DataSourceSpec:
    return DataSourceSpec(name, "1", DIM, ATTRIBUTES, ["id"])


def percentile(xs: list[float] | np.ndarray, p: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), p)) if len(xs) else float("nan")


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that makes a child process build the same Settings."""
    return settings.child_env()


# -- publishers: threads or processes, one Publisher each ----------------------------------------------


@dataclass
class Sent:
    message_id: str
    started: float  # time.monotonic() before the publish call (CLOCK_MONOTONIC: shared by processes)
    returned: float
    points: int


@dataclass
class PubPlan:
    settings: dict[str, Any]  # Settings(**settings) in the publisher
    source: str
    ranges: list[tuple[int, int]]  # id ranges, one per message
    fmt: str  # arrow | json


def prepare(data: Data, plan: PubPlan) -> list[Any]:
    """Each message's input in the form its publish call takes (built before the clock starts)."""
    if plan.fmt == "json":
        return [data.points(s, e) for s, e in plan.ranges]
    return [data.columns(s, e) for s, e in plan.ranges]


def publish_all(publisher: Any, plan: PubPlan, payloads: list[Any], stop: Any) -> list[Sent]:
    out = []
    for (s, e), payload in zip(plan.ranges, payloads, strict=True):
        if stop.is_set():
            break
        t0 = time.monotonic()
        if plan.fmt == "json":
            mid = publisher.publish(plan.source, "1", payload)
        else:
            mid = publisher.publish_columns(plan.source, "1", payload[0], payload[1])
        out.append(Sent(mid, t0, time.monotonic(), e - s))
    return out


def _publisher_process(plan: PubPlan, ready: Any, go: Any, stop: Any, results: Any) -> None:
    """A publisher process (spawned): loads the data, prepares, connects, waits for `go`, publishes."""
    from shoal.intake.publisher import Publisher

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us through `stop` (or terminate())
    data = load_data()
    payloads = prepare(data, plan)
    publisher = Publisher(Settings(**plan.settings))
    publisher._ensure_producer()  # noqa: SLF001 - connect before the clock starts
    ready.put(os.getpid())
    go.wait()
    try:
        results.put(publish_all(publisher, plan, payloads, stop))
    finally:
        publisher.close()


class Publishers:
    """`k` publishers, each with its own plan, started (connected, inputs prepared) and waiting for go()."""

    def __init__(self, data: Data, plans: list[PubPlan], mode: str) -> None:
        self.mode = mode
        self.plans = plans
        self.sent: list[Sent] = []
        self.errors: list[BaseException] = []
        if mode == "process":
            ctx = mp.get_context("spawn")
            self._ready = ctx.Queue()
            self._results = ctx.Queue()
            self._go = ctx.Event()
            self._stop = ctx.Event()
            self._procs = [
                ctx.Process(
                    target=_publisher_process, args=(p, self._ready, self._go, self._stop, self._results), daemon=True
                )
                for p in plans
            ]
            with children_ignore_sigint():  # a terminal's Ctrl-C is for the parent, which stops them
                for proc in self._procs:
                    proc.start()
            for _ in plans:
                self._ready.get(timeout=120)
        else:
            from shoal.intake.publisher import Publisher

            self._go = threading.Event()
            self._stop = threading.Event()
            self._threads = []
            for i, plan in enumerate(plans):
                publisher = Publisher(Settings(**plan.settings))
                publisher._ensure_producer()  # noqa: SLF001 - connect before the clock starts
                payloads = prepare(data, plan)
                t = threading.Thread(
                    target=self._thread, args=(publisher, plan, payloads), name=f"pub-{i}", daemon=True
                )
                t.start()
                self._threads.append(t)

    def _thread(self, publisher: Any, plan: PubPlan, payloads: list[Any]) -> None:
        self._go.wait()
        try:
            got = publish_all(publisher, plan, payloads, self._stop)
            self.sent.extend(got)  # list.extend is atomic under the GIL
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.errors.append(exc)
            self._stop.set()
        finally:
            publisher.close()

    def go(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        if self.mode == "process":
            for proc in self._procs:
                proc.join(5)
                if proc.is_alive():
                    proc.terminate()
                    proc.join(5)
        else:
            for t in self._threads:
                t.join(10)

    def join(self, timeout: float) -> list[Sent]:
        """Wait for every publisher to finish; their sends."""
        if self.mode == "process":
            for _ in self._procs:
                self.sent.extend(self._results.get(timeout=timeout))
            for proc in self._procs:
                proc.join(10)
        else:
            deadline = time.monotonic() + timeout
            for t in self._threads:
                t.join(max(0.0, deadline - time.monotonic()))
            if self.errors:
                raise self.errors[0]
        return self.sent


def split(start: int, n: int, size: int, k: int) -> list[list[tuple[int, int]]]:
    """Ids start..start+n-1 as messages of `size` points, dealt round-robin to k publishers."""
    messages = [(s, min(s + size, start + n)) for s in range(start, start + n, size)]
    return [messages[i::k] for i in range(k)]


# -- the consumer: a `shoal consume` subprocess or an IntakeConsumer thread ----------------------------


class ConsumerRunner:
    def __init__(self, settings: Settings, mode: str) -> None:
        self.mode = mode
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None
        self.consumer: Any = None
        self.thread: threading.Thread | None = None
        self.log = settings.data_dir / f"consumer-{TAG}.log"

    def start(self) -> None:
        if self.mode == "process":
            with open(self.log, "wb") as out:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "shoal.cli", "consume"],
                    env=settings_env(self.settings),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
        else:
            from shoal.intake.consumer import IntakeConsumer

            self.consumer = IntakeConsumer(self.settings)
            self.thread = threading.Thread(target=self.consumer.run, name="consumer", daemon=True)
            self.thread.start()

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self.thread is not None and self.thread.is_alive()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the consumer flushes what it holds, then exits
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.consumer is not None:
            self.consumer.stop.set()
            if self.thread is not None:
                self.thread.join(20)

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# -- polling the log head --------------------------------------------------------------------------------


class HeadPoller:
    """Polls one data source's head every `interval` s in a thread; keeps (time after the read, head) at each
    change, so the time a seq became visible is known to within one interval plus one catalog round trip."""

    def __init__(self, shoal: Shoal, source_id: int, interval: float, *, watch: Callable[[], int] | None = None):
        self.shoal = shoal
        self.source_id = source_id
        self.interval = interval
        self.times: list[float] = []
        self.heads: list[int] = []
        self.polls = 0
        self.watch = watch  # an extra value sampled at each poll (e.g. a built watermark)
        self.watch_times: list[float] = []
        self.watch_values: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="head-poller", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> HeadPoller:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                h = head_of(self.shoal.engine, self.source_id)[0]
                now = time.monotonic()
                self.polls += 1
                if not self.heads or h != self.heads[-1]:
                    self.times.append(now)
                    self.heads.append(h)
                if self.watch is not None:
                    w = self.watch()
                    now = time.monotonic()
                    if not self.watch_values or w != self.watch_values[-1]:
                        self.watch_times.append(now)
                        self.watch_values.append(w)
                self._stop.wait(self.interval)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            self.error = exc

    @property
    def head(self) -> int:
        return self.heads[-1] if self.heads else 0

    def wait_head(self, target: int, timeout: float, consumer: ConsumerRunner | None = None) -> None:
        deadline = time.monotonic() + timeout
        while self.head < target:
            if self.error is not None:
                raise self.error
            if consumer is not None and not consumer.alive():
                raise RuntimeError(f"the consumer exited while waiting for head {target}:\n{consumer.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f}s: head {self.head:,} of {target:,}")
            time.sleep(0.002)

    def seen(self, seq: int) -> float | None:
        """When the head was first seen covering `seq`."""
        i = bisect.bisect_left(self.heads, seq)  # heads only grow
        return self.times[i] if i < len(self.heads) else None

    def watch_seen(self, seq: int) -> float | None:
        i = bisect.bisect_left(self.watch_values, seq)
        return self.watch_times[i] if i < len(self.watch_values) else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def message_seqs(shoal: Shoal, source_id: int) -> dict[str, int]:
    """Message id -> last seq of its entries, from the consumer's batch ids."""
    with Session(shoal.engine) as s:
        rows = s.execute(
            select(ProducerBatch.batch_id, ProducerBatch.last_seq).where(ProducerBatch.data_source_id == source_id)
        ).all()
    return {b.removeprefix(BATCH_ID_PREFIX): int(seq) for b, seq in rows if b.startswith(BATCH_ID_PREFIX)}


# -- part 1: throughput -----------------------------------------------------------------------------------


@dataclass
class Side:
    label: str
    rates: list[float] = field(default_factory=list)  # points/s per round
    commits: list[int] = field(default_factory=list)  # log segments per round
    publish_rates: list[float] = field(default_factory=list)  # ours: points/s of the publish calls alone
    queue_max: list[int] = field(default_factory=list)  # ours: most messages waiting in the broker
    seconds: list[float] = field(default_factory=list)

    def median(self) -> float:
        return float(np.median(self.rates)) if self.rates else float("nan")


@dataclass
class Ctx:
    shoal: Shoal
    settings: Settings
    data: Data
    args: argparse.Namespace
    consumer: ConsumerRunner
    queue_len: Callable[[], int]
    pub_settings: dict[str, Any]


def run_ours(ctx: Ctx, name: str, n: int, side: Side) -> None:
    args = ctx.args
    src = ctx.shoal.create_data_source(source_spec(name))
    plans = [
        PubPlan(ctx.pub_settings, name, ranges, args.format)
        for ranges in split(0, n, args.message_points, args.publishers)
    ]
    pubs = Publishers(ctx.data, plans, args.publisher_mode)
    queue_max = 0
    try:
        t0 = time.monotonic()
        pubs.go()
        deadline = t0 + max(120.0, n / 200)
        last_q = 0.0
        while head_of(ctx.shoal.engine, src.id)[0] < n:
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(f"timed out: head {head_of(ctx.shoal.engine, src.id)[0]:,} of {n:,}")
            if not ctx.consumer.alive():
                raise RuntimeError(f"the consumer exited:\n{ctx.consumer.tail()}")
            if pubs.errors:
                raise pubs.errors[0]
            if now - last_q > 0.05:
                queue_max = max(queue_max, ctx.queue_len())
                last_q = now
            time.sleep(0.002)
        t_done = time.monotonic()
        sent = pubs.join(60)
    finally:
        pubs.stop()
    head = head_of(ctx.shoal.engine, src.id)[0]
    if head != n or len(sent) != sum(len(p.ranges) for p in plans):
        raise RuntimeError(f"head {head} after {n} points, {len(sent)} messages sent")
    side.rates.append(n / (t_done - t0))
    side.seconds.append(t_done - t0)
    side.publish_rates.append(n / (max(s.returned for s in sent) - t0))
    side.commits.append(len(ctx.shoal.log_segments(name, "1")))
    side.queue_max.append(queue_max)


def run_direct(ctx: Ctx, name: str, n: int, batch: int, threads: int, side: Side) -> None:
    ctx.shoal.create_data_source(source_spec(name))
    producer = ctx.shoal.producer(name, "1")
    parts = split(0, n, batch, threads)
    inputs = [[ctx.data.columns(s, e) for s, e in ranges] for ranges in parts]
    errors: list[BaseException] = []
    go = threading.Event()

    def work(items: list[tuple[np.ndarray, dict[str, Any]]]) -> None:
        go.wait()
        try:
            for vectors, attrs in items:
                producer.upload_columns(vectors, attrs)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(items,), daemon=True) for items in inputs[1:]]
    for w in workers:
        w.start()
    t0 = time.monotonic()
    go.set()
    work(inputs[0])
    for w in workers:
        w.join()
    t1 = time.monotonic()
    if errors:
        raise errors[0]
    head = ctx.shoal.get_data_source(name, "1").head_seq
    if head != n:
        raise RuntimeError(f"direct: head {head} after {n} points")
    side.rates.append(n / (t1 - t0))
    side.seconds.append(t1 - t0)
    side.commits.append(len(ctx.shoal.log_segments(name, "1")))


def run_throughput(ctx: Ctx) -> list[Side]:
    args = ctx.args
    n = args.points
    commit = ctx.settings.intake_max_points
    plural = "es" if args.publisher_mode == "process" else "s"
    ours = Side(
        f"ours: {args.publishers} publisher {args.publisher_mode}{plural if args.publishers > 1 else ''} "
        f"-> broker -> 1 consumer ({args.consumer})"
    )
    direct = Side(f"direct: upload_columns x {commit:,} (commit size), 1 thread")
    direct_msg = Side(
        f"direct: upload_columns x {args.message_points:,} (message size), {args.publishers} "
        f"thread{'s' if args.publishers > 1 else ''}"
    )
    steps: dict[str, Callable[[str], None]] = {
        "ours": lambda name: run_ours(ctx, name, n, ours),
        "direct": lambda name: run_direct(ctx, name, n, commit, 1, direct),
        "direct_msg": lambda name: run_direct(ctx, name, n, args.message_points, args.publishers, direct_msg),
    }
    order = list(steps)
    for r in range(args.rounds):
        for key in order if r % 2 == 0 else order[::-1]:
            name = f"bench-{key.replace('_', '-')}-r{r}-{TAG}"
            steps[key](name)
            side = {"ours": ours, "direct": direct, "direct_msg": direct_msg}[key]
            extra = ""
            if key == "ours":
                extra = (
                    f", publish calls alone {side.publish_rates[-1]:,.0f} pts/s, queue max "
                    f"{side.queue_max[-1]} messages"
                )
            console.print(
                f"  round {r + 1} {key}: {side.rates[-1]:,.0f} pts/s ({n:,} points in {side.seconds[-1]:.2f}s, "
                f"{side.commits[-1]} commits{extra})"
            )
            ctx.shoal.drop_data_source(name, "1")
    return [ours, direct, direct_msg]


# -- part 2 (and 3): lag under a sustained rate ----------------------------------------------------------------


@dataclass
class LagResult:
    label: str
    lags: list[float] = field(default_factory=list)  # s, publish/upload start -> head seen covering it
    calls: list[float] = field(default_factory=list)  # s, the publish or upload call itself
    index_lags: list[float] = field(default_factory=list)  # s, start -> built watermark covering it (part 3)
    achieved: float = 0.0
    behind: int = 0
    commits: int = 0
    points: int = 0
    polls: int = 0
    seconds: float = 0.0
    tasks: dict[str, int] = field(default_factory=dict)  # part 3: worker tasks that succeeded, by name


def paced(
    rate: float, batch: int, seconds: float, stop: threading.Event, send: Callable[[int, int], None]
) -> tuple[float, int]:
    """Call send(start_id, end_id) every batch/rate s for `seconds`; (achieved points/s, late calls)."""
    interval = batch / rate
    n = max(1, int(seconds / interval))
    behind = 0
    t0 = time.monotonic()
    for i in range(n):
        due = t0 + i * interval
        now = time.monotonic()
        if now < due:
            if stop.wait(due - now):
                break
        elif now - due > interval:
            behind += 1
        if stop.is_set():
            break
        send(i * batch, (i + 1) * batch)
    return n * batch / (time.monotonic() - t0), behind


def run_lag_ours(ctx: Ctx, name: str, stop: threading.Event, *, index: bool = False) -> LagResult:
    from shoal.intake.publisher import Publisher

    args = ctx.args
    res = LagResult("ours: publish -> head covers the message" if not index else "ours, with a flat index + worker")
    src = ctx.shoal.create_data_source(source_spec(name))
    watch = None
    if index:
        ctx.shoal.create_index(IndexSpec(name, "1", name, "1", algorithm="flat", metric="cosine", id_attributes=["id"]))
        shard_ids = [s.id for s in ctx.shoal.get_index(name, "1").shards]

        def watch() -> int:
            with Session(ctx.shoal.engine) as s:
                return int(s.scalar(select(func.min(IndexShard.built_watermark)).where(IndexShard.id.in_(shard_ids))))

    publisher = Publisher(Settings(**ctx.pub_settings))
    publisher._ensure_producer()  # noqa: SLF001 - connect before the clock starts
    batch = args.message_points
    total = batch * max(1, int(args.lag_seconds / (batch / args.rate)))
    payloads = {s: ctx.data.columns(s, s + batch) for s in range(0, total, batch)}
    if args.format == "json":
        payloads = {s: ctx.data.points(s, s + batch) for s in range(0, total, batch)}
    sent: list[Sent] = []

    def send(s: int, e: int) -> None:
        t0 = time.monotonic()
        if args.format == "json":
            mid = publisher.publish(name, "1", payloads[s])
        else:
            mid = publisher.publish_columns(name, "1", *payloads[s])
        sent.append(Sent(mid, t0, time.monotonic(), e - s))

    poller = HeadPoller(ctx.shoal, src.id, args.poll_ms / 1000, watch=watch).start()
    try:
        t0 = time.monotonic()
        res.achieved, res.behind = paced(args.rate, batch, args.lag_seconds, stop, send)
        n = sum(s.points for s in sent)
        poller.wait_head(n, 120, ctx.consumer)
        if index:
            deadline = time.monotonic() + 300
            while not poller.watch_values or poller.watch_values[-1] < n:
                if time.monotonic() > deadline or poller.error is not None:
                    raise RuntimeError(f"the index did not catch up: {poller.watch_values[-1:]} of {n}")
                time.sleep(0.01)
        res.seconds = time.monotonic() - t0
    finally:
        poller.stop()
        publisher.close()
    seqs = message_seqs(ctx.shoal, src.id)
    for s in sent:
        seq = seqs[s.message_id]
        seen = poller.seen(seq)
        assert seen is not None
        res.lags.append(seen - s.started)
        res.calls.append(s.returned - s.started)
        if index:
            built = poller.watch_seen(seq)
            assert built is not None
            res.index_lags.append(built - s.started)
    res.points = n
    res.polls = poller.polls
    res.commits = len(ctx.shoal.log_segments(name, "1"))
    return res


def run_lag_direct(ctx: Ctx, name: str, stop: threading.Event) -> LagResult:
    args = ctx.args
    res = LagResult("direct: upload_columns at the same rate")
    src = ctx.shoal.create_data_source(source_spec(name))
    producer = ctx.shoal.producer(name, "1")
    batch = args.message_points
    started: list[tuple[int, float, float]] = []  # (token seq, start, return)

    def send(s: int, e: int) -> None:
        vectors, attrs = ctx.data.columns(s, e)
        t0 = time.monotonic()
        seq = producer.upload_columns(vectors, attrs).seq
        started.append((seq, t0, time.monotonic()))

    poller = HeadPoller(ctx.shoal, src.id, args.poll_ms / 1000).start()
    try:
        t0 = time.monotonic()
        res.achieved, res.behind = paced(args.rate, batch, args.lag_seconds, stop, send)
        n = started[-1][0] if started else 0
        poller.wait_head(n, 60)
        res.seconds = time.monotonic() - t0
    finally:
        poller.stop()
    for seq, t_start, t_ret in started:
        seen = poller.seen(seq)
        assert seen is not None
        res.lags.append(seen - t_start)
        res.calls.append(t_ret - t_start)
    res.points = n
    res.polls = poller.polls
    res.commits = len(ctx.shoal.log_segments(name, "1"))
    return res


def run_lag(ctx: Ctx, stop: threading.Event) -> list[LagResult]:
    out = []
    for key in ("ours", "direct"):
        name = f"bench-lag-{key}-{TAG}"
        res = run_lag_ours(ctx, name, stop) if key == "ours" else run_lag_direct(ctx, name, stop)
        console.print(
            f"  {key}: {len(res.lags)} batches, achieved {res.achieved:,.0f} pts/s ({res.behind} late), lag p50 "
            f"{1e3 * percentile(res.lags, 50):.1f} ms, p99 {1e3 * percentile(res.lags, 99):.1f} ms, "
            f"{res.commits} commits"
        )
        ctx.shoal.drop_data_source(name, "1")
        out.append(res)
    return out


# -- part 3: index lag with a real worker (optional) --------------------------------------------------------


def start_worker(settings: Settings) -> tuple[subprocess.Popen[bytes], Path]:
    log = settings.data_dir / f"worker-{TAG}.log"
    argv = worker_argv(beat=True, schedule=settings.data_dir / f"beat-{TAG}", pool="solo", loglevel="info",
                       quick=True)
    return start_worker_process(argv, log, settings.child_env()), log


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    stop_worker_process(proc, timeout)


TASK_DONE = re.compile(r"Task shoal\.workers\.tasks\.(\w+)\[[0-9a-f-]+\] succeeded")


def run_index_lag(ctx: Ctx, stop: threading.Event, cleanup: list[Callable[[], None]]) -> LagResult:
    proc, log = start_worker(ctx.settings)
    cleanup.append(lambda: stop_process(proc))
    try:
        name = f"bench-lag-index-{TAG}"
        res = run_lag_ours(ctx, name, stop, index=True)
        console.print(
            f"  ours + index: {len(res.lags)} batches, commit lag p50 {1e3 * percentile(res.lags, 50):.1f} ms, "
            f"index lag p50 {1e3 * percentile(res.index_lags, 50):.1f} ms, p99 "
            f"{1e3 * percentile(res.index_lags, 99):.1f} ms"
        )
        ctx.shoal.drop_index(name, "1")
        ctx.shoal.drop_data_source(name, "1")
        for task in TASK_DONE.findall(log.read_text(errors="replace")):
            res.tasks[task] = res.tasks.get(task, 0) + 1
        return res
    finally:
        stop_process(proc)


# -- report ---------------------------------------------------------------------------------------------------


def ratio(x: float, ref: float) -> str:
    return f"{x / ref:.2f}x" if ref and np.isfinite(ref) else "n/a"


def print_throughput(sides: list[Side], args: argparse.Namespace) -> None:
    ours = sides[0]
    table = Table(
        title=f"1. Intake throughput: {args.points:,} real 384-d points, {args.message_points}-point "
        f"{args.format} messages, durable points/s (median of {args.rounds} round(s))"
    )
    table.add_column("side")
    table.add_column("pts/s", justify="right")
    table.add_column("rounds pts/s", justify="right")
    table.add_column("ours ÷ this", justify="right")
    table.add_column("commits (pts/commit)", justify="right")
    table.add_column("publish calls alone", justify="right")
    table.add_column("queue max (msgs)", justify="right")
    for side in sides:
        commits = int(np.median(side.commits))
        table.add_row(
            escape(side.label),
            f"{side.median():,.0f}",
            " / ".join(f"{x:,.0f}" for x in side.rates),
            "" if side is ours else ratio(ours.median(), side.median()),
            f"{commits} ({args.points / commits:,.0f})",
            f"{np.median(side.publish_rates):,.0f} pts/s" if side.publish_rates else "",
            str(max(side.queue_max)) if side.queue_max else "",
        )
    console.print(table)


def print_lag(results: list[LagResult], args: argparse.Namespace) -> None:
    table = Table(
        title=f"2. Commit lag at a sustained {args.rate:,.0f} pts/s ({args.message_points}-point batches, "
        f"{args.lag_seconds:.0f} s; head polled every {args.poll_ms:g} ms)"
    )
    table.add_column("side / measure")
    table.add_column("p50 ms", justify="right")
    table.add_column("p99 ms", justify="right")
    table.add_column("max ms", justify="right")
    table.add_column("mean ms", justify="right")
    table.add_column("batches", justify="right")
    table.add_column("achieved pts/s (late)", justify="right")
    table.add_column("commits (pts/commit)", justify="right")

    def row(label: str, xs: list[float], res: LagResult | None) -> None:
        table.add_row(
            escape(label),
            f"{1e3 * percentile(xs, 50):,.1f}",
            f"{1e3 * percentile(xs, 99):,.1f}",
            f"{1e3 * max(xs):,.1f}",
            f"{1e3 * float(np.mean(xs)):,.1f}",
            f"{len(xs):,}",
            f"{res.achieved:,.0f} ({res.behind})" if res else "",
            f"{res.commits} ({res.points / max(res.commits, 1):,.0f})" if res else "",
        )

    ours = next((r for r in results if r.label.startswith("ours:")), None)
    direct = next((r for r in results if r.label.startswith("direct")), None)
    indexed = next((r for r in results if r.index_lags), None)
    if ours:
        row("ours: publish start -> log head covers the message (commit lag)", ours.lags, ours)
        row("  ours: the publish call itself", ours.calls, None)
    if direct:
        row("direct: upload start -> log head covers the batch", direct.lags, direct)
        row("  direct: upload_columns call (returns once durable)", direct.calls, None)
    if ours and direct:
        table.add_section()
        p50 = ratio(percentile(ours.lags, 50), percentile(direct.lags, 50))
        p99 = ratio(percentile(ours.lags, 99), percentile(direct.lags, 99))
        table.add_row("commit lag ours ÷ direct (p50 / p99)", p50, p99, "", "", "", "", "")
    if indexed:
        table.add_section()
        row("3. ours + flat index + Celery worker: commit lag", indexed.lags, indexed)
        row("3.   publish start -> built watermark covers the message (index lag; ref n/a)", indexed.index_lags, None)
    console.print(table)


def print_notes(ctx: Ctx, sides: list[Side], lags: list[LagResult], notes: list[str]) -> None:
    args, s = ctx.args, ctx.settings
    lines = list(notes)
    if sides:
        lines.append(
            f"1: ours = points/s from the moment the publishers are released (each already connected, its messages' "
            f"inputs built: numpy slices for arrow, DataPoint lists for json) to the first poll (every 2 ms) of "
            f"the data source's head in the catalog that reads all {args.points:,} points; the publish call "
            f"includes encoding the body (Arrow IPC or Vektonn JSON) and the broker round trip. The consumer "
            f"gathers up to intake_max_points={s.intake_max_points:,} points or intake_max_wait_ms="
            f"{s.intake_max_wait_ms} ms (prefetch {s.intake_prefetch:,}) and commits them as one segment; "
            f"commits = log segments of the round. 'publish calls alone' = points / time until the last publish "
            f"call returned; 'queue max' = most messages waiting in the group's queue (LLEN, sampled every 50 ms). "
            f"direct = Producer.upload_columns of the same points (same ids, vectors and attributes) in "
            f"{s.intake_max_points:,}-point batches from one thread, and in {args.message_points}-point batches "
            f"from {args.publishers} thread(s) sharing one Shoal (group commit merges them); points/s from the "
            f"first call to the return of the last (returned = durable). A fresh data source per side and round; "
            f"sides in order ours, direct, direct-message, reversed every other round; median over rounds."
        )
    if lags:
        lines.append(
            f"2: one publisher thread sends a {args.message_points}-point message every "
            f"{1e3 * args.message_points / args.rate:.0f} ms for {args.lag_seconds:.0f} s (a late send goes out at "
            f"once; 'late' counts sends more than one interval behind). Commit lag = from just before the publish "
            f"call to the first head poll (a thread polling head_of every {args.poll_ms:g} ms; the time is taken "
            f"after the read returns) reading a head >= the message's last seq, read back after the run from the "
            f"consumer's batch ids (msg:<message id>). So it includes encoding, the broker, the consumer's "
            f"gathering wait (up to {s.intake_max_wait_ms} ms), the commit, and up to one poll interval. direct = "
            f"upload_columns of the same batches at the same pace from one thread, measured by the same poll (and "
            f"by the call's own return). No index exists on these data sources, so no worker is notified."
        )
    if any(r.index_lags for r in lags):
        lines.append(
            "3: the same publish pace into a data source with a flat (exact) cosine index, a real Celery worker "
            f"(--pool solo --beat, sweep every {s.sweep_interval_s:g} s) building it as the consumer's commits notify "
            "it (the consumer's Shoal notifies indexers after each commit); index lag = from the publish to the "
            "first poll (same thread) of min(built watermark) over the shards covering the message. "
            "No reference (n/a). Worker tasks that succeeded: "
            + ", ".join(f"{k} {v}" for k, v in sorted(next(r for r in lags if r.index_lags).tasks.items()))
        )
    lines.append(
        "Durability: 'durable' means the segment is fsynced and the catalog commit returned (Postgres fsync and "
        "synchronous_commit as printed in the header). The embedded Valkey runs with appendonly yes (fsync "
        "every second), so a published message may sit in the broker's memory for up to a second before it is "
        "on disk there; the consumer acks only after the log commit."
    )
    for line in lines:
        console.print(escape(line))


# -- main -----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--points", type=int, default=50_000, help="points per side and round in part 1 (default 50000)")
    p.add_argument("--message-points", type=int, default=100, help="points per message (default 100)")
    p.add_argument("--publishers", type=int, default=2, help="publisher threads/processes in part 1 (default 2)")
    p.add_argument(
        "--publisher-mode",
        choices=["thread", "process"],
        default="thread",
        help="publishers as threads of the bench or spawned processes (default thread)",
    )
    p.add_argument("--format", choices=["arrow", "json"], default="arrow", help="message body (default arrow)")
    p.add_argument(
        "--consumer",
        choices=["process", "thread"],
        default="process",
        help="`python -m shoal.cli consume` subprocess, or IntakeConsumer in a thread (default process)",
    )
    p.add_argument(
        "--commit-points",
        type=int,
        default=None,
        help="SHOAL_INTAKE_MAX_POINTS for the consumer, and the direct batch size (default: settings)",
    )
    p.add_argument("--max-wait-ms", type=int, default=None, help="SHOAL_INTAKE_MAX_WAIT_MS (default: settings)")
    p.add_argument("--rounds", type=int, default=3, help="part 1 rounds, order reversed every other (default 3)")
    p.add_argument("--rate", type=float, default=2_000.0, help="part 2 publish rate, points/s (default 2000)")
    p.add_argument("--lag-seconds", type=float, default=20.0, help="part 2 duration per side (default 20)")
    p.add_argument("--poll-ms", type=float, default=5.0, help="part 2 head poll interval (default 5)")
    p.add_argument("--index", action="store_true", help="also part 3: index lag with a flat index and a worker")
    p.add_argument(
        "--skip", type=lambda t: [int(x) for x in t.split(",") if x], default=[], help="parts to skip, e.g. --skip 2"
    )
    p.add_argument("--quick", action="store_true", help="scaled down: 10,000 points, 1 round, 8 s of lag")
    p.add_argument("--storage", default=None, help="storage root (default SHOAL_STORAGE_URI or a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp data dir (servers are still stopped)")
    args = p.parse_args(argv)
    if args.quick:
        args.points = min(args.points, 10_000)
        args.rounds = 1
        args.lag_seconds = min(args.lag_seconds, 8.0)
    if args.points < 1 or args.message_points < 1 or args.publishers < 1 or args.rate <= 0:
        p.error("--points, --message-points, --publishers and --rate must be positive")
    return args


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def drop_bench_objects(shoal: Shoal) -> None:
    for index in shoal.list_indexes():
        if index.spec.name.endswith(f"-{TAG}"):
            shoal.drop_index(index.spec.name, index.spec.version)
    for source in shoal.list_data_sources():
        if source.spec.name.endswith(f"-{TAG}"):
            shoal.drop_data_source(source.spec.name, source.spec.version)


def server_facts(shoal: Shoal, broker: str) -> str:
    import redis

    with shoal.engine.connect() as c:
        pg = c.execute(text("SHOW server_version")).scalar()
        fsync = c.execute(text("SHOW fsync")).scalar()
        sync = c.execute(text("SHOW synchronous_commit")).scalar()
    client = redis.Redis.from_url(broker)
    try:
        info = client.info("server")
        aof = client.config_get("appendonly").get("appendonly")
        every = client.config_get("appendfsync").get("appendfsync")
        kind = "valkey" if "valkey_version" in info else "redis"
        server = f"{kind} {info.get('valkey_version') or info.get('redis_version')}"
    finally:
        client.close()
    return (
        f"Postgres {pg} (fsync={fsync}, synchronous_commit={sync}); broker {server} (appendonly={aof}, "
        f"appendfsync={every})"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_data(DATA_DIR, "base_f16.npy", "points.parquet")
    notes: list[str] = []
    sides: list[Side] = []
    lags: list[LagResult] = []
    stop = threading.Event()  # set on interrupts and errors: paced senders stop before the servers do
    ctx: Ctx | None = None
    with Lifecycle() as life:
        life.cleanup(None, stop.set, early=True)
        tmp = life.temp_dir("shoal-intake-bench-", keep=args.keep)
        overrides: dict[str, Any] = {"data_dir": tmp}
        if args.storage:
            overrides["storage_uri"] = args.storage
        if args.commit_points:
            overrides["intake_max_points"] = args.commit_points
        if args.max_wait_ms:
            overrides["intake_max_wait_ms"] = args.max_wait_ms
        # An exchange and consumer group of the run's own: a shared broker never mixes runs.
        overrides["intake_exchange"] = f"bench-{TAG}.intake"
        overrides["intake_group"] = f"bench-{TAG}"
        base_settings = Settings(**overrides)
        embedded = not base_settings.database_url
        versions = " ".join(
            f"{m} {importlib.metadata.version(m)}"
            for m in ("shoal", "kombu", "celery", "redis", "sqlalchemy", "psycopg")
        )
        console.print(
            f"[bold]shoal intake bench[/] python {platform.python_version()}, {versions}, numpy {np.__version__}, "
            f"pyarrow {pa.__version__}, {os.cpu_count()} cpus, load average before the bench {_load()}"
        )
        t_start = time.perf_counter()
        life.stop_servers(tmp)  # the embedded Valkey, and Postgres unless SHOAL_DATABASE_URL is set
        console.print("loading data …")
        data = load_data()
        notes.append(
            f"data: {data.total:,} real all-MiniLM-L6-v2 vectors (384-d, float16 widened to float32) with "
            f"package and installed_size_kb from points.parquet; ids are unique per data source"
        )
        from shoal.servers.broker import broker_url

        with life.starting(tmp):
            broker = broker_url(base_settings)  # the configured Redis, or the embedded Valkey (started here)
            settings = Settings(
                **{**overrides, "redis_url": broker, "database_url": resolve_database_url(base_settings)}
            )
            if embedded:
                # The embedded catalog's schema: Runtime auto-migrates only without a database URL.
                Shoal(base_settings, notify=False).close()
            shoal = Shoal(settings, notify=False)
        life.cleanup("Shoal connections", shoal.close)
        if not embedded:
            life.cleanup("the bench's objects in the shared catalog", lambda: drop_bench_objects(shoal))
        console.print(
            f"catalog: {'embedded Postgres in ' + str(tmp) if embedded else 'SHOAL_DATABASE_URL'}; "
            f"storage: {shoal.storage.root}; {server_facts(shoal, broker)}"
        )
        console.print(
            f"consumer settings: intake_max_points={settings.intake_max_points:,}, intake_max_wait_ms="
            f"{settings.intake_max_wait_ms}, intake_prefetch={settings.intake_prefetch:,}"
        )
        import redis

        rclient = redis.Redis.from_url(broker)
        life.cleanup("broker connections", rclient.close)
        queue_name = f"{settings.intake_exchange}.{settings.intake_group}"
        consumer = ConsumerRunner(settings, args.consumer)
        life.cleanup("the consumer", consumer.stop)
        consumer.start()
        pub_settings = settings.model_dump(exclude_none=True)
        ctx = Ctx(shoal, settings, data, args, consumer, lambda: int(rclient.llen(queue_name)), pub_settings)

        # Warm-up: the consumer connects and commits once, each publisher connects once, the direct path writes once.
        warm = f"bench-warm-{TAG}"
        src = shoal.create_data_source(source_spec(warm))
        t0 = time.monotonic()
        pubs = Publishers(
            data,
            [
                PubPlan(pub_settings, warm, r, args.format)
                for r in split(0, args.message_points * args.publishers, args.message_points, args.publishers)
            ],
            "thread",
        )
        pubs.go()
        pubs.join(60)
        pubs.stop()
        poller = HeadPoller(shoal, src.id, 0.01).start()
        try:
            poller.wait_head(args.message_points * args.publishers, 120, consumer)
        finally:
            poller.stop()
        shoal.producer(warm, "1").upload_columns(*data.columns(10**9, 10**9 + args.message_points))
        shoal.drop_data_source(warm, "1")
        console.print(f"consumer ({args.consumer}) warmed up in {time.monotonic() - t0:.1f}s")

        if 1 not in args.skip:
            console.print(f"[bold]1. throughput[/] ({args.points:,} points per side and round, {args.rounds} round(s))")
            sides = run_throughput(ctx)
        if 2 not in args.skip:
            console.print(f"[bold]2. commit lag[/] ({args.rate:,.0f} pts/s for {args.lag_seconds:.0f}s per side)")
            lags = run_lag(ctx, stop)
        if args.index and 3 not in args.skip:
            if not embedded:
                notes.append("3: skipped: its worker's beat sweep would build every lagging index of a shared catalog")
            else:
                console.print("[bold]3. index lag[/] (flat index, Celery worker + beat)")
                lags.append(run_index_lag(ctx, stop, life.steps("part 3's worker processes")))
    assert ctx is not None
    if sides:
        print_throughput(sides, args)
    if lags:
        print_lag(lags, args)
    print_notes(ctx, sides, lags, notes)
    console.print(f"total bench time {time.perf_counter() - t_start:.0f}s, load average after {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
