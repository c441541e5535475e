"""The young tier counts toward SHOAL_SEARCHER_CACHE_BYTES: indexes whose points no worker has built hold only a
young tier (the log entries decoded, exact engines over them), which the budget ignored. One search of each of
900 such indexes took an API from 538 MiB to 2,283 MiB while it reported 0 bytes loaded. The least recently
searched indexes are unloaded until segments and young tiers fit, as for segments alone."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from conftest import wait_for

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec

DIM = 16
NAMES = ["Y0", "Y1", "Y2", "Y3", "Y4"]


def _unbuilt_index(shoal: Shoal, name: str, seed: int) -> np.ndarray:
    """A data source and flat index `name` with 200 points uploaded and never built; returns the vectors."""
    shoal.create_data_source(DataSourceSpec(name, "1", DIM, {"id": "int64"}, ["id"]))
    shoal.create_index(IndexSpec(f"{name}.Index", "1", name, "1", algorithm="flat", metric="euclidean",
                                 id_attributes=["id"]))
    vectors = np.random.default_rng(seed).normal(size=(200, DIM)).astype(np.float32)
    shoal.producer(name, "1").upload_columns(vectors, {"id": np.arange(200)})
    return vectors


def _nearest(searcher: object, name: str, query: np.ndarray) -> int:
    hits = searcher.search(f"{name}.Index", "1", query[None], 1)  # type: ignore[attr-defined]
    return int(hits[0].column("id")[0])


def test_young_tiers_are_kept_within_the_budget(make_settings: Callable[..., Settings], redis_url: str) -> None:
    settings = make_settings("local", redis_url=redis_url)
    with Shoal(settings, notify=False) as probe:  # no worker: nothing is ever built
        vectors = {name: _unbuilt_index(probe, name, seed) for seed, name in enumerate(NAMES)}
        searcher = probe.searcher(follow=True, poll_interval=30.0)  # a followed view reads its young tier at load
        try:
            assert _nearest(searcher, "Y0", vectors["Y0"][3]) == 3
            assert probe.runtime.segment_cache.bytes == 0  # no built version: a young tier alone
            one = sum(t.nbytes for t in searcher.service._tails.values())
            assert one > vectors["Y0"].nbytes, one  # the vectors at least, decoded from the log
        finally:
            searcher.close()
    budget = int(one * 2.5)  # room for two indexes' young tiers, not three
    with Shoal(settings.model_copy(update={"searcher_cache_bytes": budget}), notify=False) as shoal:
        searcher = shoal.searcher(follow=True, poll_interval=30.0)
        service = searcher.service
        try:
            for i, name in enumerate(NAMES):
                assert _nearest(searcher, name, vectors[name][i]) == i
                held = shoal.runtime.segment_cache.bytes + sum(t.nbytes for t in service._tails.values())
                assert held <= budget, (name, held, budget)
            loaded = [n for n in NAMES if searcher.loaded(f"{n}.Index", "1")]
            assert loaded == ["Y3", "Y4"], loaded  # the least recently searched were unloaded
            # An unloaded index is loaded again on its next search, answers from its young tier, and the least
            # recently searched one (Y3) goes in turn.
            assert _nearest(searcher, "Y0", vectors["Y0"][7]) == 7
            loaded = [n for n in NAMES if searcher.loaded(f"{n}.Index", "1")]
            assert loaded == ["Y0", "Y4"], loaded
            held = shoal.runtime.segment_cache.bytes + sum(t.nbytes for t in service._tails.values())
            assert held <= budget
            assert service.loaded_bytes == service.young_bytes == held  # what the searcher reports, it holds
        finally:
            searcher.close()


def _tier_end(service: object, name: str) -> int:
    """How far the young tier of index `name` reaches (0: none held)."""
    for view in list(service._views.values()):  # type: ignore[attr-defined]
        if view.index.spec.name == f"{name}.Index":
            tier = service._tails.get(view.index.id)  # type: ignore[attr-defined]
            return tier.end if tier is not None else 0
    return 0


def test_a_young_tier_grown_by_the_follower_unloads_others(make_settings: Callable[..., Settings],
                                                          redis_url: str) -> None:
    """A young tier that grows after its index loaded (the follower extends it as commits are announced) counts at
    once: the least recently searched other indexes are unloaded to fit, never the one that grew (even when it is
    the least recently searched). It counted only at the next load, so a process ran past its budget with no load
    happening."""
    settings = make_settings("local", redis_url=redis_url)
    with Shoal(settings, notify=False) as probe:
        vectors = {name: _unbuilt_index(probe, name, seed) for seed, name in enumerate(["G0", "G1"])}
        searcher = probe.searcher(follow=True, poll_interval=30.0)
        try:
            assert _nearest(searcher, "G0", vectors["G0"][3]) == 3
            one = sum(t.nbytes for t in searcher.service._tails.values())
        finally:
            searcher.close()
    budget = int(one * 2.5)  # both indexes fit as loaded; G1 grown to twice its points does not fit beside G0
    with Shoal(settings.model_copy(update={"searcher_cache_bytes": budget}), notify=False) as shoal:
        searcher = shoal.searcher(follow=True, poll_interval=30.0)  # no poll: no load happens after the searches
        service = searcher.service
        try:
            assert _nearest(searcher, "G1", vectors["G1"][4]) == 4
            assert _nearest(searcher, "G0", vectors["G0"][5]) == 5  # G1 is now the least recently searched
            assert searcher.loaded("G0.Index", "1") and searcher.loaded("G1.Index", "1")
            assert service.loaded_bytes <= budget
            grown = shoal.producer("G1", "1").upload_columns(vectors["G1"] + 5.0, {"id": np.arange(200, 400)})
            wait_for(lambda: _tier_end(service, "G1") >= grown.seq, 20, "the follower to extend G1's young tier")
            wait_for(lambda: not searcher.loaded("G0.Index", "1"), 10, "G0 to be unloaded")
            assert searcher.loaded("G1.Index", "1")  # the tier that grew stays, least recently searched or not
            assert service.loaded_bytes <= budget
            assert _nearest(searcher, "G1", vectors["G1"][9] + 5.0) == 209  # answered from the grown tier
        finally:
            searcher.close()


def test_an_index_whose_young_tier_passes_the_budget_is_still_served(
    make_settings: Callable[..., Settings], redis_url: str,
) -> None:
    """A built index whose segments fit the budget, with updates no worker built yet that take its young tier
    past it, answers every search (eventual from the young tier, strong too) rather than 503: a lagging build
    costs memory past the budget until builds catch up, never the index's availability. It answered
    CapacityError at every consistency until a worker built the updates."""
    settings = make_settings("local", redis_url=redis_url)
    rng = np.random.default_rng(11)
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec("U", "1", DIM, {"id": "int64"}, ["id"]))
        shoal.create_index(IndexSpec("U.Index", "1", "U", "1", algorithm="flat", metric="euclidean",
                                     id_attributes=["id"]))
        ids = np.arange(300)
        shoal.producer("U", "1").upload_columns(rng.normal(size=(300, DIM)).astype(np.float32), {"id": ids})
        for shard in shoal.get_index("U.Index", "1").shards:
            ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
        latest = np.empty((300, DIM), dtype=np.float32)
        for _ in range(8):  # updates of the same 300 points, never built
            latest = rng.normal(size=(300, DIM)).astype(np.float32)
            shoal.producer("U", "1").upload_columns(latest, {"id": ids})
        searcher = shoal.searcher(follow=True, poll_interval=30.0)
        try:
            assert _nearest(searcher, "U", latest[3]) == 3
            segments, young = shoal.runtime.segment_cache.bytes, searcher.service.young_bytes
        finally:
            searcher.close()
    assert 0 < segments < young, (segments, young)  # the unbuilt updates outweigh the built index
    budget = (segments + young) // 2  # the segments fit, not with the young tier
    with Shoal(settings.model_copy(update={"searcher_cache_bytes": budget}), notify=False) as shoal:
        searcher = shoal.searcher(follow=True, poll_interval=30.0)
        try:
            assert _nearest(searcher, "U", latest[5]) == 5  # eventual: the young tier shows the updates
            hits = searcher.search("U.Index", "1", latest[7][None], 1, consistency="strong")
            assert int(hits[0].column("id")[0]) == 7
            assert searcher.loaded("U.Index", "1")
        finally:
            searcher.close()
