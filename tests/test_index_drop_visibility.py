"""A strong search learns of a drop of the index it serves at once, also while the index's data source stays
(README, HTTP API: "A `strong` search reads the head, so it learns of a drop at once"): it answers from the index
made again under the name (its own metric), or NotFoundError, never from the dropped index's definition and
versions. A searcher that does not follow, or follows without Redis, checks the index in the catalog head read
it makes anyway (same query); one that follows announcements on Redis reads the data source's index token with
the announced head, which a drop sets anew before it returns, and so still makes no catalog round trip while
nothing changed.

No worker runs: the tests build the indexes in-process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for
from sqlalchemy import event

from shoal import DataPoint, DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.errors import NotFoundError
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec
from shoal.searcher.consistency import Consistency
from shoal.searcher.searcher import Searcher
from shoal.servers.embedded import ensure_valkey, stop_embedded

SOURCE = DataSourceSpec("drops", "1", 2, {"id": "int64"}, ["id"])
QUERY = [[1.0, 0.0]]
STRONG = Consistency.strong()
# Points (i, 0) for i in 0..9: euclidean's nearest to (1, 0) are 1 and 0; dot product's are 9 and 8.
EUCLIDEAN = [(1, 0.0), (0, 1.0)]
DOT = [(9, 9.0), (8, 8.0)]


def _index(metric: str) -> IndexSpec:
    return IndexSpec("I", "1", SOURCE.name, SOURCE.version, algorithm="flat", metric=metric)


def _made(shoal: Shoal) -> None:
    """The data source with ten points and index I (euclidean), built."""
    shoal.create_data_source(SOURCE)
    shoal.create_index(_index("euclidean"))
    shoal.producer(SOURCE.name, SOURCE.version).upload(
        [DataPoint({"id": i}, [float(i), 0.0]) for i in range(10)])
    _build(shoal)


def _build(shoal: Shoal) -> None:
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for shard in shoal.get_index("I", "1").shards:
        builder.materialize(shard.id)


def _strong(searcher: Searcher) -> list[tuple[int, float]]:
    hits = searcher.search("I", "1", QUERY, 2, consistency=STRONG)[0]
    return [(h.attributes["id"], round(h.distance, 6)) for h in hits]


def _remake(dropper: Shoal, maker: Shoal, metric: str) -> None:
    """Drop index I through `dropper`, then make it again with `metric` through `maker`, built."""
    dropper.drop_index("I", "1")
    maker.create_index(_index(metric))
    _build(maker)


def _drop_and_remake(searcher: Searcher, dropper: Shoal, maker: Shoal) -> None:
    """Drop index I under a searcher serving it, check strong answers NotFoundError at once, then make it
    again (dot product) and check strong answers from the new index at once; then drop and remake it in one go
    while the searcher serves it, and check again."""
    assert _strong(searcher) == EUCLIDEAN
    dropper.drop_index("I", "1")
    with pytest.raises(NotFoundError, match="not found|dropped"):
        _strong(searcher)
    maker.create_index(_index("dot_product"))
    _build(maker)
    assert _strong(searcher) == DOT
    _remake(dropper, maker, "euclidean")
    assert _strong(searcher) == EUCLIDEAN


def test_a_non_following_searcher_learns_of_a_drop_at_its_next_strong_search(
    make_shoal: Callable[..., Shoal],
) -> None:
    shoal = make_shoal()
    _made(shoal)
    searcher = shoal.searcher(follow=False)  # never polls: only its own reads tell it of a drop
    try:
        _drop_and_remake(searcher, shoal, shoal)
    finally:
        searcher.close()


def test_a_following_searcher_without_redis_learns_of_a_drop_at_its_next_strong_search(
    make_shoal: Callable[..., Shoal],
) -> None:
    shoal = make_shoal()  # its Redis URL answers nothing: the searcher asks the catalog for heads
    _made(shoal)
    searcher = shoal.searcher(follow=True, poll_interval=30.0)  # no poll within the test
    try:
        assert not searcher.service.heads_followed
        _drop_and_remake(searcher, shoal, shoal)
    finally:
        searcher.close()


class _CatalogReads:
    """Counts the SQL statements this thread sends to an engine (the searcher's own threads are not counted)."""

    def __init__(self, shoal: Shoal) -> None:
        self.count = 0
        self._engine = shoal.engine
        self._thread = threading.get_ident()
        event.listen(self._engine, "before_cursor_execute", self._seen)

    def _seen(self, *_: Any) -> None:
        if threading.get_ident() == self._thread:
            self.count += 1

    def close(self) -> None:
        event.remove(self._engine, "before_cursor_execute", self._seen)


@pytest.fixture
def followed(make_settings: Callable[..., Settings], redis_url: str) -> Iterator[tuple[Shoal, Shoal]]:
    """(a Shoal that queues no worker task, one that announces its drops on Redis), on one tenant."""
    settings = make_settings("local", redis_url=redis_url)
    quiet = Shoal(settings, notify=False)
    # Only drops go through this one: with notify, a drop is announced (a commit or a made index would queue
    # materialization tasks on the shared Redis).
    loud = Shoal(settings)
    try:
        yield quiet, loud
    finally:
        loud.close()
        quiet.close()


def test_a_following_searcher_learns_of_an_announced_drop_at_once_and_reads_no_catalog_while_nothing_changed(
    followed: tuple[Shoal, Shoal],
) -> None:
    quiet, loud = followed
    _made(quiet)
    searcher = quiet.searcher(follow=True, poll_interval=30.0)  # announcements, not polls
    reads = _CatalogReads(quiet)
    try:
        wait_for(lambda: searcher.service.heads_followed, 15, "the searcher to follow announced heads")
        for _ in range(3):  # the first ones check the head and the index in the catalog once
            assert _strong(searcher) == EUCLIDEAN
        reads.count = 0
        for _ in range(20):
            assert _strong(searcher) == EUCLIDEAN
        assert reads.count == 0  # nothing changed: Redis answered alone
        for _ in range(5):  # the announcement reaches the poll thread later; strong must not wait for it
            _drop_and_remake(searcher, loud, quiet)
            assert _strong(searcher) == EUCLIDEAN  # the made index checked once in the catalog, then Redis alone
            reads.count = 0
            assert _strong(searcher) == EUCLIDEAN
            assert reads.count == 0
    finally:
        reads.close()
        searcher.close()


@pytest.fixture
def own_valkey(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """(home, URL) of a Valkey of this test alone (it is stopped and started; the session's stays up)."""
    home = tmp_path / "own-valkey"
    url = ensure_valkey(home)
    try:
        yield home, url
    finally:
        stop_embedded(home)


def test_a_following_searcher_learns_of_a_drop_whose_announcement_redis_lost(
    make_settings: Callable[..., Settings], own_valkey: tuple[Path, str],
) -> None:
    """The index is dropped and made again while Redis is away, so the drop's announcement (and the new index
    token) never lands; Redis comes back as it was. Strong searches answer from the index made again, both
    while Redis is away and once the searcher follows it again."""
    home, url = own_valkey
    settings = make_settings("local", redis_url=url)
    with Shoal(settings, notify=False) as quiet, Shoal(settings) as loud:
        _made(quiet)
        searcher = quiet.searcher(follow=True, poll_interval=30.0)
        try:
            wait_for(lambda: searcher.service.heads_followed, 15, "the searcher to follow announced heads")
            for _ in range(3):
                assert _strong(searcher) == EUCLIDEAN
            stop_embedded(home)
            wait_for(lambda: not searcher.service.heads_followed, 15, "the searcher to notice Redis is gone")
            _remake(loud, quiet, "dot_product")  # its drop's announcement fails (logged): Redis is away
            assert _strong(searcher) == DOT
            _remake(loud, quiet, "euclidean")
            assert ensure_valkey(home) == url
            wait_for(lambda: searcher.service.heads_followed, 15, "the searcher to follow announced heads again")
            assert _strong(searcher) == EUCLIDEAN
            loud.drop_index("I", "1")  # announced again
            with pytest.raises(NotFoundError):
                _strong(searcher)
        finally:
            searcher.close()


def test_a_following_searcher_learns_of_a_dropped_data_source_at_once(followed: tuple[Shoal, Shoal]) -> None:
    """A drop of the whole data source (index and all) was announced to nobody: a following searcher's strong
    searches trusted the head Redis still held and answered from the dropped index, even once the source and
    index were made again and written to."""
    quiet, loud = followed
    _made(quiet)
    searcher = quiet.searcher(follow=True, poll_interval=30.0)
    try:
        wait_for(lambda: searcher.service.heads_followed, 15, "the searcher to follow announced heads")
        for _ in range(3):
            assert _strong(searcher) == EUCLIDEAN
        loud.drop_data_source(SOURCE.name, SOURCE.version)
        with pytest.raises(NotFoundError):
            _strong(searcher)
        quiet.create_data_source(SOURCE)
        quiet.create_index(_index("dot_product"))
        quiet.producer(SOURCE.name, SOURCE.version).upload(
            [DataPoint({"id": i}, [float(i), 0.0]) for i in range(100, 110)])
        assert [i for i, _ in _strong(searcher)] == [109, 108]  # the acknowledged writes, not the dropped data
    finally:
        searcher.close()


@pytest.mark.parametrize("follow", [False, True])
def test_a_data_source_moved_to_the_trash_stops_strong_searches_of_its_index(
    followed: tuple[Shoal, Shoal], follow: bool
) -> None:
    """A source moved to the trash (a dataset deleted) kept answering strong searches of its loaded index, on
    every searcher: the head read found the rows, which the trash keeps."""
    from shoal.datasets.rules import VERSION
    from shoal.datasets.service import DatasetService

    quiet, loud = followed
    searcher = quiet.searcher(follow=follow, poll_interval=30.0)
    # The delete comes from another process (its own searcher is the one it refreshes).
    theirs = loud.searcher(follow=False)
    try:
        service = DatasetService(loud, theirs)
        service.create("trashme", 2, metric_type="euclidean", index_type="flat")
        if follow:
            wait_for(lambda: searcher.service.heads_followed, 15, "the searcher to follow announced heads")
        service.upsert("trashme", [{"id": "a", "values": [1.0, 0.0]}])
        # The dataset's index, searched as any index (Vektonn's route, the Python API).
        assert searcher.search("trashme", VERSION, QUERY, 1, consistency=STRONG)[0]
        service.delete("trashme")
        with pytest.raises(NotFoundError):
            searcher.search("trashme", VERSION, QUERY, 1, consistency=STRONG)
    finally:
        theirs.close()
        searcher.close()
