"""One `Shoal` shared by many threads, as a web app shares it: searchers made and closed while others search
under one memory budget, data sources dropped while others look them up. Each race ran for a bounded time with
the interpreter switching threads very often (sys.setswitchinterval), which makes the interleavings that broke
frequent; the assertion is what a user checks: no error a single thread would not get. Real Postgres, storage
and index builds; nothing mocked."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from shoal import Shoal
from shoal.config.settings import Settings
from shoal.errors import ShoalError
from shoal.index.builder import ShardBuilder
from shoal.log.records import DataSourceSpec, IndexSpec

DIM = 64


@pytest.fixture
def fast_switching() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _race(seconds: float, workers: list[Callable[[], None]]) -> list[str]:
    """Run each worker in a loop in its own thread for `seconds`; the errors they raised (as text)."""
    stop = threading.Event()
    errors: list[str] = []

    def loop(work: Callable[[], None]) -> None:
        while not stop.is_set():
            try:
                work()
            except Exception as exc:  # noqa: BLE001 - every error is what the test reports
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=loop, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    return errors


def test_searchers_sharing_a_budget_answer_every_search_of_an_index_that_fits(
    make_settings: Callable[..., Settings], fast_switching: None
) -> None:
    """Two indexes, each alone within the process's searcher budget, not both. One searcher shared by threads
    alternating between them, while other threads make a searcher, search and close it: searches failed with a
    CapacityError ("needs about 0 bytes ... more than this process's budget", counting what another searcher had
    just loaded), and with an AttributeError from a searcher seen by the others before it was fully made."""
    with Shoal(make_settings("local", searcher_cache_bytes=1 << 20), notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec("s", "1", DIM, {"id": "int64"}, ["id"]))
        for name in ("a", "b"):
            shoal.create_index(IndexSpec(name, "1", "s", "1", algorithm="flat", metric="l2_squared",
                                         id_attributes=["id"]))
        vectors = np.random.default_rng(0).random((1400, DIM), dtype=np.float32)
        shoal.producer("s", "1").upload_columns(vectors, {"id": np.arange(1400)})
        builder = ShardBuilder(shoal.engine, shoal.storage)
        for name in ("a", "b"):
            for shard in shoal.get_index(name, "1").shards:
                builder.materialize(shard.id)
        shared = shoal.searcher(follow=False)
        try:
            shared.search("a", "1", vectors[:1], 1)
            assert shoal.runtime.segment_cache.bytes * 2 > (1 << 20)  # the two do not fit together

            def alternate() -> None:
                for name in ("a", "b"):
                    [hits] = shared.search(name, "1", vectors[7:8], 1)
                    assert [h.attributes["id"] for h in hits] == [7]

            def churn(name: str) -> Callable[[], None]:
                def run() -> None:
                    own = shoal.searcher(follow=False)
                    try:
                        own.search(name, "1", vectors[:1], 1)
                    finally:
                        own.close()
                return run

            errors = _race(8.0, [alternate] * 3 + [churn("a"), churn("b"), churn("a")])
        finally:
            shared.close()
    assert errors == [], errors[:5]


def test_dropping_data_sources_while_others_look_them_up(
    make_settings: Callable[..., Settings], fast_switching: None
) -> None:
    """A drop committed, then failed with "dictionary changed size during iteration" (the runtime's cache of
    source definitions was written beside the drop's walk of it), so the caller (and HTTP, a 500) was told a
    drop that happened had failed."""
    with Shoal(make_settings("local"), notify=False) as shoal:
        names = [f"s{i}" for i in range(200)]
        for name in names:
            shoal.create_data_source(DataSourceSpec(name, "1", 2, {"id": "int64"}, ["id"]))
        rng = np.random.default_rng(1)
        made = iter(range(10**9))

        def look_up() -> None:
            try:
                shoal.check_backpressure(names[int(rng.integers(len(names)))], "1")
            except ShoalError:
                pass  # not found while dropped: the answer a single thread gets too

        def make_and_look_up() -> None:
            name = f"new{next(made)}"
            shoal.create_data_source(DataSourceSpec(name, "1", 2, {"id": "int64"}, ["id"]))
            shoal.check_backpressure(name, "1")

        def drop_and_remake() -> None:
            name = names[int(rng.integers(len(names)))]
            try:
                shoal.drop_data_source(name, "1")
            except ShoalError:
                return
            shoal.create_data_source(DataSourceSpec(name, "1", 2, {"id": "int64"}, ["id"]))

        errors = _race(8.0, [look_up, look_up, make_and_look_up, make_and_look_up, drop_and_remake])
    assert errors == [], errors[:5]
