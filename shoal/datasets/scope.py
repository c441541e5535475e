"""What every dataset operation of one tenant shares: the handles, name lookups, the cache, and dropping a
dataset's objects. The operations themselves live by idea in `lifecycle`, `deletion`, `stats`, `uploads` and
`search`; `service.DatasetService` puts them together."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from typing import Any

from shoal.client import Shoal
from shoal.datasets import rules
from shoal.datasets.cache import DatasetCache
from shoal.datasets.catalog import DatasetCatalog, DatasetRecord, LogTotals
from shoal.datasets.errors import DatasetError, ErrorCode, invalid, not_found
from shoal.datasets.files import forget_files, write_mirror
from shoal.datasets.live import live_count
from shoal.datasets.results import Dataset
from shoal.errors import NotFoundError
from shoal.searcher.searcher import Searcher
from shoal.storage.layout import dataset_dir, dataset_metadata_path
from shoal.upkeep.trash import Trash

log = logging.getLogger(__name__)


class DatasetScope:
    """The datasets of the tenant `shoal` is scoped to. One instance per request is cheap (it holds references
    only); the cache is shared by the process."""

    def __init__(self, shoal: Shoal, searcher: Searcher, cache: DatasetCache | None = None) -> None:
        self.shoal = shoal
        self.searcher = searcher
        self.cache = cache
        self.catalog = DatasetCatalog(shoal)
        self.tenant = shoal.tenant
        self.tenant_id = shoal.catalog.tenant_id  # what cache keys and entries carry (a name may be reused)

    # -- lookups -----------------------------------------------------------------------------------------

    @staticmethod
    def _lookup_name(name: Any) -> str:
        """A name from a path or a request: malformed is INVALID_DATASET_NAME; a reserved one cannot exist, so
        it is DATASET_NOT_FOUND."""
        try:
            return rules.check_name(name)
        except DatasetError as exc:
            if exc.code is ErrorCode.RESERVED_DATASET_NAME:
                raise not_found(name) from None
            raise

    def record(self, name: Any) -> DatasetRecord:
        """The dataset's catalog entry, from the cache when there; DATASET_NOT_FOUND if absent. What it caches
        is never older than the last change's invalidation."""
        name = self._lookup_name(name)
        if self.cache is None:
            return self.catalog.get(name)
        cached = self.cache.get_info(self.tenant_id, name)
        if cached is not None:
            return cached
        # Read before the catalog: a change committed after the catalog read bumps it, and the entry read is
        # then not cached (it may be the old one), even by a reader that writes after the change's invalidation.
        generation = self.cache.info_generation(self.tenant_id, name)
        record = self.catalog.get(name)
        if generation is not None:
            self.cache.set_info(self.tenant_id, record, generation)
        return record

    def _forget(self, name: str) -> None:
        """Drop the cache's entries of the dataset (before and after a change, so no reader caches the old)."""
        if self.cache is not None:
            self.cache.invalidate(self.tenant_id, name)

    def _current(self, records: Sequence[DatasetRecord]) -> list[DatasetRecord]:
        """The entries with the index definition serving now (one catalog query). A cached entry may predate a
        reindex or rollback, which another process (a worker) swapped in without touching the cache: such an
        entry is dropped from the cache, so the next read caches the catalog's."""
        serving = self.catalog.serving([r.source_id for r in records])
        current = [r.serving(serving.get(r.source_id)) for r in records]
        for old, new in zip(records, current, strict=True):
            if new != old:
                self._forget(old.name)
        return current

    def storage_location(self, name: str) -> str:
        """The URI of the dataset's folder (`file://` on local storage, `s3://` on a bucket)."""
        scheme = "file://" if self.shoal.storage.local else "s3://"
        return f"{scheme}{self.shoal.storage.path(dataset_dir(self.tenant, name))}/"

    def _dataset(self, record: DatasetRecord, totals: LogTotals, *, live: bool = True) -> Dataset:
        """The dataset of a catalog entry; with `live`, its live vector count read from its log."""
        count = live_count(self.shoal.engine, self.shoal.storage, record.source_id, totals) if live else None
        return Dataset.of(record, totals, live=count, tenant_id=self.tenant,
                          storage_location=self.storage_location(record.name))

    def _datasets(self, records: Sequence[DatasetRecord]) -> list[Dataset]:
        """The datasets of catalog entries, with the index definition serving now, their log totals and live
        vector counts."""
        records = self._current(records)
        totals = self.catalog.log_totals([r.source_id for r in records])
        return [self._dataset(r, totals.get(r.source_id, LogTotals())) for r in records]

    def _trash(self) -> Trash:
        return Trash(self.shoal.engine, self.shoal.catalog.tenant_id, self.tenant)

    @staticmethod
    def _check_page(limit: Any, offset: Any) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise invalid("limit must be an integer in 1..1000", field="limit")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise invalid("offset must be a non-negative integer", field="offset")

    # -- changes -----------------------------------------------------------------------------------------

    def _write_mirror(self, record: DatasetRecord) -> None:
        write_mirror(self.shoal.storage, self.tenant, record)

    def _refresh_searcher(self) -> None:
        # Drop (or reload) views of indexes that went away, so a dataset recreated under the same name is
        # never served from the old one's view.
        try:
            self.searcher.refresh()
        except Exception as exc:  # noqa: BLE001 - the searcher's poll catches up
            log.warning("searcher refresh after a dataset change failed: %s", exc)

    def _drop(self, record: DatasetRecord) -> int:
        """Delete the dataset of `record` at once: its data source with every index over it (theirs only, by
        id) in one transaction under the source's row lock, then its mirror; files deleted. DATASET_NOT_FOUND,
        changing nothing, if that data source is no longer live (a delete moved it to the trash, or another
        request dropped or replaced the dataset, meanwhile): never half of it, and never another dataset that
        took the name since `record` was read."""
        from shoal.upkeep.drops import drop_data_source

        source_id = record.source_id
        shards = self.shoal.runtime.shards.shards_of_source(source_id)  # read before: the drop deletes their rows
        grace_end = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self.shoal.settings.gc_grace_s)
        try:
            # The lock waits for a soft delete in flight: it commits first (and this finds the source in the
            # trash) or finds no live row afterwards; so the trash never holds a source without its index.
            paths = drop_data_source(self.shoal.engine, source_id, delete_after=grace_end)
        except NotFoundError:
            raise not_found(record.name) from None
        self.shoal.runtime.forget_source(source_id)
        self.shoal.announce_source_gone(source_id, shards)
        forget_files(self.shoal.engine, self.shoal.storage, files=[dataset_metadata_path(self.tenant, record.name)])
        self._refresh_searcher()
        return len(paths) + 1

    def _drop_quietly(self, name: str, source_id: int) -> None:
        """Undo a failed create of dataset `name` as far as possible: drop the data source `source_id` it made,
        with its index, logging (not raising) what could not be undone. By id, never by name: another request
        may have replaced the dataset meanwhile, and what it made stays."""
        from shoal.upkeep.drops import drop_data_source

        grace_end = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self.shoal.settings.gc_grace_s)
        try:
            drop_data_source(self.shoal.engine, source_id, delete_after=grace_end)  # its index goes with it
        except NotFoundError:
            pass  # dropped already, by the request that replaced or deleted the dataset
        except Exception as exc:  # noqa: BLE001 - cleanup after a failed create
            log.warning("could not undo a failed create of dataset %s: %s", name, exc)
        self.shoal.runtime.forget_source(source_id)
        # GC's checked deletion keeps a mirror a live dataset of the name wrote again meanwhile.
        forget_files(self.shoal.engine, self.shoal.storage, files=[dataset_metadata_path(self.tenant, name)])
