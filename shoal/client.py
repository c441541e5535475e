"""The Python API: `Shoal`, a tenant's facade over the process's runtime; producers for uploading, readers of
the log."""

from __future__ import annotations

import datetime as dt
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from sqlalchemy import Engine

from shoal.catalog.indexes import AliasRecord, IndexRecord
from shoal.catalog.repo import SegmentRecord, SourceRecord, head_of, list_segments
from shoal.config.settings import Settings
from shoal.errors import ConfigurationError, InvalidNameError, NotFoundError, PermissionDeniedError, ValidationError
from shoal.index.generations import Generations, JobRecord
from shoal.index.manifest import segments_of
from shoal.intake.backpressure import Backpressure
from shoal.intake.producer import Producer
from shoal.log.commit import held_batches
from shoal.log.reader import fold, read_log
from shoal.log.records import (
    DATASET_KEY,
    GENERATION_MARK,
    DataSourceSpec,
    IndexSpec,
    WriteToken,
    check_name,
    is_datasets_index,
    refuse_dataset_key,
)
from shoal.log.validation import SEQ, segment_schema
from shoal.runtime import CLOSED, Runtime
from shoal.searcher.consistency import check_seq
from shoal.storage import Storage
from shoal.storage.layout import source_log_dir

if TYPE_CHECKING:
    from shoal.log.compaction import CompactionResult
    from shoal.log.retention import RetentionResult
    from shoal.searcher.searcher import Searcher, SearchService
    from shoal.upkeep.gc import GcResult

log = logging.getLogger(__name__)


class Shoal:
    """The Python API for one tenant: a thin facade over the process's `Runtime` (catalog pool, storage,
    broker clients), which it makes (and closes) itself unless one is passed in. Many Shoals of one runtime
    share its connections, so a scope per tenant costs no pool of its own. Once closed, every method refuses
    (ConfigurationError "this Shoal is closed"), as do its producers and searchers."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        tenant: str | None = None,
        notify: bool = True,
        runtime: Runtime | None = None,
    ) -> None:
        if settings is not None and not isinstance(settings, Settings):
            raise ConfigurationError(f"settings must be a shoal.config.settings.Settings, got "
                                     f"{type(settings).__name__}")
        if runtime is not None and not isinstance(runtime, Runtime):
            raise ConfigurationError(f"runtime must be a shoal.runtime.Runtime, got {type(runtime).__name__}")
        if runtime is not None and settings is not None and settings is not runtime.settings:
            raise ConfigurationError("pass settings or runtime, not both: a runtime has its own settings "
                                     "(Shoal(runtime=runtime) uses runtime.settings)")
        self._closed = False
        self._owns_runtime = runtime is None
        # The search services of the searchers `searcher()` made (threads, connections): closed with this Shoal,
        # or they would go on polling the catalog after it closed. Held strongly: a searcher used once and
        # dropped (`s.searcher().search(...)`) leaves its service running on its own threads.
        self._services: list[SearchService] = []
        self.runtime = runtime if runtime is not None else Runtime(settings, notify=notify)
        try:
            self.scope = self.runtime.scope(tenant or self.runtime.settings.tenant)
        except BaseException:
            if self._owns_runtime:
                self.runtime.close()
            raise
        self.catalog = self.scope.catalog
        self.indexes = self.scope.indexes
        self.aliases = self.scope.aliases
        self.shards = self.runtime.shards
        self.generations = Generations(self.engine)

    @property
    def settings(self) -> Settings:
        """The settings of the runtime this Shoal works on."""
        return self.runtime.settings

    @property
    def engine(self) -> Engine:
        """The catalog's connection pool (the runtime's, shared)."""
        return self.runtime.engine

    @property
    def storage(self) -> Storage:
        """Where the log and the index artifacts live (the runtime's)."""
        return self.runtime.storage

    @property
    def backpressure(self) -> Backpressure:
        """The runtime's backpressure check (index lag per data source, cached for a second)."""
        return self.runtime.backpressure

    @property
    def tenant(self) -> str:
        """The tenant every call of this instance is scoped to."""
        return self.scope.tenant

    def broker_url(self) -> str:
        """The Redis URL of the broker: configured, or the embedded Valkey (started if needed)."""
        return self.runtime.broker_url()

    # -- data sources -------------------------------------------------------------------------------

    def create_data_source(self, spec: DataSourceSpec, *, exist_ok: bool = False) -> SourceRecord:
        """Create a data source; AlreadyExistsError if it exists (unless `exist_ok` and identical). Its custom
        metadata may not hold `shoal.dataset`, the dataset API's own key (ValidationError)."""
        _check_spec("spec", spec, DataSourceSpec)
        refuse_dataset_key(spec.custom_metadata)
        return self.catalog.create_data_source(spec, exist_ok=exist_ok)

    def get_data_source(self, name: str, version: str) -> SourceRecord:
        """The data source's definition and head; NotFoundError if absent."""
        return self.catalog.get_data_source(check_name("data source name", name),
                                            check_name("data source version", version))

    def list_data_sources(self) -> list[SourceRecord]:
        """All data sources of this tenant."""
        return self.catalog.list_data_sources()

    def drop_data_source(self, name: str, version: str) -> int:
        """Delete a data source with its indexes, and queue their files for GC in the same transaction (see
        `shoal.upkeep.drops`: they go once SHOAL_GC_GRACE_S passed, so searchers still reading them finish);
        return how many files were queued."""
        from shoal.upkeep.drops import drop_data_source

        record = self.get_data_source(name, version)
        # A dataset goes only through its own delete (to the trash, or for good), which its caches and its folder's
        # mirror follow: dropped here, the dataset API would go on answering it from its caches, and a source
        # made later under the name would be searched as the dataset.
        if DATASET_KEY in record.spec.custom_metadata:
            raise PermissionDeniedError(
                f"data source {name!r} version {version!r} belongs to dataset {name!r}: delete the dataset "
                f"(DELETE /api/v1/datasets/{name}: to the trash, or with ?hard=true and an admin key)")
        shards = self.runtime.shards.shards_of_source(record.id)  # read before: the drop deletes their rows
        paths = drop_data_source(self.engine, record.id, delete_after=self._drop_grace_end())
        self.runtime.forget_source(record.id)
        self.announce_source_gone(record.id, shards)
        return len(paths)

    def announce_source_gone(self, source_id: int, shards: list[int]) -> None:
        """Tell searchers a data source was dropped or moved to the trash with the index shards `shards` (read
        before): they stop serving its indexes, and strong searches of a following searcher ask the catalog at
        once (the data source's index token changes) instead of trusting the head Redis still holds."""
        if not self.runtime.notify:
            return
        from shoal.searcher.announce import announce_versions

        announce_versions(self.broker_url(), [(shard, 0) for shard in shards], token_of=source_id)

    def _drop_grace_end(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self.settings.gc_grace_s)

    # -- writing ----------------------------------------------------------------------------------

    def producer(self, name: str, version: str, *, fresh: bool = True) -> Producer:
        """A producer for one data source; producers of one runtime share group commits across threads.

        `fresh=False` may reuse the definition this process read up to 2 s ago (shoal.runtime.SOURCE_TTL_S), as
        the upload routes do: a source dropped meanwhile is still refused by the commit, which re-reads it under
        its row lock."""
        if fresh:
            record = self.get_data_source(name, version)
        else:
            record = self.runtime.source(self.scope, check_name("data source name", name),
                                         check_name("data source version", version))
        return Producer(record, self.runtime.writer(record), self.settings.max_batch_points)

    def message_token(self, name: str, version: str, message_id: str) -> WriteToken | None:
        """The write token of a published message once a consumer committed it (None before): publishers
        get no token back, so this is how they learn a message is durable."""
        from shoal.intake.publisher import message_id_problem
        from shoal.intake.topology import BATCH_ID_PREFIX

        record = self.get_data_source(name, version)
        problem = message_id_problem(message_id)
        if problem is not None:  # the rule publishing applies: an id it refuses was never published
            raise ValidationError(f"message_id: {problem}")
        batch_id = BATCH_ID_PREFIX + message_id
        with self.engine.connect() as conn:
            held = held_batches(conn, record.id, [batch_id]).get(batch_id)
        return None if held is None else WriteToken(held.token, name, version)

    def check_backpressure(self, name: str, version: str) -> None:
        """Raise BackpressureError (HTTP 429) when an index of the data source lags past
        SHOAL_MAX_INDEX_LAG_SEQS; the HTTP upload routes call this before writing."""
        record = self.runtime.source(self.scope, check_name("data source name", name),
                                     check_name("data source version", version))
        self.backpressure.check(record.id, name)

    def _after_commit(self, source_id: int) -> None:
        self.runtime.after_commit(source_id)

    # -- indexes ----------------------------------------------------------------------------------

    def create_index(self, spec: IndexSpec, *, exist_ok: bool = False) -> IndexRecord:
        """Create an index over an existing data source, checked by Vektonn's rules; its shards start empty
        and the workers build them (the sweep or the next commit queues the work)."""
        from shoal.index.spec import resolve_index

        _check_spec("spec", spec, IndexSpec)
        if GENERATION_MARK in spec.version:
            raise InvalidNameError(f"index version {spec.version!r}: '~' is reserved for reindex generations")
        source = self.get_data_source(spec.source_name, spec.source_version)
        resolved = resolve_index(spec, source.spec)
        record = self.indexes.create_index(resolved, source, exist_ok=exist_ok)
        self.runtime.forget_shards(source.id)
        if source.head_seq > 0:
            self._after_commit(source.id)
        return record

    def get_index(self, name: str, version: str) -> IndexRecord:
        """The index definition and its shards; NotFoundError if absent."""
        return self.indexes.get_index(check_name("index name", name), check_name("index version", version))

    def list_indexes(self) -> list[IndexRecord]:
        """All indexes of this tenant."""
        return self.indexes.list_indexes()

    def drop_index(self, name: str, version: str) -> int:
        """Delete an index with all its versions and generations (a reindex building ends as cancelled), and
        queue their files for GC in the same transaction (they go once SHOAL_GC_GRACE_S passed, so searchers
        still reading them finish); return how many files were queued."""
        from shoal.upkeep.drops import drop_index

        index = self.get_index(name, version)
        spec = index.spec
        # A dataset's own index goes only with its dataset: without it the dataset would still list and take
        # uploads, yet every search, /stats and reindex of it answer "not found".
        if is_datasets_index(spec) and DATASET_KEY in self.get_data_source(
                spec.source_name, spec.source_version).spec.custom_metadata:
            raise PermissionDeniedError(
                f"index {name!r} version {version!r} belongs to dataset {spec.source_name!r}: delete the dataset "
                f"(DELETE /api/v1/datasets/{spec.source_name}: to the trash, or with ?hard=true and an admin key)")
        paths = drop_index(self.engine, index.id, delete_after=self._drop_grace_end(), generations=True)
        if self.runtime.notify:
            self._announce_index(index)  # searchers stop serving it now, not at their next poll
        return len(paths)

    # -- reindexing ---------------------------------------------------------------------------------

    def reindex(
        self,
        name: str,
        version: str,
        *,
        algorithm: str | None = None,
        metric: str | None = None,
        params: dict[str, Any] | None = None,
        gate: float | None = None,
        wait: bool = False,
    ) -> JobRecord:
        """Rebuild the index with a new algorithm, metric or params as a new generation built aside; once
        it reached the head and its recall@10 on a sample of stored vectors meets `gate` (default
        SHOAL_REINDEX_RECALL_GATE for ANN, 1.0 for flat), it is swapped in atomically. The old generation
        serves meanwhile and is kept for `rollback` for SHOAL_REINDEX_KEEP_S. `wait`: run the job in this
        process and return it ended; otherwise a worker runs it (`reindex_jobs` shows its progress)."""
        from shoal.index.reindex import run_reindex, start_reindex

        _check_index(name, version)
        if params is not None and not isinstance(params, Mapping):
            raise ValidationError(f"params must be a mapping of index parameter name to value, e.g. {{'M': 16}} "
                                  f"(got {type(params).__name__} {params!r:.100})")
        job = start_reindex(self.catalog, self.indexes, name, version, algorithm=algorithm, metric=metric,
                            params=params, gate=gate, ann_gate=self.settings.reindex_recall_gate)
        if wait:
            run_reindex(self.engine, self.storage, job.id, on_swap=self._announce_index)
        else:
            from shoal.workers.names import QUEUE, REINDEX
            from shoal.workers.triggers import producer_app

            try:
                producer_app(self.broker_url()).send_task(REINDEX, args=[job.id], queue=QUEUE)
            except Exception as exc:  # noqa: BLE001 - the job is recorded; beat's sweep_generations queues it
                log.warning("could not queue reindex job %s now (%s); the next sweep will", job.id, exc)
        return self.generations.job(job.id)

    def reindex_jobs(self, name: str, version: str) -> list[JobRecord]:
        """The index's reindex jobs, newest first: state, progress (0..1), ETA, recall, gate, error."""
        self.get_index(name, version)
        return self.generations.jobs(self.catalog.tenant_id, name, version)

    def cancel_reindex(self, name: str, version: str) -> JobRecord:
        """Cancel the running reindex: the old generation keeps serving, the new one and its files go."""
        from shoal.index.reindex import drop_generation

        _check_index(name, version)
        job = self.generations.running(self.catalog.tenant_id, name, version)
        if job is None:
            raise NotFoundError(f"index {name!r} version {version!r} has no reindex running")
        if self.generations.finish(job.id, "cancelled", error="cancelled"):
            drop_generation(self.engine, self.storage, job.to_index_id)
        return self.generations.job(job.id)

    def rollback(self, name: str, version: str) -> None:
        """Serve again the generation the last reindex replaced (while it is kept), atomically."""
        from shoal.index.reindex import refresh_dataset_mirror

        _check_index(name, version)
        self.generations.rollback(self.catalog.tenant_id, name, version)
        index = self.get_index(name, version)
        refresh_dataset_mirror(self.engine, self.storage, index.source_id)  # a dataset's mirror shows its index
        self._announce_index(index)

    def _announce_index(self, index: IndexRecord) -> None:
        from shoal.searcher.announce import announce_index

        announce_index(self.broker_url(), index)

    # -- time travel --------------------------------------------------------------------------------

    def tag_index(self, name: str, version: str, tag: str) -> dict[int, int | None]:
        """Pin the versions the index's shards serve now under `tag`: version pruning keeps them and
        `searcher.search(..., tag=tag)` queries them. Returns shard id -> version id."""
        from shoal.index import history

        return history.tag(self.engine, self.get_index(name, version).id, tag)

    def index_tags(self, name: str, version: str) -> dict[str, dict[int, int | None]]:
        """The index's tags: tag -> shard id -> pinned version id."""
        from shoal.index import history

        return history.tags(self.engine, self.get_index(name, version).id)

    def untag_index(self, name: str, version: str, tag: str) -> None:
        """Remove a tag; its versions become prunable like any other."""
        from shoal.index import history

        history.untag(self.engine, self.get_index(name, version).id, check_name("tag", tag))

    def set_alias(self, alias: str, index_name: str, index_version: str) -> AliasRecord:
        """Point `alias` at an index, creating it or moving it atomically (searches see one index or the other)."""
        _check_index(index_name, index_version)
        return self.aliases.set(check_name("alias", alias), index_name, index_version)

    def get_alias(self, alias: str) -> AliasRecord:
        """The index an alias names; NotFoundError if there is no such alias."""
        return self.aliases.get(check_name("alias", alias))

    def list_aliases(self) -> list[AliasRecord]:
        """Every alias of the tenant."""
        return self.aliases.list()

    def drop_alias(self, alias: str) -> None:
        """Remove an alias (its index stays)."""
        self.aliases.drop(check_name("alias", alias))

    def index_status(self, name: str, version: str) -> list[ShardStatus]:
        """Freshness per shard: log head, built and served watermarks, lag in seqs and seconds, and the young
        tier: the entries past the served watermark that following searchers search exactly.

        The served watermark is what a searcher last loaded (searchers report it when they swap a version in).
        """
        index = self.get_index(name, version)
        head, _ = head_of(self.engine, index.source_id)
        out = []
        now = dt.datetime.now(dt.UTC)
        for shard in index.shards:
            lag_seconds = 0.0
            if shard.served_watermark < head:
                first_unserved = list_segments(self.engine, index.source_id, shard.served_watermark, None)
                if first_unserved:
                    lag_seconds = max(0.0, (now - first_unserved[0].committed_at).total_seconds())
            active = self.shards.active_version(shard.id) if shard.active_version_id else None
            out.append(
                ShardStatus(
                    index=f"{index.spec.name}/{index.spec.version}",
                    shard=shard.shard_no,
                    head=head,
                    built_watermark=shard.built_watermark,
                    served_watermark=shard.served_watermark,
                    lag_seqs=head - shard.served_watermark,
                    built_lag_seqs=head - shard.built_watermark,
                    lag_seconds=lag_seconds,
                    segments=len(segments_of(active.manifest)) if active else 0,
                    version_id=shard.active_version_id,
                    young_tier_seqs=min(head - shard.served_watermark, self.settings.young_tier_max_seqs),
                    young_tier_age_s=lag_seconds if self.settings.young_tier_max_seqs > 0 else 0.0,
                )
            )
        return out

    def searcher(self, *, follow: bool = True, poll_interval: float | None = None) -> Searcher:
        """A searcher over this tenant's indexes, with a search service of its own (follows new versions
        unless `follow` is False; polls every `poll_interval` s, default SHOAL_SEARCHER_POLL_S). Its loaded
        segments count against the runtime's SHOAL_SEARCHER_CACHE_BYTES."""
        from shoal.searcher.searcher import Searcher, SearchService

        service = SearchService(self.runtime, follow=follow, poll_interval=poll_interval)
        self._services = [s for s in self._services if not s.closed]  # those closed by their searcher go
        self._services.append(service)
        return Searcher(service, self.scope, owns_service=True)

    # -- reading ----------------------------------------------------------------------------------

    def log_segments(self, name: str, version: str) -> list[SegmentRecord]:
        """The committed segments of a data source, in seq order."""
        return self.catalog.segments(self.get_data_source(name, version).id)

    def read_log(
        self, name: str, version: str, after_seq: int = 0, up_to_seq: int | None = None
    ) -> Iterator[pa.RecordBatch]:
        """Log entries with seq in (after_seq, up_to_seq], in order, as Arrow record batches. Seqs are integers
        in 0..2**63-1 (ValidationError otherwise).

        Once a compaction dropped entries below seq N (superseded ones, expired tombstones), the log there no
        longer holds every state it went through: a read ending below N (the state there is gone), or starting
        above 0 and below N (its entries would not take a reader's state at `after_seq` to a later one: the
        deletes among them may be gone), is refused with NotFoundError naming N. From 0, or from N or above,
        it reads as ever; checked again once the read's snapshot of the log is taken, so a compaction
        committing meanwhile never slips a thinned range in."""
        from shoal.log.compaction_swap import dropped_through

        after_seq = check_seq(after_seq, "after_seq")
        up_to_seq = None if up_to_seq is None else check_seq(up_to_seq, "up_to_seq")
        source_id = self.get_data_source(name, version).id

        def refuse_if_compacted() -> None:
            if up_to_seq is not None and up_to_seq <= after_seq:
                return  # an empty range reads nothing
            bound = dropped_through(self.engine, source_id)
            if after_seq >= bound:
                return
            if up_to_seq is not None and up_to_seq < bound:
                raise NotFoundError(
                    f"the log below seq {bound} was compacted: entries superseded up to there are gone, so the "
                    f"state at seq {up_to_seq} can no longer be read (read up to seq {bound} or above)"
                )
            if after_seq > 0:
                raise NotFoundError(
                    f"the log below seq {bound} was compacted: its entries between seq {after_seq} and {bound} "
                    f"were thinned (superseded ones and expired tombstones dropped), so they no longer take the "
                    f"state at seq {after_seq} to a later one; read from seq 0, or from seq {bound} or above"
                )

        refuse_if_compacted()

        def entries() -> Iterator[pa.RecordBatch]:
            batches = read_log(self.engine, self.storage, source_id, after_seq, up_to_seq)
            # The first batch comes after the reader took its one snapshot of the segments: a compaction that
            # committed before it shows in its bound now (bounds never go back).
            first = next(batches, None)
            refuse_if_compacted()
            if first is not None:
                yield first
                yield from batches

        return entries()

    def fold(self, name: str, version: str, up_to_seq: int | None = None) -> pa.Table:
        """The data source's state at `up_to_seq` (default: head; else an integer in 0..2**63-1): the live data
        point per key. A seq below what a compaction dropped is refused (NotFoundError naming the bound): the
        log there no longer shows the state it had (see `read_log`)."""
        up_to_seq = None if up_to_seq is None else check_seq(up_to_seq, "up_to_seq")
        record = self.get_data_source(name, version)
        schema = segment_schema(record.spec).append(pa.field(SEQ, pa.int64()))
        return fold(self.read_log(name, version, 0, up_to_seq), schema)

    def log_dir(self, name: str, version: str) -> str:
        """The data source's log folder, relative to the storage root."""
        return source_log_dir(self.tenant, name, version)

    # -- the log's upkeep --------------------------------------------------------------------------

    def compact(self, name: str, version: str, *, now: dt.datetime | None = None) -> CompactionResult:
        """Compact the data source's log now (below the lowest watermark of its indexes): keep the latest
        entry per key at its seq, drop tombstones older than SHOAL_TOMBSTONE_RETENTION_S, merge small
        segments toward SHOAL_COMPACTION_TARGET_BYTES. Returns segments before/after and entries dropped;
        the replaced files are deleted by GC after SHOAL_GC_GRACE_S. `now` stands in for the clock."""
        from shoal.log.compaction import CompactionPolicy, compact_log

        now = _check_now(now)
        record = self.get_data_source(name, version)
        return compact_log(
            self.engine, self.storage, record.id, CompactionPolicy.from_settings(self.settings), now=now
        )

    def apply_retention(self, name: str, version: str, *, now: dt.datetime | None = None) -> RetentionResult:
        """Expire the data source's points older than its `retention_days` (custom metadata) by appending
        tombstones; nothing when it has no retention. `now` stands in for the clock."""
        from shoal.log.retention import apply_retention

        now = _check_now(now)
        record = self.get_data_source(name, version)
        result = apply_retention(
            self.engine, self.storage, record, now=now, max_batch_points=self.settings.max_batch_points,
            lock_timeout_ms=self.settings.lock_timeout_ms, commit_retries=self.settings.commit_retries,
            announce_head=self.runtime.announce_head,
        )
        if result.expired:
            self._after_commit(record.id)
        return result

    def collect_garbage(self, *, now: dt.datetime | None = None, scan: bool = True) -> GcResult:
        """Delete this tenant's files no catalog row references once SHOAL_GC_GRACE_S passed (with `scan`,
        also look for unreferenced files in its log folders); every deletion is logged."""
        from shoal.upkeep.gc import collect_garbage

        return collect_garbage(
            self.engine, self.storage, grace_s=self.settings.gc_grace_s, now=_check_now(now), tenant=self.tenant,
            lock_timeout_ms=self.settings.lock_timeout_ms, scan=scan,
        )

    def close(self) -> None:
        """Stop the searchers `searcher()` made (their threads and connections), and release the catalog
        connections and broker clients when this Shoal made its own runtime. For good: every later call of this
        Shoal, its producers and its searchers raises ConfigurationError. A second close does nothing."""
        if self._closed:
            return
        self._closed = True
        for service in self._services:
            service.close()
        self._services.clear()
        if self._owns_runtime:
            self.runtime.close()

    def __enter__(self) -> Shoal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_spec(what: str, spec: object, kind: type) -> None:
    """Refuse (ValidationError naming `what`) a spec that is not a `kind`: a None or a dict would fail deep in
    the call with an AttributeError."""
    if not isinstance(spec, kind):
        raise ValidationError(f"{what} must be a {kind.__module__}.{kind.__name__}, got {type(spec).__name__} "
                              f"{spec!r:.100}")


def _refusing_when_closed(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method`, raising ConfigurationError once its Shoal was closed (a bool check: nothing else is paid)."""

    @functools.wraps(method)
    def checked(self: Shoal, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise ConfigurationError(f"{CLOSED}: {method.__name__}() is refused (make a new Shoal)")
        return method(self, *args, **kwargs)

    return checked


def _refuse_after_close(cls: type) -> None:
    """Wrap every public method of `cls` (not close, nor the properties) with `_refusing_when_closed`: a closed
    Shoal must not silently reopen the pool, the Redis client and searcher threads its close released, whichever
    method is called, including methods added later."""
    for name, member in list(vars(cls).items()):
        if name.startswith("_") or name == "close" or not callable(member):
            continue
        setattr(cls, name, _refusing_when_closed(member))


_refuse_after_close(Shoal)


def _check_index(name: str, version: str) -> None:
    """Refuse (InvalidNameError) an index name or version the catalog could not even look up (NUL, a lone
    surrogate, an int): as `get_index` does, before the calls that take them to the catalog without it."""
    check_name("index name", name)
    check_name("index version", version)


# The clock a `now` may stand in for: the upkeep adds and subtracts durations of up to MAX_DURATION_S (100
# years) to it, and datetime.min or max would overflow that (OverflowError) deep in the call.
_EARLIEST_NOW = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_LATEST_NOW = dt.datetime(9000, 1, 1, tzinfo=dt.UTC)


def _check_now(now: dt.datetime | None) -> dt.datetime | None:
    """`now` unchanged when it is None or a timezone-aware datetime from 1970 up to 9000, else ValidationError
    naming it (a naive one is ambiguous: the catalog's times are UTC)."""
    if now is None:
        return None
    if not isinstance(now, dt.datetime) or now.utcoffset() is None:
        raise ValidationError(f"now must be a timezone-aware datetime (e.g. datetime.now(UTC)), got {now!r:.100}")
    if not _EARLIEST_NOW <= now < _LATEST_NOW:
        raise ValidationError(f"now must lie between {_EARLIEST_NOW:%Y-%m-%d} and {_LATEST_NOW:%Y-%m-%d}, got {now}")
    return now


@dataclass(frozen=True)
class ShardStatus:
    """Freshness of one index shard (DESIGN.md invariant 8)."""

    index: str
    shard: int
    head: int
    built_watermark: int
    served_watermark: int
    lag_seqs: int  # head minus the served watermark: what searchers do not show yet
    lag_seconds: float  # how long the oldest entry searchers do not show has been committed
    built_lag_seqs: int  # head minus the built watermark: what the workers have not indexed yet
    segments: int
    version_id: int | None
    # Of the entries searchers do not serve from a built version, those following searchers search exactly
    # (at most SHOAL_YOUNG_TIER_MAX_SEQS), and how long the oldest of them has been committed.
    young_tier_seqs: int = 0
    young_tier_age_s: float = 0.0
