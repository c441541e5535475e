"""Exactness: a Hypothesis state machine interleaves upserts, tombstones, materializations, merges and
searches, and compares every search with brute force over the data source's state.

The expected state is an oracle independent of Shoal's log reader: the machine keeps every batch it
committed (upserts and tombstones, with the seq range its write token gave it) and replays them in seq order,
last write per key wins, a tombstone deletes.

`eventual` searches must equal brute force at each shard's visible watermark (its served version's, or
as far as the searcher's young tier reaches past it, never beyond the head); `strong` and `at_least`
searches brute force over the log up to the head (or the token). The young tier is bounded to a few seqs
here, so searches also run with it cut short. On flat indexes the results must be exact;
on HNSW, recall@10 against brute force must stay >= 0.95.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from shoal import DataPoint, DataSourceSpec, Shoal, Tombstone
from shoal.engines.metrics import Metric, exact_top_k, higher_is_nearer
from shoal.errors import NotFoundError, QueryError
from shoal.index.builder import ShardBuilder
from shoal.index.sharding import shard_numbers
from shoal.log.records import IndexSpec
from shoal.searcher.consistency import Consistency
from shoal.searcher.searcher import AnsweredAt

DIM = 6
IDS = st.integers(0, 40)
SEED_IDS = 1_000  # the ids of the points an example may start with (`seed_points`): past every id IDS draws
GROUPS = st.sampled_from(["a", "b", "c"])
VECTORS = st.lists(st.integers(-8, 8), min_size=DIM, max_size=DIM).map(lambda v: [x / 4 for x in v])


Key = tuple[int, str]  # (id, group): the data source's permanent attributes


class ReplayLog:
    """Every batch the machine committed, in commit order, each with the seq range its token gave it.

    Plain Python, owing nothing to Shoal's reader: the state at a seq replays the entries with seq at most
    that, in seq order; an upsert sets its key's vector (the last write wins), a tombstone deletes the key.
    """

    def __init__(self) -> None:
        # (first seq, last seq, entries); an entry is (key, vector), the vector None for a tombstone.
        self.batches: list[tuple[int, int, list[tuple[Key, np.ndarray | None]]]] = []

    @property
    def head(self) -> int:
        return self.batches[-1][1] if self.batches else 0

    def record(self, token_seq: int, entries: list[tuple[Key, np.ndarray | None]]) -> None:
        """A committed batch: its token is the seq of its last entry, and its entries take consecutive seqs."""
        first = token_seq - len(entries) + 1
        # The machine is its source's only writer, so batches tile the seqs from 1 without gaps.
        assert first == self.head + 1, f"batch seqs {first}..{token_seq} do not follow the last token {self.head}"
        self.batches.append((first, token_seq, entries))

    def state_at(self, seq: int) -> dict[Key, np.ndarray]:
        """The live vector of every key after replaying the entries with seq <= `seq`."""
        state: dict[Key, np.ndarray] = {}
        for first, _, entries in self.batches:
            for offset, (key, vector) in enumerate(entries):
                if first + offset > seq:
                    return state
                if vector is None:
                    state.pop(key, None)
                else:
                    state[key] = vector
        return state


def brute_force(
    log: ReplayLog,
    spec: IndexSpec,
    watermarks: dict[int, int],
    query: np.ndarray,
    k: int,
    group: str | None,
    predicate: Callable[[Key], bool] | None = None,
) -> tuple[np.ndarray, dict[Key, np.ndarray]]:
    """Top-k distances over the replayed state, each shard at its own watermark, of the keys `predicate`
    passes (all when None); and key -> vector."""
    live_ids: list[Key] = []
    live_vecs: list[np.ndarray] = []
    for shard_no, watermark in watermarks.items():
        state = log.state_at(watermark)
        if not state:
            continue
        keys = list(state)
        table = pa.table(
            {"id": pa.array([i for i, _ in keys], pa.int64()), "group": pa.array([g for _, g in keys], pa.string())}
        )
        mine = shard_numbers(table, spec.shard_attributes, spec.shard_count) == shard_no
        for key, keep in zip(keys, mine, strict=True):
            if keep and (group is None or key[1] == group) and (predicate is None or predicate(key)):
                live_ids.append(key)
                live_vecs.append(state[key])
    vectors = np.stack(live_vecs) if live_vecs else np.zeros((0, DIM), np.float32)
    dist, labels = exact_top_k(Metric(spec.metric), query[None, :], vectors, k)
    found = dist[0][labels[0] >= 0]
    return found, {i: v for i, v in zip(live_ids, live_vecs, strict=True)}


class IndexMachine(RuleBasedStateMachine):
    """One data source with one index (2 shards, split by `group`) per example."""

    shoal: Shoal
    algorithm = "flat"
    metric = "euclidean"
    params: dict[str, Any] = {}  # noqa: RUF012
    recall_sink: list[float] = []  # noqa: RUF012 - each test gives its subclass a fresh list
    # Points written and built before the rules run, ids from SEED_IDS on: approximate indexes then search graphs
    # (lists) much larger than k, not ones where every row is an answer (k >= rows leaves recall nothing to miss).
    seed_points = 0

    @initialize()
    def setup(self) -> None:
        tag = uuid.uuid4().hex[:8]
        self.source = DataSourceSpec(
            f"src-{tag}", "1", DIM, {"id": "int64", "group": "string", "text": "string"}, ["id", "group"]
        )
        self.shoal.create_data_source(self.source)
        self.index = self.shoal.create_index(
            IndexSpec(
                f"idx-{tag}",
                "1",
                self.source.name,
                "1",
                algorithm=self.algorithm,
                metric=self.metric,
                params=self.params,
                id_attributes=["id"],
                split_attributes=["group"],
                shard_count=2,
            )
        )
        self.producer = self.shoal.producer(self.source.name, "1")
        self.builder = ShardBuilder(self.shoal.engine, self.shoal.storage)
        self.searcher = self.shoal.searcher(follow=False)
        self.last_token = 0
        self.log = ReplayLog()
        if self.seed_points:
            self._seed()

    def _seed(self) -> None:
        """Write `seed_points` points (spread over the groups, so over both shards) and build both shards."""
        rng = np.random.default_rng(7)  # fixed: Hypothesis replays an example with the same seed points
        vectors = rng.uniform(-2, 2, (self.seed_points, DIM)).astype(np.float32)
        keys = [(SEED_IDS + n, "abc"[n % 3]) for n in range(self.seed_points)]
        token = self.producer.upload([DataPoint({"id": i, "group": g, "text": f"{i}{g}"}, v)
                                      for (i, g), v in zip(keys, vectors, strict=True)])
        self.log.record(token.seq, list(zip(keys, vectors, strict=True)))
        self.last_token = token.seq
        for shard in self.index.shards:
            self.builder.materialize(shard.id)
        self.searcher.refresh()

    def teardown(self) -> None:
        if hasattr(self, "searcher"):
            self.searcher.close()

    @rule(points=st.lists(st.tuples(IDS, GROUPS, VECTORS), min_size=1, max_size=8))
    def upsert(self, points: list[tuple[int, str, list[float]]]) -> None:
        token = self.producer.upload([DataPoint({"id": i, "group": g, "text": f"{i}{g}"}, v) for i, g, v in points])
        self.log.record(token.seq, [((i, g), np.asarray(v, dtype=np.float32)) for i, g, v in points])
        self.last_token = token.seq

    @rule(keys=st.lists(st.tuples(IDS, GROUPS), min_size=1, max_size=4))
    def delete(self, keys: list[tuple[int, str]]) -> None:
        self.last_token = self.producer.upload([Tombstone({"id": i, "group": g}) for i, g in keys]).seq
        self.log.record(self.last_token, [((i, g), None) for i, g in keys])

    @rule(shard=st.sampled_from([0, 1]))
    def materialize(self, shard: int) -> None:
        self.builder.materialize(self.index.shards[shard].id)
        self.searcher.refresh()

    @rule(shard=st.sampled_from([0, 1]), force=st.booleans())
    def merge(self, shard: int, force: bool) -> None:
        self.builder.merge(self.index.shards[shard].id, force=force)
        self.searcher.refresh()

    def _check(
        self,
        consistency: Consistency,
        watermarks: Callable[[], dict[int, int]],
        query: list[float],
        k: int,
        group: str | None,
        filters: dict[str, Any] | None = None,
        predicate: Callable[[Key], bool] | None = None,
        as_of: int | None = None,
        answered: AnsweredAt | None = None,
    ) -> None:
        q = np.asarray(query, dtype=np.float32)
        when: dict[str, Any] = {"consistency": consistency} if as_of is None else {"as_of": as_of}
        if answered is not None:
            when["answered"] = answered
        hits = self.searcher.search(
            self.index.spec.name,
            "1",
            [q],
            k,
            split_filter={"group": group} if group else None,
            retrieve_vectors=True,
            filters=filters,
            **when,
        )[0]
        expected, live = brute_force(self.log, self.index.spec, watermarks(), q, k, group, predicate)
        got = np.array([h.distance for h in hits])
        # Every hit is a live point of the right split, at its true distance: the distance from the query to that
        # hit's own live vector (float64), so a hit carrying another hit's point or distance is caught.
        for h in hits:
            key = (h.attributes["id"], h.attributes["group"])
            assert key in live
            assert group is None or key[1] == group
            assert predicate is None or predicate(key), (key, filters)
            np.testing.assert_array_equal(h.vector, live[key])
            own = exact_top_k(Metric(self.metric), q[None, :].astype(np.float64), live[key][None, :].astype(np.float64),
                              1)[0][0][0]
            np.testing.assert_allclose(h.distance, own, rtol=1e-5, atol=1e-5, err_msg=f"hit {key}")
        if self.algorithm == "flat":
            assert len(hits) == len(expected)
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        else:
            assert len(hits) == len(expected)
            # Recall only where the search had rows to leave out: with k at least the matching live rows, every
            # row is an answer, whichever way the index searches.
            if 0 < len(expected) < len(live):
                kth = expected[-1]  # the k-th best: a hit at least as near is one of the true top k
                near = got >= kth - 1e-5 if higher_is_nearer(self.metric) else got <= kth + 1e-5
                self.recall_sink.append(float(np.sum(near)) / len(expected))

    @rule()
    def follow_heads(self) -> None:
        """What a following searcher does when a commit announces a head: extend the young tier."""
        self.searcher.refresh()  # reads the head with the definitions, as a poll does
        self.searcher.service.follow_heads()

    @rule(query=VECTORS, k=st.integers(1, 10), group=st.none() | GROUPS)
    def search_eventual(self, query: list[float], k: int, group: str | None) -> None:
        visible = self.searcher.visible_watermarks(self.index.spec.name, "1")
        served = self.searcher.served_watermarks(self.index.spec.name, "1")
        assert all(served[s] <= w <= self.log.head for s, w in visible.items()), (served, visible)
        self._check(Consistency.eventual(), lambda: visible, query, k, group)

    @rule(query=VECTORS, k=st.integers(1, 10), group=st.none() | GROUPS)
    def search_strong(self, query: list[float], k: int, group: str | None) -> None:
        head = self.shoal.get_data_source(self.source.name, "1").head_seq
        self._check(Consistency.strong(), lambda: {0: head, 1: head}, query, k, group)

    @rule(query=VECTORS, k=st.integers(1, 10))
    def search_at_least(self, query: list[float], k: int) -> None:
        token = self.last_token
        served = self.searcher.served_watermarks(self.index.spec.name, "1")
        marks = {s: max(w, token) for s, w in served.items()}
        self._check(Consistency.at_least(token), lambda: marks, query, k, None)

    @rule(query=VECTORS, k=st.integers(1, 10), back=st.integers(0, 6))
    def search_at_least_older(self, query: list[float], k: int, back: int) -> None:
        """`at_least` with the token of an earlier write (`search_at_least` only sends the head: the machine is
        its source's only writer): the answer reports the one seq it reflects, at least the token and every
        served watermark, at most the head, and equals brute force at that seq."""
        if not self.log.batches:
            return
        token = self.log.batches[max(0, len(self.log.batches) - 1 - back)][1]
        served = self.searcher.served_watermarks(self.index.spec.name, "1")
        answered = AnsweredAt()

        def at_answer() -> dict[int, int]:
            seq = answered.seq
            assert seq is not None and max([token, *served.values()]) <= seq <= self.log.head, (token, served, seq)
            return {0: seq, 1: seq}

        self._check(Consistency.at_least(token), at_answer, query, k, None, answered=answered)

    @rule(query=VECTORS, past=st.integers(1, 2**40))
    def search_past_the_head(self, query: list[float], past: int) -> None:
        """A token no write gave is refused, naming it; every search after it is still exact (before, the young
        tier took the log as read up to it, and strong and at_least searches missed later writes)."""
        token = self.log.head + past
        with pytest.raises(QueryError, match=f"write token {token} is past the log head {self.log.head}"):
            self.searcher.search(self.index.spec.name, "1", [np.asarray(query, dtype=np.float32)], 1,
                                 consistency=Consistency.at_least(token))

    @rule(
        query=VECTORS,
        k=st.integers(1, 10),
        level=st.sampled_from(["eventual", "strong", "at_least"]),
        low=st.integers(0, 40),
        width=st.integers(0, 20),
        groups=st.lists(GROUPS, min_size=1, max_size=2, unique=True),
        negate=st.booleans(),
    )
    def search_filtered(
        self, query: list[float], k: int, level: str, low: int, width: int, groups: list[str], negate: bool
    ) -> None:
        """A filtered search (an id range or some groups, maybe negated) at each consistency level equals brute
        force over the matching part of the state the level reflects."""
        cond: dict[str, Any] = {"$or": [{"id": {"$gte": low, "$lt": low + width}},
                                        {"group": {"$in": groups}, "text": {"$ne": f"{low}{groups[0]}"}}]}
        filters = {"$not": cond} if negate else cond

        def passes(key: Key) -> bool:
            i, g = key
            inside = low <= i < low + width or (g in groups and f"{i}{g}" != f"{low}{groups[0]}")
            return inside != negate

        if level == "eventual":
            visible = self.searcher.visible_watermarks(self.index.spec.name, "1")
            self._check(Consistency.eventual(), lambda: visible, query, k, None, filters, passes)
        elif level == "strong":
            head = self.shoal.get_data_source(self.source.name, "1").head_seq
            self._check(Consistency.strong(), lambda: {0: head, 1: head}, query, k, None, filters, passes)
        else:
            token = self.last_token
            served = self.searcher.served_watermarks(self.index.spec.name, "1")
            marks = {s: max(w, token) for s, w in served.items()}
            self._check(Consistency.at_least(token), lambda: marks, query, k, None, filters, passes)

    @rule(query=VECTORS, k=st.integers(1, 10), back=st.integers(0, 30), group=st.none() | GROUPS)
    def search_as_of(self, query: list[float], k: int, back: int, group: str | None) -> None:
        """Time travel: as of an earlier write (or the last), exactly the state the log held then, whatever was
        built, merged or served since."""
        seq = self.log.head - back
        if seq < 1:
            return
        try:
            self._check(Consistency.eventual(), lambda: {0: seq, 1: seq}, query, k, group, as_of=seq)
        except NotFoundError as err:
            if not self.may_refuse_time_travel():
                raise
            assert "was compacted" in str(err), err

    def may_refuse_time_travel(self) -> bool:
        """Whether time travel may be refused here: never, where the log is not compacted (subclasses that
        compact say when)."""
        return False

    @invariant()
    def served_never_ahead_of_head(self) -> None:
        if hasattr(self, "searcher"):
            head = self.shoal.get_data_source(self.source.name, "1").head_seq
            assert all(w <= head for w in self.searcher.served_watermarks(self.index.spec.name, "1").values())


@pytest.fixture
def quiet_shoal(make_settings):  # type: ignore[no-untyped-def]
    """A Shoal that queues no Celery work: this test drives materialize and merge itself. Its searchers' young
    tier holds at most 7 seqs past the served watermark, so the machine also searches it cut short."""
    client = Shoal(make_settings("local", young_tier_max_seqs=7), notify=False)
    yield client
    client.close()


MACHINE_SETTINGS = settings(
    max_examples=12, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)
# The approximate indexes' machines start from this many built points (a graph of ~150 per shard against k <= 10),
# and must compare at least this many searches that had rows to leave out.
SEED_POINTS = 300
MIN_RECALL_SEARCHES = 50


@pytest.mark.parametrize(
    "metric",
    ["euclidean", pytest.param("cosine", marks=pytest.mark.slow), pytest.param("dot_product", marks=pytest.mark.slow)],
)
def test_flat_searches_equal_brute_force(quiet_shoal: Shoal, metric: str) -> None:
    machine = type("FlatMachine", (IndexMachine,), {"shoal": quiet_shoal, "metric": metric})
    run_state_machine_as_test(machine, settings=MACHINE_SETTINGS)


def test_hnsw_recall_against_brute_force(quiet_shoal: Shoal) -> None:
    recalls: list[float] = []

    class HnswMachine(IndexMachine):
        shoal = quiet_shoal
        algorithm = "hnsw"
        metric = "cosine"
        params = {"M": 16, "ef_construction": 100, "ef_search": 32}  # noqa: RUF012
        recall_sink = recalls
        seed_points = SEED_POINTS

    run_state_machine_as_test(HnswMachine, settings=MACHINE_SETTINGS)
    assert len(recalls) >= MIN_RECALL_SEARCHES, f"only {len(recalls)} HNSW searches had rows to leave out"
    assert float(np.mean(recalls)) >= 0.95, f"recall@10 {np.mean(recalls):.3f} over {len(recalls)} searches"


def test_ivf_recall_against_brute_force(quiet_shoal: Shoal) -> None:
    """IVF probing half its lists: every search (filtered too, at every consistency level) answers k live points
    of the right split when that many exist, and recall@10 against brute force stays high."""
    recalls: list[float] = []

    class IvfMachine(IndexMachine):
        shoal = quiet_shoal
        algorithm = "ivf"
        metric = "euclidean"
        params = {"nlist": 4, "nprobe": 2}  # noqa: RUF012
        recall_sink = recalls
        seed_points = SEED_POINTS

    run_state_machine_as_test(IvfMachine, settings=MACHINE_SETTINGS)
    assert len(recalls) >= MIN_RECALL_SEARCHES, f"only {len(recalls)} IVF searches had rows to leave out"
    print(f"IVF recall@10 {np.mean(recalls):.3f} over {len(recalls)} searches")
    assert float(np.mean(recalls)) >= 0.9, f"recall@10 {np.mean(recalls):.3f} over {len(recalls)} searches"
