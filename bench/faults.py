"""Fault bench: a mixed workload while a driver SIGKILLs, in turn, the API, a worker, the consumer, Valkey and Postgres.

Run by hand, never in CI (see bench/README.md, "`bench/faults.py`"):

    .venv/bin/python bench/faults.py                          # 30 faults, about 16 minutes in all
    .venv/bin/python bench/faults.py --faults 5 --minutes 3   # a short pass that checks it works
    .venv/bin/python bench/faults.py --kinds postgres,valkey --faults 6

What it does:

1. On a fresh data dir under /tmp it starts the embedded default with `python -m shoal.cli server start` (an
   embedded Postgres and Valkey), creates a tenant, a write key, a data source (`id` int64 key, `package` string,
   `write_no` int64, 384-d real vectors from /work/shared/data/debian-packages) and an index over it (flat,
   cosine by default), then starts each process with the command an operator would use, each in its own session:
   `python -m shoal.cli api --port P`, `python -m shoal.cli worker`, `python -m shoal.cli consume`.
2. The workload runs throughout, from threads of this process:
   * HTTP uploads: Arrow IPC bodies (`--http-format json` for Vektonn JSON) of `--batch` points, each with an
     `Idempotency-Key`; a failed attempt (connection error, timeout, 5xx, 429) is retried with the same key and body
     until acknowledged (200) or `--give-up-s` passed;
   * broker uploads: `shoal.intake.Publisher.publish_columns` of `--batch` points with a message id of our own; a
     failed publish is retried with the same id (a new Publisher), likewise;
   * searches over HTTP at each consistency level: `eventual` (held-out queries), `strong` and `at_least` (the
     write token of the newest acknowledged HTTP upload in `X-Shoal-Required-Token`); the last two query the
     vector of a point that upload wrote and check that the hit shows that write or a later one (read-your-writes);
   * a sampler reading the index lag (head - built watermark) with `Shoal.index_status` every `--sample-s`.
   Every point carries `write_no`, unique per write; ids repeat (HTTP and the broker each cycle through their own
   half of the distinct real vectors, one vector per id), so the index stays the size of the vector set while the
   log keeps growing.
3. The driver kills one process (group) with SIGKILL every `--minutes` * 60 / `--faults` seconds, in the order of
   `--kinds`, waits `--down-s`, and restarts it with the command it was started with (Valkey and Postgres: `python
   -m shoal.cli server start`, which restarts Valkey on its old port and Postgres on its data dir). The next fault
   waits until the previous one recovered (uploads, the three search levels, lag under 1,000 seqs for
   `--lag-hold-s`) or `--recover-timeout` passed. A process that dies on its own is restarted too, and reported.
4. At the end the workload stops, the consumer drains the broker, and the Python API (`Shoal`) checks:
   every acknowledged write's `write_no` is in the log (lost = acknowledged and absent), no `write_no` is in the
   log twice (every upload carried a key: an Idempotency-Key or a message id), the fold holds for every id a write
   at least as new as its last acknowledged one, and a strong search (`Consistency.strong()`) finds a sample of
   acknowledged writes. Log compaction is off for the run (`SHOAL_COMPACTION_INTERVAL_S=0`) so the log keeps every
   entry it was given.

It prints the totals and, per fault kind, the seconds from the kill until each thing worked again (median / max
over that kind's faults): HTTP uploads, broker publishes, intake commits (a message published after the kill
committed, by `producer_batches.committed_at`), each search level, and the lag back under 1,000 seqs (and staying
there for `--lag-hold-s`). A figure that did not come back before the next fault is shown as `>Ns`. The same goes
to a JSON file (`--out`). Everything it starts is stopped and removed at the end, also on errors, Ctrl-C and
SIGTERM (`--keep` keeps the data dir and the process logs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from rich.console import Console
from rich.markup import escape
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benches' helpers
from _lifecycle import Lifecycle, require_data  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "debian-packages"
DATA_DIR = Path(os.environ.get("SHOAL_BENCH_DATA", SHARED))
TENANT = "faults"
SOURCE = "faults.points"
VERSION = "1"
ATTRIBUTES = {"id": "int64", "package": "string", "write_no": "int64"}
HNSW_PARAMS = {"M": 16, "ef_construction": 200, "ef_search": 64}
K = 10
LAG_TARGET = 1_000  # seqs: "the index lag returns under 1,000 seqs"
KINDS = ("api", "worker", "consumer", "valkey", "postgres")
REPO = Path(__file__).resolve().parents[1]
ARROW = "application/vnd.apache.arrow.stream"
JSON_TYPE = "application/json"
# The things whose recovery is timed after each fault, in table order.
MEASURES = ("upload_http", "publish", "intake", "eventual", "strong", "at_least", "lag")
MEASURE_TITLES = {
    "upload_http": "HTTP upload",
    "publish": "broker publish",
    "intake": "intake commit",
    "eventual": "search eventual",
    "strong": "search strong",
    "at_least": "search at_least",
    "lag": f"lag < {LAG_TARGET:,}",
}
console = Console(width=None if sys.stdout.isatty() else 200)


# -- data -----------------------------------------------------------------------------------------------------


@dataclass
class Data:
    """The distinct real vectors, split in two halves (HTTP ids and broker ids), and the held-out queries."""

    vectors: np.ndarray  # [U, 384] float32, no two rows equal
    package: list[str]
    queries: np.ndarray  # [Q, 384] float32
    http_rows: np.ndarray  # rows of `vectors` HTTP writes cycle through (id = position)
    broker_rows: np.ndarray  # rows the broker writes cycle through (id = len(http_rows) + position)


def load_data() -> Data:
    """base_f16.npy widened to float32, duplicates dropped (packages with the same description embed alike)."""
    base16 = np.load(DATA_DIR / "base_f16.npy")
    packages = pq.read_table(DATA_DIR / "points.parquet", columns=["package"])["package"].to_pylist()
    if len(packages) != base16.shape[0]:
        raise RuntimeError("points.parquet and base_f16.npy do not have the same rows")
    _, first = np.unique(np.ascontiguousarray(base16).view(f"V{base16.shape[1] * 2}").ravel(), return_index=True)
    keep = np.sort(first)
    vectors = base16[keep].astype(np.float32)
    queries = np.load(DATA_DIR / "queries_f16.npy").astype(np.float32)
    rows = np.arange(len(keep))
    return Data(vectors, [packages[i] for i in keep], queries, rows[0::2], rows[1::2])


# -- a light HTTP client ------------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: Any
    body: bytes


class Http:
    """One keep-alive connection (`http.client`), reopened after any error; no retry of its own (callers decide)."""

    def __init__(self, port: int, timeout: float) -> None:
        self.port, self.timeout = port, timeout
        self.conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> Reply:
        if self.conn is None:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            conn.connect()
            assert conn.sock is not None
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conn = conn
        try:
            self.conn.request(method, path, body=body, headers=headers)
            answer = self.conn.getresponse()
            data = answer.read()
        except BaseException:
            self.close()
            raise
        if answer.will_close:
            self.close()
        return Reply(answer.status, answer.headers, data)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


# -- what the clients saw -------------------------------------------------------------------------------------


@dataclass
class Op:
    """One attempt of one client: when it started and ended (wall clock), and how it went."""

    kind: str  # upload_http, publish, eventual, strong, at_least
    t0: float
    t1: float
    ok: bool
    status: int | None  # HTTP status, None for a connection error or a publish
    error: str | None


@dataclass
class Write:
    """One upload (HTTP batch or broker message): its key, its first write counter, and what became of it."""

    path: str  # "http" or "broker"
    key: str  # Idempotency-Key or message id
    j0: int  # the path's counter of its first point
    count: int
    t_first: float  # first attempt started
    acked: bool = False
    t_ack: float | None = None
    token: int | None = None  # HTTP write token
    attempts: int = 0


class Record:
    """Everything the workload threads report, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ops: list[Op] = []
        self.writes: list[Write] = []
        self.statuses: Counter[str] = Counter()  # "kind status" -> count
        self.bad_5xx: list[tuple[float, str, int, str]] = []  # 5xx other than 503: (t, kind, status, body)
        self.samples_503: list[tuple[float, str, str]] = []  # the first few 503 answers: (t, kind, body)
        self.errors: Counter[str] = Counter()  # "kind: error class" -> count
        self.error_samples: dict[str, str] = {}
        self.ryw_checked: Counter[str] = Counter()
        self.ryw_misses: list[tuple[float, str, str]] = []
        self.lag: list[tuple[float, int | None, int | None]] = []  # (t, head, built) or Nones when unreadable
        self.latest_http: tuple[int, int, int, int] | None = None  # (token, id, row, write_no) of the newest ack

    def op(self, kind: str, t0: float, ok: bool, status: int | None = None, error: BaseException | None = None,
           body: bytes = b"") -> None:
        t1 = time.time()
        text = None if error is None else f"{type(error).__name__}: {error}"[:300]
        with self.lock:
            self.ops.append(Op(kind, t0, t1, ok, status, text))
            if status is not None:
                self.statuses[f"{kind} {status}"] += 1
                if status >= 500 and status != 503:
                    self.bad_5xx.append((t1, kind, status, body[:300].decode(errors="replace")))
                elif status == 503 and len(self.samples_503) < 20:
                    self.samples_503.append((t1, kind, body[:300].decode(errors="replace")))
            if error is not None:
                name = f"{kind}: {type(error).__name__}"
                self.errors[name] += 1
                self.error_samples.setdefault(name, text or "")


# -- processes ------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A Shoal process started with one fixed command, in its own session, its output appended to a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.killed_by_us = False

    @property
    def command(self) -> str:
        return "python " + " ".join(self.argv[1:])

    def start(self) -> None:
        with open(self.log, "ab") as out:
            stamp = dt.datetime.now(dt.UTC).isoformat()
            out.write(f"\n=== {stamp} start #{self.starts + 1}: {self.command}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.argv, env=self.env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.starts += 1
        self.killed_by_us = False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the process and everything in its session (a prefork worker's pool, its embedded beat)."""
        if self.proc is None:
            return
        self.killed_by_us = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, timeout: float = 15) -> None:
        """A clean stop for the end of the run: SIGTERM (SIGINT for the API), then SIGKILL of the session."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT if self.name == "api" else signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self, lines: int = 12) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ConsumerProc(Proc):
    """`shoal consume`, started as `shoal up` starts it: under an id of its own, and from the second start on
    naming the one before it (killed, or seen to exit), so that the new one frees the group's lead at once rather
    than standing by until the dead one's lease runs out."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        super().__init__("consumer", argv, env, log)
        self.base_argv = list(argv)
        self.consumer_id: str | None = None

    def start(self) -> None:
        """Start a consumer under a new id; `--replaces` the previous one, which is no longer running."""
        from shoal.intake.delivery import new_consumer_id

        previous, self.consumer_id = self.consumer_id, new_consumer_id()
        self.argv = [*self.base_argv, "--consumer-id", self.consumer_id]
        if previous is not None:
            self.argv += ["--replaces", previous]
        super().start()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, ValueError):
                continue
    return out


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class Servers:
    """The embedded Postgres and Valkey of the data dir, started (and restarted) by `shoal server start`."""

    def __init__(self, data_dir: Path, env: dict[str, str], log: Path) -> None:
        self.data_dir, self.env, self.log = data_dir, env, log
        self.argv = [sys.executable, "-m", "shoal.cli", "server", "start"]

    @property
    def command(self) -> str:
        return "python -m shoal.cli server start"

    def start(self, timeout: float = 120) -> float:
        """Run `shoal server start` to its end; the seconds it took. Raises if it failed."""
        t0 = time.monotonic()
        with open(self.log, "ab") as out:
            out.write(f"\n=== {dt.datetime.now(dt.UTC).isoformat()} {self.command}\n".encode())
            out.flush()
            done = subprocess.run(self.argv, env=self.env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=timeout, check=False)
        if done.returncode != 0:
            # The log's last lines in the message: the log itself goes with the temp dir unless --keep.
            try:
                tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-12:])
            except OSError:
                tail = ""
            raise RuntimeError(f"`{self.command}` exited with {done.returncode}; {self.log} ends:\n{tail}")
        return time.monotonic() - t0

    def valkey_pid(self) -> int | None:
        try:
            return int((self.data_dir / "valkey" / "valkey.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data_dir / "postgres" / "postmaster.pid").read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill_valkey(self) -> str:
        pid = self.valkey_pid()
        if pid is None or not _pid_alive(pid):
            return "valkey was not running"
        os.kill(pid, signal.SIGKILL)
        self._wait_gone([pid])
        return f"valkey pid {pid}"

    def kill_postgres(self) -> str:
        """SIGKILL the postmaster and every process it started (the whole server dies at once, as in a crash)."""
        pid = self.postmaster_pid()
        if pid is None or not _pid_alive(pid):
            return "postgres was not running"
        kids = _children(pid)
        os.kill(pid, signal.SIGKILL)
        for kid in kids:
            try:
                os.kill(kid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._wait_gone([pid, *kids])
        return f"postmaster pid {pid} and its {len(kids)} processes"

    @staticmethod
    def _wait_gone(pids: list[int], timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.05)


# -- the workload ---------------------------------------------------------------------------------------------


class Workload:
    """The client threads: HTTP uploads, broker publishes, searches at three consistency levels, the lag sampler."""

    def __init__(self, args: argparse.Namespace, data: Data, port: int, api_key: str, settings: Any, shoal: Any,
                 rec: Record) -> None:
        self.args, self.data, self.port, self.settings, self.shoal, self.rec = args, data, port, settings, shoal, rec
        self.auth = {"Authorization": f"ApiKey {api_key}"}
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.counter_lock = threading.Lock()
        self.counters = {"http": 0, "broker": 0}
        self.n_http = len(data.http_rows)
        self.crashed: list[str] = []
        self.run_tag = uuid.uuid4().hex[:8]
        self.stopped_at: float | None = None
        # Resolved once: a Publisher made without a URL would start the embedded Valkey itself during its fault.
        self.broker = shoal.broker_url()

    # ids, rows and write numbers: HTTP writes are even, broker writes odd, so write_no is unique over both paths.
    def take(self, path: str, n: int) -> int:
        with self.counter_lock:
            j0 = self.counters[path]
            self.counters[path] += n
        return j0

    def batch_columns(self, path: str, j0: int, n: int) -> tuple[np.ndarray, dict[str, Any], np.ndarray, np.ndarray]:
        js = np.arange(j0, j0 + n, dtype=np.int64)
        if path == "http":
            pos = js % self.n_http
            rows, ids, write_no = self.data.http_rows[pos], pos, 2 * js
        else:
            pos = js % len(self.data.broker_rows)
            rows, ids, write_no = self.data.broker_rows[pos], self.n_http + pos, 2 * js + 1
        attrs = {"id": ids.astype(np.int64), "package": [self.data.package[r] for r in rows],
                 "write_no": write_no.astype(np.int64)}
        return self.data.vectors[rows], attrs, rows, write_no

    def json_body(self, vectors: np.ndarray, attrs: dict[str, Any]) -> bytes:
        parts = [
            f'{{"attributes":[{{"key":"id","value":{{"int64":{int(i)}}}}},'
            f'{{"key":"package","value":{{"string":{json.dumps(p)}}}}},'
            f'{{"key":"write_no","value":{{"int64":{int(w)}}}}}],'
            f'"vector":{{"isSparse":false,"coordinates":{json.dumps(v.tolist())}}},"isDeleted":false}}'
            for i, p, w, v in zip(attrs["id"], attrs["package"], attrs["write_no"], vectors, strict=True)
        ]
        return ("[" + ",".join(parts) + "]").encode()

    def start(self) -> None:
        a = self.args
        http_each = a.http_rate / a.http_threads
        for i in range(a.http_threads):
            self._spawn(f"http-upload-{i}", self.http_uploader, a.batch / http_each)
        broker_each = a.broker_rate / a.broker_threads
        for i in range(a.broker_threads):
            self._spawn(f"publisher-{i}", self.publisher, a.batch / broker_each)
        for level in ("eventual", "strong", "at_least"):
            self._spawn(f"search-{level}", self.searcher, 1.0 / a.search_rate, level)
        self._spawn("lag-sampler", self.sampler, a.sample_s)

    def _spawn(self, name: str, fn: Callable[..., None], *fn_args: Any) -> None:
        def run() -> None:
            try:
                fn(*fn_args)
            except BaseException as exc:  # noqa: BLE001 - a thread that dies is reported, the run goes on
                self.crashed.append(f"{name}: {type(exc).__name__}: {exc}")
                raise

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        self.threads.append(t)

    def should_give_up(self, w: Write) -> bool:
        """An upload is retried until --give-up-s after its first attempt, and for at most 30 s after the stop."""
        now = time.time()
        if now - w.t_first > self.args.give_up_s:
            return True
        return self.stopped_at is not None and now - self.stopped_at > 30

    def join(self, timeout: float = 150) -> None:
        self.stopped_at = time.time()
        self.stop.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))

    def paced(self, interval: float) -> Any:
        """Yields at a steady pace; after a stall it resumes from now (no burst to catch up)."""
        due = time.monotonic()
        while not self.stop.is_set():
            now = time.monotonic()
            if now < due and self.stop.wait(due - now):
                return
            due = max(due + interval, time.monotonic())
            yield

    # -- uploads ----------------------------------------------------------------------------------------------

    def http_uploader(self, interval: float) -> None:
        a = self.args
        client = Http(self.port, a.http_timeout)
        path = f"/api/v1/upload/{SOURCE}/{VERSION}"
        for _ in self.paced(interval):
            j0 = self.take("http", a.batch)
            vectors, attrs, rows, write_no = self.batch_columns("http", j0, a.batch)
            if a.http_format == "json":
                body, ctype = self.json_body(vectors, attrs), JSON_TYPE
            else:
                from shoal.intake.codec import encode_arrow

                body, ctype = encode_arrow(vectors, attrs), ARROW
            key = f"{self.run_tag}-h-{j0}"
            w = Write("http", key, j0, a.batch, time.time())
            with self.rec.lock:
                self.rec.writes.append(w)
            headers = {"Content-Type": ctype, "Idempotency-Key": key, **self.auth}
            while not self.should_give_up(w):
                w.attempts += 1
                t0 = time.time()
                try:
                    r = client.request("POST", path, body, headers)
                except (OSError, http.client.HTTPException) as exc:
                    self.rec.op("upload_http", t0, False, None, exc)
                    time.sleep(0.2)
                    continue
                if r.status == 200:
                    token = int(r.headers.get("X-Shoal-Write-Token") or 0)
                    self.rec.op("upload_http", t0, True, 200)
                    with self.rec.lock:
                        w.acked, w.t_ack, w.token = True, time.time(), token
                        self.rec.latest_http = (token, int(attrs["id"][0]), int(rows[0]), int(write_no[0]))
                    break
                self.rec.op("upload_http", t0, False, r.status, body=r.body)
                if 400 <= r.status < 500 and r.status != 429:
                    break  # refused as invalid: a retry would be refused again (counted as a client error)
                wait = 0.3
                if r.status in (429, 503):
                    try:
                        wait = min(1.0, max(0.1, float(r.headers.get("Retry-After") or 0.3)))
                    except ValueError:
                        pass
                time.sleep(wait)
        client.close()

    def publisher(self, interval: float) -> None:
        from shoal.intake.publisher import Publisher

        a = self.args
        pub: Any = None
        for _ in self.paced(interval):
            j0 = self.take("broker", a.batch)
            vectors, attrs, _, _ = self.batch_columns("broker", j0, a.batch)
            key = f"{self.run_tag}-b-{j0}"
            w = Write("broker", key, j0, a.batch, time.time())
            with self.rec.lock:
                self.rec.writes.append(w)
            while not self.should_give_up(w):
                w.attempts += 1
                t0 = time.time()
                try:
                    if pub is None:
                        # Few retries inside kombu: each attempt here is one op, so recovery is timed by ours.
                        pub = Publisher(self.settings, tenant=TENANT, url=self.broker, max_retries=2,
                                        max_backoff_s=0.5)
                    pub.publish_columns(SOURCE, VERSION, vectors, attrs, message_id=key)
                except Exception as exc:  # noqa: BLE001 - kombu and redis raise many kinds while the broker is away
                    self.rec.op("publish", t0, False, None, exc)
                    if pub is not None:
                        try:
                            pub.close()
                        except Exception:  # noqa: BLE001
                            pass
                        pub = None
                    time.sleep(0.3)
                    continue
                self.rec.op("publish", t0, True)
                with self.rec.lock:
                    w.acked, w.t_ack = True, time.time()
                break
        if pub is not None:
            try:
                pub.close()
            except Exception:  # noqa: BLE001
                pass

    # -- searches and the lag ---------------------------------------------------------------------------------

    def searcher(self, interval: float, level: str) -> None:
        client = Http(self.port, self.args.http_timeout)
        path = f"/api/v1/search/{SOURCE}.idx/{VERSION}"
        rng = np.random.default_rng(abs(hash(level)) % (1 << 32))
        for _ in self.paced(interval):
            headers = {"Content-Type": JSON_TYPE, **self.auth}
            expect: tuple[int, int, int, int] | None = None
            if level == "eventual":
                query = self.data.queries[int(rng.integers(len(self.data.queries)))]
            else:
                with self.rec.lock:
                    expect = self.rec.latest_http
                if expect is None:
                    continue
                query = self.data.vectors[expect[2]]
                headers["X-Shoal-Consistency"] = level
                if level == "at_least":
                    headers["X-Shoal-Required-Token"] = str(expect[0])
            body = json.dumps({"k": K, "queryVectors": [{"isSparse": False, "coordinates": query.tolist()}]}).encode()
            t0 = time.time()
            try:
                r = client.request("POST", path, body, headers)
            except (OSError, http.client.HTTPException) as exc:
                self.rec.op(level, t0, False, None, exc)
                continue
            if r.status != 200:
                self.rec.op(level, t0, False, r.status, body=r.body)
                continue
            self.rec.op(level, t0, True, 200)
            if expect is not None:
                self._check_ryw(level, r.body, expect, t0)
        client.close()

    def _check_ryw(self, level: str, body: bytes, expect: tuple[int, int, int, int], t0: float) -> None:
        """The point the newest acknowledged upload wrote must be found as that write or a newer one."""
        _, ident, _, write_no = expect
        seen: int | None = None
        try:
            for hit in json.loads(body)[0]["nearestDataPoints"]:
                attrs = {a["key"]: a["value"] for a in hit["attributes"]}
                if attrs["id"]["int64"] == ident:
                    seen = int(attrs["write_no"]["int64"])
                    break
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            seen = None
            detail = f"unreadable answer: {exc!r}"
        else:
            detail = f"id {ident}: expected write_no >= {write_no}, got {seen}"
        with self.rec.lock:
            self.rec.ryw_checked[level] += 1
            if seen is None or seen < write_no:
                self.rec.ryw_misses.append((t0, level, detail))

    def sampler(self, interval: float) -> None:
        for _ in self.paced(interval):
            t = time.time()
            try:
                shards = self.shoal.index_status(f"{SOURCE}.idx", VERSION)
                head = max(s.head for s in shards)
                built = min(s.built_watermark for s in shards)
            except Exception:  # noqa: BLE001 - the catalog is away during a Postgres fault
                head = built = None
            with self.rec.lock:
                self.rec.lag.append((t, head, built))

    # -- live state for the driver --------------------------------------------------------------------------

    def recovered_since(self, t_kill: float, hold: float) -> bool:
        """Whether every client kind succeeded after t_kill and the lag has stayed under target for `hold` s."""
        with self.rec.lock:
            ops = self.rec.ops[-2000:]
            lag = self.rec.lag[-int(hold / self.args.sample_s) - 40 :]
        good = {o.kind for o in ops if o.ok and o.t0 >= t_kill}
        if not {"upload_http", "publish", "eventual", "strong", "at_least"} <= good:
            return False
        now = time.time()
        recent = [s for s in lag if s[0] >= now - hold]
        if not recent or recent[0][0] > now - hold + 2 * self.args.sample_s or recent[0][0] < t_kill:
            return False
        return all(h is not None and b is not None and h - b < LAG_TARGET for _, h, b in recent)


# -- the fault driver -----------------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    no: int
    t_kill: float
    killed: str = ""
    t_restarted: float | None = None
    restart_s: float | None = None
    restart_error: str | None = None
    waited_recovery: float | None = None  # seconds the driver waited for recovery before the next fault
    recovered_live: bool = False


@dataclass
class Exit:
    """A process that died without being killed by the driver (restarted by the bench)."""

    name: str
    t: float
    code: int | None
    tail: str


class Driver:
    """Kills and restarts; meanwhile restarts any managed process that dies on its own (and records it)."""

    def __init__(self, procs: dict[str, Proc], servers: Servers, args: argparse.Namespace, work: Workload) -> None:
        self.procs, self.servers, self.args, self.work = procs, servers, args, work
        self.faults: list[Fault] = []
        self.exits: list[Exit] = []
        self.lock = threading.Lock()  # one restart at a time: a fault's, or the watchdog's
        self.stop = threading.Event()
        self.watchdog = threading.Thread(target=self._watch, name="watchdog", daemon=True)

    def _watch(self) -> None:
        while not self.stop.wait(0.5):
            with self.lock:
                for p in self.procs.values():
                    if p.proc is not None and not p.alive() and not p.killed_by_us:
                        self.exits.append(Exit(p.name, time.time(), p.proc.returncode, p.tail()))
                        console.print(f"[yellow]{p.name} exited by itself with {p.proc.returncode}; restarting it[/]")
                        p.start()

    def inject(self, kind: str, no: int) -> Fault:
        f = Fault(kind, no, time.time())
        with self.lock:
            try:
                if kind in self.procs:
                    p = self.procs[kind]
                    pid = p.proc.pid if p.proc else None
                    f.t_kill = time.time()
                    p.kill()
                    f.killed = f"{p.name} pid {pid} (its session)"
                elif kind == "valkey":
                    f.t_kill = time.time()
                    f.killed = self.servers.kill_valkey()
                else:
                    f.t_kill = time.time()
                    f.killed = self.servers.kill_postgres()
                time.sleep(self.args.down_s)
                t0 = time.monotonic()
                if kind in self.procs:
                    self.procs[kind].start()
                else:
                    self.servers.start()
                f.restart_s = time.monotonic() - t0
            except Exception as exc:  # noqa: BLE001 - the run goes on; the fault row shows it
                f.restart_error = f"{type(exc).__name__}: {exc}"
            f.t_restarted = time.time()
        self.faults.append(f)
        return f

    def run(self, t_start: float) -> None:
        """The faults: fault i due at t_start + i * interval, and not before the previous one recovered (or
        its --recover-timeout passed)."""
        a = self.args
        kinds = a.kinds
        interval = a.minutes * 60 / a.faults
        for i in range(a.faults):
            due = t_start + i * interval
            if i:
                prev = self.faults[-1]
                t_wait = time.time()
                deadline = prev.t_kill + a.recover_timeout
                while time.time() < deadline and not self.work.recovered_since(prev.t_kill, a.lag_hold_s):
                    time.sleep(0.25)
                prev.recovered_live = self.work.recovered_since(prev.t_kill, a.lag_hold_s)
                prev.waited_recovery = time.time() - t_wait
            while time.time() < due:
                time.sleep(0.1)
            kind = kinds[i % len(kinds)]
            f = self.inject(kind, i + 1)
            state = f"restarted in {f.restart_s:.1f}s" if f.restart_error is None else f"[red]{f.restart_error}[/]"
            console.print(f"fault {i + 1}/{a.faults} at +{f.t_kill - t_start:,.0f}s: SIGKILL {escape(f.killed)}; "
                          f"{state}")
        last = self.faults[-1]
        deadline = last.t_kill + max(interval, a.recover_timeout)
        while time.time() < deadline and not self.work.recovered_since(last.t_kill, a.lag_hold_s):
            time.sleep(0.25)
        last.recovered_live = self.work.recovered_since(last.t_kill, a.lag_hold_s)
        # One more stretch at the fault interval, so the last fault's window is as long as the others'.
        while time.time() < min(deadline, last.t_kill + interval):
            time.sleep(0.1)


# -- analysis -------------------------------------------------------------------------------------------------


def first_success(ops: list[Op], kind: str, t_kill: float, end: float) -> float | None:
    """Seconds from the kill to the end of the first successful op of `kind` that started after it."""
    best: float | None = None
    for o in ops:
        if o.kind == kind and o.ok and t_kill <= o.t0 < end and (best is None or o.t1 < best):
            best = o.t1
    return None if best is None else best - t_kill


def lag_back(samples: list[tuple[float, int | None, int | None]], t_kill: float, end: float,
             hold: float) -> float | None:
    """Seconds from the kill to the first sample from which the lag stays under target for `hold` s (or until the
    window ends, given at least two samples), within [t_kill, end)."""
    window = [s for s in samples if t_kill <= s[0] < end]
    for i, (t, _, _) in enumerate(window):
        run = [s for s in window[i:] if s[0] <= t + hold]
        if all(h is not None and b is not None and h - b < LAG_TARGET for _, h, b in run):
            reaches = window[-1][0] >= t + hold or (len(run) >= 2 and run[-1] is window[-1])
            if reaches:
                return t - t_kill
    return None


def intake_back(writes: list[Write], committed: dict[str, float], t_kill: float) -> float | None:
    """Seconds from the kill until a message whose publish started after it committed (the earliest such)."""
    times = [committed[w.key] for w in writes if w.path == "broker" and w.t_first >= t_kill and w.key in committed]
    return None if not times else min(times) - t_kill


def summarize(values: list[float | None], window: list[float]) -> dict[str, Any]:
    got = [v for v in values if v is not None]
    missing = len(values) - len(got)
    return {
        "median_s": round(statistics.median(got), 2) if got else None,
        "max_s": round(max(got), 2) if got else None,
        "not_recovered_in_window": missing,
        "window_s": round(min(window), 1) if window else None,
        "values_s": [None if v is None else round(v, 2) for v in values],
    }


def fmt_cell(s: dict[str, Any]) -> str:
    if s["median_s"] is None:
        return f">{s['window_s']:.0f}s (all {s['not_recovered_in_window']})" if s["window_s"] else "n/a"
    text = f"{s['median_s']:.1f} / {s['max_s']:.1f}"
    if s["not_recovered_in_window"]:
        text += f" (+{s['not_recovered_in_window']} >{s['window_s']:.0f}s)"
    return text


# -- final checks ---------------------------------------------------------------------------------------------


def committed_messages(shoal: Any, keys: set[str]) -> dict[str, float]:
    """Message id -> commit time (epoch s) of every committed message of ours, from producer_batches."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from shoal.catalog.models import ProducerBatch
    from shoal.intake.topology import BATCH_ID_PREFIX

    sid = shoal.get_data_source(SOURCE, VERSION).id
    out: dict[str, float] = {}
    with Session(shoal.engine) as s:
        rows = s.execute(
            select(ProducerBatch.batch_id, ProducerBatch.committed_at).where(
                ProducerBatch.data_source_id == sid, ProducerBatch.batch_id.like(BATCH_ID_PREFIX + "%")
            )
        ).all()
    for batch_id, at in rows:
        key = batch_id[len(BATCH_ID_PREFIX) :]
        if key in keys:
            out[key] = at.timestamp()
    return out


def wait_for(predicate: Callable[[], bool], timeout: float) -> tuple[bool, float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if predicate():
                return True, time.monotonic() - t0
        except Exception:  # noqa: BLE001 - the catalog may still be coming back
            pass
        time.sleep(1.0)
    return False, time.monotonic() - t0


def final_checks(args: argparse.Namespace, shoal: Any, work: Workload, rec: Record) -> dict[str, Any]:
    """Drain the broker, then compare what was acknowledged with the log, the fold and a strong search."""
    from shoal.searcher.consistency import Consistency

    broker_keys = {w.key for w in rec.writes if w.path == "broker"}
    acked_broker = {w.key for w in rec.writes if w.path == "broker" and w.acked}
    drained, drain_s = wait_for(lambda: acked_broker <= set(committed_messages(shoal, broker_keys)),
                                args.drain_timeout)
    console.print(f"broker drained: {drained} after {drain_s:.0f}s")
    caught, catch_s = wait_for(
        lambda: all(s.built_watermark >= s.head for s in shoal.index_status(f"{SOURCE}.idx", VERSION)),
        args.drain_timeout,
    )
    console.print(f"index caught up with the head: {caught} after {catch_s:.0f}s")
    committed = committed_messages(shoal, broker_keys)

    # The log, entry by entry: every write_no, how many times.
    t0 = time.monotonic()
    chunks = [b.column(b.schema.get_field_index("write_no")).to_numpy() for b in shoal.read_log(SOURCE, VERSION)]
    in_log = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
    values, counts = np.unique(in_log, return_counts=True)
    read_s = time.monotonic() - t0

    def write_nos(w: Write) -> np.ndarray:
        js = np.arange(w.j0, w.j0 + w.count, dtype=np.int64)
        return 2 * js if w.path == "http" else 2 * js + 1

    acked = [w for w in rec.writes if w.acked]
    unacked = [w for w in rec.writes if not w.acked]
    out: dict[str, Any] = {"log_entries": int(in_log.size), "log_read_s": round(read_s, 1),
                           "broker_drained": drained, "index_caught_up": caught}
    for path in ("http", "broker"):
        mine = [w for w in acked if w.path == path]
        nos = np.concatenate([write_nos(w) for w in mine]) if mine else np.zeros(0, dtype=np.int64)
        present = np.isin(nos, values)
        un = [w for w in unacked if w.path == path]
        un_nos = np.concatenate([write_nos(w) for w in un]) if un else np.zeros(0, dtype=np.int64)
        out[path] = {
            "uploads_acked": len(mine),
            "points_acked": int(nos.size),
            "points_present": int(present.sum()),
            "points_lost": int((~present).sum()),
            "lost_keys": sorted({w.key for w in mine if not np.isin(write_nos(w), values).all()})[:20],
            "uploads_given_up": len(un),
            "given_up_points_present": int(np.isin(un_nos, values).sum()),
            "attempts": sum(w.attempts for w in rec.writes if w.path == path),
            "uploads_retried": sum(1 for w in mine if w.attempts > 1),
        }
    dup_mask = counts > 1
    dup_nos = values[dup_mask]
    out["duplicate_entries"] = {
        "http": int((counts[dup_mask][dup_nos % 2 == 0] - 1).sum()),
        "broker": int((counts[dup_mask][dup_nos % 2 == 1] - 1).sum()),
        "examples_write_no": [int(x) for x in dup_nos[:10]],
    }

    # The fold: for every id, a write at least as new as its last acknowledged one.
    t0 = time.monotonic()
    fold = shoal.fold(SOURCE, VERSION)
    fold_no = dict(zip(fold.column("id").to_pylist(), fold.column("write_no").to_pylist(), strict=True))
    need: dict[int, int] = {}
    for w in acked:
        js = np.arange(w.j0, w.j0 + w.count, dtype=np.int64)
        if w.path == "http":
            ids, nos = js % work.n_http, 2 * js
        else:
            ids, nos = work.n_http + js % len(work.data.broker_rows), 2 * js + 1
        for i, n in zip(ids.tolist(), nos.tolist(), strict=True):
            if n > need.get(i, -1):
                need[i] = n
    stale = [i for i, n in need.items() if fold_no.get(i, -1) < n]
    out["fold"] = {"ids": len(fold_no), "ids_acked": len(need), "ids_older_than_acked": len(stale),
                   "examples": stale[:10], "seconds": round(time.monotonic() - t0, 1)}

    # A strong search through the Python API for a sample of ids: the hit shows the newest acknowledged write.
    rng = np.random.default_rng(3)
    sample = rng.choice(sorted(need), size=min(args.final_sample, len(need)), replace=False).tolist() if need else []
    rows = [int(work.data.http_rows[i]) if i < work.n_http else int(work.data.broker_rows[i - work.n_http])
            for i in sample]
    misses: list[int] = []
    if sample:
        searcher = shoal.searcher(follow=False)
        try:
            hits = searcher.search(f"{SOURCE}.idx", VERSION, work.data.vectors[rows], K,
                                   consistency=Consistency.strong())
        finally:
            searcher.close()
        for ident, h in zip(sample, hits, strict=True):
            found = {int(a["id"]): int(a["write_no"]) for a in (x.attributes for x in h)}
            if found.get(ident, -1) < need[ident]:
                misses.append(ident)
    out["strong_search"] = {"sampled": len(sample), "misses": len(misses), "examples": misses[:10]}
    out["intake_committed"] = len(committed)
    return out


# -- main -----------------------------------------------------------------------------------------------------


def child_env(data_dir: Path, args: argparse.Namespace) -> dict[str, str]:
    """This environment without SHOAL_*, plus the run's settings (the embedded default on the fresh data dir)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update({
        "SHOAL_DATA_DIR": str(data_dir),
        "SHOAL_TENANT": TENANT,
        "SHOAL_COMPACTION_INTERVAL_S": "0",  # keep every log entry: the duplicate count reads the raw log
        "SHOAL_INTAKE_VISIBILITY_TIMEOUT_S": f"{args.intake_visibility_s:g}",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=30, help="faults to inject (default 30)")
    p.add_argument("--minutes", type=float, default=12.0,
                   help="the faults are spread over this many minutes (default 12); a fault also waits for the "
                        "previous one to recover, up to --recover-timeout")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"what to kill, in turn (default {','.join(KINDS)})")
    p.add_argument("--down-s", type=float, default=1.0, help="seconds between a kill and the restart (default 1)")
    p.add_argument("--recover-timeout", type=float, default=35.0,
                   help="longest the next fault waits, from the previous kill, for it to recover (default 35 s)")
    p.add_argument("--lag-hold-s", type=float, default=5.0,
                   help="the lag counts as back under 1,000 seqs once it stays there this long (default 5 s)")
    p.add_argument("--warmup-s", type=float, default=20.0, help="workload before the first fault (default 20 s)")
    p.add_argument("--http-rate", type=float, default=500.0, help="points/s uploaded over HTTP (default 500)")
    p.add_argument("--broker-rate", type=float, default=500.0, help="points/s published to the broker (default 500)")
    p.add_argument("--batch", type=int, default=100, help="points per upload and per message (default 100)")
    p.add_argument("--http-threads", type=int, default=4, help="HTTP upload clients (default 4)")
    p.add_argument("--broker-threads", type=int, default=2, help="publisher threads (default 2)")
    p.add_argument("--http-format", choices=["arrow", "json"], default="arrow",
                   help="HTTP upload body: Arrow IPC (default) or Vektonn JSON")
    p.add_argument("--search-rate", type=float, default=5.0, help="searches/s per consistency level (default 5)")
    p.add_argument("--sample-s", type=float, default=0.5, help="seconds between index lag samples (default 0.5)")
    p.add_argument("--algorithm", choices=["flat", "hnsw"], default="flat",
                   help="the index (cosine): flat (default) or hnsw (M=16, ef_construction=200, ef_search=64)")
    p.add_argument("--http-timeout", type=float, default=30.0, help="seconds per HTTP request (default 30)")
    p.add_argument("--give-up-s", type=float, default=120.0,
                   help="a client gives an upload up after retrying it this long (default 120 s)")
    p.add_argument("--intake-visibility-s", type=float, default=30.0,
                   help="SHOAL_INTAKE_VISIBILITY_TIMEOUT_S of the run: a killed consumer's messages come back after "
                        "this long (default 30 s; Shoal's default is 300)")
    p.add_argument("--drain-timeout", type=float, default=180.0,
                   help="seconds to wait at the end for the consumer to commit every acknowledged message (180)")
    p.add_argument("--final-sample", type=int, default=500, help="ids checked by the final strong search (500)")
    p.add_argument("--out", default="/tmp/shoal-faults-summary.json", help="the JSON summary file")
    p.add_argument("--keep", action="store_true", help="keep the data dir and the process logs")
    args = p.parse_args(argv)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not args.kinds or set(args.kinds) - set(KINDS):
        p.error(f"--kinds takes a comma-separated list of {', '.join(KINDS)}")
    if args.faults < 1 or args.minutes <= 0:
        p.error("--faults and --minutes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_data(DATA_DIR, "base_f16.npy", "queries_f16.npy", "points.parquet")
    for name in [k for k in os.environ if k.startswith("SHOAL_")]:
        del os.environ[name]  # the run is the embedded default on its own data dir, whatever this shell set
    procs: dict[str, Proc] = {}
    work: Workload | None = None
    driver: Driver | None = None
    shoal: Any = None

    def stop_flags() -> None:  # the workload and the driver stop first, before the processes they use
        if work is not None:
            work.stop.set()
        if driver is not None:
            driver.stop.set()

    with Lifecycle() as life:
        logs = "logs: api.log, worker.log, consumer.log, servers.log"
        tmp = life.temp_dir("shoal-faults-", keep=args.keep, kept=logs)
        life.stop_servers(tmp)
        life.cleanup("Shoal connections", lambda: shoal is not None and shoal.close())
        life.cleanup("the API, worker and consumer processes", lambda: stop_procs(procs))
        life.cleanup(None, stop_flags, early=True)
        env = child_env(tmp, args)
        os.environ.update({k: v for k, v in env.items() if k.startswith("SHOAL_")})
        interval = args.minutes * 60 / args.faults
        console.print(
            f"[bold]shoal fault bench[/] python {platform.python_version()}, {os.cpu_count()} cpus, load average "
            f"{_load()}; {args.faults} faults ({', '.join(args.kinds)} in turn) every {interval:.0f}s or after "
            f"recovery (up to {args.recover_timeout:g}s); uploads {args.http_rate:g} pts/s HTTP "
            f"({args.http_format}) + {args.broker_rate:g} pts/s broker in {args.batch}-point batches; "
            f"{args.search_rate:g} searches/s per consistency level; {args.algorithm} index; data dir {tmp}"
        )
        servers = Servers(tmp, env, tmp / "servers.log")
        t_begin = time.time()
        from shoal.auth.keys import create_key
        from shoal.client import Shoal
        from shoal.config.settings import Settings
        from shoal.log.records import DataSourceSpec, IndexSpec

        data = load_data()
        console.print(f"data: {data.vectors.shape[0]:,} distinct real vectors (384-d) of {DATA_DIR}, "
                      f"{len(data.http_rows):,} ids written over HTTP, {len(data.broker_rows):,} through the broker")
        with life.starting(tmp):
            servers.start()
            settings = Settings()
            shoal = Shoal(settings, tenant=TENANT, notify=False)
        shoal.create_data_source(DataSourceSpec(SOURCE, VERSION, data.vectors.shape[1], ATTRIBUTES, ["id"]))
        shoal.create_index(IndexSpec(
            f"{SOURCE}.idx", VERSION, SOURCE, VERSION, algorithm=args.algorithm, metric="cosine",
            params=HNSW_PARAMS if args.algorithm == "hnsw" else {}, id_attributes=["id"],
        ))
        _, api_key = create_key(shoal.engine, TENANT, "write", "fault-bench")

        port = free_port()
        py = sys.executable
        procs = {
            "api": Proc("api", [py, "-m", "shoal.cli", "api", "--host", "127.0.0.1", "--port", str(port),
                                "--no-access-log"], env, tmp / "api.log"),
            "worker": Proc("worker", [py, "-m", "shoal.cli", "worker"], env, tmp / "worker.log"),
            "consumer": ConsumerProc([py, "-m", "shoal.cli", "consume"], env, tmp / "consumer.log"),
        }
        for p in procs.values():
            p.start()
        for name, cmd in [("servers", servers.command)] + [(p.name, p.command) for p in procs.values()]:
            console.print(f"  {name}: `{cmd}`")
        with life.starting(tmp, "the API"):
            ready, waited = wait_for(lambda: _healthz(port), 120)
            if not ready:
                raise RuntimeError(f"the API did not answer /healthz within 120s:\n{procs['api'].tail()}")
        console.print(f"API ready on 127.0.0.1:{port} after {waited:.0f}s")

        rec = Record()
        work = Workload(args, data, port, api_key, settings, shoal, rec)
        work.start()
        driver = Driver(procs, servers, args, work)
        driver.watchdog.start()
        time.sleep(args.warmup_s)
        t_start = time.time()
        driver.run(t_start)
        t_end = time.time()
        work.join()
        driver.stop.set()
        driver.watchdog.join(5)
        console.print(f"workload stopped at +{t_end - t_start:,.0f}s; final checks")
        final = final_checks(args, shoal, work, rec)
        summary = analyse(args, rec, work, driver, final, t_start, t_end, interval)
        summary["setup"] = {
            "python": platform.python_version(), "cpus": os.cpu_count(), "load_average_after": _load(),
            "commands": {"servers": servers.command, **{p.name: p.command for p in procs.values()}},
            "starts": {p.name: p.starts for p in procs.values()},
            "args": {k: v for k, v in vars(args).items()},
            "settings": {k: v for k, v in env.items() if k.startswith("SHOAL_") and k != "SHOAL_DATA_DIR"},
            "wall_s": round(time.time() - t_begin, 1),
        }
        Path(args.out).write_text(json.dumps(summary, indent=2, default=str))
        report(args, summary, rec, driver)
        console.print(f"JSON summary: {args.out}")
    console.print(f"total bench time {time.time() - t_begin:.0f}s, load average after {_load()}")
    return 0


def stop_procs(procs: dict[str, Proc]) -> None:
    """Stop every process of the run, each on its own; raise naming those that would not stop."""
    failed = []
    for p in procs.values():
        try:
            p.stop()
        except Exception as exc:  # noqa: BLE001 - the others still get stopped
            failed.append(f"{p.name}: {exc!r}")
    if failed:
        raise RuntimeError("; ".join(failed))


def _healthz(port: int) -> bool:
    client = Http(port, 5)
    try:
        return client.request("GET", "/healthz", None, {}).status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        client.close()


def analyse(args: argparse.Namespace, rec: Record, work: Workload, driver: Driver, final: dict[str, Any],
            t_start: float, t_end: float, interval: float) -> dict[str, Any]:
    """Per fault and per kind: the recovery times; and the run's totals."""
    faults = driver.faults
    committed = committed_messages(work.shoal, {w.key for w in rec.writes if w.path == "broker"})
    per_fault = []
    for i, f in enumerate(faults):
        end = faults[i + 1].t_kill if i + 1 < len(faults) else t_end
        times: dict[str, float | None] = {
            kind: first_success(rec.ops, kind, f.t_kill, end)
            for kind in ("upload_http", "publish", "eventual", "strong", "at_least")
        }
        back = intake_back(rec.writes, committed, f.t_kill)
        times["intake"] = back if back is not None and back < end - f.t_kill else None
        times["lag"] = lag_back(rec.lag, f.t_kill, end, args.lag_hold_s)
        in_window = [o for o in rec.ops if f.t_kill <= o.t0 < end]
        lags = [h - b for t, h, b in rec.lag if f.t_kill <= t < end and h is not None and b is not None]
        per_fault.append({
            "no": f.no, "kind": f.kind, "at_s": round(f.t_kill - t_start, 1), "window_s": round(end - f.t_kill, 1),
            "killed": f.killed, "restart_s": None if f.restart_s is None else round(f.restart_s, 2),
            "restart_error": f.restart_error, "recovered_before_next": f.recovered_live,
            "recovery_s": {k: None if v is None else round(v, 2) for k, v in times.items()},
            "failed_ops": dict(Counter(o.kind for o in in_window if not o.ok)),
            "status_503": sum(1 for o in in_window if o.status == 503),
            "status_5xx_other": sum(1 for o in in_window if o.status and o.status >= 500 and o.status != 503),
            "max_lag_seqs": max(lags, default=None),
            # The HTTP upload attempts after the kill that ended first, ok or not, and the first successes:
            # (start, end) in s from the kill, status or error.
            "first_uploads": [
                [round(o.t0 - f.t_kill, 2), round(o.t1 - f.t_kill, 2), o.status if o.status else (o.error or "")[:80]]
                for o in sorted((o for o in in_window if o.kind == "upload_http"), key=lambda o: o.t1)[:4]
                + sorted((o for o in in_window if o.kind == "upload_http" and o.ok), key=lambda o: o.t1)[:4]
            ],
        })
    by_kind: dict[str, Any] = {}
    for kind in args.kinds:
        rows = [r for r in per_fault if r["kind"] == kind]
        if not rows:
            continue
        windows = [r["window_s"] for r in rows]
        by_kind[kind] = {
            "faults": len(rows),
            **{m: summarize([r["recovery_s"][m] for r in rows], windows) for m in MEASURES},
            "restart_s_median": round(statistics.median([r["restart_s"] or 0 for r in rows]), 2),
            "failed_ops": sum(sum(r["failed_ops"].values()) for r in rows),
            "status_503": sum(r["status_503"] for r in rows),
            "status_5xx_other": sum(r["status_5xx_other"] for r in rows),
            "max_lag_seqs": max((r["max_lag_seqs"] or 0 for r in rows), default=0),
        }
    ok_ops = Counter(o.kind for o in rec.ops if o.ok)
    all_ops = Counter(o.kind for o in rec.ops)
    latency = {}
    for kind in sorted(all_ops):
        ms = np.array([(o.t1 - o.t0) * 1e3 for o in rec.ops if o.kind == kind and o.ok])
        if ms.size:
            latency[kind] = {"p50_ms": round(float(np.percentile(ms, 50)), 1),
                             "p99_ms": round(float(np.percentile(ms, 99)), 1)}
    span = max(1e-9, t_end - t_start)
    rates = {path: round(sum(w.count for w in rec.writes if w.path == path and w.acked and w.t_ack is not None
                             and t_start <= w.t_ack < t_end) / span, 1) for path in ("http", "broker")}
    http = final["http"]
    broker = final["broker"]
    return {
        "started_utc": dt.datetime.fromtimestamp(t_start, dt.UTC).isoformat(),
        "duration_s": round(t_end - t_start, 1),
        "fault_interval_s": round(interval, 1),
        "faults": len(faults),
        "totals": {
            "points_acked": http["points_acked"] + broker["points_acked"],
            "points_present": http["points_present"] + broker["points_present"],
            "points_lost": http["points_lost"] + broker["points_lost"],
            "duplicate_log_entries_keyed_uploads": final["duplicate_entries"]["http"]
            + final["duplicate_entries"]["broker"],
            "http_5xx_other_than_503": len(rec.bad_5xx),
            "http_503": sum(v for k, v in rec.statuses.items() if k.endswith(" 503")),
            "http_429": sum(v for k, v in rec.statuses.items() if k.endswith(" 429")),
            "read_your_writes_misses": len(rec.ryw_misses),
            "read_your_writes_checked": dict(rec.ryw_checked),
            "ops_ok": dict(ok_ops),
            "ops_all": dict(all_ops),
            "latency_ok_ops": latency,
            "acked_points_per_s": rates,
            "unexpected_exits": [{"name": e.name, "code": e.code, "at_s": round(e.t - t_start, 1),
                                  "log_tail": e.tail} for e in driver.exits],
            "client_threads_crashed": work.crashed,
        },
        "final": final,
        "by_kind": by_kind,
        "per_fault": per_fault,
        "statuses": dict(rec.statuses),
        "errors": dict(rec.errors),
        "error_samples": rec.error_samples,
        "samples_503": [{"at_s": round(t - t_start, 1), "kind": k, "body": b} for t, k, b in rec.samples_503],
        "bad_5xx_samples": [{"at_s": round(t - t_start, 1), "kind": k, "status": s, "body": b}
                            for t, k, s, b in rec.bad_5xx[:20]],
        "ryw_miss_samples": [{"at_s": round(t - t_start, 1), "level": lv, "detail": d}
                             for t, lv, d in rec.ryw_misses[:20]],
    }


def report(args: argparse.Namespace, s: dict[str, Any], rec: Record, driver: Driver) -> None:
    """The two tables: totals with their targets, and recovery per fault kind."""
    t = s["totals"]
    f = s["final"]
    summary = Table(title=f"Fault bench: {s['faults']} faults over {s['duration_s'] / 60:.1f} min")
    summary.add_column("what")
    summary.add_column("figure", justify="right")
    summary.add_column("target", justify="right")
    summary.add_column("")

    def row(what: str, figure: str, target: str = "", met: bool | None = None) -> None:
        verdict = "" if met is None else ("[green]met[/]" if met else "[red]not met[/]")
        summary.add_row(escape(what), escape(figure), escape(target), verdict)

    row("acknowledged points: present / acknowledged (HTTP + broker)",
        f"{t['points_present']:,} / {t['points_acked']:,}", "all", t["points_lost"] == 0)
    row("  over HTTP (Idempotency-Key): present / acknowledged, uploads (retried)",
        f"{f['http']['points_present']:,} / {f['http']['points_acked']:,}, {f['http']['uploads_acked']:,} uploads "
        f"({f['http']['uploads_retried']:,})")
    row("  through the broker (message id): present / acknowledged, messages (retried)",
        f"{f['broker']['points_present']:,} / {f['broker']['points_acked']:,}, "
        f"{f['broker']['uploads_acked']:,} messages ({f['broker']['uploads_retried']:,})")
    row("lost points (acknowledged, absent from the log)", f"{t['points_lost']:,}", "0", t["points_lost"] == 0)
    row("duplicate log entries of keyed uploads (HTTP / broker)",
        f"{f['duplicate_entries']['http']:,} / {f['duplicate_entries']['broker']:,}", "0",
        t["duplicate_log_entries_keyed_uploads"] == 0)
    row("fold: ids older than their last acknowledged write",
        f"{f['fold']['ids_older_than_acked']:,} of {f['fold']['ids_acked']:,}", "0",
        f["fold"]["ids_older_than_acked"] == 0)
    row("final strong search (Python API): sampled ids not showing their last ack",
        f"{f['strong_search']['misses']:,} of {f['strong_search']['sampled']:,}", "0",
        f["strong_search"]["misses"] == 0)
    row("HTTP 5xx other than 503 seen by clients", f"{t['http_5xx_other_than_503']:,}", "0",
        t["http_5xx_other_than_503"] == 0)
    row("HTTP 503 / 429 seen by clients (retried)", f"{t['http_503']:,} / {t['http_429']:,}")
    row("read-your-writes misses (strong, at_least) / checked",
        f"{t['read_your_writes_misses']:,} / {sum(t['read_your_writes_checked'].values()):,}", "0",
        t["read_your_writes_misses"] == 0)
    row("uploads given up (HTTP / broker), their points found in the log",
        f"{f['http']['uploads_given_up']} / {f['broker']['uploads_given_up']}, "
        f"{f['http']['given_up_points_present'] + f['broker']['given_up_points_present']:,} points")
    ops = ", ".join(f"{k} {t['ops_ok'].get(k, 0):,}/{v:,}" for k, v in sorted(t["ops_all"].items()))
    row("client attempts ok / all", ops)
    lat = ", ".join(f"{k} {v['p50_ms']:,.0f}/{v['p99_ms']:,.0f}" for k, v in t["latency_ok_ops"].items())
    row("latency of successful attempts p50/p99 ms", lat)
    r = t["acked_points_per_s"]
    row("acknowledged points/s during the faults (HTTP / broker)",
        f"{r['http']:,.0f} / {r['broker']:,.0f} (asked {args.http_rate:g} / {args.broker_rate:g})")
    row("processes that exited by themselves (restarted)",
        ", ".join(f"{e['name']} ({e['code']})" for e in t["unexpected_exits"]) or "none", "none",
        not t["unexpected_exits"])
    row("log entries read; broker drained; index caught up at the end",
        f"{f['log_entries']:,}; {f['broker_drained']}; {f['index_caught_up']}")
    console.print(summary)

    table = Table(title="Seconds from the SIGKILL until it works again: median / max over the kind's faults "
                        "(>Ns: not within the fault's window of N s)")
    table.add_column("fault")
    table.add_column("n", justify="right")
    table.add_column("restart cmd s", justify="right")
    for m in MEASURES:
        table.add_column(MEASURE_TITLES[m], justify="right")
    table.add_column("failed / 503 / other 5xx", justify="right")
    table.add_column("max lag", justify="right")
    for kind, k in s["by_kind"].items():
        table.add_row(kind, str(k["faults"]), f"{k['restart_s_median']:.1f}", *(fmt_cell(k[m]) for m in MEASURES),
                      f"{k['failed_ops']:,} / {k['status_503']:,} / {k['status_5xx_other']:,}",
                      f"{k['max_lag_seqs']:,}")
    console.print(table)
    if s["bad_5xx_samples"]:
        console.print("first 5xx other than 503:")
        for b in s["bad_5xx_samples"][:5]:
            console.print(escape(f"  +{b['at_s']}s {b['kind']} {b['status']}: {b['body'][:200]}"))
    if s["samples_503"]:
        console.print("first 503 answers:")
        for b in s["samples_503"][:3]:
            console.print(escape(f"  +{b['at_s']}s {b['kind']}: {b['body'][:200]}"))
    if s["ryw_miss_samples"]:
        console.print("first read-your-writes misses:")
        for m in s["ryw_miss_samples"][:5]:
            console.print(escape(f"  +{m['at_s']}s {m['level']}: {m['detail']}"))
    for e in s["totals"]["unexpected_exits"][:3]:
        head = f"{e['name']} exited by itself ({e['code']}) at +{e['at_s']}s; log tail:\n"
        console.print(escape(head + e["log_tail"]))
    if s["totals"]["client_threads_crashed"]:
        console.print(escape(f"client threads that crashed: {s['totals']['client_threads_crashed']}"))


if __name__ == "__main__":
    sys.exit(main())
