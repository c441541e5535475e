"""The searcher: serves kNN queries from the active index versions and follows new ones.

Views are immutable and swapped whole under a lock, so a query runs entirely against the view it started
with while a new version loads in the background. New versions are announced on a Redis channel; polling
the catalog is the fallback when a message is missed or Redis is down.
"""

from __future__ import annotations

import contextlib
import json
import logging
import numbers
import os
import threading
import time
import weakref
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import redis

from shoal.catalog.indexes import IndexRecord, ServingKey, serving_fingerprints
from shoal.catalog.repo import head_of
from shoal.config.settings import MAX_DURATION_S
from shoal.errors import (
    CapacityError,
    ConfigurationError,
    ConflictError,
    NotFoundError,
    Problem,
    QueryError,
    ShardsUnavailableError,
    ShoalError,
    ValidationError,
)
from shoal.index.segment_cache import SegmentCache, release_free_memory
from shoal.log.compaction_swap import dropped_through
from shoal.log.heads import HEADS_CHANNEL, parse_announcement
from shoal.log.reader import read_log
from shoal.log.records import SparseVector, check_name
from shoal.log.validation import SEQ
from shoal.runtime import CLOSED, Runtime, Scope
from shoal.searcher.announce import VERSIONS_CHANNEL, HeadAndTokenRead
from shoal.searcher.consistency import Consistency, check_seq
from shoal.searcher.execute import Hits, execute, prepare_queries, split_matcher
from shoal.searcher.filters import Filter, filter_key, parse_filter
from shoal.searcher.placement import Placement
from shoal.searcher.tails import Tail, build_tails
from shoal.searcher.views import IndexView, load_shard
from shoal.searcher.young import TailCache, extend

log = logging.getLogger(__name__)



# Datetimes, subclasses (numpy's float64, enums) and other objects are written by _typed, with their type, so that
# no two filters a parser might read differently (a datetime and its ISO string) share a cache key.
_KEY_OPTIONS = orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS


def _typed(value: Any) -> str:
    return f"\x00{type(value).__module__}.{type(value).__qualname__}:{value}"


def _checked_filter(view: IndexView, filters: Mapping[str, Any] | Filter) -> Filter | None:
    """The search's filter checked against the data source, and against what the index's segments store
    (a filter can only test attributes kept per row: id, split and payload attributes)."""
    if isinstance(filters, Filter):
        return _stored_only(view, filters)
    # Parsed and checked once per view and filter text: a server sees the same few filters again and again. The
    # text is only a cache key (orjson: a tenth of json.dumps's time); keys orjson refuses are parsed each time.
    try:
        text: bytes | None = orjson.dumps(filters, option=_KEY_OPTIONS, default=_typed)
        if b"null" in text:  # orjson writes NaN and infinities as null too: tell them apart as json does
            text = json.dumps(filters, sort_keys=True, default=_typed).encode()
    except (TypeError, ValueError):
        text = None
    cache = view.filter_cache
    key = filter_key(text) if text is not None else None  # a digest: the cache holds no filter's whole text
    flt = cache.get(key) if key is not None else None
    if flt is not None:
        return flt  # only filters that passed the checks below are kept
    flt = parse_filter(filters, view.source.spec.attribute_types, key=key)
    if flt is None:
        return None
    _stored_only(view, flt)
    if key is not None:
        if len(cache) >= 256:
            cache.clear()
        cache[key] = flt
    return flt


# The search services sharing each segment cache (the runtime's): the budget is the cache's, so one service
# may unload another's least recently searched index to fit one it loads.
_SHARING: weakref.WeakKeyDictionary[SegmentCache, weakref.WeakSet[SearchService]] = weakref.WeakKeyDictionary()
_SHARING_LOCK = threading.Lock()  # a WeakSet walked while another thread adds to it raises RuntimeError

# This process's id, kept up to date across fork: a service made in another process (a forked parent) restarts its
# following threads in this one at its first use here (`SearchService._usable`).
_pid = os.getpid()


def _services_after_fork_in_child() -> None:
    """In a forked child (one thread): the new pid, and every service's locks and events fresh (a parent thread
    may have held them at the fork, and it does not run here); their threads restart at the first search."""
    global _pid, _SHARING_LOCK
    _pid = os.getpid()
    _SHARING_LOCK = threading.Lock()
    for services in list(_SHARING.values()):
        for service in list(services):
            service._reset_after_fork()


os.register_at_fork(after_in_child=_services_after_fork_in_child)


def _poll_s(value: Any) -> float:
    """A searcher's poll interval, checked: a real number of seconds in (0, MAX_DURATION_S]. Zero, a negative
    or NaN would poll the catalog in a busy loop; a string or a longer one would end the poll threads at their
    first wait (TypeError, OverflowError), and the searcher silently stop following."""
    seconds = float("nan")
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except (OverflowError, ValueError):  # 10**400 has no float: too long anyway
            seconds = float("inf")
    if not 0 < seconds <= MAX_DURATION_S:  # NaN fails the comparison too
        raise ValidationError(f"poll_interval must be a number of seconds in (0, {MAX_DURATION_S}], got "
                              f"{value!r:.100}")
    return seconds


def _consistency(value: Any) -> Consistency:
    """A search's consistency given as a level name ("eventual", "strong": the names the CLI and the HTTP API
    take), else ValidationError naming what a search accepts."""
    if isinstance(value, str) and value in ("eventual", "strong"):
        return Consistency(value)  # type: ignore[arg-type]
    raise ValidationError(f"consistency must be Consistency.eventual(), Consistency.at_least(token), "
                          f"Consistency.strong() or the level name 'eventual' or 'strong', got {value!r:.100}")


class _SourceGone(Exception):
    """A head read found the served view's data source, or its index, gone from the catalog (SearchService.search
    reloads)."""


_UNREAD = object()  # no index token was read (the catalog head read confirms none)


class _Stale(Exception):
    """The view's young tier would be read on from below the bound of a compaction that dropped entries, over
    a state holding points (a served version, or tail entries, below that bound): the log no longer holds the
    expired tombstones that delete some of them. Compaction never reaches past an active version, so the
    versions active now are at or above the bound: SearchService.search reloads and answers from them."""


# How many times one search reloads a view found stale (_Stale) before it gives up: once is enough unless
# compactions keep overtaking the loads.
# Catch-ups of a generation swapped in, without the lock, to what the one it replaces showed (its follower goes
# on extending it meanwhile) before the last, under the lock.
CATCH_UP_TRIES = 3
_STALE_RELOADS = 3


class AnsweredAt:
    """Where a search part reports the one seq its answer reflects (every write up to it, none after): the
    node fanning a search out (shoal.api.fanout) asks again, pinned to the highest, the parts that answered
    below it, so every shard of a placed index answers at one seq as in one process. Also the direction of the
    metric of the generation it searched (a tag taken before a reindex searches the old one, whose metric may
    be another): the parts are merged by it."""

    __slots__ = ("higher_is_nearer", "seq")

    def __init__(self) -> None:
        self.seq: int | None = None
        self.higher_is_nearer: bool | None = None


def check_hits(view: IndexView, tails: Mapping[int, Tail], queries: Any, k: int, max_hits: int) -> None:
    """Refuse (ValidationError) a search that could return more than `max_hits` hits: its query vectors times k,
    k counted up to the rows it can find (the view's segment rows and the keys its tails touch), so that a k past
    every row (Vektonn's k has no bound) is refused only when the rows are that many. Before this, one search of
    1,000 query vectors and a huge k over 59,004 rows would have held about 18 GB."""
    try:
        count = len(queries)
    except TypeError:
        return  # not a sequence of query vectors: the query's own check names what is wrong with it
    if count * k <= max_hits:
        return
    rows = sum(seg.segment.rows.num_rows for shard in view.shards for seg in shard.segments)
    rows += sum(len(t.touched) for t in tails.values())
    most = count * min(k, rows)
    if most > max_hits:
        per_query = f"k {k:,}" if k <= rows else f"{rows:,}: k {k:,}, at most every row"
        raise ValidationError(
            f"the search could return {most:,} hits ({count:,} query vectors x {per_query}), more than the "
            f"{max_hits:,} a search may (SHOAL_MAX_SEARCH_HITS): ask for a smaller k or fewer query vectors")


def _check_token_source(view: IndexView, consistency: Consistency) -> None:
    """Refuse (QueryError) an at_least token of another data source than the one `view` indexes: seqs count
    one data source's log, so another's token asks for an unrelated point of this log."""
    spec = view.source.spec
    if consistency.data_source != spec.name or (
        consistency.data_source_version and consistency.data_source_version != spec.version
    ):
        raise QueryError(
            f"write token of data source {consistency.data_source}/{consistency.data_source_version} given to a "
            f"search of index {view.index.spec.name}/{view.index.spec.version}, over data source "
            f"{spec.name}/{spec.version}: a write token counts only its own data source's writes")


def _stored_only(view: IndexView, flt: Filter) -> Filter:
    """`flt`, unless it tests an attribute the index's segments do not keep per row (ValidationError)."""
    stored = set(view.index.spec.stored_attributes())
    for name in sorted(flt.attributes - stored):
        raise ValidationError(Problem(
            f"index {view.index.spec.name}/{view.index.spec.version} does not store this attribute (not an id, "
            "split or payload attribute), so it cannot filter on it", attribute=name))
    return flt


class SearchService:
    """Serves the indexes of every tenant of a runtime: one per process (or per `Shoal.searcher()`). Thread-safe;
    loads versions lazily, follows new ones, and keeps its loaded segments under the runtime's byte budget by
    unloading the least recently searched indexes. Tenants reach it through `Searcher`, a scope over it."""

    def __init__(
        self, runtime: Runtime, *, follow: bool = True, poll_interval: float | None = None,
        placement: Placement | None = None,
    ) -> None:
        # Checked first: a service refused here must not have joined _SHARING (other services walk it).
        runtime.check_open()
        self.poll_interval = runtime.settings.searcher_poll_s if poll_interval is None else _poll_s(poll_interval)
        self.runtime = runtime
        # Which shards of placed indexes this process loads (the rest are other nodes'; shoal.api.fanout asks them).
        self.placement = placement or Placement()
        self.engine = runtime.engine
        self.storage = runtime.storage
        self.shards = runtime.shards
        self.cache = runtime.segment_cache
        # (tenant id, index name, version) -> the view served, and the scope to reload it with.
        self._views: dict[tuple[int, str, str], IndexView] = {}
        self._scopes: dict[int, Scope] = {}
        self._used: dict[tuple[int, str, str], float] = {}  # when each view last answered (unloading order)
        # Per index: its young tier (shoal.searcher.young), the log entries its served versions do not reflect.
        self._tails: dict[int, TailCache] = {}
        self.young_max_seqs = runtime.settings.young_tier_max_seqs
        self.follows = follow
        self._heads: dict[int, int] = {}  # data source id -> the newest head announced or read
        # Heads are kept only for the data sources of served views (and, while a load runs, for any: its view is
        # not served yet, and a head announced after its catalog read must not be lost). Every commit of the
        # deployment is announced, so keeping all of them grew one entry per data source ever written to.
        self._served_sources: frozenset[int] = frozenset()
        self._loading = False
        # Strong searches take the head announced on Redis only while this searcher is subscribed to the
        # announcements (so it notices Redis going away) and only when it is at least the head the catalog gave
        # since the subscription began: Redis may have come back holding the heads of before (its append-only
        # file), while commits made meanwhile were not announced. One catalog read per data source and
        # subscription settles that; after it, Redis answers alone.
        self._subscription = 0  # which subscription is current (0: none)
        self._subscriptions = 0  # how many there were
        self._floors: dict[int, tuple[int, int]] = {}  # source id -> (subscription, catalog head read in it)
        # Likewise for the served indexes: a strong search takes the index as still there (not dropped) without
        # asking the catalog only while its data source's index token on Redis (shoal.searcher.announce) is the
        # one read just before the catalog last found the index, in the current subscription. A drop sets a new
        # token before it returns, so a strong search that begins after it asks the catalog.
        self._checked: dict[int, tuple[int, Any]] = {}  # index id -> (subscription, token read before the check)
        self._young_wake = threading.Event()
        self._stale: set[tuple[int, str, str]] = set()  # views whose last refresh failed (an outage, logged once)
        # Per view the poll loaded: the catalog's fingerprint of what it was loaded from (serving_fingerprints).
        # A poll reloads only the views whose fingerprint changed, not every view (two statements each).
        self._fingerprints: dict[ServingKey, tuple[Any, ...]] = {}
        self._poll_failed = False  # the last poll's fingerprint read failed (an outage, logged once)
        # Views whose young tier alone passes the budget after it grew (`_fit_grown`: logged once, not per growth).
        self._over_alone: set[tuple[int, str, str]] = set()
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pid = _pid  # the process whose threads follow for it (see `_usable`)
        # Joined last: other services walk _SHARING to unload (`_fit_budget`), and a half-made one has no lock yet.
        with _SHARING_LOCK:
            _SHARING.setdefault(self.cache, weakref.WeakSet()).add(self)
        self._start_following()

    def _start_following(self) -> None:
        """Start the threads that follow new versions and heads (when this service follows)."""
        if not self.follows:
            return
        self._threads = [
            threading.Thread(target=self._poll_loop, name="shoal-searcher-poll", daemon=True),
            threading.Thread(target=self._listen_loop, name="shoal-searcher-listen", daemon=True),
            threading.Thread(target=self._young_loop, name="shoal-searcher-young", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _usable(self) -> None:
        """Raise ConfigurationError once this service, or its runtime, was closed: it no longer follows new
        versions, and its answers would go stale silently. In a forked child, first restart the following threads
        (they do not survive fork): a service inherited from the parent (a server's preloaded app, a pool's
        worker) then serves fresh answers in the child as in the parent, and its loaded segments (immutable,
        shared copy-on-write) need no reload."""
        if self._pid != _pid:
            self._restart_after_fork()
        if self._stop.is_set() or self.runtime.closed:
            raise Searcher._closed_error()

    def _reset_after_fork(self) -> None:
        """Called in a forked child only: fresh locks and events (kept closed if closed), no threads, and no
        subscription to the announcements (the parent's listener does not run here: `strong` must not trust the
        heads on Redis until this process's own listener subscribed)."""
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()
        closed = self._stop.is_set()
        self._stop, self._wake, self._young_wake = threading.Event(), threading.Event(), threading.Event()
        if closed:
            self._stop.set()
        self._threads = []
        self._subscription = 0
        self._loading = False  # a load the parent ran is not running here

    def _restart_after_fork(self) -> None:
        """Start this process's following threads, once, and poll at once: what changed since the fork is
        loaded now rather than a poll interval later."""
        with self._lock:
            if self._pid == _pid:
                return  # another thread of this process did it
            self._pid = _pid
            if not self._stop.is_set():
                self._start_following()
                self._wake.set()
                self._young_wake.set()

    def for_tenant(self, scope: Scope) -> Searcher:
        """A searcher of one tenant's indexes over this service."""
        return Searcher(self, scope)

    # -- serving ---------------------------------------------------------------------------------------

    def search(
        self,
        scope: Scope,
        index_name: str,
        index_version: str,
        queries: Any,
        k: int,
        *,
        split_filter: Mapping[str, Any] | None = None,
        retrieve_vectors: bool = False,
        consistency: Consistency | None = None,
        tag: str | None = None,
        as_of: int | None = None,
        search_params: Mapping[str, int] | None = None,
        filters: Mapping[str, Any] | Filter | None = None,
        shards: Collection[int] | None = None,
        max_hits: int | None = None,
        pin: int | None = None,
        answered: AnsweredAt | None = None,
    ) -> list[Hits]:
        """`Searcher.search` for the tenant of `scope`; `shards` restricts it to those shards (which this process
        must serve: a fanned-out search's part, shoal.api.fanout); `max_hits` bounds the hits it may return
        (`check_hits`). A search at `at_least` or `strong` reports in `answered` the seq its answer reflects;
        with `pin`, it answers at exactly the lowest seq at or past `pin` (and its token) it can: a part asked
        again to match the other parts of a fanned-out search."""
        self._usable()
        # Any integer (numpy's too, as as_of and at_least take), but not a bool: True is an int but not a k.
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k <= 0:
            raise ValidationError(f"k must be a positive integer, got {k!r:.100}")
        k = int(k)
        # Only what the steps below would fail on with a raw TypeError or AttributeError, or a catalog error, is
        # checked here; the query vectors themselves are checked by prepare_queries.
        if queries is None or isinstance(queries, SparseVector) or not hasattr(queries, "__iter__"):
            raise ValidationError(f"queries must be a list (or array) of query vectors, got {queries!r:.100}")
        if split_filter is not None and not isinstance(split_filter, Mapping):
            raise ValidationError(f"split_filter must be a mapping of split attribute to value, got "
                                  f"{type(split_filter).__name__} {split_filter!r:.100}")
        if consistency is not None and not isinstance(consistency, Consistency):
            consistency = _consistency(consistency)
        if tag is not None or as_of is not None:
            check_name("index name", index_name)
            check_name("index version", index_version)
            if tag is not None:
                check_name("tag", tag)
            if as_of is not None:
                check_seq(as_of, "as_of")
            return self._search_history(scope, index_name, index_version, queries, k, split_filter,
                                        retrieve_vectors, consistency, tag, as_of, search_params, filters, shards,
                                        max_hits, answered)
        view = self.view(scope, index_name, index_version)
        key = (scope.tenant_id, index_name, index_version)
        if pin is not None:
            check_seq(pin, "pin")
        args = (queries, k, split_filter, retrieve_vectors, consistency, search_params, filters, shards, max_hits,
                pin, answered)
        try:
            return self._search_current(scope, key, view, *args)
        except _SourceGone:
            # The view's index (or its whole data source) is gone from the catalog: the index was dropped, perhaps
            # made again under its name, and this searcher has not heard yet (an announcement lost, or not polled
            # since). Serve what the name holds now (NotFoundError when nothing does), rather than a 404 or the
            # dropped index's answers (its metric, splits and versions).
            self._unload(key)
            view = self._load(scope, index_name, index_version)
            try:
                return self._search_current(scope, key, view, *args)
            except _SourceGone:
                raise NotFoundError(f"index {index_name}/{index_version} was dropped") from None

    def _search_current(self, scope: Scope, key: tuple[int, str, str], view: IndexView, *args: Any) -> list[Hits]:
        """`_search_view`, over the versions active now when `view` turns out stale (_Stale: a compaction
        reached past what it serves)."""
        for _ in range(_STALE_RELOADS):
            try:
                return self._search_view(scope, key, view, *args)
            except _Stale:
                view = self._load(scope, key[1], key[2])
        raise ConflictError(f"index {key[1]}/{key[2]}: compactions of its log kept overtaking the versions this "
                            f"searcher loaded; retry")

    def _search_view(
        self, scope: Scope, key: tuple[int, str, str], view: IndexView, queries: Any, k: int,
        split_filter: Mapping[str, Any] | None, retrieve_vectors: bool, consistency: Consistency | None,
        search_params: Mapping[str, int] | None, filters: Mapping[str, Any] | Filter | None,
        shards: Collection[int] | None, max_hits: int | None, pin: int | None = None,
        answered: AnsweredAt | None = None,
    ) -> list[Hits]:
        """`search` over one served view; _SourceGone when a head read finds its data source or its index gone."""
        self._used[key] = time.monotonic()
        if consistency is not None and consistency.data_source:
            _check_token_source(view, consistency)
        if pin is not None and consistency is not None and consistency.level != "eventual":
            # A pinned part answers at least the pin (checked as a token: past the head it is refused, or the young
            # tier would claim seqs no commit has taken) and at most as far as it must. A strong part needs no head
            # of its own: the pin is a head another part read after the search began.
            consistency = Consistency.at_least(max(pin, consistency.seq))
        else:
            pin = None
        served = view
        if shards is not None or view.partial:
            view = self._part(view, scope.tenant, shards)
            if not view.shards:
                q = prepare_queries(view.source.spec, queries)  # a bad query is still refused
                return [Hits([], [], ()) for _ in range(len(q))]
        if answered is not None:
            answered.higher_is_nearer = view.higher_is_nearer
        if consistency is None or consistency.level == "eventual":
            required = 0
        elif consistency.level == "at_least":
            required = consistency.seq
            young = self._tails.get(view.index.id)
            if required > max(young.end if young is not None else 0, served.min_watermark):
                try:
                    self._check_token(view.source.id, required, view.index.id)
                except NotFoundError:
                    raise _SourceGone from None
            # At least the highest shard watermark, as the young tier reaches (see _load): below it, shards built
            # further than the others would show writes of a batch the others do not (a state the log never
            # had). Every shard then answers at one seq, the token's or later.
            required = max(required, max((s.watermark for s in served.shards), default=0))
        else:
            read = self._head_read(view.source.id)
            if read is None:
                try:
                    required = self._catalog_head(view.source.id, view.index.id)
                except NotFoundError:
                    raise _SourceGone from None
            else:
                # The head is on its way; meanwhile answer over what the young tier covers now. Nothing
                # missing (the common case): that is the answer, and the round trip cost no extra time.
                young = self._tails.get(view.index.id)
                covered = max(young.end if young is not None else 0, served.min_watermark)
                try:
                    answer = self._answer(view, served, queries, k, split_filter, retrieve_vectors, covered,
                                          search_params, filters, max_hits, answered=answered)
                    head = self._read_head(read, view.source.id, view.index.id)
                except NotFoundError:
                    raise _SourceGone from None
                finally:
                    read.close()
                if head <= covered:
                    return answer
                required = head
        # A strong search's `required` is a head, never below a compaction's bound: no need to ask for it.
        return self._answer(view, served, queries, k, split_filter, retrieve_vectors, required, search_params,
                            filters, max_hits, at_head=consistency is not None and consistency.level == "strong",
                            pin=required if pin is not None else None,
                            answered=answered if consistency is not None and consistency.level != "eventual"
                            else None)

    def _answer(
        self, view: IndexView, served: IndexView, queries: Any, k: int, split_filter: Mapping[str, Any] | None,
        retrieve_vectors: bool, required: int, search_params: Mapping[str, int] | None,
        filters: Mapping[str, Any] | Filter | None, max_hits: int | None = None, at_head: bool = False,
        pin: int | None = None, answered: AnsweredAt | None = None,
    ) -> list[Hits]:
        """The search over `view` (a part of `served`, or itself) and its young tier, covering the log up to
        `required` at least (`at_head`: `required` is a head the catalog or Redis gave); with `pin` (at most
        `required`), up to exactly the lowest seq at or past it that the view can answer at. `answered` gets the
        seq the answer reflects."""
        params = view.engine_class.check_search_params(search_params) if search_params else None
        # The young tier as far as it reaches (no I/O), or further when the consistency level needs more.
        # (The young tier is kept for the served view; a part of it takes its own shards' tails.)
        young = self._tails.get(view.index.id)
        cache: TailCache | None
        if young is None:
            cache = self._extend(served, required, at_head) if required > served.min_watermark else None
        elif young.end >= required:
            cache = young
            if young.versions != served.versions:
                # A newer version was swapped in and its young tier is still being derived (by the loader or
                # the follower): answer from the view the young tier was derived for. That pair is consistent
                # and covers the log as far, so no search waits for a derivation (up to a second on a busy box).
                shards = view.shard_numbers
                served = young.view
                view = served if len(shards) == len(served.shards) else IndexView(
                    served.index, served.source, tuple(s for s in served.shards if s.shard_no in shards))
        else:
            cache = self._extend(served, required, at_head)
        tails = cache.tails if cache is not None else {}
        if answered is not None or pin is not None:  # parts of fanned-out searches only: eventual ones skip it
            top = max((s.watermark for s in served.shards), default=0)
            seq = max(cache.end if cache is not None else required, top)
            if pin is not None and cache is not None and seq > max(pin, top):
                seq, tails = self._cut(served, cache, max(pin, top))
            if answered is not None:
                answered.seq = seq
        if view is not served and tails:
            tails = {n: t for n, t in tails.items() if n in view.shard_numbers}
        if max_hits is not None:
            check_hits(view, tails, queries, k, max_hits)
        if filters is not None:  # only filtered searches take this branch: the unfiltered path is unchanged
            flt = _checked_filter(view, filters)
            if flt is not None:
                q = prepare_queries(view.source.spec, queries)
                matches = split_matcher(view.index.spec, view.source.spec, split_filter)
                return execute(view, q, k, matches, tails, retrieve_vectors, params, flt)
        if not tails and not split_filter and (block := view.one_block) is not None:
            # One engine over every row the view serves: its answer is the result (no masks, tails or merge).
            # Inlined rather than a call to `execute`: single-query searches spend microseconds per step.
            engine, sources = block
            one = engine.search_one(queries, k, params)
            if one is not None:
                return [Hits(one[1], one[0], sources, None, retrieve_vectors)]
            d_rows, r_rows = engine.search_lists(prepare_queries(view.source.spec, queries), k, params)
            if len(d_rows) == 1:  # one query: no comprehension (in Python 3.11 it costs a function call)
                return [Hits(r_rows[0], d_rows[0], sources, None, retrieve_vectors)]
            return [Hits(r, d, sources, None, retrieve_vectors) for d, r in zip(d_rows, r_rows, strict=True)]
        q = prepare_queries(view.source.spec, queries)
        matches = split_matcher(view.index.spec, view.source.spec, split_filter)
        return execute(view, q, k, matches, tails, retrieve_vectors, params)

    def _cut(self, served: IndexView, cache: TailCache, seq: int) -> tuple[int, dict[int, Tail]]:
        """The tails of `served` (the view `cache` was derived for) up to `seq` alone, cut from the young tier
        that reaches further, and the seq they reflect: `seq`, or a compaction's bound when the young tier was
        read over a compacted range below it (the entries there that later ones superseded are gone, so a cut
        below the bound would show a state the log never had)."""
        if cache.start < seq:
            floor = dropped_through(self.engine, served.source.id)
            if cache.start < floor:
                seq = max(seq, floor)
        if seq >= cache.end:
            return cache.end, cache.tails
        entries = cache.entries
        if entries is None or not entries.num_rows:
            return seq, {}
        held = entries.filter(pc.less_equal(entries[SEQ], seq))
        return seq, build_tails(served, held) if held.num_rows else {}

    def _part(self, view: IndexView, tenant: str, shards: Collection[int] | None) -> IndexView:
        """The part of a served view that a search may use: `shards` (None: every shard of the index), each of
        which this process must serve (ShardsUnavailableError names the others, and who serves them)."""
        held = view.shard_numbers
        wanted = self._wanted(view.index, tenant, held, shards)
        if wanted == held:
            return view
        parts = view.parts
        part = parts.get(wanted)
        if part is None:
            part = IndexView(view.index, view.source, tuple(s for s in view.shards if s.shard_no in wanted))
            if len(parts) < 64:
                parts[wanted] = part
        return part

    def _wanted(
        self, index: IndexRecord, tenant: str, held: frozenset[int], shards: Collection[int] | None
    ) -> frozenset[int]:
        """The shards a search asks for (None: every shard of the index), all of them among `held` (the shards
        this process serves), else ShardsUnavailableError naming the others and where they are placed."""
        wanted = frozenset(range(len(index.shards))) if shards is None else frozenset(shards)
        beyond = sorted(n for n in wanted if n >= len(index.shards))
        if beyond:  # no node could answer it: the caller's mistake, not a shard to retry later
            spec = index.spec
            raise ValidationError(
                f"index {spec.name}/{spec.version} has {len(index.shards)} shard{'s' if len(index.shards) > 1 else ''}"
                f" (0..{len(index.shards) - 1}): no shard {', '.join(map(str, beyond))}")
        missing = sorted(wanted - held)
        if missing:
            spec = index.spec
            placed = self.placement.of(tenant, spec.name, spec.version)
            where = ""
            if placed is not None:
                nodes = sorted({n for s in missing for n in placed.nodes.get(s, ())})
                where = (f" (placed on {', '.join(nodes)}; search through the API, which fans out)" if nodes
                         else " (placed on no node: add them to SHOAL_PLACEMENT_FILE)")
            me = f"node {self.placement.node}" if self.placement.node else "this process"
            raise ShardsUnavailableError(
                f"{me} does not serve shard{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of "
                f"index {spec.name}/{spec.version}{where}", missing)
        return wanted

    def _head_read(self, source_id: int) -> HeadAndTokenRead | None:
        """The read of the head announced on Redis (and of the data source's index token), sent now, when
        announcements are trusted for the data source (the searcher follows them, and the catalog confirmed a
        head once since it (re)subscribed); None when they are not, or Redis does not take the read: the catalog
        answers then."""
        subscription = self._subscription
        if not subscription:
            return None
        floor = self._floors.get(source_id)
        if floor is None or floor[0] != subscription:
            return None
        try:
            return HeadAndTokenRead(self.runtime.redis(), source_id)
        except (redis.RedisError, OSError, ShoalError):
            return None

    def _read_head(self, read: HeadAndTokenRead, source_id: int, index_id: int | None = None) -> int:
        """The head `read` answers when it can be trusted (at least the head the catalog confirmed, and, with
        `index_id`, the data source's index token unchanged since the catalog last found that index: no catalog
        round trip), else the catalog's (NotFoundError when the data source or that index is gone)."""
        token: Any = _UNREAD
        try:
            head, token = read.result()
        except (redis.RedisError, OSError, ShoalError):
            head = None
        floor = self._floors.get(source_id)
        if (head is not None and floor is not None and head >= floor[1]
                and (index_id is None or self._checked.get(index_id) == (self._subscription, token))):
            return head
        return self._catalog_head(source_id, index_id, token)

    def _check_token(self, source_id: int, token: int, index_id: int | None = None) -> None:
        """Refuse a write token past the log's head: tokens come from commits, which reach the catalog before
        they are acknowledged, so such a token was never issued for this data source. (Read up to it, the young
        tier would claim to cover seqs no commit has taken yet, and miss the writes that later take them.)"""
        read = self._head_read(source_id)
        head = -1
        if read is not None:
            try:
                head = self._read_head(read, source_id, index_id)
            finally:
                read.close()
        if head < token:  # an announcement may trail its commit: the catalog decides
            head = self._catalog_head(source_id, index_id)
        if token > head:
            raise QueryError(f"write token {token} is past the log head {head}: a write token comes from an "
                             f"upload to this data source")

    def _catalog_head(self, source_id: int, index_id: int | None = None, token: Any = _UNREAD) -> int:
        """The data source's head as the catalog has it now; NotFoundError when the data source is gone, or
        (`index_id`) that index is: read in the same query, so a strong search learns of a drop of the index it
        serves at once even while the data source stays. While following announcements, the head is also the
        floor a head read from Redis must reach to be trusted (Redis may come back from a restart older), and
        `token` (the data source's index token, read before this) the one under which the index is taken as
        there without asking again."""
        subscription = self._subscription
        head = head_of(self.engine, source_id, index_id)[0]
        if subscription:
            self._floors[source_id] = (subscription, head)
            if index_id is not None and token is not _UNREAD:
                self._checked[index_id] = (subscription, token)
        return head

    def _search_history(
        self, scope: Scope, name: str, version: str, queries: Any, k: int, split_filter: Mapping[str, Any] | None,
        retrieve_vectors: bool, consistency: Consistency | None, tag: str | None, as_of: int | None,
        search_params: Mapping[str, int] | None, filters: Mapping[str, Any] | Filter | None = None,
        wanted: Collection[int] | None = None, max_hits: int | None = None, answered: AnsweredAt | None = None,
    ) -> list[Hits]:
        from shoal.index import history

        if tag is not None and as_of is not None:
            raise ValidationError("give a tag or an as_of seq, not both")
        if consistency is not None and consistency.level != "eventual":
            raise ValidationError("a search of older versions (tag, as_of) takes no consistency level")
        if as_of is not None and (isinstance(as_of, bool) or not isinstance(as_of, int)):
            raise ValidationError(f"as_of must be a seq (an integer), got {as_of!r}")
        index = scope.indexes.get_index(name, version)
        if tag is not None:
            tagged = history.tagged_versions(self.engine, index.id, tag)
            versions = tagged.versions
            # The seq the tag stands for: shards pinned at lower watermarks read the log up to it, as for as_of
            # (None: a tag taken before it was recorded answers each shard at its own version's watermark).
            seq = tagged.seq
            if tagged.index_id != index.id:  # taken before a reindex: its own generation answers, as it was
                found = self.shards.index_by_id(tagged.index_id)
                if found is None:
                    raise NotFoundError(f"tag {tag!r} not found")
                index = found[1]
        else:
            assert as_of is not None
            head = head_of(self.engine, index.source_id)[0]
            if as_of > head:
                raise ValidationError(f"as_of seq {as_of} is past the log head {head}")
            versions = history.versions_as_of(self.engine, index.id, as_of)
            seq = as_of
        source = scope.catalog.get_data_source(index.spec.source_name, index.spec.source_version)
        local = self.placement.local_shards(scope.tenant, name, version)
        # The same rules as a search of the active versions: only shards this process serves, all unless asked.
        picked = self._wanted(index, scope.tenant,
                              frozenset(s.shard_no for s in index.shards if local is None or s.shard_no in local),
                              wanted)
        shards = tuple(
            load_shard(self.storage, self.cache, index, s.id, s.shard_no, versions.get(s.id))
            for s in index.shards if s.shard_no in picked
        )
        # No view holds these segments: within the budget they stay for the next search of these versions, past it
        # they go (they filled the cache past its budget until the next load of a current version).
        self.cache.trim()
        view = IndexView(index, source, shards)
        q = prepare_queries(source.spec, queries)  # a bad query is refused even when no shard is searched
        if not shards:
            return [Hits([], [], ()) for _ in range(len(q))]
        if answered is not None:
            answered.higher_is_nearer = view.higher_is_nearer
        params = view.engine_class.check_search_params(search_params)
        matches = split_matcher(index.spec, source.spec, split_filter)
        flt = _checked_filter(view, filters) if filters is not None else None
        tails = {}
        if seq is not None and seq > view.min_watermark:
            batches = list(read_log(self.engine, self.storage, source.id, view.min_watermark, seq))
            # Checked again now that the log was read: a compaction that committed since the versions were
            # picked (as_of checks before too) may have dropped entries of that range, and the read would show
            # a state that never existed. What compactions dropped never comes back, so passing now means the
            # read saw the log whole.
            history.check_log_kept(self.engine, source.id, view.min_watermark, seq, tag,
                                   starts=[s.watermark for s in view.shards])
            if batches:
                tails = build_tails(view, pa.Table.from_batches(batches))
        if max_hits is not None:
            check_hits(view, tails, q, k, max_hits)
        return execute(view, q, k, matches, tails, retrieve_vectors, params, flt)

    def _tail(self, view: IndexView, required: int, at_head: bool = False) -> dict[int, Tail]:
        """The log tail (served watermark, at least `required`] per shard: the young tier, extended (and
        re-derived for newly served versions) as needed. A tail reaching past `required` still reflects every
        write up to it."""
        return self._extend(view, required, at_head).tails

    def _extend(self, view: IndexView, required: int, at_head: bool = False) -> TailCache:
        """The young tier of `view` reaching at least `required` (further past a compacted range: see
        `_past_compaction`; `at_head`: `required` is a head, at or past any compaction's bound)."""
        made = self._extend_within(view, required, None, at_head)
        assert made is not None  # no limit: always made
        return made

    def _extend_within(self, view: IndexView, required: int, limit: int | None, at_head: bool = False
                       ) -> TailCache | None:
        """`_extend`, unless reaching past a compacted range would take the young tier past `limit` (its
        bound): then it is left as it is, and None returned."""
        with self._lock:
            cached = self._tails.get(view.index.id)
        if cached is not None and cached.versions == view.versions and cached.end >= required:
            return cached
        required = self._past_compaction(view, cached, required, at_head)
        if limit is not None and required > limit:
            return None
        made = extend(cached, view, required, lambda after, up_to: self._read_log(view, after, up_to),
                      time.monotonic())
        with self._lock:
            current = self._tails.get(view.index.id)
            # Of two racing extensions keep the one made for the view served now (a loader may have swapped in
            # a newer view, with its tails, while this one was made for the older), then the one reaching further.
            key, served = next(((k, v.versions) for k, v in self._views.items() if v.index.id == view.index.id),
                               (None, None))
            if served is None:
                # Unloaded meanwhile (the budget evicted it): kept, the tail would pin its segments outside the
                # budget until the index is searched again. This search answers from it alone.
                keep = False
            elif current is None:
                keep = True
            elif (made.versions == served) != (current.versions == served):
                keep = made.versions == served
            else:  # both for the served view, or neither: the further of the same, else the one made last
                keep = current.versions != made.versions or current.end <= made.end
            if keep:
                self._tails[view.index.id] = made
        if keep and key is not None:
            # Held now, it counts toward the budget: a tier grown with no load (commits the follower reads) would
            # otherwise take the process past the budget until some index is loaded. Called with no lock held.
            self._fit_grown(key)
        return made

    def _past_compaction(self, view: IndexView, cached: TailCache | None, required: int, at_head: bool) -> int:
        """`required`, or the bound of the source's compactions that dropped entries when the extension would
        read from below it to below it: those entries superseded later are gone from the log, so such a read
        would show keys missing or old values, a state the log never had. Reading on to the bound shows the
        state there, but only over an empty start (an index made after the compaction, its first builds not
        done): over points held from below the bound (a served version, or the young tier's entries) the read
        misses the expired tombstones that delete some of them. _Stale then: the view must be reloaded.
        (`at_head`: `required` is a head, so at or past the bound.)"""
        start = view.min_watermark
        if cached is not None and cached.start <= start <= cached.end:
            start = cached.end  # what the young tier holds was read before, whole
        if required <= start:
            return required
        floor = dropped_through(self.engine, view.source.id)
        if start >= floor:
            return required
        if start > 0 or any(s.version_id is not None and s.watermark < floor for s in view.shards):
            raise _Stale
        return required if at_head else max(required, floor)

    def _read_log(self, view: IndexView, after: int, up_to: int) -> pa.Table | None:
        batches = list(read_log(self.engine, self.storage, view.source.id, after, up_to))
        return pa.Table.from_batches(batches) if batches else None

    def view(self, scope: Scope, index_name: str, index_version: str) -> IndexView:
        """The index as currently served, loading it on first use; InvalidNameError (nothing read) when a name
        is no legal name."""
        self._usable()
        # Read without the lock: one dict lookup is atomic, and views are only ever replaced whole.
        try:
            view = self._views.get((scope.tenant_id, index_name, index_version))
        except TypeError:  # an unhashable name (a list): refused just below
            view = None
        if view is None:
            # Checked before the catalog sees them (a NUL, a lone surrogate or an int is a raw database error
            # there); a served view's names passed this check when it was loaded, so searches of it skip it.
            check_name("index name", index_name)
            check_name("index version", index_version)
            view = self._load(scope, index_name, index_version)
        return view

    def refresh(self) -> None:
        """Load, now, any newer active version of the indexes served; stop serving the ones that are gone.

        One catalog statement tells which served indexes changed (their index, shard or data source rows); only
        those, the ones whose last refresh failed and the ones not polled yet are loaded again. Only NotFoundError
        (the catalog answered: the index or its data source is no more) unloads an index. Any other failure, a
        catalog or storage outage above all, keeps the view served as it is: eventual searches go on answering
        from it, and the next poll tries again (logged once per outage, not per poll)."""
        with self._lock:
            keys = list(self._views)
            for gone in self._fingerprints.keys() - set(keys):  # unloaded since (the budget, a drop): forgotten
                self._fingerprints.pop(gone, None)
        current = self._current_fingerprints(keys)
        if current is None:
            return
        for key in keys:
            tenant_id, name, version = key
            scope = self._scopes.get(tenant_id)
            if scope is None or key not in self._views:  # unloaded since (the budget): loaded again when searched
                continue
            known = self._fingerprints.get(key)
            if key not in self._stale and known is not None and known == current.get(key):
                continue  # nothing it was loaded from changed
            self._refresh_one(scope, key, current.get(key))

    def _current_fingerprints(self, keys: list[ServingKey]) -> dict[ServingKey, tuple[Any, ...]] | None:
        """The catalog's fingerprints of the served `keys` (`serving_fingerprints`), or None when the catalog
        does not answer: the views are kept as they are, and the failure logged once per outage."""
        try:
            current = serving_fingerprints(self.engine, keys)
        except Exception as exc:  # noqa: BLE001 - unreachable is not deleted: keep serving, retry next poll
            if not self._poll_failed:
                self._poll_failed = True
                log.warning("could not poll the catalog for new index versions (%s: %s); serving the versions "
                            "held until it answers again", type(exc).__name__, exc)
            return None
        if self._poll_failed:
            self._poll_failed = False
            log.info("the catalog answers the searcher's poll again")
        return current

    def _refresh_one(self, scope: Scope, key: ServingKey, fingerprint: tuple[Any, ...] | None) -> None:
        """Load the view of `key` again (`fingerprint`: the catalog's, read before the load, or None when the
        index is gone), unloading it when the catalog no longer has it."""
        _, name, version = key
        # Forgotten first: a failed or concurrent load must not leave a fingerprint the view does not reflect.
        self._fingerprints.pop(key, None)
        try:
            self._load(scope, name, version)
        except NotFoundError:
            log.info("index %s/%s of tenant %s is gone: no longer served", name, version, scope.tenant)
            self._unload(key)
            self._stale.discard(key)
        except CapacityError as exc:  # `_fit_budget` unloaded it: loaded again by its next search, not by a poll
            log.warning("index %s/%s of tenant %s unloaded at a refresh: %s", name, version, scope.tenant, exc)
            self._stale.discard(key)
        except Exception as exc:  # noqa: BLE001 - unreachable is not deleted: keep serving, retry next poll
            if key not in self._stale:
                self._stale.add(key)
                log.warning("could not refresh index %s/%s (%s: %s); serving the version it holds until the "
                            "catalog and storage answer again", name, version, type(exc).__name__, exc)
        else:
            # Read before the load: the view reflects it or a later state (then the next poll loads once more).
            if fingerprint is not None and key in self._views:
                self._fingerprints[key] = fingerprint
            if key in self._stale:
                self._stale.discard(key)
                log.info("index %s/%s refreshed again", name, version)

    @property
    def loaded_bytes(self) -> int:
        """Bytes the process's searchers hold against SHOAL_SEARCHER_CACHE_BYTES: the segments of the runtime's
        cache (shared) and the young tiers of every searcher sharing it (estimated: `TailCache.nbytes`)."""
        return self.cache.bytes + self.young_bytes

    @property
    def young_bytes(self) -> int:
        """Estimated bytes of the young tiers held by the searchers sharing this one's segment cache (the
        process's budget): the log entries their served versions do not reflect yet, decoded."""
        return sum(service._own_young_bytes() for service in self._sharing())

    def _own_young_bytes(self) -> int:
        with self._lock:
            tiers = list(self._tails.values())
        return sum(t.nbytes for t in tiers)

    def _sharing(self) -> list[SearchService]:
        """The services sharing this one's segment cache, and so its budget (this one among them)."""
        with _SHARING_LOCK:
            return list(_SHARING.get(self.cache, ()))

    def _over_budget(self) -> bool:
        """True while the segments and the young tiers held pass the budget: a young tier is memory a search
        needs as much as a segment (900 indexes no worker had built held 1.7 GB past a 100 MB budget)."""
        return self.loaded_bytes > self.cache.budget

    def _load(self, scope: Scope, name: str, version: str) -> IndexView:
        key = (scope.tenant_id, name, version)
        # One loader at a time: two racing loads would do the same I/O twice.
        with self._load_lock, self._loading_heads():
            old = self._views.get(key)
            held = {s.version_id for s in old.shards if s.version_id is not None} if old else set()
            index, source, versions = scope.indexes.serving(name, version, held)
            shards = []
            local = self.placement.local_shards(scope.tenant, name, version)
            if local is not None and (beyond := sorted(n for n in local if n >= len(index.shards))):
                raise ConfigurationError(
                    f"SHOAL_PLACEMENT_FILE places shard(s) {', '.join(map(str, beyond))} of index {name}/{version} "
                    f"on node {self.placement.node}, but the index has {len(index.shards)} shards")
            for shard in index.shards:
                if local is not None and shard.shard_no not in local:
                    continue  # another node's: this process never loads it
                current = next((s for s in old.shards if s.shard_id == shard.id), None) if old else None
                if current is not None and current.version_id == shard.active_version_id:
                    shards.append(current)
                    continue
                record = versions[shard.active_version_id] if shard.active_version_id else None
                shards.append(load_shard(self.storage, self.cache, index, shard.id, shard.shard_no, record))
            view = IndexView(index, source, tuple(shards))
            # A young tier reaches at least the highest shard watermark: below it, shards built further than the
            # others would show writes of a batch the others do not (a state the log never had).
            top = max((s.watermark for s in view.shards), default=0)
            bound = view.min_watermark + self.young_max_seqs
            # Another generation (a reindex swap, a rollback, the index made again): the young tiers kept under
            # the generations' ids are of other versions and times. The old one's pinned its whole generation
            # outside the budget; the new one's, kept since it last served (a rollback), showed points deleted
            # since. The view is loaded as anew.
            anew = old is None or old.index.id != index.id
            fresh: TailCache | None = None
            followed = anew and self.follows and self.young_max_seqs > 0 and bool(view.shards)
            if followed:
                # A view loaded anew answers its first eventual search with the log up to the head read with it,
                # as a followed view does: writes acknowledged before the load (maybe long before, with no
                # worker building) are shown at once, not from the follower's next wake, up to a poll later.
                # Read before the view is served: a search finding the view served (a concurrent first search,
                # which does not wait for this loader) then finds its young tier with it, never a view without
                # one (writes missing) or with the one kept from when its generation last served (a rollback).
                target = max(min(source.head_seq, bound), top)
                if target > view.min_watermark:
                    try:
                        fresh = self._young_at_load(view, target, max(bound, top))
                    except Exception as exc:  # noqa: BLE001 - the follower extends it then
                        log.debug("young tier of index %s not read at load: %s", name, exc)
            # What the generation served showed binds the new one only over the same data source: an index made
            # again over another counts other seqs (its tier would be marked as reaching seqs it never read).
            replaced = old if followed and old is not None and old.source.id == view.source.id else None
            if replaced is not None:
                # The follower goes on extending the old generation's tier while this one is read: caught up
                # here, without the lock, a few times, so the check under it rarely has anything left to read.
                for _ in range(CATCH_UP_TRIES):
                    fresh = self._caught_up(view, fresh, self._shown(replaced), bound)
                    if self._reaches(view, fresh, self._shown(replaced)):
                        break
            with self._lock:
                if replaced is not None and not self._reaches(view, fresh, self._shown(replaced)):
                    # Under the lock, which the follower takes to store what it extends: the old tier cannot
                    # move past this check, and no search finds the new view with less than it showed. Only up
                    # to that (the newest head is the follower's, after the swap): the read here is short.
                    fresh = self._caught_up(view, fresh, self._shown(replaced), bound, newest=False)
                self._views[key] = view
                self._served_sources = self._sources_of_views()
                self._scopes[scope.tenant_id] = scope
                self._used.setdefault(key, time.monotonic())
                if anew:  # swapped with the view, so no search pairs the new view with another tier
                    if old is not None:
                        self._tails.pop(old.index.id, None)
                        self._checked.pop(old.index.id, None)
                    self._tails.pop(index.id, None)
                    if fresh is not None:
                        self._tails[index.id] = fresh
            # Only once the view is served: the follower this may wake extends served views alone.
            self._saw_head(source.id, source.head_seq)
            self._fit_budget(key)
        # The young tier for the new versions, derived now in the loader (only the shards whose version changed
        # are, cut from what is held: no I/O). Until it is served, searches answer from the young tier's own view.
        young = self._tails.get(index.id)
        if not anew and young is not None and young.versions != view.versions:
            try:
                self._extend_within(view, max(young.end, top), max(young.end, top, bound))
            except Exception as exc:  # noqa: BLE001 - the follower derives it then
                log.debug("young tier of index %s not derived at load: %s", name, exc)
        self.shards.mark_served_many({s.shard_id: s.watermark for s in view.shards
                                      if s.version_id is not None and s.version_id not in held})
        return view

    def _shown(self, old: IndexView) -> int:
        """The seq up to which eventual searches of `old` (the view served) may have shown the log: its young
        tier's end, or its highest shard watermark when that reaches further (or it has no tier)."""
        young = self._tails.get(old.index.id)
        top = max((s.watermark for s in old.shards), default=0)
        return max(young.end if young is not None else 0, top)

    @staticmethod
    def _reaches(view: IndexView, fresh: TailCache | None, shown: int) -> bool:
        """Whether `view` with the young tier `fresh` covers the log up to `shown`."""
        return shown <= max(fresh.end if fresh is not None else 0, view.min_watermark)

    def _caught_up(
        self, view: IndexView, fresh: TailCache | None, shown: int, bound: int, *, newest: bool = True,
    ) -> TailCache | None:
        """`fresh`, the young tier read for `view` (loaded anew, about to replace a served generation of the
        same data source), extended to `shown` (what searches of the generation served showed: past its bound
        if need be, or a write once returned would vanish at the swap) and, with `newest`, to the newest head
        this searcher knows (within the bound). Unchanged when it reaches them; None only when it was None and
        the view covers them already. A read that fails raises: the caller keeps the generation served (the
        next poll loads again), unless the log past the view's watermarks was compacted away (_Stale), which no
        young tier can cover."""
        top = max((s.watermark for s in view.shards), default=0)
        known = min(self._heads.get(view.source.id, 0), bound) if newest else 0
        required = max(shown, known, top)
        if required <= max(fresh.end if fresh is not None else 0, view.min_watermark):
            return fresh
        try:
            required = self._past_compaction(view, fresh, required, False)
        except _Stale:  # the view must be reloaded once built past the compaction: served as it is meanwhile
            return fresh
        return extend(fresh, view, required, lambda after, up_to: self._read_log(view, after, up_to),
                      time.monotonic())

    def _young_at_load(self, view: IndexView, target: int, limit: int) -> TailCache | None:
        """The young tier of `view`, a view loaded anew and not served yet, read from its lowest watermark up to
        `target` (further past a compacted range: `_past_compaction`); None when that would take it past
        `limit`. Not kept here: the loader serves it together with the view."""
        required = self._past_compaction(view, None, target, False)
        if required > limit:
            return None
        return extend(None, view, required, lambda after, up_to: self._read_log(view, after, up_to),
                      time.monotonic())

    def _retain(self) -> None:
        """Tell the cache which segments this service's views hold (the rest can go)."""
        with self._lock:
            segments = [seg.segment for v in self._views.values() for sh in v.shards for seg in sh.segments]
        self.cache.retain(id(self), segments)

    def _unload(self, key: tuple[int, str, str]) -> bool:
        """Stop serving the view of `key`, releasing its segments and young tier; True when it had one."""
        young = None
        with self._lock:
            view = self._views.pop(key, None)
            self._used.pop(key, None)
            self._fingerprints.pop(key, None)
            self._over_alone.discard(key)
            if view is not None:
                young = self._tails.pop(view.index.id, None)
                self._checked.pop(view.index.id, None)
                self._served_sources = self._sources_of_views()
                self._forget_unserved_sources()
        self._retain()
        return young is not None

    @contextlib.contextmanager
    def _loading_heads(self) -> Iterator[None]:
        """While a load runs (under the load lock), take every head announced; after it, keep only the heads
        of the data sources served."""
        with self._lock:
            self._loading = True
        try:
            yield
        finally:
            with self._lock:
                self._loading = False
                self._forget_unserved_sources()

    def _sources_of_views(self) -> frozenset[int]:
        """The data sources of the views served (called under the lock, when they change)."""
        return frozenset(view.source.id for view in self._views.values())

    def _forget_unserved_sources(self) -> None:
        """Drop the heads and floors of data sources no served view uses (under the lock; not while a load runs,
        whose view may need a head announced meanwhile). A later load reads the head with the data source."""
        if self._loading:
            return
        for table in (self._heads, self._floors):
            # list(table) in one step: `_catalog_head` adds floors without the lock, and a walk of the dict itself
            # would fail ("changed size during iteration") should one land in the middle of it.
            for source_id in [s for s in list(table) if s not in self._served_sources]:
                table.pop(source_id, None)

    def _lru(self, loaded: tuple[int, str, str]) -> list[tuple[float, tuple[int, str, str]]]:
        """(last searched, key) of the indexes this service serves, `loaded` left out."""
        with self._lock:
            return [(t, k) for k, t in self._used.items() if k != loaded and k in self._views]

    def _fit_budget(self, loaded: tuple[int, str, str]) -> None:
        """Release superseded segments, then unload the least recently searched other indexes while the
        segments and young tiers held pass the budget (`_over_budget`), whichever service of the cache serves
        them (the budget is the process's, and `Shoal.searcher()` makes a service per searcher). An index whose
        segments alone pass the budget is not served (CapacityError); one that passes it only with its young
        tier is served, and the others stay (`_alone_over_budget`)."""
        self._retain()
        if self._alone_over_budget(loaded):
            return
        self._unload_others(loaded)

    def _unload_others(self, keep: tuple[int, str, str]) -> None:
        """Unload the least recently searched indexes of the services sharing the budget, `keep` (this service's)
        left out, while the segments and young tiers held pass it, or until nothing but `keep` is left."""
        freed_young = False
        try:
            while self._over_budget():
                others = [(t, k, service) for service in self._sharing()
                          for t, k in service._lru(keep if service is self else (0, "", ""))]
                if not others:
                    return
                _, key, service = min(others, key=lambda o: o[0])
                log.info("unloading index %s/%s to stay within the searcher memory budget", *key[1:])
                freed_young = service._unload(key) or freed_young
        finally:
            if freed_young:
                # Segments dropped hand their memory back in the cache; a young tier's arrays (Arrow's pool,
                # NumPy's heap pages) are handed back here, or the process keeps them though nothing uses them.
                release_free_memory()

    def _fit_grown(self, grown: tuple[int, str, str]) -> None:
        """After the young tier of `grown` (an index this service serves) grew with no load: unload the least
        recently searched other indexes while the process passes its budget, unless `grown` alone passes it
        (`_alone_over_budget`); `grown` itself stays (it is being searched or followed). Never raises: the
        follower thread and the search that grew it must go on, so a failure is logged."""
        try:
            if not self._over_budget():  # the common case: a sum of the tiers' estimates, each taken once
                self._over_alone.discard(grown)
            elif not self._alone_over_budget(grown):
                self._unload_others(grown)
        except CapacityError as exc:  # its segments alone pass the budget: unloaded, searched again on demand
            log.warning("%s", exc)
        except Exception:  # noqa: BLE001 - see above: unloading is best effort here, the next growth tries again
            log.exception("could not unload indexes to fit the searcher memory budget after a young tier grew")

    def _alone_over_budget(self, key: tuple[int, str, str]) -> bool:
        """Whether the index of `key` alone passes the budget. Its segments alone: CapacityError, the index
        unloaded. With its young tier (writes no worker has built yet, which shrinks as builds catch up): True,
        with a warning logged once while it stays so; the index is served all the same, since refusing it would
        turn a lagging build into an outage of every search of it, strong ones included (updates of 3,000 points
        unbuilt made a 9 MB index answer 503). Other indexes are then left loaded: unloading them cannot make it
        fit, and each would unload it in turn as it is searched again."""
        with self._lock:
            view = self._views.get(key)
            young = self._tails.get(view.index.id) if view is not None else None
        segments = sum(seg.segment.nbytes for sh in view.shards for seg in sh.segments) if view else 0
        if segments > self.cache.budget:
            self._unload(key)
            raise CapacityError(
                f"index {key[1]}/{key[2]} needs about {segments:,} bytes in memory, more than this process's "
                f"budget SHOAL_SEARCHER_CACHE_BYTES = {self.cache.budget:,}: raise it, or serve the index's "
                "shards from more processes"
            )
        tier = young.nbytes if young is not None else 0
        if segments + tier <= self.cache.budget:
            self._over_alone.discard(key)
            return False
        if key not in self._over_alone:
            self._over_alone.add(key)  # logged once, until it fits again
            log.warning("index %s/%s passes the searcher memory budget SHOAL_SEARCHER_CACHE_BYTES = %s with its "
                        "young tier (writes not built yet, about %s bytes): served all the same until builds "
                        "catch up", key[1], key[2], f"{self.cache.budget:,}", f"{tier:,}")
        return True

    # -- following -----------------------------------------------------------------------------------

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a failed poll must not end the following: the next one retries
                log.exception("searcher poll failed; retrying at the next poll")

    def _listen_loop(self) -> None:
        """Follow the announcements: new index versions (reload now rather than at the next poll) and new
        heads (extend the young tier now)."""
        while not self._stop.is_set():
            try:
                client = redis.Redis.from_url(self.runtime.broker_url(), socket_timeout=1.0)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(VERSIONS_CHANNEL, HEADS_CHANNEL)
                self._subscription = self._subscriptions = self._subscriptions + 1
                heads = HEADS_CHANNEL.encode()
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if not message or message.get("type") != "message":
                        continue
                    if message["channel"] == heads:
                        announced = parse_announcement(message["data"])
                        if announced is not None:
                            self._saw_head(*announced)
                    else:
                        self._wake.set()
                pubsub.close()
                client.close()
            except (redis.RedisError, OSError) as exc:
                self._subscription = 0
                log.debug("announcements unavailable (%s); polling only", exc)
                self._stop.wait(min(self.poll_interval, 1.0))  # back soon: strong asks the catalog meanwhile
            except ShoalError as exc:  # no broker configured or startable: polling only
                self._subscription = 0
                log.debug("announcements unavailable (%s); polling only", exc)
                self._stop.wait(max(self.poll_interval, 5.0))
        self._subscription = 0

    @property
    def heads_followed(self) -> bool:
        """True while this searcher follows the announcements on Redis: strong searches then take the head
        announced there (no catalog round trip) once the catalog confirmed it for the subscription."""
        return self._subscription > 0

    def _saw_head(self, source_id: int, head: int) -> None:
        """Note a data source's head (announced, or read with its definition) when a served view uses it (or
        a load runs); wake the young tier's follower when it moved. Other data sources' heads are ignored."""
        with self._lock:
            if not self._loading and source_id not in self._served_sources:
                return
            if head <= self._heads.get(source_id, 0):
                return
            self._heads[source_id] = head
        self._young_wake.set()

    def _young_loop(self) -> None:
        """Keep each served index's young tier up to the newest known head of its data source, up to
        SHOAL_YOUNG_TIER_MAX_SEQS past its served watermark."""
        while not self._stop.is_set():
            self._young_wake.wait(self.poll_interval)
            self._young_wake.clear()
            if not self._stop.is_set():
                self.follow_heads()

    def follow_heads(self) -> None:
        """Extend, now, each served index's young tier to the newest head known for its data source (announced,
        or read at the last refresh), up to SHOAL_YOUNG_TIER_MAX_SEQS past its served watermark."""
        if self.young_max_seqs <= 0:
            return
        with self._lock:
            views = list(self._views.items())
        for key, view in views:
            if not view.shards:  # a placed index none of whose shards is here: nothing to keep
                continue
            head = self._heads.get(view.source.id, 0)
            # At least to the highest shard watermark (see _load), up to the bound past the lowest beyond it.
            top = max(s.watermark for s in view.shards)
            bound = max(view.min_watermark + self.young_max_seqs, top)
            target = max(min(head, bound), top)
            cached = self._tails.get(view.index.id)
            if target <= view.min_watermark and cached is None:
                continue
            if cached is not None and cached.versions == view.versions and cached.end >= target:
                continue
            try:
                self._extend_within(view, target, bound)
            except _Stale:  # eventual serves the young tier it has (a state the log had) until the reload
                self._fingerprints.pop(key, None)  # reloaded by the poll woken now, changed in the catalog or not
                self._wake.set()
            except Exception as exc:  # noqa: BLE001 - an outage or a dropped index: eventual serves what it has
                log.debug("young tier of index %s not extended: %s", view.index.spec.name, exc)

    def young_tier(self) -> list[tuple[str, str, str, int, int, float]]:
        """Per served shard: (tenant, index, version, shard number, keys in its young tier, seconds since this
        searcher read the oldest of them)."""
        now = time.monotonic()
        with self._lock:
            views = list(self._views.values())
        rows = []
        for view in views:
            cache = self._tails.get(view.index.id)
            for shard in view.shards:
                size = cache.size(shard.shard_no) if cache is not None and cache.versions == view.versions else 0
                age = cache.age(shard.watermark, now) if size and cache is not None else 0.0
                rows.append((view.index.tenant, view.index.spec.name, view.index.spec.version, shard.shard_no,
                             size, age))
        return rows

    @property
    def closed(self) -> bool:
        """True once `close` was called."""
        return self._stop.is_set()

    def close(self) -> None:
        """Stop following new versions and release the segments this service holds."""
        self._stop.set()
        self._wake.set()
        self._young_wake.set()
        for t in self._threads:
            t.join(timeout=5)
        with self._lock:
            self._views.clear()
            self._used.clear()
            self._tails.clear()
            self._served_sources = frozenset()
            self._heads.clear()
            self._floors.clear()
        self.cache.release(id(self))


class Searcher:
    """Serves searches of one tenant's indexes: a scope over a `SearchService` (the process's, in the API;
    a private one from `Shoal.searcher()`). Thread-safe."""

    def __init__(self, service: SearchService, scope: Scope, *, owns_service: bool = False) -> None:
        self.service = service
        self.scope = scope
        self._owns_service = owns_service
        self._closed = False

    def search(
        self,
        index_name: str,
        index_version: str,
        queries: Any,
        k: int,
        *,
        split_filter: Mapping[str, Any] | None = None,
        retrieve_vectors: bool = False,
        consistency: Consistency | str | None = None,
        tag: str | None = None,
        as_of: int | None = None,
        search_params: Mapping[str, int] | None = None,
        filters: Mapping[str, Any] | Filter | None = None,
        shards: Collection[int] | None = None,
        max_hits: int | None = None,
        pin: int | None = None,
        answered: AnsweredAt | None = None,
    ) -> list[Hits]:
        """The k nearest data points for each query vector, nearest first, at the requested consistency.

        Options: `split_filter` (attribute -> value), `filters` (attribute filters, see
        `shoal.searcher.filters`: only matching points are searched, at any consistency), `retrieve_vectors`,
        `consistency` (eventual by default, `Consistency.at_least(token)`, `Consistency.strong()`; the level names
        "eventual" and "strong" are taken too). Time travel:
        `tag` searches the versions a tag pinned (as they were; shards pinned below the highest of their
        watermarks, the seq the tag stands for, with the log up to it, so all answer at that seq); `as_of`
        answers exactly as of that seq (a write token's), from the newest kept version at or below it plus the
        log up to it. `search_params` overrides
        the index's query-time parameters for this search only, without a rebuild: `ef_search` for HNSW,
        `nprobe` for IVF (unknown names and bad values raise ValidationError). A search writes nothing, and its
        errors say "invalid query" (a QueryError), never "nothing written".

        For the HTTP server's fan-out (shoal.api.fanout): `shards`, `max_hits`, `pin` and `answered`, as
        `SearchService.search` takes them. Once this searcher (or its Shoal) was closed: ConfigurationError.
        """
        if self._closed:
            raise self._closed_error()
        try:
            return self.service.search(
                self.scope, index_name, index_version, queries, k, split_filter=split_filter,
                retrieve_vectors=retrieve_vectors, consistency=consistency,  # type: ignore[arg-type]
                tag=tag, as_of=as_of, search_params=search_params, filters=filters, shards=shards,
                max_hits=max_hits, pin=pin, answered=answered,
            )
        except ValidationError as exc:
            raise QueryError.of(exc) from None

    def search_alias(
        self,
        alias: str,
        queries: Any,
        k: int,
        *,
        split_filter: Mapping[str, Any] | None = None,
        retrieve_vectors: bool = False,
        consistency: Consistency | str | None = None,
        tag: str | None = None,
        as_of: int | None = None,
        search_params: Mapping[str, int] | None = None,
        filters: Mapping[str, Any] | Filter | None = None,
    ) -> list[Hits]:
        """`search` on the index the alias names now: resolved once per call, so a search is answered wholly
        by the index before a move or wholly by the one after it."""
        if self._closed:
            raise self._closed_error()
        target = self.scope.aliases.get(check_name("alias", alias))
        return self.search(
            target.index_name, target.index_version, queries, k, split_filter=split_filter,
            retrieve_vectors=retrieve_vectors, consistency=consistency, tag=tag, as_of=as_of,
            search_params=search_params, filters=filters,
        )

    @staticmethod
    def _closed_error() -> ConfigurationError:
        return ConfigurationError(f"this Searcher is closed (or {CLOSED}, which made it): it no longer follows "
                                  f"new versions, so its answers would go stale (make a new one)")

    def view(self, index_name: str, index_version: str) -> IndexView:
        """The index as currently served, loading it on first use; InvalidNameError when a name is no legal
        name."""
        if self._closed:
            raise self._closed_error()
        return self.service.view(self.scope, index_name, index_version)

    def loaded(self, index_name: str, index_version: str) -> bool:
        """True when the index is loaded: an eventual search of it reads nothing from the catalog or storage.
        InvalidNameError when a name is no legal name (no such index can be loaded)."""
        try:
            if (self.scope.tenant_id, index_name, index_version) in self.service._views:
                return True  # its names passed the check when it was loaded: the fast path checks nothing
        except TypeError:  # an unhashable name (a list): refused just below
            pass
        check_name("index name", index_name)
        check_name("index version", index_version)
        return False

    def served_watermarks(self, index_name: str, index_version: str) -> dict[int, int]:
        """Shard number -> the watermark of the version this searcher serves; InvalidNameError when a name is no
        legal name."""
        return {s.shard_no: s.watermark for s in self.view(index_name, index_version).shards}

    def visible_watermarks(self, index_name: str, index_version: str) -> dict[int, int]:
        """Shard number -> the seq an eventual search reflects now: the served version's watermark, or as far
        as the young tier reaches past it (every write up to that seq, none after). InvalidNameError when a name
        is no legal name."""
        view = self.view(index_name, index_version)
        end = self.service._extend(view, 0).end
        return {s.shard_no: max(s.watermark, end) for s in view.shards}

    def refresh(self) -> None:
        """Load, now, any newer active version of the indexes served (every tenant's of the service)."""
        if self._closed:
            raise self._closed_error()
        self.service._usable()
        self.service.refresh()

    def close(self) -> None:
        """Stop following new versions (when this searcher made its service; the process's stays); every later
        search of this searcher raises ConfigurationError. A second close does nothing."""
        self._closed = True
        if self._owns_service:
            self.service.close()
