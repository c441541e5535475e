"""Backpressure counts only what indexers will catch up on: the serving generation of live indexes. A reindex's
generation built aside (watermark 0) and a dataset in the trash (never built) held every upload at 429, and the
broker consumer paused, until the reindex caught up or the trash was purged (30 days). Real Postgres, HTTP
uploads through the served API; the builds run in the test."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

import httpx
from conftest import serve_api, wait_for
from test_api_vektonn import point

from shoal import Shoal
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder
from shoal.log.records import AttributeType, DataPoint, DataSourceSpec, IndexSpec
from shoal.upkeep.trash import Trash

TYPES = {"id": AttributeType.INT64, "payload": AttributeType.STRING}


def _built_source(shoal: Shoal, name: str, points: int) -> None:
    shoal.create_data_source(DataSourceSpec(name, "1", 2, TYPES, ["id"]))
    shoal.producer(name, "1").upload([DataPoint({"id": i, "payload": "p"}, [float(i), 1.0]) for i in range(points)])
    shoal.create_index(IndexSpec(f"{name}-flat", "1", name, "1", algorithm="flat", metric="euclidean",
                                 id_attributes=["id"]))
    for shard in shoal.get_index(f"{name}-flat", "1").shards:
        ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)


def test_a_reindex_building_aside_does_not_hold_uploads_at_429(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings("local", max_index_lag_seqs=10)
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with Shoal(settings, notify=False) as shoal:
        _built_source(shoal, "src", 30)  # built to its head: lag 0
        shoal.reindex("src-flat", "1", metric="cosine")  # its new generation starts at watermark 0 (no worker)
        sid = shoal.get_data_source("src", "1").id
        assert shoal.runtime.backpressure.over([sid]) == {}
    with serve_api(settings) as base:
        answer = httpx.post(f"{base}/api/v1/upload/src/1", json=[point(99, "p", [9.0, 0.0])], timeout=30)
        assert answer.status_code == 200, answer.text


def test_a_source_in_the_trash_no_longer_counts_as_lagging(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings("local", max_index_lag_seqs=10)
    with Shoal(settings, notify=False) as shoal:
        _built_source(shoal, "kept", 5)
        shoal.create_data_source(DataSourceSpec("gone", "1", 2, TYPES, ["id"]))
        shoal.create_index(IndexSpec("gone-flat", "1", "gone", "1", algorithm="flat", metric="euclidean",
                                     id_attributes=["id"]))
        shoal.producer("gone", "1").upload([DataPoint({"id": i, "payload": "p"}, [float(i), 1.0]) for i in range(20)])
        gone = shoal.get_data_source("gone", "1").id
        wait_for(lambda: gone in shoal.runtime.backpressure.over([gone]), 30, "the unbuilt source to lag")
        Trash(shoal.engine, shoal.catalog.tenant_id, shoal.tenant).soft_delete("gone", "1", dt.timedelta(days=30))
        wait_for(lambda: shoal.runtime.backpressure.over([gone]) == {}, 30, "the trashed source's lag forgotten")
