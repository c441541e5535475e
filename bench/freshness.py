"""Freshness bench (issue 14): how soon writes become searchable under sustained ingest, on real data.

Run by hand, never in CI (see bench/README.md, "Freshness bench"):

    .venv/bin/python bench/freshness.py                 # 5,000 points/s for 60 s, 500-point batches (minutes)
    .venv/bin/python bench/freshness.py --quick         # 2,000 points/s for 20 s, fewer queries (about 1 min)
    .venv/bin/python bench/freshness.py --rate 500 --batch 50 --seconds 30 --workers 2 --shards 4

Data: ../shared/data/debian-packages beside the repository (override with SHOAL_BENCH_DATA), loaded by
bench/index.py's helpers: base_f16.npy (59,004 all-MiniLM-L6-v2 vectors, 384-d), queries_f16.npy (held-out
queries), gt.npy (exact neighbours), points.parquet (attributes).

What one run measures, everything in the same run (2 cores, embedded Postgres and Valkey in a temp dir):

1. Setup: a data source and an HNSW index (M 16, ef_construction 200, cosine, --shards shards) preloaded
   with the shared data set (--preload N, default all) and materialized in-process; then --workers real
   Celery worker processes (the first with beat), as bench/index.py part 3 starts them.
2. Baseline: eventual QPS of a following searcher (`shoal.searcher(follow=True)` in this process, one query
   per call, k=10) with no ingest, and recall@10 against the shared ground truth.
3. Sustained ingest from a separate process (this file's hidden `_produce` subcommand: no GIL shared with
   the searcher): --rate points/s in --batch batches for --seconds through `Producer.upload_columns`; new ids,
   vectors drawn from the shared base vectors with a small random perturbation, re-normalised. Every batch's
   ack time (time.time() right after the upload returned) and write token go back through a pipe.
4. Meanwhile, in this process: write -> visible for eventual (one sampled point per batch, polled with its
   own vector every few ms until the searcher returns its id), eventual recall@10 every few seconds against
   an exact brute force over the state at that moment (preload + every acknowledged point), and eventual QPS
   in short bursts between the polls.
5. After ingest: recall sampled until back at the baseline (within 0.005) or 2 minutes passed; then, once the
   index serves the head, the recall of the grown index at rest and how soon the samples came within 0.005 of it.
6. Strong vs eventual: the workers are stopped, then with T = 100 and T = 1,000 unindexed points appended,
   the QPS of `Consistency.strong()` and of eventual on the same searcher.

It prints each figure beside issue 14's target; it never fails on a missed target.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
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
from rich.console import Console
from rich.markup import escape
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package: reuse index.py's helpers

import index as ib  # noqa: E402
from _lifecycle import Lifecycle, require_data  # noqa: E402

from shoal.catalog.db import resolve_database_url  # noqa: E402
from shoal.cli.worker import start_worker_process, worker_argv  # noqa: E402
from shoal.client import Shoal  # noqa: E402
from shoal.config.settings import Settings  # noqa: E402
from shoal.engines.base import available_cores  # noqa: E402
from shoal.index.builder import ShardBuilder  # noqa: E402
from shoal.searcher.consistency import Consistency  # noqa: E402
from shoal.searcher.searcher import Searcher  # noqa: E402

K = ib.K
PARAMS = ib.HNSW_PARAMS  # M 16, ef_construction 200, ef_search 64
EVENTUAL = Consistency.eventual()
STRONG = Consistency.strong()
FRESH_ID_BASE = ib.FRESH_ID_BASE  # ids of the ingested points: never a base row number
TAIL_ID_BASE = ib.TAIL_ID_BASE  # ids of part 6's unindexed tail
NOISE = 0.1  # norm of the Gaussian perturbation added to a base vector before re-normalising
SEED = 14
RECOVERY_S = 120.0  # the "back at steady state within 2 minutes"
RECALL_BAND = 0.005
WIDE_EF = 512  # ef_search of the check whether a never-visible point is an approximate miss
console = Console(width=None if sys.stdout.isatty() else 170)


# -- the ingested points: the same function in the producer and here ------------------------------------


def fresh_batch(
    base: np.ndarray, seed: int, i: int, batch: int, id_base: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch `i` of new points: (base rows drawn, unit vectors, ids). Deterministic in (seed, i, batch), so the
    producer process and the measuring process make the very same points without shipping vectors."""
    rng = np.random.default_rng([seed, i])
    rows = rng.integers(0, base.shape[0], batch)
    noise = rng.standard_normal((batch, base.shape[1]), dtype=np.float32) * np.float32(NOISE / np.sqrt(base.shape[1]))
    vectors = base[rows] + noise
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    ids = id_base + i * batch + np.arange(batch, dtype=np.int64)
    return rows, np.ascontiguousarray(vectors, dtype=np.float32), ids


def probe_position(i: int, batch: int) -> int:
    """Which point of batch i is followed for write -> visible (spread over the batch)."""
    return (i * 7919) % batch


# -- part 3: the producer process ----------------------------------------------------------------------


def produce_main(argv: list[str]) -> int:
    """The hidden `_produce` subcommand: upload at a fixed rate, report every ack on --report-fd (JSON lines)."""
    p = argparse.ArgumentParser(prog="freshness.py _produce")
    p.add_argument("--name", required=True)
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--report-fd", type=int, required=True)
    a = p.parse_args(argv)
    report = os.fdopen(a.report_fd, "w", buffering=1)

    def send(msg: dict[str, Any]) -> None:
        report.write(json.dumps(msg) + "\n")

    data, _ = ib.load_data(1)
    shoal = Shoal(Settings())  # the parent's settings, through child_env(); notify=True: commits queue builds
    try:
        shoal.get_data_source(a.name, "1")  # connect before the clock starts
        producer = shoal.producer(a.name, "1")
        interval = a.batch / a.rate
        n = max(1, round(a.seconds * a.rate / a.batch))
        send({"ready": True, "batches": n})
        if not sys.stdin.readline().strip():  # "go"; EOF: the parent went away
            return 1
        late = 0
        upload_s: list[float] = []
        nxt = fresh_batch(data.base, a.seed, a.first, a.batch, FRESH_ID_BASE)
        t0 = time.perf_counter()
        for k in range(n):
            due = t0 + k * interval
            now = time.perf_counter()
            if now < due:
                time.sleep(due - now)
            elif now - due > interval:
                late += 1
            rows, vectors, ids = nxt
            u0 = time.perf_counter()
            token = producer.upload_columns(vectors, {"id": ids, "section": data.sections(rows)})
            ack = time.time()
            upload_s.append(time.perf_counter() - u0)
            send({"i": a.first + k, "seq": token.seq, "ack": ack})
            if k + 1 < n:
                nxt = fresh_batch(data.base, a.seed, a.first + k + 1, a.batch, FRESH_ID_BASE)
        elapsed = time.perf_counter() - t0
        send({
            "done": True, "points": n * a.batch, "seconds": elapsed, "late": late,
            "upload_p50_ms": 1e3 * ib.percentile(upload_s, 50), "upload_p99_ms": 1e3 * ib.percentile(upload_s, 99),
        })
        return 0
    except BrokenPipeError:  # the measuring process ended
        return 1
    finally:
        shoal.close()


# -- what the measuring process keeps -------------------------------------------------------------------


@dataclass
class Probe:
    id: int
    vector: np.ndarray  # [1, dim]
    seq: int
    acked: float  # time.time() in the producer right after the upload returned
    visible: float | None = None  # time.time() here right after the search that first returned it
    last_poll: float | None = None  # time.monotonic() of its last search
    received: float = 0.0  # time.monotonic() when its ack reached the measuring thread
    found_began: float | None = None  # time.time() when the search that first returned it began


@dataclass
class RecallSample:
    t: float  # seconds since ingest started when it began (the truth's snapshot)
    phase: str  # ingest | after
    recall: float
    points: int  # points in the state when its first query began
    points_end: int  # points in the state when its last query began (each query is judged on its own state)
    lag_seqs: int  # head - served watermark (largest shard), from the last index_status sample
    built_lag_seqs: int
    t_end: float  # seconds since ingest started when its last query returned


@dataclass
class StrongRow:
    tail: int
    strong_s: list[float] = field(default_factory=list)
    eventual_s: list[float] = field(default_factory=list)
    strong_tail_hits: int = 0
    eventual_tail_hits: int = 0

    def qps(self, which: str) -> float:
        xs = self.strong_s if which == "strong" else self.eventual_s
        return len(xs) / sum(xs) if xs else float("nan")


@dataclass
class Result:
    preload: int = 0
    shards: int = 1
    workers: int = 1
    materialize_s: float = 0.0
    base_qps: float = float("nan")
    base_cpu_s: float = float("nan")  # the search thread's CPU seconds per query, no ingest
    base_recall: float = float("nan")  # vs the shared ground truth, every held-out query used
    base_sample_recall: float = float("nan")  # the recall sample's queries vs the brute force: the steady state
    rate_asked: float = 0.0
    batch: int = 0
    produced: dict[str, Any] = field(default_factory=dict)
    ingest_qps_s: float = 0.0
    ingest_qps_cpu_s: float = 0.0  # the search thread's CPU seconds in those calls
    ingest_qps_n: int = 0
    after_qps_s: float = 0.0
    after_qps_n: int = 0
    probes: list[Probe] = field(default_factory=list)
    not_visible_at_ingest_end: int = 0
    found_gaps: list[float] = field(default_factory=list)  # per visible point: its finding search - the one before
    samples: list[RecallSample] = field(default_factory=list)
    recovered_after: float | None = None  # s from the last ack to the first recall sample back at baseline
    recovery_waited: float = 0.0
    last_ack_t: float = 0.0  # seconds from ingest start to the last ack
    t_ingest: float = 0.0  # time.time() when ingest started
    max_lag_seqs: int = 0
    max_built_lag_seqs: int = 0
    caught_up_after: float | None = None  # s from the last ack until served watermark == head (before part 6)
    rest_recall: float = float("nan")  # the recall sample once the index serves the head (after the drain)
    never_found_wide: int = 0  # never-visible points an eventual search at ef_search=WIDE_EF finds (HNSW misses)
    strong: list[StrongRow] = field(default_factory=list)
    tasks: dict[str, int] = field(default_factory=dict)
    segments: int = 0
    notes: list[str] = field(default_factory=list)

    def lags(self) -> np.ndarray:
        """ack -> visible per probe, never-visible ones as +inf."""
        return np.array([p.visible - p.acked if p.visible is not None else np.inf for p in self.probes])


class Truth:
    """Exact top-K (cosine) of the recall sample's queries over the state so far, updated per acked batch."""

    def __init__(self, queries: np.ndarray, base: np.ndarray, n: int) -> None:
        self.q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
        self.lock = threading.Lock()
        scores, ids = self._top(self.q @ self._unit(base[:n]).T, np.arange(n, dtype=np.int64))
        self.scores, self.ids, self.points = scores, ids, n

    @staticmethod
    def _unit(v: np.ndarray) -> np.ndarray:
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    @staticmethod
    def _top(scores: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        part = np.argpartition(-scores, K - 1, axis=1)[:, :K]
        s = np.take_along_axis(scores, part, axis=1)
        order = np.argsort(-s, axis=1)
        return np.take_along_axis(s, order, axis=1), ids[np.take_along_axis(part, order, axis=1)]

    def add(self, vectors: np.ndarray, ids: np.ndarray) -> None:
        # Unit vectors already. einsum, not matmul: numpy's own single-threaded loop (~3 ms a batch) instead of
        # BLAS, whose worker threads would wake on a loaded 2-core box and compete with what is measured.
        new = np.einsum("qd,bd->qb", self.q, vectors)
        with self.lock:
            scores = np.concatenate([self.scores, new], axis=1)
            all_ids = np.concatenate([self.ids, np.broadcast_to(ids, new.shape)], axis=1)
            part = np.argpartition(-scores, K - 1, axis=1)[:, :K]
            self.scores = np.take_along_axis(scores, part, axis=1)
            self.ids = np.take_along_axis(all_ids, part, axis=1)
            self.points += len(ids)

    def snapshot(self) -> tuple[np.ndarray, int]:
        with self.lock:
            return self.ids.copy(), self.points

    def row(self, i: int) -> tuple[np.ndarray, int]:
        """Query i's exact top-K over the state now, and the number of points in that state."""
        with self.lock:
            return self.ids[i].copy(), self.points


class Reader(threading.Thread):
    """Reads the producer's reports: each acked batch updates the truth and adds a probe."""

    def __init__(self, fd: int, base: np.ndarray, batch: int, truth: Truth) -> None:
        super().__init__(name="bench-reader", daemon=True)
        self.stream = os.fdopen(fd, "r")
        self.base, self.batch, self.truth = base, batch, truth
        self.lock = threading.Lock()
        self.new_probes: list[Probe] = []
        self.acks: list[tuple[int, float]] = []  # (seq, ack)
        self.ready = threading.Event()
        self.done: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.n_batches = 0

    def run(self) -> None:
        try:
            for line in self.stream:
                msg = json.loads(line)
                if msg.get("ready"):
                    self.n_batches = int(msg["batches"])
                    self.ready.set()
                elif msg.get("done"):
                    self.done = msg
                    return
                else:
                    i = int(msg["i"])
                    _, vectors, ids = fresh_batch(self.base, SEED, i, self.batch, FRESH_ID_BASE)
                    self.truth.add(vectors, ids)
                    j = probe_position(i, self.batch)
                    probe = Probe(int(ids[j]), vectors[j : j + 1], int(msg["seq"]), float(msg["ack"]))
                    with self.lock:
                        self.new_probes.append(probe)
                        self.acks.append((probe.seq, probe.acked))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc

    def take_probes(self) -> list[Probe]:
        with self.lock:
            out, self.new_probes = self.new_probes, []
            return out


# -- part 4/5: the measuring loop -----------------------------------------------------------------------


class Watcher:
    """One thread does all the searching (probes, QPS bursts, recall samples), so none of it competes with
    itself for the GIL; between rounds it sleeps --poll-ms."""

    def __init__(self, shoal: Shoal, searcher: Searcher, name: str, data: ib.Data, sample_q: np.ndarray,
                 truth: Truth, res: Result, args: argparse.Namespace) -> None:
        self.shoal, self.searcher, self.name, self.data = shoal, searcher, name, data
        self.sample_q, self.truth, self.res, self.args = sample_q, truth, res, args
        self.pending: list[Probe] = []
        self.all_probes: list[Probe] = []
        self.next_sweep = 0.0  # when poll_probes next searches every followed point, not only the oldest
        self.qi = 0
        self.t_ingest = 0.0  # time.time() of "go"
        self.lag_seqs = 0
        self.built_lag_seqs = 0
        self.sampling: tuple[str, float, np.ndarray, int, np.ndarray, list[int]] | None = None

    def search_ids(self, q: np.ndarray, consistency: Consistency = EVENTUAL) -> list[Any]:
        return self.searcher.search(self.name, "1", q, K, consistency=consistency)[0].column("id")

    def absorb(self, reader: Reader) -> None:
        new = reader.take_probes()
        for p in new:
            p.received = time.monotonic()
        self.pending += new
        self.all_probes += new

    def poll_probes(self, everything: bool = False) -> None:
        """Search followed points not seen yet with their own vectors (eventual; each row of a call is one point's
        own k=10 search). Points become visible about in seq order, often many at once (a new version served), so
        every round searches the --probe-batch oldest, then the next ones (twice as many each call) for as long as
        a call found any; every --sweep-every s (or with `everything`) all of them, in calls of up to 200."""
        now = time.monotonic()
        sweep = everything or now >= self.next_sweep
        if sweep:
            self.next_sweep = now + self.args.sweep_every
        seen: set[int] = set()
        start, size = 0, (200 if sweep else self.args.probe_batch)
        while start < len(self.pending):
            chunk = self.pending[start : start + size]
            start += len(chunk)
            now, began = time.monotonic(), time.time()
            hits = self.searcher.search(self.name, "1", np.vstack([p.vector for p in chunk]), K,
                                        consistency=EVENTUAL)
            found = time.time()
            any_found = False
            for p, h in zip(chunk, hits, strict=True):
                if p.id in h.column("id"):
                    p.visible, p.found_began = found, began
                    seen.add(p.id)
                    any_found = True
                    # It became visible after the previous search of it (or its ack reached us): the error bound.
                    self.res.found_gaps.append(now - (p.last_poll if p.last_poll is not None else p.received))
                p.last_poll = now
            if not sweep:
                if not any_found:
                    break
                size = min(2 * size, 200)
        if seen:
            self.pending = [p for p in self.pending if p.id not in seen]

    def qps_query(self) -> tuple[float, float]:
        """One held-out query (eventual, k=10, one per call); the seconds inside the call, and the thread's CPU
        seconds in it."""
        q = self.data.queries[self.qi % len(self.data.queries)][None, :]
        self.qi += 1
        t0, c0 = time.perf_counter(), time.thread_time()
        self.search_ids(q)
        return time.perf_counter() - t0, time.thread_time() - c0

    def recall_now(self) -> tuple[float, int]:
        truth_ids, points = self.truth.snapshot()
        found = np.full(truth_ids.shape, -1, dtype=np.int64)
        for i in range(len(self.sample_q)):
            got = self.search_ids(self.sample_q[i : i + 1])
            found[i, : len(got)] = got
        return ib.recall(found, truth_ids), points

    def status(self) -> None:
        st = self.shoal.index_status(self.name, "1")
        self.lag_seqs = max(s.lag_seqs for s in st)
        self.built_lag_seqs = max(s.built_lag_seqs for s in st)
        self.res.max_lag_seqs = max(self.res.max_lag_seqs, self.lag_seqs)
        self.res.max_built_lag_seqs = max(self.res.max_built_lag_seqs, self.built_lag_seqs)

    def start_sample(self, phase: str) -> None:
        """A recall sample, its queries spread over the next rounds. Each query is judged against the exact top-K
        over the state when that query starts (a sample spans seconds of ingest, so one snapshot for all of it
        would count the points acknowledged meanwhile, and found, as misses)."""
        truth_ids, points = self.truth.snapshot()
        found = np.full(truth_ids.shape, -1, dtype=np.int64)
        self.sampling = (phase, time.time() - self.t_ingest, truth_ids, points, found, [0])

    def continue_sample(self) -> RecallSample | None:
        """The sample's next queries, for up to --recall-slice-ms (at least one); the sample after its last."""
        assert self.sampling is not None
        phase, t, truth_ids, points, found, nxt = self.sampling
        t0 = time.perf_counter()
        while nxt[0] < len(self.sample_q) and (time.perf_counter() - t0) < self.args.recall_slice_ms / 1e3:
            i = nxt[0]
            truth_ids[i], now_points = self.truth.row(i)
            got = self.search_ids(self.sample_q[i : i + 1])
            found[i, : len(got)] = got
            nxt[0] += 1
        if nxt[0] < len(self.sample_q):
            return None
        self.sampling = None
        r = ib.recall(found, truth_ids)
        s = RecallSample(t, phase, r, points, now_points, self.lag_seqs, self.built_lag_seqs,
                         time.time() - self.t_ingest)
        self.res.samples.append(s)
        console.print(
            f"  t={s.t:6.1f}-{s.t_end:.1f}s {phase:6s} recall@{K} {r:.4f}  state {points:,}-{now_points:,} pts  "
            f"probes in flight {len(self.pending)}  head-served {s.lag_seqs:,} seqs  head-built "
            f"{s.built_lag_seqs:,} seqs"
        )
        return s

    def run(self, reader: Reader, until: Callable[[], bool], phase: str,
            check: Callable[[], None]) -> None:
        """Rounds until `until()`: search the followed points not seen yet, then (when due) an index_status
        sample, one query of the running QPS burst and up to --recall-slice-ms of the running recall sample, then
        sleep --poll-ms. Short rounds keep the probes' granularity fine."""
        a = self.args
        now = time.monotonic()
        next_qps = now
        next_recall = now + (a.recall_every if phase == "ingest" else 0.0)
        next_status = now
        burst_left, burst_spent = 0, 0.0
        while not until():
            check()
            self.absorb(reader)
            self.poll_probes()
            now = time.monotonic()
            if now >= next_status:
                self.status()
                next_status = now + 1.0
            if burst_left == 0 and now >= next_qps:
                burst_left, burst_spent = a.qps_burst, 0.0
                next_qps = now + a.qps_every
            if burst_left:
                spent, cpu = self.qps_query()
                burst_spent += spent
                burst_left = 0 if burst_spent >= a.burst_ms / 1e3 else burst_left - 1
                if phase == "ingest":
                    self.res.ingest_qps_s += spent
                    self.res.ingest_qps_cpu_s += cpu
                    self.res.ingest_qps_n += 1
                else:
                    self.res.after_qps_s += spent
                    self.res.after_qps_n += 1
            if self.sampling is None and now >= next_recall:
                self.start_sample(phase)
                next_recall = now + a.recall_every
            if self.sampling is not None:
                self.continue_sample()
            time.sleep(a.poll_ms / 1e3)
        # A sample still running goes on in the next phase, under the phase (and state) it began in.


# -- setup helpers ----------------------------------------------------------------------------------------


def start_workers(settings: Settings, n: int) -> list[tuple[subprocess.Popen[bytes], Path]]:
    """The first worker exactly as bench/index.py starts one (solo pool, beat); the others without beat."""
    out = [ib.start_worker(settings)]
    for i in range(1, n):
        log = settings.data_dir / f"worker-{i}-{uuid.uuid4().hex[:6]}.log"
        argv = worker_argv(beat=False, pool="solo", loglevel="info", quick=True, hostname=f"bench{i}-{ib.TAG}@%h")
        out.append((start_worker_process(argv, log, settings.child_env()), log))
    return out


def start_producer(
    settings: Settings, name: str, args: argparse.Namespace, log: Path
) -> tuple[subprocess.Popen[bytes], int]:
    r, w = os.pipe()
    env = settings.child_env()
    env["SHOAL_BENCH_DATA"] = str(ib.DATA_DIR)  # child_env drops every other SHOAL_* variable
    argv = [
        sys.executable, str(Path(__file__).resolve()), "_produce", "--name", name, "--rate", str(args.rate),
        "--batch", str(args.batch), "--seconds", str(args.seconds), "--first", "1", "--seed", str(SEED),
        "--report-fd", str(w),
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                pass_fds=(w,), start_new_session=True)
    os.close(w)
    return proc, r


def reap_group(pgid: int, timeout: float = 5.0) -> None:
    """End what is left of a process group this bench started (a child started with start_new_session leads
    one, whose id is its pid): e.g. the beat process of a worker that had to be SIGKILLed."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_producer(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    reap_group(proc.pid)


def stop_workers(workers: list[tuple[subprocess.Popen[bytes], Path]], timeout: float = 20.0) -> None:
    """Celery's warm shutdown (SIGTERM) to every worker at once, SIGKILL to those still running after
    `timeout` s, then whatever is left of each worker's session (a SIGKILLed worker leaves its beat behind)."""
    for proc, _ in workers:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout
    for proc, _ in workers:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        reap_group(proc.pid)


def tail_of(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def served(searcher: Searcher, name: str) -> int:
    return min(searcher.served_watermarks(name, "1").values())


def eventual_qps(searcher: Searcher, name: str, queries: np.ndarray, passes: int) -> tuple[float, float]:
    """(queries per second inside the calls, thread CPU seconds per query)."""
    spent, cpu, n = 0.0, 0.0, 0
    for _ in range(passes):
        for i in range(len(queries)):
            t0, c0 = time.perf_counter(), time.thread_time()
            searcher.search(name, "1", queries[i : i + 1], K, consistency=EVENTUAL)[0].column("id")
            spent += time.perf_counter() - t0
            cpu += time.thread_time() - c0
            n += 1
    return n / spent, cpu / n


# -- part 6 -------------------------------------------------------------------------------------------------


def run_strong(shoal: Shoal, searcher: Searcher, name: str, data: ib.Data, args: argparse.Namespace,
               res: Result) -> None:
    producer = shoal.producer(name, "1")
    added = 0
    q = data.queries
    wm = served(searcher, name)
    for t in args.tails:
        while added < t:  # 100-point uploads, ids of their own
            rows, vectors, ids = fresh_batch(data.base, SEED + 1, added // 100, 100, TAIL_ID_BASE)
            producer.upload_columns(vectors, {"id": ids, "section": data.sections(rows)})
            added += 100
        head = shoal.index_status(name, "1")[0].head
        now_wm = served(searcher, name)
        row = StrongRow(head - now_wm)
        if now_wm != wm:
            res.notes.append(f"6: the served watermark moved from {wm:,} to {now_wm:,} after the workers stopped")
        budget = time.monotonic() + args.strong_budget
        for j in range(args.strong_queries):
            if j >= 20 and time.monotonic() > budget:
                break
            qj = q[j % len(q)][None, :]
            for level in (STRONG, EVENTUAL) if j % 2 == 0 else (EVENTUAL, STRONG):
                t0 = time.perf_counter()
                ids = searcher.search(name, "1", qj, K, consistency=level)[0].column("id")
                dt = time.perf_counter() - t0
                tail_hits = sum(1 for x in ids if TAIL_ID_BASE <= x < FRESH_ID_BASE)
                if level is STRONG:
                    row.strong_s.append(dt)
                    row.strong_tail_hits += tail_hits
                else:
                    row.eventual_s.append(dt)
                    row.eventual_tail_hits += tail_hits
        res.strong.append(row)
        console.print(
            f"  T={t:,} appended (unindexed tail {row.tail:,} seqs): strong {row.qps('strong'):,.0f} qps, "
            f"eventual {row.qps('eventual'):,.0f} qps, ratio {row.qps('strong') / row.qps('eventual'):.2f}x "
            f"({len(row.strong_s)} queries each)"
        )


# -- the run ----------------------------------------------------------------------------------------------


def run(settings: Settings, data: ib.Data, args: argparse.Namespace, res: Result,
        cleanup: list[Callable[[], None]]) -> None:
    shoal = Shoal(settings)
    cleanup.append(shoal.close)
    name = f"bench-freshness-{ib.TAG}"
    n = min(args.preload, data.total)
    res.preload = n
    shoal.runtime.notify = False  # steady state before the workers start: nothing queued for them
    shoal.create_data_source(ib.source_spec(name))
    rows = np.arange(n)
    ib.ingest(shoal, name, data, rows, rows.astype(np.int64), 10_000)
    spec = ib.index_spec(name, name, PARAMS)
    if args.shards > 1:
        spec = dataclasses.replace(spec, shard_count=args.shards, shard_attributes=("id",))
    shoal.create_index(spec)
    t0 = time.perf_counter()
    for shard in shoal.get_index(name, "1").shards:
        ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
    res.materialize_s = time.perf_counter() - t0
    shoal.runtime.notify = True
    console.print(f"  preloaded and materialized {n:,} points ({args.shards} shard(s)) in {res.materialize_s:.1f}s")

    workers = start_workers(settings, args.workers)
    stopped = [False]

    def stop_all_workers() -> None:
        if not stopped[0]:
            stopped[0] = True
            stop_workers(workers)

    cleanup.append(stop_all_workers)
    searcher = shoal.searcher(follow=True, poll_interval=args.poll_interval)
    cleanup.append(searcher.close)
    # The producer process loads its data now, so it sits idle (waiting for "go") during the baseline.
    plog = settings.data_dir / "producer.log"
    sample_q = data.queries[: args.recall_queries]
    truth = Truth(sample_q, data.base, n)
    proc, rfd = start_producer(settings, name, args, plog)
    cleanup.append(lambda: stop_producer(proc))
    reader = Reader(rfd, data.base, args.batch, truth)
    reader.start()
    if not reader.ready.wait(180):
        raise RuntimeError(f"the producer did not get ready:\n{tail_of(plog)}")

    # -- 2. baseline -----------------------------------------------------------------------------------
    console.print("[bold]2. baseline: no ingest[/]")
    gt, note = ib.truth(data, n)
    res.notes.append(note)
    q = data.queries
    eventual_qps(searcher, name, q[: min(100, len(q))], 1)  # warm-up: view loaded, first-call paths
    res.base_qps, res.base_cpu_s = eventual_qps(searcher, name, q, args.base_passes)
    found = np.array([searcher.search(name, "1", q[i : i + 1], K)[0].column("id") for i in range(len(q))])
    res.base_recall = ib.recall(found, gt)
    watcher = Watcher(shoal, searcher, name, data, sample_q, truth, res, args)
    res.base_sample_recall, _ = watcher.recall_now()
    console.print(
        f"  eventual {res.base_qps:,.0f} qps (one query per call, {len(q)} queries x {args.base_passes}); "
        f"recall@{K} {res.base_recall:.4f} vs gt.npy ({len(q)} queries), {res.base_sample_recall:.4f} on the "
        f"{len(sample_q)}-query recall sample vs brute force"
    )

    # Warm-up of the pipeline: batch 0 (from here), built by a worker and served, before the clock starts.
    wrows, wvec, wids = fresh_batch(data.base, SEED, 0, args.batch, FRESH_ID_BASE)
    token = shoal.producer(name, "1").upload_columns(wvec, {"id": wids, "section": data.sections(wrows)})
    truth.add(wvec, wids)
    ib.wait_for(lambda: served(searcher, name) >= token.seq, 180, "the workers and searcher to serve a warm-up batch",
                workers[0][0])

    # -- 3/4. sustained ingest -------------------------------------------------------------------------
    console.print(
        f"[bold]3/4. sustained ingest[/]: {args.rate:,.0f} pts/s asked, {args.batch}-point batches, "
        f"{args.seconds:.0f}s, from a separate process; {args.workers} worker(s)"
    )

    def check() -> None:
        if reader.error is not None:
            raise RuntimeError(f"reading the producer's reports failed: {reader.error!r}")
        if reader.done is None and proc.poll() not in (None, 0):
            raise RuntimeError(f"the producer exited with {proc.returncode}:\n{tail_of(plog)}")
        for wproc, wlog in workers:
            if not stopped[0] and wproc.poll() is not None:
                raise RuntimeError(f"a worker exited with {wproc.returncode}:\n{tail_of(wlog)}")

    watcher.t_ingest = time.time()
    assert proc.stdin is not None
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    watcher.run(reader, lambda: reader.done is not None and not reader.is_alive(), "ingest", check)
    res.produced = reader.done or {}
    watcher.absorb(reader)
    res.not_visible_at_ingest_end = len(watcher.pending)
    last_ack = max(a for _, a in reader.acks) if reader.acks else time.time()
    res.last_ack_t = last_ack - watcher.t_ingest
    console.print(
        f"  producer done: {res.produced.get('points', 0):,} points in {res.produced.get('seconds', 0):.1f}s, "
        f"{len(watcher.pending)} sampled points not visible yet"
    )

    # -- 5. after ingest -------------------------------------------------------------------------------
    console.print(f"[bold]5. after ingest[/]: recall until back within {RECALL_BAND} of {res.base_sample_recall:.4f} "
                  f"or {RECOVERY_S:.0f}s")
    deadline = last_ack + RECOVERY_S
    head = shoal.index_status(name, "1")[0].head  # every write of the run is in by now

    def caught_up() -> bool:
        """True once the searcher serves the head (noted the first time, checked every round)."""
        if res.caught_up_after is None and served(searcher, name) >= head:
            res.caught_up_after = time.time() - last_ack
        return res.caught_up_after is not None

    def recovered() -> bool:
        caught_up()
        if time.time() >= deadline:
            return True
        after = [s for s in res.samples if s.phase == "after"]
        if after and after[-1].recall >= res.base_sample_recall - RECALL_BAND:
            res.recovered_after = watcher.t_ingest + after[-1].t_end - last_ack
            return True
        return False

    watcher.run(reader, recovered, "after", check)
    res.recovery_waited = time.time() - last_ack
    # The probes not visible yet get until the index has caught up (or --drain s), still polled.
    drain_end = time.time() + args.drain
    if not caught_up():
        console.print(f"  waiting (up to {args.drain:.0f}s) for the index to serve the head {head:,} before part 6")
        watcher.run(reader, lambda: time.time() >= drain_end or caught_up(), "drain", check)
    watcher.poll_probes(everything=True)
    res.probes = watcher.all_probes
    res.t_ingest = watcher.t_ingest
    res.rest_recall, _ = watcher.recall_now()
    for p in watcher.pending:  # never seen: an approximate miss at the index's ef_search, or really absent?
        hits = searcher.search(name, "1", p.vector, K, consistency=EVENTUAL, search_params={"ef_search": WIDE_EF})
        res.never_found_wide += p.id in hits[0].column("id")
    console.print(f"  recall@{K} of the grown index at rest: {res.rest_recall:.4f}")
    stop_all_workers()

    # -- 6. strong vs eventual -------------------------------------------------------------------------
    console.print("[bold]6. strong vs eventual[/] (workers stopped: appended points stay unindexed)")
    run_strong(shoal, searcher, name, data, args, res)

    for _, wlog in workers:
        for task in ib.TASK_DONE.findall(Path(wlog).read_text(errors="replace")):
            res.tasks[task] = res.tasks.get(task, 0) + 1
    res.segments = sum(
        len(v.manifest["segments"]) for s in shoal.get_index(name, "1").shards
        if (v := shoal.shards.active_version(s.id)) is not None
    )


# -- report -------------------------------------------------------------------------------------------------


def fmt_s(x: float) -> str:
    return "never" if not np.isfinite(x) else f"{x:.3f}"


def print_report(res: Result, args: argparse.Namespace) -> None:
    ok = ib.ok
    table = Table(title="Shoal freshness bench (issue 14): figures of one run beside the issue's targets")
    table.add_column("#")
    table.add_column("measure")
    table.add_column("figure", justify="right")
    table.add_column("target")
    table.add_column("met")
    table.add_row("1", f"preload (points, HNSW M16 efC200 cosine, {res.shards} shard(s)), materialized in-process",
                  f"{res.preload:,} in {res.materialize_s:.1f}s", "the shared data set", "")
    table.add_row("1", "worker processes (solo pool; the first with beat)", f"{res.workers}", "", "")
    table.add_section()
    table.add_row("2", "eventual QPS, no ingest (one query per call)", f"{res.base_qps:,.0f}", "", "")
    table.add_row("2", f"recall@{K}, no ingest, vs gt.npy ({args.queries} queries)", f"{res.base_recall:.4f}", "", "")
    table.add_row("2", f"recall@{K}, no ingest, recall sample ({args.recall_queries} queries) vs brute force",
                  f"{res.base_sample_recall:.4f}", "", "")
    table.add_section()
    pr = res.produced
    achieved = pr.get("points", 0) / pr["seconds"] if pr.get("seconds") else float("nan")
    full = ok(achieved >= 0.98 * 5000 and pr.get("seconds", 0) >= 59) if res.rate_asked >= 5000 else "(asked less)"
    table.add_row("3", f"ingest rate asked / achieved (pts/s), for {pr.get('seconds', 0):.1f}s",
                  f"{res.rate_asked:,.0f} / {achieved:,.0f}", "5,000 for 60 s", full)
    table.add_row("3", "points, batches late (> 1 interval behind), upload p50 / p99 ms",
                  f"{pr.get('points', 0):,}, {pr.get('late', 0)}, {pr.get('upload_p50_ms', float('nan')):.1f} / "
                  f"{pr.get('upload_p99_ms', float('nan')):.1f}", "", "")
    table.add_section()
    lags = res.lags()
    never = int(np.sum(~np.isfinite(lags)))
    if len(lags):
        p = {x: float(np.percentile(lags, x, method="higher")) for x in (50, 90, 99, 100)}
    else:
        p = dict.fromkeys((50, 90, 99, 100), float("nan"))
    table.add_row("4", f"write -> visible (eventual) p50 s ({len(lags)} sampled points)", fmt_s(p[50]), "<= 0.3 s",
                  ok(p[50] <= 0.3))
    table.add_row("4", "write -> visible p90 s", fmt_s(p[90]), "", "")
    table.add_row("4", "write -> visible p99 s", fmt_s(p[99]), "<= 1 s", ok(p[99] <= 1.0))
    table.add_row("4", "write -> visible max s", fmt_s(p[100]), "", "")
    table.add_row("4", "  error bound: s between the search that found a point and the one before, p50 / p99",
                  f"{ib.percentile(res.found_gaps, 50):.3f} / {ib.percentile(res.found_gaps, 99):.3f}", "", "")
    table.add_row("4", "sampled points not visible when ingest stopped / never visible before the end "
                  f"(of these, found at ef_search={WIDE_EF})",
                  f"{res.not_visible_at_ingest_end} / {never} ({res.never_found_wide})", "", "")
    during = [s for s in res.samples if s.phase == "ingest"]
    low = min((s.recall for s in during), default=float("nan"))
    table.add_row("4", f"eventual recall@{K} during ingest: minimum of {len(during)} samples", f"{low:.4f}",
                  ">= 0.9 throughout", ok(low >= 0.9))
    qps = res.ingest_qps_n / res.ingest_qps_s if res.ingest_qps_s else float("nan")
    ratio = qps / res.base_qps
    table.add_row("4", "eventual QPS during ingest (bursts between probes) / ratio to no ingest",
                  f"{qps:,.0f} / {ratio:.2f}x", ">= 0.5x", ok(ratio >= 0.5))
    cpu = res.ingest_qps_cpu_s / res.ingest_qps_n if res.ingest_qps_n else float("nan")
    table.add_row("4", "  per query during ingest / no ingest: ms inside the call, of it ms of the search thread's "
                  "CPU (the rest: waiting for a core or the GIL)",
                  f"{1e3 / qps:.2f} ({1e3 * cpu:.2f}) / {1e3 / res.base_qps:.2f} ({1e3 * res.base_cpu_s:.2f})", "", "")
    table.add_row("4", "largest head - served / head - built during the run (seqs)",
                  f"{res.max_lag_seqs:,} / {res.max_built_lag_seqs:,}", "", "")
    table.add_section()
    after = [s for s in res.samples if s.phase == "after"]
    back = res.recovered_after
    table.add_row(
        "5", f"back at the no-ingest recall (within {RECALL_BAND}) after the last ack (s)",
        f"{back:.1f}" if back is not None else f"not within {res.recovery_waited:.0f}",
        "<= 120 s", ok(back is not None and back <= RECOVERY_S),
    )
    rest = res.rest_recall
    settled = None  # the first sample after ingest within the band of the at-rest recall
    for s in after:
        if np.isfinite(rest) and s.recall >= rest - RECALL_BAND:
            settled = s.t_end - res.last_ack_t
            break
    at_rest = "serving the head" if res.caught_up_after is not None else "NOT caught up within --drain"
    table.add_row("5", f"recall@{K} of the grown index at rest ({at_rest}, after part 5 and the drain)",
                  f"{rest:.4f}", "", "")
    table.add_row(
        "5", f"back within {RECALL_BAND} of that at-rest recall after the last ack (s): the index's steady state",
        f"{settled:.1f}" if settled is not None else f"not within {res.recovery_waited:.0f}",
        "<= 120 s", ok(settled is not None and settled <= RECOVERY_S),
    )
    table.add_row("5", "recall samples after ingest: last / minimum",
                  f"{after[-1].recall:.4f} / {min(s.recall for s in after):.4f}" if after else "n/a", "", "")
    table.add_row("5", "index serves the head (head - served = 0) after the last ack (s)",
                  f"{res.caught_up_after:.1f}" if res.caught_up_after is not None else "not within --drain",
                  "", "")
    table.add_section()
    targets = {100: 0.8, 1000: 0.5}
    for row, t in zip(res.strong, args.tails, strict=False):
        r = row.qps("strong") / row.qps("eventual")
        target = targets.get(t)
        table.add_row(
            "6", f"strong / eventual QPS, T={t:,} appended (tail {row.tail:,} seqs): strong, eventual",
            f"{row.qps('strong'):,.0f}, {row.qps('eventual'):,.0f}: {r:.2f}x",
            f">= {target}x" if target else "", ok(r >= target) if target else "",
        )
    console.print(table)

    if res.samples:
        st = Table(title=f"Recall@{K} samples ({args.recall_queries} queries, exact brute force over the state)")
        st.add_column("t s (from ingest start)", justify="right")
        st.add_column("phase")
        st.add_column("recall", justify="right")
        st.add_column("state points (first - last query)", justify="right")
        st.add_column("head - served", justify="right")
        st.add_column("head - built", justify="right")
        for s in res.samples:
            st.add_row(f"{s.t:.1f}-{s.t_end:.1f}", s.phase, f"{s.recall:.4f}", f"{s.points:,}-{s.points_end:,}",
                       f"{s.lag_seqs:,}",
                       f"{s.built_lag_seqs:,}")
        console.print(st)

    if res.probes:
        vt = Table(title="write -> visible by ack time (s from ingest start; never-visible points as infinite)")
        for col in ("acked in", "points", "p50 s", "p99 s", "max s"):
            vt.add_column(col, justify="right")
        lags = res.lags()
        at = np.array([p.acked - res.t_ingest for p in res.probes])
        step = 10.0
        for lo in np.arange(0.0, max(float(at.max()), 0.0) + step, step):
            sel = lags[(at >= lo) & (at < lo + step)]
            if len(sel):
                vt.add_row(f"{lo:.0f}-{lo + step:.0f}", f"{len(sel)}", f"{ib.percentile(sel, 50):.3f}",
                           f"{ib.percentile(sel, 99):.3f}", f"{float(sel.max()):.3f}")
        console.print(vt)

    gaps = res.found_gaps
    lines = list(res.notes)
    lines.append(
        f"4: write -> visible = time.time() after the eventual search (k={K}, the point's own vector) that first "
        f"returned the point's id, minus time.time() in the producer right after its upload returned. One point "
        f"per batch is followed; each round (every --poll-ms {args.poll_ms:g} ms plus its searches) searches the "
        f"{args.probe_batch} oldest followed points not seen yet in one eventual search call (each row's k={K} hits "
        f"are that point's own search), then the next ones, twice as many per call, while a call found any (points "
        f"become visible about in seq order, often many at once), and every {args.sweep_every:g}s all of them. "
        f"Error bound per point (its finding search minus the search before it, or minus its ack's "
        f"arrival here): p50 {1e3 * ib.percentile(gaps, 50):.1f} ms, p99 {1e3 * ib.percentile(gaps, 99):.1f} ms. "
        f"Percentiles count never-visible points as infinite."
    )
    lines.append(
        f"4: QPS = queries / seconds inside search calls, one held-out query per call; during ingest a burst of up "
        f"to {args.qps_burst} queries or {args.burst_ms:g} ms inside the calls every {args.qps_every}s, one query "
        f"per probe round ({res.ingest_qps_n:,} queries); no "
        f"ingest: {args.base_passes} pass(es) over the {args.queries} held-out queries. After ingest: "
        f"{res.after_qps_n / res.after_qps_s if res.after_qps_s else float('nan'):,.0f} qps."
    )
    lines.append(
        f"4/5: recall samples every {args.recall_every}s: the first {args.recall_queries} held-out queries, one per "
        f"call (up to {args.recall_slice_ms:g} ms of them per probe round, so a sample spans rounds), vs exact "
        f"cosine top-{K} (numpy) over the preload + every point acknowledged when that query began (each query "
        f"its own state; the truth is kept incrementally per acked batch). New points: a random shared base "
        f"vector + Gaussian noise of norm {NOISE}, re-normalised; ids from {FRESH_ID_BASE:,}."
    )
    lines.append(
        f"6: T points (100-point uploads, ids from {TAIL_ID_BASE:,}) appended after the workers stopped; strong and "
        f"eventual alternate query by query on the same searcher, up to {args.strong_queries} queries each or "
        f"{args.strong_budget:.0f}s. Hits from the appended points: "
        + ", ".join(f"T={t:,}: strong {r.strong_tail_hits}, eventual {r.eventual_tail_hits}"
                    for r, t in zip(res.strong, args.tails, strict=False))
    )
    lines.append(
        f"workers ran {res.tasks.get('materialize_shard', 0)} materializations, {res.tasks.get('merge_shard', 0)} "
        f"merges, {res.tasks.get('sweep', 0)} sweeps; {res.segments} index segments at the end"
    )
    for line in lines:
        console.print(escape(line))


# -- main -------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=None, help="ingest points/s (default 5000; --quick 2000)")
    p.add_argument("--batch", type=int, default=500, help="points per upload (default 500)")
    p.add_argument("--seconds", type=float, default=None, help="ingest duration (default 60; --quick 20)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--shards", type=int, default=1, help="index shards (default 1)")
    p.add_argument("--preload", type=int, default=10**9, help="points preloaded (default: all of the data set)")
    p.add_argument("--queries", type=int, default=1000, help="held-out queries for QPS and recall (default 1000)")
    p.add_argument("--recall-queries", type=int, default=100, help="queries per recall sample (default 100)")
    p.add_argument("--recall-every", type=float, default=3.0, help="seconds between recall samples (default 3)")
    p.add_argument("--poll-ms", type=float, default=3.0, help="sleep between probe rounds, ms (default 3)")
    p.add_argument("--qps-every", type=float, default=0.1, help="seconds between QPS bursts (default 0.1)")
    p.add_argument("--qps-burst", type=int, default=20, help="most queries per QPS burst (default 20)")
    p.add_argument("--burst-ms", type=float, default=20.0,
                   help="a QPS burst ends after this many ms inside its calls (default 20)")
    p.add_argument("--probe-batch", type=int, default=8,
                   help="oldest followed points searched every round, in one call (default 8)")
    p.add_argument("--sweep-every", type=float, default=1.0,
                   help="seconds between searches of every followed point, not only the oldest (default 1)")
    p.add_argument("--recall-slice-ms", type=float, default=30.0,
                   help="a round runs a recall sample's queries for up to this many ms, at least one (default 30)")
    p.add_argument("--base-passes", type=int, default=2, help="passes over the queries for the baseline QPS")
    p.add_argument("--poll-interval", type=float, default=None, help="searcher poll s (default SHOAL_SEARCHER_POLL_S)")
    p.add_argument("--drain", type=float, default=240.0, help="max s to wait for the index to catch up before 6")
    p.add_argument("--tails", type=ib._ints, default=[100, 1000], help="part 6 tail sizes (default 100,1000)")
    p.add_argument("--strong-queries", type=int, default=1000, help="part 6 queries per level and T (default 1000)")
    p.add_argument("--strong-budget", type=float, default=15.0, help="part 6 seconds per T (default 15)")
    p.add_argument("--quick", action="store_true", help="20 s at 2000 pts/s, 300 queries, shorter waits")
    p.add_argument("--storage", default=None, help="storage root (default: in the temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp data dir (servers are still stopped)")
    p.add_argument("--searcher-stats", action="store_true",
                   help="time the searcher's version loads and young-tier extensions by thread (wall and CPU)")
    args = p.parse_args(argv)
    if args.quick:
        args.rate = args.rate or 2000.0
        args.seconds = args.seconds or 20.0
        args.queries = min(args.queries, 300)
        args.recall_queries = min(args.recall_queries, 50)
        args.base_passes = 1
        args.drain = min(args.drain, 120.0)
        args.strong_queries = min(args.strong_queries, 300)
        args.strong_budget = min(args.strong_budget, 5.0)
    args.rate = args.rate or 5000.0
    args.seconds = args.seconds or 60.0
    args.recall_queries = min(args.recall_queries, args.queries)
    return args


def versions() -> str:
    names = ("hnswlib", "numpy", "pyarrow", "celery", "redis")
    return ", ".join(f"{n} {importlib.metadata.version(n)}" for n in names)


SEARCHER_CALLS: list[tuple[str, str, float, float]] = []  # (what, thread, wall s, thread CPU s), --searcher-stats
HEARD: list[tuple[int, float]] = []  # (head the searcher learned, time.time()), --searcher-stats
COVERED: list[tuple[int, float]] = []  # (seq a young tier or served view now reaches, time.time()), --searcher-stats


def trace_searcher() -> None:
    """Time every version load and young-tier extension of this process's searchers, by thread (--searcher-stats):
    a search thread that extends the young tier itself pays for it in its latency, and wall time far above CPU
    time is time spent waiting, mostly for the GIL."""
    from shoal.searcher.searcher import SearchService

    def timed(what: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                SEARCHER_CALLS.append((what, threading.current_thread().name, time.perf_counter() - t0,
                                       time.thread_time() - c0))
        return wrapper

    def covering(fn: Callable[..., Any], end_of: Callable[[Any], int]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            out = fn(*a, **k)
            COVERED.append((end_of(out), time.time()))
            return out
        return wrapper

    def saw_head(self: Any, source_id: int, head: int) -> None:
        HEARD.append((head, time.time()))
        seen_head(self, source_id, head)

    seen_head = SearchService._saw_head
    SearchService._saw_head = saw_head  # type: ignore[method-assign]
    # A point is searchable once a young tier or a served view reaching its seq is in place (the bench has one
    # index: the ends are its).
    SearchService._load = timed("load a version", covering(  # type: ignore[method-assign]
        SearchService._load, lambda view: view.min_watermark))
    SearchService._extend = timed("extend the young tier", covering(  # type: ignore[method-assign]
        SearchService._extend, lambda cache: cache.end))


def print_visibility_parts(res: Result) -> None:
    """Where write -> visible goes (--searcher-stats): per sampled point, from its ack to the searcher hearing a
    head at or past its seq, to a young tier or served view covering it, and to the search that found it."""
    if not res.probes or not COVERED or not HEARD:
        return
    heard = sorted(HEARD, key=lambda h: h[1])
    covered = sorted(COVERED, key=lambda c: c[1])

    def first(events: list[tuple[int, float]], seq: int) -> float:
        """When the first event reaching `seq` happened (events in time order; none reaches a seq before its
        commit)."""
        return next((t for end, t in events if end >= seq), np.inf)

    parts: dict[str, list[float]] = {"ack -> head heard": [], "ack -> covered": [], "covered -> found": [],
                                     "  covered -> finding search began": [], "  the finding search itself": []}
    for p in res.probes:
        if p.visible is None or p.found_began is None:
            continue
        h, c = first(heard, p.seq), first(covered, p.seq)  # may precede the ack's clock read: counted as 0
        parts["ack -> head heard"].append(max(0.0, h - p.acked))
        parts["ack -> covered"].append(max(0.0, c - p.acked))
        parts["covered -> found"].append(max(0.0, p.visible - c) if np.isfinite(c) else np.inf)
        parts["  covered -> finding search began"].append(max(0.0, p.found_began - c) if np.isfinite(c) else np.inf)
        parts["  the finding search itself"].append(p.visible - p.found_began)
    t = Table(title="write -> visible, in parts (found points; --searcher-stats)")
    for col in ("part", "p50 s", "p90 s", "p99 s"):
        t.add_column(col, justify="left" if col == "part" else "right")
    for name, values in parts.items():
        t.add_row(name, *(f"{ib.percentile(values, q):.3f}" for q in (50, 90, 99)))
    console.print(t)


def print_searcher_stats() -> None:
    if not SEARCHER_CALLS:
        return
    t = Table(title="Searcher background work, by thread (the whole run; --searcher-stats)")
    for col in ("what", "thread", "calls", "wall s", "thread CPU s", "wall p50 ms", "wall p99 ms"):
        t.add_column(col, justify="left" if col in ("what", "thread") else "right")
    for what, thread in sorted({(c[0], c[1]) for c in SEARCHER_CALLS}):
        wall = [c[2] for c in SEARCHER_CALLS if c[:2] == (what, thread)]
        cpu = sum(c[3] for c in SEARCHER_CALLS if c[:2] == (what, thread))
        t.add_row(what, thread, f"{len(wall)}", f"{sum(wall):.1f}", f"{cpu:.1f}",
                  f"{1e3 * ib.percentile(wall, 50):.1f}", f"{1e3 * ib.percentile(wall, 99):.1f}")
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_data(ib.DATA_DIR, "base_f16.npy", "queries_f16.npy", "gt.npy", "points.parquet")
    res = Result(shards=args.shards, workers=args.workers, rate_asked=args.rate, batch=args.batch)
    finished = False
    with Lifecycle() as life:
        tmp = life.temp_dir("shoal-freshness-bench-", keep=args.keep)
        console.print(
            f"[bold]shoal freshness bench[/] python {platform.python_version()}, {versions()}, "
            f"{os.cpu_count()} cpus (available_cores() = {available_cores()}), load average before {ib._load()}"
        )
        t_start = time.perf_counter()
        life.stop_servers(tmp)
        console.print("[bold]1. setup[/]: embedded Postgres + Valkey, preload, materialize, worker(s)")
        # Always the embedded servers of a temp dir: the workers' sweeps must see no one else's indexes.
        base = Settings(data_dir=tmp, database_url=None, redis_url=None)
        from shoal.servers.embedded import ensure_valkey

        with life.starting(tmp):
            overrides: dict[str, Any] = {
                "data_dir": tmp,
                "database_url": resolve_database_url(base),
                "redis_url": ensure_valkey(tmp),
                "sweep_interval_s": 5.0,
            }
            if args.storage:
                overrides["storage_uri"] = args.storage
            settings = Settings(**overrides)
            Shoal(base, notify=False).close()  # the embedded catalog's schema (auto-migrated only without a URL)
        console.print(
            f"  catalog and broker: embedded in {tmp}; storage {settings.resolved_storage_uri}; young tier bound "
            f"SHOAL_YOUNG_TIER_MAX_SEQS={getattr(settings, 'young_tier_max_seqs', 'n/a')}; searcher poll "
            f"{args.poll_interval or settings.searcher_poll_s}s"
        )
        data, note = ib.load_data(args.queries)
        res.notes.append(note)
        if args.searcher_stats:
            trace_searcher()
        run(settings, data, args, res, life.steps("workers, producer, searcher and Shoal connections"))
        finished = True
    if finished:
        print_report(res, args)
        print_searcher_stats()
        print_visibility_parts(res)
    console.print(f"total bench time {time.perf_counter() - t_start:.0f}s, load average after {ib._load()}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_produce":
        sys.exit(produce_main(sys.argv[2:]))
    sys.exit(main())
