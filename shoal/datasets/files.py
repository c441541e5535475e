"""A dataset's own files: its `dataset_metadata.json` mirror, the mirror's copy in the trash, and the one place
the dataset service deletes files itself (`forget_files`).

The catalog is the source of truth; the mirror is a convenience for people browsing storage. Paths come from
`shoal.storage.layout`.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
from sqlalchemy import Engine

from shoal.datasets import rules
from shoal.datasets.catalog import DatasetRecord, live_dataset
from shoal.errors import StorageUnavailableError
from shoal.storage import Storage
from shoal.storage.layout import dataset_metadata_path, trash_dir
from shoal.upkeep.drops import release_files

log = logging.getLogger(__name__)

FORMAT = 1  # version of the mirror document's layout


def trash_mirror_path(tenant: str, source_id: int) -> str:
    """Layout-relative path of a trashed dataset's mirror (keyed by the source's id: the name is free)."""
    return f"{trash_dir(tenant, source_id)}/dataset_metadata.json"


def iso_utc(t: dt.datetime) -> str:
    """A timestamp in ISO 8601, UTC, to the microsecond."""
    return t.astimezone(dt.UTC).isoformat(timespec="microseconds")


def mirror_doc(tenant: str, record: DatasetRecord) -> dict[str, Any]:
    """The mirror document of a dataset's catalog entry."""
    return {
        "format": FORMAT,
        "id": record.name,
        "name": record.name,
        "tenant": tenant,
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


def _write_json(storage: Storage, path: str, doc: dict[str, Any]) -> None:
    data = json.dumps(doc, indent=2, ensure_ascii=False).encode()
    storage.write_atomic(path, pa.py_buffer(data))


def write_mirror(storage: Storage, tenant: str, record: DatasetRecord) -> None:
    """Write (atomically) the dataset's mirror from its catalog entry."""
    _write_json(storage, dataset_metadata_path(tenant, record.name), mirror_doc(tenant, record))


def refresh_mirror(engine: Engine, storage: Storage, source_id: int) -> bool:
    """Write again the mirror of the live dataset whose data source is `source_id`, from its catalog entry
    (which shows the index generation serving now); False when the source is no live dataset. Called after a
    reindex swap or a rollback, which change what the mirror shows. Never raises: the swap is done and the
    catalog is the source of truth, so a failure is logged and the mirror stays as it was."""
    try:
        found = live_dataset(engine, source_id)
        if found is None:
            return False
        tenant, record = found
        write_mirror(storage, tenant, record)
        return True
    except Exception as exc:  # noqa: BLE001 - best effort, see above
        log.warning("could not refresh the metadata mirror of data source %s: %s", source_id, exc)
        return False


def move_mirror_to_trash(
    engine: Engine, storage: Storage, tenant: str, record: DatasetRecord, source_id: int, deleted_at: dt.datetime,
    purge_after: dt.datetime,
) -> None:
    """Copy the mirror (with its trash dates) into the source's trash folder, then remove the original.

    Never raises for the copy: the catalog, already saying "in the trash", is the source of truth.
    """
    try:
        doc = mirror_doc(tenant, record) | {"trash_id": source_id, "deleted_at": iso_utc(deleted_at),
                                            "purge_after": iso_utc(purge_after)}
        _write_json(storage, trash_mirror_path(tenant, source_id), doc)
    except Exception as exc:  # noqa: BLE001
        log.warning("could not write the trash copy of dataset %s's metadata mirror: %s", record.name, exc)
    forget_files(engine, storage, files=[dataset_metadata_path(tenant, record.name)])


def forget_files(engine: Engine, storage: Storage, *, files: Sequence[str] = (), folder: str | None = None) -> None:
    """Give up files no catalog row names any more (their rows were just deleted or moved): `files`, and
    every file under `folder`, go through the one deletion path (`shoal.upkeep.drops.release_files`: queued
    in GC's `garbage_files`, then deleted at once by GC's checked deletion, which keeps a mirror that a live
    dataset of the same name wrote again meanwhile). A crash in between leaves them queued for the next GC.

    Never raises for a storage that cannot be reached: callers give files up after their change committed, so
    an error would tell the client the change failed (a retry then finds it done: 404). What could not be
    deleted stays queued, or is found by GC's scan (stray files in dataset and trash folders), and goes later."""
    try:
        release_files(engine, storage, files, folders=[folder] if folder is not None else [])
    except StorageUnavailableError as exc:
        log.warning("files given up stay for GC: the storage is unavailable (%s)", exc)
