"""Searches of an index whose shards are placed on several nodes (shoal.searcher.placement): answered by this
process's shards and, through the same Vektonn search route, by the nodes serving the others, then merged.

A part asked of another node carries `X-Shoal-Shards` (the shards it is to answer from, never fanned out further)
and the caller's own headers (its key, consistency level, write token, tag or seq), so each node authenticates the
caller and reflects every write the level asks for, as one process would. At `at_least` and `strong` each part
also says which seq its answer reflects (`X-Shoal-Seq`): nodes read the log as far as each needs, so parts may
answer at different seqs, which merged would show some shards' writes of a batch and not the others' (a state the
log never had). The parts below the highest are asked again pinned to it (`X-Shoal-Answer-Seq`), as many rounds as
shards keep moving past it, up to a bound. Parts are merged per query by the
metric's direction, ties to the lower shard, as one process merges its shards. A shard that no node answers
for makes the search a 503 naming it (X-Shoal-Missing-Shards), unless the caller sent `X-Shoal-Allow-Partial:
true`: then the answer holds what the other shards found and the same header names the missing ones; the 503 says
why each node asked for them did not answer (its own error message, a timeout, a refused connection).

A search has one deadline, SHOAL_FANOUT_TIMEOUT_S from its start, for every node it asks (replicas and the rounds
at one seq included). A part a node has not answered after HEDGE_S is asked of the next replica listed for its
shards too, and the first answer is taken. Nodes that just failed (or were outrun by a replica) are asked after
their healthy replicas for SUSPECT_S, and still asked when no other node is left. Only a node's refusal of the
caller's own request (a bad query: 400 in the Vektonn shape; the caller's key, forwarded, refused: 401 or 403) is
answered as it came; any other status is the node failing, and its replica is asked.

Idle connections to the nodes are kept FANOUT_KEEPALIVE_S, less than a node keeps them open (serve.py sets
uvicorn's keep-alive to serve.NODE_KEEPALIVE_S; uvicorn's own default is 5 s): a part sent on a connection the node
closed at that moment was reset, and its shards counted as answered by no node. A part that fails so, before
any byte of its answer came, is sent once more on a new connection (a search writes nothing).

What searches see of the nodes is kept for operators: every failed part, hedged part and missing shard is counted
in /metrics (Metrics.fanout_*: by node and a reason of FAILURE_KINDS, a fixed few, never the node's words), and
`NodeHealth` remembers the nodes whose parts failed and that answered none since, which /healthz reports (without
probing any node: only what searches saw).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from fastapi import Response
from starlette.concurrency import run_in_threadpool

from shoal.api.security import TenantContext
from shoal.errors import ConflictError, QueryError, ShardsUnavailableError
from shoal.searcher.placement import IndexPlacement, Placement

if TYPE_CHECKING:
    from shoal.api.metrics import Metrics

log = logging.getLogger(__name__)

SHARDS_HEADER = "x-shoal-shards"
PARTIAL_HEADER = "x-shoal-allow-partial"
MISSING_HEADER = "X-Shoal-Missing-Shards"
SEQ_HEADER = "X-Shoal-Seq"  # a part's answer: the seq it reflects (at_least and strong)
# A part's answer: `higher` or `lower` is nearer, by the metric of the generation it searched (a tag taken before a
# reindex answers from the old generation, whose metric may be another).
NEARER_HEADER = "X-Shoal-Nearer"
PIN_HEADER = "x-shoal-answer-seq"  # a part asked again: answer at exactly this seq, or the lowest past it it can
# What a part carries of the caller's request: who it is, and which state it must reflect.
PASSED = ("authorization", "x-shoal-consistency", "x-shoal-required-token", "x-shoal-tag", "x-shoal-as-of")
# Rounds of asking parts again at one seq: a new round is needed only when a shard's served version moved past the
# seq meanwhile (a build swapped in during the search), so a few are plenty.
SEQ_ROUNDS = 4
# Seconds an idle connection to a node is kept for the next part: below uvicorn's default keep-alive (5 s, a node
# of an older release, or run under plain uvicorn) and well below what `shoal api` keeps (serve.NODE_KEEPALIVE_S), so
# the node never closes a connection this process is about to send on.
FANOUT_KEEPALIVE_S = 4.0
# Retry-After of a 503 for shards whose nodes did not answer (one restarting); none for shards placed on no node.
RETRY_AFTER_S = 5
# Seconds a part may go unanswered before the next replica of its shards is asked too (at most half the timeout;
# SHOAL_FANOUT_HEDGE_S, 0: never).
HEDGE_S = 1.0
# A part is sent only with at least this long left to the search's deadline: one sent with less could not be
# answered, and its node would count as failed (suspect, in the 503) without having been asked.
MIN_PART_S = 0.05
# Seconds a node that failed a part (or was outrun by a replica) is asked only after its replicas.
SUSPECT_S = 30.0
REASON_CHARS = 300  # of each error message a node answered, repeated in the search's 503
# aiohttp rounds a timeout of ClientTimeout.ceil_threshold s or more (5 by default) up to a whole second of the
# loop's clock; a part's timeout is the time left to the search's deadline, which must not land late.
NO_CEIL = float("inf")
# Failures of a part before any answer came on which it is sent once more, on a new connection: the pooled one it
# went out on was closed by the node meanwhile (a refused connection is no such failure: the node is not there).
RETRIED = (aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionResetError, aiohttp.ClientOSError)
# Why a part failed, as a metric's label and in /healthz: a fixed few (a label of free text, or of a node's own
# message, would make a series per message).
TIMEOUT, CONNECT, DNS, STATUS_5XX, STATUS_4XX, BAD_BODY = (
    "timeout", "connect", "dns", "status_5xx", "status_4xx", "bad_body")
FAILURE_KINDS = (TIMEOUT, CONNECT, DNS, STATUS_5XX, STATUS_4XX, BAD_BODY)
# Seconds after its last failed part that a node no search asked since is no longer reported by /healthz: nothing
# seen of it since (a replica listed before it answers every part) says whether it still fails. As long as it is
# asked after its replicas: one slow answer (a pause) degraded /healthz for minutes at ten times this. A node still
# down is asked first again once this passes, fails, and is reported again.
FORGET_S = SUSPECT_S
# Why shards were not asked of their next node: the search's deadline was too near (no node's failure).
NOT_ASKED = "was not asked: too little of the search's time was left (SHOAL_FANOUT_TIMEOUT_S)"

# One node's answer for some shards: (the shards, its SearchResultDto list, the seq it reflects and whether higher
# is nearer, where it says).
Answered = tuple[list[int], list[dict[str, Any]], int | None, bool | None]


@dataclass(frozen=True)
class Failure:
    """Why a node did not answer a part, in a few words, and whether asking again later may help (a timeout, a
    refused connection, a 5xx: yes; a node configured other than this one, answering 404 or 413: no), its kind
    (one of FAILURE_KINDS) and the status the node answered, if it did."""

    reason: str
    transient: bool = True
    kind: str = CONNECT
    status: int | None = None

    def plain(self, timeout_s: float) -> str:
        """The failure in a few words naming nothing (no host, none of the node's own words, which may name an
        index): for /healthz, which anyone may read."""
        if self.kind == TIMEOUT:
            return f"timed out after {timeout_s:g} s"
        if self.kind == DNS:
            return "its host name did not resolve"
        if self.kind in (STATUS_5XX, STATUS_4XX):
            return f"answered {self.status}"
        if self.kind == BAD_BODY:
            return "answered a body that is no list of search results"
        return "could not be connected to"


# The shards no node answered for, and why each node asked for some did not (node -> failure).
Unanswered = tuple[set[int], dict[str, Failure]]


@dataclass(frozen=True)
class LocalPart:
    """This process's part of a fanned-out search: its results (SearchResultDto list), and what merging needs."""

    results: list[dict[str, Any]]
    k: int
    higher_is_nearer: bool
    shard_count: int
    seq: int | None = None  # the seq it reflects (at_least and strong, with shards of its own)
    searched: bool = False  # whether `higher_is_nearer` is that of the generation its shards were searched in


@dataclass(frozen=True)
class _Down:
    """A node whose parts failed since it last answered one: since when (time.monotonic), its latest failure and
    when."""

    since: float
    last_at: float
    last: Failure


class NodeHealth:
    """The placed nodes searches found failing: each node whose parts failed and that has answered none since,
    until it answers one (or no search asked it for FORGET_S). Written on the event loop, read by /healthz in a
    thread: under a lock."""

    def __init__(self, timeout_s: float, forget_s: float = FORGET_S) -> None:
        self.timeout_s = timeout_s
        self.forget_s = forget_s
        self._lock = threading.Lock()
        self._down: dict[str, _Down] = {}

    def failed(self, node: str, failure: Failure) -> None:
        """A part asked of `node` failed."""
        now = time.monotonic()
        with self._lock:
            before = self._down.get(node)
            self._down[node] = _Down(before.since if before else now, now, failure)

    def answered(self, node: str) -> None:
        """`node` answered a part (its results, or the caller's own error): it is up."""
        with self._lock:
            self._down.pop(node, None)

    def down(self) -> dict[str, _Down]:
        """The nodes failing now (those no search asked for `forget_s` left out)."""
        now = time.monotonic()
        with self._lock:
            for node in [n for n, d in self._down.items() if now - d.last_at > self.forget_s]:
                del self._down[node]
            return dict(self._down)

    def problems(self) -> list[str]:
        """A sentence for /healthz when placed nodes fail: how many, for how long, and their last failures in a
        few words; no node's name or URL (/healthz names nothing: /metrics' shoal_fanout_part_failures_total has
        the nodes). Empty when every node asked lately answered."""
        down = self.down()
        if not down:
            return []
        now = time.monotonic()
        seconds = round(now - max(d.since for d in down.values()))
        said = sorted({d.last.plain(self.timeout_s) for d in down.values()})
        if len(down) == 1:
            return [f"1 placed node has failed every search part asked of it for {seconds} s (its last failure: "
                    f"{said[0]}); searches of its shards answer 503 unless a replica serves them "
                    "(shoal_fanout_part_failures_total in /metrics names the node)"]
        return [f"{len(down)} placed nodes have failed every search part asked of them for {seconds} s or more "
                f"(their last failures: {'; '.join(said)}); searches of their shards answer 503 unless a replica "
                "serves them (shoal_fanout_part_failures_total in /metrics names the nodes)"]


class PeerError(Exception):
    """A node answered the part with an error that is the caller's (4xx): the search answers it as it came."""

    def __init__(self, status: int, content: bytes, content_type: str) -> None:
        super().__init__(status)
        self.status = status
        self.content = content
        self.content_type = content_type


def parse_shards(raw: str) -> list[int]:
    """The shard numbers of an X-Shoal-Shards header ("0,2,3"); ValueError when it is not such a list (an empty
    one included: a part names at least one shard, and an empty list answered every search with no hits)."""
    numbers = [int(x) for x in raw.split(",")]
    if any(n < 0 for n in numbers):
        raise ValueError(raw)
    return numbers


class FanOut:
    """Fans searches of placed indexes out to the nodes serving their shards, over one pooled HTTP client
    (aiohttp's: about a quarter of httpx's CPU per request, bench/fanout.py). Made on the event loop it serves."""

    def __init__(
        self, placement: Placement, timeout_s: float, metrics: Metrics | None = None, *, hedge_s: float = HEDGE_S,
    ) -> None:
        self.placement = placement
        self.timeout_s = timeout_s
        self.metrics = metrics  # failed and hedged parts, missing shards counted there
        self.health = NodeHealth(timeout_s)  # the nodes failing lately, for /healthz
        self._unpinned: set[str] = set()  # nodes found not to say the seq of their parts (an older release)
        self.hedge_s = min(hedge_s, timeout_s / 2)  # 0: no hedging
        # Nodes that failed a part, or were outrun by a replica, lately: node -> when (the loop's clock).
        self._suspect: dict[str, float] = {}
        self.client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=FANOUT_KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(total=timeout_s, ceil_threshold=NO_CEIL),
            skip_auto_headers=("User-Agent",),
        )
        # For a part sent again: a new connection every time, never one of the pool the first attempt failed on.
        self._fresh = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=timeout_s, ceil_threshold=NO_CEIL),
            skip_auto_headers=("User-Agent",),
        )

    def spans(self, tenant: str, name: str, version: str) -> bool:
        """True when a search of the index needs shards this process does not serve."""
        placed = self.placement.of(tenant, name, version)
        return placed is not None and placed.spans

    async def search(
        self, ctx: TenantContext, name: str, version: str, body: bytes, headers: Mapping[str, str],
        local: Any, inline: bool = False,
    ) -> Response:
        """The merged answer to a Vektonn search of a placed index. `local(shards)` runs this process's part and
        returns a LocalPart (it raises the search's own errors: a bad query fails before any node's answer is
        awaited): in a thread, or with `inline` (a search that needs no I/O) on the event loop once the other
        nodes' requests are out."""
        placed = self.placement.of(ctx.tenant, name, version)
        assert placed is not None
        mine = sorted(placed.local)
        # Shards past the index's own (a placement file edited for another index, or not yet on every process)
        # are asked of no node: a node refuses them as the caller's mistake (400), which this caller did not make.
        searcher = ctx.handle.searcher
        if not searcher.loaded(name, version):
            await run_in_threadpool(searcher.view, name, version)  # the local part loads it anyway
        count = len(searcher.view(name, version).index.shards)
        mine = [s for s in mine if s < count]
        # One for every node this search asks, from when they are asked: a first search that loads a large index
        # here first must not leave the other nodes no time (they were all timed out, and suspected).
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        remote_task = asyncio.ensure_future(
            self._remote(placed, name, version, body, headers, deadline, set(mine),
                         {s for s in placed.nodes if s < count}))
        try:
            if inline:
                for _ in range(3):  # the task, the gather of its requests, and their writes
                    await asyncio.sleep(0)
                part = local(mine)
            else:
                part = await run_in_threadpool(local, mine)
        except BaseException:
            _abandon(remote_task)
            raise
        try:
            remote, (missing, failures) = await remote_task
            part, remote, (lost, failed) = await self._at_one_seq(placed, name, version, body, headers, deadline,
                                                                  local, mine, part, remote)
        except PeerError as exc:  # the caller's request refused by a node (its key, its token): answered as sent
            return Response(exc.content, status_code=exc.status, media_type=exc.content_type)
        missing |= lost
        # Shards the placement names on no node, or beyond the index's own: the index's shards decide.
        missing |= set(range(part.shard_count)) - set(mine) - {s for shards, _, _, _ in remote for s in shards}
        missing = {s for s in missing if s < part.shard_count}
        if missing and self.metrics is not None:
            self.metrics.fanout_missing(len(missing))
        if missing and headers.get(PARTIAL_HEADER, "").lower() not in ("true", "1", "yes"):
            raise self._unavailable(placed, name, version, missing, failures | failed)
        parts = [(min(mine), part.results)] if mine else [(part.shard_count, part.results)]
        parts += [(min(shards), results) for shards, results, _, _ in remote]
        # Each node bounds only its own shards' hits, so the merged answer is held to the bound here too: a
        # search is refused the same whether one process serves the index or several.
        check_merged(parts, part.k, ctx.handle.shoal.settings.max_search_hits)
        content = merge(parts, part.k, _direction(name, version, part, bool(mine), remote))
        extra = {MISSING_HEADER: ",".join(map(str, sorted(missing)))} if missing else {}
        return Response(content, media_type="application/json", headers=extra)

    async def _at_one_seq(
        self, placed: IndexPlacement, name: str, version: str, body: bytes, headers: Mapping[str, str],
        deadline: float, local: Any, mine: list[int], part: LocalPart, remote: list[Answered],
    ) -> tuple[LocalPart, list[Answered], Unanswered]:
        """The parts all at one seq: those that answered below the highest seq a part reports are asked again,
        pinned to it, until all agree (parts that report none, eventual or time travel, are consistent as they
        are); ConflictError after SEQ_ROUNDS rounds. Also the shards no node answered for when asked again, and
        why."""
        lost: set[int] = set()
        failures: dict[str, Failure] = {}
        for _ in range(SEQ_ROUNDS):
            seqs = [s for _, _, s, _ in remote if s is not None]
            if mine and part.seq is not None:
                seqs.append(part.seq)
            if not seqs or min(seqs) == max(seqs):
                return part, remote, (lost, failures)
            top = max(seqs)
            behind = {shard for shards, _, s, _ in remote if s is not None and s < top for shard in shards}
            remote = [r for r in remote if r[2] is None or r[2] >= top]
            remote_task = asyncio.ensure_future(
                self._remote(placed, name, version, body, headers, deadline, set(mine), behind, top))
            try:
                if mine and part.seq is not None and part.seq < top:
                    part = await run_in_threadpool(local, mine, top)
            except BaseException:
                _abandon(remote_task)
                raise
            again, (gone, failed) = await remote_task
            remote += again
            lost |= gone
            failures |= failed
        raise ConflictError(
            f"index {name}/{version}: its shards' nodes kept answering at different seqs (new versions swapped in "
            f"during the search); retry")

    async def _remote(
        self, placed: IndexPlacement, name: str, version: str, body: bytes, headers: Mapping[str, str],
        deadline: float, mine: set[int], only: set[int] | None = None, pin: int | None = None,
    ) -> tuple[list[Answered], Unanswered]:
        """The other shards' parts (`only` these, when given; at exactly `pin`, or the lowest seq past it a node
        can answer at, when given), all answered by `deadline` (the loop's clock): (the shards a node answered
        for, its results, its seq), and the shards no node answered for with why each node that failed did. A
        shard's nodes are asked in the order listed, those that failed lately last; the next one is asked when one
        fails, or has not answered after `hedge_s` (its first answer is taken); PeerError when a node refuses the
        caller's own request."""
        passed = {h: headers[h] for h in PASSED if h in headers}
        passed["content-type"] = "application/json"
        if pin is not None:
            passed[PIN_HEADER] = str(pin)
        asked = sorted({s for s in placed.nodes if s not in mine} if only is None else set(only) - mine)
        order = {s: self._order([n for n in placed.nodes[s] if n != self.placement.node]) for s in asked}
        loop = asyncio.get_running_loop()
        flights = _Flights(order, lambda node, shards: asyncio.ensure_future(
            self._ask(node, shards, name, version, body, passed, deadline)), lambda: deadline - loop.time())
        flights.launch(asked)
        try:
            while flights.tasks:
                left = deadline - loop.time()
                hedging = flights.hedgeable() if self.hedge_s > 0 and left > MIN_PART_S else []
                # _ask ends each part at the deadline itself; the second more is for it to say so.
                wait = min(self.hedge_s, left) if hedging else left + 1
                if left + 1 <= 0:
                    break
                finished, _ = await asyncio.wait(flights.tasks, timeout=max(wait, 0),
                                                 return_when=asyncio.FIRST_COMPLETED)
                if not finished:
                    if hedging:
                        self._count_hedged(flights, hedging)
                        flights.hedge(hedging)
                    continue
                for task in finished:
                    self._settle(flights, task)
                for node in flights.drop_answered():  # outrun by a replica: asked after it for a while
                    self._suspect[node] = loop.time()
                flights.launch(flights.orphans())
        finally:
            for task in flights.tasks:
                _abandon(task)
        for node, _ in flights.tasks.values():  # still out at the deadline (the loop stalled)
            if node not in flights.failures:
                self._failed(flights, node, Failure(_failure(TimeoutError(), self.timeout_s), kind=TIMEOUT))
        return flights.answered, (set(asked) - flights.done, flights.failures)

    def _settle(self, flights: _Flights, task: asyncio.Future[Any]) -> None:
        """Take a finished part's outcome: its shards answered (unless a replica answered some meanwhile), or its
        node's failure remembered (PeerError, the caller's own refusal, goes up)."""
        node, shards = flights.tasks.pop(task)
        try:
            outcome = task.result()
        except PeerError:
            self.health.answered(node)  # it refused the caller's request: it is up
            raise
        if isinstance(outcome, Failure):
            self._failed(flights, node, outcome)
            self._suspect[node] = asyncio.get_running_loop().time()
            return
        self._suspect.pop(node, None)
        self.health.answered(node)
        flights.take(node, shards, outcome)

    def _failed(self, flights: _Flights, node: str, failure: Failure) -> None:
        """Remember a node's failed part: for the search's 503, for /healthz, and counted in /metrics."""
        flights.failures[node] = failure
        self.health.failed(node, failure)
        if self.metrics is not None:
            self.metrics.fanout_part_failed(node, failure.kind)

    def _count_hedged(self, flights: _Flights, hedging: list[asyncio.Future[Any]]) -> None:
        """Count, by node, the parts about to be asked of a replica too (their node was slow to answer)."""
        if self.metrics is not None:
            for task in hedging:
                self.metrics.fanout_hedged(flights.tasks[task][0])

    def _order(self, candidates: list[str]) -> list[str]:
        """The nodes listed for a shard, in the order to ask them: as listed, those that failed a part in the
        last SUSPECT_S after the others (a node stalled costs one search its hedge, not every search)."""
        now = asyncio.get_running_loop().time()
        for node, when in list(self._suspect.items()):
            if now - when > SUSPECT_S:
                del self._suspect[node]
        return sorted(candidates, key=lambda n: n in self._suspect)

    async def _ask(
        self, node: str, shards: list[int], name: str, version: str, body: bytes, headers: dict[str, str],
        deadline: float | None = None,
    ) -> tuple[list[dict[str, Any]], int | None, bool | None] | Failure:
        """One node's results for `shards`, the seq it says they reflect and whether it says higher is nearer,
        by `deadline` (the loop's clock; the fan-out timeout from now by default); why not (Failure) when it
        cannot answer for them now (unreachable, timed out, 5xx: its own error message, or a status that is not
        the caller's); PeerError when it refuses the caller's own request."""
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self.timeout_s
        url = f"{self.placement.urls[node].rstrip('/')}/api/v1/search/{name}/{version}"
        try:
            status, content, kind, seq_text, nearer_text = await self._post(
                url, body, headers | {SHARDS_HEADER: ",".join(map(str, shards))}, deadline)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("node %s did not answer for shards %s of %s/%s: %s: %s", node, shards, name, version,
                        type(exc).__name__, exc)
            return Failure(_failure(exc, self.timeout_s), kind=_kind(exc))
        if status != 200:
            if _callers(status, content, headers):
                raise PeerError(status, content, kind)
            log.warning("node %s answered %d for shards %s of %s/%s", node, status, shards, name, version)
            return Failure(_node_reason(status, content), _transient(status),
                           STATUS_5XX if status >= 500 else STATUS_4XX, status)
        try:
            results = orjson.loads(content)
        except orjson.JSONDecodeError:
            log.warning("node %s answered shards %s of %s/%s with a body that is not JSON", node, shards, name,
                        version)
            return Failure("answered with a body that is not JSON", kind=BAD_BODY)
        if not isinstance(results, list):
            return Failure("answered with JSON that is no list of results", kind=BAD_BODY)
        nearer = {"higher": True, "lower": False}.get(nearer_text or "")
        seq = int(seq_text) if seq_text is not None and seq_text.isascii() and seq_text.isdigit() else None
        if seq is None and _one_seq_asked(headers) and node not in self._unpinned:
            # A node of an older release (during a rolling upgrade) neither says its seq nor takes a pin: its part
            # is merged as that release merged it, each node at its own seq. Said once per node.
            self._unpinned.add(node)
            log.warning("node %s answered an at_least or strong part without %s: it runs an older release, so "
                        "searches fanned out to it may show some shards' writes of a batch and not others' until "
                        "every node of the placement is upgraded", node, SEQ_HEADER)
        return results, seq, nearer

    async def _post(
        self, url: str, body: bytes, headers: dict[str, str], deadline: float,
    ) -> tuple[int, bytes, str, str | None, str | None]:
        """A part's answer: its status, body, content type, X-Shoal-Seq and X-Shoal-Nearer. Sent once more, on a
        new connection, when it failed before any answer came on one from the pool (RETRIED): the node closed that
        idle connection as the part went out. Both attempts together end at the search's `deadline`."""
        loop = asyncio.get_running_loop()
        left = deadline - loop.time()
        if left <= 0:
            raise TimeoutError
        try:
            response = await self.client.post(url, data=body, headers=headers, timeout=_timeout(left))
        except RETRIED as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):  # no connection made: the node is not there
                raise
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError from exc
            log.info("a part sent to %s failed before any answer came (%s: %s); sending it again on a new "
                     "connection", url, type(exc).__name__, exc)
            response = await self._fresh.post(url, data=body, headers=headers, timeout=_timeout(left))
        async with response:
            content = await response.read()
            reply = response.headers
            return (response.status, content, reply.get("content-type", "application/json"), reply.get(SEQ_HEADER),
                    reply.get(NEARER_HEADER))

    def _where(self, placed: IndexPlacement, missing: set[int]) -> str:
        return "; ".join(f"shard {s} on {', '.join(placed.nodes.get(s, ())) or 'no node'}" for s in sorted(missing))

    def _unavailable(
        self, placed: IndexPlacement, name: str, version: str, missing: set[int], failures: Mapping[str, Failure],
    ) -> ShardsUnavailableError:
        """The 503 of a search missing `missing`: where they are placed and why each node asked did not answer;
        "retry" and Retry-After only when some node's failure may pass (not for shards placed on no node, nor a
        node answering a status no retry changes)."""
        asked = {n: failures[n] for n in failures if any(n in placed.nodes.get(s, ()) for s in missing)}
        why = "".join(f"; node {n} {asked[n].reason}" for n in sorted(asked))
        unplaced = sorted(s for s in missing if not placed.nodes.get(s))
        transient = any(f.transient for f in asked.values())
        if transient:
            hint = "retry, or send"
        elif unplaced:
            which = f"shard{'s' if len(unplaced) > 1 else ''} {', '.join(map(str, unplaced))}"
            hint = (f"the placement file (SHOAL_PLACEMENT_FILE) lists no node for {which}: an operator must "
                    "place it; send")
        else:
            hint = "a retry will not help until an operator corrects the node or the placement; send"
        return ShardsUnavailableError(
            f"shard{'s' if len(missing) > 1 else ''} {', '.join(map(str, sorted(missing)))} of index "
            f"{name}/{version} answered from no node (placement: {self._where(placed, missing)}){why}; {hint} "
            f"{PARTIAL_HEADER}: true to accept the other shards' results",
            sorted(missing), RETRY_AFTER_S if transient else None)

    async def close(self) -> None:
        """Close the pooled connections."""
        await self.client.close()
        await self._fresh.close()


class _Flights:
    """The parts of one `_remote` call out at a time: each task with its node and shards, the shards answered,
    how far down each shard's node order the parts went, and each failed node's failure."""

    def __init__(self, order: dict[int, list[str]], start: Any, time_left: Callable[[], float]) -> None:
        self.order = order
        self.start = start  # (node, shards) -> the task asking it
        self.time_left = time_left  # seconds to the search's deadline
        self.next = dict.fromkeys(order, 0)
        self.tasks: dict[asyncio.Future[Any], tuple[str, list[int]]] = {}
        self.hedged: set[asyncio.Future[Any]] = set()
        self.done: set[int] = set()
        self.answered: list[Answered] = []
        self.failures: dict[str, Failure] = {}
        self.reasked: set[int] = set()  # shards asked again of a node whose answer overlapped others' (`take`)

    def launch(self, shards: list[int]) -> None:
        """Ask each shard's next node (one part per node); a shard with none left is not asked again. With less
        than MIN_PART_S left to the deadline nothing is sent (it could not be answered, and its node would count
        as failed unasked): the shards' next nodes are said to be not asked (NOT_ASKED, a retry may help)."""
        if self.time_left() <= MIN_PART_S:
            for shard in shards:
                if self.next[shard] < len(self.order[shard]):
                    self.failures.setdefault(self.order[shard][self.next[shard]], Failure(NOT_ASKED, kind=TIMEOUT))
            return
        by_node: dict[str, list[int]] = {}
        for shard in shards:
            if self.next[shard] < len(self.order[shard]):
                by_node.setdefault(self.order[shard][self.next[shard]], []).append(shard)
                self.next[shard] += 1
        for node, group in by_node.items():
            self.tasks[self.start(node, group)] = (node, group)

    def _open(self, shards: list[int]) -> list[int]:
        return [s for s in shards if s not in self.done and self.next[s] < len(self.order[s])]

    def hedgeable(self) -> list[asyncio.Future[Any]]:
        """The parts not yet hedged that have shards unanswered with another node left to ask."""
        return [t for t, (_, shards) in self.tasks.items() if t not in self.hedged and self._open(shards)]

    def hedge(self, tasks: list[asyncio.Future[Any]]) -> None:
        """Ask the next node of these parts' shards too, each part on its own: a hedge's shards then lie within
        its part's, so whichever of the two answers last overlaps the other only within its own (`take`)."""
        self.hedged.update(tasks)
        for task in tasks:
            self.launch(self._open(self.tasks[task][1]))

    def orphans(self) -> list[int]:
        """Shards unanswered that no part out asks for (its node failed, or answered what was answered)."""
        out = {s for _, shards in self.tasks.values() for s in shards}
        return [s for s in self.order if s not in self.done and s not in out]

    def take(self, node: str, shards: list[int], outcome: tuple[Any, ...]) -> None:
        """Keep a node's answer for `shards`, each shard answered once in all. A node's results cannot be split by
        shard, so an answer overlapping earlier ones replaces those that lie within its shards (a hedge asked of
        a replica for some of them answered first); should one reach past them, this node is asked again for
        its shards still unanswered (once per shard), rather than its answer dropping the ones no other node
        serves."""
        overlap = [s for s in shards if s in self.done]
        if len(overlap) == len(shards):  # every one answered by others meanwhile
            return
        if overlap:
            inside = [a for a in self.answered if set(a[0]) <= set(shards)]
            if sum(len(a[0]) for a in inside) < len(overlap):
                open_shards = [s for s in shards if s not in self.done]
                again = [s for s in open_shards if s not in self.reasked]
                self.reasked.update(again)
                if again and self.time_left() > MIN_PART_S:
                    self.tasks[self.start(node, again)] = (node, again)
                elif open_shards:  # not asked again: said so, as a failure a retry may mend
                    self.failures.setdefault(node, Failure(
                        "answered shards other nodes had partly answered, and was not asked again in time",
                        kind=TIMEOUT))
                return
            self.answered = [a for a in self.answered if not any(a is b for b in inside)]
            self.done.difference_update(s for a in inside for s in a[0])
        self.done.update(shards)
        self.answered.append((shards, *outcome))

    def drop_answered(self) -> list[str]:
        """Cancel the parts whose shards were all answered by other nodes; their nodes."""
        dropped = [t for t, (_, shards) in self.tasks.items() if all(s in self.done for s in shards)]
        nodes = [self.tasks.pop(t)[0] for t in dropped]
        for task in dropped:
            _abandon(task)
        return nodes


def _timeout(left: float) -> aiohttp.ClientTimeout:
    """A part's timeout: the time left to its search's deadline, not rounded up to a whole second."""
    return aiohttp.ClientTimeout(total=left, ceil_threshold=NO_CEIL)


def _callers(status: int, content: bytes, headers: Mapping[str, str]) -> bool:
    """Whether a node's non-200 answer is the caller's own error, answered as it came: a 400 in the Vektonn error
    shape (its query), or a 401 or 403 in that shape to the caller's own key, which the part carried. Anything
    else (404 of a wrong path, 405, 413 of a smaller body limit, 429, a 401 to no key: a node set up otherwise)
    is the node failing: its replica is asked."""
    if status == 400 or (status in (401, 403) and "authorization" in headers):
        return _vektonn_messages(content) is not None
    return False


def _transient(status: int) -> bool:
    """Whether a node's error status may pass on its own (5xx, 408, 409, 429) rather than stay until an operator
    changes the node or the placement (404 of a wrong path, 405, 413, 401...)."""
    return status >= 500 or status in (408, 409, 425, 429)


def _failure(exc: BaseException, timeout_s: float) -> str:
    """Why a node did not answer, in a few words for the caller's 503: only what the connection told (no
    address, no URL: the placement file's, which the caller never sent)."""
    if isinstance(exc, TimeoutError):
        return f"timed out after {timeout_s:g} s (SHOAL_FANOUT_TIMEOUT_S, the search's time for all its nodes)"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return f"cannot resolve its host: {_os_reason(exc.os_error)}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect: {_os_reason(exc.os_error)}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "closed the connection before answering"
    if isinstance(exc, OSError):
        return f"connection failed: {_os_reason(exc)}"
    return f"did not answer ({type(exc).__name__})"


def _kind(exc: BaseException) -> str:
    """The kind of a part's failure to get any answer (FAILURE_KINDS): timed out, unresolved, or connection."""
    if isinstance(exc, TimeoutError):
        return TIMEOUT
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return DNS
    return CONNECT


def _os_reason(error: OSError) -> str:
    """The error's own words ("Connection refused", "Name or service not known"): the number's for an OS error
    (asyncio's strerror names the address it dialed), the resolver's for a DNS one (socket.gaierror, whose
    negative numbers os.strerror knows nothing of)."""
    if isinstance(error, socket.gaierror) or (error.errno or 0) < 0:
        return error.strerror or type(error).__name__
    return os.strerror(error.errno) if error.errno else type(error).__name__


def _vektonn_messages(content: bytes) -> list[str] | None:
    """The errorMessages of a Vektonn error body; None for a body of another shape (a proxy's page, no route)."""
    try:
        messages = orjson.loads(content).get("errorMessages")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return [m for m in messages if isinstance(m, str)] if isinstance(messages, list) else None


def _node_reason(status: int, content: bytes) -> str:
    """What a node said when it answered a part with an error of its own (not the caller's): its status and its
    Vektonn errorMessages, each cut to REASON_CHARS; only the status for a body of another shape."""
    said = [m[:REASON_CHARS] for m in _vektonn_messages(content) or []]
    return f"answered {status}: {'; '.join(said)}" if said else f"answered {status}"


def _one_seq_asked(headers: Mapping[str, str]) -> bool:
    """Whether a part asked with these headers must say its seq: at_least or strong, not a time travel."""
    if "x-shoal-tag" in headers or "x-shoal-as-of" in headers:
        return False
    return headers.get("x-shoal-consistency") in ("strong", "at_least") or "x-shoal-required-token" in headers


def _abandon(task: asyncio.Future[Any]) -> None:
    """Cancel the other nodes' requests of a search this process's part refused: their outcome (a node's own
    refusal, PeerError, when it came first) is the caller's error over again, retrieved so that asyncio does not
    log it as never retrieved."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


def _direction(name: str, version: str, local: LocalPart, mine: bool, remote: list[Answered]) -> bool:
    """Whether higher is nearer for the merge: as the parts searched (they say so; this process's own part only
    when it has shards), else as this process's view of the index's current generation; ConflictError when parts
    searched generations whose metrics rank opposite ways (a reindex that changed the metric swapping in on one
    node before another), which no merge can rank."""
    said = {nearer for _, _, _, nearer in remote if nearer is not None}
    if mine and local.searched:
        said.add(local.higher_is_nearer)
    if len(said) > 1:
        raise ConflictError(f"index {name}/{version}: its shards' nodes searched generations whose metrics rank "
                            "opposite ways (a reindex swapping in); retry")
    return said.pop() if said else local.higher_is_nearer


def check_merged(parts: list[tuple[int, list[dict[str, Any]]]], k: int, max_hits: int) -> None:
    """Refuse (QueryError) a fanned-out search whose merged answer would hold more than `max_hits` hits: per query
    vector, k or what all parts found together if fewer (SHOAL_MAX_SEARCH_HITS, as one searcher bounds it)."""
    count = len(parts[0][1])
    if count * k <= max_hits:
        return
    total = sum(min(k, sum(len(results[i]["nearestDataPoints"]) for _, results in parts)) for i in range(count))
    if total > max_hits:
        raise QueryError(
            f"the search returns {total:,} hits over its shards ({count:,} query vectors x up to k {k:,}), more "
            f"than the {max_hits:,} a search may (SHOAL_MAX_SEARCH_HITS): ask for a smaller k or fewer query "
            "vectors")


def merge(parts: list[tuple[int, list[dict[str, Any]]]], k: int, higher_is_nearer: bool) -> bytes:
    """One SearchResultDto list from the parts' (each nearest first): per query, the k nearest of all parts by
    the metric's direction, ties to the part of the lower shard (a stable sort over parts in shard order)."""
    parts = sorted(parts, key=lambda p: p[0])
    first = parts[0][1]
    merged = []
    for i, result in enumerate(first):
        found = [point for _, results in parts for point in results[i]["nearestDataPoints"]]
        found.sort(key=lambda p: p["distance"], reverse=higher_is_nearer)
        merged.append({"queryVector": result["queryVector"], "nearestDataPoints": found[:k]})
    return orjson.dumps(merged)
