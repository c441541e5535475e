"""The Python API: one `Shoal` per process and tenant, producers for uploading, readers of the log."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from sqlalchemy.exc import OperationalError

from shoal.catalog.db import make_engine, migrate, resolve_database_url
from shoal.catalog.repo import Catalog, SegmentRecord, SourceRecord
from shoal.config.settings import Settings, mask_url
from shoal.errors import ConfigurationError, ValidationError
from shoal.ingest.batch import SEQ, columns_to_table, points_to_table, segment_schema
from shoal.ingest.reader import fold, read_log
from shoal.ingest.writer import LogWriter
from shoal.records import DataPoint, DataSourceSpec, Tombstone, WriteToken, check_name
from shoal.storage import Storage, source_log_dir

_migrated: set[str] = set()
_migrate_lock = threading.Lock()


class Shoal:
    """Entry point: connects to the catalog (embedded unless configured), migrates it, opens storage."""

    def __init__(self, settings: Settings | None = None, *, tenant: str | None = None) -> None:
        self.settings = settings or Settings()
        url = resolve_database_url(self.settings)
        self.engine = make_engine(url)
        try:
            with _migrate_lock:
                if url not in _migrated:
                    migrate(url)
                    _migrated.add(url)
            self.catalog = Catalog(self.engine, tenant or self.settings.tenant)
        except OperationalError as exc:
            self.engine.dispose()
            reason = str(exc.orig or exc).strip().splitlines()[0]
            raise ConfigurationError(f"cannot reach the catalog at {mask_url(url)}: {reason}") from exc
        self.storage = Storage.from_settings(self.settings)
        self._writers: dict[int, LogWriter] = {}
        self._writers_lock = threading.Lock()

    @property
    def tenant(self) -> str:
        """The tenant every call of this instance is scoped to."""
        return self.catalog.tenant

    def broker_url(self) -> str:
        """The Redis URL of the broker: configured, or the embedded Valkey (started if needed)."""
        if self.settings.redis_url:
            return self.settings.redis_url
        from shoal.config.embedded import ensure_valkey

        return ensure_valkey(self.settings.data_dir)

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
                self._writers[record.id] = writer
        return Producer(record, writer, self.settings.max_batch_points)

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

    def close(self) -> None:
        """Release the catalog connections."""
        self.engine.dispose()

    def __enter__(self) -> Shoal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
