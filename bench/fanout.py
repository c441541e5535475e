"""Fan-out bench: search QPS and p99 of a 4-shard index served by 2 searcher processes (2 shards each, the query
sent to one of them, which asks the other for its shards and merges) beside the same index served whole by one
process, same run, same machine.

Run by hand, never in CI (bench/README.md, "Fan-out bench"):

    .venv/bin/python bench/fanout.py                  # 20,000 points, 1 and 8 clients, 3 rounds each
    .venv/bin/python bench/fanout.py --rows 59004 --rounds 5

Data: /work/shared/data/debian-packages (override with SHOAL_BENCH_DATA): the first --rows base vectors (384-d,
float16 widened to float32) and the 1,000 held-out queries. Index: HNSW (M 16, ef_construction 200, ef_search 64,
cosine), 4 shards, built in this process with ShardBuilder before any search.

Servers: three `python -m shoal.cli api --no-access-log` processes on one embedded Postgres, Valkey and local
storage in a temp dir: `single` (no placement: loads all 4 shards), `a` and `b` (SHOAL_PLACEMENT_FILE places
shards 0-1 on a and 2-3 on b; SHOAL_NODE names each). Load: wrk (`-t1 -c<clients> -d<seconds>s --latency`, a Lua
script rotating through one single-query body per held-out query, k 10), alternating single and fan-out runs so
that drift on the shared machine weighs on both; each row is the median over --rounds and its min-max. Before
timing, the first 200 queries are checked to answer byte-identically through `single`, `a` and `b`.

On 2 cores the fan-out's two processes, the client and the machine's other work share the same cores; a fanned-out
query also does more work in total (two searches of half the rows, a second HTTP request, a merge), so the ratio
here is a floor for machines where each searcher has cores of its own.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package: reuse api.py's wrk script

from _lifecycle import Lifecycle, require_data  # noqa: E402
from api import WRK_LUA  # noqa: E402

from shoal import DataSourceSpec, Shoal  # noqa: E402
from shoal.catalog.db import resolve_database_url  # noqa: E402
from shoal.config.settings import Settings  # noqa: E402
from shoal.index.builder import ShardBuilder  # noqa: E402
from shoal.log.records import IndexSpec  # noqa: E402

DATA_DIR = Path(os.environ.get("SHOAL_BENCH_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"
                                / "debian-packages"))
TENANT = "bench"
INDEX = "Fan.Index"
K = 10
WRK = shutil.which("wrk")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "shoal.cli", "api", "--host", "127.0.0.1", "--port", str(port), "--no-access-log"]
    return subprocess.Popen(cmd, env=os.environ | env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)


def wait_ready(proc: subprocess.Popen[bytes], port: int, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"a server exited:\n{log.read_text()[-2000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"a server did not answer /healthz in {timeout:.0f}s:\n{log.read_text()[-2000:]}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def post(port: int, path: str, body: bytes) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    answer = conn.getresponse()
    content = answer.read()
    if answer.status != 200:
        raise RuntimeError(f"POST {path} on port {port}: {answer.status} {content[:500]!r}")
    return content


def wrk(port: int, path: str, clients: int, seconds: float, bodies: Path, script: Path) -> tuple[float, float]:
    """(QPS, p99 ms) of one wrk run."""
    assert WRK is not None
    out = subprocess.run([WRK, "-t1", f"-c{clients}", f"-d{seconds:g}s", "--timeout", "10s", "-s", str(script),
                          "--latency", f"http://127.0.0.1:{port}{path}", "--", str(bodies), "1"],
                         capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("SHOAL_WRK "))
    f = {k: int(v) for k, v in (x.split("=", 1) for x in line.split()[1:])}
    errors = f["non200"] + f["connect"] + f["read"] + f["write"] + f["timeout"]
    if errors:
        raise RuntimeError(f"wrk: {errors} errors of {f['requests']} requests on port {port}")
    return f["requests"] / (f["duration_us"] / 1e6), f["p99_us"] / 1e3


def profile(pid: int, port: int, path: str, bodies: Path, script: Path, tmp: Path) -> None:
    """py-spy over one process while wrk loads it: the share of samples per innermost Shoal/library frame."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out = tmp / "profile.txt"
    rec = subprocess.Popen([spy, "record", "-p", str(pid), "-d", "8", "-r", "200", "-f", "raw", "-o", str(out),
                            "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wrk(port, path, 8, 8, bodies, script)
    rec.wait(60)
    counts: dict[str, int] = {}
    total = 0
    for line in out.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        total += int(n)
        for depth in (1, 2):
            if len(frames) >= depth:
                key = f"{'leaf' if depth == 1 else 'parent'}: {frames[-depth]}"
                counts[key] = counts.get(key, 0) + int(n)
    print(f"\npy-spy over node a ({total} samples), top frames:")
    for key, n in sorted(counts.items(), key=lambda kv: -kv[1])[:30]:
        print(f"  {100 * n / total:5.1f}%  {key}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="then an untimed py-spy pass over node a under 8 clients (its top leaf functions)")
    args = parser.parse_args()
    if WRK is None:
        print("wrk is needed (apt-get install wrk)", file=sys.stderr)
        return 2
    require_data(DATA_DIR, "base_f16.npy", "queries_f16.npy")
    procs: list[subprocess.Popen[bytes]] = []
    with Lifecycle() as life:
        tmp = life.temp_dir("shoal-fanout-bench-", keep=bool(os.environ.get("SHOAL_BENCH_KEEP")))
        life.stop_servers(tmp)
        life.cleanup("the API servers", lambda: stop_api_servers(procs))
        base = np.load(DATA_DIR / "base_f16.npy", mmap_mode="r")[: args.rows].astype(np.float32)
        queries = np.load(DATA_DIR / "queries_f16.npy").astype(np.float32)
        # Built at the index's own parameters (no quick build: the bench measures search of a steady index).
        settings = Settings(data_dir=tmp, tenant=TENANT, quick_build_backlog_seqs=0)
        from shoal.servers.embedded import ensure_valkey

        with life.starting(tmp):
            settings = settings.model_copy(update={"redis_url": ensure_valkey(tmp)})
            database_url = resolve_database_url(settings)
            shoal = Shoal(settings)
        with shoal:
            shoal.create_data_source(DataSourceSpec("Fan", "1", base.shape[1], {"id": "int64"}, ["id"]))
            shoal.create_index(IndexSpec(INDEX, "1", "Fan", "1", algorithm="hnsw", metric="cosine", shard_count=4,
                                         params={"M": 16, "ef_construction": 200, "ef_search": 64}))
            for start_row in range(0, len(base), 10_000):
                rows = np.arange(start_row, min(start_row + 10_000, len(base)))
                shoal.producer("Fan", "1").upload_columns(base[rows], {"id": rows})
            t0 = time.perf_counter()
            builder = ShardBuilder(shoal.engine, shoal.storage)
            for shard in shoal.get_index(INDEX, "1").shards:
                builder.materialize(shard.id)
            print(f"{len(base):,} points, 4 HNSW shards built in {time.perf_counter() - t0:.1f}s")
            storage_uri = shoal.storage.root
        ports = {"single": free_port(), "a": free_port(), "b": free_port()}
        placement = tmp / "placement.yaml"
        placement.write_text(yaml.safe_dump({
            "nodes": {n: f"http://127.0.0.1:{ports[n]}" for n in ("a", "b")},
            "indexes": [{"tenant": TENANT, "index": INDEX, "version": "1", "shards": {"a": [0, 1], "b": [2, 3]}}],
        }))
        common = {"SHOAL_DATA_DIR": str(tmp), "SHOAL_DATABASE_URL": database_url, "SHOAL_STORAGE_URI": storage_uri,
                  "SHOAL_REDIS_URL": str(settings.redis_url), "SHOAL_TENANT": TENANT,
                  "SHOAL_ANONYMOUS_TENANT": TENANT}
        for name, port in ports.items():
            env = dict(common)
            if name != "single":
                env |= {"SHOAL_PLACEMENT_FILE": str(placement), "SHOAL_NODE": name}
            procs.append(start(env, port, tmp / f"api-{name}.log"))
        with life.starting(tmp, "the API servers"):
            for proc, (name, port) in zip(procs, ports.items(), strict=True):
                wait_ready(proc, port, tmp / f"api-{name}.log")
        path = f"/api/v1/search/{INDEX}/1"
        bodies = [json.dumps({"k": K, "queryVectors": [{"isSparse": False, "coordinates": q}]}).encode()
                  for q in queries.tolist()]
        same = sum(post(ports["single"], path, b) == post(ports["a"], path, b) == post(ports["b"], path, b)
                   for b in bodies[:200])
        print(f"answers identical through single, a and b: {same}/200")
        body_file, script = tmp / "bodies.txt", tmp / "search.lua"
        body_file.write_bytes(b"\n".join(bodies) + b"\n")
        script.write_text(WRK_LUA)
        for port in ports.values():  # warm every connection path
            wrk(port, path, 2, 2, body_file, script)
        print(f"\n{'clients':>7}  {'single QPS':>10}  {'p99 ms':>7}  {'fan-out QPS':>11}  {'p99 ms':>7}  "
              f"{'ratio (min-max)':>18}  {'CPU ms/query: single | a + b':>28}")
        pids = {name: proc.pid for name, proc in zip(ports, procs, strict=True)}
        for clients in (int(c) for c in args.clients.split(",")):
            single, fan, ratios, cpu_single, cpu_fan = [], [], [], [], []
            for _ in range(args.rounds):
                c0 = cpu_seconds(pids["single"])
                s = wrk(ports["single"], path, clients, args.seconds, body_file, script)
                c1 = cpu_seconds(pids["single"])
                cpu_single.append((c1 - c0) * 1e3 / (s[0] * args.seconds))
                a0, b0 = cpu_seconds(pids["a"]), cpu_seconds(pids["b"])
                f = wrk(ports["a"], path, clients, args.seconds, body_file, script)
                a1, b1 = cpu_seconds(pids["a"]), cpu_seconds(pids["b"])
                queries_run = f[0] * args.seconds
                cpu_fan.append(((a1 - a0) * 1e3 / queries_run, (b1 - b0) * 1e3 / queries_run))
                single.append(s)
                fan.append(f)
                ratios.append(f[0] / s[0])
            med = statistics.median
            print(f"{clients:>7}  {med(x[0] for x in single):>10,.0f}  {med(x[1] for x in single):>7.2f}  "
                  f"{med(x[0] for x in fan):>11,.0f}  {med(x[1] for x in fan):>7.2f}  "
                  f"{med(ratios):>6.2f}x ({min(ratios):.2f}-{max(ratios):.2f})  "
                  f"{med(cpu_single):>10.2f} | {med(x[0] for x in cpu_fan):.2f} + {med(x[1] for x in cpu_fan):.2f}")
        if args.profile:
            profile(procs[1].pid, ports["a"], path, body_file, script, tmp)
    return 0


def stop_api_servers(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop the `shoal api` processes (each leads its own session): SIGTERM, then SIGKILL after 20 s."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


if __name__ == "__main__":
    sys.exit(main())
