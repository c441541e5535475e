"""Log compaction, retention and GC against the real catalog and storage (local and S3).

Compaction is invisible (the folded state and every index answer the same), stays below the lowest
watermark, merges small segments; retention expires old points with tombstones; GC never deletes a
referenced file and waits for the grace period; SIGKILL during compaction and GC loses nothing.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import select
import signal
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from conftest import run_helper, start_worker, stop_process, wait_for
from helpers.compaction_checks import (
    COMPACT_SPEC,
    DIM,
    assert_log_intact,
    committed_batches,
    comparable_fold,
    folded_state,
    init_batch,
    mix_batch,
    replay,
)
from helpers.compaction_windows import TARGETS, LogWindow, freeze_child_inside

from shoal import DataPoint, DataSourceSpec, Shoal, Tombstone
from shoal.config.settings import Settings
from shoal.engines.metrics import Metric, exact_top_k
from shoal.errors import ConflictError
from shoal.index.builder import LeaseBusyError, ShardBuilder
from shoal.log import retention
from shoal.log.compaction_swap import compaction_states
from shoal.log.records import IndexSpec
from shoal.log.validation import columns_to_table
from shoal.searcher.consistency import Consistency
from shoal.upkeep import gc_queue as garbage

NAME, VERSION = COMPACT_SPEC.name, COMPACT_SPEC.version


def flat_index(shoal: Shoal, name: str, shard_count: int = 1) -> IndexSpec:
    spec = IndexSpec(name, "1", NAME, VERSION, algorithm="flat", metric="euclidean", id_attributes=["id"],
                     shard_count=shard_count)
    shoal.create_index(spec)
    return spec


def build(shoal: Shoal, index: str) -> None:
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for shard in shoal.get_index(index, "1").shards:
        builder.materialize(shard.id)


def search_all(shoal: Shoal, index: str, queries: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    searcher = shoal.searcher(follow=False)
    try:
        hits = searcher.search(index, "1", queries, k)
    finally:
        searcher.close()
    return [[(h.attributes["id"], float(h.distance)) for h in row] for row in hits]


def brute_force(shoal: Shoal, queries: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    state = shoal.fold(NAME, VERSION)
    vectors = np.asarray(state["__vector"].to_pylist(), dtype=np.float32).reshape(-1, DIM)
    ids = state["id"].to_pylist()
    dist, labels = exact_top_k(Metric("euclidean"), queries, vectors, k)
    return [[(ids[j], float(d)) for d, j in zip(drow, lrow, strict=True) if j >= 0] for drow, lrow in zip(
        dist, labels, strict=True)]


def same_answers(a: list[list[tuple[int, float]]], b: list[list[tuple[int, float]]]) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b, strict=True):
        assert [i for i, _ in ra] == [i for i, _ in rb]
        np.testing.assert_allclose([d for _, d in ra], [d for _, d in rb], rtol=1e-5, atol=1e-6)


def churn(shoal: Shoal, keys: int, rng: random.Random, prefix: str) -> None:
    """`keys` inserts, then as many updates and deletes (half each) of random keys, in batches of 50."""
    producer = shoal.producer(NAME, VERSION)
    for start in range(0, keys, 50):
        producer.upload(init_batch(f"{prefix}-init-{start}", range(start, min(start + 50, keys))),
                        batch_id=f"{prefix}-init-{start}")
    for b in range(keys // 50):
        items: list[DataPoint | Tombstone] = []
        for pos in range(50):
            k = rng.randrange(keys)
            if pos % 2:
                items.append(Tombstone({"id": k}))
            else:
                v = [rng.uniform(-1, 1) for _ in range(DIM)]
                items.append(DataPoint({"id": k, "text": f"{prefix}-upd-{b}-{pos}"}, v))
        producer.upload(items, batch_id=f"{prefix}-mix-{b}")


# -- compaction is invisible ----------------------------------------------------------------------------


def test_compaction_is_invisible(make_shoal: Callable[..., Shoal], storage_kind: str) -> None:
    shoal = make_shoal(storage_kind, tombstone_retention_s=0, gc_grace_s=0, compaction_target_bytes=24_000)
    shoal.create_data_source(COMPACT_SPEC)
    churn(shoal, 600, random.Random(7), "w")
    flat_index(shoal, "full")
    build(shoal, "full")  # built from the full log, at the head

    before = assert_log_intact(shoal, NAME, VERSION)
    state_before = comparable_fold(shoal, NAME, VERSION)
    live = state_before.num_rows
    assert before["entries"] == 1200 and 0 < live < 600

    result = shoal.compact(NAME, VERSION)
    assert result.changed and result.bound == before["head"]
    after = assert_log_intact(shoal, NAME, VERSION)
    # Every key keeps exactly its latest upsert: tombstones were older than the (zero) retention.
    assert after["entries"] == live and result.entries_dropped == 1200 - live
    assert result.tombstones_dropped > 0
    assert sum(s.tombstone_count for s in shoal.log_segments(NAME, VERSION)) == 0
    assert after["bytes"] < before["bytes"] * (live / 1200 + 0.25)
    assert result.segments_before == before["segments"] and result.segments_after == after["segments"]
    assert after["segments"] < before["segments"]
    # Merged toward the target: no two adjacent segments that would both fit in it.
    sizes = [s.bytes for s in shoal.log_segments(NAME, VERSION)]
    assert all(a + b > 24_000 or min(a, b) >= 12_000 for a, b in zip(sizes, sizes[1:], strict=False))
    assert comparable_fold(shoal, NAME, VERSION).equals(state_before)

    # An index rebuilt from the compacted log answers exactly as the one built from the full log.
    flat_index(shoal, "compacted")
    build(shoal, "compacted")
    queries = np.random.default_rng(3).uniform(-1, 1, (25, DIM)).astype(np.float32)
    full = search_all(shoal, "full", queries, 10)
    same_answers(full, search_all(shoal, "compacted", queries, 10))
    same_answers(full, brute_force(shoal, queries, 10))

    # Both catch up on more writes the same way, and a second compaction finds the new garbage only.
    churn(shoal, 100, random.Random(8), "x")
    build(shoal, "full")
    build(shoal, "compacted")
    full = search_all(shoal, "full", queries, 10)
    same_answers(full, search_all(shoal, "compacted", queries, 10))
    same_answers(full, brute_force(shoal, queries, 10))
    state = comparable_fold(shoal, NAME, VERSION)
    again = shoal.compact(NAME, VERSION)
    assert again.changed and comparable_fold(shoal, NAME, VERSION).equals(state)
    assert shoal.compact(NAME, VERSION).changed is False  # nothing left to rewrite

    # GC (grace 0) deletes exactly the replaced files; what the catalog references stays.
    replaced = garbage.pending(shoal.engine, tenant=shoal.tenant)
    gc = shoal.collect_garbage()
    assert gc.deleted == replaced and gc.pending == 0
    files = set(shoal.storage.list_files(shoal.log_dir(NAME, VERSION)))
    assert files == {s.path for s in shoal.log_segments(NAME, VERSION)}
    assert comparable_fold(shoal, NAME, VERSION).equals(state)


def test_compaction_never_touches_seqs_above_the_lowest_watermark(make_shoal: Callable[..., Shoal]) -> None:
    shoal = make_shoal(tombstone_retention_s=0)
    shoal.create_data_source(COMPACT_SPEC)
    flat_index(shoal, "idx", shard_count=2)
    assert shoal.compact(NAME, VERSION).bound == 0  # no commit yet

    churn(shoal, 200, random.Random(1), "a")
    # Shards never built (watermark 0): nothing may be touched.
    none = shoal.compact(NAME, VERSION)
    assert none.bound == 0 and not none.changed
    build(shoal, "idx")
    low = shoal.get_data_source(NAME, VERSION).head_seq
    churn(shoal, 100, random.Random(2), "b")  # above every watermark now
    head = shoal.get_data_source(NAME, VERSION).head_seq
    tail_before = pa.Table.from_batches(list(shoal.read_log(NAME, VERSION, after_seq=low)))
    at_low, at_head = comparable_fold(shoal, NAME, VERSION, low), comparable_fold(shoal, NAME, VERSION)

    result = shoal.compact(NAME, VERSION)
    assert result.changed and result.bound <= low
    tail_after = pa.Table.from_batches(list(shoal.read_log(NAME, VERSION, after_seq=low)))
    assert tail_after.drop_columns(["__seq_offset"]).equals(tail_before.drop_columns(["__seq_offset"]))
    assert len(tail_after) == head - low
    assert comparable_fold(shoal, NAME, VERSION, low).equals(at_low)
    assert comparable_fold(shoal, NAME, VERSION).equals(at_head)

    # A searcher serving an older version holds the bound down too (its tail scan starts there).
    shard = shoal.get_index("idx", "1").shards[0]
    searcher = shoal.searcher(follow=False)
    searcher.search("idx", "1", np.zeros((1, DIM), np.float32), 3)  # serves the built version: marks it served
    searcher.close()
    build(shoal, "idx")
    assert shoal.shards.shard_context(shard.id)[0].served_watermark == low
    assert shoal.compact(NAME, VERSION).bound <= low


def test_tombstones_stay_for_their_retention(make_shoal: Callable[..., Shoal]) -> None:
    shoal = make_shoal(tombstone_retention_s=3600, compaction_target_bytes=1 << 20)
    shoal.create_data_source(COMPACT_SPEC)
    producer = shoal.producer(NAME, VERSION)
    producer.upload(init_batch("i", range(10)))
    producer.upload([Tombstone({"id": k}) for k in range(5)])
    producer.upload([Tombstone({"id": 0})])  # a second tombstone of a key: the first one is superseded
    state = comparable_fold(shoal, NAME, VERSION)

    kept = shoal.compact(NAME, VERSION)  # superseded entries go; the latest tombstones are too young
    segs = shoal.log_segments(NAME, VERSION)
    assert kept.changed and kept.tombstones_dropped == 1 and sum(s.tombstone_count for s in segs) == 5
    assert sum(s.upsert_count for s in segs) == 5
    assert comparable_fold(shoal, NAME, VERSION).equals(state)

    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)
    gone = shoal.compact(NAME, VERSION, now=later)
    assert gone.changed and gone.tombstones_dropped == 5
    assert sum(s.tombstone_count for s in shoal.log_segments(NAME, VERSION)) == 0
    assert comparable_fold(shoal, NAME, VERSION).equals(state)
    assert_log_intact(shoal, NAME, VERSION)


def test_small_segments_merge_and_batch_ids_still_deduplicate(make_shoal: Callable[..., Shoal]) -> None:
    shoal = make_shoal(compaction_target_bytes=40_000)
    shoal.create_data_source(COMPACT_SPEC)
    producer = shoal.producer(NAME, VERSION)
    tokens = [producer.upload(init_batch(f"s{i}", range(i, i + 1)), batch_id=f"s{i}").seq for i in range(60)]
    state = comparable_fold(shoal, NAME, VERSION)
    result = shoal.compact(NAME, VERSION)
    assert result.changed and result.entries_dropped == 0 and result.segments_before == 60
    assert result.segments_after < 10
    assert all(s.bytes <= 40_000 for s in shoal.log_segments(NAME, VERSION))
    assert comparable_fold(shoal, NAME, VERSION).equals(state)
    # Producer batch ids moved with their entries: a repeated upload returns its token and writes nothing.
    head = shoal.get_data_source(NAME, VERSION).head_seq
    assert producer.upload(init_batch("s7", range(7, 8)), batch_id="s7").seq == tokens[7]
    assert shoal.get_data_source(NAME, VERSION).head_seq == head
    assert [b for b, _, _ in committed_batches(shoal, NAME, VERSION)] == [f"s{i}" for i in range(60)]


def test_overlapping_compactions_leave_one_consistent_log(make_shoal: Callable[..., Shoal]) -> None:
    import threading

    shoal = make_shoal(tombstone_retention_s=0, gc_grace_s=0, compaction_target_bytes=20_000)
    shoal.create_data_source(COMPACT_SPEC)
    churn(shoal, 300, random.Random(4), "o")
    state = comparable_fold(shoal, NAME, VERSION)
    results = []
    barrier = threading.Barrier(3)

    def run() -> None:
        barrier.wait()
        results.append(shoal.compact(NAME, VERSION))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 3 and any(r.changed for r in results)
    assert_log_intact(shoal, NAME, VERSION)
    assert comparable_fold(shoal, NAME, VERSION).equals(state)
    # The losers removed their own files; GC removes the replaced ones: only referenced files remain.
    shoal.collect_garbage()
    assert set(shoal.storage.list_files(shoal.log_dir(NAME, VERSION))) == {
        s.path for s in shoal.log_segments(NAME, VERSION)
    }


# -- retention ------------------------------------------------------------------------------------------


def _ingested_at(shoal: Shoal, name: str, version: str) -> dict[int, dt.datetime]:
    table = shoal.fold(name, version)
    return dict(zip(table["id"].to_pylist(), table["__ingested_at"].to_pylist(), strict=True))


@pytest.mark.parametrize("nested", [False, True], ids=["source-metadata", "dataset-metadata"])
def test_retention_expires_points_older_than_retention_days(make_shoal: Callable[..., Shoal], nested: bool) -> None:
    shoal = make_shoal()
    meta = {"shoal.dataset": {"metadata": {"retention_days": 2}}} if nested else {"retention_days": 2}
    spec = DataSourceSpec("Retained", "1", DIM, {"id": "int64", "text": "string"}, ["id"], custom_metadata=meta)
    shoal.catalog.create_data_source(spec)  # the dataset API's own path: Shoal.create_data_source refuses its key
    shoal.create_data_source(COMPACT_SPEC)  # no retention: never touched
    flat_index(shoal, "plain")
    producer = shoal.producer("Retained", "1")
    producer.upload(init_batch("old", range(20)))
    shoal.producer(NAME, VERSION).upload(init_batch("old", range(20)))
    old_at = max(_ingested_at(shoal, "Retained", "1").values())
    wait_for(lambda: dt.datetime.now(dt.UTC) > old_at + dt.timedelta(milliseconds=5), 5, "the clock to move on")
    producer.upload(init_batch("new", range(15, 30)))  # re-upserts 15..19: they are young again
    new_at = min(v for k, v in _ingested_at(shoal, "Retained", "1").items() if k >= 15)
    assert new_at > old_at

    # Simulated age: "now" is two days after a moment between the two uploads.
    now = old_at + (new_at - old_at) / 2 + dt.timedelta(days=2)
    result = shoal.apply_retention("Retained", "1", now=now)
    assert result.retention_days == 2 and result.expired == 15 and result.token is not None
    assert sorted(folded_state(shoal, "Retained", "1")) == list(range(15, 30))
    # The expiry is in the log (tombstones under a retention batch id) and idempotent.
    batches = [b for b in committed_batches(shoal, "Retained", "1") if b[0].startswith(retention.BATCH_PREFIX)]
    assert len(batches) == 1 and batches[0][2] == result.token
    assert shoal.apply_retention("Retained", "1", now=now).expired == 0
    assert shoal.apply_retention(NAME, VERSION, now=now).retention_days is None
    assert len(folded_state(shoal, NAME, VERSION)) == 20

    # Much later everything expires; indexes apply expiries like any delete.
    everything = shoal.apply_retention("Retained", "1", now=now + dt.timedelta(days=30))
    assert everything.expired == 15 and folded_state(shoal, "Retained", "1") == {}
    assert [r.id for r in retention.sources_with_retention(shoal.engine) if r.tenant == shoal.tenant] == [
        shoal.get_data_source("Retained", "1").id
    ]


@pytest.mark.parametrize("days", [10**30, 1e300, 800_000])
def test_a_retention_longer_than_the_calendar_expires_nothing(make_shoal: Callable[..., Shoal], days: float) -> None:
    # The dataset API takes retention_days as any non-negative integer: one reaching before year 1 failed every
    # run with OverflowError (a logged traceback per source and beat run), instead of keeping every point.
    shoal = make_shoal()
    spec = DataSourceSpec("Forever", "1", DIM, {"id": "int64", "text": "string"}, ["id"],
                          custom_metadata={"retention_days": days})
    shoal.create_data_source(spec)
    shoal.producer("Forever", "1").upload(init_batch("old", range(5)))
    result = shoal.apply_retention("Forever", "1")
    assert result.retention_days == float(days) and result.expired == 0 and result.token is None
    assert sorted(folded_state(shoal, "Forever", "1")) == list(range(5))


def test_retention_never_deletes_a_point_updated_after_its_decision(make_shoal: Callable[..., Shoal]) -> None:
    shoal = make_shoal()
    spec = DataSourceSpec("Retained", "1", DIM, {"id": "int64", "text": "string"}, ["id"],
                          custom_metadata={"retention_days": 1})
    shoal.create_data_source(spec)
    producer = shoal.producer("Retained", "1")
    producer.upload(init_batch("old", range(5)))
    record = shoal.get_data_source("Retained", "1")
    decided_at = record.head_seq
    producer.upload(init_batch("fresh", range(2, 3)))  # key 2 updated after the decision below
    tables = [columns_to_table(spec, None, {"id": [0, 1, 2, 3, 4]}, 100, delete=True)]
    # A commit of the stale decision is refused under the lock, and writes nothing.
    with pytest.raises(ConflictError) as refused:
        retention._commit(shoal.engine, shoal.storage, record, decided_at, tables, 1000, 1)
    assert refused.value.actual == shoal.get_data_source("Retained", "1").head_seq
    assert sorted(folded_state(shoal, "Retained", "1")) == [0, 1, 2, 3, 4]
    assert len(shoal.storage.list_files(shoal.log_dir("Retained", "1"))) == 2


# -- garbage collection -----------------------------------------------------------------------------------


def test_gc_waits_for_the_grace_period_and_never_deletes_a_referenced_file(
    make_shoal: Callable[..., Shoal], storage_kind: str
) -> None:
    shoal = make_shoal(storage_kind, tombstone_retention_s=0, gc_grace_s=3600)
    other = make_shoal(storage_kind, gc_grace_s=0)
    for client in (shoal, other):
        client.create_data_source(COMPACT_SPEC)
        churn(client, 100, random.Random(5), "g")
    state = comparable_fold(shoal, NAME, VERSION)
    old_paths = {s.path for s in shoal.log_segments(NAME, VERSION)}
    assert shoal.compact(NAME, VERSION).changed
    live_paths = {s.path for s in shoal.log_segments(NAME, VERSION)}
    replaced = old_paths - live_paths
    assert replaced and all(shoal.storage.exists(p) for p in replaced)

    # Within the grace period nothing goes.
    first = shoal.collect_garbage()
    assert first.deleted == 0 and first.pending == len(replaced)
    assert all(shoal.storage.exists(p) for p in replaced)

    # A stray file (a crashed commit's) and a referenced file wrongly queued.
    stray = f"{shoal.log_dir(NAME, VERSION)}/{0:020d}-{uuid.uuid4()}.parquet"
    shoal.storage.write_atomic(stray, pa.py_buffer(b"not a segment"))
    referenced = sorted(live_paths)[0]
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)
    garbage.enqueue(shoal.engine, [referenced], "test", later - dt.timedelta(hours=1))

    done = shoal.collect_garbage(now=later)
    assert done.deleted == len(replaced) + 1 and done.kept == 1 and done.pending == 0
    assert not any(shoal.storage.exists(p) for p in replaced) and not shoal.storage.exists(stray)
    assert all(shoal.storage.exists(p) for p in live_paths)
    assert set(shoal.storage.list_files(shoal.log_dir(NAME, VERSION))) == live_paths
    assert comparable_fold(shoal, NAME, VERSION).equals(state)
    logged = {p for p, _, _ in garbage.deletion_log(shoal.engine, tenant=shoal.tenant, limit=1000)}
    assert logged == replaced | {stray}

    # The other tenant's files were never looked at: its own GC finds nothing to delete either.
    assert len(other.storage.list_files(other.log_dir(NAME, VERSION))) == len(other.log_segments(NAME, VERSION))
    assert other.collect_garbage().deleted == 0


def test_gc_keeps_index_files_a_kept_version_still_uses(make_shoal: Callable[..., Shoal]) -> None:
    from sqlalchemy import delete

    from shoal.catalog.models import IndexVersion
    from shoal.index.segment import segment_files

    shoal = make_shoal(gc_grace_s=0)
    shoal.create_data_source(COMPACT_SPEC)
    flat_index(shoal, "v")
    shard = shoal.get_index("v", "1").shards[0].id
    producer = shoal.producer(NAME, VERSION)
    versions = []
    for i in range(3):  # rounds 2 and 3 update keys 0, then 1: the first segment gets a new deletion file
        producer.upload(init_batch(f"v{i}", range(0, 10) if i == 0 else range(i - 1, i)))
        build(shoal, "v")
        versions.append(shoal.shards.active_version(shard))
    files = [{f for e in v.manifest["segments"] for f in segment_files(e)} for v in versions]

    def prune(version_index: int) -> None:  # what version pruning does: the row goes, its files are queued
        with shoal.engine.begin() as conn:
            conn.execute(delete(IndexVersion).where(IndexVersion.id == versions[version_index].id))
            garbage.enqueue(conn, sorted(files[version_index]), "test-pruned", dt.datetime.now(dt.UTC))

    prune(0)
    first = shoal.collect_garbage(scan=False)
    assert first.deleted == 0 and first.kept == len(files[0])  # all still used by the later versions
    prune(1)
    second = shoal.collect_garbage(scan=False)
    only_v1 = files[1] - files[2]  # the deletion file version 3 replaced
    assert second.deleted == len(only_v1) == 1 and second.kept == len(files[1]) - 1
    assert not any(shoal.storage.exists(p) for p in only_v1)
    assert all(shoal.storage.exists(p) for p in files[2])
    queries = np.random.default_rng(1).uniform(-1, 1, (5, DIM)).astype(np.float32)
    same_answers(search_all(shoal, "v", queries, 5), brute_force(shoal, queries, 5))


def test_a_drop_keeps_its_grace_period_for_files_queued_before(make_shoal: Callable[..., Shoal]) -> None:
    """Version pruning queues the files of a pruned version that later versions still use (GC keeps them); a
    drop queuing the same files again must not inherit the earlier, already passed due time: every file of the
    dropped index stays until the drop's own grace period is over."""
    from shoal.index.history import prune_versions
    from shoal.index.segment import segment_files

    shoal = make_shoal(gc_grace_s=3600)
    shoal.create_data_source(COMPACT_SPEC)
    flat_index(shoal, "d")
    producer = shoal.producer(NAME, VERSION)
    for i in range(3):
        producer.upload(init_batch(f"d{i}", range(i * 10, i * 10 + 10)))
        build(shoal, "d")
    shard = shoal.get_index("d", "1").shards[0].id
    active = shoal.shards.active_version(shard)
    assert active is not None
    files = {f for e in active.manifest["segments"] for f in segment_files(e)}
    # Pruning two hours ago (a negative keep window prunes all but the active version and the newest before):
    # the first version's files were due an hour ago, and no GC ran since.
    two_hours_ago = dt.datetime.now(dt.UTC) - dt.timedelta(hours=2)
    # (Of this index only: the catalog is shared with the other tests, whose versions must not count here.)
    index_id = shoal.get_index("d", "1").id
    assert prune_versions(shoal.engine, keep_s=-3 * 3600, grace_s=3600, now=two_hours_ago, index_id=index_id) == 1
    shoal.drop_index("d", "1")
    done = shoal.collect_garbage(scan=False)
    assert done.deleted == 0, done
    assert all(shoal.storage.exists(p) for p in files)
    later = shoal.collect_garbage(scan=False, now=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1, minutes=1))
    assert later.deleted >= len(files) and not any(shoal.storage.exists(p) for p in files)


def test_cli_log_compact_expire_and_gc(make_shoal: Callable[..., Shoal], monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from shoal.cli import app

    shoal = make_shoal(tombstone_retention_s=0, gc_grace_s=0)
    for name, value in shoal.settings.model_dump().items():
        if value is not None:
            monkeypatch.setenv(f"SHOAL_{name.upper()}", str(value))
    shoal.create_data_source(COMPACT_SPEC)
    churn(shoal, 100, random.Random(3), "c")
    state = comparable_fold(shoal, NAME, VERSION)
    runner = CliRunner()

    def cli(*args: str) -> str:
        result = runner.invoke(app, list(args))
        assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
        return result.output

    assert "head seq" in cli("log", NAME, VERSION, "--segments")  # `shoal log NAME VERSION` still shows it
    compacted = json.loads(cli("log", "compact", NAME, VERSION, "--json"))
    assert compacted["changed"] and compacted["segments_after"] < compacted["segments_before"]
    assert "nothing worth rewriting" in cli("log", "compact", NAME, VERSION)
    assert "no retention_days" in cli("log", "expire", NAME, VERSION)
    collected = json.loads(cli("gc", "--json"))
    assert collected["deleted"] == compacted["segments_rewritten"]
    table = cli("gc")
    assert "files deleted" in table and "empty folders removed" in table  # README: gc counts the folders too
    assert comparable_fold(shoal, NAME, VERSION).equals(state)


# -- the beat tasks, on a real worker ---------------------------------------------------------------------


@pytest.mark.slow
def test_beat_expires_compacts_and_collects_with_a_real_worker(
    worker_catalog: str, redis_url: str, make_shoal: Callable[..., Shoal]
) -> None:
    shoal = make_shoal(
        "local", database_url=worker_catalog, redis_url=redis_url, sweep_interval_s=1.0, merge_interval_s=0,
        lease_seconds=3.0, pending_ttl_s=2.0, task_visibility_timeout_s=5.0, compaction_interval_s=1.0,
        compaction_min_seqs=1, retention_interval_s=1.0, gc_interval_s=1.0, gc_grace_s=0, tombstone_retention_s=0,
    )
    settings = shoal.settings
    # Points of "Expiring" live two seconds; "Kept" has no retention and sees updates and deletes.
    expiring = DataSourceSpec("Expiring", "1", DIM, {"id": "int64", "text": "string"}, ["id"],
                              custom_metadata={"retention_days": 2 / 86_400})
    shoal.create_data_source(expiring)
    shoal.create_data_source(COMPACT_SPEC)
    shoal.create_index(IndexSpec("exp", "1", "Expiring", "1", algorithm="flat", metric="euclidean"))
    flat_index(shoal, "kept")
    shoal.producer("Expiring", "1").upload(init_batch("e", range(40)))
    churn(shoal, 100, random.Random(11), "k")
    kept_state = comparable_fold(shoal, NAME, VERSION)
    worker = start_worker(settings, beat=True)
    try:
        def settled() -> bool:
            if folded_state(shoal, "Expiring", "1") or not all(
                s.built_watermark == s.head for name in ("exp", "kept") for s in shoal.index_status(name, "1")
            ):
                return False
            logs = [(n, v) for n, v in (("Expiring", "1"), (NAME, VERSION))]
            entries = [sum(s.upsert_count + s.tombstone_count for s in shoal.log_segments(n, v)) for n, v in logs]
            files = [set(shoal.storage.list_files(shoal.log_dir(n, v))) for n, v in logs]
            refs = [{s.path for s in shoal.log_segments(n, v)} for n, v in logs]
            return entries == [0, kept_state.num_rows] and files == refs

        wait_for(settled, 120, "beat to expire, compact and collect")
    finally:
        stop_process(worker)
    assert comparable_fold(shoal, NAME, VERSION).equals(kept_state)
    assert search_all(shoal, "exp", np.zeros((1, DIM), np.float32), 5) == [[]]
    queries = np.random.default_rng(12).uniform(-1, 1, (5, DIM)).astype(np.float32)
    same_answers(search_all(shoal, "kept", queries, 10), brute_force(shoal, queries, 10))
    assert any(r == "compacted" for _, r, _ in garbage.deletion_log(shoal.engine, tenant=shoal.tenant))


# -- the state machine: compaction and GC interleaved with writes, builds and searches --------------------


def _compacting_machine(client: Shoal) -> type:
    """The exactness machine (tests/test_index_exactness.py) with compaction and GC among its rules."""
    import test_index_exactness as ix
    from hypothesis.stateful import rule

    class CompactingMachine(ix.IndexMachine):
        shoal = client

        @rule()
        def compact(self) -> None:
            self.shoal.compact(self.source.name, "1")

        @rule()
        def collect(self) -> None:
            self.shoal.collect_garbage()

        def may_refuse_time_travel(self) -> bool:
            # Compaction keeps only the latest entry per key below compacted_through, so time travel to a seq no
            # kept version at or above it covers is refused, as the README says, rather than answered wrongly.
            source_id = self.shoal.get_data_source(self.source.name, "1").id
            return compaction_states(self.shoal.engine, [source_id])[0].compacted_through > 0

    return CompactingMachine


def test_searches_stay_exact_with_compaction_and_gc_interleaved(make_settings: Callable[..., Settings]) -> None:
    import test_index_exactness as ix
    from hypothesis import settings as hsettings
    from hypothesis.stateful import run_state_machine_as_test

    client = Shoal(make_settings("local", tombstone_retention_s=0, gc_grace_s=0, compaction_target_bytes=4000),
                   notify=False)
    try:
        run_state_machine_as_test(
            _compacting_machine(client),
            settings=hsettings(ix.MACHINE_SETTINGS, max_examples=10, stateful_step_count=40),
        )
    finally:
        client.close()


def test_tombstones_of_a_quiet_source_make_it_due_once_they_expire(make_shoal: Callable[..., Shoal]) -> None:
    """A source far below the size triggers (retention's deletions on a small, quiet source) is compacted once its
    tombstones pass the retention: the sweep only counted tombstones a previous run had kept, so the expired
    points stayed in the log files for good. After the run it is not due again."""
    from shoal.log.compaction import CompactionPolicy, compact_log, due_for_compaction

    shoal = make_shoal(tombstone_retention_s=3600)
    shoal.create_data_source(COMPACT_SPEC)
    flat_index(shoal, "q")
    producer = shoal.producer(NAME, VERSION)
    producer.upload(init_batch("q0", range(20)))
    producer.upload([Tombstone({"id": i}) for i in range(5)])
    build(shoal, "q")
    source = shoal.get_data_source(NAME, VERSION).id

    def due(at: dt.datetime) -> bool:
        return source in due_for_compaction(shoal.engine, min_seqs=10_000, tombstone_retention_s=3600, now=at,
                                            source_ids=[source])

    now = dt.datetime.now(dt.UTC)
    assert not due(now)  # the tombstones have not expired yet
    later = now + dt.timedelta(hours=1, minutes=1)
    assert due(later)
    done = compact_log(shoal.engine, shoal.storage, source, CompactionPolicy.from_settings(shoal.settings), now=later)
    assert done.entries_dropped == 10  # the five deleted points and their (expired) tombstones
    assert not due(later)


# -- the state machine, with an index made mid-run: after compactions, over the same data source ------------

# What the new-index machine ran, by path (printed by the test; the last run's counts are kept here).
NEW_INDEX_PATHS: dict[str, int] = {}

# Whether a compaction may run while the following searcher still serves an older version of the new index than
# the plain one made the catalog hold served, or the index as it was before its first build. It may: such a
# searcher reloads the active versions rather than scan the log on from below the compaction's bound (see
# test_a_searcher_serving_an_older_version_never_shows_a_compacted_tombstone_undone and
# test_a_searcher_that_loaded_an_index_before_its_first_build_never_shows_a_compacted_tombstone_undone). False
# makes every compaction first bring the following searcher up to date, as the machine's builds do the plain one.
LAGGING_SEARCHERS = True


def new_index_machine(client: Shoal, paths: dict[str, int], *, lagging_searchers: bool) -> type:
    """The compacting exactness machine, plus an index made mid-run over the same data source (after
    compactions, whose bound it then holds down to 0), built or not, merged, reindexed, tagged, dropped and made
    again (maybe under the same name). Each search of it is compared with brute force over the replayed log:

    - `eventual` through a following searcher (its young tier, bounded to a few seqs): the state at some seq e
      between its served watermarks and the head, each shard at max(its served watermark, e);
    - `eventual` through the machine's plain searcher: exactly at its visible watermarks;
    - `at_least(t)`, t the token of any earlier write: at some seq e >= t (each shard at max(served, e)), on
      either searcher;
    - `strong`: exactly at the head, on either searcher;
    - `as_of`: exactly at that seq, or refused with NotFoundError naming the compaction (only once one dropped
      entries); a tag: exactly at the seq it stands for (the highest watermark it pinned).

    `paths` counts what ran (searches before the first build, served below a compaction, ...);
    `lagging_searchers`: see LAGGING_SEARCHERS.
    """
    import dataclasses

    import test_index_exactness as ix
    from hypothesis import strategies as st
    from hypothesis.stateful import initialize, invariant, precondition, rule

    from shoal.errors import NotFoundError
    from shoal.index.sharding import shard_numbers
    from shoal.log.compaction_swap import dropped_through

    def count(path: str) -> None:
        paths[path] = paths.get(path, 0) + 1

    has_new = precondition(lambda self: self.new_name is not None)

    class NewIndexMachine(_compacting_machine(client)):
        @initialize()
        def setup(self) -> None:
            super().setup()
            self.following = self.shoal.searcher(follow=True, poll_interval=3600.0)  # refreshed by the rules
            self.new_name: str | None = None  # the index made mid-run, while it exists
            self.new_age = 0  # steps since it was made
            self.last_name: str | None = None
            self.new_metric = self.metric
            self.new_tags: dict[str, tuple[dict[int, int], str]] = {}  # tag -> (shard watermarks, metric)
            self.states: dict[int, dict[ix.Key, np.ndarray]] = {}  # seq -> replayed state (the log only grows)
            self.shard_of: dict[tuple[ix.Key, int], int] = {}

        # The main index's eventual, filtered and past-the-head searches, its merges and its young tier are the
        # compacting machine's (test_searches_stay_exact_with_compaction_and_gc_interleaved): here they would only
        # dilute the new index's rules. Its builds stay (they move the compaction bound), and its strong, at_least
        # and as_of searches (a new index lowers the bound of later compactions).
        search_eventual = search_filtered = search_past_the_head = merge = follow_heads = None

        @invariant()
        def steps(self) -> None:
            count("steps")
            if self.new_name is not None:
                count("steps with the new index")
                self.new_age += 1

        def teardown(self) -> None:
            count("examples")
            super().teardown()
            if hasattr(self, "following"):
                self.following.close()

        @rule(picks=st.lists(st.integers(0, 1000), min_size=1, max_size=3))
        def delete_live(self, picks: list[int]) -> None:
            """Tombstones of keys that are live (the machine's own deletes mostly miss: its keys are many)."""
            live = sorted(self._state(self.log.head))
            if live:
                self.delete(sorted({live[p % len(live)] for p in picks}))

        # -- the new index's life ----------------------------------------------------------------------

        @precondition(lambda self: self.new_name is None)
        @rule(shard_count=st.sampled_from([1, 2]), same_name=st.booleans(), compact_first=st.booleans())
        def create_new(self, shard_count: int, same_name: bool, compact_first: bool) -> None:
            if compact_first:  # the main index caught up and served, then a compaction up to it
                for shard in self.index.shards:
                    self.builder.materialize(shard.id)
                self.searcher.refresh()
                self.searcher.served_watermarks(self.index.spec.name, "1")
                self.compact()
            reuse = same_name and self.last_name is not None
            name = self.last_name if reuse else f"new-{uuid.uuid4().hex[:8]}"
            assert name is not None
            self.shoal.create_index(IndexSpec(name, "1", self.source.name, "1", algorithm="flat",
                                              metric=self.metric, id_attributes=["id"], split_attributes=["group"],
                                              shard_count=shard_count))
            self.new_name = self.last_name = name
            self.new_metric, self.new_tags, self.new_age = self.metric, {}, 0
            count("created" + (" again under its name" if reuse else ""))
            if self._dropped() > 0:
                count("created after a compaction dropped entries")

        @has_new
        @rule(shard=st.integers(0, 1))
        def build_new(self, shard: int) -> None:
            shards = self._record().shards
            self.builder.materialize(shards[shard % len(shards)].id)
            self.searcher.refresh()  # the plain searcher as the machine's own builds do; the following one lags

        @has_new
        @rule()
        def build_new_all(self) -> None:
            """A worker catching the whole index up to the head."""
            for shard in self._record().shards:
                self.builder.materialize(shard.id)
            self.searcher.refresh()

        @has_new
        @rule(shard=st.integers(0, 1), force=st.booleans())
        def merge_new(self, shard: int, force: bool) -> None:
            shards = self._record().shards
            self.builder.merge(shards[shard % len(shards)].id, force=force)
            self.searcher.refresh()

        @rule()
        def compact(self) -> None:
            if not lagging_searchers:
                self.following.refresh()  # see LAGGING_SEARCHERS
            super().compact()

        @has_new
        @rule()
        def catch_up_and_compact(self) -> None:
            """Workers catch both indexes up to the head, the plain searcher loads their versions (so the catalog
            holds them served), beat compacts; the following searcher may still serve older versions."""
            for shard in (*self.index.shards, *self._record().shards):
                self.builder.materialize(shard.id)
            self.searcher.refresh()
            assert self.new_name is not None
            self.searcher.served_watermarks(self.new_name, "1")
            self.compact()

        @has_new
        @rule()
        def follow_new(self) -> None:
            """What the following searcher does on an announcement: load new versions, extend the young tier."""
            self.following.refresh()
            self.following.service.follow_heads()

        # Later in an index's life: the generation a reindex replaces is kept (for rollback) at its watermark,
        # which then holds every compaction below it.
        @precondition(lambda self: self.new_name is not None and self.new_age >= 15)
        @rule(metric=st.sampled_from(["euclidean", "manhattan"]))
        def reindex_new(self, metric: str) -> None:
            assert self.new_name is not None
            job = self.shoal.reindex(self.new_name, "1", metric=metric, wait=True)
            assert job.state == "swapped", job
            self.new_metric = metric
            # The swap's announcement: both searchers serve the new generation now (its metric differs).
            self.searcher.refresh()
            self.following.refresh()
            count("reindexed")

        @precondition(lambda self: self.new_name is not None and self.new_age >= 10)  # searched a while first
        @rule()
        def drop_new(self) -> None:
            assert self.new_name is not None
            self.shoal.drop_index(self.new_name, "1")
            self.new_name, self.new_tags = None, {}
            self.searcher.refresh()  # the drop's announcement: neither searcher serves it any more
            self.following.refresh()
            count("dropped")

        @has_new
        @rule(tag=st.sampled_from(["t1", "t2"]))
        def tag_new(self, tag: str) -> None:
            assert self.new_name is not None
            # A tag stands for one seq, the highest watermark it pinned (migration 0012): every shard answers there.
            pinned = [self.shoal.shards.active_version(s.id) for s in self._record().shards]
            top = max((v.watermark for v in pinned if v is not None), default=0)
            marks = {s.shard_no: top for s in self._record().shards}
            self.shoal.tag_index(self.new_name, "1", tag)
            self.new_tags[tag] = (marks, self.new_metric)
            count("tagged")

        # -- searches of it ------------------------------------------------------------------------------

        @has_new
        @rule(query=ix.VECTORS, k=st.integers(1, 10), group=st.none() | ix.GROUPS, low=st.none() | ix.IDS)
        def search_new_following_eventual(self, query: list[float], k: int, group: str | None,
                                          low: int | None) -> None:
            self._some_seq(self.following, "following", Consistency.eventual(), 0, query, k, group, low)

        @has_new
        @rule(query=ix.VECTORS, k=st.integers(1, 10), group=st.none() | ix.GROUPS, low=st.none() | ix.IDS)
        def follow_and_search_new_eventual(self, query: list[float], k: int, group: str | None,
                                           low: int | None) -> None:
            """An eventual search right after the following searcher heard of new versions and heads."""
            self.follow_new()
            self._some_seq(self.following, "following", Consistency.eventual(), 0, query, k, group, low)

        @has_new
        @rule(query=ix.VECTORS, k=st.integers(1, 10), group=st.none() | ix.GROUPS, low=st.none() | ix.IDS)
        def search_new_plain_eventual(self, query: list[float], k: int, group: str | None, low: int | None) -> None:
            assert self.new_name is not None
            visible = self.searcher.visible_watermarks(self.new_name, "1")
            served = self.searcher.served_watermarks(self.new_name, "1")
            assert all(served[s] <= w <= self.log.head for s, w in visible.items()), (served, visible)
            self._note("eventual", "plain", served)
            self._exact(self.searcher, {"consistency": Consistency.eventual()}, visible, self._spec(), query, k,
                        group, low)

        @has_new
        @rule(query=ix.VECTORS, k=st.integers(1, 10), pick=st.integers(0, 1000), following=st.booleans(),
              group=st.none() | ix.GROUPS, low=st.none() | ix.IDS)
        def search_new_at_least(self, query: list[float], k: int, pick: int, following: bool, group: str | None,
                                low: int | None) -> None:
            tokens = [last for _, last, _ in self.log.batches] or [0]
            token = tokens[pick % len(tokens)]
            searcher, via = (self.following, "following") if following else (self.searcher, "plain")
            self._some_seq(searcher, via, Consistency.at_least(token), token, query, k, group, low)

        @has_new
        @rule(query=ix.VECTORS, k=st.integers(1, 10), following=st.booleans(), group=st.none() | ix.GROUPS,
              low=st.none() | ix.IDS)
        def search_new_strong(self, query: list[float], k: int, following: bool, group: str | None,
                              low: int | None) -> None:
            assert self.new_name is not None
            searcher, via = (self.following, "following") if following else (self.searcher, "plain")
            self._note("strong", via, searcher.served_watermarks(self.new_name, "1"))
            spec = self._spec()
            head = self.log.head
            self._exact(searcher, {"consistency": Consistency.strong()}, dict.fromkeys(range(spec.shard_count), head),
                        spec, query, k, group, low)

        @has_new
        @rule(query=ix.VECTORS, k=st.integers(1, 10), back=st.integers(0, 40), group=st.none() | ix.GROUPS)
        def search_new_as_of(self, query: list[float], k: int, back: int, group: str | None) -> None:
            seq = self.log.head - back
            if seq < 0:
                return
            spec = self._spec()
            try:
                self._exact(self.searcher, {"as_of": seq}, dict.fromkeys(range(spec.shard_count), seq), spec, query,
                            k, group, None)
            except NotFoundError as err:
                # Nothing prunes versions here. A read from a version below the bound to a seq at or above it
                # would miss the expired tombstones compaction dropped there, so those are refused too.
                assert "was compacted" in str(err) and self._dropped() > 0, (err, self._dropped())
                count("as_of refused (compacted)" + ("" if seq < self._dropped() else ", at or above the bound"))
            else:
                count("as_of answered" + (" below a compaction's bound" if seq < self._dropped() else ""))

        @precondition(lambda self: self.new_name is not None and self.new_tags)
        @rule(query=ix.VECTORS, k=st.integers(1, 10), pick=st.integers(0, 1))
        def search_new_tag(self, query: list[float], k: int, pick: int) -> None:
            tag = sorted(self.new_tags)[pick % len(self.new_tags)]
            marks, metric = self.new_tags[tag]
            self._exact(self.searcher, {"tag": tag}, marks, dataclasses.replace(self._spec(), metric=metric), query,
                        k, None, None)
            count("tag searched" + (" (an older generation)" if metric != self.new_metric else ""))

        # -- checking ------------------------------------------------------------------------------------

        def _record(self) -> Any:
            assert self.new_name is not None
            return self.shoal.get_index(self.new_name, "1")

        def _spec(self) -> IndexSpec:
            return self._record().spec

        def _dropped(self) -> int:
            return dropped_through(self.shoal.engine, self.shoal.get_data_source(self.source.name, "1").id)

        def _note(self, level: str, via: str, served: dict[int, int]) -> None:
            """Count the search by path: before any build of the index, and whether its served versions start
            below a compaction that dropped entries (a log read from them crosses it)."""
            built = any(self.shoal.shards.active_version(s.id) is not None for s in self._record().shards)
            below = min(served.values(), default=0) < self._dropped()
            count(f"{level} via {via}" + ("" if built else ", before the first build")
                  + (", served below a compaction" if below else ""))

        def _state(self, seq: int) -> dict[ix.Key, np.ndarray]:
            if seq not in self.states:
                self.states[seq] = self.log.state_at(seq)
            return self.states[seq]

        def _shard(self, key: ix.Key, spec: IndexSpec) -> int:
            found = self.shard_of.get((key, spec.shard_count))
            if found is None:
                table = pa.table({"id": pa.array([key[0]], pa.int64()), "group": pa.array([key[1]], pa.string())})
                found = int(shard_numbers(table, spec.shard_attributes, spec.shard_count)[0])
                self.shard_of[(key, spec.shard_count)] = found
            return found

        def _search(self, searcher: Any, when: dict[str, Any], query: list[float], k: int, group: str | None,
                    low: int | None) -> Any:
            assert self.new_name is not None
            return searcher.search(self.new_name, "1", [np.asarray(query, dtype=np.float32)], k,
                                   split_filter={"group": group} if group else None, retrieve_vectors=True,
                                   filters={"id": {"$gte": low, "$lt": low + 8}} if low is not None else None,
                                   **when)[0]

        def _mismatch(self, hits: Any, marks: dict[int, int], spec: IndexSpec, query: list[float], k: int,
                      group: str | None, low: int | None) -> str | None:
            """Why `hits` is not brute force over each shard's state at its mark (None: it is)."""
            ids: list[ix.Key] = []
            vectors: list[np.ndarray] = []
            for shard_no, mark in marks.items():
                for key, vector in self._state(mark).items():
                    if (self._shard(key, spec) == shard_no and (group is None or key[1] == group)
                            and (low is None or low <= key[0] < low + 8)):
                        ids.append(key)
                        vectors.append(vector)
            matrix = np.stack(vectors) if vectors else np.zeros((0, ix.DIM), np.float32)
            dist, labels = exact_top_k(Metric(spec.metric), np.asarray(query, np.float32)[None, :], matrix, k)
            expected = [(ids[j], float(d)) for d, j in zip(dist[0], labels[0], strict=True) if j >= 0]
            got = [((h.attributes["id"], h.attributes["group"]), float(h.distance)) for h in hits]
            live = dict(zip(ids, vectors, strict=True))
            why = None
            if len(got) != len(expected):
                why = "count"
            elif not np.allclose([d for _, d in got], [d for _, d in expected], rtol=1e-5, atol=1e-5):
                why = "distances"
            elif any(key not in live or not np.array_equal(h.vector, live[key])
                     for (key, _), h in zip(got, hits, strict=True)):
                why = "a hit that is not live there, or not with that vector"
            return None if why is None else f"{why}: got {got}, expected {expected}"

        def _exact(self, searcher: Any, when: dict[str, Any], marks: dict[int, int], spec: IndexSpec,
                   query: list[float], k: int, group: str | None, low: int | None) -> None:
            hits = self._search(searcher, when, query, k, group, low)
            why = self._mismatch(hits, marks, spec, query, k, group, low)
            assert why is None, f"{when} on the new index, each shard at {marks} (head {self.log.head}): {why}"

        def _some_seq(self, searcher: Any, via: str, consistency: Consistency, low_seq: int, query: list[float],
                      k: int, group: str | None, low: int | None) -> None:
            """The answer is brute force with each shard at max(its served watermark, e) for some seq e in
            [low_seq, head] (the served watermarks as before or after the search, or those of the view the young
            tier was derived for: a search may answer from it until the tier of a newer one is derived)."""
            assert self.new_name is not None
            name = self.new_name
            served_sets = [searcher.served_watermarks(name, "1")]
            self._note(consistency.level, via, served_sets[0])
            young = searcher.service._tails.get(searcher.view(name, "1").index.id)  # private: the test's only peek
            if young is not None:
                served_sets.append({s.shard_no: s.watermark for s in young.view.shards})
            hits = self._search(searcher, {"consistency": consistency}, query, k, group, low)
            served_sets.append(searcher.served_watermarks(name, "1"))
            spec = self._spec()
            head = self.log.head
            tried: dict[tuple[tuple[int, int], ...], str | None] = {}
            for served in served_sets:
                for e in range(max(low_seq, min(served.values(), default=0)), head + 1):
                    marks = {s: max(w, e) for s, w in served.items()}
                    frozen = tuple(sorted(marks.items()))
                    if frozen not in tried:
                        tried[frozen] = self._mismatch(hits, marks, spec, query, k, group, low)
                    if tried[frozen] is None:
                        if consistency.level == "eventual" and e > min(served.values(), default=0):
                            count(f"eventual via {via} answered past its served versions (young tier)")
                        return
            first = next(iter(tried.items()), None)
            raise AssertionError(
                f"{consistency} via the {via} searcher on the new index equals brute force at no seq in "
                f"[{low_seq}, {head}] (served {served_sets}); e.g. at {first}")

    return NewIndexMachine


NEW_INDEX_SETTINGS = {"max_examples": 30, "stateful_step_count": 50}


def test_an_index_made_mid_run_stays_exact_with_compaction_and_gc(make_settings: Callable[..., Settings]) -> None:
    """The compacting machine with an index made mid-run (after compactions) over its data source: every search
    of it, at every consistency level, through a following searcher (bounded young tier) and a plain one, and
    as of an earlier seq or a tag, answers a state the log had (see `new_index_machine`)."""
    import test_index_exactness as ix
    from hypothesis import settings as hsettings
    from hypothesis.stateful import run_state_machine_as_test

    client = Shoal(make_settings("local", tombstone_retention_s=0, gc_grace_s=0, compaction_target_bytes=4000,
                                 young_tier_max_seqs=7), notify=False)
    NEW_INDEX_PATHS.clear()
    try:
        run_state_machine_as_test(new_index_machine(client, NEW_INDEX_PATHS, lagging_searchers=LAGGING_SEARCHERS),
                                  settings=hsettings(ix.MACHINE_SETTINGS, **NEW_INDEX_SETTINGS))
    finally:
        client.close()
        print("new-index machine paths:", json.dumps(dict(sorted(NEW_INDEX_PATHS.items())), indent=1))
    assert NEW_INDEX_PATHS.get("created", 0) > 0, NEW_INDEX_PATHS


# -- SIGKILL during compaction and GC -----------------------------------------------------------------------

KILLS = {"local": 12, "s3": 5}


@pytest.mark.slow
def test_sigkill_during_compaction_and_gc_loses_nothing(make_shoal: Callable[..., Shoal], storage_kind: str) -> None:
    shoal = make_shoal(storage_kind, tombstone_retention_s=0, gc_grace_s=0, compaction_target_bytes=6000,
                       lease_seconds=1.0)
    shoal.create_data_source(COMPACT_SPEC)
    producer = shoal.producer(NAME, VERSION)
    for start in range(0, 60, 20):
        producer.upload(init_batch(f"init-{start}", range(start, start + 20)), batch_id=f"init-{start}")
    flat_index(shoal, "crash", shard_count=2)
    build(shoal, "crash")

    acked: dict[str, int] = {}
    stages: dict[str, int] = {}
    windows: dict[str, int] = {}
    for run in range(KILLS[storage_kind]):
        window = LogWindow(shoal)
        proc = run_helper("compaction_crasher.py", [f"r{run}", "crash"], shoal.settings)
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the child never started"
        lines = [proc.stdout.readline()]
        assert lines[0], f"child {run} died: {proc.stderr.read() if proc.poll() is not None else ''}"
        # Each kill aims at one window, in turn: a compaction's rewrite written but not swapped in, GC
        # deleting queued files before it records that, a batch's segment written but not committed, and
        # a swap committed with the replaced files not yet collected.
        target = TARGETS[run % len(TARGETS)]
        freeze_child_inside(proc, window, target, lines)
        os.kill(proc.pid, signal.SIGKILL)
        rest, err = proc.stdout.read(), proc.stderr.read()  # the buffered lines too, up to the end
        proc.wait(30)
        assert proc.returncode == -signal.SIGKILL, err
        windows[target] = windows.get(target, 0) + 1
        last_stage = "start"
        for line in lines + rest.splitlines():
            if line.strip():
                msg = json.loads(line)
                if "stage" in msg:
                    last_stage = msg["stage"]
                else:
                    acked[msg["batch"]] = msg["seq"]
        stages[last_stage] = stages.get(last_stage, 0) + 1

        # After every kill: no row points at a missing or corrupt file, segments tile 1..head, and the
        # folded state is exactly the replay of every committed batch (acknowledged ones among them).
        assert_log_intact(shoal, NAME, VERSION)
        committed = committed_batches(shoal, NAME, VERSION)
        tokens = {b: last for b, _, last in committed}
        for batch, seq in acked.items():
            assert tokens.get(batch) == seq, f"acknowledged batch {batch} (token {seq}) is missing"
        expected = replay([(b, init_batch(b, range(int(b[5:]), int(b[5:]) + 20)) if b.startswith("init-")
                            else mix_batch(b)) for b, _, _ in committed])
        assert folded_state(shoal, NAME, VERSION) == expected

    print(f"kills by stage: {stages}, by window: {windows}; {len(acked)} acknowledged batches")
    assert stages.get("compact", 0) + stages.get("gc", 0) >= 2, stages

    # Indexes catch up to the head from whatever watermark they were left at, and answer exactly.
    def caught_up() -> bool:
        try:
            build(shoal, "crash")
        except LeaseBusyError:  # a killed child's lease: it expires after lease_seconds
            return False
        return True

    wait_for(caught_up, 30, "the index to catch up")
    head = shoal.get_data_source(NAME, VERSION).head_seq
    assert all(s.built_watermark == head for s in shoal.get_index("crash", "1").shards)
    queries = np.random.default_rng(9).uniform(-1, 1, (10, DIM)).astype(np.float32)
    same_answers(search_all(shoal, "crash", queries, 8), brute_force(shoal, queries, 8))
    # A final compaction and GC leave exactly the referenced files (crashes' leftovers collected).
    shoal.compact(NAME, VERSION)
    shoal.collect_garbage()
    assert set(shoal.storage.list_files(shoal.log_dir(NAME, VERSION))) == {
        s.path for s in shoal.log_segments(NAME, VERSION)
    }


def test_a_log_read_below_a_compaction_shows_a_state_the_log_had(make_shoal: Callable[..., Shoal]) -> None:
    """An index made after a compaction reads the log from seq 0. A read ending below the compaction's bound
    would miss the keys whose entries there were superseded later (dropped) and show a state the log never had:
    `at_least` a write token from before the compaction reads on to the bound instead, and the young tier, when
    the bound is past its own, shows nothing rather than part of the log."""
    shoal = make_shoal(young_tier_max_seqs=60)
    spec = DataSourceSpec("below", "1", 4, {"id": "int64"}, ["id"])
    shoal.create_data_source(spec)
    rng = np.random.default_rng(3)
    first, second = rng.normal(size=(50, 4)).astype(np.float32), rng.normal(size=(25, 4)).astype(np.float32)
    producer = shoal.producer("below", "1")
    token = producer.upload_columns(first, {"id": np.arange(50)})  # seqs 1-50
    producer.upload_columns(second, {"id": np.arange(25)})  # seqs 51-75: keys 0-24 again
    done = shoal.compact("below", "1")  # no index yet: the whole log, 25 superseded entries dropped
    assert (done.bound, done.entries_dropped) == (75, 25)
    shoal.create_index(IndexSpec("below.flat", "1", "below", "1", algorithm="flat", metric="euclidean",
                                 id_attributes=["id"]))
    state = {i: (second[i] if i < 25 else first[i]) for i in range(50)}
    query = np.zeros((1, 4), dtype=np.float32)

    def found(searcher: Any, **options: Any) -> dict[int, list[float]]:
        hits = searcher.search("below.flat", "1", query, 100, retrieve_vectors=True, **options)[0]
        return {h.attributes["id"]: list(h.vector) for h in hits}

    plain = shoal.searcher(follow=False)
    following = shoal.searcher(follow=True, poll_interval=30.0)
    try:
        at_token = found(plain, consistency=Consistency.at_least(token))
        assert at_token == {i: v.tolist() for i, v in state.items()}  # the state at 75, which is at least 50
        # The young tier (at most 60 seqs) cannot reach the bound (75): eventual shows the built state (none)
        # rather than seqs 1-60 of the compacted log (keys 25-49 and 0-9: keys 10-24 missing).
        assert found(following) == {}
        assert found(following, consistency=Consistency.strong()) == at_token
    finally:
        plain.close()
        following.close()


def one_key_index(shoal: Shoal, name: str) -> Any:
    """A 2-d data source `name` keyed by `id` with a flat euclidean index `name.flat`; its producer."""
    shoal.create_data_source(DataSourceSpec(name, "1", 2, {"id": "int64"}, ["id"]))
    shoal.create_index(IndexSpec(f"{name}.flat", "1", name, "1", algorithm="flat", metric="euclidean",
                                 id_attributes=["id"]))
    return shoal.producer(name, "1")


def test_a_searcher_serving_an_older_version_never_shows_a_compacted_tombstone_undone(
    make_shoal: Callable[..., Shoal],
) -> None:
    """Two searchers of one index: one still serves the version at seq 1 (it has not loaded the newer one yet),
    the other loaded the version at seq 3, which marks the shard served at 3. A compaction may then reach seq 3
    and drop key 1's tombstone (seq 2: the key's last entry, past the tombstone retention). The first searcher's
    strong and at_least searches scan the log above its version (seq 1) and must still hide key 1: the state at
    seq 3 (or any seq >= 2) holds key 2 alone, never key 1."""
    shoal = make_shoal(tombstone_retention_s=0, gc_grace_s=0)
    producer = one_key_index(shoal, "lag")
    query = np.zeros((1, 2), dtype=np.float32)

    def ids(searcher: Any, **options: Any) -> list[int]:
        return sorted(h.attributes["id"] for h in searcher.search("lag.flat", "1", query, 10, **options)[0])

    producer.upload([DataPoint({"id": 1}, [1.0, 0.0])])  # seq 1
    build(shoal, "lag.flat")
    older, newer = shoal.searcher(follow=False), shoal.searcher(follow=False)
    try:
        assert ids(older) == [1]  # loads the version at seq 1
        deleted = producer.upload([Tombstone({"id": 1})])  # seq 2
        producer.upload([DataPoint({"id": 2}, [0.0, 1.0])])  # seq 3
        build(shoal, "lag.flat")
        assert ids(newer) == [2]  # loads the version at seq 3: the shard is marked served at 3
        done = shoal.compact("lag", "1")
        assert (done.bound, done.tombstones_dropped) == (3, 1)
        assert ids(older, consistency=Consistency.at_least(deleted)) == [2]  # got [1, 2]
        assert ids(older, consistency=Consistency.strong()) == [2]  # got [1, 2]
    finally:
        older.close()
        newer.close()


def test_a_searcher_that_loaded_an_index_before_its_first_build_never_shows_a_compacted_tombstone_undone(
    make_shoal: Callable[..., Shoal],
) -> None:
    """One searcher. It loads an index with no version yet and reads its tail (seq 1: key 1). Then key 1 is
    deleted (seq 2), key 2 written (seq 3), the index built at seq 3, which no searcher loads yet; the shard, never
    served, is held at its built watermark, so a compaction reaches seq 3 and drops key 1's tombstone (its last
    entry, past the retention). The searcher's next strong search extends its tail from seq 1 and must not show
    key 1 again."""
    shoal = make_shoal(tombstone_retention_s=0, gc_grace_s=0)
    producer = one_key_index(shoal, "unbuilt")
    query = np.zeros((1, 2), dtype=np.float32)
    searcher = shoal.searcher(follow=False)

    def ids(**options: Any) -> list[int]:
        return sorted(h.attributes["id"] for h in searcher.search("unbuilt.flat", "1", query, 10, **options)[0])

    try:
        producer.upload([DataPoint({"id": 1}, [1.0, 0.0])])  # seq 1
        assert ids(consistency=Consistency.strong()) == [1]  # no version: the tail (0, 1]
        producer.upload([Tombstone({"id": 1})])  # seq 2
        producer.upload([DataPoint({"id": 2}, [0.0, 1.0])])  # seq 3
        build(shoal, "unbuilt.flat")  # the version at seq 3, not loaded by the searcher yet
        done = shoal.compact("unbuilt", "1")
        assert (done.bound, done.tombstones_dropped) == (3, 1)
        assert ids(consistency=Consistency.strong()) == [2]  # got [1, 2]
    finally:
        searcher.close()
