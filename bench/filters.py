"""Filtered search bench: recall@10 and QPS of Shoal's filtered HNSW search at several selectivities, beside
raw hnswlib with a filter function (an index the bench builds itself, same params, labelled by row) and numpy
exact search over the matching rows, all in one run. Run by hand, never in CI:

    .venv/bin/python bench/filters.py               # about a minute on 2 cores
    .venv/bin/python bench/filters.py --queries 100
    .venv/bin/python bench/filters.py --sweep       # also: exact scan vs the index's filtered search, forced,
                                                    # at 9 selectivities (FILTER_EXACT_MAX_ROWS_X_FRACTION)
    .venv/bin/python bench/filters.py --vary        # also: every query with a filter of its own (no cache helps)
    .venv/bin/python bench/filters.py --young 20000 # the last 20,000 points searched in the young tier
    .venv/bin/python bench/filters.py --metadata    # the same filters on fields of JSON metadata (the dataset API)

Data: ../shared/data/debian-packages (see bench/index.py); filters on `section` and `installed_size_kb`.
HNSW M16 efC200 (ef_search 64) over the whole set, cosine. One query per call, single-threaded, as a server
answers. Ground truth: float64 exact top-10 over the matching rows. Target (issue 15): recall@10 >= 0.95 at
every selectivity and QPS >= the better of the two references.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lifecycle import Lifecycle, require_data  # noqa: E402
from index import DATA_DIR, HNSW_PARAMS, K, raw_build, recall  # noqa: E402

from shoal import DataSourceSpec, Shoal  # noqa: E402
from shoal.config.settings import Settings  # noqa: E402
from shoal.engines.base import available_cores  # noqa: E402
from shoal.index.builder import ShardBuilder  # noqa: E402
from shoal.log.records import AttributeType, IndexSpec  # noqa: E402
from shoal.searcher import execute as execute_module  # noqa: E402
from shoal.searcher.consistency import Consistency  # noqa: E402
from shoal.searcher.filters import parse_filter  # noqa: E402


def load(queries: int) -> tuple[np.ndarray, np.ndarray, pa.Table]:
    base = np.load(DATA_DIR / "base_f16.npy").astype(np.float32)
    q = np.load(DATA_DIR / "queries_f16.npy").astype(np.float32)[:queries]
    points = pq.read_table(DATA_DIR / "points.parquet", columns=["id", "section", "installed_size_kb"])
    return base, q, points


def filters_for(points: pa.Table) -> list[tuple[str, dict[str, Any], np.ndarray]]:
    """(label, filter, mask) at ~50 %, 10 %, 1 %, 0.1 % of the rows."""
    size = points["installed_size_kb"].to_numpy(zero_copy_only=False)
    section = points["section"].to_numpy(zero_copy_only=False)
    n = len(size)
    median = int(np.median(size))
    libs = section == "libs"
    # Among `libs` (10 %), the smallest ones make ~1 %; among `utils` (3.8 %), the smallest make ~0.1 %.
    libs_cut = int(np.sort(size[libs])[int(0.01 * n)])
    utils_cut = int(np.sort(size[section == "utils"])[int(0.001 * n)])
    out = [
        ("~50 %", {"installed_size_kb": {"$lt": median}}, size < median),
        ("~10 %", {"section": "libs"}, libs),
        ("~1 %", {"section": "libs", "installed_size_kb": {"$lt": libs_cut}}, libs & (size < libs_cut)),
        ("~0.1 %", {"$and": [{"section": {"$in": ["utils"]}}, {"installed_size_kb": {"$lt": utils_cut}}]},
         (section == "utils") & (size < utils_cut)),
    ]
    return out


def exact_truth(unit: np.ndarray, queries: np.ndarray, rows: np.ndarray) -> np.ndarray:
    sub = unit[rows].astype(np.float64)
    scores = queries.astype(np.float64) @ sub.T
    return rows[np.argsort(-scores, axis=1, kind="stable")[:, :K]]


def timed(fn: Any, queries: np.ndarray, min_seconds: float = 1.0) -> tuple[float, np.ndarray]:
    """QPS (the median over passes over all the queries, as many as fill `min_seconds`: one pass of the fast
    cases lasts a few milliseconds, and a single pass was at the scheduler's mercy), and the first pass's
    answers."""
    fn(queries[0])  # warm (mask cache, BLAS)
    out: list[Any] = []
    rates: list[float] = []
    spent = 0.0
    while not rates or spent < min_seconds:
        t0 = time.perf_counter()
        found = [fn(q) for q in queries]
        elapsed = time.perf_counter() - t0
        out = out or found
        rates.append(len(queries) / elapsed)
        spent += elapsed
    width = max(len(r) for r in out)
    found = np.full((len(out), width), -1, dtype=np.int64)
    for i, r in enumerate(out):
        found[i, : len(r)] = r
    return float(np.median(rates)), found


def varied_filters(points: pa.Table, fraction: float, count: int, rng: np.random.Generator,
                   ) -> list[tuple[dict[str, Any], np.ndarray]]:
    """`count` filters, each matching about `fraction` of the rows at a random place: an `installed_size_kb`
    range (even ones), or `section` "libs" and a size range within it (odd ones, below 10 %), as a user's
    per-request filters are; with the rows each matches."""
    size = points["installed_size_kb"].to_numpy(zero_copy_only=False)
    section = points["section"].to_numpy(zero_copy_only=False)
    n = len(size)
    libs = section == "libs"
    in_libs = np.sort(size[libs])
    everywhere = np.sort(size)
    out: list[tuple[dict[str, Any], np.ndarray]] = []
    for i in range(count):
        with_section = i % 2 == 1 and fraction < 0.1
        pool = in_libs if with_section else everywhere
        width = min(len(pool) - 1, max(1, int(round(fraction * n))))
        start = int(rng.integers(0, len(pool) - width))
        lo, hi = int(pool[start]), int(pool[start + width])
        rng_filter: dict[str, Any] = {"installed_size_kb": {"$gte": lo, "$lt": max(hi, lo + 1)}}
        mask = (size >= lo) & (size < max(hi, lo + 1))
        if with_section:
            out.append(({"section": "libs", **rng_filter}, mask & libs))
        else:
            out.append((rng_filter, mask))
    return out


def vary(searcher: Any, index: str, graph: Any, unit: np.ndarray, queries: np.ndarray, points: pa.Table,
         passes: int, options: dict[str, Any], as_filter: Callable[[dict[str, Any]], Any]) -> None:
    """Every query with a filter of its own, drawn afresh for every pass, so no cache of a filter's rows can
    help: Shoal evaluates each filter over the segment's columns, and so do the references (numpy over the
    attribute columns, then a product over the matching rows it gathers; hnswlib's filter function over the
    mask). QPS is the median over `passes` passes; recall is the first pass's."""
    size = points["installed_size_kb"].to_numpy(zero_copy_only=False)
    section = points["section"].to_numpy(zero_copy_only=False)
    codes = {s: i for i, s in enumerate(sorted(set(section.tolist())))}
    section_code = np.array([codes[s] for s in section.tolist()], dtype=np.int32)
    libs_code = codes["libs"]
    ef = max(HNSW_PARAMS["ef_search"], K)
    rng = np.random.default_rng(15)
    print(f"\nvaried filters: every query its own filter, new ones every pass ({passes} passes, median QPS)")
    header = (f"{'selectivity':>11} {'rows':>6} | {'recall ours':>11} {'hnswlib-f':>9} {'numpy':>6} | "
              f"{'QPS ours':>9} {'hnswlib-f':>9} {'numpy':>9} | {'ours/best':>9}")
    print(header)
    print("-" * len(header))
    for label, fraction in (("~50 %", 0.5), ("~10 %", 0.1), ("~1 %", 0.01), ("~0.1 %", 0.001)):
        rounds = [varied_filters(points, fraction, len(queries), rng) for _ in range(passes)]

        def ours(q: np.ndarray, flt: dict[str, Any]) -> list[int]:
            hits = searcher.search(index, "1", q[None, :], K, filters=as_filter(flt), **options)[0]
            return [h.attributes["id"] for h in hits]

        def raw(q: np.ndarray, flt: dict[str, Any]) -> list[int]:
            mask = _numpy_mask(flt, size, section_code, libs_code)
            graph.set_ef(ef)
            try:
                labels, _ = graph.knn_query(q[None, :], K, 1, mask.tobytes().__getitem__)
            except RuntimeError:
                return []
            return labels[0].astype(np.int64).tolist()

        def exact(q: np.ndarray, flt: dict[str, Any]) -> list[int]:
            rows = np.flatnonzero(_numpy_mask(flt, size, section_code, libs_code))
            scores = unit[rows] @ q
            top = np.argpartition(-scores, K)[:K] if len(scores) > K else np.arange(len(scores))
            return rows[top[np.argsort(-scores[top])]].tolist()

        # Each first-pass query's exact top 10 over its own matching rows, -2 where it matches fewer than 10.
        truth = np.full((len(queries), K), -2, dtype=np.int64)
        for i, (q, (_, m)) in enumerate(zip(queries, rounds[0], strict=True)):
            top = exact_truth(unit, q[None, :], np.flatnonzero(m))[0]
            truth[i, : len(top)] = top
        results = []
        for fn in (ours, raw, exact):
            rates, first = [], None
            for filters in rounds:
                t0 = time.perf_counter()
                found = [fn(q, f) for q, (f, _) in zip(queries, filters, strict=True)]
                rates.append(len(queries) / (time.perf_counter() - t0))
                first = first or found
            assert first is not None
            out = np.full((len(first), K), -1, dtype=np.int64)
            for i, r in enumerate(first):
                out[i, : len(r)] = r[:K]
            results.append((float(np.median(rates)), recall(out, truth)))
        rows = int(np.median([m.sum() for _, m in rounds[0]]))
        best = max(results[1][0], results[2][0])
        print(f"{label:>11} {rows:>6} | {results[0][1]:>11.4f} {results[1][1]:>9.4f} {results[2][1]:>6.4f} | "
              f"{results[0][0]:>9,.0f} {results[1][0]:>9,.0f} {results[2][0]:>9,.0f} | {results[0][0] / best:>8.2f}x")


def _numpy_mask(flt: dict[str, Any], size: np.ndarray, section_code: np.ndarray, libs_code: int) -> np.ndarray:
    """The rows a varied filter matches, as numpy finds them over the attribute columns."""
    bounds = flt["installed_size_kb"]
    mask = (size >= bounds["$gte"]) & (size < bounds["$lt"])
    if "section" in flt:
        mask &= section_code == libs_code
    return mask


def sweep(searcher: Any, index: str, unit: np.ndarray, queries: np.ndarray, points: pa.Table,
          options: dict[str, Any], as_filter: Callable[[dict[str, Any]], Any]) -> None:
    """Per selectivity (installed_size_kb below a quantile): QPS and recall of Shoal's filtered search forced
    to the exact scan of the matching rows, and forced to the index's own filtered search."""
    size = points["installed_size_kb"].to_numpy(zero_copy_only=False)
    print("\nsweep: exact scan of the matching rows vs the index's filtered search (forced)")
    print(f"{'fraction':>8} {'rows':>6} | {'QPS exact':>9} {'recall':>6} | {'QPS index':>9} {'recall':>6}")
    saved = execute_module.FILTER_EXACT_MAX_ROWS_X_FRACTION
    try:
        for fraction in (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5):
            cut = int(np.quantile(size, fraction))
            rows = np.flatnonzero(size < cut)
            if not len(rows):
                continue
            truth = exact_truth(unit, queries, rows)
            flt = {"installed_size_kb": {"$lt": cut}}

            def ours(q: np.ndarray, flt: dict[str, Any] = flt) -> list[int]:
                hits = searcher.search(index, "1", q[None, :], K, filters=as_filter(flt), **options)[0]
                return [h.attributes["id"] for h in hits]

            out = []
            for limit in (1 << 40, 0):
                execute_module.FILTER_EXACT_MAX_ROWS_X_FRACTION = limit
                qps, found = timed(ours, queries)
                out.append(f"{qps:>9,.0f} {recall(found, truth):>6.3f}")
            print(f"{len(rows) / len(size):>8.2%} {len(rows):>6} | {out[0]} | {out[1]}")
    finally:
        execute_module.FILTER_EXACT_MAX_ROWS_X_FRACTION = saved


def _metadata_columns(points: pa.Table) -> pa.Table:
    """`id`, and the other attributes as the JSON text of a `metadata` attribute, as the dataset API keeps them."""
    rows = points.select(["section", "installed_size_kb"]).to_pylist()
    return pa.table({"id": points["id"], "metadata": pa.array([json.dumps(r) for r in rows], pa.string())})


def _attribute_filter(flt: dict[str, Any]) -> dict[str, Any]:
    return flt


def _metadata_filter(flt: dict[str, Any]) -> Any:
    """The same filter over the fields of the `metadata` attribute, parsed as the dataset API parses a request's."""
    return parse_filter(flt, {"id": AttributeType.INT64, "metadata": AttributeType.STRING},
                        json_attribute="metadata")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--sweep", action="store_true",
                        help="also time the exact scan against the index's filtered search at more selectivities "
                             "(where FILTER_EXACT_MAX_ROWS_X_FRACTION comes from)")
    parser.add_argument("--vary", action="store_true",
                        help="also time queries that each carry a filter of their own (nothing cached helps)")
    parser.add_argument("--passes", type=int, default=3, help="passes of --vary, each with new filters")
    parser.add_argument("--young", type=int, default=0,
                        help="upload the last N points after the build, and search at least up to them: they are "
                             "answered from the young tier (hnswlib's reference then holds only the built points)")
    parser.add_argument("--metadata", action="store_true",
                        help="keep section and installed_size_kb as fields of a JSON `metadata` attribute, as the "
                             "dataset API does, and filter on those fields (parsed per search, as a request is)")
    args = parser.parse_args(argv)
    require_data(DATA_DIR, "base_f16.npy", "queries_f16.npy", "points.parquet")
    with Lifecycle() as life:
        base, queries, points = load(args.queries)
        n = len(base)
        unit = base / np.linalg.norm(base, axis=1, keepdims=True)
        tmp = life.temp_dir("shoal-filters-bench-")
        life.stop_servers(tmp)  # the embedded Postgres and Valkey the Shoal starts in the temp dir
        with life.starting(tmp):
            shoal = Shoal(Settings(data_dir=tmp), notify=False)
        life.cleanup("Shoal connections", shoal.close)
        tag = str(int(time.time()))
        attributes = ({"id": "int64", "metadata": "string"} if args.metadata
                      else {"id": "int64", "section": "string", "installed_size_kb": "int64"})
        source = DataSourceSpec(f"fbench-{tag}", "1", 384, attributes, ["id"])
        columns = _metadata_columns(points) if args.metadata else points
        as_filter = _metadata_filter if args.metadata else _attribute_filter
        shoal.create_data_source(source)
        index = shoal.create_index(IndexSpec(f"fbench-{tag}", "1", source.name, "1", algorithm="hnsw",
                                             metric="cosine", params=HNSW_PARAMS, id_attributes=["id"]))
        producer = shoal.producer(source.name, "1")
        t0 = time.perf_counter()
        built = n - args.young
        for s in range(0, built, 10_000):
            e = min(s + 10_000, built)
            part = columns.slice(s, e - s)
            producer.upload_columns(base[s:e], {c: part[c].combine_chunks() for c in part.column_names})
        ShardBuilder(shoal.engine, shoal.storage).materialize(index.shards[0].id)
        token = 0
        for s in range(built, n, 500):  # as a producer's batches arrive, after the build
            part = columns.slice(s, min(500, n - s))
            token = producer.upload_columns(base[s : s + 500],
                                            {c: part[c].combine_chunks() for c in part.column_names}).seq
        print(f"{n:,} points x 384, HNSW {HNSW_PARAMS}, {built:,} built in {time.perf_counter() - t0:.1f}s"
              f"{f', {args.young:,} in the young tier (searched at least up to them)' if args.young else ''}; "
              f"{len(queries)} queries, one per call; exact scan where matching rows x fraction <= "
              f"{execute_module.FILTER_EXACT_MAX_ROWS_X_FRACTION:,}")
        searcher = shoal.searcher(follow=False)
        # The young tier answers a search that must reach its points; one that need not would skip it.
        options: dict[str, Any] = {"consistency": Consistency.at_least(token)} if args.young else {}
        # The raw reference is a plain hnswlib index of its own (same M, ef_construction and seed as Shoal's),
        # labelled by row: Shoal's graph holds each distinct vector once, so its labels are not rows.
        raw_seconds, graph = raw_build(base[:built], available_cores())
        print(f"raw hnswlib reference: {built:,} points built in {raw_seconds:.1f}s")
        ef = max(HNSW_PARAMS["ef_search"], K)
        header = (f"{'selectivity':>11} {'rows':>6} | {'recall ours':>11} {'hnswlib-f':>9} {'numpy':>6} | "
                  f"{'QPS ours':>9} {'hnswlib-f':>9} {'numpy':>9} | {'ours/best':>9}")
        print(header)
        print("-" * len(header))
        for label, flt, mask in filters_for(points):
            rows = np.flatnonzero(mask)
            truth = exact_truth(unit, queries, rows)

            def ours(q: np.ndarray, flt: dict[str, Any] = flt) -> list[int]:
                hits = searcher.search(index.spec.name, "1", q[None, :], K, filters=as_filter(flt), **options)[0]
                return [h.attributes["id"] for h in hits]

            test = mask.tobytes().__getitem__

            def raw(q: np.ndarray, test: Any = test) -> list[int]:
                graph.set_ef(ef)
                try:
                    labels, _ = graph.knn_query(q[None, :], K, 1, test)
                except RuntimeError:
                    return []
                return labels[0].astype(np.int64).tolist()

            sub = unit[rows]

            def exact(q: np.ndarray, sub: np.ndarray = sub, rows: np.ndarray = rows) -> list[int]:
                scores = sub @ q
                top = np.argpartition(-scores, K)[:K] if len(scores) > K else np.arange(len(scores))
                return rows[top[np.argsort(-scores[top])]].tolist()

            qps_o, found_o = timed(ours, queries)
            qps_h, found_h = timed(raw, queries)
            qps_n, found_n = timed(exact, queries)
            best = max(qps_h, qps_n)
            print(f"{label:>11} {len(rows):>6} | {recall(found_o, truth):>11.4f} {recall(found_h, truth):>9.4f} "
                  f"{recall(found_n, truth):>6.4f} | {qps_o:>9,.0f} {qps_h:>9,.0f} {qps_n:>9,.0f} | "
                  f"{qps_o / best:>8.2f}x")
        if args.vary:
            vary(searcher, index.spec.name, graph, unit, queries, points, args.passes, options, as_filter)
        if args.sweep:
            sweep(searcher, index.spec.name, unit, queries, points, options, as_filter)
        searcher.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
