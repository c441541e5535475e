"""Log tails extended chunk by chunk (shoal.searcher.tails) equal the tail derived from all their entries at once:
the same keys touched, the same live upserts, the same segment rows hidden. A Hypothesis property over random
sequences of upserts and deletions of a few keys, cut into random extensions (the searcher's young tier extends
its tails as commits arrive; strong and at_least searches rely on them being exact)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.index.segment import LoadedSegment
from shoal.log.validation import DELETE, KEY, OP, SEQ, UPSERT
from shoal.searcher.tails import Tail

KEYS = [f"k{i}" for i in range(12)]
ENTRY = st.tuples(st.sampled_from(KEYS), st.booleans())  # (key, is an upsert)


def _entries(ops: list[tuple[str, bool]], first_seq: int) -> pa.Table:
    return pa.table({
        KEY: pa.array([k for k, _ in ops], pa.string()),
        SEQ: pa.array(range(first_seq, first_seq + len(ops)), pa.int64()),
        OP: pa.array([UPSERT if up else DELETE for _, up in ops], pa.string()),
        "payload": pa.array([f"{k}@{first_seq + i}" for i, (k, _) in enumerate(ops)], pa.string()),
    })


def _segment(keys: list[str], name: str) -> LoadedSegment:
    rows = pa.table({KEY: pa.array(keys, pa.string()), SEQ: pa.array(range(len(keys)), pa.int64())})
    return LoadedSegment(name, rows, rows[KEY].to_numpy(zero_copy_only=False), rows[SEQ].to_numpy(), ())


def _live(tail: Tail) -> list[tuple[str, str]]:
    table = tail.upserts
    return sorted(zip(table[KEY].to_pylist(), table["payload"].to_pylist(), strict=True))


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(ENTRY, min_size=1, max_size=60), cuts=st.lists(st.integers(1, 59), max_size=8),
       seg_keys=st.lists(st.sampled_from(KEYS), unique=True, max_size=12), warm_at=st.sets(st.integers(0, 8)))
def test_a_tail_extended_piece_by_piece_equals_the_tail_of_all_entries(
    ops: list[tuple[str, bool]], cuts: list[int], seg_keys: list[str], warm_at: set[int]
) -> None:
    segment = _segment(seg_keys, "s")
    bounds = sorted({c for c in cuts if c < len(ops)} | {0, len(ops)})
    tail = None
    for step, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        piece = _entries(ops[lo:hi], 1 + lo)
        tail = Tail.of(piece) if tail is None else tail.extended(piece)
        if step in warm_at:
            tail.hidden_rows(segment)  # masks derived midway are carried into the next extension
    assert tail is not None
    whole = Tail.of(_entries(ops, 1))
    assert tail.touched == whole.touched
    assert _live(tail) == _live(whole)
    keys = [k for k, _ in _live(tail)]
    assert len(keys) == len(set(keys))  # chunks hold disjoint keys
    got, want = tail.hidden_rows(segment), whole.hidden_rows(segment)
    expected = np.array([k in whole.touched for k in seg_keys], dtype=bool)
    assert np.array_equal(np.zeros(len(seg_keys), bool) if got is None else got, expected)
    assert np.array_equal(np.zeros(len(seg_keys), bool) if want is None else want, expected)
    assert len(tail.chunks) <= 2 + int(np.log2(max(1, len(keys)))) * 2  # merged as they grow


def test_a_long_stream_of_new_keys_keeps_few_chunks_and_reuses_them() -> None:
    tail = Tail.of(_entries([("a0", True)], 1))
    seq = 2
    for i in range(1, 200):
        tail = tail.extended(_entries([(f"a{i}-{j}", True) for j in range(50)], seq))
        seq += 50
    assert len(tail.upserts) == 1 + 199 * 50
    assert len(tail.chunks) <= 10, [c.upserts.num_rows for c in tail.chunks]


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(ENTRY, min_size=1, max_size=60), cuts=st.lists(st.integers(1, 59), max_size=6),
       mark=st.integers(0, 60), old_keys=st.lists(st.sampled_from(KEYS), unique=True, max_size=12),
       new_keys=st.lists(st.sampled_from(KEYS), unique=True, max_size=12), warm=st.booleans())
def test_a_tail_cut_at_a_new_watermark_equals_the_tail_of_the_entries_above_it(
    ops: list[tuple[str, bool]], cuts: list[int], mark: int, old_keys: list[str], new_keys: list[str],
    warm: bool,
) -> None:
    """A shard's new version reflects the entries up to `mark`: the tail cut there touches the same keys and
    holds the same live upserts as the tail of the entries above it. A segment the old version already had
    keeps its hidden rows (a superset: the rest are rows of keys rewritten up to the mark, which the new version
    deletes); a segment new in this version hides exactly what the remaining entries touch."""
    bounds = sorted({c for c in cuts if c < len(ops)} | {0, len(ops)})
    tail = None
    for lo, hi in zip(bounds, bounds[1:], strict=False):  # built in pieces, as the follower does: many chunks
        piece = _entries(ops[lo:hi], 1 + lo)
        tail = Tail.of(piece) if tail is None else tail.extended(piece)
    assert tail is not None
    kept = _segment(old_keys, "old")
    if warm:
        tail.hidden_rows(kept)
    entries = _entries(ops, 1)
    above = entries.filter(pc.greater(entries[SEQ], mark))
    cut = tail.cut(mark, above)
    whole = Tail.of(above) if above.num_rows else None
    assert cut.touched == (whole.touched if whole else frozenset())
    assert _live(cut) == (_live(whole) if whole else [])
    new = _segment(new_keys, "new")
    hidden = cut.hidden_rows(new)
    expected = np.array([k in cut.touched for k in new_keys], dtype=bool)
    assert np.array_equal(np.zeros(len(new_keys), bool) if hidden is None else hidden, expected)
    old_hidden = cut.hidden_rows(kept)
    got = np.zeros(len(old_keys), bool) if old_hidden is None else old_hidden
    at_least = np.array([k in cut.touched for k in old_keys], dtype=bool)
    assert not (at_least & ~got).any(), "a key the remaining entries touch is not hidden"
    rewritten = {k for k, _ in ops[:mark]} | set(tail.touched)
    assert all(k in rewritten for k, h in zip(old_keys, got, strict=True) if h)
