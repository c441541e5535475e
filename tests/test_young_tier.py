"""The young tier and heads announced on Redis (issue 14): a following searcher answers eventual searches
with writes no worker has built yet (up to SHOAL_YOUNG_TIER_MAX_SEQS past the served watermark), and strong
searches from the head announced on Redis, never missing an acknowledged write: not while commits race the
queries, and not after a Redis restart that lost announcements.

No worker runs in these tests unless said: what eventual searches show beyond the served version comes from
the young tier alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import wait_for

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.errors import ValidationError
from shoal.index.builder import ShardBuilder
from shoal.log.heads import read_head
from shoal.log.records import IndexSpec
from shoal.searcher.consistency import Consistency
from shoal.servers.embedded import ensure_valkey, stop_embedded

DIM = 16


def _vectors(ids: np.ndarray) -> np.ndarray:
    """A distinct unit vector per id (its own nearest neighbour by far)."""
    v = np.stack([np.random.default_rng(int(n)).standard_normal(DIM) for n in ids]).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


class Setup:
    """A data source with a flat index, 200 points built in-process, and a following searcher serving it."""

    def __init__(self, settings: Settings, algorithm: str = "flat") -> None:
        self.shoal = Shoal(settings, notify=False)  # no worker: nothing but the test builds
        tag = f"{time.monotonic_ns() % 10**9}"
        self.source = DataSourceSpec(f"young-{tag}", "1", DIM, {"id": "int64"}, ["id"])
        self.shoal.create_data_source(self.source)
        self.index = f"young-{tag}-idx"
        self.shoal.create_index(IndexSpec(self.index, "1", self.source.name, "1", algorithm=algorithm,
                                          metric="cosine"))
        self.producer = self.shoal.producer(self.source.name, "1")
        self.upload(np.arange(200))
        ShardBuilder(self.shoal.engine, self.shoal.storage).materialize(
            self.shoal.get_index(self.index, "1").shards[0].id)
        self.searcher = self.shoal.searcher(follow=True, poll_interval=30.0)  # announcements, not polls
        self.built = self.served()
        assert self.built == 200

    def upload(self, ids: np.ndarray) -> int:
        return self.producer.upload_columns(_vectors(ids), {"id": ids.astype(np.int64)}).seq

    def served(self) -> int:
        return min(self.searcher.served_watermarks(self.index, "1").values())

    def nearest(self, point_id: int, consistency: Consistency | None = None) -> int | None:
        hits = self.searcher.search(self.index, "1", _vectors(np.array([point_id])), 1, consistency=consistency)[0]
        return next((h.attributes["id"] for h in hits), None)

    def close(self) -> None:
        self.searcher.close()
        self.shoal.close()


@pytest.fixture
def setup(make_settings: Callable[..., Settings], redis_url: str) -> Iterator[Callable[..., Setup]]:
    made: list[Setup] = []

    def make(**overrides: object) -> Setup:
        made.append(Setup(make_settings("local", redis_url=redis_url, **overrides)))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_eventual_shows_a_write_no_worker_built(setup: Callable[..., Setup]) -> None:
    s = setup()
    latencies = []
    for n in range(20):
        point = 1_000 + n
        s.upload(np.array([point]))
        acked = time.monotonic()
        wait_for(lambda point=point: s.nearest(point) == point, 10,  # type: ignore[misc]
                 f"an eventual search to return point {point} (written, not built)")
        latencies.append(time.monotonic() - acked)
    print(f"write -> visible to eventual (no worker): p50 {np.median(latencies) * 1000:.1f} ms, "
          f"max {max(latencies) * 1000:.1f} ms")
    assert s.served() == s.built  # nothing was built: the young tier answered
    # The status says so: 20 entries past the served watermark, all in the young tier.
    status = s.shoal.index_status(s.index, "1")[0]
    assert (status.lag_seqs, status.young_tier_seqs) == (20, 20)
    rows = {(r[1], r[3]): r for r in s.searcher.service.young_tier()}
    assert rows[(s.index, 0)][4] == 20


def test_the_first_eventual_search_of_a_searcher_shows_what_was_written_before_it_loaded_the_index(
    setup: Callable[..., Setup],
) -> None:
    """A searcher that loads the index now (a process started, the index searched there for the first time)
    answers its first eventual search with every write acknowledged before, built or not: no announcement will
    come for those, and its next poll may be far off (30 s here)."""
    s = setup()
    s.upload(np.array([2_000]))
    s.upload(np.array([2_001, 2_002]))
    late = s.shoal.searcher(follow=True, poll_interval=30.0)
    try:
        for point in (2_000, 2_001, 2_002, 7):
            hits = late.search(s.index, "1", _vectors(np.array([point])), 1)[0]
            assert [h.attributes["id"] for h in hits] == [point]
    finally:
        late.close()


def test_a_new_version_is_served_with_its_young_tier_and_a_stale_extension_does_not_replace_it(
    setup: Callable[..., Setup],
) -> None:
    """The loader derives the young tier for a new version before serving it, so no search has to; an extension
    made for the version served before (the follower's, racing the load) does not replace it."""
    s = setup()
    s.upload(np.arange(1_000, 1_050))
    wait_for(lambda: s.searcher.visible_watermarks(s.index, "1")[0] == s.built + 50, 10,
             "the young tier to hold the 50 new entries")
    service = s.searcher.service
    old_view = s.searcher.view(s.index, "1")
    index_id = old_view.index.id
    s.upload(np.arange(1_050, 1_060))
    ShardBuilder(s.shoal.engine, s.shoal.storage).materialize(old_view.shards[0].shard_id)  # builds the 60
    s.searcher.refresh()
    new_view = s.searcher.view(s.index, "1")
    assert new_view.versions != old_view.versions
    young = service._tails[index_id]
    assert young.versions == new_view.versions  # derived with the load, before any search
    # The follower's extension for the old view, finishing after the load: the served view keeps its tails.
    service._extend(old_view, young.end)
    assert service._tails[index_id].versions == new_view.versions
    assert all(s.nearest(p) == p for p in range(1_000, 1_060, 3))


def test_searches_answer_from_the_young_tiers_own_view_until_the_new_versions_tier_is_derived(
    setup: Callable[..., Setup], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A version swapped in before its young tier is derived (the follower's extension for the old view won
    the race): eventual and strong searches answer from the view that tier was derived for, consistently
    (new points shown, a deleted one hidden, an updated one once), and never derive it themselves."""
    import shoal.searcher.searcher as searcher_module

    s = setup()
    s.upload(np.arange(1_000, 1_040))
    s.producer.delete({"id": np.array([5], dtype=np.int64)})  # built: its row hides under the young tier
    moved = np.array([7], dtype=np.int64)
    token = s.producer.upload_columns(_vectors(np.array([5_007])), {"id": moved}).seq  # point 7 moves
    wait_for(lambda: s.searcher.visible_watermarks(s.index, "1")[0] == token, 10,
             "the young tier to hold the 42 new entries")
    service = s.searcher.service
    old_view = s.searcher.view(s.index, "1")
    ShardBuilder(s.shoal.engine, s.shoal.storage).materialize(old_view.shards[0].shard_id)
    s.searcher.refresh()
    new_view = s.searcher.view(s.index, "1")
    assert new_view.versions != old_view.versions
    # The race, made to happen: the young tier served is the one derived for the old view.
    service._tails.pop(old_view.index.id)
    service._extend(old_view, token)
    assert service._tails[old_view.index.id].versions == old_view.versions

    derived_here: list[str] = []
    real_extend = searcher_module.extend

    def watched_extend(*args: object, **kwargs: object) -> object:
        if threading.current_thread() is threading.main_thread():
            derived_here.append("extend")
        return real_extend(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(searcher_module, "extend", watched_extend)
    for level in (None, Consistency.strong()):
        assert all(s.nearest(p, level) == p for p in range(1_000, 1_040, 3))
        assert s.nearest(5, level) != 5
        hits = s.searcher.search(s.index, "1", _vectors(np.array([5_007])), 3, consistency=level)[0]
        ids = [h.attributes["id"] for h in hits]
        assert ids[0] == 7 and ids.count(7) == 1
    assert derived_here == [], "a search derived the young tier itself"
    service.follow_heads()  # the follower's next pass derives the new version's tier
    assert service._tails[old_view.index.id].versions == new_view.versions
    assert s.nearest(5) != 5 and s.nearest(1_039) == 1_039


def test_the_young_tier_is_bounded_and_strong_still_sees_everything(setup: Callable[..., Setup]) -> None:
    s = setup(young_tier_max_seqs=50)
    token = s.upload(np.arange(1_000, 1_120))  # 120 entries past the served watermark, one commit
    assert token == s.built + 120
    wait_for(lambda: s.searcher.visible_watermarks(s.index, "1")[0] == s.built + 50, 10,
             "the young tier to reach 50 entries past the served watermark")
    # Eventual shows the first 50 entries exactly, none after them.
    assert all(s.nearest(p) == p for p in range(1_000, 1_050))
    assert all(s.nearest(p) != p for p in range(1_050, 1_120, 7))
    # Strong shows every acknowledged write.
    assert all(s.nearest(p, Consistency.strong()) == p for p in range(1_000, 1_120, 7))
    status = s.shoal.index_status(s.index, "1")[0]
    assert (status.lag_seqs, status.young_tier_seqs) == (120, 50)


def test_strong_never_misses_a_write_acknowledged_before_it_began(setup: Callable[..., Setup]) -> None:
    """Commits race strong queries: every query must show the last write acknowledged before it started,
    answered from the head announced on Redis (no catalog round trip for the head)."""
    s = setup()
    wait_for(lambda: s.searcher.service.heads_followed, 15, "the searcher to follow announced heads")
    acked = [0]  # the last point whose upload returned
    stop = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        point = 10_000
        try:
            while not stop.is_set():
                s.upload(np.array([point]))
                acked[0] = point
                point += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    checked = 0
    wanted = 100  # strong queries, each racing the writer's commits
    try:
        # A generous bound, only so that a hang fails rather than waits forever: no rate is asserted.
        deadline = time.monotonic() + 120
        while checked < wanted and time.monotonic() < deadline and not errors:
            point = acked[0]
            if not point:
                continue
            assert s.nearest(point, Consistency.strong()) == point, f"strong missed acknowledged point {point}"
            checked += 1
    finally:
        stop.set()
        writer.join(10)
    assert not errors, errors
    assert checked == wanted, f"only {checked} of {wanted} strong queries ran within 120 s"
    head = s.shoal.get_data_source(s.source.name, "1").head_seq
    assert read_head(s.shoal.runtime.redis(), s.shoal.get_data_source(s.source.name, "1").id) == head
    print(f"{checked} strong queries raced commits; none missed an acknowledged write")


def test_a_refused_strong_query_leaves_the_head_reads_working(setup: Callable[..., Setup]) -> None:
    """A strong search sends its head read before it searches; a query refused meanwhile gives the connection
    back unread (dropped), and the strong searches after it still see every acknowledged write."""
    s = setup()
    wait_for(lambda: s.searcher.service.heads_followed, 15, "the searcher to follow announced heads")
    bad = np.full((1, DIM), np.nan, dtype=np.float32)
    for _ in range(3):
        with pytest.raises(ValidationError, match="finite"):
            s.searcher.search(s.index, "1", bad, 1, consistency=Consistency.strong())
    for point in range(2_000, 2_010):
        s.upload(np.array([point]))
        assert s.nearest(point, Consistency.strong()) == point


@pytest.fixture
def own_valkey(tmp_path: Path) -> Iterator[str]:
    """A Valkey of this test alone (it is stopped and started; the session's stays up)."""
    home = tmp_path / "own-valkey"
    url = ensure_valkey(home)
    try:
        yield url
    finally:
        stop_embedded(home)


def test_strong_sees_writes_committed_while_redis_was_down(
    make_settings: Callable[..., Settings], own_valkey: str, tmp_path: Path
) -> None:
    """A writer commits while Redis is away, so its announcement is owed, and ends before it could send it;
    Redis comes back holding the heads of before (its append-only file). Strong searches must still show that
    write, from the moment Redis answers again, and go back to taking heads from Redis once it is announced."""
    home = tmp_path / "own-valkey"
    settings = make_settings("local", redis_url=own_valkey)
    s = Setup(settings)
    try:
        wait_for(lambda: s.searcher.service.heads_followed, 15, "the searcher to follow announced heads")
        s.upload(np.array([500]))  # announced: Redis holds this head
        assert s.nearest(500, Consistency.strong()) == 500
        source_id = s.shoal.get_data_source(s.source.name, "1").id
        announced = read_head(s.shoal.runtime.redis(), source_id)
        stop_embedded(home)
        wait_for(lambda: not s.searcher.service.heads_followed, 15, "the searcher to notice Redis is gone")
        with Shoal(settings, notify=False) as writer:  # another process's writer, say
            writer.producer(s.source.name, "1").upload_columns(_vectors(np.array([501])), {"id": np.array([501])})
            assert writer.runtime.heads.owed  # not announced; and this writer ends without retrying
        head = s.shoal.get_data_source(s.source.name, "1").head_seq
        assert ensure_valkey(home) == own_valkey
        assert read_head(s.shoal.runtime.redis(), source_id) == announced < head  # Redis came back stale
        # No search until the searcher follows again (one made meanwhile would read the catalog's head and
        # keep the tail it read, hiding what this test is about).
        wait_for(lambda: s.searcher.service.heads_followed, 15, "the searcher to follow announced heads again")
        checks = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert s.nearest(501, Consistency.strong()) == 501
            checks += 1
        s.upload(np.array([502]))  # announced again: Redis is current, and strong takes its head from it
        assert read_head(s.shoal.runtime.redis(), source_id) == head + 1
        assert s.nearest(502, Consistency.strong()) == 502
        print(f"{checks} strong queries after the restart, none missed the write made while Redis was away")
    finally:
        s.close()


def test_a_swap_or_rollback_keeps_no_young_tier_of_another_generation(setup: Callable[..., Setup]) -> None:
    """A reindex swap and a rollback load another generation: the young tier kept under the replaced one's id
    pinned its whole generation outside the memory budget, and the one kept under the restored generation's id
    since it last served (a rollback) answered eventual searches with points deleted since."""
    s = setup()
    s.upload(np.array([3_000]))
    wait_for(lambda: s.nearest(3_000) == 3_000, 10, "the write to show (the young tier of generation 1)")
    first = s.shoal.get_index(s.index, "1").id
    s.shoal.reindex(s.index, "1", metric="euclidean", wait=True)
    s.searcher.refresh()
    second = s.shoal.get_index(s.index, "1").id
    assert second != first
    assert set(s.searcher.service._tails) <= {second}  # nothing kept of generation 1
    assert s.nearest(3_000) == 3_000
    s.producer.delete({"id": np.array([3_000])})
    wait_for(lambda: s.nearest(3_000) != 3_000, 10, "the deletion to show in eventual searches")
    s.shoal.rollback(s.index, "1")
    s.searcher.refresh()
    assert s.shoal.get_index(s.index, "1").id == first
    assert set(s.searcher.service._tails) <= {first}
    assert s.nearest(3_000) != 3_000, "the rollback showed a point deleted before it"


def test_eventual_never_shows_half_a_batch_across_shards_built_to_different_seqs(
    make_settings: Callable[..., Settings], redis_url: str,
) -> None:
    """One batch updates a key of shard 0 and a key of shard 1. Shard 1's worker builds it, shard 0's not yet, and
    the young tier's bound (5 seqs) ends below shard 1's new watermark: the young tier is read on to the highest
    shard watermark, so an eventual search shows the whole batch. It showed shard 1's update without shard 0's,
    a state the log never had."""
    from shoal.index.sharding import shard_numbers

    with Shoal(make_settings("local", redis_url=redis_url, young_tier_max_seqs=5), notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec("Mix", "1", 4, {"id": "int64"}, ["id"]))
        shoal.create_index(IndexSpec("Mix.Index", "1", "Mix", "1", algorithm="flat", metric="euclidean",
                                     id_attributes=["id"], shard_count=3))
        rng = np.random.default_rng(0)
        producer = shoal.producer("Mix", "1")
        producer.upload_columns(rng.standard_normal((30, 4)).astype(np.float32), {"id": np.arange(30)})
        builder = ShardBuilder(shoal.engine, shoal.storage)
        shards = sorted(shoal.get_index("Mix.Index", "1").shards, key=lambda s: s.shard_no)
        for shard in shards:
            builder.materialize(shard.id)
        shard_of = dict(enumerate(shard_numbers(pa.table({"id": pa.array(range(30), pa.int64())}), ["id"], 3)))
        a = next(i for i in range(30) if shard_of[i] == 0)
        b = next(i for i in range(30) if shard_of[i] == 1)
        others = [i for i in range(30) if i not in (a, b)][:6]
        searcher = shoal.searcher(follow=True, poll_interval=30.0)
        try:
            def nearest(vector: list[float]) -> int:
                return searcher.search("Mix.Index", "1", np.asarray([vector], np.float32), 1)[0][0].attributes["id"]

            nearest([0.0] * 4)  # loaded: its young tier reaches at most 5 seqs past 30
            va, vb = [5.0] * 4, [-5.0] * 4
            vectors = np.concatenate([rng.standard_normal((6, 4)), [va, vb]]).astype(np.float32)
            producer.upload_columns(vectors, {"id": np.array([*others, a, b])})  # seqs 31-38, one batch
            builder.materialize(shards[1].id)  # shard 1 built to 38; shards 0 and 2 stay at 30
            searcher.refresh()
            assert searcher.served_watermarks("Mix.Index", "1") == {0: 30, 1: 38, 2: 30}
            assert (nearest(va), nearest(vb)) == (a, b)
        finally:
            searcher.close()
