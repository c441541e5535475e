"""Reindex bench: swap an HNSW index from M=16 to M=32 while 8 clients search continuously.

Run by hand, never in CI:

    .venv/bin/python bench/reindex.py                 # 20,000 real 384-d points, a few minutes on 2 cores
    .venv/bin/python bench/reindex.py --points 50000 --clients 8 --steady-seconds 20

What it prints, measured in this run:
- failed queries (target 0) and answers that match neither generation (target 0: each answer must be what
  the old or the new generation answers for that query, searched alone afterwards);
- search latency p50 / p99 of the 8 clients in steady state (before the reindex), while the new generation
  is built (both cores are shared with hnswlib's build), and in the swap window (1 s either side of the
  moment the searcher switched generation); ratios to steady state (target: swap window p99 <= 2x);
- the reindex job's time (build, catch-up, recall check, swap) beside raw hnswlib building the same vectors
  with M=32 in the same run, and the recall@10 the gate measured.

Data: ../shared/data/debian-packages (see bench/index.py); the embedded Postgres runs in a temp data dir and
is stopped at the end, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import hnswlib
import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _lifecycle import Lifecycle, require_data  # noqa: E402
from index import DATA_DIR, K, load_data  # noqa: E402 - the index bench's data loader

from shoal import DataSourceSpec, Shoal  # noqa: E402
from shoal.config.settings import Settings  # noqa: E402
from shoal.index.builder import ShardBuilder  # noqa: E402
from shoal.log.records import AttributeType, IndexSpec  # noqa: E402

console = Console(width=None if sys.stdout.isatty() else 150)
OLD = {"M": 16, "ef_construction": 200, "ef_search": 64}
NEW = {"M": 32, "ef_construction": 200, "ef_search": 64}


def pct(xs: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1000, p)) if xs else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", type=int, default=20_000)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--steady-seconds", type=float, default=10.0)
    args = p.parse_args()
    require_data(DATA_DIR, "base_f16.npy", "queries_f16.npy", "gt.npy", "points.parquet")
    with Lifecycle() as life:
        data, _ = load_data(1000)
        n = min(args.points, len(data.base))
        vectors, queries = data.base[:n], data.queries
        tmp = life.temp_dir("shoal-reindex-bench-")  # the catalog, broker and segments of the run
        settings = Settings(data_dir=tmp)
        console.print(f"[bold]shoal reindex bench[/] {n:,} points x {vectors.shape[1]}-d from {DATA_DIR.name}, "
                      f"{args.clients} clients, {os.cpu_count()} cpus")
        life.stop_servers(tmp)
        with life.starting(tmp):
            shoal = Shoal(settings, notify=False)
        life.cleanup("Shoal connections", shoal.close)
        with shoal:
            dim = vectors.shape[1]
            shoal.create_data_source(DataSourceSpec("bench", "1", dim, {"id": AttributeType.INT64}, ["id"]))
            shoal.producer("bench", "1").upload_columns(vectors, {"id": np.arange(n)})
            spec = IndexSpec("bench", "1", "bench", "1", algorithm="hnsw", metric="cosine", params=OLD,
                             id_attributes=["id"])
            shoal.create_index(spec)
            builder = ShardBuilder(shoal.engine, shoal.storage)
            for shard in shoal.get_index("bench", "1").shards:
                builder.materialize(shard.id)
            searcher = shoal.searcher(follow=True, poll_interval=0.05)
            ids = lambda hits: tuple(h.attributes["id"] for h in hits)  # noqa: E731
            old = [ids(h) for h in searcher.search("bench", "1", queries, K)]

            samples: list[tuple[float, float, int, tuple[int, ...]]] = []  # (start, seconds, query, answer)
            failures: list[BaseException] = []
            stop = threading.Event()
            lock = threading.Lock()

            def client(offset: int) -> None:
                i = offset * 97
                while not stop.is_set():
                    q = i % len(queries)
                    t0 = time.perf_counter()
                    try:
                        got = ids(searcher.search("bench", "1", queries[q : q + 1], K)[0])
                    except BaseException as exc:  # noqa: BLE001 - counted as a failed query
                        failures.append(exc)
                        got = ()
                    with lock:
                        samples.append((t0, time.perf_counter() - t0, q, got))
                    i += 1

            threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.clients)]
            life.cleanup(None, stop.set, early=True)  # on an interrupt: the clients stop searching first
            for t in threads:
                t.start()
            time.sleep(args.steady_seconds)  # the steady-state window is a duration, not a wait for a result
            t_start = time.perf_counter()
            job = shoal.reindex("bench", "1", params=NEW, wait=True)
            t_swapped = time.perf_counter()
            switched = None
            while switched is None and time.perf_counter() - t_swapped < 60:
                if searcher.view("bench", "1").index.spec.params["M"] == 32:
                    switched = time.perf_counter()
                else:
                    time.sleep(0.01)
            time.sleep(2.0)  # keep measuring after the switch
            stop.set()
            for t in threads:
                t.join(30)
            new = [ids(h) for h in searcher.search("bench", "1", queries, K)]
            searcher.close()
        raw0 = time.perf_counter()
        raw = hnswlib.Index(space="cosine", dim=vectors.shape[1])
        raw.init_index(max_elements=n, M=32, ef_construction=200, random_seed=1)
        raw.add_items(vectors, np.arange(n), num_threads=os.cpu_count() or 1)
        raw_s = time.perf_counter() - raw0

    steady = [s for t0, s, _, _ in samples if t0 < t_start]
    building = [s for t0, s, _, _ in samples if t_start <= t0 < t_swapped]
    window = [s for t0, s, _, _ in samples if switched is not None and abs(t0 - switched) <= 1.0]
    mixed = sum(1 for _, _, q, got in samples if got and got not in (old[q], new[q]))
    table = Table(title="Reindex HNSW M=16 -> M=32 under continuous search (ours vs reference, same run)")
    for col in ("measure", "value", "reference", "ratio", "target"):
        table.add_column(col, justify="right" if col != "measure" else "left")
    table.add_row("queries answered", f"{len(samples):,}", "", "", "")
    table.add_row("failed queries", str(len(failures)), "", "", "0")
    table.add_row("answers matching neither generation", str(mixed), "", "", "0")
    table.add_row("job", f"{job.state}, recall@10 {job.recall:.4f}" if job.recall is not None else job.state, "",
                  "", f"gate {job.gate}")
    table.add_row("reindex time (build, catch-up, recall, swap) s", f"{t_swapped - t_start:.2f}",
                  f"{raw_s:.2f} (raw hnswlib M=32 build)", f"{(t_swapped - t_start) / raw_s:.2f}x", "")
    for label, xs in (("steady", steady), ("while building", building), ("swap window (+-1 s)", window)):
        for q in (50, 99):
            v = pct(xs, q)
            ref = pct(steady, q)
            table.add_row(f"latency p{q} {label} (ms, {len(xs):,} queries)", f"{v:.2f}", f"{ref:.2f} (steady)",
                          f"{v / ref:.2f}x", "<= 2x" if label.startswith("swap") and q == 99 else "")
    console.print(table)
    console.print("steady: before the reindex; while building: the new generation's build shares both cores with "
                  "the clients; swap window: 1 s either side of the searcher's switch to the new generation. "
                  "Answers are checked against each generation searched alone after the run.")
    return 0 if not failures and not mixed else 1


if __name__ == "__main__":
    sys.exit(main())
