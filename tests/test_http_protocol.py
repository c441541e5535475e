"""Shoal's HTTP protocol (shoal.api.http_protocol) over real sockets: a plain search answered on the spot gives the
same bytes as the routes, answers keep their order behind a request still in progress, connections close when the
client asks, a client that does not read its answers is not read from either, refusals the headers tell come before
the body, a graceful shutdown answers a search still arriving, and the access log still names every request."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from conftest import serve_api, serve_api_server, wait_for

from shoal import DataSourceSpec, Shoal
from shoal.api.fastpath import FastSearchAPI
from shoal.api.http_protocol import NoDelayHttpProtocol
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec

INDEX = "/api/v1/search/Proto.Index/1"


def _point(i: int, vector: list[float]) -> dict[str, Any]:
    return {"attributes": [{"key": "id", "value": {"int64": i}}], "vector": {"isSparse": False, "coordinates": vector}}


def _query(k: int) -> bytes:
    return json.dumps({"k": k, "queryVectors": [{"isSparse": False, "coordinates": [0.0, 2.0]}]}).encode()


@pytest.fixture
def answered_on_the_spot(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each search the protocol offered the app was answered on the spot (True) or passed on."""
    seen: list[bool] = []
    original = FastSearchAPI.answer_search

    def counting(self: FastSearchAPI, *args: Any) -> bytes | None:
        content = original(self, *args)
        seen.append(content is not None)
        return content

    monkeypatch.setattr(FastSearchAPI, "answer_search", counting)
    return seen


@pytest.fixture
def connections(monkeypatch: pytest.MonkeyPatch) -> list[NoDelayHttpProtocol]:
    """The server's side of every connection made from now on, to see what the server holds for a client."""
    made: list[NoDelayHttpProtocol] = []
    original = NoDelayHttpProtocol.connection_made

    def recording(self: NoDelayHttpProtocol, transport: Any) -> None:
        original(self, transport)
        made.append(self)

    monkeypatch.setattr(NoDelayHttpProtocol, "connection_made", recording)
    return made


def _flat_index(url: str, settings: Settings) -> None:
    """A flat index of three points behind the API at `url`, built (not yet loaded by the API)."""
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec("Proto.Source", "1", 2, {"id": "int64"}, ["id"]))
        index = shoal.create_index(IndexSpec("Proto.Index", "1", "Proto.Source", "1", algorithm="FaissIndex.L2"))
        r = httpx.post(f"{url}/api/v1/upload/Proto.Source/1",
                       json=[_point(1, [0.0, 1.0]), _point(2, [1.0, 0.0]), _point(3, [-0.5, 0.0])])
        assert r.status_code == 200, r.text
        for shard in index.shards:
            ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)


@pytest.fixture
def index(served: tuple[str, Settings]) -> Iterator[str]:
    """A loaded flat index of three points behind the served API; yields the API's URL."""
    url, settings = served
    _flat_index(url, settings)
    # The first search loads the index (through the routes); later ones may be answered on the spot.
    assert httpx.post(url + INDEX, content=_query(2)).status_code == 200
    yield url


def _responses(sock: socket.socket, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """Read `count` HTTP/1.1 responses (status, lower-case headers, body) off the socket, in order."""
    stream = sock.makefile("rb")
    out = []
    for _ in range(count):
        status = int(stream.readline().split()[1])
        headers: dict[str, str] = {}
        while (line := stream.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        out.append((status, headers, stream.read(int(headers["content-length"]))))
    return out


def _request(body: bytes, *headers: str, path: str = INDEX, version: str = "1.1") -> bytes:
    head = [f"POST {path} HTTP/{version}", "Host: test", "Content-Type: application/json",
            f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _server_side(url: str, connections: list[NoDelayHttpProtocol]) -> tuple[socket.socket, NoDelayHttpProtocol]:
    """A new connection to the API at `url`, and the server's side of it."""
    before = len(connections)
    sock = _connect(url)
    wait_for(lambda: len(connections) > before, 10, "the server to accept the connection")
    return sock, connections[before]


def test_a_search_answered_on_the_spot_is_the_routes_answer(index: str, answered_on_the_spot: list[bool]) -> None:
    spot = httpx.post(index + INDEX, content=_query(2))
    proxied = httpx.post(index + INDEX, content=_query(2), headers={"X-Forwarded-For": "10.1.2.3"})
    assert answered_on_the_spot == [True, True]
    # A query string sends the same search through the routes.
    routed = httpx.post(index + INDEX + "?via=routes", content=_query(2))
    assert answered_on_the_spot == [True, True]
    assert spot.status_code == routed.status_code == proxied.status_code == 200
    assert spot.content == routed.content == proxied.content
    assert spot.headers["content-type"] == routed.headers["content-type"] == "application/json"
    [result] = spot.json()
    assert [p["distance"] for p in result["nearestDataPoints"]] == [1.0, 4.25]
    # Errors are the routes' own: a search the app declines on the spot is answered in Vektonn's error shape.
    bad = httpx.post(index + INDEX, content=b'{"k": 0, "queryVectors": []}')
    assert bad.status_code == 400 and "errorMessages" in bad.json()
    assert answered_on_the_spot == [True, True, False]


def test_pipelined_answers_keep_their_order(index: str, answered_on_the_spot: list[bool]) -> None:
    """A plain search pipelined behind a strong one (answered on the thread pool) is answered after it."""
    with _connect(index) as sock:
        sock.sendall(_request(_query(1), "X-Shoal-Consistency: strong") + _request(_query(2)) + _request(_query(3)))
        answers = _responses(sock, 3)
    assert [status for status, _, _ in answers] == [200, 200, 200]
    assert [len(json.loads(body)[0]["nearestDataPoints"]) for _, _, body in answers] == [1, 2, 3]


def test_the_connection_closes_when_the_client_asks(index: str, answered_on_the_spot: list[bool]) -> None:
    # An HTTP/1.0 connection is never kept, whatever it asks (as uvicorn's cycle decides for the routes).
    for extra, version in ((("Connection: close",), "1.1"), ((), "1.0"), (("Connection: keep-alive",), "1.0")):
        with _connect(index) as sock:
            sock.sendall(_request(_query(2), *extra, version=version))
            [(status, headers, body)] = _responses(sock, 1)
            assert status == 200 and headers["connection"] == "close"
            assert len(json.loads(body)[0]["nearestDataPoints"]) == 2
            sock.settimeout(2)  # well before uvicorn's keep-alive timeout (5 s) would close it
            assert sock.recv(1) == b""  # closed by the server
    assert answered_on_the_spot == [True, True, True]


def test_a_client_that_does_not_read_its_answers_is_not_read_from(
    index: str, answered_on_the_spot: list[bool], connections: list[NoDelayHttpProtocol]
) -> None:
    """Searches pipelined by a client that never reads: the server stops answering (and reading) once its writes
    are held back, as the routes do, instead of buffering every answer; read later, every answer is there."""
    body = json.dumps({"k": 3, "queryVectors": [{"isSparse": False, "coordinates": [0.0, 2.0]}] * 200}).encode()
    count = 200  # about 2 MB of searches, 10 MB of answers
    sock, server_side = _server_side(index, connections)
    with sock:
        # In a thread: once the server stops reading, the kernel's buffers may not take all of it.
        sender = threading.Thread(target=sock.sendall, args=(_request(body) * count,), daemon=True)
        sender.start()

        def held() -> bool:  # writes held back, and a search waiting for them to drain before it answers
            cycle = server_side.cycle
            return server_side.flow.write_paused and cycle is not None and not cycle.response_complete

        wait_for(lambda: len(answered_on_the_spot) == count or held(), 60,
                 "the server to answer every search, or to wait for the client to read")
        assert server_side.transport.get_write_buffer_size() < 1 << 20, "the server buffers answers unread"
        answers = _responses(sock, count)  # now read: the server goes on
        sender.join(30)
    assert [status for status, _, _ in answers] == [200] * count
    assert all(len(json.loads(answer)) == 200 for _, _, answer in answers)


def test_a_large_or_chunked_body_goes_through_the_routes(index: str, answered_on_the_spot: list[bool]) -> None:
    padded = _query(2)[:-1] + b"," + b'"pad": "' + b"x" * (2 << 20) + b'"}'  # over FAST_BODY_BYTES
    r = httpx.post(index + INDEX, content=padded)
    assert r.status_code == 200 and len(r.json()[0]["nearestDataPoints"]) == 2

    def chunks() -> Iterator[bytes]:
        body = _query(2)
        yield body[:10]
        yield body[10:]

    r = httpx.post(index + INDEX, content=chunks())  # Transfer-Encoding: chunked
    assert r.status_code == 200 and len(r.json()[0]["nearestDataPoints"]) == 2
    assert answered_on_the_spot == []


def test_the_access_log_names_searches_answered_on_the_spot(
    make_settings: Callable[..., Settings], answered_on_the_spot: list[bool]
) -> None:
    """The line is written after the answer is sent, by uvicorn's access logger, in its usual form."""
    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    collect = Collect()
    with serve_api(settings, log_level="info") as url:
        logging.getLogger("uvicorn.access").addHandler(collect)
        try:
            _flat_index(url, settings)
            _access_log_lines(url, lines, answered_on_the_spot)
        finally:
            logging.getLogger("uvicorn.access").removeHandler(collect)


def _access_log_lines(url: str, lines: list[str], answered_on_the_spot: list[bool]) -> None:
    with httpx.Client(base_url=url) as http:
        assert http.post(INDEX, content=_query(1)).status_code == 200  # loads the index (routes)
        assert http.post(INDEX, content=_query(1)).status_code == 200  # on the spot
        assert http.post(INDEX, content=b"{").status_code == 400
        # Behind a trusted proxy (uvicorn trusts 127.0.0.1), on the spot or not, the forwarded client is named.
        proxied = {"X-Forwarded-For": "10.1.2.3"}
        assert http.post(INDEX, content=_query(1), headers=proxied).status_code == 200
        assert http.post(INDEX + "?via=routes", content=_query(1), headers=proxied).status_code == 200
    assert answered_on_the_spot == [False, True, False, True]
    searches = lambda: [line for line in lines if INDEX in line]  # noqa: E731
    wait_for(lambda: len(searches()) == 5, 10, "five access log lines")
    assert [line.split('"')[1] for line in searches()] == [f"POST {INDEX} HTTP/1.1"] * 4 + [
        f"POST {INDEX}?via=routes HTTP/1.1"]
    assert [line.rsplit(" ", 1)[1] for line in searches()] == ["200", "200", "400", "200", "200"]
    clients = [line.split(" ", 1)[0] for line in searches()]
    assert all(c.startswith("127.0.0.1:") for c in clients[:3])
    assert clients[3] == clients[4] == "10.1.2.3:0"


def test_refusals_the_headers_tell_come_before_the_body(make_settings: Callable[..., Settings]) -> None:
    """401 for a search without a key (no anonymous tenant), 413 for a declared body over SHOAL_MAX_BODY_BYTES:
    answered from the headers, before a byte of the body is sent, as for every other route."""
    settings = make_settings("local", max_body_bytes=1000)
    assert settings.resolved_anonymous_tenant is None
    with serve_api(settings) as url:
        for length, status in ((5000, 413), (900, 401)):
            with _connect(url) as sock:
                sock.settimeout(10)  # no body follows: an answer that waits for it never comes
                sock.sendall(_request(b"x" * length)[:-length])
                [(got, _, body)] = _responses(sock, 1)
                assert got == status, body
                assert "errorMessages" in json.loads(body)


def test_a_body_in_parts_from_a_known_caller_is_answered_on_the_spot(
    index: str, answered_on_the_spot: list[bool], connections: list[NoDelayHttpProtocol]
) -> None:
    """The check a body still arriving earns (is its caller known without I/O?) keeps a known caller's search
    on the spot."""
    request = _request(_query(2))
    sock, server_side = _server_side(index, connections)
    with sock:
        sock.sendall(request[:-5])
        wait_for(lambda: server_side._fast_body is not None, 10, "the server to read the request's head")
        sock.sendall(request[-5:])
        [(status, _, body)] = _responses(sock, 1)
    assert status == 200 and len(json.loads(body)[0]["nearestDataPoints"]) == 2
    assert answered_on_the_spot == [True]


def test_a_graceful_shutdown_answers_a_search_still_arriving(
    make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch,
    answered_on_the_spot: list[bool], connections: list[NoDelayHttpProtocol]
) -> None:
    """SIGTERM (a rolling restart) while a search's body is arriving: it is answered, with Connection: close, and
    then the connection closes, as the routes do."""
    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    shut: list[NoDelayHttpProtocol] = []
    original = NoDelayHttpProtocol.shutdown

    def recording(self: NoDelayHttpProtocol) -> None:
        shut.append(self)
        original(self)

    monkeypatch.setattr(NoDelayHttpProtocol, "shutdown", recording)
    with serve_api_server(settings) as (url, server):
        _flat_index(url, settings)
        assert httpx.post(url + INDEX, content=_query(2)).status_code == 200  # loads the index
        request = _request(_query(2))
        sock, server_side = _server_side(url, connections)
        with sock:
            sock.sendall(request[:-5])
            wait_for(lambda: server_side._fast_body is not None, 10, "the server to read the request's head")
            server.should_exit = True
            wait_for(lambda: server_side in shut, 10, "the server to shut the connection down")
            sock.sendall(request[-5:])
            [(status, headers, body)] = _responses(sock, 1)
            assert status == 200 and headers["connection"] == "close"
            assert len(json.loads(body)[0]["nearestDataPoints"]) == 2
            assert sock.recv(1) == b""  # closed by the server
    assert answered_on_the_spot[-1] is True


@pytest.mark.parametrize("first, second", [("bogus", "eventual"), ("eventual", "bogus")])
def test_a_header_sent_twice_counts_by_its_first_value_everywhere(
    index: str, answered_on_the_spot: list[bool], first: str, second: str
) -> None:
    """The routes read a repeated header's first value (as a key sent twice is read): a search answered on the
    spot must read the same one, or it answers as another key, tenant or consistency level than the route."""
    answers = {}
    for path in (INDEX, INDEX + "?via=routes"):
        with _connect(index) as sock:
            sock.sendall(_request(_query(1), f"X-Shoal-Consistency: {first}", f"X-Shoal-Consistency: {second}",
                                  path=path))
            answers[path] = _responses(sock, 1)[0]
    (spot_status, _, spot), (routed_status, _, routed) = answers.values()
    assert spot_status == routed_status == (400 if first == "bogus" else 200), (spot, routed)
    assert spot == routed
