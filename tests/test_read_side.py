"""The read side after compactions, reindexes and drops: time travel over the raw log refuses a state the log no
longer has, lag metrics and health count the generations that serve (and a reindex's being built), and
`shoal status` over every index survives an index dropped while it runs."""

from __future__ import annotations

import datetime as dt
import re
import threading
from collections.abc import Callable

import httpx
import numpy as np
import psycopg
import pyarrow as pa
import pytest
from conftest import serve_api, wait_for

from shoal import DataSourceSpec, Shoal
from shoal.auth import create_key
from shoal.cli.logview import print_log
from shoal.cli.status import collect, running_jobs
from shoal.config.settings import Settings
from shoal.errors import NotFoundError
from shoal.index.builder import ShardBuilder
from shoal.index.reindex import start_reindex
from shoal.log.records import DataPoint, IndexSpec, Tombstone
from shoal.workers.liveness import lag_summary

SPEC = DataSourceSpec("RS", "1", 2, {"id": "int64", "p": "string"}, ["id"])


def _point(i: int, p: str) -> DataPoint:
    return DataPoint({"id": i, "p": p}, [float(i), 1.0])


def _state(table: pa.Table) -> list[tuple[int, str]]:
    return sorted(zip(table.column("id").to_pylist(), table.column("p").to_pylist(), strict=True))


def _seqs(batches: object) -> list[int]:
    return [s for b in batches for s in b.column("__seq").to_pylist()]  # type: ignore[attr-defined]


def test_fold_and_read_log_refuse_a_state_compaction_dropped(local_shoal: Shoal) -> None:
    """Below what a compaction dropped, fold and read_log refuse naming the bound (they answered states the log
    never had: keys missing, old values); at and above it, and from seq 0 to the head, they answer as before."""
    shoal = local_shoal
    shoal.create_data_source(SPEC)
    producer = shoal.producer("RS", "1")
    producer.upload([_point(1, "a"), _point(2, "a")])  # seqs 1, 2
    producer.upload([_point(1, "b")])  # 3
    producer.upload([Tombstone({"id": 2})])  # 4
    producer.upload([_point(3, "c")])  # 5
    at_head = _state(shoal.fold("RS", "1"))
    pending = shoal.read_log("RS", "1", after_seq=2)  # asked before the compaction, read after it

    result = shoal.compact("RS", "1", now=dt.datetime.now(dt.UTC) + dt.timedelta(days=3))
    assert result.bound == 5 and result.entries_dropped == 3

    bound = "the log below seq 5 was compacted"
    for seq in (1, 2, 3, 4):
        with pytest.raises(NotFoundError, match=bound):
            shoal.fold("RS", "1", seq)
        with pytest.raises(NotFoundError, match=bound):
            list(shoal.read_log("RS", "1", after_seq=0, up_to_seq=seq))
    # From above 0 and below the bound: its thinned entries would not take a state at after_seq forward.
    with pytest.raises(NotFoundError, match=bound):
        shoal.read_log("RS", "1", after_seq=2)
    with pytest.raises(NotFoundError, match=bound):
        list(pending)  # the check passed before the compaction; the read's snapshot came after it

    assert _state(shoal.fold("RS", "1", 0)) == []  # nothing was ever there
    assert _state(shoal.fold("RS", "1", 5)) == _state(shoal.fold("RS", "1")) == at_head == [(1, "b"), (3, "c")]
    assert _seqs(shoal.read_log("RS", "1")) == [3, 5]  # the compacted log from the start: its fold is the head's
    producer.upload([_point(4, "d")])  # 6
    assert _seqs(shoal.read_log("RS", "1", after_seq=5)) == [6]
    assert _state(shoal.fold("RS", "1", 6)) == [(1, "b"), (3, "c"), (4, "d")]
    print_log(shoal, "RS", "1", segments=True, show=5)  # `shoal log --show` folds at the head: still answers


def _lag_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "lag_seqs" in line and not line.startswith("#")]


def _gauge(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found is not None, name
    return float(found.group(1))


def test_lag_metrics_and_health_leave_out_generations_that_serve_nothing(
    make_settings: Callable[..., Settings], worker_catalog: str
) -> None:
    """After a reindex, the generation kept for rollback is served by no searcher: it shows in no lag series,
    the served lag max is 0 while every index serves its head, and /healthz's counts leave it out. A reindex
    still building shows in no metric either, but its shards count in the health report (workers owe them)."""
    settings = make_settings("local", database_url=worker_catalog)  # a catalog of its own: the max is global
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(SPEC)
        producer = shoal.producer("RS", "1")
        producer.upload([_point(i, "x") for i in range(1, 6)])
        shoal.create_index(IndexSpec("RS.Index", "1", "RS", "1", algorithm="flat", metric="euclidean",
                                     id_attributes=["id"], shard_count=2))
        builder = ShardBuilder(shoal.engine, shoal.storage)

        def build_all() -> None:  # every shard of every generation, as the sweep does
            for shard_id, _, _ in shoal.shards.all_shards():
                builder.materialize(shard_id)

        build_all()
        shoal.reindex("RS.Index", "1", algorithm="flat", wait=True)  # generation 1 is kept for rollback
        producer.upload([_point(i, "y") for i in range(6, 106)])
        build_all()
        searcher = shoal.searcher(follow=False)
        try:
            searcher.search("RS.Index", "1", np.zeros((1, 2), np.float32), 3)
        finally:
            searcher.close()
        wait_for(lambda: all(s.lag_seqs == 0 for s in shoal.index_status("RS.Index", "1")), 30,
                 "the searcher to serve the head")
        key = create_key(shoal.engine, settings.tenant, "admin")[1]

        def scrape() -> str:
            with serve_api(settings) as url:
                return httpx.get(f"{url}/metrics", headers={"Authorization": f"ApiKey {key}"}, timeout=30).text

        text = scrape()
        lines = _lag_lines(text)
        assert not [line for line in lines if "~g" in line], lines
        assert len([line for line in lines if line.startswith("shoal_index_served_lag_seqs{")]) == 2
        assert _gauge(text, "shoal_index_served_lag_seqs_max") == 0
        assert _gauge(text, "shoal_index_built_lag_seqs_max") == 0
        assert lag_summary(shoal.engine).shards == 2  # the index's two shards, not its rollback generation's

        # A reindex left building: its generation, built from 0, is the workers' debt, not a lagging index.
        start_reindex(shoal.catalog, shoal.indexes, "RS.Index", "1", algorithm="flat")
        text = scrape()
        assert not [line for line in _lag_lines(text) if "~g" in line]
        assert _gauge(text, "shoal_index_served_lag_seqs_max") == 0
        assert _gauge(text, "shoal_index_built_lag_seqs_max") == 0
        summary = lag_summary(shoal.engine)
        assert (summary.shards, summary.lagging_shards, summary.max_lag_seqs) == (4, 2, 105)


def test_status_of_every_index_leaves_out_one_dropped_while_it_runs(
    make_settings: Callable[..., Settings],
) -> None:
    """`shoal status` lists the indexes, then reads each: one dropped between the two is left out (it failed the
    whole table, and ended `--watch`); a named index that is gone is still not found."""
    settings = make_settings("local")
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(SPEC)
        shoal.producer("RS", "1").upload([_point(1, "x")])
        for name in ("A", "B"):
            shoal.create_index(IndexSpec(name, "1", "RS", "1", algorithm="flat", id_attributes=["id"]))
        url = settings.database_url.replace("postgresql+psycopg://", "postgresql://")
        found: list[object] = []
        # The watcher in autocommit: within a transaction pg_stat_activity is one snapshot.
        with psycopg.connect(url) as blocker, psycopg.connect(url, autocommit=True) as watcher:
            # Reading index A's lag reads log_segments (nothing served it yet), after the listing: hold that
            # table, so the status run waits right between listing B and reading it.
            blocker.execute("LOCK TABLE log_segments IN ACCESS EXCLUSIVE MODE")

            def run() -> None:
                try:
                    found.append(collect(shoal, None, None))
                except Exception as exc:  # noqa: BLE001 - the test reports it
                    found.append(exc)

            thread = threading.Thread(target=run)
            thread.start()
            wait_for(lambda: watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query LIKE '%log_segments%'").fetchone()[0] > 0,  # type: ignore[index]
                30, "the status run to wait on log_segments")
            shoal.drop_index("B", "1")
            blocker.commit()
            thread.join(30)
        assert len(found) == 1 and not isinstance(found[0], Exception), found
        assert {s.index for s in found[0]} == {"A/1"}  # type: ignore[attr-defined]
        assert running_jobs(shoal, None, None) == []
        with pytest.raises(NotFoundError):
            collect(shoal, "B", "1")
        with pytest.raises(NotFoundError):
            running_jobs(shoal, "B", "1")
