"""Monotonic eventual reads across generation swaps: a following searcher that once returned an acknowledged
write keeps returning it when a reindex swap or a rollback makes it load another generation (README: the new
generation's young tier is read up to the head before it is served, and the one it replaces is dropped only
then). The writes acknowledged while the new generation loads are the ones at risk: the follower extends the old
generation's young tier with them, searches show them, and the new tier must reach as far before it serves."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from conftest import wait_for

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec
from shoal.searcher.consistency import Consistency

DIM = 16
ROUNDS = 4  # each a reindex swap and a rollback: 8 loads of another generation while writes go on
MARKER = 1_000_000  # ids of the points the writer adds (the built ones are below)


def _vectors(ids: np.ndarray) -> np.ndarray:
    """A distinct unit vector per id (its own nearest neighbour by far)."""
    v = np.stack([np.random.default_rng(int(n)).standard_normal(DIM) for n in ids]).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


class Monotonic:
    """A writer adding one point at a time (each acknowledged before the next), and a reader searching the
    newest ones through a following searcher, recording which it returned and any it returned once and then
    no longer did."""

    def __init__(self, shoal: Shoal, source: str, index: str) -> None:
        self.shoal, self.index = shoal, index
        self.producer = shoal.producer(source, "1")
        self.searcher = shoal.searcher(follow=True, poll_interval=0.05)
        self.acked: list[int] = []
        self.seen: set[int] = set()
        self.lost: list[tuple[int, float]] = []
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._guard, args=(f,), daemon=True)
                        for f in (self._write, self._read)]

    def _guard(self, body: Callable[[], None]) -> None:
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)
            self.stop.set()

    def _write(self) -> None:
        n = MARKER
        while not self.stop.is_set():
            ids = np.array([n])
            self.producer.upload_columns(_vectors(ids), {"id": ids.astype(np.int64)})
            self.acked.append(n)  # acknowledged: the upload returned
            n += 1
            time.sleep(0.02)

    def _read(self) -> None:
        while not self.stop.is_set():
            for point in self.acked[-6:]:
                hits = self.searcher.search(self.index, "1", _vectors(np.array([point])), 1)[0]
                found = next((h.attributes["id"] for h in hits), None) == point
                if found:
                    self.seen.add(point)
                elif point in self.seen:
                    self.lost.append((point, time.monotonic()))
                    self.seen.discard(point)  # counted once per disappearance

    def serving(self) -> int:
        return self.searcher.view(self.index, "1").index.id

    def __enter__(self) -> Monotonic:
        self.serving()  # loaded before the writes begin
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        self.searcher.close()


@pytest.fixture
def flat(make_settings: Callable[..., Settings], redis_url: str) -> Iterator[Shoal]:
    """A 2-shard flat index over 5,000 built points, heads announced on a real Redis, no worker."""
    shoal = Shoal(make_settings("local", redis_url=redis_url), notify=False)
    shoal.create_data_source(DataSourceSpec("mono", "1", DIM, {"id": "int64"}, ["id"]))
    ids = np.arange(5_000)
    shoal.producer("mono", "1").upload_columns(_vectors(ids), {"id": ids.astype(np.int64)})
    shoal.create_index(IndexSpec("mono-ix", "1", "mono", "1", metric="cosine", id_attributes=["id"], shard_count=2))
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for shard in shoal.get_index("mono-ix", "1").shards:
        builder.materialize(shard.id)
    yield shoal
    shoal.close()


def test_a_write_once_returned_stays_returned_across_swaps_and_rollbacks(flat: Shoal) -> None:
    with Monotonic(flat, "mono", "mono-ix") as run:
        wait_for(lambda: len(run.seen) >= 5 or bool(run.errors), 60, "the first writes to show")
        for _ in range(ROUNDS):
            for change in (lambda: flat.reindex("mono-ix", "1", wait=True), lambda: flat.rollback("mono-ix", "1")):
                before = run.serving()
                change()
                wait_for(lambda b=before: run.serving() != b or bool(run.errors), 60, "the other generation")
                shown = len(run.seen)
                # Searches on the generation loaded, past its first moments (where the loss showed).
                wait_for(lambda s=shown: len(run.seen) >= s + 3 or bool(run.errors), 60, "writes on it")
            assert not run.errors, run.errors[:3]
    assert not run.errors, run.errors[:3]
    assert not run.lost, f"{len(run.lost)} acknowledged writes returned once, then missing: {run.lost[:5]}"


def test_an_index_made_again_over_another_source_is_read_from_that_source(
    make_settings: Callable[..., Settings], redis_url: str,
) -> None:
    """An index dropped and made again under its name over another data source, noticed by one refresh of a
    following searcher: what the young tier it replaced reached (seqs of the other data source's log, far
    further on) was taken as what the new one had to reach, so the new tier was marked as covering seqs of its
    own log it never read, and even strong searches missed the writes made there after the swap."""
    shoal = Shoal(make_settings("local", redis_url=redis_url), notify=False)
    try:
        for source in ("far", "near"):
            shoal.create_data_source(DataSourceSpec(source, "1", DIM, {"id": "int64"}, ["id"]))
        far = shoal.producer("far", "1")
        for n in range(40):  # 40 commits: its head far past the other source's
            far.upload_columns(_vectors(np.array([n])), {"id": np.array([n], dtype=np.int64)})
        shoal.producer("near", "1").upload_columns(_vectors(np.array([100])), {"id": np.array([100], np.int64)})
        shoal.create_index(IndexSpec("again", "1", "far", "1", metric="cosine", id_attributes=["id"]))
        searcher = shoal.searcher(follow=True, poll_interval=3600)  # refreshed by hand below
        try:
            assert searcher.search("again", "1", _vectors(np.array([39])), 1)[0][0].attributes["id"] == 39
            shoal.drop_index("again", "1")
            shoal.create_index(IndexSpec("again", "1", "near", "1", metric="cosine", id_attributes=["id"]))
            searcher.refresh()  # loads the new index in place of the one it served
            near = shoal.producer("near", "1")
            for n in range(101, 106):
                near.upload_columns(_vectors(np.array([n])), {"id": np.array([n], dtype=np.int64)})
            hits = searcher.search("again", "1", _vectors(np.array([105])), 1, consistency=Consistency.strong())[0]
            assert [h.attributes["id"] for h in hits] == [105]
        finally:
            searcher.close()
    finally:
        shoal.close()
