"""Shoal's HTTP/1.1 protocol: uvicorn's httptools protocol with TCP_NODELAY on every connection, a response's
writes sent in one go, its access log line written after it, and the hot search route answered on the spot.

Why TCP_NODELAY by hand: with `--workers N` uvicorn binds the listening socket itself, without naming the
protocol, and asyncio's own loop then never sets TCP_NODELAY on accepted connections; every keep-alive request
after the first waits for a delayed ACK (~40 ms on Linux). uvloop sets it, but the fix must not depend on
which loop is installed.

Why the search route is answered here: an eventual search of a loaded index takes about 0.1 ms, and uvicorn's
way to an ASGI app (a scope, a task, receive and send awaited, headers checked) cost a further 15-25 us a request
(bench/api.py; a bare ASGI app against a bare protocol answering the same bytes). The protocol asks the app
(FastSearchAPI.answer_search) once the request is complete, and writes the answer itself; whenever the app
declines, or the request is anything but a plain one (another route, a query string, chunked or large bodies, a
body over the app's limit, an expectation, a request pipelined behind one in progress, a client not reading its
answers), uvicorn handles it as always, with the body read so far handed on. A body that does not come with its
headers is handed on at once when the app says its caller is not known without I/O (may_answer_search), so the
routes answer what the headers alone tell (401, 429) before the body is read. Behind a trusted proxy the access
log names the client its X-Forwarded-For names, as uvicorn's proxy middleware would (with a uvicorn whose
middleware offers no such lookup, proxied requests take the usual way).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Callable
from typing import Any

from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.utils import get_client_addr

# The scope key holding the connection's own peer (host, port), which uvicorn's proxy middleware leaves alone
# while it rewrites "client" from X-Forwarded-For (shoal.api.security.peer_address).
PEER = "shoal.peer"
# The requests answered on the spot: the search route's prefix, bodies up to this size.
SEARCH_PREFIX = b"/api/v1/search/"
FAST_BODY_BYTES = 1 << 20
_OK = b"HTTP/1.1 200 OK\r\n"
JSON_HEADER = b"content-type: application/json\r\n"


class CoalescingTransport:
    """A transport whose writes of one event-loop iteration leave in one send, followed by the work that was
    waiting for them to leave (after_send).

    uvicorn writes a response's head and its body in two calls, and each is a send syscall at once: on
    loopback, a small search answer cost two sends and two wake-ups of the client (15% of the API's GIL time
    in bench/api.py). Writes are gathered and sent together at the end of the iteration they were made in, so
    nothing waits for more than that; everything else is the real transport's.
    """

    __slots__ = ("_after", "_loop", "_pending", "_scheduled", "_transport", "queued")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._after: list[Callable[[], object]] = []
        self._scheduled = False
        self.queued = 0  # bytes queued and not yet handed to the real transport

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def write(self, data: bytes) -> None:
        """Queue `data`; it is sent, with whatever else this iteration writes, once the iteration ends."""
        self._pending.append(data)
        self.queued += len(data)
        self._schedule()

    def writelines(self, lines: Any) -> None:
        """Queue several buffers, as `write` does."""
        for data in lines:
            self.write(data)

    def after_send(self, work: Callable[[], object]) -> None:
        """Run `work` on the loop once what is queued now (and whatever else this iteration writes) was sent."""
        self._after.append(work)
        self._schedule()

    def flush(self) -> None:
        """Send what is queued now, then run the work that waited for it."""
        self._scheduled = False
        pending, self._pending = self._pending, []
        self.queued = 0
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))
        if self._after:
            after, self._after = self._after, []
            for work in after:
                work()

    def get_write_buffer_size(self) -> int:
        """Bytes not yet sent: queued here and buffered by the real transport."""
        return self.queued + self._transport.get_write_buffer_size()

    def close(self) -> None:
        """Send what is queued, then close."""
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        """Drop what is queued and close at once (work waiting for a send still runs)."""
        self._pending.clear()
        self.queued = 0
        self._transport.abort()
        self.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class AfterSendAccessLog:
    """Stands in for uvicorn's access logger on one connection: a request's line is logged, by the same logger and
    so in the same form, right after its response has been sent instead of before its head is written.

    uvicorn logs the line as the response starts: formatting and writing it (a write to the log stream per
    request) then delays every answer, by about 40 us on this machine, a sixth of a search's round trip with one
    client (bench/api.py). After the send, the line is written while the client reads the answer.
    """

    __slots__ = ("_logger", "_transport")

    def __init__(self, logger: logging.Logger, transport: CoalescingTransport) -> None:
        self._logger = logger
        self._transport = transport

    def info(self, msg: str, *args: Any) -> None:
        """Log `msg % args` at INFO once the response being written has been sent."""
        self._transport.after_send(functools.partial(self._logger.info, msg, *args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


class NoDelayHttpProtocol(HttpToolsProtocol):  # type: ignore[misc]
    """uvicorn's HTTP protocol with TCP_NODELAY set on the connection's socket, a response's writes sent in one go
    (CoalescingTransport), its access log line written after them (AfterSendAccessLog), and plain searches
    answered without an ASGI cycle (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fast_body: list[bytes] | None = None  # the body of a request that may be answered on the spot
        self._fast_screened = False  # its caller was screened (its body did not come with its headers)
        self._closing = False  # a graceful shutdown waits for that request's answer, then closes
        search_app, self._trusted = _search_app(self.app)
        self._answer: Answerer | None = getattr(search_app, "answer_search", None)
        self._screen: Screen | None = getattr(search_app, "may_answer_search", None)
        # A larger body is answered 413 by the app before it is read: it never waits here to be buffered.
        self._fast_limit = min(FAST_BODY_BYTES, getattr(search_app, "max_body_bytes", None) or FAST_BODY_BYTES)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # a socket that is already gone: the protocol will see it closed
                pass
        super().connection_made(transport)
        # Responses write through the wrapper; flow control and the connection's own calls reach the real
        # transport through it unchanged.
        self.transport = CoalescingTransport(transport, self.loop)
        try:
            self._write_high = transport.get_write_buffer_limits()[1]
        except (AttributeError, NotImplementedError):  # a transport without limits: uvicorn's own mark
            self._write_high = HIGH_WATER_LIMIT
        if self.access_log:  # each request's cycle takes the protocol's logger
            self.access_logger = AfterSendAccessLog(self.access_logger, self.transport)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # Kept apart from "client": failed authentications count against the peer, and X-Forwarded-For, which
        # any loopback peer may send, must not choose the address counted.
        self.scope[PEER] = self.client  # type: ignore[typeddict-unknown-key]

    # -- requests answered on the spot ----------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._fast_body is not None and not self._fast_screened and not self.transport.is_closing():
            # The body is still to come: the routes answer a caller the headers alone refuse (401, 429) before
            # it is read. Asked once a request, and only then: a body that came with its headers costs nothing.
            self._fast_screened = True
            if self._screen is not None and not self._screen(self.headers):
                self._pass_on(b"".join(self._fast_body))

    def on_headers_complete(self) -> None:
        if self._may_answer():
            self._fast_body = []  # uvicorn's cycle is made only if the app declines (on_message_complete)
            self._fast_screened = False
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._fast_body is None:
            super().on_body(body)
        else:
            self._fast_body.append(body)

    def on_message_complete(self) -> None:
        chunks = self._fast_body
        if chunks is None:
            super().on_message_complete()
            return
        body = b"".join(chunks)
        answered = None
        # Writes made here leave at the end of the iteration (CoalescingTransport): writing is never paused when
        # on_response_complete resumes reading below, as nothing is answered here while it is (_writes_held).
        if self._answer is not None and not self._writes_held():
            answered = self._answer(self.url.decode("latin-1"), body, self.headers)
        if answered is None:  # the app's routes answer it, as if it had come the usual way
            self._pass_on(body)
            super().on_message_complete()
            return
        self._fast_body = None
        # As uvicorn's cycle decides: an HTTP/1.0 connection is never kept, whatever its Connection header says.
        keep_alive = (not self._closing and self.parser.get_http_version() != "1.0"
                      and self.parser.should_keep_alive())
        head = [_OK]
        for name, value in self.server_state.default_headers:
            head += (name, b": ", value, b"\r\n")
        content, extra = answered
        head += (JSON_HEADER, b"content-length: %d\r\n" % len(content))
        for key, text in extra.items():  # a part's X-Shoal-Nearer and X-Shoal-Seq: the node asking merges by them
            head += (key.encode("latin-1"), b": ", text.encode("latin-1"), b"\r\n")
        if not keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        if self.access_log:
            self.access_logger.info('%s - "%s %s HTTP/%s" %d', self._client_addr(),
                                    self.parser.get_method().decode("ascii"), self.url.decode("latin-1"),
                                    self.parser.get_http_version(), 200)
        self.transport.write(b"".join(head) + content)
        if not keep_alive:
            self.transport.close()
        self.on_response_complete()

    def _pass_on(self, body: bytes) -> None:
        """Hand the request taken on the spot to uvicorn's cycle with the body read so far, as if it had come the
        usual way (what is still to come of it follows there)."""
        self._fast_body = None
        super().on_headers_complete()
        if self._closing:  # shutdown() came while the body was arriving: close after the answer
            self.cycle.keep_alive = False
        if body:
            super().on_body(body)

    def shutdown(self) -> None:
        """Start a graceful shutdown: a request taken on the spot whose body is still arriving is answered once
        it has come (with Connection: close), then the connection closes; otherwise as uvicorn does."""
        if self._fast_body is not None:
            self._closing = True
            return
        super().shutdown()

    def _may_answer(self) -> bool:
        """True for a request the app may answer on the spot: a GET or POST of the search route on HTTP/1.x, no
        query string or escapes, a declared body within FAST_BODY_BYTES and the app's limit, no upgrade,
        expectation or proxy header, no earlier request of this connection still being answered (answers keep
        their order), and a client reading its answers (writing not paused)."""
        if self._answer is None or not self.url.startswith(SEARCH_PREFIX) or b"?" in self.url or b"%" in self.url:
            return False
        if self.parser.get_method() not in (b"POST", b"GET") or self.expect_100_continue or self._writes_held():
            return False
        if self.parser.should_upgrade() or self.pipeline or self.limit_concurrency is not None:
            return False
        if self.cycle is not None and not self.cycle.response_complete:
            return False
        length = None
        for name, value in self.headers:
            if name == b"content-length":
                if length is not None or not value.isdigit():
                    return False
                length = int(value)
            elif name == b"transfer-encoding" or (name == b"x-forwarded-for" and self._trusted is None):
                return False
        return length is not None and length <= self._fast_limit

    def _writes_held(self) -> bool:
        """True while the client is not taking its answers as fast as they come: the transport paused writing,
        or the answers queued this iteration already pass its high-water mark (one iteration may read
        megabytes of pipelined searches). Answered here, they would pile up in memory without bound; uvicorn's
        cycle awaits the drain before it writes, and reading pauses behind it."""
        return self.flow.write_paused or self.transport.queued > self._write_high

    def _client_addr(self) -> str:
        """The client the access log names: behind a trusted proxy, the one its X-Forwarded-For names."""
        client = self.scope.get("client")
        if self._trusted is not None and client and client[0] in self._trusted:
            forwarded = [value for name, value in self.headers if name == b"x-forwarded-for"]
            if forwarded:
                host, port = self._trusted.get_trusted_client_address(b", ".join(forwarded).decode("latin1"))
                if host:
                    client = (host, port)
        return get_client_addr({"client": client})  # type: ignore[typeddict-item]


# The app's answer to a search: its JSON content and the headers it is answered with besides content type and
# length (name -> value), or None to let the routes answer it.
Answerer = Callable[[str, bytes, list[tuple[bytes, bytes]]], tuple[bytes, dict[str, str]] | None]
Screen = Callable[[list[tuple[bytes, bytes]]], bool]


def _search_app(app: Any) -> tuple[Any, Any]:
    """The app that answers searches on the spot (one with `answer_search`; None when there is none), found
    through the middleware uvicorn wraps it in, and the trusted proxies of uvicorn's proxy middleware among them
    (None without one, or without the lookup)."""
    trusted = None
    for _ in range(8):
        if isinstance(app, ProxyHeadersMiddleware):
            hosts = getattr(app, "trusted_hosts", None)
            trusted = hosts if hasattr(hosts, "get_trusted_client_address") else None
        if getattr(app, "answer_search", None) is not None:
            return app, trusted
        app = getattr(app, "app", None)
        if app is None:
            break
    return None, None
