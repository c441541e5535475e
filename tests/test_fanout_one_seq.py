"""A fanned-out search answers every shard at one seq: at `at_least` and `strong`, nodes whose shards are built to
different seqs (or whose young tiers reach different seqs) still answer together a state the log had, the one a
single process holding every shard answers; and a part asked again pinned to a seq answers at exactly it.

Real `shoal api` processes (two nodes and one process without a placement), real sockets, a real catalog.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import api_process, free_port, serve_api

from shoal import DataPoint, DataSourceSpec, Shoal
from shoal.auth.keys import create_key
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec

IDS = range(20)
BODY = {"k": 40, "queryVectors": [{"isSparse": False, "coordinates": [0.0, 0.0]}]}


def _ys(response: httpx.Response) -> dict[int, float]:
    """id -> its y coordinate as the answer shows it (the distance from (0, 0) less its x, which is the id)."""
    assert response.status_code == 200, response.text
    out = {}
    for point in response.json()[0]["nearestDataPoints"]:
        i = int(next(a["value"]["int64"] for a in point["attributes"] if a["key"] == "id"))
        out[i] = round((float(point["distance"]) ** 2 - i * i) ** 0.5)
    return out


def _source_and_index(shoal: Shoal) -> None:
    shoal.create_data_source(DataSourceSpec("S", "1", 2, {"id": "int64"}, ["id"]))
    shoal.create_index(IndexSpec("F", "1", "S", "1", algorithm="flat", metric="euclidean", shard_count=2))


def _rewrite(shoal: Shoal, y: float) -> int:
    """Every id moved to height y in one batch; its write token."""
    return shoal.producer("S", "1").upload([DataPoint({"id": i}, [float(i), y]) for i in IDS]).seq


def _two_nodes(tmp_path: Path, tenant: str, index: str) -> tuple[dict[str, int], Path]:
    """Ports for nodes a and b, and a placement file giving shard 0 of `index`/1 to a and shard 1 to b."""
    ports = {"a": free_port(), "b": free_port()}
    placement = tmp_path / "placement.yaml"
    placement.write_text(yaml.safe_dump({
        "nodes": {n: f"http://127.0.0.1:{p}" for n, p in ports.items()},
        "indexes": [{"tenant": tenant, "index": index, "version": "1", "shards": {"a": [0], "b": [1]}}],
    }))
    return ports, placement


@pytest.mark.timeout(600)
def test_nodes_built_to_different_seqs_answer_at_one_seq(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    # No young tier kept ahead of the builds: each node's answer then starts from its own shards' watermarks.
    settings = make_settings("local", anonymous_tenant="", young_tier_max_seqs=0, fanout_timeout_s=120)
    with Shoal(settings, notify=False) as shoal:
        _source_and_index(shoal)
        first = _rewrite(shoal, 0.0)  # seqs 1..20
        builder = ShardBuilder(shoal.engine, shoal.storage)
        shards = shoal.get_index("F", "1").shards
        for shard in shards:
            builder.materialize(shard.id)
        second = _rewrite(shoal, 100.0)  # seqs 21..40
        builder.materialize(shards[0].id)  # shard 0 reflects the second batch, shard 1 only the first
        _, key = create_key(shoal.engine, settings.tenant, "read")
    ports, placement = _two_nodes(tmp_path, settings.tenant, "F")
    auth = {"Authorization": f"ApiKey {key}"}
    with api_process(settings) as (_, one), \
            api_process(settings, port=ports["a"], SHOAL_PLACEMENT_FILE=str(placement), SHOAL_NODE="a") as (_, a), \
            api_process(settings, port=ports["b"], SHOAL_PLACEMENT_FILE=str(placement), SHOAL_NODE="b") as (_, b):
        for level in ({"X-Shoal-Required-Token": str(first)}, {"X-Shoal-Consistency": "strong"}):
            want = _ys(httpx.post(f"{one}/api/v1/search/F/1", json=BODY, headers=auth | level, timeout=60))
            assert want == dict.fromkeys(IDS, 100), level  # one process: the second batch whole
            for node in (a, b):
                got = _ys(httpx.post(f"{node}/api/v1/search/F/1", json=BODY, headers=auth | level, timeout=60))
                # Before, node a's shard answered at seq 40 and node b's at 20: half the batch moved.
                assert got == want, f"{level} through {node}"
        assert second == 40


def test_a_part_pinned_to_a_seq_answers_at_exactly_it(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with Shoal(settings, notify=False) as shoal:
        _source_and_index(shoal)
        first = _rewrite(shoal, 0.0)  # seqs 1..20
        builder = ShardBuilder(shoal.engine, shoal.storage)
        for shard in shoal.get_index("F", "1").shards:
            builder.materialize(shard.id)
        second = _rewrite(shoal, 100.0)  # seqs 21..40
        third = _rewrite(shoal, 200.0)  # seqs 41..60
    part = {"X-Shoal-Shards": "0,1", "X-Shoal-Required-Token": str(first)}
    with serve_api(settings) as url:
        search = f"{url}/api/v1/search/F/1"
        strong = httpx.post(search, json=BODY, headers={"X-Shoal-Consistency": "strong"}, timeout=60)
        assert _ys(strong) == dict.fromkeys(IDS, 200)  # the young tier now reaches seq 60
        # A part says which seq it reflects ...
        unpinned = httpx.post(search, json=BODY, headers=part, timeout=60)
        assert _ys(unpinned) == dict.fromkeys(IDS, 200)
        assert unpinned.headers["X-Shoal-Seq"] == str(third)
        # ... and, pinned, answers the state at that seq, though its young tier reaches further.
        pinned = httpx.post(search, json=BODY, headers=part | {"X-Shoal-Answer-Seq": str(second)}, timeout=60)
        assert _ys(pinned) == dict.fromkeys(IDS, 100)
        assert pinned.headers["X-Shoal-Seq"] == str(second)
        # Below the shards' watermark it answers at the watermark, and says so.
        low = httpx.post(search, json=BODY, headers=part | {"X-Shoal-Answer-Seq": "5"}, timeout=60)
        assert _ys(low) == dict.fromkeys(IDS, 0)
        assert low.headers["X-Shoal-Seq"] == str(first)
        # A pin no commit has reached is refused, as a write token past the head is.
        past = httpx.post(search, json=BODY, headers=part | {"X-Shoal-Answer-Seq": str(third + 1)}, timeout=60)
        assert past.status_code == 400 and "past the log head" in past.text
        # A search that is no part (no X-Shoal-Shards) reports nothing and takes no pin.
        plain = httpx.post(search, json=BODY, headers={"X-Shoal-Required-Token": str(first),
                                                       "X-Shoal-Answer-Seq": str(second)}, timeout=60)
        assert _ys(plain) == dict.fromkeys(IDS, 200) and "X-Shoal-Seq" not in plain.headers


@pytest.mark.timeout(600)
def test_a_tag_taken_before_a_reindex_that_changed_the_metric_merges_by_the_old_metric(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    settings = make_settings("local", anonymous_tenant="", fanout_timeout_s=120)
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec("S", "1", 2, {"id": "int64"}, ["id"]))
        shoal.create_index(IndexSpec("R", "1", "S", "1", algorithm="flat", metric="dot_product", shard_count=2))
        shoal.producer("S", "1").upload([DataPoint({"id": i}, [float(i + 1), 1.0]) for i in IDS])
        builder = ShardBuilder(shoal.engine, shoal.storage)
        for shard in shoal.get_index("R", "1").shards:
            builder.materialize(shard.id)
        shoal.tag_index("R", "1", "before")
        assert shoal.reindex("R", "1", metric="euclidean", wait=True).state == "swapped"
        _, key = create_key(shoal.engine, settings.tenant, "read")
    ports, placement = _two_nodes(tmp_path, settings.tenant, "R")
    body = {"k": 3, "queryVectors": [{"isSparse": False, "coordinates": [1.0, 0.0]}]}
    auth = {"Authorization": f"ApiKey {key}"}
    with api_process(settings) as (_, one), \
            api_process(settings, port=ports["a"], SHOAL_PLACEMENT_FILE=str(placement), SHOAL_NODE="a") as (_, a), \
            api_process(settings, port=ports["b"], SHOAL_PLACEMENT_FILE=str(placement), SHOAL_NODE="b") as (_, b), \
            api_process(settings, SHOAL_PLACEMENT_FILE=str(placement)) as (_, router):  # serves no shard
        for tag in ({"X-Shoal-Tag": "before"}, {}):
            want = httpx.post(f"{one}/api/v1/search/R/1", json=body, headers=auth | tag, timeout=60)
            assert want.status_code == 200, want.text
            for node in (a, b, router):
                got = httpx.post(f"{node}/api/v1/search/R/1", json=body, headers=auth | tag, timeout=60)
                assert got.status_code == 200, got.text
                # Before, the tagged parts (dot product: larger is nearer) were merged as euclidean, the metric
                # of the generation serving now: the caller got the smallest products of the parts' best.
                assert got.content == want.content, f"{tag or 'current'} through {node}"
        tagged = httpx.post(f"{one}/api/v1/search/R/1", json=body, headers=auth | {"X-Shoal-Tag": "before"},
                            timeout=60).json()[0]["nearestDataPoints"]
        assert [p["distance"] for p in tagged] == [20.0, 19.0, 18.0]  # the largest products, nearest first


@pytest.mark.timeout(600)
def test_a_router_whose_placement_names_a_shard_past_the_index_answers_from_the_real_ones(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    """Midway through a placement change the files disagree: a router's copy names shard 2 of a 2-shard index
    on node b. It asked b for it, b refused that as the caller's mistake, and the caller's sound query got 400
    "invalid query". Shards past the index's own are asked of no node."""
    settings = make_settings("local", anonymous_tenant="", fanout_timeout_s=120)
    with Shoal(settings, notify=False) as shoal:
        _source_and_index(shoal)
        _rewrite(shoal, 3.0)
        _, key = create_key(shoal.engine, settings.tenant, "read")
    ports, placement = _two_nodes(tmp_path, settings.tenant, "F")
    stale = tmp_path / "router.yaml"
    document = yaml.safe_load(placement.read_text())
    document["indexes"][0]["shards"]["b"] = [1, 2]
    stale.write_text(yaml.safe_dump(document))
    auth = {"Authorization": f"ApiKey {key}", "X-Shoal-Consistency": "strong"}
    with api_process(settings, port=ports["a"], SHOAL_PLACEMENT_FILE=str(stale), SHOAL_NODE="a") as (_, a), \
            api_process(settings, port=ports["b"], SHOAL_PLACEMENT_FILE=str(placement), SHOAL_NODE="b") as (_, b):
        for node in (a, b):
            got = httpx.post(f"{node}/api/v1/search/F/1", json=BODY, headers=auth, timeout=60)
            assert _ys(got) == dict.fromkeys(IDS, 3), node
            assert "X-Shoal-Missing-Shards" not in got.headers, got.headers
