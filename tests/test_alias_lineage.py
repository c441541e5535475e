"""Aliases and reindex jobs follow the index, not a moment of it: an alias set while a reindex swaps or rolls the
index back names the generation serving afterwards (never the one hidden for rollback), one set while the index
is dropped is a clean NotFoundError, a dropped index's jobs are not those of an index made again under its name,
a version too long for its generations' hidden versions is refused before anything is written, and seq headers
take plain digits only."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import httpx
import numpy as np
import pytest
from conftest import serve_api, wait_for
from sqlalchemy import Connection, select, text
from sqlalchemy.orm import Session

from shoal import DataSourceSpec, Shoal
from shoal.catalog.models import Index, IndexShard, ReindexJob
from shoal.config.settings import Settings
from shoal.errors import NotFoundError, ValidationError
from shoal.index.builder import ShardBuilder
from shoal.index.reindex import drop_expired_generations, materialize_inline, reindex_step, start_reindex
from shoal.log.records import AttributeType, IndexSpec

SOURCE = DataSourceSpec("docs", "1", 2, {"id": AttributeType.INT64}, ["id"])


def _index(version: str = "1") -> IndexSpec:
    return IndexSpec("ix", version, "docs", "1", algorithm="flat", metric="euclidean", id_attributes=["id"])


def _setup(shoal: Shoal, version: str = "1") -> None:
    shoal.create_data_source(SOURCE)
    shoal.producer("docs", "1").upload_columns(np.eye(2, dtype=np.float32), {"id": np.arange(2)})
    shoal.create_index(_index(version))
    _build(shoal, shoal.get_index("ix", version).id)


def _build(shoal: Shoal, index_id: int) -> None:
    builder = ShardBuilder(shoal.engine, shoal.storage)
    with Session(shoal.engine) as s:
        shard_ids = list(s.scalars(select(IndexShard.id).where(IndexShard.index_id == index_id)))
    for shard_id in shard_ids:
        builder.materialize(shard_id)


def _pid(conn: Connection) -> int:
    return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _blocked_by(shoal: Shoal, pid: int) -> Callable[[], int | None]:
    """A probe: the backend (if any) waiting for a lock `pid` holds."""

    def probe() -> int | None:
        with shoal.engine.connect() as c:
            return c.execute(text(
                "SELECT pid FROM pg_stat_activity"
                " WHERE datname = current_database() AND :pid = ANY(pg_blocking_pids(pid))"
            ), {"pid": pid}).scalar()

    return probe


def _run(target: Callable[[], object], errors: list[BaseException]) -> threading.Thread:
    def body() -> None:
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - every outcome is checked by the test
            errors.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    return thread


def _race_alias_with(shoal: Shoal, hold: int, change: Callable[[], object], alias: str) -> list[BaseException]:
    """Run `change` (a swap, rollback or drop) until it waits on index row `hold`'s lock (held by this test, so it
    stops after taking the locks it takes first), then set `alias` to ix/1 until that waits on `change`, then let
    both go; the errors each raised."""
    errors: list[BaseException] = []
    with shoal.engine.connect() as holder:
        holder.execute(select(Index.id).where(Index.id == hold).with_for_update())
        changing = _run(change, errors)
        wait_for(lambda: _blocked_by(shoal, _pid(holder))() is not None, 30, "the change to wait on the held row")
        changer = _blocked_by(shoal, _pid(holder))()
        assert changer is not None
        setter = _run(lambda: shoal.set_alias(alias, "ix", "1"), errors)
        wait_for(lambda: _blocked_by(shoal, changer)() is not None, 30, "set_alias to wait on the change")
        holder.rollback()
    for thread in (changing, setter):
        thread.join(60)
        assert not thread.is_alive()
    return errors


def test_an_alias_set_during_a_swap_names_the_new_generation_and_survives_the_sweep(local_shoal: Shoal) -> None:
    _setup(local_shoal)
    job = start_reindex(local_shoal.catalog, local_shoal.indexes, "ix", "1")
    assert job.to_index_id is not None
    _build(local_shoal, job.to_index_id)
    build = materialize_inline(ShardBuilder(local_shoal.engine, local_shoal.storage))
    # The swap takes the serving row's lock, then waits on the new generation's (held here) while set_alias runs.
    errors = _race_alias_with(
        local_shoal, job.to_index_id,
        lambda: reindex_step(local_shoal.engine, local_shoal.storage, job.id, build=build), "live",
    )
    assert errors == []
    assert local_shoal.reindex_jobs("ix", "1")[0].state == "swapped"
    serving = local_shoal.get_index("ix", "1")
    assert serving.id == job.to_index_id
    alias = local_shoal.get_alias("live")
    assert (alias.index_name, alias.index_version) == ("ix", "1")
    searcher = local_shoal.searcher(follow=False)
    try:
        hits = searcher.search_alias("live", np.eye(2, dtype=np.float32)[:1], 1)
        assert hits[0][0].attributes["id"] == 0
    finally:
        searcher.close()
    drop_expired_generations(local_shoal.engine, local_shoal.storage, 0)  # the replaced generation goes
    assert local_shoal.get_alias("live").index_version == "1"


def test_an_alias_set_during_a_rollback_names_the_generation_serving_again(local_shoal: Shoal) -> None:
    _setup(local_shoal)
    first = local_shoal.get_index("ix", "1").id
    local_shoal.reindex("ix", "1", wait=True)
    # The rollback takes the serving row's lock, then waits on the kept generation's (held here).
    errors = _race_alias_with(local_shoal, first, lambda: local_shoal.rollback("ix", "1"), "live")
    assert errors == []
    assert local_shoal.get_index("ix", "1").id == first
    alias = local_shoal.get_alias("live")
    assert (alias.index_name, alias.index_version) == ("ix", "1")
    local_shoal.reindex("ix", "1", wait=True)  # a later swap moves the alias along with the index
    assert local_shoal.get_alias("live").index_version == "1"


def test_an_alias_set_while_its_index_is_dropped_is_not_found(local_shoal: Shoal) -> None:
    _setup(local_shoal)
    index = local_shoal.get_index("ix", "1")
    errors: list[BaseException] = []
    with local_shoal.engine.connect() as holder:
        # The drop locks the index row, then waits on its shard rows (held here) while set_alias runs.
        holder.execute(select(IndexShard.id).where(IndexShard.index_id == index.id).with_for_update())
        dropping = _run(lambda: local_shoal.drop_index("ix", "1"), errors)
        wait_for(lambda: _blocked_by(local_shoal, _pid(holder))() is not None, 30, "the drop to wait on the shards")
        dropper = _blocked_by(local_shoal, _pid(holder))()
        assert dropper is not None
        setting = _run(lambda: local_shoal.set_alias("live", "ix", "1"), errors)
        wait_for(lambda: _blocked_by(local_shoal, dropper)() is not None, 30, "set_alias to wait on the drop")
        holder.rollback()
    for thread in (dropping, setting):
        thread.join(60)
        assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], NotFoundError), errors
    assert "'ix' version '1' not found" in str(errors[0])
    assert local_shoal.list_aliases() == []
    local_shoal.create_index(_index())
    assert local_shoal.set_alias("live", "ix", "1").index_version == "1"


def test_a_dropped_indexs_jobs_are_not_listed_for_one_made_again_over_the_same_source(local_shoal: Shoal) -> None:
    _setup(local_shoal)
    local_shoal.reindex("ix", "1", wait=True)
    local_shoal.reindex("ix", "1", wait=True)
    drop_expired_generations(local_shoal.engine, local_shoal.storage, 0)
    # The first job's generations are both gone (swept): it is still this index's.
    jobs = local_shoal.reindex_jobs("ix", "1")
    assert [j.state for j in jobs] == ["swapped", "swapped"]
    assert (jobs[1].from_index_id, jobs[1].to_index_id) == (None, None)
    local_shoal.drop_index("ix", "1")
    local_shoal.create_index(_index())
    assert local_shoal.reindex_jobs("ix", "1") == []
    # The new index's own jobs are listed, and only they.
    job = local_shoal.reindex("ix", "1", wait=True)
    assert [j.id for j in local_shoal.reindex_jobs("ix", "1")] == [job.id]


def test_a_version_too_long_for_its_generations_is_refused_before_anything_is_written(local_shoal: Shoal) -> None:
    version = "v" * 98  # legal (1..100 characters), but `...~g2` would be 101
    _setup(local_shoal, version)
    with pytest.raises(ValidationError, match=r"too long to reindex.*101 characters, over the limit of 100"):
        local_shoal.reindex("ix", version, algorithm="hnsw", wait=True)
    tenant = local_shoal.catalog.tenant_id
    with Session(local_shoal.engine) as s:
        assert s.scalar(select(ReindexJob.id).where(ReindexJob.tenant_id == tenant)) is None
        assert list(s.scalars(select(Index.version).where(Index.tenant_id == tenant))) == [version]
    assert local_shoal.reindex_jobs("ix", version) == []
    # A version that fits up to generation 9 reindexes until generation 10 would not fit.
    local_shoal.create_index(IndexSpec("ix", "w" * 97, "docs", "1", algorithm="flat", metric="euclidean",
                                       id_attributes=["id"]))
    for _ in range(8):  # generations 2..9
        assert local_shoal.reindex("ix", "w" * 97, wait=True).state == "swapped"
    with pytest.raises(ValidationError, match="generation 10 .* 101 characters"):
        local_shoal.reindex("ix", "w" * 97, wait=True)
    assert local_shoal.get_index("ix", "w" * 97).generation == 9


@pytest.fixture
def http_index(make_settings: Callable[..., Settings]) -> Iterator[str]:
    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with Shoal(settings, notify=False) as shoal:
        _setup(shoal, "v" * 100)
    with serve_api(settings) as base:
        yield base


def test_http_answers_400_for_a_reindex_of_a_version_too_long_for_its_generations(http_index: str) -> None:
    reindex = httpx.post(f"{http_index}/api/v1/indexes/ix/{'v' * 100}/reindex", json={}, timeout=30)
    assert reindex.status_code == 400, reindex.text
    assert "over the limit of 100" in reindex.text


def test_seq_headers_take_plain_digits_only(http_index: str) -> None:
    version = "v" * 100
    url = f"{http_index}/api/v1/search/ix/{version}"
    body = {"k": 1, "queryVectors": [{"isSparse": False, "coordinates": [1.0, 0.0]}]}
    for header in ("X-Shoal-As-Of", "X-Shoal-Required-Token"):
        for bad in ("0_1", "1_0", "+1", "0x1", "1 0", "-1", ""):
            found = httpx.post(url, json=body, headers={header: bad}, timeout=30)
            assert found.status_code == 400, (header, bad, found.text)
            assert "digits 0-9" in found.text, (header, bad, found.text)
        assert httpx.post(url, json=body, headers={header: "1"}, timeout=30).status_code == 200
