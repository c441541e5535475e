"""Deleting datasets: soft (into the tenant's trash, restorable until `purge_after`) or hard (at once), and the
trash itself: list, restore, purge. The trash's rows and purge protocol are `shoal.upkeep.trash`'s."""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from sqlalchemy.orm import Session

from shoal.catalog.models import DataSource
from shoal.datasets import rules
from shoal.datasets.catalog import DatasetRecord, LogTotals, TrashedDataset
from shoal.datasets.errors import DatasetError, ErrorCode, not_found
from shoal.datasets.files import forget_files, move_mirror_to_trash, trash_mirror_path
from shoal.datasets.results import Dataset, Deletion, Page, Purge, TrashEntry
from shoal.datasets.scope import DatasetScope
from shoal.errors import AlreadyExistsError, NotFoundError
from shoal.storage.layout import trash_dir

log = logging.getLogger(__name__)


class Deletions(DatasetScope):
    """Delete datasets; list, restore and purge the tenant's trash."""

    def delete(self, name: Any, *, hard: bool = False) -> Deletion:
        """Soft delete: move the dataset to the tenant's trash, restorable until `purge_after`, then purged by
        beat. With `hard`: delete at once the index, the data source, their files and the metadata mirror.
        DATASET_NOT_FOUND, changing nothing, if the dataset read first left meanwhile (another delete, or an
        overwrite create, took it first)."""
        name = self._lookup_name(name)
        record = self.catalog.get(name)
        self._forget(name)
        try:
            if hard:
                files = self._drop(record)
                log.info("dataset %s (#%d) of tenant %s deleted at once (hard): %d files",
                         name, record.source_id, self.tenant, files)
                return Deletion(name, soft=False, files_deleted=files, trash_id=None, purge_after=None,
                                deleted_at=dt.datetime.now(dt.UTC))
            retention = dt.timedelta(days=self.shoal.settings.trash_retention_days)
            shards = self.shoal.runtime.shards.shards_of_source(record.source_id)
            try:
                # The source read above, by id: one a hard delete or an overwrite create dropped meanwhile is
                # not found, and a dataset made anew under the name since is not this request's to move.
                trashed = self._trash().soft_delete(name, rules.VERSION, retention, source_id=record.source_id)
            except NotFoundError:
                raise not_found(name) from None
            self.shoal.announce_source_gone(record.source_id, shards)
            log.info("dataset %s (#%d) of tenant %s moved to the trash; purge after %s",
                     name, trashed.id, self.tenant, trashed.purge_after.isoformat())
            self.shoal.runtime.forget_source(record.source_id)  # uploads of this process see it gone at once
            move_mirror_to_trash(self.shoal.engine, self.shoal.storage, self.tenant, record, trashed.id,
                                 trashed.deleted_at, trashed.purge_after)
            self._refresh_searcher()
        finally:
            self._forget(name)
        return Deletion(name, soft=True, files_deleted=0, trash_id=trashed.id, purge_after=trashed.purge_after,
                        deleted_at=trashed.deleted_at)

    def _trashed_one(self, name: str, trash_id: int | None) -> TrashedDataset:
        candidates = self.catalog.trashed(name)
        if trash_id is not None:
            candidates = [c for c in candidates if c.record.source_id == trash_id]
        if not candidates:
            which = f" with trash_id {trash_id}" if trash_id is not None else ""
            raise DatasetError(ErrorCode.DATASET_NOT_FOUND, f"dataset {name!r}{which} not found in the trash",
                               {"dataset_id": name, "trash_id": trash_id})
        return candidates[0]

    def trash(self, limit: int = 100, offset: int = 0) -> Page[TrashEntry]:
        """A page of the tenant's datasets in the trash, most recently deleted first."""
        self._check_page(limit, offset)
        items, total = self.catalog.trash_page(limit, offset)
        totals = self.catalog.log_totals([t.record.source_id for t in items])
        entries = tuple(
            TrashEntry(self._dataset(t.record, totals.get(t.record.source_id, LogTotals()), live=False),
                       t.record.source_id, t.deleted_at, t.purge_after)
            for t in items
        )
        return Page(entries, total, limit, offset)

    def restore(self, name: Any, trash_id: int | None = None) -> Dataset:
        """Take a dataset out of the trash (the most recently deleted of that name unless `trash_id` picks one):
        DATASET_ALREADY_EXISTS if a dataset took its name meanwhile, DATASET_NOT_FOUND once purged."""
        name = self._lookup_name(name)
        chosen = self._trashed_one(name, trash_id)
        source_id = chosen.record.source_id
        self._forget(name)
        try:
            try:
                self._trash().restore(source_id)
            except NotFoundError as exc:
                raise DatasetError(ErrorCode.DATASET_NOT_FOUND, str(exc),
                                   {"dataset_id": name, "trash_id": source_id}) from None
            except AlreadyExistsError as exc:
                raise DatasetError(ErrorCode.DATASET_ALREADY_EXISTS, f"{exc}; delete that one first",
                                   {"dataset_id": name, "trash_id": source_id, "conflict": "dataset",
                                    "action": "delete the dataset that took the name first, then restore"}) from None
            log.info("dataset %s (#%d) of tenant %s restored from the trash", name, source_id, self.tenant)
            # From here on the restore has committed: no step below may tell the client it failed (its retry
            # would find the trash empty), so each one logs what it could not do instead of raising.
            record = self.catalog.get(name)
            try:
                self._write_mirror(record)
            except Exception as exc:  # noqa: BLE001 - the catalog is the source of truth
                log.warning("could not rewrite the metadata mirror of restored dataset %s: %s", name, exc)
            try:
                # The trash folder is the source's alone (keyed by its id).
                forget_files(self.shoal.engine, self.shoal.storage, folder=trash_dir(self.tenant, source_id),
                             files=[trash_mirror_path(self.tenant, source_id)])
            except Exception as exc:  # noqa: BLE001 - what is not given up now, GC's scan of trash folders finds
                log.warning("could not give up the trash folder of restored dataset %s (#%d): %s",
                            name, source_id, exc)
            self._refresh_searcher()
        finally:
            self._forget(name)
        return self._restored(record)

    def _restored(self, record: DatasetRecord) -> Dataset:
        """The dataset a restore answers, as `get` shows it; when its log cannot be read (the storage is away,
        or its files are), with the catalog's vector count instead of the live one, never an error: the restore
        has committed."""
        record = self._current([record])[0]
        totals = self.catalog.log_totals([record.source_id]).get(record.source_id, LogTotals())
        try:
            return self._dataset(record, totals)
        except Exception as exc:  # noqa: BLE001 - the answer must not say a committed restore failed
            log.warning("restored dataset %s (#%d) answered with the catalog's vector count: its log cannot be "
                        "read: %s", record.name, record.source_id, exc)
            # The catalog's estimate (upserts minus tombstones, as the trash listing shows): exact unless some id
            # was written more than once or deleted; `get` counts exactly once the log can be read again.
            return self._dataset(record, totals, live=False)

    def purge(self, name: Any, trash_id: int | None = None) -> Purge:
        """Delete for good, now, a dataset in the trash (the most recently deleted of that name unless
        `trash_id` picks one): its rows, then its files. DATASET_NOT_FOUND if it left the trash meanwhile (a
        restore committed first); ConflictError (retry), the dataset left in the trash as it was, restorable, if
        another transaction held its row lock past the lock timeout."""
        name = self._lookup_name(name)
        chosen = self._trashed_one(name, trash_id)
        source_id = chosen.record.source_id
        try:
            result = self._trash().purge(self.shoal.storage, [source_id],
                                         redis_client=self.shoal.runtime.redis_if_any(),
                                         lock_timeout_ms=self.shoal.settings.lock_timeout_ms)
        except Exception as exc:
            if self._row_left(source_id):
                raise  # nothing committed (e.g. the trash folder could not be listed): the error is the answer
            # The rows went (this purge's commit, or a concurrent purge's); deleting the files failed after it.
            # They stay queued and the next purge run deletes them: the purge happened, so it answers success.
            log.warning("dataset %s (#%d) of tenant %s purged; its files stay queued for the next purge run: %s",
                        name, source_id, self.tenant, exc)
            return Purge(name, source_id, 0)
        purged = any(i == source_id for _, _, _, i in result.sources)
        # Restored, or purged by someone else, meanwhile: for one still in the trash `Trash.purge` raised
        # ConflictError instead (a client told "not found" would give up on a dataset the trash still lists).
        if not purged:
            raise DatasetError(ErrorCode.DATASET_NOT_FOUND, f"dataset {name!r} is no longer in the trash",
                               {"dataset_id": name, "trash_id": source_id})
        return Purge(name, source_id, result.files)

    def _row_left(self, source_id: int) -> bool:
        """Whether the data source `source_id` still has its row: in the trash, or restored meanwhile (a failed
        purge gives the retention back, so a restore may follow it at once). A purged source has none."""
        with Session(self.shoal.engine) as s:
            return s.get(DataSource, source_id) is not None
