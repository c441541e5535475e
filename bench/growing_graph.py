"""Design probe for issue 14 (raw hnswlib, no Shoal code): what a query would cost if each shard's young tier
were one graph the searcher grows itself, as Milvus's growing segments are, instead of quick segments and an
exact scan. Run by hand, never in CI:

    .venv/bin/python bench/growing_graph.py                  # 20,000 and 75,000 young rows per shard
    .venv/bin/python bench/growing_graph.py --young 40000

The shared data set (../shared/data/debian-packages) in 4 shards (M 16, ef_construction 200, ef 64, cosine),
held-out queries one per call, each searched in every graph. Beside it, per shard, one graph of `--young`
noisy copies of the data (a base vector plus noise of norm 0.1, as bench/freshness.py ingests) built at
ef_construction 40; then the same while a thread inserts `--rate` rows/s into those graphs. Prints ms per query
and the ratio of the at-rest cost to it (the QPS ratio a searcher could reach at best, before Python around the
walks, exact scans or waits for a core). hnswlib allows no search of a graph during an insert into it, so the
inserting thread and the queries take a lock per graph, as a searcher would have to.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import hnswlib
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lifecycle import Lifecycle, require_data  # noqa: E402
from index import DATA_DIR  # noqa: E402

SHARDS = 4


def noisy(base: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    picked = base[rng.integers(0, len(base), count)]
    noise = rng.standard_normal(picked.shape).astype(np.float32)
    noise *= 0.1 / np.linalg.norm(noise, axis=1, keepdims=True)
    out = picked + noise
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def graph(rows: np.ndarray, capacity: int, ef_construction: int) -> hnswlib.Index:
    g = hnswlib.Index("cosine", rows.shape[1])
    g.init_index(capacity, 16, ef_construction)
    g.set_num_threads(1)
    g.add_items(rows)
    g.set_ef(64)
    return g


def per_query_ms(graphs: list[tuple[hnswlib.Index, threading.Lock]], queries: np.ndarray) -> tuple[float, float]:
    """(wall, CPU of this thread) ms per query, each query searched in every graph."""
    t0, c0 = time.perf_counter(), time.thread_time()
    for q in queries:
        for g, lock in graphs:
            with lock:
                g.knn_query(q, 10)
    n = len(queries)
    return (time.perf_counter() - t0) / n * 1e3, (time.thread_time() - c0) / n * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--young", type=int, nargs="+", default=[20_000, 75_000], help="young rows per shard")
    parser.add_argument("--rate", type=int, default=5_000, help="rows/s the inserting thread adds (all shards)")
    parser.add_argument("--queries", type=int, default=300)
    args = parser.parse_args(argv)
    require_data(DATA_DIR, "base_f16.npy", "queries_f16.npy")
    base = np.load(DATA_DIR / "base_f16.npy").astype(np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    queries = np.load(DATA_DIR / "queries_f16.npy").astype(np.float32)[: args.queries]
    rng = np.random.default_rng(16)
    built = [(graph(base[s::SHARDS], len(base[s::SHARDS]), 200), threading.Lock()) for s in range(SHARDS)]
    per_query_ms(built, queries[:20])  # warm
    rest, _ = per_query_ms(built, queries)
    print(f"{len(base):,} rows in {SHARDS} shards: {rest:.3f} ms a query over the built graphs (at rest)")
    for young in args.young:
        capacity = young + args.rate * 30
        grown = []
        for _ in range(SHARDS):
            rows = noisy(base, young, rng)
            t0 = time.perf_counter()
            g = graph(rows, capacity, 40)
            grown.append((g, threading.Lock()))
            rate = young / (time.perf_counter() - t0)
        ms, _ = per_query_ms(built + grown, queries)
        print(f"+ {young:,} young rows per shard (inserted at {rate:,.0f} rows/s, one thread): {ms:.3f} ms a "
              f"query, {rest / ms:.2f}x the at-rest rate")
        stop = threading.Event()

        def insert(grown: list[tuple[hnswlib.Index, threading.Lock]] = grown, stop: threading.Event = stop) -> None:
            batch = max(1, args.rate // (10 * SHARDS))  # ten batches a second per shard
            while not stop.is_set():
                t0 = time.perf_counter()
                for g, lock in grown:
                    rows = noisy(base, batch, rng)
                    with lock:
                        g.add_items(rows)
                stop.wait(max(0.0, 0.1 - (time.perf_counter() - t0)))

        worker = threading.Thread(target=insert)
        worker.start()
        try:
            ms, cpu = per_query_ms(built + grown, queries)
        finally:
            stop.set()
            worker.join()
        print(f"  while a thread inserts {args.rate:,} rows/s: {ms:.3f} ms a query ({cpu:.3f} ms of it CPU), "
              f"{rest / ms:.2f}x the at-rest rate")
    return 0


if __name__ == "__main__":
    with Lifecycle():  # nothing to clean up; SIGTERM, like Ctrl-C, ends it with one line (the inserter joined)
        raise SystemExit(main())
