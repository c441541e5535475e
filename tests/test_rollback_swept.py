"""Rollback once the generation a reindex replaced was swept (beat's sweep_generations, past SHOAL_REINDEX_KEEP_S):
the job stays listed as swapped, and the rollback says the generation is no longer kept, not that there is no
reindex to roll back."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import numpy as np
import pytest
from conftest import serve_api

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.errors import ReindexConflictError
from shoal.index.builder import ShardBuilder
from shoal.index.reindex import drop_expired_generations
from shoal.log.records import IndexSpec

DIM = 8


def _reindexed_and_swept(shoal: Shoal) -> None:
    """A flat index reindexed (swapped), then the generation it replaced dropped as the sweep drops it."""
    shoal.create_data_source(DataSourceSpec("docs", "1", DIM, {"id": "int64"}, ["id"]))
    ids = np.arange(300)
    vectors = np.random.default_rng(3).normal(size=(len(ids), DIM)).astype(np.float32)
    shoal.producer("docs", "1").upload_columns(vectors, {"id": ids})
    shoal.create_index(IndexSpec("ix", "1", "docs", "1", metric="euclidean", id_attributes=["id"]))
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for shard in shoal.get_index("ix", "1").shards:
        builder.materialize(shard.id)
    assert shoal.reindex("ix", "1", wait=True).state == "swapped"
    assert drop_expired_generations(shoal.engine, shoal.storage, keep_s=0, tenant_id=shoal.catalog.tenant_id) == 1


def test_rollback_after_the_sweep_says_the_generation_is_no_longer_kept(local_shoal: Shoal) -> None:
    _reindexed_and_swept(local_shoal)
    assert local_shoal.reindex_jobs("ix", "1")[0].state == "swapped"
    with pytest.raises(ReindexConflictError, match=r"before the last reindex of 'ix' '1' is no longer kept.*"
                                                   r"SHOAL_REINDEX_KEEP_S"):
        local_shoal.rollback("ix", "1")
    assert local_shoal.reindex_jobs("ix", "1")[0].state == "swapped"  # nothing changed


def test_rollback_after_the_sweep_over_http_is_a_409_naming_it(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with Shoal(settings, notify=False) as shoal:
        _reindexed_and_swept(shoal)
    with serve_api(settings) as base:
        api = f"{base}/api/v1/indexes/ix/1"
        assert httpx.get(f"{api}/reindex", timeout=30).json()[0]["state"] == "swapped"
        back = httpx.post(f"{api}/rollback", timeout=30)
        assert back.status_code == 409, back.text
        assert "no longer kept" in back.text and "SHOAL_REINDEX_KEEP_S" in back.text, back.text
