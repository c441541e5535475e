"""The searcher: serves kNN queries from the active index versions and follows new ones.

Views are immutable and swapped whole under a lock, so a query runs entirely against the view it started
with while a new version loads in the background. New versions are announced on a Redis channel; polling
the catalog is the fallback when a message is missed or Redis is down.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import redis

from shoal.artifacts.segment import SegmentCache
from shoal.catalog.indexes import IndexCatalog, IndexRecord, ShardCatalog
from shoal.catalog.repo import head_of
from shoal.client import Shoal
from shoal.errors import ValidationError
from shoal.ingest.reader import read_log
from shoal.searcher.consistency import Consistency
from shoal.searcher.execute import (
    Hits,
    Tail,
    build_tails,
    execute,
    prepare_queries,
    split_matcher,
)
from shoal.searcher.views import IndexView, load_shard

log = logging.getLogger(__name__)

VERSIONS_CHANNEL = "shoal:index-versions"


def announce_version(redis_url: str, shard_id: int, version_id: int) -> None:
    """Tell searchers a shard has a new active version (best effort: they also poll)."""
    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        try:
            client.publish(VERSIONS_CHANNEL, json.dumps({"shard": shard_id, "version": version_id}))
        finally:
            client.close()
    except redis.RedisError as exc:
        log.warning("could not announce version %s of shard %s: %s", version_id, shard_id, exc)


def announce_index(redis_url: str, index: IndexRecord) -> None:
    """Tell searchers an index changed whole (a reindex swap or rollback): they reload the shards they do not
    know, which is every shard of a new generation."""
    for shard in index.shards:
        announce_version(redis_url, shard.id, 0)


class Searcher:
    """Serves searches for one tenant. Thread-safe; loads versions lazily and follows new ones."""

    def __init__(self, shoal: Shoal, *, follow: bool = True, poll_interval: float = 1.0) -> None:
        self.shoal = shoal
        self.indexes = IndexCatalog(shoal.engine, shoal.catalog.tenant_id, shoal.tenant)
        self.shards = ShardCatalog(shoal.engine)
        self.cache = SegmentCache()
        self.poll_interval = poll_interval
        self._views: dict[tuple[str, str], IndexView] = {}
        # Per index: the log tail last read for a search stronger than eventual, and the shard versions it was
        # read against. Log segments are immutable: a later search reuses it and reads only newer segments.
        self._tails: dict[int, tuple[tuple[int | None, ...], int, pa.Table | None, dict[int, Tail]]] = {}
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        if follow:
            self._threads.append(threading.Thread(target=self._poll_loop, name="shoal-searcher-poll", daemon=True))
            self._threads.append(threading.Thread(target=self._listen_loop, name="shoal-searcher-listen", daemon=True))
            for t in self._threads:
                t.start()

    # -- serving ---------------------------------------------------------------------------------------

    def search(
        self,
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
    ) -> list[Hits]:
        """The k nearest data points for each query vector, nearest first, at the requested consistency.

        Time travel: `tag` searches the versions a tag pinned (as they were); `as_of` answers exactly as of
        that seq (a write token's), from the newest kept version at or below it plus the log up to it.
        `search_params` overrides the index's query-time parameters for this search only, without a rebuild:
        `ef_search` for HNSW, `nprobe` for IVF (unknown names and bad values raise ValidationError).
        """
        if type(k) is not int or k <= 0:  # the exact type first: True is an int but not a k
            raise ValidationError(f"k must be a positive integer, got {k!r}")
        if tag is not None or as_of is not None:
            return self._search_history(index_name, index_version, queries, k, split_filter, retrieve_vectors,
                                        consistency, tag, as_of, search_params)
        # Read without the lock: one dict lookup is atomic, and views are only ever replaced whole.
        view = self._views.get((index_name, index_version)) or self._load(index_name, index_version)
        if consistency is None or consistency.level == "eventual":
            required = 0
        elif consistency.level == "at_least":
            required = consistency.seq
        else:
            required = head_of(self.shoal.engine, view.source.id)[0]
        params = view.engine_class.check_search_params(search_params) if search_params else None
        if required <= view.min_watermark and not split_filter and (block := view.one_block) is not None:
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
        tails = self._tail(view, required) if required > view.min_watermark else {}
        return execute(view, q, k, matches, tails, retrieve_vectors, params)

    def _search_history(
        self, name: str, version: str, queries: Any, k: int, split_filter: Mapping[str, Any] | None,
        retrieve_vectors: bool, consistency: Consistency | None, tag: str | None, as_of: int | None,
        search_params: Mapping[str, int] | None,
    ) -> list[Hits]:
        from shoal.catalog import history

        if tag is not None and as_of is not None:
            raise ValidationError("give a tag or an as_of seq, not both")
        if consistency is not None and consistency.level != "eventual":
            raise ValidationError("a search of older versions (tag, as_of) takes no consistency level")
        if as_of is not None and (isinstance(as_of, bool) or not isinstance(as_of, int)):
            raise ValidationError(f"as_of must be a seq (an integer), got {as_of!r}")
        index = self.indexes.get_index(name, version)
        if tag is not None:
            versions = history.tagged_versions(self.shoal.engine, index.id, tag)
        else:
            assert as_of is not None
            head = head_of(self.shoal.engine, index.source_id)[0]
            if as_of > head:
                raise ValidationError(f"as_of seq {as_of} is past the log head {head}")
            versions = history.versions_as_of(self.shoal.engine, index.id, as_of)
        source = self.shoal.catalog.get_data_source(index.spec.source_name, index.spec.source_version)
        shards = tuple(
            load_shard(self.shoal.storage, self.cache, index, s.id, s.shard_no, versions.get(s.id))
            for s in index.shards
        )
        view = IndexView(index, source, shards)
        q = prepare_queries(source.spec, queries)
        params = view.engine_class.check_search_params(search_params)
        matches = split_matcher(index.spec, source.spec, split_filter)
        tails = {}
        if as_of is not None and as_of > view.min_watermark:
            batches = list(read_log(self.shoal.engine, self.shoal.storage, source.id, view.min_watermark, as_of))
            if batches:
                tails = build_tails(view, pa.Table.from_batches(batches))
        return execute(view, q, k, matches, tails, retrieve_vectors, params)

    def search_alias(self, alias: str, queries: Any, k: int, **options: Any) -> list[Hits]:
        """`search` on the index the alias names now: resolved once per call, so a search is answered wholly
        by the index before a move or wholly by the one after it."""
        target = self.shoal.aliases.get(alias)
        return self.search(target.index_name, target.index_version, queries, k, **options)

    def _tail(self, view: IndexView, required: int) -> dict[int, Tail]:
        """The log tail (served watermark, required] per shard; reuses and extends the last one read."""
        versions = tuple(s.version_id for s in view.shards)
        with self._lock:
            cached = self._tails.get(view.index.id)
        start, entries = view.min_watermark, None
        if cached is not None and cached[0] == versions:
            if cached[1] >= required:  # a tail reaching past `required` still reflects every write up to it
                return cached[3]
            start, entries = cached[1], cached[2]
        batches = list(read_log(self.shoal.engine, self.shoal.storage, view.source.id, start, required))
        if batches:
            new = pa.Table.from_batches(batches)
            entries = new if entries is None else pa.concat_tables([entries, new])
        tails = build_tails(view, entries) if entries is not None and entries.num_rows else {}
        with self._lock:
            self._tails[view.index.id] = (versions, required, entries, tails)
        return tails

    def view(self, index_name: str, index_version: str) -> IndexView:
        """The index as currently served, loading it on first use."""
        key = (index_name, index_version)
        with self._lock:
            view = self._views.get(key)
        if view is None:
            view = self._load(index_name, index_version)
        return view

    def served_watermarks(self, index_name: str, index_version: str) -> dict[int, int]:
        """Shard number -> the watermark this searcher serves."""
        return {s.shard_no: s.watermark for s in self.view(index_name, index_version).shards}

    def refresh(self) -> None:
        """Load, now, any newer active version of the indexes already served."""
        with self._lock:
            keys = list(self._views)
        for name, version in keys:
            try:
                self._load(name, version)
            except Exception as exc:  # noqa: BLE001 - keep serving the old view; retry on the next poll
                log.warning("could not refresh index %s/%s: %s", name, version, exc)
                with self._lock:
                    if not self._index_exists(name, version):
                        self._views.pop((name, version), None)

    def _index_exists(self, name: str, version: str) -> bool:
        try:
            self.indexes.get_index(name, version)
            return True
        except Exception:  # noqa: BLE001
            return False

    def _load(self, name: str, version: str) -> IndexView:
        # One loader at a time: two racing loads would do the same I/O twice.
        with self._load_lock:
            index = self.indexes.get_index(name, version)
            source = self.shoal.catalog.get_data_source(index.spec.source_name, index.spec.source_version)
            with self._lock:
                old = self._views.get((name, version))
            shards = []
            for shard in index.shards:
                current = next((s for s in old.shards if s.shard_id == shard.id), None) if old else None
                if current is not None and current.version_id == shard.active_version_id:
                    shards.append(current)
                    continue
                record = self.shards.version(shard.active_version_id) if shard.active_version_id else None
                shards.append(load_shard(self.shoal.storage, self.cache, index, shard.id, shard.shard_no, record))
            view = IndexView(index, source, tuple(shards))
            with self._lock:
                self._views[(name, version)] = view
        for s in view.shards:
            if s.version_id is not None and (old is None or all(o.version_id != s.version_id for o in old.shards)):
                self.shards.mark_served(s.shard_id, s.watermark)
        return view

    # -- following -----------------------------------------------------------------------------------

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            self.refresh()

    def _listen_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client = redis.Redis.from_url(self.shoal.broker_url(), socket_timeout=1.0)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(VERSIONS_CHANNEL)
                while not self._stop.is_set():
                    if pubsub.get_message(timeout=1.0):
                        self._wake.set()
                pubsub.close()
                client.close()
            except (redis.RedisError, OSError) as exc:
                log.debug("version announcements unavailable (%s); polling only", exc)
                self._stop.wait(self.poll_interval)

    def close(self) -> None:
        """Stop following new versions."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=5)
