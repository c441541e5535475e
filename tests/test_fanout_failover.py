"""Fan-out across replicas and failing nodes (shoal.api.fanout, shoal.searcher.placement): a search has one
deadline for all the nodes it asks and asks the next replica of a stalled node without waiting for it; a node's
4xx that is not the caller's own error is the node failing (its replica answers, or the 503 names it); a node URL
no request can reach is refused when the placement loads; a DNS failure and a shard placed on no node are said in
words, without a "retry" no retry can honour.

Real servers: `shoal api` processes (nodes and a router that serves no shard), real sockets, a real catalog; a
stalled node is one stopped with SIGSTOP (resumed when the test ends).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import api_process, free_port, wait_for

from shoal import DataPoint, DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.errors import ConfigurationError
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec
from shoal.searcher.placement import Placement

QUERY = {"k": 3, "queryVectors": [{"isSparse": False, "coordinates": [0.0, 0.0]}]}
NEAREST = [0, 1, 2]  # ids of the points (i, i): the nearest to the origin by euclidean distance


def _indexes(settings: Settings, names: list[str]) -> None:
    """Source S and, for each name, a built flat euclidean index `name`/1 of 2 shards over the points (i, i)."""
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec("S", "1", 2, {"id": "int64"}, ["id"]))
        shoal.producer("S", "1").upload([DataPoint({"id": i}, [float(i), float(i)]) for i in range(20)])
        builder = ShardBuilder(shoal.engine, shoal.storage)
        for name in names:
            shoal.create_index(IndexSpec(name, "1", "S", "1", algorithm="flat", metric="euclidean", shard_count=2))
            for shard in shoal.get_index(name, "1").shards:
                builder.materialize(shard.id)


def _ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return [next(int(a["value"]["int64"]) for a in p["attributes"] if a["key"] == "id")
            for p in response.json()[0]["nearestDataPoints"]]


def _placement(path: Path, nodes: dict[str, str], tenant: str, shards: dict[str, dict[str, list[int]]]) -> str:
    path.write_text(yaml.safe_dump({
        "nodes": nodes,
        "indexes": [{"tenant": tenant, "index": name, "version": "1", "shards": by_node}
                    for name, by_node in shards.items()],
    }))
    return str(path)


@contextlib.contextmanager
def _stopped(*procs: subprocess.Popen[str]) -> Iterator[None]:
    """The processes stopped (SIGSTOP: they keep their sockets and answer nothing), resumed when the block ends."""
    for proc in procs:
        os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)


def _warm(url: str, name: str, shards: str = "0,1") -> None:
    """The node's shards of the index loaded (a cold first part must not meet a deadline)."""
    got = httpx.post(f"{url}/api/v1/search/{name}/1", json=QUERY, headers={"X-Shoal-Shards": shards}, timeout=60)
    assert got.status_code == 200, got.text


# -- one deadline; a stalled replica is not waited on ---------------------------------------------------------------


@pytest.mark.timeout(600)
def test_a_stalled_replica_is_not_waited_on_and_the_search_has_one_deadline(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    """Before, each replica got the whole SHOAL_FANOUT_TIMEOUT_S, one after another: with the first replica
    stopped every search waited it out (60 s here) before asking the healthy one, and with both stopped the
    search took twice the timeout. Now the healthy replica is asked after a short delay and answers; with both
    stopped the search ends at its one deadline with a 503 naming both."""
    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    _indexes(settings, ["R"])
    ports = {"a": free_port(), "b": free_port()}
    nodes = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    placement = _placement(tmp_path / "placement.yaml", nodes, settings.tenant, {"R": {"a": [0, 1], "b": [0, 1]}})
    env = {"SHOAL_PLACEMENT_FILE": placement}
    with api_process(settings, port=ports["a"], SHOAL_NODE="a", **env) as (pa, a), \
            api_process(settings, port=ports["b"], SHOAL_NODE="b", **env) as (pb, b), \
            api_process(settings, SHOAL_FANOUT_TIMEOUT_S="60", **env) as (_, router), \
            api_process(settings, SHOAL_FANOUT_TIMEOUT_S="10", **env) as (_, quick):
        _warm(a, "R")
        _warm(b, "R")
        assert _ids(httpx.post(f"{router}/api/v1/search/R/1", json=QUERY, timeout=60)) == NEAREST
        with _stopped(pa):
            # Waiting for node a would take the router's 60 s: the client gives up at 30 s, long before.
            for _ in range(3):  # the first search hedges to b; the next ones ask b first (a failed lately)
                got = httpx.post(f"{router}/api/v1/search/R/1", json=QUERY, timeout=30)
                assert _ids(got) == NEAREST  # only node b answers while a is stopped: the answer is b's
            with _stopped(pb):
                # Both replicas stopped: the search ends at its one 10 s deadline (before: 10 s per replica,
                # rounded up, then 503 past the client's 17 s).
                got = httpx.post(f"{quick}/api/v1/search/R/1", json=QUERY, timeout=17)
                assert got.status_code == 503, got.text
                message = " ".join(got.json()["errorMessages"])
                assert "node a timed out after 10 s" in message and "node b timed out after 10 s" in message, message
                assert got.headers["Retry-After"] == "5"  # stalled nodes may come back
        # Both resumed: node a answers again (it is asked last for a while, but still asked when b fails).
        assert _ids(httpx.post(f"{router}/api/v1/search/R/1", json=QUERY, timeout=60)) == NEAREST


def _searches_answered(proc: subprocess.Popen[str], name: str) -> int:
    """How many searches of `name` the node started with --access-log has answered (its access log's lines)."""
    text = Path(proc.log_path).read_text()  # type: ignore[attr-defined]
    return text.count(f'"POST /api/v1/search/{name}/1 HTTP/1.1" 200')


@pytest.mark.timeout(600)
def test_a_slow_nodes_answer_is_kept_when_a_replica_answered_part_of_it(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    """Shard 0 on nodes a and b, shard 1 on a alone. Node a slow: its part (shards 0 and 1) is hedged to b for
    shard 0, and b answers first. Then a answers both: its results cannot be split by shard, and were dropped
    whole as overlapping b's, so shard 1, which no other node serves, was missing (a 503 saying no retry would
    help). A's answer now replaces b's, which lay within it."""
    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    _indexes(settings, ["P"])
    ports = {"a": free_port(), "b": free_port()}
    nodes = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    placement = _placement(tmp_path / "placement.yaml", nodes, settings.tenant, {"P": {"a": [0, 1], "b": [0]}})
    env = {"SHOAL_PLACEMENT_FILE": placement}
    with api_process(settings, port=ports["a"], SHOAL_NODE="a", **env) as (pa, a), \
            api_process(settings, "--access-log", port=ports["b"], SHOAL_NODE="b", **env) as (pb, b), \
            api_process(settings, SHOAL_FANOUT_TIMEOUT_S="60", **env) as (_, router):
        _warm(a, "P")
        _warm(b, "P", "0")
        answered = _searches_answered(pb, "P")
        with ThreadPoolExecutor(1) as pool:
            with _stopped(pa):
                search = pool.submit(httpx.post, f"{router}/api/v1/search/P/1", json=QUERY, timeout=60)
                # The hedge: node b asked for shard 0 after a second without a's answer, and answering it.
                wait_for(lambda: _searches_answered(pb, "P") > answered, 30, "node b to answer the hedged part")
            got = search.result(60)  # node a resumed: its part, both shards, answers now
        assert _ids(got) == NEAREST


# -- a node's own 4xx, a DNS failure, a shard on no node -----------------------------------------------------------


@pytest.mark.timeout(600)
def test_a_nodes_4xx_is_the_node_failing_and_unhelpable_503s_say_no_retry(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    """Before, a node answering 404 (a URL with a wrong path prefix) ended the search with that 404 although a
    replica served the shard, and X-Shoal-Allow-Partial did not help; a DNS failure read "cannot connect: Unknown
    error -2"; a shard placed on no node answered a 503 saying "retry"."""
    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    _indexes(settings, ["W", "X", "D", "U"])
    port = free_port()
    a = f"http://127.0.0.1:{port}"
    nodes = {"a": a, "prefixed": f"{a}/prefix", "dns": "http://no-such-host.invalid:8080"}
    placement = _placement(tmp_path / "placement.yaml", nodes, settings.tenant, {
        "W": {"prefixed": [0, 1], "a": [0, 1]},  # the wrong URL listed first, a replica that works second
        "X": {"prefixed": [0], "a": [1]},  # shard 0 only on the wrong URL
        "D": {"dns": [0], "a": [1]},
        "U": {"a": [0]},  # shard 1 on no node
    })
    env = {"SHOAL_PLACEMENT_FILE": placement}
    with api_process(settings, port=port, SHOAL_NODE="a", **env) as (_, node), \
            api_process(settings, **env) as (_, router):
        for name, shards in (("W", "0,1"), ("X", "1"), ("D", "1"), ("U", "0")):
            _warm(node, name, shards)

        def search(name: str, **headers: str) -> httpx.Response:
            return httpx.post(f"{router}/api/v1/search/{name}/1", json=QUERY, headers=headers, timeout=60)

        # The replica answers for the node whose URL has no such route.
        assert _ids(search("W")) == NEAREST
        # No replica: a 503 naming the node's 404, which no retry mends; a partial answer when asked for.
        got = search("X")
        assert got.status_code == 503, got.text
        message = " ".join(got.json()["errorMessages"])
        assert "node prefixed answered 404" in message, message
        assert "Retry-After" not in got.headers and "retry, or" not in message, (got.headers, message)
        assert "a retry will not help" in message, message
        partial = search("X", **{"X-Shoal-Allow-Partial": "true"})
        assert partial.status_code == 200, partial.text
        assert partial.headers["X-Shoal-Missing-Shards"] == "0"
        # A host that does not resolve: the resolver's words, not "Unknown error -2".
        got = search("D")
        assert got.status_code == 503, got.text
        message = " ".join(got.json()["errorMessages"])
        assert "node dns cannot resolve its host: " in message and "Unknown error" not in message, message
        # A shard the placement puts on no node: said so, with no retry to wait for.
        got = search("U")
        assert got.status_code == 503, got.text
        message = " ".join(got.json()["errorMessages"])
        assert "lists no node for shard 1" in message and "retry, or" not in message, message
        assert "Retry-After" not in got.headers
        # The caller's own error still comes back as it is.
        bad = httpx.post(f"{router}/api/v1/search/W/1", json={"k": 3, "queryVectors": [
            {"isSparse": False, "coordinates": [0.0, 0.0, 0.0]}]}, timeout=60)
        assert bad.status_code == 400, bad.text


# -- node URLs checked when the placement loads ---------------------------------------------------------------------


@pytest.mark.parametrize(("url", "complaint"), [
    ("http://127.0.0.1:99999", "Port out of range"),
    ("http://127.0.0.1:0", "port 0"),
    ("http://:8080", "names no host"),
    ("http://h:abc", "is not a valid URL"),
    ("http://h:80/p?x=1", "no query"),
    ("http://user:secret@h:80", "no credentials"),
    ("http://h st:80", "no spaces"),
])
def test_a_node_url_no_request_can_reach_is_refused_when_the_placement_loads(url: str, complaint: str) -> None:
    """Before, such URLs were accepted and every search asking the node answered a retryable 503 ("did not
    answer (InvalidUrlClientError)")."""
    with pytest.raises(ConfigurationError) as refused:
        Placement.parse({"nodes": {"bad": url}, "indexes": []}, None, "pl.yaml")
    message = str(refused.value)
    assert message.startswith("pl.yaml: node 'bad': URL") and url in message and complaint in message, message


def test_a_node_url_with_a_path_prefix_or_ipv6_host_is_accepted() -> None:
    """A node behind a proxy's path prefix, or named by an IPv6 address, is a URL a part can reach."""
    placement = Placement.parse({"nodes": {"p": "http://h:80/search-tier/", "v6": "http://[::1]:8080"},
                                 "indexes": []}, None)
    assert placement.urls["p"] == "http://h:80/search-tier/"


def test_shoal_api_refuses_a_node_url_with_no_such_port_before_it_starts(tmp_path: Path) -> None:
    """The process does not start: the file, the node and the URL are named."""
    bad = tmp_path / "placement.yaml"
    bad.write_text(yaml.safe_dump({"nodes": {"bad": "http://127.0.0.1:99999"}, "indexes": []}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env |= {"SHOAL_DATA_DIR": str(tmp_path / "data"), "SHOAL_PLACEMENT_FILE": str(bad)}
    run = subprocess.run([sys.executable, "-m", "shoal.cli", "api", "--port", str(free_port())], env=env,
                         capture_output=True, text=True, timeout=120)
    said = run.stdout + run.stderr
    assert run.returncode == 1, said
    assert f"{bad}: node 'bad': URL 'http://127.0.0.1:99999' is not a valid URL" in said, said
    assert "Traceback" not in said
