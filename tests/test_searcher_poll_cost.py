"""The searcher's poll (SearchService.refresh, every SHOAL_SEARCHER_POLL_S and on every version announcement)
costs a bounded number of catalog statements however many indexes are loaded, and only the indexes whose
catalog rows changed are loaded again: yet a new version, a drop, a data source moved to the trash, a commit to
the data source and an index made again under its name are each still picked up by the next poll."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Engine, event, update

from shoal import DataSourceSpec, Shoal
from shoal.catalog.models import DataSource
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec
from shoal.searcher.searcher import Searcher

DIM = 4


@contextmanager
def _statements(engine: Engine) -> Iterator[list[str]]:
    """The SQL statements `engine` sends while the block runs."""
    sent: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        yield sent
    finally:
        event.remove(engine, "before_cursor_execute", count)


def _upload(shoal: Shoal, source: str, ids: range) -> int:
    vectors = np.random.default_rng(ids.start).standard_normal((len(ids), DIM)).astype(np.float32)
    return shoal.producer(source, "1").upload_columns(vectors, {"id": np.array(ids, dtype=np.int64)}).seq


def _build(shoal: Shoal, index: str) -> None:
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for shard in shoal.get_index(index, "1").shards:
        builder.materialize(shard.id)


def _make(shoal: Shoal, sources: int, per_source: int) -> list[str]:
    """`sources` data sources with 20 points each and `per_source` built flat indexes over each; their names."""
    names = []
    for s in range(sources):
        shoal.create_data_source(DataSourceSpec(f"src{s}", "1", DIM, {"id": "int64"}, ["id"]))
        _upload(shoal, f"src{s}", range(20))
        for i in range(per_source):
            name = f"src{s}.idx{i}"
            shoal.create_index(IndexSpec(name, "1", f"src{s}", "1", algorithm="FaissIndex.L2"))
            _build(shoal, name)
            names.append(name)
    return names


@pytest.fixture
def served(make_shoal: Callable[..., Shoal]) -> Iterator[tuple[Shoal, Searcher, list[str]]]:
    """30 loaded indexes (3 data sources x 10) and a searcher that does not follow on its own (the test polls),
    polled twice so that it knows what each index was loaded from."""
    shoal = make_shoal("local")
    names = _make(shoal, 3, 10)
    searcher = shoal.searcher(follow=False)
    for name in names:
        searcher.view(name, "1")
    searcher.refresh()
    searcher.refresh()
    yield shoal, searcher, names
    searcher.close()


def test_a_poll_of_unchanged_indexes_costs_statements_independent_of_their_number(
    served: tuple[Shoal, Searcher, list[str]],
) -> None:
    shoal, searcher, names = served
    with _statements(shoal.engine) as sent:
        searcher.refresh()
    # Before: at least two statements per loaded index (IndexCatalog.serving), 60+ here.
    assert len(sent) <= 2, sent
    assert all(searcher.loaded(name, "1") for name in names)


def test_a_poll_still_picks_up_each_kind_of_change(served: tuple[Shoal, Searcher, list[str]]) -> None:
    shoal, searcher, names = served
    service = searcher.service

    # A new version of one index: served after the next poll, which loads no other index again.
    before = searcher.served_watermarks("src0.idx0", "1")
    seq = _upload(shoal, "src0", range(100, 110))
    _build(shoal, "src0.idx0")
    with _statements(shoal.engine) as sent:
        searcher.refresh()
    assert searcher.served_watermarks("src0.idx0", "1") == {0: seq} != before
    # The commit moved src0's head too: its 10 indexes load again (each reads its shards once), the 20 others not.
    assert len([q for q in sent if "WHERE index_shards.index_id = " in q]) == 10, sent

    # A commit to a data source (no build): the poll reads its new head (what the young tier follows when no
    # announcement arrives).
    source_id = shoal.get_data_source("src1", "1").id
    seq = _upload(shoal, "src1", range(200, 205))
    searcher.refresh()
    assert service._heads[source_id] == seq

    # An index dropped: no longer served.
    shoal.drop_index("src1.idx3", "1")
    searcher.refresh()
    assert not searcher.loaded("src1.idx3", "1")
    assert searcher.loaded("src1.idx4", "1")

    # An index made again under its name (another index row: another definition, no versions yet).
    old_id = searcher.view("src1.idx5", "1").index.id
    shoal.drop_index("src1.idx5", "1")
    shoal.create_index(IndexSpec("src1.idx5", "1", "src1", "1", algorithm="FaissIndex.IP"))
    searcher.refresh()
    view = searcher.service._views[(shoal.scope.tenant_id, "src1.idx5", "1")]  # the poll swapped it in
    assert view.index.id != old_id and view.index.spec.metric != shoal.get_index("src1.idx4", "1").spec.metric

    # A data source moved to the trash (its row alone, as a soft delete marks it): its indexes are no more served.
    with shoal.engine.begin() as conn:
        conn.execute(update(DataSource).where(DataSource.id == shoal.get_data_source("src2", "1").id)
                     .values(deleted_at=DataSource.created_at))
    searcher.refresh()
    assert not any(searcher.loaded(f"src2.idx{i}", "1") for i in range(10))
    assert searcher.loaded("src0.idx0", "1")

    # What was unloaded is forgotten with it.
    assert set(service._fingerprints) <= set(service._views)


def test_a_failed_refresh_is_retried_at_every_poll(
    served: tuple[Shoal, Searcher, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    shoal, searcher, _ = served
    service = searcher.service
    seq = _upload(shoal, "src0", range(100, 110))
    _build(shoal, "src0.idx0")
    load = service._load
    failing = {"on": True}

    def flaky(scope: Any, name: str, version: str) -> Any:
        if failing["on"] and name == "src0.idx0":
            raise OSError("storage away")
        return load(scope, name, version)

    monkeypatch.setattr(service, "_load", flaky)
    searcher.refresh()
    assert searcher.served_watermarks("src0.idx0", "1") != {0: seq}  # still the version it held
    searcher.refresh()  # nothing changed in the catalog since: retried all the same
    failing["on"] = False
    searcher.refresh()
    assert searcher.served_watermarks("src0.idx0", "1") == {0: seq}
