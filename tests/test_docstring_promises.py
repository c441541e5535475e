"""Docstring promises that held only on the usual path: `reindex_jobs` of an index restored from the trash lists
none of a dropped index of the same name (newer than it), `drop_alias` leaves the alias of an index in the trash
for its restore, the searcher's and `revoke_key`'s name arguments are checked (InvalidNameError, not a database
driver error), and the generation sweep counts no generation of an index in the trash as dropped."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from shoal import DataSourceSpec, Shoal
from shoal.auth import create_key, revoke_key
from shoal.catalog.models import IndexShard
from shoal.errors import InvalidNameError, NotFoundError
from shoal.index.builder import ShardBuilder
from shoal.index.reindex import drop_expired_generations
from shoal.log.records import AttributeType, IndexSpec
from shoal.upkeep.trash import Trash

SOURCE = DataSourceSpec("docs", "1", 2, {"id": AttributeType.INT64}, ["id"])
INDEX = IndexSpec("ix", "1", "docs", "1", algorithm="flat", metric="euclidean", id_attributes=["id"])


def _setup(shoal: Shoal) -> None:
    """The source `docs/1` with two points and the index `ix/1` over it, built."""
    shoal.create_data_source(SOURCE)
    shoal.producer("docs", "1").upload_columns(np.eye(2, dtype=np.float32), {"id": np.arange(2)})
    shoal.create_index(INDEX)
    builder = ShardBuilder(shoal.engine, shoal.storage)
    with Session(shoal.engine) as s:
        shard_ids = list(s.scalars(select(IndexShard.id).where(IndexShard.index_id == shoal.get_index("ix", "1").id)))
    for shard_id in shard_ids:
        builder.materialize(shard_id)


def _trash(shoal: Shoal) -> Trash:
    return Trash(shoal.engine, shoal.catalog.tenant_id, shoal.tenant)


# -- 1. reindex jobs of an index restored from the trash ------------------------------------------------------


def test_an_index_restored_from_the_trash_lists_no_job_of_a_newer_index_dropped_with_its_source(
    make_shoal: Callable[..., Shoal],
) -> None:
    shoal = make_shoal()
    _setup(shoal)
    own = shoal.reindex("ix", "1", wait=True)  # the old index's own job: listed again once it is restored
    trashed = _trash(shoal).soft_delete("docs", "1", dt.timedelta(days=1))
    _setup(shoal)  # the names are free: a new source and index take them
    newer = shoal.reindex("ix", "1", algorithm="hnsw", wait=True)
    assert newer.state == "swapped"
    shoal.drop_data_source("docs", "1")
    _trash(shoal).restore(trashed.id)
    assert [j.id for j in shoal.reindex_jobs("ix", "1")] == [own.id]
    assert shoal.generations.job(newer.id).state == "swapped"  # still read by its id
    assert "_index_dropped" not in shoal.generations.job(newer.id).definition


def test_an_index_restored_from_the_trash_lists_no_job_of_a_newer_index_dropped_by_its_owner(
    make_shoal: Callable[..., Shoal],
) -> None:
    shoal = make_shoal()
    _setup(shoal)
    trashed = _trash(shoal).soft_delete("docs", "1", dt.timedelta(days=1))
    _setup(shoal)
    first = shoal.reindex("ix", "1", wait=True)
    second = shoal.reindex("ix", "1", wait=True)
    drop_expired_generations(shoal.engine, shoal.storage, 0, shoal.catalog.tenant_id)
    # The first job's generations are both gone (swept): it links nothing, and is still the newer index's.
    assert [j.id for j in shoal.reindex_jobs("ix", "1")] == [second.id, first.id]
    assert (shoal.generations.job(first.id).from_index_id, shoal.generations.job(first.id).to_index_id) == (None, None)
    shoal.drop_index("ix", "1")
    shoal.drop_data_source("docs", "1")  # frees the source's names for the restore
    _trash(shoal).restore(trashed.id)
    assert shoal.reindex_jobs("ix", "1") == []
    job = shoal.reindex("ix", "1", wait=True)  # the restored index's own jobs are listed, and only they
    assert [j.id for j in shoal.reindex_jobs("ix", "1")] == [job.id]


# -- 2. drop_alias of an index in the trash -------------------------------------------------------------------


def test_drop_alias_of_an_index_in_the_trash_is_not_found_and_the_restore_brings_the_alias_back(
    make_shoal: Callable[..., Shoal],
) -> None:
    shoal = make_shoal()
    _setup(shoal)
    shoal.set_alias("al", "ix", "1")
    trashed = _trash(shoal).soft_delete("docs", "1", dt.timedelta(days=1))
    with pytest.raises(NotFoundError, match="alias 'al' not found"):
        shoal.drop_alias("al")
    _trash(shoal).restore(trashed.id)
    alias = shoal.get_alias("al")
    assert (alias.index_name, alias.index_version) == ("ix", "1")
    shoal.drop_alias("al")  # a live index's alias still goes
    with pytest.raises(NotFoundError):
        shoal.get_alias("al")


# -- 3. names checked before the catalog sees them ------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "what"),
    [
        (lambda sr: sr.view("ix\x00", "1"), "index name"),
        (lambda sr: sr.view(5, "1"), "index name"),
        (lambda sr: sr.service.view(sr.scope, "ix", "1\x00"), "index version"),
        (lambda sr: sr.served_watermarks("ix\x00", "1"), "index name"),
        (lambda sr: sr.visible_watermarks("ix", 7), "index version"),
        (lambda sr: sr.loaded(["ix"], "1"), "index name"),
        (lambda sr: sr.loaded("ix", "1\x00"), "index version"),
    ],
    ids=["view-nul", "view-int", "service-view-nul", "served-nul", "visible-int", "loaded-list", "loaded-nul"],
)
def test_the_searchers_name_arguments_are_checked(
    make_shoal: Callable[..., Shoal], call: Callable[[Any], object], what: str
) -> None:
    shoal = make_shoal()
    _setup(shoal)
    searcher = shoal.searcher(follow=False)
    try:
        with pytest.raises(InvalidNameError, match=f"invalid {what}"):
            call(searcher)
        assert searcher.loaded("ix", "1") is False  # good names still answer as before
        assert searcher.served_watermarks("ix", "1") == searcher.visible_watermarks("ix", "1")
        assert searcher.loaded("ix", "1") is True
    finally:
        searcher.close()


@pytest.mark.parametrize("tenant", ["a\x00", 5])
def test_revoke_key_checks_the_tenant_name(make_shoal: Callable[..., Shoal], tenant: Any) -> None:
    shoal = make_shoal()
    record, _ = create_key(shoal.engine, shoal.tenant, "read")
    with pytest.raises(InvalidNameError, match="invalid tenant name"):
        revoke_key(shoal.engine, record.key_id, tenant=tenant)
    assert revoke_key(shoal.engine, record.key_id, tenant=shoal.tenant).revoked_at is not None


# -- 4. the generation sweep and an index in the trash --------------------------------------------------------


def test_the_sweep_counts_no_generation_of_an_index_in_the_trash_and_the_restore_can_roll_back(
    make_shoal: Callable[..., Shoal],
) -> None:
    shoal = make_shoal()
    _setup(shoal)
    assert shoal.reindex("ix", "1", algorithm="hnsw", wait=True).state == "swapped"
    trashed = _trash(shoal).soft_delete("docs", "1", dt.timedelta(days=1))
    # The trash lists the index, not the generation built aside (`1~g1`), which lists leave out.
    assert trashed.indexes == (("ix", "1"),), trashed.indexes
    assert [t.indexes for t in _trash(shoal).list()] == [(("ix", "1"),)]
    for _ in range(2):
        assert drop_expired_generations(shoal.engine, shoal.storage, 0, shoal.catalog.tenant_id) == 0
    _trash(shoal).restore(trashed.id)
    shoal.rollback("ix", "1")  # the generation kept for rollback stayed with the index in the trash
    assert shoal.get_index("ix", "1").spec.algorithm == "flat"
