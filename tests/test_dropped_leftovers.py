"""What a data source or index deleted for good leaves behind is removed (shoal.upkeep.leftovers): its two Redis
keys (the announced head, the index token) when the trash purge deletes its rows, and by the backstop every full
purge runs (keys of ids no data_sources row has, reindex jobs of dropped indexes past their retention).

Real Postgres (the session's catalog), a Valkey of each test alone (the backstop scans every key of its Redis),
datasets made, written, reindexed and searched in process; no worker runs. Eight days passing is simulated by
moving a job's times into the past in the catalog."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import Text, cast, func, literal, select, update
from sqlalchemy.orm import Session

from shoal import Shoal
from shoal.catalog.models import DataSource, ReindexJob
from shoal.config.settings import Settings
from shoal.datasets.rules import VERSION
from shoal.datasets.service import DatasetService
from shoal.errors import NotFoundError
from shoal.index.generations import DROPPED
from shoal.index.reindex import drop_expired_generations
from shoal.log.heads import head_key
from shoal.searcher.announce import index_token_key
from shoal.searcher.searcher import Searcher
from shoal.servers.embedded import ensure_valkey, stop_embedded
from shoal.upkeep.trash import Trash, purge_due

VECTORS = [{"id": str(i), "values": [float(i), 0.0]} for i in range(6)]


class Tenant:
    """A tenant on a Valkey of its own: its Shoal (announcing drops), a dataset service and a Redis client."""

    def __init__(self, shoal: Shoal, client: redis.Redis) -> None:
        self.shoal = shoal
        self.redis = client
        self.searcher: Searcher = shoal.searcher(follow=False)
        self.service = DatasetService(shoal, self.searcher)

    def dataset(self, name: str, reindexes: int = 1) -> int:
        """A dataset written to, reindexed (each reindex run here and swapped in) and searched strongly, so both
        its keys exist; its data source's id."""
        self.service.create(name, 2, metric_type="euclidean", index_type="flat")
        self.service.upsert(name, VECTORS)
        for n in range(reindexes):
            self.service.reindex(name, "hnsw" if n % 2 == 0 else "flat", wait=True)
        assert self.nearest(name) == "1"
        return self.source_id(name)

    def nearest(self, name: str) -> str:
        """The id of the vector nearest (1, 0), by a strong search."""
        return str(self.service.search(name, [1.0, 0.0], 1, consistency="strong").matches[0].id)

    def source_id(self, name: str) -> int:
        return self.shoal.get_data_source(name, VERSION).id

    def keys(self, source_id: int) -> dict[str, bool]:
        """Which of the data source's two keys Redis holds."""
        return {"head": bool(self.redis.exists(head_key(source_id))),
                "index token": bool(self.redis.exists(index_token_key(source_id)))}

    def trash(self) -> Trash:
        return Trash(self.shoal.engine, self.shoal.catalog.tenant_id, self.shoal.tenant)


BOTH = {"head": True, "index token": True}
NONE = {"head": False, "index token": False}


@pytest.fixture
def tenant(make_settings: Callable[..., Settings], tmp_path: Path) -> Iterator[Tenant]:
    home = tmp_path / "own-valkey"
    url = ensure_valkey(home)
    client = redis.Redis.from_url(url)
    try:
        with Shoal(make_settings("local", redis_url=url)) as shoal:
            made = Tenant(shoal, client)
            try:
                yield made
            finally:
                made.searcher.close()
    finally:
        client.close()
        stop_embedded(home)


def test_a_purged_dataset_leaves_no_redis_keys_and_a_live_one_keeps_its_own(tenant: Tenant) -> None:
    gone = tenant.dataset("gone")
    kept = tenant.dataset("kept")
    assert tenant.keys(gone) == BOTH and tenant.keys(kept) == BOTH
    tenant.service.delete("gone")  # to the trash: its id (and keys) stay for a restore
    assert tenant.keys(gone) == BOTH

    tenant.service.purge("gone")  # the dataset API's purge (DELETE /api/v1/trash/{name}), as a user purges

    assert tenant.trash().list() == []
    assert tenant.keys(gone) == NONE, "the purged data source's Redis keys are left behind"
    assert tenant.keys(kept) == BOTH
    assert tenant.nearest("kept") == "1"


def test_a_purge_while_redis_is_away_still_purges_and_the_next_full_purge_deletes_the_keys(
    tenant: Tenant, caplog: pytest.LogCaptureFixture,
) -> None:
    gone = tenant.dataset("gone")
    tenant.service.delete("gone")
    away = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=2)  # nothing listens there
    try:
        result = tenant.trash().purge(tenant.shoal.storage, [gone], redis_client=away)
    finally:
        away.close()
    assert [s[3] for s in result.sources] == [gone]
    assert "could not delete the Redis keys of deleted data sources" in caplog.text
    assert tenant.keys(gone) == BOTH

    purge_due(tenant.shoal.engine, tenant.shoal.storage, redis_client=tenant.redis)

    assert tenant.keys(gone) == NONE


def test_the_backstop_deletes_the_keys_of_deleted_data_sources_and_keeps_live_and_trashed_ones(
    tenant: Tenant,
) -> None:
    live = tenant.dataset("live")
    binned = tenant.dataset("binned")
    tenant.service.delete("binned")  # in the trash
    hard = tenant.dataset("hard")
    tenant.service.delete("hard", hard=True)  # deleted for good: its keys stayed, as they did before the fix
    assert tenant.keys(hard) == BOTH
    # A data source deleted before the fix, whose keys were set then (by hand here): its id has no row.
    older = tenant.dataset("older")
    tenant.service.delete("older", hard=True)
    tenant.redis.delete(head_key(older), index_token_key(older))
    tenant.redis.set(head_key(older), 6)
    tenant.redis.set(index_token_key(older), "a token of before")
    with Session(tenant.shoal.engine) as s:
        assert s.scalars(select(DataSource.id).where(DataSource.id.in_([hard, older]))).all() == []

    result = purge_due(tenant.shoal.engine, tenant.shoal.storage, redis_client=tenant.redis)

    assert tenant.keys(hard) == NONE, "the keys of a hard-deleted data source are left behind"
    assert tenant.keys(older) == NONE, "the keys of a data source deleted before the fix are left behind"
    assert result.to_json()["redis_keys_deleted"] >= 4
    assert tenant.keys(live) == BOTH
    assert tenant.keys(binned) == BOTH
    assert tenant.nearest("live") == "1"
    tenant.service.restore("binned")  # same id, its keys kept
    assert tenant.keys(binned) == BOTH
    assert tenant.nearest("binned") == "1"


def _jobs_of(tenant: Tenant, name: str) -> list[int]:
    return [j.id for j in tenant.shoal.reindex_jobs(name, VERSION)]


def _ended_eight_days_ago(tenant: Tenant, job_ids: list[int]) -> None:
    """Move the jobs' end (and last change) eight days into the past."""
    then = func.now() - dt.timedelta(days=8)
    with Session(tenant.shoal.engine) as s, s.begin():
        s.execute(update(ReindexJob).where(ReindexJob.id.in_(job_ids)).values(finished_at=then, updated_at=then))


def _dropped_eight_days_ago(tenant: Tenant, job_ids: list[int]) -> None:
    """Move the drop of the jobs' index eight days into the past (the time its mark holds)."""
    then = func.now() - dt.timedelta(days=8)
    with Session(tenant.shoal.engine) as s, s.begin():
        marked = s.execute(
            update(ReindexJob)
            .where(ReindexJob.id.in_(job_ids), ReindexJob.definition.has_key(DROPPED))
            .values(definition=ReindexJob.definition.op("||")(
                func.jsonb_build_object(cast(literal(DROPPED), Text), then)))
        ).rowcount
    assert marked == len(job_ids)


def test_jobs_of_dropped_indexes_are_deleted_after_their_retention_and_younger_ones_stay_readable(
    tenant: Tenant,
) -> None:
    shoal = tenant.shoal
    tenant.dataset("old", reindexes=2)
    old_jobs = _jobs_of(tenant, "old")
    tenant.dataset("young", reindexes=2)
    young_jobs = _jobs_of(tenant, "young")
    # A live dataset whose replaced generations were swept: its first job links no generation any more, and is
    # still one of its jobs.
    tenant.dataset("live", reindexes=2)
    live_jobs = _jobs_of(tenant, "live")
    assert drop_expired_generations(shoal.engine, shoal.storage, keep_s=0, tenant_id=shoal.catalog.tenant_id) >= 2
    orphan = shoal.generations.job(live_jobs[-1])
    assert (orphan.from_index_id, orphan.to_index_id) == (None, None)
    # The young dataset's jobs ended eight days ago too, but it is deleted now: they stay readable a while.
    _ended_eight_days_ago(tenant, old_jobs + young_jobs + live_jobs)
    tenant.service.delete("old", hard=True)
    tenant.service.delete("young", hard=True)
    assert len(old_jobs) == len(young_jobs) == 2
    for job_id in old_jobs + young_jobs:
        job = shoal.generations.job(job_id)  # readable by id after the drop
        assert (job.from_index_id, job.to_index_id) == (None, None)
    _dropped_eight_days_ago(tenant, old_jobs)

    result = purge_due(shoal.engine, shoal.storage)

    for job_id in old_jobs:
        with pytest.raises(NotFoundError):
            shoal.generations.job(job_id)
    assert result.to_json()["reindex_jobs_deleted"] >= 2
    assert [shoal.generations.job(j).id for j in young_jobs] == young_jobs
    assert _jobs_of(tenant, "live") == live_jobs
