"""The hot search route, answered before FastAPI's middleware and routing when it needs no I/O.

An eventual search of an index the process has loaded, by a caller whose key verdict is cached (or who is the
anonymous tenant), touches neither the catalog nor storage: the app answers it on the event loop, first thing.
Everything else, and every search this path declines or fails (a bad body, an unknown index, a role too low),
goes on to the FastAPI routes with the body read here, which answer it (and its errors) as always. Routing,
dependency resolution and five middleware layers cost more than the search itself (bench/api.py, py-spy).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI

from shoal.api.security import context_from_cache
from shoal.api.vektonn import JSON, plain_search, search_content
from shoal.auth import Role

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PREFIX = "/api/v1/search/"
JSON_BYTES = JSON.encode()
WANTED = {b"authorization", b"x-shoal-consistency", b"x-shoal-required-token", b"x-shoal-tag", b"x-shoal-as-of"}


class FastSearchAPI(FastAPI):
    """FastAPI with `POST|GET /api/v1/search/{index}/{version}` answered before its middleware and routing
    whenever that needs no I/O; every other request, and every search declined here, goes through FastAPI."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(PREFIX) or scope["method"] not in ("POST", "GET"):
            await super().__call__(scope, receive, send)
            return
        name, _, version = path[len(PREFIX):].partition("/")
        body = await _read_body(receive)
        content = None
        if name and version and "/" not in version:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in WANTED}
            content = self._answer(name, version, body, headers)
        if content is None:
            await super().__call__(scope, _replay(body, receive), send)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", JSON_BYTES), (b"content-length", b"%d" % len(content))]})
        await send({"type": "http.response.body", "body": content})

    def _answer(self, name: str, version: str, body: bytes, headers: dict[str, str]) -> bytes | None:
        """The answer, or None to let the route answer (I/O needed, or anything went wrong)."""
        tenants = getattr(self.state, "tenants", None)
        if tenants is None or not plain_search(headers):
            return None
        try:
            ctx = context_from_cache(tenants, headers.get("authorization"), Role.READ)
            if ctx is None or not ctx.handle.searcher.loaded(name, version):
                return None
            return search_content(ctx, self.state.metrics, name, version, body, headers)
        except Exception:  # noqa: BLE001 - the route answers it again, errors in their proper shape
            return None


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away: let the app see it
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


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
