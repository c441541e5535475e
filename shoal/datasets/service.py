"""The dataset service: create, list, read, update, delete, stats, upsert and search datasets of one tenant.

UI-free: takes and returns plain JSON-ready values and raises `DatasetError` with the API's codes. One instance
per request is cheap (it holds references only); the cache is shared by the process.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from shoal.catalog.repo import list_segments
from shoal.upkeep.trash import Trash, trash_dir
from shoal.client import Shoal
from shoal.datasets import rules
from shoal.datasets.cache import DatasetCache
from shoal.datasets.catalog import MARKER, DatasetCatalog, DatasetRecord, LogTotals, TrashedDataset, definition
from shoal.datasets.errors import DatasetError, ErrorCode, not_found
from shoal.datasets.merge import STRATEGIES, merge
from shoal.engines.metrics import higher_is_nearer
from shoal.errors import AlreadyExistsError, NotFoundError, ReindexConflictError, ValidationError
from shoal.index.spec import resolve_index
from shoal.log.validation import KEY, OP, UPSERT
from shoal.log.records import DataPoint, DataSourceSpec, IndexSpec
from shoal.searcher.consistency import Consistency
from shoal.searcher.execute import Hit
from shoal.searcher.searcher import Searcher

log = logging.getLogger(__name__)

MUTABLE_FIELDS = ("description", "metadata")
METADATA_SAMPLE = 100_000  # live vectors whose metadata keys /stats counts (the first ones in seq order)
TOP_METADATA_KEYS = 50


def _problems(exc: ValidationError) -> list[str]:
    return [str(p) for p in exc.problems]


def _invalid(message: str, **details: Any) -> DatasetError:
    return DatasetError(ErrorCode.VALIDATION_ERROR, message, details)


def consistency_of(level: str | None, min_write_token: int | None) -> Consistency:
    """`strong` if asked; else at least `min_write_token` when given; else `eventual`."""
    if level not in (None, "eventual", "strong"):
        raise _invalid(f"consistency must be eventual or strong, got {level!r}", field="consistency")
    if level == "strong":
        return Consistency.strong()
    if min_write_token is not None:
        if isinstance(min_write_token, bool) or not isinstance(min_write_token, int) or min_write_token < 0:
            raise _invalid("min_write_token must be a non-negative integer", field="min_write_token")
        return Consistency.at_least(min_write_token)
    return Consistency.eventual()


def _metadata_value(text: Any) -> Any:
    if not isinstance(text, str):
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text  # written by another client (e.g. the Vektonn routes) as plain text


def hit_json(hit: Hit) -> dict[str, Any]:
    """A search result: id, score (the metric's distance), content, metadata, document_id."""
    a = hit.attributes
    return {
        "id": a.get("id"),
        "score": float(hit.distance),
        "content": a.get("content") or None,
        "metadata": _metadata_value(a.get("metadata")),
        "document_id": a.get("document_id") or None,
    }


class DatasetService:
    """The datasets of the tenant `shoal` is scoped to."""

    def __init__(self, shoal: Shoal, searcher: Searcher, cache: DatasetCache | None = None) -> None:
        self.shoal = shoal
        self.searcher = searcher
        self.cache = cache
        self.catalog = DatasetCatalog(shoal)
        self.tenant = shoal.tenant

    # -- layout ------------------------------------------------------------------------------------------

    def mirror_path(self, name: str) -> str:
        """Layout-relative path of the dataset's `dataset_metadata.json`."""
        return f"tenants/{self.tenant}/datasets/{name}/dataset_metadata.json"

    def trash_mirror_path(self, source_id: int) -> str:
        """Layout-relative path of a trashed dataset's `dataset_metadata.json` (keyed by id: the name is free)."""
        return f"{trash_dir(self.tenant, source_id)}/dataset_metadata.json"

    def index_dir(self, name: str) -> str:
        """Layout-relative folder of the default index's artifacts."""
        return f"tenants/{self.tenant}/indexes/{name}/{rules.VERSION}"

    # -- lookups -----------------------------------------------------------------------------------------

    @staticmethod
    def _lookup_name(name: Any) -> str:
        """A name from a path or a request: malformed is INVALID_DATASET_NAME, reserved cannot exist (404)."""
        try:
            return rules.check_name(name)
        except DatasetError as exc:
            if exc.code is ErrorCode.RESERVED_DATASET_NAME:
                raise not_found(name) from None
            raise

    def record(self, name: Any) -> DatasetRecord:
        """The dataset's catalog entry, from the cache when there; DATASET_NOT_FOUND if absent."""
        name = self._lookup_name(name)
        if self.cache is not None:
            cached = self.cache.get_info(self.tenant, name)
            if cached is not None:
                return cached
        record = self.catalog.get(name)
        if self.cache is not None:
            self.cache.set_info(self.tenant, record)
        return record

    def _forget(self, name: str) -> None:
        if self.cache is not None:
            self.cache.invalidate(self.tenant, name)

    def _object(self, record: DatasetRecord, totals: LogTotals) -> dict[str, Any]:
        return {
            "id": record.name,
            "name": record.name,
            "description": record.description,
            "dimensions": record.dimensions,
            "metric_type": record.metric_type,
            "index_type": record.index_type,
            "metadata": record.metadata,
            "created_at": record.created_at.isoformat(timespec="microseconds"),
            "updated_at": record.updated_at.isoformat(timespec="microseconds"),
            "vector_count": totals.estimated_vector_count,
            "storage_size": totals.bytes,
        }

    def _objects(self, records: Sequence[DatasetRecord]) -> list[dict[str, Any]]:
        totals = self.catalog.log_totals([r.source_id for r in records])
        return [self._object(r, totals.get(r.source_id, LogTotals())) for r in records]

    # -- CRUD --------------------------------------------------------------------------------------------

    def create(
        self,
        name: Any,
        dimensions: Any,
        *,
        metric_type: Any = rules.DEFAULT_METRIC,
        index_type: Any = rules.DEFAULT_INDEX,
        description: Any = None,
        metadata: Any = None,
        index_params: Any = None,
        overwrite: bool = False,
    ) -> dict[str, Any]:
        """Create a dataset (with `overwrite`, first hard-delete a dataset of that name); its object."""
        name = rules.check_name(name)
        dimensions = rules.check_dimensions(dimensions)
        metric_type = rules.check_choice("metric_type", metric_type, rules.METRIC_TYPES)
        index_type = rules.check_choice("index_type", index_type, rules.INDEX_TYPES)
        description = rules.check_description(description)
        metadata = rules.check_metadata(metadata)
        if index_params is not None and not isinstance(index_params, dict):
            raise DatasetError(ErrorCode.INVALID_DATASET_CONFIG, "index_params must be null or a JSON object",
                               {"field": "index_params"})
        plain = DataSourceSpec(name, rules.VERSION, dimensions, rules.ATTRIBUTES, rules.PERMANENT)
        index_spec = IndexSpec(name, rules.VERSION, name, rules.VERSION, algorithm=index_type, metric=metric_type,
                               params=index_params or {}, id_attributes=rules.PERMANENT, shard_count=1)
        try:
            resolved = resolve_index(index_spec, plain)
        except ValidationError as exc:
            raise DatasetError(
                ErrorCode.INVALID_DATASET_CONFIG,
                f"index_type {index_type!r} with metric_type {metric_type!r} and these index_params is refused: "
                + "; ".join(_problems(exc)),
                {"problems": _problems(exc), "index_type": index_type, "metric_type": metric_type},
            ) from None
        params = dict(resolved.params)
        spec = DataSourceSpec(
            name, rules.VERSION, dimensions, rules.ATTRIBUTES, rules.PERMANENT, description=description or "",
            custom_metadata={MARKER: definition(description, metadata, metric_type, index_type, params)},
        )

        existing = self.catalog.find(name)
        if existing is not None:
            if not overwrite:
                raise DatasetError(ErrorCode.DATASET_ALREADY_EXISTS, f"dataset {name!r} already exists",
                                   {"dataset_id": name, "conflict": "dataset"})
            self._drop(existing)
        self._refuse_foreign(name)
        self._forget(name)
        try:
            self.shoal.create_data_source(spec)
        except AlreadyExistsError:
            raise self._exists(name) from None
        try:
            self.shoal.create_index(index_spec)
            record = self.catalog.get(name)
            self._write_mirror(record)
        except BaseException as exc:
            self._drop_quietly(name)
            if isinstance(exc, AlreadyExistsError):
                raise self._exists(name, "index") from None
            raise
        finally:
            self._forget(name)
        return self._object(record, LogTotals())

    def _exists(self, name: str, conflict: str = "dataset") -> DatasetError:
        return DatasetError(ErrorCode.DATASET_ALREADY_EXISTS, f"dataset {name!r} already exists",
                            {"dataset_id": name, "conflict": conflict})

    def _refuse_foreign(self, name: str) -> None:
        """A data source or index of the dataset's name that is not a dataset's blocks it (never overwritten)."""
        for kind, lookup in (("data_source", self.shoal.get_data_source), ("index", self.shoal.get_index)):
            try:
                lookup(name, rules.VERSION)
            except NotFoundError:
                continue
            raise DatasetError(
                ErrorCode.DATASET_ALREADY_EXISTS,
                f"a {kind.replace('_', ' ')} named {name!r} version {rules.VERSION!r} exists and is not a dataset",
                {"dataset_id": name, "conflict": kind},
            )

    def list(self, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        """A page of datasets by name: `{"datasets", "total", "limit", "offset"}`."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise _invalid("limit must be an integer in 1..1000", field="limit")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise _invalid("offset must be a non-negative integer", field="offset")
        page = self.cache.get_list(self.tenant, limit, offset) if self.cache is not None else None
        if page is None:
            page = self.catalog.page(limit, offset)
            if self.cache is not None:
                self.cache.set_list(self.tenant, limit, offset, *page)
        records, total = page
        return {"datasets": self._objects(records), "total": total, "limit": limit, "offset": offset}

    def get(self, name: Any) -> dict[str, Any]:
        """The dataset object."""
        return self._objects([self.record(name)])[0]

    def update(self, name: Any, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Change the description and/or metadata (a field left out stays, null clears it)."""
        name = self._lookup_name(name)
        self.catalog.get(name)  # 404 before any complaint about the body
        other = sorted(set(changes) - set(MUTABLE_FIELDS))
        if other:
            raise DatasetError(
                ErrorCode.INVALID_DATASET_CONFIG,
                f"only description and metadata may change; refused: {', '.join(other)}",
                {"fields": other, "mutable_fields": list(MUTABLE_FIELDS)},
            )
        clean: dict[str, Any] = {}
        if "description" in changes:
            clean["description"] = rules.check_description(changes["description"])
        if "metadata" in changes:
            clean["metadata"] = rules.check_metadata(changes["metadata"])
        if not clean:
            return self.get(name)
        self._forget(name)
        try:
            record = self.catalog.update(name, clean)
            self._write_mirror(record)
        finally:
            self._forget(name)
        return self._objects([record])[0]

    def delete(self, name: Any, *, hard: bool = False) -> dict[str, Any]:
        """Soft delete: move the dataset to the tenant's trash, restorable until `purge_after`, then purged by
        beat. With `hard`: delete at once the index, the data source, their files and the metadata mirror."""
        name = self._lookup_name(name)
        record = self.catalog.get(name)
        self._forget(name)
        try:
            if hard:
                files = self._drop(record)
                log.info("dataset %s (#%d) of tenant %s deleted at once (hard): %d files",
                         name, record.source_id, self.tenant, files)
                return {"success": True, "dataset_id": name, "deleted": True, "soft": False, "files_deleted": files,
                        "trash_id": None, "purge_after": None}
            retention = dt.timedelta(days=self.shoal.settings.trash_retention_days)
            try:
                trashed = self._trash().soft_delete(name, rules.VERSION, retention)
            except NotFoundError:
                raise not_found(name) from None
            log.info("dataset %s (#%d) of tenant %s moved to the trash; purge after %s",
                     name, trashed.id, self.tenant, trashed.purge_after.isoformat())
            self.shoal.runtime.forget_source(record.source_id)  # uploads of this process see it gone at once
            self._move_mirror_to_trash(record, trashed.id, trashed.deleted_at, trashed.purge_after)
            self._refresh_searcher()
        finally:
            self._forget(name)
        return {"success": True, "dataset_id": name, "deleted": True, "soft": True, "files_deleted": 0,
                "trash_id": trashed.id, "purge_after": _iso(trashed.purge_after)}

    def _trash(self) -> Trash:
        return Trash(self.shoal.engine, self.shoal.catalog.tenant_id, self.tenant)

    def _move_mirror_to_trash(
        self, record: DatasetRecord, source_id: int, deleted_at: dt.datetime, purge_after: dt.datetime
    ) -> None:
        # The catalog is the source of truth and already says "in the trash": a failure here is logged, not raised.
        storage = self.shoal.storage
        try:
            doc = self._mirror_doc(record) | {"trash_id": source_id, "deleted_at": _iso(deleted_at),
                                              "purge_after": _iso(purge_after)}
            data = json.dumps(doc, indent=2, ensure_ascii=False).encode()
            storage.write_atomic(self.trash_mirror_path(source_id), pa.py_buffer(data))
        except Exception as exc:  # noqa: BLE001
            log.warning("could not write the trash copy of dataset %s's metadata mirror: %s", record.name, exc)
        storage.delete_quietly(self.mirror_path(record.name))

    def _remove_trash_dir(self, source_id: int) -> None:
        storage = self.shoal.storage
        try:  # the folder is the source's alone (keyed by its id)
            storage.fs.delete_dir(storage.path(trash_dir(self.tenant, source_id)))
        except OSError:
            storage.delete_quietly(self.trash_mirror_path(source_id))

    # -- trash -------------------------------------------------------------------------------------------

    def _trashed_one(self, name: str, trash_id: int | None) -> TrashedDataset:
        candidates = self.catalog.trashed(name)
        if trash_id is not None:
            candidates = [c for c in candidates if c.record.source_id == trash_id]
        if not candidates:
            which = f" with trash_id {trash_id}" if trash_id is not None else ""
            raise DatasetError(ErrorCode.DATASET_NOT_FOUND, f"dataset {name!r}{which} not found in the trash",
                               {"dataset_id": name, "trash_id": trash_id})
        return candidates[0]

    def _trash_object(self, t: TrashedDataset, totals: LogTotals) -> dict[str, Any]:
        return {**self._object(t.record, totals), "trash_id": t.record.source_id,
                "deleted_at": _iso(t.deleted_at), "purge_after": _iso(t.purge_after)}

    def trash(self, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        """A page of the tenant's datasets in the trash, most recently deleted first."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise _invalid("limit must be an integer in 1..1000", field="limit")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise _invalid("offset must be a non-negative integer", field="offset")
        items, total = self.catalog.trash_page(limit, offset)
        totals = self.catalog.log_totals([t.record.source_id for t in items])
        return {"datasets": [self._trash_object(t, totals.get(t.record.source_id, LogTotals())) for t in items],
                "total": total, "limit": limit, "offset": offset}

    def restore(self, name: Any, trash_id: int | None = None) -> dict[str, Any]:
        """Take a dataset out of the trash (the most recently deleted of that name unless `trash_id` picks one):
        DATASET_ALREADY_EXISTS (409) if a dataset took its name meanwhile, DATASET_NOT_FOUND once purged."""
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
                                   {"dataset_id": name, "trash_id": source_id, "conflict": "dataset"}) from None
            log.info("dataset %s (#%d) of tenant %s restored from the trash", name, source_id, self.tenant)
            record = self.catalog.get(name)
            try:
                self._write_mirror(record)
            except Exception as exc:  # noqa: BLE001 - the catalog is the source of truth
                log.warning("could not rewrite the metadata mirror of restored dataset %s: %s", name, exc)
            self._remove_trash_dir(source_id)
            self._refresh_searcher()
        finally:
            self._forget(name)
        return self._objects([record])[0]

    def purge(self, name: Any, trash_id: int | None = None) -> dict[str, Any]:
        """Delete for good, now, a dataset in the trash (the most recently deleted of that name unless
        `trash_id` picks one): its rows, then its files."""
        name = self._lookup_name(name)
        chosen = self._trashed_one(name, trash_id)
        result = self._trash().purge(self.shoal.storage, [chosen.record.source_id])
        purged = any(i == chosen.record.source_id for _, _, _, i in result.sources)
        if not purged:  # restored or purged by someone else meanwhile
            raise DatasetError(ErrorCode.DATASET_NOT_FOUND, f"dataset {name!r} is no longer in the trash",
                               {"dataset_id": name, "trash_id": chosen.record.source_id})
        return {"success": True, "dataset_id": name, "trash_id": chosen.record.source_id, "purged": True,
                "files_deleted": result.files}

    def _drop(self, record: DatasetRecord) -> int:
        name = record.name
        files = 0
        try:
            index = self.shoal.get_index(name, rules.VERSION)
            if index.source_id == record.source_id:
                files += self.shoal.drop_index(name, rules.VERSION)
        except NotFoundError:
            pass
        try:
            files += self.shoal.drop_data_source(name, rules.VERSION)
        except NotFoundError:
            pass
        self.shoal.storage.delete_quietly(self.mirror_path(name))
        self._refresh_searcher()
        return files + 1

    def _drop_quietly(self, name: str) -> None:
        for drop in (self.shoal.drop_index, self.shoal.drop_data_source):
            try:
                drop(name, rules.VERSION)
            except Exception as exc:  # noqa: BLE001 - cleanup after a failed create; report the first error
                log.warning("could not undo a failed create of dataset %s: %s", name, exc)
        self.shoal.storage.delete_quietly(self.mirror_path(name))

    def _refresh_searcher(self) -> None:
        # Drop (or reload) views of indexes that went away, so a dataset recreated under the same name is
        # never served from the old one's view.
        try:
            self.searcher.refresh()
        except Exception as exc:  # noqa: BLE001 - the searcher's poll catches up
            log.warning("searcher refresh after a dataset change failed: %s", exc)

    def _write_mirror(self, record: DatasetRecord) -> None:
        data = json.dumps(self._mirror_doc(record), indent=2, ensure_ascii=False).encode()
        self.shoal.storage.write_atomic(self.mirror_path(record.name), pa.py_buffer(data))

    def _mirror_doc(self, record: DatasetRecord) -> dict[str, Any]:
        return {
            "format": 1,
            "id": record.name,
            "name": record.name,
            "tenant": self.tenant,
            "description": record.description,
            "metadata": record.metadata,
            "dimensions": record.dimensions,
            "metric_type": record.metric_type,
            "index_type": record.index_type,
            "index_params": record.index_params,
            "created_at": record.created_at.isoformat(timespec="microseconds"),
            "updated_at": record.updated_at.isoformat(timespec="microseconds"),
            "data_source": {
                "name": record.name,
                "version": rules.VERSION,
                "attributes": {k: v.value for k, v in rules.ATTRIBUTES.items()},
                "permanent_attributes": list(rules.PERMANENT),
            },
            "index": {"name": record.name, "version": rules.VERSION, "algorithm": record.index_type,
                      "metric": record.metric_type, "shards": 1},
        }

    def reindex(
        self, name: Any, index_type: str | None = None, index_params: Mapping[str, Any] | None = None,
        *, wait: bool = False,
    ) -> dict[str, Any]:
        """Rebuild the dataset's index (optionally with another type or params) as a new generation swapped in
        once its recall meets the gate; `wait` runs it here, else a worker does. The job as JSON."""
        record = self.record(name)
        if index_type is not None and index_type not in rules.INDEX_TYPES:
            raise _invalid(f"index_type must be one of {', '.join(rules.INDEX_TYPES)}", index_type=index_type)
        try:
            job = self.shoal.reindex(record.name, rules.VERSION, algorithm=index_type,
                                     params=dict(index_params) if index_params is not None else None, wait=wait)
        except ValidationError as exc:
            raise _invalid(str(exc), problems=_problems(exc)[:100]) from None
        except ReindexConflictError as exc:
            raise DatasetError(ErrorCode.REINDEX_CONFLICT, str(exc), {"dataset_id": record.name}) from None
        return {"dataset_id": record.name, "job": job.id, "state": job.state, "progress": job.progress,
                "recall": job.recall, "gate": job.gate, "error": job.error, "definition": job.definition}

    # -- stats -------------------------------------------------------------------------------------------

    def stats(self, name: Any) -> dict[str, Any]:
        """Exact live vector count, storage bytes, metadata stats and per-shard freshness."""
        record = self.record(name)
        segments = list_segments(self.shoal.engine, record.source_id)
        live = self._live_state(segments)
        log_bytes = sum(s.bytes for s in segments)
        index_bytes, index_files = self._bytes_under(self.index_dir(record.name))
        mirror_bytes, _ = self._bytes_under(f"tenants/{self.tenant}/datasets/{record.name}")
        try:
            shards = [_shard_json(s) for s in self.shoal.index_status(record.name, rules.VERSION)]
        except NotFoundError:
            self._forget(record.name)
            raise not_found(record.name) from None
        return {
            "dataset_id": record.name,
            "vector_count": live.num_rows,
            "storage_size": log_bytes + index_bytes + mirror_bytes,
            "storage": {"log_bytes": log_bytes, "index_bytes": index_bytes, "index_files": index_files,
                        "metadata_bytes": mirror_bytes},
            "metadata_stats": self._metadata_stats(live, segments),
            "index_stats": {
                "index_type": record.index_type,
                "metric_type": record.metric_type,
                "index_params": record.index_params,
                "shards": shards,
            },
        }

    def _live_state(self, segments: Sequence[Any]) -> pa.Table:
        """The live vectors (last write per id, minus deletions), reading only the small columns of the log."""
        columns = [KEY, OP, "document_id", "content", "metadata"]
        tables = []
        storage = self.shoal.storage
        for seg in segments:
            tables.append(pq.read_table(storage.path(seg.path), columns=columns, filesystem=storage.fs))
        if not tables:
            return pa.table({c: pa.array([], pa.string()) for c in columns})
        table = pa.concat_tables(tables)  # rows in seq order: segments by seq, rows by seq offset
        table = table.append_column("__row", pa.array(np.arange(table.num_rows, dtype=np.int64)))
        last = table.group_by(KEY, use_threads=False).aggregate([("__row", "max")])["__row_max"]
        latest = table.take(pa.array(np.sort(last.to_numpy())))
        return latest.filter(pc.equal(latest[OP], UPSERT))

    def _metadata_stats(self, live: pa.Table, segments: Sequence[Any]) -> dict[str, Any]:
        doc_ids = [d for d in live["document_id"].to_pylist() if d]
        with_content = sum(1 for c in live["content"].to_pylist() if c)
        keys: Counter[str] = Counter()
        with_metadata = 0
        sample = live["metadata"].slice(0, METADATA_SAMPLE).to_pylist()
        for text in sample:
            value = _metadata_value(text)
            if isinstance(value, dict) and value:
                with_metadata += 1
                keys.update(value.keys())
        return {
            "log_entries": sum(s.upsert_count + s.tombstone_count for s in segments),  # compaction leaves gaps
            "log_segments": len(segments),
            "upserts": sum(s.upsert_count for s in segments),
            "tombstones": sum(s.tombstone_count for s in segments),
            "vectors_with_document_id": len(doc_ids),
            "distinct_document_ids": len(set(doc_ids)),
            "vectors_with_content": with_content,
            "vectors_with_metadata": with_metadata,
            "metadata_keys": dict(keys.most_common(TOP_METADATA_KEYS)),
            "metadata_sampled_vectors": len(sample),
        }

    def _bytes_under(self, folder: str) -> tuple[int, int]:
        storage = self.shoal.storage
        selector = pafs.FileSelector(storage.path(folder), recursive=True, allow_not_found=True)
        files = [i for i in storage.fs.get_file_info(selector) if i.type == pafs.FileType.File]
        return sum(int(i.size or 0) for i in files), len(files)

    # -- vectors -----------------------------------------------------------------------------------------

    def upsert(self, name: Any, vectors: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Append the vectors (an id already there is replaced), all or nothing; the batch's write token."""
        record = self.record(name)
        if not vectors:
            raise _invalid("vectors must not be empty", field="vectors")
        for i, v in enumerate(vectors):
            values = v.get("values")
            if not isinstance(values, list | tuple) or len(values) != record.dimensions:
                got = len(values) if isinstance(values, list | tuple) else None
                raise DatasetError(
                    ErrorCode.INVALID_DIMENSIONS,
                    f"vector {i}: expected {record.dimensions} values, got {got}",
                    {"position": i, "expected": record.dimensions, "got": got},
                )
        problems: list[str] = []
        points = []
        for i, v in enumerate(vectors):
            vid = v.get("id")
            if not rules.is_text(vid) or not 1 <= len(vid) <= rules.MAX_VECTOR_ID:
                problems.append(f"vector {i}: id must be a string of 1 to {rules.MAX_VECTOR_ID} characters")
            for field in ("document_id", "content"):
                if v.get(field) is not None and not rules.is_text(v.get(field)):
                    problems.append(f"vector {i}: {field} must be null or a string")
            meta = v.get("metadata")
            try:
                rules.check_metadata(meta, "metadata", rules.MAX_VECTOR_METADATA_BYTES, nul=True)
            except DatasetError as exc:
                problems.append(f"vector {i}: {exc.message}")
                meta = None
            attrs = {
                "id": vid,
                "document_id": v.get("document_id") or "",
                "content": v.get("content") or "",
                "metadata": rules.json_text(meta),
            }
            points.append(DataPoint(attrs, v["values"]))
        if problems:
            raise _invalid(f"invalid vectors, nothing written: {'; '.join(problems[:10])}", problems=problems[:100])
        try:
            self.shoal.check_backpressure(record.name, rules.VERSION)
            token = self.shoal.producer(record.name, rules.VERSION).upload(points)
        except NotFoundError:
            self._forget(record.name)
            raise not_found(record.name) from None
        except ValidationError as exc:
            raise _invalid(str(exc), problems=_problems(exc)[:100]) from None
        return {"dataset_id": record.name, "inserted": len(points), "write_token": token.seq}

    # -- search ------------------------------------------------------------------------------------------

    @staticmethod
    def _check_query(record: DatasetRecord, vector: Sequence[float], top_k: int) -> None:
        if len(vector) != record.dimensions:
            raise DatasetError(
                ErrorCode.INVALID_DIMENSIONS,
                f"query vector of dataset {record.name!r}: expected {record.dimensions} values, got {len(vector)}",
                {"dataset_id": record.name, "expected": record.dimensions, "got": len(vector)},
            )
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= rules.MAX_TOP_K:
            raise _invalid(f"top_k must be an integer in 1..{rules.MAX_TOP_K}", field="top_k")

    def _hits(
        self, record: DatasetRecord, vector: Sequence[float], top_k: int, consistency: Consistency
    ) -> Sequence[Hit]:
        self._check_query(record, vector, top_k)
        try:
            if self.searcher.view(record.name, rules.VERSION).source.id != record.source_id:
                self.searcher.refresh()  # a view of a dataset since deleted and recreated under the same name
            return self.searcher.search(record.name, rules.VERSION, [list(vector)], top_k, consistency=consistency)[0]
        except NotFoundError:
            self._forget(record.name)
            raise not_found(record.name) from None
        except ValidationError as exc:
            raise _invalid(str(exc), problems=_problems(exc)) from None

    def search(
        self,
        name: Any,
        vector: Sequence[float],
        top_k: int = 10,
        *,
        consistency: str | None = None,
        min_write_token: int | None = None,
    ) -> dict[str, Any]:
        """The `top_k` nearest vectors, nearest first; `score` is the metric's distance."""
        record = self.record(name)
        level = consistency_of(consistency, min_write_token)
        hits = self._hits(record, vector, top_k, level)
        return {
            "dataset_id": record.name,
            "metric_type": record.metric_type,
            "higher_is_better": higher_is_nearer(record.metric_type),
            "consistency": level.level,
            "results": [hit_json(h) for h in hits],
        }

    def multi_search(
        self,
        dataset_ids: Sequence[Any],
        vector: Sequence[float],
        top_k: int = 10,
        *,
        merge_strategy: str = "interleave",
        consistency: str | None = None,
    ) -> dict[str, Any]:
        """Search several datasets with one vector and merge their results (see `shoal.datasets.merge`)."""
        if not dataset_ids or len(dataset_ids) > rules.MAX_MULTI_DATASETS:
            raise _invalid(f"dataset_ids must name 1 to {rules.MAX_MULTI_DATASETS} datasets", field="dataset_ids")
        if len(set(dataset_ids)) != len(dataset_ids):
            raise _invalid("dataset_ids must not repeat", field="dataset_ids")
        if merge_strategy not in STRATEGIES:
            raise _invalid(f"merge_strategy must be one of {', '.join(STRATEGIES)}", field="merge_strategy")
        level = consistency_of(consistency, None)
        records = [self.record(n) for n in dataset_ids]
        directions = {higher_is_nearer(r.metric_type) for r in records}
        if merge_strategy == "score" and len(directions) > 1:
            raise DatasetError(
                ErrorCode.INVALID_DATASET_CONFIG,
                "merge_strategy 'score' cannot merge metrics that rank in opposite directions "
                "(dot_product: higher is nearer; cosine, euclidean, manhattan: lower is nearer)",
                {"metric_types": {r.name: r.metric_type for r in records}, "merge_strategy": merge_strategy},
            )
        for r in records:  # every query problem before any search runs
            self._check_query(r, vector, top_k)
        lists = [self._hits(r, vector, top_k, level) for r in records]
        merged = merge(merge_strategy, lists, [[h.distance for h in hits] for hits in lists],
                       directions == {True}, top_k)
        return {
            "merge_strategy": merge_strategy,
            "dataset_ids": [r.name for r in records],
            "top_k": top_k,
            "consistency": level.level,
            "results": [{"dataset_id": records[d].name, "rank": rank, **hit_json(hit)} for d, rank, hit in merged],
        }


def _iso(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).isoformat(timespec="microseconds")


def _shard_json(status: Any) -> dict[str, Any]:
    return {
        "shard": status.shard,
        "head": status.head,
        "built_watermark": status.built_watermark,
        "served_watermark": status.served_watermark,
        "lag_seqs": status.lag_seqs,
        "built_lag_seqs": status.built_lag_seqs,
        "lag_seconds": status.lag_seconds,
        "segments": status.segments,
        "version_id": status.version_id,
    }
