"""How many live vectors a dataset holds: its log folded by id (the last write per id, minus deletions).

The count reads only the log's key and operation columns (through the checked reader), O(log entries); it is
remembered per process by the log's shape (segments, head, entry counts), which any commit or compaction
changes, so a dataset listed again without a write in between costs no read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import pyarrow.compute as pc
from sqlalchemy import Engine

from shoal.datasets.catalog import LogTotals
from shoal.log.reader import read_log
from shoal.log.validation import KEY, OP, UPSERT
from shoal.storage import Storage

MEMO_SIZE = 4096  # datasets whose count a process remembers

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
