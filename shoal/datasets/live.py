"""How many live vectors a dataset holds: its log folded by id (the last write per id, minus deletions).

The count reads only the log's key and operation columns (through the checked reader), O(log entries); it is
remembered per process by the log's shape (segments, head, entry counts), which any commit or compaction
changes, so a dataset listed again without a write in between costs no read.

The live ids a quota check needs are remembered per process too (`live_and_new`), and brought up to date by
reading only the segments committed since: a dataset's upload then reads its new entries, not its whole log.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from sqlalchemy import Engine

from shoal.catalog.repo import SegmentRecord, list_segments
from shoal.datasets.catalog import LogTotals
from shoal.log.reader import read_log
from shoal.log.segment_file import read_segment
from shoal.log.validation import KEY, OP, SEQ_OFFSET, UPSERT
from shoal.storage import Storage

MEMO_SIZE = 4096  # datasets whose count a process remembers
# Live ids a process remembers, summed over datasets (least recently used dropped first). Bounded by ids, not
# datasets: a set costs roughly 100 bytes per short id (more for long ones), so this is some 100 MB at most; a
# dataset holding more is read in full on each check, as before.
IDS_MEMO_SIZE = 1_000_000

_memo: OrderedDict[tuple[int, int, int, int, int], int] = OrderedDict()
_lock = threading.Lock()


def live_count(engine: Engine, storage: Storage, source_id: int, totals: LogTotals) -> int:
    """The number of live vectors of the data source whose log has these totals (0 for an empty log)."""
    if totals.segments == 0:
        return 0
    key = (source_id, totals.segments, totals.head, totals.upserts, totals.tombstones)
    with _lock:
        if key in _memo:
            _memo.move_to_end(key)
            return _memo[key]
    # The last op per key decides: walking seq order, a later entry overwrites an earlier one.
    last: dict[object, bool] = {}
    for batch in read_log(engine, storage, source_id, 0, totals.head, columns=[KEY, OP]):
        keys = batch.column(KEY).to_pylist()
        ups = pc.equal(batch.column(OP), UPSERT).to_pylist()
        last.update(zip(keys, ups, strict=True))
    count = sum(1 for alive in last.values() if alive)
    with _lock:
        _memo[key] = count
        while len(_memo) > MEMO_SIZE:
            _memo.popitem(last=False)
    return count


def live_ids(engine: Engine, storage: Storage, source_id: int, up_to: int) -> set[str]:
    """The ids of the data source's live vectors at seq `up_to` (a dataset's log folded by its `id`)."""
    last: dict[str, bool] = {}
    for batch in read_log(engine, storage, source_id, 0, up_to, columns=[OP, "id"]):
        ids = batch.column("id").to_pylist()
        ups = pc.equal(batch.column(OP), UPSERT).to_pylist()
        last.update(zip(ids, ups, strict=True))
    return {i for i, alive in last.items() if alive}


@dataclass
class _LiveIds:
    """The live ids of a data source's log as it was when its segments summed to `totals`."""

    totals: LogTotals
    ids: set[str]


_ids_memo: OrderedDict[int, _LiveIds] = OrderedDict()  # by source id, least recently used first
_ids_held = 0  # ids in _ids_memo, kept under IDS_MEMO_SIZE


def live_and_new(
    engine: Engine, storage: Storage, source_id: int, totals: LogTotals, ids: Iterable[str]
) -> tuple[int, int]:
    """(how many vectors are live, how many of `ids` are not among them) in the data source's log with these
    totals, exact; read from the segments committed since the state this process remembers, else in full."""
    if totals.segments == 0:
        return 0, len(set(ids))
    # Taken out of the memo while it is used: no other thread sees a set this one is changing (one that wants
    # it meanwhile reads in full; quota checks of one dataset are serialized anyway).
    state = _take(source_id)
    if state is None or not _extend(engine, storage, source_id, state, totals):
        state = _read_in_full(engine, storage, source_id, totals)
    answer = len(state.ids), len(set(ids) - state.ids)
    if state.totals == totals:  # a state of another moment than `totals` is not one to extend later
        _keep(source_id, state)
    return answer


def _take(source_id: int) -> _LiveIds | None:
    global _ids_held
    with _lock:
        state = _ids_memo.pop(source_id, None)
        if state is not None:
            _ids_held -= len(state.ids)
        return state


def _keep(source_id: int, state: _LiveIds) -> None:
    global _ids_held
    if len(state.ids) > IDS_MEMO_SIZE:
        return
    with _lock:
        old = _ids_memo.pop(source_id, None)
        if old is not None:  # put back by another thread meanwhile: keep the newer
            if old.totals.head > state.totals.head:
                state = old
            _ids_held -= len(old.ids)
        _ids_memo[source_id] = state
        _ids_held += len(state.ids)
        while _ids_held > IDS_MEMO_SIZE:
            _, dropped = _ids_memo.popitem(last=False)
            _ids_held -= len(dropped.ids)


def _sums(segments: list[SegmentRecord], head: int) -> LogTotals:
    """The totals these segments add (head: `head`)."""
    return LogTotals(
        segments=len(segments),
        upserts=sum(s.upsert_count for s in segments),
        tombstones=sum(s.tombstone_count for s in segments),
        head=head,
    )


def _plus(a: LogTotals, b: LogTotals) -> tuple[int, int, int, int]:
    """(segments, upserts, tombstones, head) of `a` followed by `b` (bytes are not compared)."""
    return a.segments + b.segments, a.upserts + b.upserts, a.tombstones + b.tombstones, b.head


def _shape(t: LogTotals) -> tuple[int, int, int, int]:
    return t.segments, t.upserts, t.tombstones, t.head


def _extend(engine: Engine, storage: Storage, source_id: int, state: _LiveIds, totals: LogTotals) -> bool:
    """Bring `state` up to `totals` by the segments committed after its head; False (state untouched) unless
    the log is exactly the remembered one plus those: a compaction or retention rewriting what was read (fewer
    entries or segments than the sum), or a segment straddling the remembered head, forces a full read."""
    old = state.totals
    if _shape(old) == _shape(totals):
        state.totals = totals
        return True
    if totals.head < old.head:
        return False
    new = list_segments(engine, source_id, old.head, totals.head)
    if any(s.first_seq <= old.head or s.last_seq > totals.head for s in new):
        return False
    if _plus(old, _sums(new, totals.head)) != _shape(totals):
        return False
    for seg in new:
        _fold_into(state.ids, read_segment(storage, seg.path, seg.checksum, [OP, "id"]))
    state.totals = totals
    return True


def _read_in_full(engine: Engine, storage: Storage, source_id: int, totals: LogTotals) -> _LiveIds:
    """The live ids at `totals.head`, read from every segment; its totals are `totals` only when the segments
    read sum to them (a compaction or retention between the two reads: not to be extended later)."""
    segments = list_segments(engine, source_id, 0, totals.head)
    ids: set[str] = set()
    for seg in segments:
        table = read_segment(storage, seg.path, seg.checksum, [OP, "id", SEQ_OFFSET])
        if seg.last_seq > totals.head:  # a segment compacted across the head since: only what was committed by it
            table = table.filter(pc.less_equal(table[SEQ_OFFSET], totals.head - seg.first_seq))
        _fold_into(ids, table)
    exact = _shape(_sums(segments, totals.head)) == _shape(totals) and all(s.last_seq <= totals.head
                                                                           for s in segments)
    return _LiveIds(totals if exact else LogTotals(head=-1), ids)


def _fold_into(ids: set[str], table: pa.Table) -> None:
    """Apply the entries of `table` (seq order) to `ids`: an upsert makes its id live, a tombstone not."""
    for vid, up in zip(table["id"].to_pylist(), pc.equal(table[OP], UPSERT).to_pylist(), strict=True):
        if up:
            ids.add(vid)
        else:
            ids.discard(vid)
