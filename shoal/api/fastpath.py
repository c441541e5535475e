"""The hot search route, answered before FastAPI's middleware and routing when it needs no I/O.

Shoal's HTTP protocol asks `answer_search` first, before any ASGI cycle exists (shoal.api.http_protocol); what
comes through ASGI (another server, or a request the protocol passes on) is answered the same way here.

An eventual search of an index the process has loaded, by a caller whose key verdict is cached (or who is the
anonymous tenant), touches neither the catalog nor storage: the app answers it on the event loop, first thing.
Everything else, and every search this path declines or fails (a bad body, an unknown index, a role too low),
goes on to the FastAPI routes with the body read here, which answer it (and its errors) as always. Routing,
dependency resolution and five middleware layers cost more than the search itself (bench/api.py, py-spy).

Every request body, on every route, is read here first within SHOAL_MAX_BODY_BYTES: a Content-Length above it
is answered 413 before a byte is read, and a streamed body is cut off (413) as soon as it passes the limit. No
route ever parses more than that: parsing is what costs, so a limit checked after it would protect nothing.
Before a body of the API's routes (/api/) is read, what its headers alone tell is answered: 401 for a missing
key (without an anonymous tenant), a malformed header or a key rejected moments ago, 429 for an address over
its failure limit (shoal.auth.keys.screen), so a caller that will be refused never has its body buffered.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI
from starlette.routing import Match

from shoal.api.datasets import router as dataset_router
from shoal.api.errors import answer, core_error, dataset_error, extra_headers, vektonn_error, vektonn_response
from shoal.api.security import context_from_cache, screen_request
from shoal.api.vektonn import JSON, fanned_out, plain_search, search_content
from shoal.auth import Role
from shoal.errors import AuthenticationError, RateLimitedError, ShoalError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger(__name__)
PREFIX = "/api/v1/search/"
API_PREFIX = "/api/"  # every route under it authenticates its caller
JSON_BYTES = JSON.encode()
# A search answered here: its JSON content, and the headers it is answered with besides content type and length.
Answered = tuple[bytes, dict[str, str]]
WANTED = {b"authorization", b"x-shoal-consistency", b"x-shoal-required-token", b"x-shoal-tag", b"x-shoal-as-of",
          b"x-shoal-shards", b"x-shoal-allow-partial", b"content-length"}


class FastSearchAPI(FastAPI):
    """FastAPI with `POST|GET /api/v1/search/{index}/{version}` answered before its middleware and routing
    whenever that needs no I/O; every other request, and every search declined here, goes through FastAPI.
    Every request body is read here first, within `max_body_bytes` (413 beyond it)."""

    def __init__(self, *args: Any, max_body_bytes: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        path = scope.get("path", "")
        fast = path.startswith(PREFIX) and scope["method"] in ("POST", "GET")
        headers, declared = _wanted(scope["headers"])
        limit = self.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(scope, send, f"the request body ({declared} bytes) is larger than")
            return
        if path.startswith(API_PREFIX) and await self._refused(scope, send, headers):
            return
        body = await _read_body(receive, limit)
        if body is None:
            await self._too_large(scope, send, "the request body passed")
            return
        if not fast:
            await super().__call__(scope, _replay(body, receive), send)
            return
        name, _, version = path[len(PREFIX):].partition("/")
        answered = None
        if name and version and "/" not in version:
            answered = self._answer(name, version, body, headers)
        if answered is None:
            if name and version and "/" not in version and await self._fan_out(scope, send, name, version, body,
                                                                              headers):
                return
            await super().__call__(scope, _replay(body, receive), send)
            return
        content, extra = answered
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", JSON_BYTES), (b"content-length", b"%d" % len(content)), *raw]})
        await send({"type": "http.response.body", "body": content})

    def answer_search(self, path: str, body: bytes, raw_headers: list[tuple[bytes, bytes]]) -> Answered | None:
        """The JSON answer to a complete search request (its path, body and lower-case headers) and the headers
        to answer it with besides its content type and length (a part's X-Shoal-Nearer and X-Shoal-Seq; none for
        an ordinary search), or None to let the routes answer it. Shoal's HTTP protocol asks this before it
        makes an ASGI cycle (shoal.api.http_protocol)."""
        if len(body) > self.max_body_bytes or not path.startswith(PREFIX):
            return None  # the routes answer 413, or whatever else this is
        name, _, version = path[len(PREFIX):].partition("/")
        if not name or not version or "/" in version:
            return None
        return self._answer(name, version, body, _wanted(raw_headers)[0])

    def may_answer_search(self, raw_headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether a search whose body is still arriving may wait for it to be answered on the spot: False when
        its caller is not known without I/O (no cached key verdict, no anonymous tenant, a role too low), so the
        routes must see it before its body is read and answer what its headers alone tell (401, 429, as
        `__call__` does). Costs what `answer_search` costs for the caller, no I/O."""
        tenants = getattr(self.state, "tenants", None)
        if tenants is None:
            return False
        authorization = None
        for name, value in raw_headers:
            if name == b"authorization":  # the first one counts, as the routes read it (_wanted)
                authorization = value.decode("latin-1")
                break
        try:
            return context_from_cache(tenants, authorization, Role.READ) is not None
        except Exception:  # noqa: BLE001 - the routes answer it, errors in their proper shape
            return False

    def _answer(self, name: str, version: str, body: bytes, headers: dict[str, str]) -> Answered | None:
        """The answer and its extra headers (a part's, vektonn.part_headers: the node that asked merges by
        them), or None to let the route answer (I/O needed, or anything went wrong)."""
        tenants = getattr(self.state, "tenants", None)
        if tenants is None or not plain_search(headers):
            return None
        try:
            ctx = context_from_cache(tenants, headers.get("authorization"), Role.READ)
            if ctx is None or not ctx.handle.searcher.loaded(name, version):
                return None
            fanout = self.state.fanout
            if fanout is not None and "x-shoal-shards" not in headers and fanout.spans(ctx.tenant, name, version):
                return None  # other nodes serve some of its shards: the route fans out (network I/O)
            return search_content(ctx, self.state.metrics, name, version, body, headers)
        except Exception:  # noqa: BLE001 - the route answers it again, errors in their proper shape
            return None

    async def _fan_out(self, scope: Scope, send: Send, name: str, version: str, body: bytes,
                       headers: dict[str, str]) -> bool:
        """Answer a search of an index placed across nodes (shoal.api.fanout) here, at any consistency, when the
        caller's key verdict is cached; False to let the route answer it (which fans out the same way)."""
        fanout = self.state.fanout
        tenants = getattr(self.state, "tenants", None)
        if fanout is None or tenants is None or "x-shoal-shards" in headers:
            return False
        try:
            ctx = context_from_cache(tenants, headers.get("authorization"), Role.READ)
        except Exception:  # noqa: BLE001 - the route answers it, in its proper shape
            return False
        if ctx is None or not fanout.spans(ctx.tenant, name, version):
            return False
        try:
            response: Any = await fanned_out(
                fanout, ctx, self.state.metrics, name, version, body, headers,
                inline=plain_search(headers) and ctx.handle.searcher.loaded(name, version))
        except Exception as exc:  # noqa: BLE001 - answered as the routes' handlers answer it
            core = core_error(exc)
            if not isinstance(core, ShoalError):
                log.error("fanned-out search of %s/%s failed", name, version, exc_info=exc)
                response = vektonn_error(500, ["internal error"])
            else:
                response = vektonn_response(core)
        await response(scope, _nothing, send)
        return True

    async def _refused(self, scope: Scope, send: Send, headers: dict[str, str]) -> bool:
        """Answer 401 or 429 before the body is read when the headers alone tell the request will be refused
        (security.screen_request: no I/O), in the error shape of the route asked for; False otherwise."""
        tenants = getattr(self.state, "tenants", None)
        if tenants is None:
            return False
        try:
            screen_request(tenants, scope, headers.get("authorization"))
        except (AuthenticationError, RateLimitedError) as exc:
            known = answer(exc)  # 401 UNAUTHORIZED or 429 TOO_MANY_REQUESTS, as the routes answer them
            if self._dataset_route(scope) and known.code is not None:
                response: Any = dataset_error(known.status, known.code.value, str(exc), {}, extra_headers(exc))
            else:
                response = vektonn_response(exc)
            await response(scope, _nothing, send)
            return True
        return False

    async def _too_large(self, scope: Scope, send: Send, what: str) -> None:
        """Answer 413 naming the limit and its setting, in the error shape of the route asked for. The body
        is not read: the server drains and drops what the client still sends, and the connection stays
        usable."""
        limit = self.max_body_bytes
        message = (f"{what} the limit of {limit} bytes (SHOAL_MAX_BODY_BYTES): send a smaller batch, or raise "
                   "the limit")
        if self._dataset_route(scope):
            response: Any = dataset_error(413, "PAYLOAD_TOO_LARGE", message,
                                          {"max_body_bytes": limit, "setting": "SHOAL_MAX_BODY_BYTES"})
        else:
            response = vektonn_error(413, [message])
        await response(scope, _nothing, send)

    def _dataset_route(self, scope: Scope) -> bool:
        """True when the request is for a route of the dataset API (which answers errors in its own shape)."""
        return any(route.matches(scope)[0] is not Match.NONE for route in dataset_router.routes)


def _wanted(raw_headers: list[tuple[bytes, bytes]]) -> tuple[dict[str, str], str | None]:
    """The headers a search reads (lower-case names, as text), and the declared Content-Length apart. A header
    sent twice counts by its first value, as the routes read it (Starlette's `Headers.get`): the fast path must
    not answer as another key, tenant or consistency level than the route would."""
    headers: dict[str, str] = {}
    for k, v in raw_headers:
        if k in WANTED:
            headers.setdefault(k.decode("latin-1"), v.decode("latin-1"))
    return headers, headers.pop("content-length", None)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The request body, or None as soon as it passes `limit` bytes (nothing more is read then)."""
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away: let the app see it
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _nothing() -> Message:
    # A response sent before the body was read needs no receive (starlette's Response never calls it).
    return {"type": "http.disconnect"}


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the body read already, then whatever comes next."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again
