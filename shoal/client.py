"""The Python API: one `Shoal` per process and tenant, producers for uploading, readers of the log."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
from sqlalchemy.exc import OperationalError

from shoal.catalog.db import make_engine, migrate, resolve_database_url
from shoal.catalog.generations import Generations, JobRecord
from shoal.catalog.indexes import AliasCatalog, AliasRecord, IndexCatalog, IndexRecord, ShardCatalog
from shoal.catalog.repo import Catalog, SegmentRecord, SourceRecord, head_of, list_segments
from shoal.config.settings import Settings, mask_url
from shoal.errors import ConfigurationError, InvalidNameError, NotFoundError, ValidationError
from shoal.ingest.backpressure import Backpressure
from shoal.ingest.batch import SEQ, columns_to_table, points_to_table, segment_schema
from shoal.ingest.reader import fold, read_log
from shoal.ingest.writer import LogWriter
from shoal.records import GENERATION_MARK, DataPoint, DataSourceSpec, IndexSpec, Tombstone, WriteToken, check_name
from shoal.storage import Storage, source_log_dir

if TYPE_CHECKING:
    from shoal.ingest.compaction import CompactionResult
    from shoal.ingest.gc import GcResult
    from shoal.ingest.retention import RetentionResult
    from shoal.searcher.searcher import Searcher

_migrated: set[str] = set()
_migrate_lock = threading.Lock()


def ensure_migrated(url: str) -> None:
    """Migrate the catalog at `url` once per process (later calls return at once)."""
    with _migrate_lock:
        if url not in _migrated:
            migrate(url)
            _migrated.add(url)


log = logging.getLogger(__name__)


class Shoal:
    """Entry point: connects to the catalog (embedded unless configured), migrates it, opens storage."""

    def __init__(self, settings: Settings | None = None, *, tenant: str | None = None, notify: bool = True) -> None:
        self.settings = settings or Settings()
        self.notify = notify  # queue index materialization after each commit
        url = resolve_database_url(self.settings)
        self.engine = make_engine(url)
        try:
            ensure_migrated(url)
            self.catalog = Catalog(self.engine, tenant or self.settings.tenant)
        except OperationalError as exc:
            self.engine.dispose()
            reason = str(exc.orig or exc).strip().splitlines()[0]
            raise ConfigurationError(f"cannot reach the catalog at {mask_url(url)}: {reason}") from exc
        self.storage = Storage.from_settings(self.settings)
        self.indexes = IndexCatalog(self.engine, self.catalog.tenant_id, self.catalog.tenant)
        self.shards = ShardCatalog(self.engine)
        self.aliases = AliasCatalog(self.engine, self.catalog.tenant_id, self.catalog.tenant)
        self.generations = Generations(self.engine)
        self._writers: dict[int, LogWriter] = {}
        self._writers_lock = threading.Lock()
        self._redis: Any = None  # broker client and Celery producer, made on the first notification
        self._celery: Any = None
        self._shards_of: dict[int, tuple[float, list[int]]] = {}
        self.backpressure = Backpressure(
            self.shards, self.settings.max_index_lag_seqs, self.settings.backpressure_retry_after_s
        )

    @property
    def tenant(self) -> str:
        """The tenant every call of this instance is scoped to."""
        return self.catalog.tenant

    def broker_url(self) -> str:
        """The Redis URL of the broker: configured, or the embedded Valkey (started if needed)."""
        from shoal.config.celery_app import broker_url

        return broker_url(self.settings)

    # -- data sources -------------------------------------------------------------------------------

    def create_data_source(self, spec: DataSourceSpec, *, exist_ok: bool = False) -> SourceRecord:
        """Create a data source; AlreadyExistsError if it exists (unless `exist_ok` and identical)."""
        return self.catalog.create_data_source(spec, exist_ok=exist_ok)

    def get_data_source(self, name: str, version: str) -> SourceRecord:
        """The data source's definition and head; NotFoundError if absent."""
        return self.catalog.get_data_source(check_name("data source name", name),
                                            check_name("data source version", version))

    def list_data_sources(self) -> list[SourceRecord]:
        """All data sources of this tenant."""
        return self.catalog.list_data_sources()

    def drop_data_source(self, name: str, version: str) -> int:
        """Delete a data source, its catalog rows and then its log files; return how many files went."""
        record = self.get_data_source(name, version)
        paths = self.catalog.drop_data_source(name, version)
        with self._writers_lock:
            self._writers.pop(record.id, None)
        for path in paths:
            self.storage.delete_quietly(path)
        return len(paths)

    # -- writing ----------------------------------------------------------------------------------

    def producer(self, name: str, version: str) -> Producer:
        """A producer for one data source; producers of one Shoal share group commits across threads."""
        record = self.get_data_source(name, version)
        with self._writers_lock:
            writer = self._writers.get(record.id)
            if writer is None:
                writer = LogWriter(
                    self.engine,
                    self.storage,
                    record,
                    group_max_points=self.settings.group_commit_max_points,
                    retries=self.settings.commit_retries,
                    lock_timeout_ms=self.settings.lock_timeout_ms,
                )
                writer.after_commit = self._after_commit
                self._writers[record.id] = writer
        return Producer(record, writer, self.settings.max_batch_points)

    def message_token(self, name: str, version: str, message_id: str) -> WriteToken | None:
        """The write token of a published message once a consumer committed it (None before): publishers
        get no token back, so this is how they learn a message is durable."""
        from sqlalchemy import select
        from sqlalchemy.orm import Session

        from shoal.catalog.models import ProducerBatch
        from shoal.intake.consumer import BATCH_ID_PREFIX

        record = self.get_data_source(name, version)
        with Session(self.engine) as s:
            seq = s.scalar(
                select(ProducerBatch.last_seq).where(
                    ProducerBatch.data_source_id == record.id, ProducerBatch.batch_id == BATCH_ID_PREFIX + message_id
                )
            )
        return None if seq is None else WriteToken(int(seq), name, version)

    def check_backpressure(self, name: str, version: str) -> None:
        """Raise BackpressureError (HTTP 429) when an index of the data source lags past
        SHOAL_MAX_INDEX_LAG_SEQS; the HTTP upload routes call this before writing."""
        record = self.get_data_source(name, version)
        self.backpressure.check(record.id, name)

    def _after_commit(self, source_id: int) -> None:
        if not self.notify:
            return
        cached = self._shards_of.get(source_id)
        # Index definitions change rarely; a short cache saves a catalog query per commit.
        if cached is None or time.monotonic() - cached[0] > 2.0:
            cached = (time.monotonic(), self.shards.shards_of_source(source_id))
            self._shards_of[source_id] = cached
        if not cached[1]:
            return
        from shoal.workers.triggers import notify_indexers, producer_app

        if self._redis is None:
            import redis

            broker = self.broker_url()
            self._celery = producer_app(broker)
            self._redis = redis.Redis.from_url(broker, socket_connect_timeout=2, socket_timeout=2)
        notify_indexers(self._redis, self._celery, cached[1], self.settings.pending_ttl_s)

    # -- indexes ----------------------------------------------------------------------------------

    def create_index(self, spec: IndexSpec, *, exist_ok: bool = False) -> IndexRecord:
        """Create an index over an existing data source, checked by Vektonn's rules; its shards start empty
        and the workers build them (the sweep or the next commit queues the work)."""
        from shoal.indexing.spec import resolve_index

        if GENERATION_MARK in spec.version:
            raise InvalidNameError(f"index version {spec.version!r}: '~' is reserved for reindex generations")
        source = self.get_data_source(spec.source_name, spec.source_version)
        resolved = resolve_index(spec, source.spec)
        record = self.indexes.create_index(resolved, source, exist_ok=exist_ok)
        self._shards_of.pop(source.id, None)
        if self.notify and source.head_seq > 0:
            self._after_commit(source.id)
        return record

    def get_index(self, name: str, version: str) -> IndexRecord:
        """The index definition and its shards; NotFoundError if absent."""
        return self.indexes.get_index(check_name("index name", name), check_name("index version", version))

    def list_indexes(self) -> list[IndexRecord]:
        """All indexes of this tenant."""
        return self.indexes.list_indexes()

    def drop_index(self, name: str, version: str) -> int:
        """Delete an index with all its versions, then its files; return how many files went."""
        from shoal.artifacts.segment import manifest_files

        paths = manifest_files(self.indexes.drop_index(name, version))
        for path in paths:
            self.storage.delete_quietly(path)
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
        from shoal.workers.reindex import run_reindex, start_reindex

        job = start_reindex(self.catalog, self.indexes, name, version, algorithm=algorithm, metric=metric,
                            params=params, gate=gate, ann_gate=self.settings.reindex_recall_gate)
        if wait:
            run_reindex(self.engine, self.storage, job.id, on_swap=self._announce_index)
        else:
            from shoal.workers.triggers import QUEUE, producer_app

            try:
                producer_app(self.broker_url()).send_task("shoal.workers.tasks.reindex", args=[job.id], queue=QUEUE)
            except Exception as exc:  # noqa: BLE001 - the job is recorded; beat's sweep_generations queues it
                log.warning("could not queue reindex job %s now (%s); the next sweep will", job.id, exc)
        return self.generations.job(job.id)

    def reindex_jobs(self, name: str, version: str) -> list[JobRecord]:
        """The index's reindex jobs, newest first: state, progress (0..1), ETA, recall, gate, error."""
        self.get_index(name, version)
        return self.generations.jobs(self.catalog.tenant_id, name, version)

    def cancel_reindex(self, name: str, version: str) -> JobRecord:
        """Cancel the running reindex: the old generation keeps serving, the new one and its files go."""
        from shoal.workers.reindex import drop_generation

        job = self.generations.running(self.catalog.tenant_id, name, version)
        if job is None:
            raise NotFoundError(f"index {name!r} version {version!r} has no reindex running")
        if self.generations.finish(job.id, "cancelled", error="cancelled"):
            drop_generation(self.engine, self.storage, job.to_index_id)
        return self.generations.job(job.id)

    def rollback(self, name: str, version: str) -> None:
        """Serve again the generation the last reindex replaced (while it is kept), atomically."""
        self.generations.rollback(self.catalog.tenant_id, name, version)
        self._announce_index(self.get_index(name, version))

    def _announce_index(self, index: IndexRecord) -> None:
        from shoal.searcher.searcher import announce_index

        announce_index(self.broker_url(), index)

    # -- time travel --------------------------------------------------------------------------------

    def tag_index(self, name: str, version: str, tag: str) -> dict[int, int | None]:
        """Pin the versions the index's shards serve now under `tag`: version pruning keeps them and
        `searcher.search(..., tag=tag)` queries them. Returns shard id -> version id."""
        from shoal.catalog import history

        return history.tag(self.engine, self.get_index(name, version).id, tag)

    def index_tags(self, name: str, version: str) -> dict[str, dict[int, int | None]]:
        """The index's tags: tag -> shard id -> pinned version id."""
        from shoal.catalog import history

        return history.tags(self.engine, self.get_index(name, version).id)

    def untag_index(self, name: str, version: str, tag: str) -> None:
        """Remove a tag; its versions become prunable like any other."""
        from shoal.catalog import history

        history.untag(self.engine, self.get_index(name, version).id, tag)

    def set_alias(self, alias: str, index_name: str, index_version: str) -> AliasRecord:
        """Point `alias` at an index, creating it or moving it atomically (searches see one index or the other)."""
        return self.aliases.set(alias, index_name, index_version)

    def get_alias(self, alias: str) -> AliasRecord:
        """The index an alias names; NotFoundError if there is no such alias."""
        return self.aliases.get(alias)

    def list_aliases(self) -> list[AliasRecord]:
        """Every alias of the tenant."""
        return self.aliases.list()

    def drop_alias(self, alias: str) -> None:
        """Remove an alias (its index stays)."""
        self.aliases.drop(alias)

    def index_status(self, name: str, version: str) -> list[ShardStatus]:
        """Freshness per shard: log head, built and served watermarks, lag in seqs and seconds.

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
                    segments=len(active.manifest["segments"]) if active else 0,
                    version_id=shard.active_version_id,
                )
            )
        return out

    def searcher(self, *, follow: bool = True, poll_interval: float = 1.0) -> Searcher:
        """A searcher over this tenant's indexes (follows new versions unless `follow` is False)."""
        from shoal.searcher.searcher import Searcher

        return Searcher(self, follow=follow, poll_interval=poll_interval)

    # -- reading ----------------------------------------------------------------------------------

    def log_segments(self, name: str, version: str) -> list[SegmentRecord]:
        """The committed segments of a data source, in seq order."""
        return self.catalog.segments(self.get_data_source(name, version).id)

    def read_log(
        self, name: str, version: str, after_seq: int = 0, up_to_seq: int | None = None
    ) -> Iterator[pa.RecordBatch]:
        """Log entries with seq in (after_seq, up_to_seq], in order, as Arrow record batches."""
        return read_log(self.engine, self.storage, self.get_data_source(name, version).id, after_seq, up_to_seq)

    def fold(self, name: str, version: str, up_to_seq: int | None = None) -> pa.Table:
        """The data source's state at `up_to_seq` (default: head): the live data point per key."""
        record = self.get_data_source(name, version)
        schema = segment_schema(record.spec).append(pa.field(SEQ, pa.int64()))
        return fold(read_log(self.engine, self.storage, record.id, 0, up_to_seq), schema)

    def log_dir(self, name: str, version: str) -> str:
        """The data source's log folder, relative to the storage root."""
        return source_log_dir(self.tenant, name, version)

    # -- the log's upkeep --------------------------------------------------------------------------

    def compact(self, name: str, version: str, *, now: dt.datetime | None = None) -> CompactionResult:
        """Compact the data source's log now (below the lowest watermark of its indexes): keep the latest
        entry per key at its seq, drop tombstones older than SHOAL_TOMBSTONE_RETENTION_S, merge small
        segments toward SHOAL_COMPACTION_TARGET_BYTES. Returns segments before/after and entries dropped;
        the replaced files are deleted by GC after SHOAL_GC_GRACE_S. `now` stands in for the clock."""
        from shoal.ingest.compaction import CompactionPolicy, compact_log

        record = self.get_data_source(name, version)
        return compact_log(
            self.engine, self.storage, record.id, CompactionPolicy.from_settings(self.settings), now=now
        )

    def apply_retention(self, name: str, version: str, *, now: dt.datetime | None = None) -> RetentionResult:
        """Expire the data source's points older than its `retention_days` (custom metadata) by appending
        tombstones; nothing when it has no retention. `now` stands in for the clock."""
        from shoal.ingest.retention import apply_retention

        record = self.get_data_source(name, version)
        result = apply_retention(
            self.engine, self.storage, record, now=now, max_batch_points=self.settings.max_batch_points,
            lock_timeout_ms=self.settings.lock_timeout_ms, commit_retries=self.settings.commit_retries,
        )
        if result.expired:
            self._after_commit(record.id)
        return result

    def collect_garbage(self, *, now: dt.datetime | None = None, scan: bool = True) -> GcResult:
        """Delete this tenant's files no catalog row references once SHOAL_GC_GRACE_S passed (with `scan`,
        also look for unreferenced files in its log folders); every deletion is logged."""
        from shoal.ingest.gc import collect_garbage

        return collect_garbage(
            self.engine, self.storage, grace_s=self.settings.gc_grace_s, now=now, tenant=self.tenant,
            lock_timeout_ms=self.settings.lock_timeout_ms, scan=scan,
        )

    def close(self) -> None:
        """Release the catalog connections."""
        self.engine.dispose()

    def __enter__(self) -> Shoal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


class Producer:
    """Uploads batches to one data source. Thread-safe; concurrent uploads share commits."""

    def __init__(self, source: SourceRecord, writer: LogWriter, max_batch_points: int) -> None:
        self.source = source
        self._writer = writer
        self._max = max_batch_points

    @property
    def spec(self) -> DataSourceSpec:
        """The data source's definition batches are validated against."""
        return self.source.spec

    def _token(self, seq: int) -> WriteToken:
        return WriteToken(seq, self.source.spec.name, self.source.spec.version)

    def upload(self, items: Sequence[DataPoint | Tombstone], *, batch_id: str | None = None) -> WriteToken:
        """Append a batch of data points and tombstones, all or nothing.

        Returns once the batch is durable and committed; its token is the seq of its last entry. A batch
        id that already committed returns the original token and writes nothing.
        """
        table = points_to_table(self.spec, items, self._max)
        return self._token(self._writer.submit(table, _batch_id(batch_id)))

    def upload_columns(
        self,
        vectors: np.ndarray,
        attributes: Mapping[str, Sequence[Any] | np.ndarray | pa.Array],
        *,
        batch_id: str | None = None,
    ) -> WriteToken:
        """Append a columnar batch of upserts: `vectors` [n, dim] and one column per attribute."""
        table = columns_to_table(self.spec, vectors, attributes, self._max)
        return self._token(self._writer.submit(table, _batch_id(batch_id)))

    def append_tables(self, batches: Sequence[tuple[pa.Table, str | None]]) -> list[WriteToken]:
        """Append batches already validated against this source (by `shoal.ingest.batch` or the intake codec),
        each all or nothing under its own batch id, sharing commits; their tokens, in order. A batch id that
        already committed returns its original token and writes nothing."""
        checked = [(table, _batch_id(batch_id)) for table, batch_id in batches]
        return [self._token(seq) for seq in self._writer.submit_many(checked)]

    def delete(
        self, keys: Mapping[str, Sequence[Any] | np.ndarray | pa.Array], *, batch_id: str | None = None
    ) -> WriteToken:
        """Append tombstones for the keys given as one column per permanent attribute."""
        table = columns_to_table(self.spec, None, keys, self._max, delete=True)
        return self._token(self._writer.submit(table, _batch_id(batch_id)))


def _batch_id(batch_id: str | None) -> str | None:
    if batch_id is None:
        return None
    if not isinstance(batch_id, str) or not 1 <= len(batch_id) <= 200:
        raise ValidationError("batch id must be a string of 1 to 200 characters")
    return batch_id
