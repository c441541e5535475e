"""What a merge policy costs, simulated with Shoal's own `merge_policy.pick`: one shard takes a build of
--unit rows at a time on top of a --base-row segment, every due merge runs at once, and each merge writes its
whole output (rows file and graph). Run by hand, in a second:

    .venv/bin/python bench/merge_policy.py
    .venv/bin/python bench/merge_policy.py --builds 240 --unit 940 --base 15000

Prints, per (max segments, min merge): rows written per row ingested (builds plus merges), rows inserted into an
existing graph per row ingested (an HNSW merge extends its largest segment by the others' rows), merges, and the
mean and largest number of segments a search has to visit. The reference is min merge 2: just enough segments
to meet the bound, as Shoal merged before session 13.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from shoal.index.manifest import SegmentEntry
from shoal.index.merge_policy import MergePolicy, pick


@dataclass
class Outcome:
    written: float
    inserted: float
    merges: int
    mean_segments: float
    peak_segments: int


def simulate(policy: MergePolicy, builds: int, unit: int, base: int) -> Outcome:
    """One shard under steady ingest, merges applied as soon as they are due."""
    sizes = [base]
    written = inserted = merges = seen = peak = 0
    for _ in range(builds):
        sizes.append(unit)
        written += unit
        while True:
            entries = [SegmentEntry(f"s{i}", "", rows, 0, 0, "", ()) for i, rows in enumerate(sizes)]
            chosen = pick(policy, entries, busy=True)
            if not chosen:
                break
            picked = [sizes[i] for i in chosen]
            sizes = [s for i, s in enumerate(sizes) if i not in chosen] + [sum(picked)]
            written += sum(picked)
            inserted += sum(picked) - max(picked)
            merges += 1
        seen += len(sizes)
        peak = max(peak, len(sizes))
    ingested = builds * unit
    return Outcome(written / ingested, inserted / ingested, merges, seen / builds, peak)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--builds", type=int, default=60, help="builds per shard (default: 60)")
    parser.add_argument("--unit", type=int, default=1250, help="rows per build (default: 1,250)")
    parser.add_argument("--base", type=int, default=15_000, help="rows of the preloaded segment (default: 15,000)")
    args = parser.parse_args(argv)
    print(f"{args.builds} builds of {args.unit:,} rows onto {args.base:,}")
    print(f"{'max seg':>7} {'min merge':>9} | {'written/row':>11} {'inserted/row':>12} {'merges':>6} "
          f"{'mean seg':>8} {'peak':>4} | {'written vs min 2':>16}")
    for max_segments in (4, 6, 8, 10):
        ref = simulate(MergePolicy(max_segments, min_merge=2), args.builds, args.unit, args.base)
        for min_merge in (2, 3, 4):
            o = simulate(MergePolicy(max_segments, min_merge=min_merge), args.builds, args.unit, args.base)
            print(f"{max_segments:>7} {min_merge:>9} | {o.written:>11.2f} {o.inserted:>12.2f} {o.merges:>6} "
                  f"{o.mean_segments:>8.2f} {o.peak_segments:>4} | {o.written / ref.written:>15.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
