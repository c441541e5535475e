"""Vektonn's HTTP API as a state machine: uploads of data points and tombstones (key-only, and with every
attribute as Vektonn clients send them) into a data source whose key is two attributes, builds in between, and
after every step searches (several query vectors, split filters, attribute filters; strong consistency)
compared with brute force over a model of the live points.

Real parts: a served uvicorn app, the real catalog (Postgres) and storage; builds run in-process
(ShardBuilder), as a worker runs them."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec

DIM = 3
Key = tuple[int, str]
COORDS = st.lists(st.integers(-3, 3), min_size=DIM, max_size=DIM)
KEYS = st.tuples(st.integers(0, 5), st.sampled_from(["eu", "us"]))
ALL_KEYS = 12
TITLES = st.sampled_from(["a", "b", "c"])

FILTERS: list[tuple[dict[str, Any] | None, Callable[[Key, str], bool]]] = [
    (None, lambda key, title: True),
    ({"title": {"$in": ["a", "c"]}}, lambda key, title: title in ("a", "c")),
    ({"$or": [{"id": {"$gte": 4}}, {"$not": {"title": "b"}}]}, lambda key, title: key[0] >= 4 or title != "b"),
]


def _attributes(key: Key, title: str | None) -> list[dict[str, Any]]:
    attrs = [{"key": "id", "value": {"int64": key[0]}}, {"key": "region", "value": {"string": key[1]}}]
    if title is not None:
        attrs.append({"key": "title", "value": {"string": title}})
    return attrs


class VektonnMachine(RuleBasedStateMachine):
    http: httpx.Client
    shoal: Shoal

    @initialize()
    def setup(self) -> None:
        tag = uuid.uuid4().hex[:8]
        self.source = DataSourceSpec(f"VM{tag}", "1", DIM, {"id": "int64", "region": "string", "title": "string"},
                                     ["id", "region"])
        self.shoal.create_data_source(self.source)
        self.index = f"VM{tag}.Index"
        self.shoal.create_index(IndexSpec(self.index, "1", self.source.name, "1", algorithm="flat",
                                          metric="euclidean", id_attributes=["id"], split_attributes=["region"],
                                          shard_count=2))
        self.live: dict[Key, tuple[tuple[int, ...], str]] = {}

    @rule(ops=st.lists(st.one_of(
        st.tuples(st.just("upsert"), KEYS, COORDS, TITLES),
        st.tuples(st.just("delete"), KEYS, st.just(None), st.none() | TITLES),
    ), min_size=1, max_size=6))
    def upload(self, ops: list[tuple[str, Key, list[int] | None, str | None]]) -> None:
        """Upserts and tombstones in one batch, applied in order; a tombstone with a title is Vektonn's form
        (every attribute), one without is the key-only form."""
        body = []
        for what, key, coords, title in ops:
            if what == "upsert":
                assert coords is not None and title is not None
                body.append({"attributes": _attributes(key, title),
                             "vector": {"isSparse": False, "coordinates": [float(x) for x in coords]}})
                self.live[key] = (tuple(coords), title)
            else:
                body.append({"attributes": _attributes(key, title), "isDeleted": True})
                self.live.pop(key, None)
        r = self.http.post(f"/api/v1/upload/{self.source.name}/1", json=body)
        assert r.status_code == 200, r.text

    @rule()
    def build(self) -> None:
        builder = ShardBuilder(self.shoal.engine, self.shoal.storage)
        for shard in self.shoal.get_index(self.index, "1").shards:
            builder.materialize(shard.id)

    @rule(queries=st.lists(COORDS, min_size=1, max_size=2), k=st.integers(1, 8),
          region=st.none() | st.sampled_from(["eu", "us"]), which=st.integers(0, len(FILTERS) - 1))
    def search(self, queries: list[list[int]], k: int, region: str | None, which: int) -> None:
        filters, keep = FILTERS[which]
        body: dict[str, Any] = {"k": k, "retrieveVectors": True, "queryVectors": [
            {"isSparse": False, "coordinates": [float(x) for x in q]} for q in queries]}
        if region is not None:
            body["splitFilter"] = [{"key": "region", "value": {"string": region}}]
        if filters is not None:
            body["filter"] = filters
        r = self.http.post(f"/api/v1/search/{self.index}/1", json=body, headers={"X-Shoal-Consistency": "strong"})
        assert r.status_code == 200, r.text
        answers = r.json()
        assert len(answers) == len(queries)
        matching = {key: v for key, v in self.live.items()
                    if (region is None or key[1] == region) and keep(key, v[1])}
        for q, answer in zip(queries, answers, strict=True):

            def distance(coords: tuple[int, ...], q: list[int] = q) -> float:
                return math.sqrt(sum((a - b) ** 2 for a, b in zip(coords, q, strict=True)))

            hits = answer["nearestDataPoints"]
            expected = sorted(distance(c) for c, _ in matching.values())[:k]
            got = [hit["distance"] for hit in hits]
            assert got == pytest.approx(expected, rel=1e-6, abs=1e-9), (body, got, expected)
            for hit in hits:  # a live, matching point as last written
                attrs = {a["key"]: next(iter(a["value"].values())) for a in hit["attributes"]}
                key = (attrs["id"], attrs["region"])
                assert key in matching, (body, hit)
                coords, title = matching[key]
                assert attrs["title"] == title
                assert hit["vector"]["coordinates"] == [float(x) for x in coords]
                assert hit["distance"] == pytest.approx(distance(coords), rel=1e-6, abs=1e-9)


    @invariant()
    def every_live_point_and_no_other_is_found(self) -> None:
        """A search for as many points as there can be keys finds exactly the live ones, as last written."""
        if not hasattr(self, "live"):
            return
        body = {"k": ALL_KEYS, "queryVectors": [{"isSparse": False, "coordinates": [0.0] * DIM}]}
        r = self.http.post(f"/api/v1/search/{self.index}/1", json=body, headers={"X-Shoal-Consistency": "strong"})
        assert r.status_code == 200, r.text
        found = {}
        for hit in r.json()[0]["nearestDataPoints"]:
            attrs = {a["key"]: next(iter(a["value"].values())) for a in hit["attributes"]}
            found[(attrs["id"], attrs["region"])] = attrs["title"]
        assert found == {key: title for key, (_, title) in self.live.items()}


def test_vektonn_http_answers_as_brute_force_over_its_live_points(served: tuple[str, Settings]) -> None:
    url, conf = served
    with Shoal(conf, notify=False) as shoal, httpx.Client(base_url=url, timeout=60) as http:
        machine = type("Machine", (VektonnMachine,), {"http": http, "shoal": shoal})
        run_state_machine_as_test(machine, settings=settings(max_examples=15, stateful_step_count=25,
                                                             deadline=None,
                                                             suppress_health_check=list(HealthCheck)))
