"""Parts of fanned-out searches (shoal.api.fanout): every part says which way the metric of the generation it
searched ranks, whichever path answers it (the fast path included), so a router never merges parts by a metric
they were not searched with; a part sent on a pooled connection the node closed meanwhile is sent again on a new
one; and a shard no node answered for is named in a 503 that says why each node did not answer.

Real servers: `shoal api` processes, or the API in a thread of this process where the test must reach the server's
side of a connection; real sockets, a real catalog.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from conftest import api_process, free_port, serve_api_server, wait_for

from shoal import DataPoint, DataSourceSpec, Shoal
from shoal.api.fanout import FANOUT_KEEPALIVE_S, FanOut
from shoal.api.fastpath import FastSearchAPI
from shoal.api.serve import server_options
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec
from shoal.searcher.placement import Placement

IDS = range(20)
# Points (i + 1, 1) and the query (1, 0): by dot product the largest i are nearest (products 20, 19, 18), by
# euclidean distance the smallest; a merge in the wrong direction shows at once.
QUERY = {"k": 3, "queryVectors": [{"isSparse": False, "coordinates": [1.0, 0.0]}]}
BY_DOT = [20.0, 19.0, 18.0]


def _dot_index(shoal: Shoal, name: str = "R") -> None:
    """Source S and a built flat index `name`/1 of 2 shards ranked by dot product, over the points (i + 1, 1)."""
    shoal.create_data_source(DataSourceSpec("S", "1", 2, {"id": "int64"}, ["id"]))
    shoal.create_index(IndexSpec(name, "1", "S", "1", algorithm="flat", metric="dot_product", shard_count=2))
    shoal.producer("S", "1").upload([DataPoint({"id": i}, [float(i + 1), 1.0]) for i in IDS])
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for shard in shoal.get_index(name, "1").shards:
        builder.materialize(shard.id)


def _distances(response: httpx.Response) -> list[float]:
    assert response.status_code == 200, response.text
    return [float(p["distance"]) for p in response.json()[0]["nearestDataPoints"]]


# -- every part says which way its metric ranks ---------------------------------------------------------------------


def test_an_eventual_part_says_which_way_its_metric_ranks_on_every_path(
    make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a part the fast path answered (eventual, index loaded) carried no X-Shoal-Nearer: the node fanning
    out then merged by its own view's metric, another generation's when a reindex or rollback swapped in there
    first."""
    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with Shoal(settings, notify=False) as shoal:
        _dot_index(shoal)
    on_the_spot: list[bool] = []
    original = FastSearchAPI.answer_search

    def counting(self: FastSearchAPI, *args: Any) -> Any:
        answered = original(self, *args)
        on_the_spot.append(answered is not None)
        return answered

    monkeypatch.setattr(FastSearchAPI, "answer_search", counting)
    part = {"X-Shoal-Shards": "0,1"}
    with serve_api_server(settings) as (url, _):
        search = f"{url}/api/v1/search/R/1"
        first = httpx.post(search, json=QUERY, headers=part, timeout=60)  # loads the index (the route answers)
        assert first.headers.get("X-Shoal-Nearer") == "higher", first.headers
        # Loaded now: answered on the spot by Shoal's HTTP protocol, and through ASGI by the fast path (a query
        # string takes the request past the protocol's own answer).
        for address in (search, f"{search}?via=asgi"):
            got = httpx.post(address, json=QUERY, headers=part, timeout=60)
            assert _distances(got) == BY_DOT
            assert got.headers.get("X-Shoal-Nearer") == "higher", (address, got.headers)
            assert "X-Shoal-Seq" not in got.headers  # an eventual part reflects no one seq
        assert on_the_spot[-1] is True, on_the_spot
        # A search that is no part says nothing of the kind, on the spot as before.
        plain = httpx.post(search, json=QUERY, timeout=60)
        assert _distances(plain) == BY_DOT and "X-Shoal-Nearer" not in plain.headers
        assert on_the_spot[-1] is True


@pytest.mark.timeout(600)
def test_a_router_never_merges_parts_by_a_metric_they_were_not_searched_with(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    """A reindex to euclidean swaps in; the nodes still serve the dot product generation they loaded (they poll the
    catalog rarely here, as a node busy loading the new one still answers from the old), while a router holding no
    segments sees the new one at once. The router merged the parts by euclidean: the smallest products first,
    answered 200. Now it merges as the parts say, and answers 409 (retry) while they disagree."""
    settings = make_settings("local", fanout_timeout_s=120)
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with Shoal(settings, notify=False) as shoal:
        _dot_index(shoal)
    ports = {"a": free_port(), "b": free_port()}
    placement = tmp_path / "placement.yaml"
    placement.write_text(yaml.safe_dump({
        "nodes": {n: f"http://127.0.0.1:{p}" for n, p in ports.items()},
        "indexes": [{"tenant": settings.tenant, "index": "R", "version": "1", "shards": {"a": [0], "b": [1]}}],
    }))
    slow_poll = {"SHOAL_SEARCHER_POLL_S": "3600", "SHOAL_PLACEMENT_FILE": str(placement)}

    def warm(url: str, shard: str) -> None:
        """The node's shard loaded, so its parts are answered by the fast path from now on."""
        for _ in range(2):
            got = httpx.post(f"{url}/api/v1/search/R/1", json=QUERY, headers={"X-Shoal-Shards": shard}, timeout=60)
            assert got.status_code == 200, got.text

    with api_process(settings, port=ports["a"], SHOAL_NODE="a", **slow_poll) as (_, a), \
            api_process(settings, port=ports["b"], SHOAL_NODE="b", **slow_poll) as (pb, b):
        warm(a, "0")
        warm(b, "1")
        with Shoal(settings, notify=False) as shoal:
            assert shoal.reindex("R", "1", metric="euclidean", wait=True).state == "swapped"
        with api_process(settings, SHOAL_PLACEMENT_FILE=str(placement)) as (_, router):  # serves no shard
            for _ in range(3):
                got = httpx.post(f"{router}/api/v1/search/R/1", json=QUERY, timeout=60)
                # Both nodes answer from the dot product generation: merged by it, the largest products first.
                assert _distances(got) == BY_DOT, got.text
        # Node b starts again and serves the euclidean generation, while node a still serves the old one.
        pb.terminate()
        pb.wait(30)
        with api_process(settings, port=ports["b"], SHOAL_NODE="b", **slow_poll) as (_, b), \
                api_process(settings, SHOAL_PLACEMENT_FILE=str(placement)) as (_, router):
            warm(b, "1")
            for _ in range(3):
                got = httpx.post(f"{router}/api/v1/search/R/1", json=QUERY, timeout=60)
                # Parts of generations whose metrics rank opposite ways: no merge ranks them; retry.
                assert got.status_code == 409, got.text
                assert "rank opposite ways" in got.text


# -- a part on a connection the node closed meanwhile ---------------------------------------------------------------


def test_a_node_keeps_idle_connections_longer_than_the_fan_out_does() -> None:
    """Before, the fan-out kept idle connections 60 s and nodes closed theirs after 5 s (uvicorn's default): a
    part sent as the node closed its connection was reset, and the search answered 503."""
    assert FANOUT_KEEPALIVE_S < 5  # below uvicorn's default too: a node of an older release, or plain uvicorn
    assert server_options()["timeout_keep_alive"] >= 2 * FANOUT_KEEPALIVE_S


def test_a_part_sent_on_a_connection_the_node_closed_is_sent_again(
    make_settings: Callable[..., Settings], caplog: pytest.LogCaptureFixture
) -> None:
    """The node closes an idle connection while the fan-out's pool still holds it (the client has not yet seen it
    go: its event loop was not running): the next part goes out on it and is reset. It is sent again on a new
    connection instead of its shards counting as answered by no node."""
    caplog.set_level(logging.INFO, logger="shoal.api.fanout")
    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with Shoal(settings, notify=False) as shoal:
        _dot_index(shoal)
    with serve_api_server(settings) as (url, server):
        placement = Placement.parse({"nodes": {"a": url, "r": "http://127.0.0.1:1"}, "indexes": []}, "r")
        loop = asyncio.new_event_loop()
        try:
            fanout = loop.run_until_complete(_make_fanout(placement))

            def ask(round_: int) -> None:
                outcome = loop.run_until_complete(
                    fanout._ask("a", [0, 1], "R", "1", _body(), {"content-type": "application/json"}))
                assert not isinstance(outcome, str) and outcome is not None, (round_, outcome)  # None: before
                assert [p["distance"] for p in outcome[0][0]["nearestDataPoints"]] == BY_DOT

            for round_ in range(3):
                # The first part goes out on the connection the node closed (sent again on a new one, closed after
                # it); the second leaves a connection in the pool.
                ask(round_)
                ask(round_)
                # The node drops its side of every idle connection; this process's loop is not running, so the
                # pool still takes the connection as open when the next part goes out.
                connections = list(server.server_state.connections)
                assert connections, "the fan-out's connection is kept"
                for protocol in connections:
                    protocol.loop.call_soon_threadsafe(protocol.transport.close)
                wait_for(lambda: not server.server_state.connections, 10, "the node to close its connections")
            loop.run_until_complete(fanout.close())
        finally:
            loop.close()
    # The parts after a close went out on the closed connection and were sent again (not merely sent on a new
    # one because the pool had let the connection go first).
    assert any("sending it again on a new connection" in r.getMessage() for r in caplog.records)


async def _make_fanout(placement: Placement) -> FanOut:
    return FanOut(placement, 30.0)  # made on the loop it serves


def _body() -> bytes:
    import orjson

    return orjson.dumps(QUERY)


# -- a 503 says why ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_a_shard_no_node_answered_for_is_named_with_each_nodes_reason(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    """Before, the 503 said only "shards 1 ... answered from no node": the node's own reason (its memory budget,
    a refused connection, a timeout) was in no answer, only in a log line of the process that fanned out."""
    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    rng = np.random.default_rng(3)
    rows = 16_000  # 64 float32 dimensions: about 2 MB a shard, past node b's budget of 1 MiB
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec("Big", "1", 64, {"id": "int64"}, ["id"]))
        shoal.producer("Big", "1").upload_columns(rng.random((rows, 64), dtype=np.float32), {"id": np.arange(rows)})
        for name in ("Big.Index", "Big.Gone", "Big.Hung"):
            shoal.create_index(IndexSpec(name, "1", "Big", "1", algorithm="flat", metric="euclidean",
                                         shard_count=2))
            for shard in shoal.get_index(name, "1").shards:
                ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
    ports = {"a": free_port(), "b": free_port(), "gone": free_port()}
    with socket.socket() as hung:  # a node that takes connections and never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        placement = tmp_path / "placement.yaml"
        placement.write_text(yaml.safe_dump({
            "nodes": {n: f"http://127.0.0.1:{p}" for n, p in ports.items()} | {"hung": hung_url},
            "indexes": [
                {"tenant": settings.tenant, "index": "Big.Index", "version": "1", "shards": {"a": [0], "b": [1]}},
                {"tenant": settings.tenant, "index": "Big.Gone", "version": "1", "shards": {"a": [0], "gone": [1]}},
                {"tenant": settings.tenant, "index": "Big.Hung", "version": "1", "shards": {"a": [0], "hung": [1]}},
            ],
        }))
        query = {"k": 3, "queryVectors": [{"isSparse": False, "coordinates": [0.5] * 64}]}
        with api_process(settings, port=ports["a"], SHOAL_PLACEMENT_FILE=str(placement), SHOAL_NODE="a",
                         SHOAL_FANOUT_TIMEOUT_S="3") as (_, a), \
                api_process(settings, port=ports["b"], SHOAL_PLACEMENT_FILE=str(placement), SHOAL_NODE="b",
                            SHOAL_SEARCHER_CACHE_BYTES=str(1 << 20)) as (_, b):
            for name in ("Big.Index", "Big.Gone", "Big.Hung"):  # node a's own shard loaded before any timeout
                own = httpx.post(f"{a}/api/v1/search/{name}/1", json=query, headers={"X-Shoal-Shards": "0"},
                                 timeout=60)
                assert own.status_code == 200, own.text
            # Node b's first part (a cold process: imports, the catalog's first connection) before node a's 3 s
            # timeout can meet it: the 503 below must be b's own answer, not a timeout of a slow start.
            cold = httpx.post(f"{b}/api/v1/search/Big.Index/1", json=query, headers={"X-Shoal-Shards": "1"},
                              timeout=60)
            assert cold.status_code == 503 and "needs about" in cold.text, cold.text

            def refused(name: str) -> str:
                got = httpx.post(f"{a}/api/v1/search/{name}/1", json=query, timeout=60)
                assert got.status_code == 503, got.text
                assert got.headers["X-Shoal-Missing-Shards"] == "1"
                assert got.headers["Retry-After"] == "5"  # nodes that did not answer now: a retry may find them
                message = " ".join(got.json()["errorMessages"])
                assert "shard 1 of index" in message and "answered from no node" in message, message
                assert "retry" in message
                return message

            # The node's own error message, as it answered it.
            over = refused("Big.Index")
            assert "node b answered 503: index Big.Index/1 needs about" in over, over
            assert "SHOAL_SEARCHER_CACHE_BYTES" in over, over
            # A node not there: the connection's own word, no address of the placement file's.
            gone = refused("Big.Gone")
            assert "node gone cannot connect: Connect" in gone, gone  # "Connection refused"
            assert str(ports["gone"]) not in gone and "127.0.0.1" not in gone, gone
            # A node that never answers: how long it was waited for.
            late = refused("Big.Hung")
            assert "node hung timed out after 3 s" in late, late
            assert hung_url not in late
