"""What operators see of a placed node failing (shoal.api.fanout, shoal.api.metrics, shoal.api.health): before,
a node stopped or killed made every search of its shards a 503 while `/healthz` said "ok" with no problem and
`/metrics` had no fan-out series; the only trace was a warning line per search in the log.

Now `/metrics` counts the failed parts by node and a reason of a fixed few, the hedged parts by node and the
missing shards, and `/healthz` says "degraded" while a node failed its parts and answered none since (counting
it, naming no node or URL), cleared by its next answer.

Real servers: `shoal api` processes (two nodes and a router that serves no shard), real sockets, a real catalog
and broker; a stalled node is one stopped with SIGSTOP (resumed when the test ends), a dead one is killed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import api_process, free_port, stop_process, wait_for
from test_fanout_failover import NEAREST, QUERY, _ids, _indexes, _placement, _stopped, _warm

from shoal.config.settings import Settings

PLACED = "placed node"  # the words of the /healthz problem


def _health(url: str) -> dict[str, Any]:
    got = httpx.get(f"{url}/healthz", timeout=30)
    assert got.status_code == 200, got.text
    return got.json()


def _placed_problems(url: str) -> list[str]:
    return [p for p in _health(url)["problems"] if PLACED in p]


def _counter(url: str, name: str, **labels: str) -> float:
    """The value of one series of `/metrics` (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series in (f"{name}{{{want}}}", name if not labels else None):
            return float(value)
    return 0.0


@pytest.mark.timeout(600)
def test_a_failing_placed_node_shows_in_metrics_and_healthz_until_it_answers_again(
    make_settings: Callable[..., Settings], redis_url: str, tmp_path: Path
) -> None:
    """Node `beta` serves shard 1 of R alone and is listed first for both shards of H (node `gamma` the replica;
    `_placement` writes the nodes in name order). Stopped: a search of H is hedged to gamma (counted for beta), a
    search of R answers 503 (a timeout counted for beta, one missing shard), and /healthz says degraded, counting
    the node; resumed, its next answer clears it. Killed: the failure is counted as `connect`."""
    # A broker that answers. /healthz counts every tenant's shards of the session's catalog, which other tests may
    # leave lagging with no worker alive: only the placed-node problem is this test's to judge.
    settings = make_settings("local", redis_url=redis_url)
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    _indexes(settings, ["R", "H"])
    ports = {"gamma": free_port(), "beta": free_port()}
    nodes = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    placement = _placement(tmp_path / "placement.yaml", nodes, settings.tenant,
                           {"R": {"gamma": [0], "beta": [1]}, "H": {"beta": [0, 1], "gamma": [0, 1]}})
    env = {"SHOAL_PLACEMENT_FILE": placement}
    with api_process(settings, port=ports["gamma"], SHOAL_NODE="gamma", **env) as (_, gamma), \
            api_process(settings, port=ports["beta"], SHOAL_NODE="beta", **env) as (pb, beta), \
            api_process(settings, SHOAL_FANOUT_TIMEOUT_S="3", **env) as (_, router):
        _warm(gamma, "R", "0")
        _warm(gamma, "H")
        _warm(beta, "R", "1")
        _warm(beta, "H")

        def search(name: str) -> httpx.Response:
            return httpx.post(f"{router}/api/v1/search/{name}/1", json=QUERY, timeout=30)

        assert _ids(search("R")) == NEAREST
        assert _placed_problems(router) == []
        with _stopped(pb):
            assert _ids(search("H")) == NEAREST  # beta asked first, hedged to gamma, which answers
            assert _counter(router, "shoal_fanout_hedged_parts_total", node="beta") >= 1
            got = search("R")
            assert got.status_code == 503, got.text
            assert _counter(router, "shoal_fanout_part_failures_total", node="beta", reason="timeout") == 1
            assert _counter(router, "shoal_fanout_part_failures_total", node="gamma", reason="timeout") == 0
            assert _counter(router, "shoal_fanout_missing_shards_total") == 1
            health = _health(router)
            assert health["status"] == "degraded", health
            placed = _placed_problems(router)
            assert len(placed) == 1 and placed[0].startswith("1 placed node has failed"), placed
            assert "its last failure: timed out after 3 s" in placed[0], placed
            # /healthz names nothing: not the node (the metrics do), nor its URL.
            assert "beta" not in placed[0] and "127.0.0.1" not in placed[0], placed
        # Resumed: its next answer clears the problem at once (not held by the report's 5 s cache).
        wait_for(lambda: search("R").status_code == 200, 60, "node beta to answer R's shard 1 again")
        assert _placed_problems(router) == []
        # Killed: no connection can be made, counted as such.
        stop_process(pb)
        got = search("R")
        assert got.status_code == 503, got.text
        assert _counter(router, "shoal_fanout_part_failures_total", node="beta", reason="connect") == 1
        placed = _placed_problems(router)
        assert len(placed) == 1 and "its last failure: could not be connected to" in placed[0], placed
        assert _health(router)["status"] == "degraded"
