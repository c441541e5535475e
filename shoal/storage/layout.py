"""The storage layout (DESIGN.md "Storage layout"): the one place that builds and parses storage paths.

Every path here is layout-relative (no root, no scheme): `Storage.path` joins it to the configured root.

```
tenants/{tenant}/sources/{source}/{version}/log/{first_seq:020d}-{uuid}.parquet
tenants/{tenant}/indexes/{index}/{version}/gen-{generation}/shard-{n}/{segment_uuid}/...
tenants/{tenant}/datasets/{name}/dataset_metadata.json
tenants/{tenant}/trash/{source_id}/...
```
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

ROOT = "tenants"
FOLDERS = ("sources", "indexes", "datasets", "trash")  # what a tenant's folder holds, one folder per kind


def tenant_prefix(tenant: str) -> str:
    """The folder (with its trailing slash) under which every file of one tenant lives."""
    return f"{ROOT}/{tenant}/"


def tenant_folder(tenant: str, kind: str) -> str:
    """One of a tenant's folders (`kind` in FOLDERS)."""
    if kind not in FOLDERS:
        raise ValueError(f"unknown folder kind {kind!r}; expected one of {', '.join(FOLDERS)}")
    return f"{ROOT}/{tenant}/{kind}"


def sources_dir(tenant: str) -> str:
    """The folder holding every data source's log of one tenant."""
    return f"{ROOT}/{tenant}/sources"


def indexes_dir(tenant: str) -> str:
    """The folder holding every index's files of one tenant."""
    return f"{ROOT}/{tenant}/indexes"


def source_log_dir(tenant: str, source: str, version: str) -> str:
    """The folder of one data source's log segments."""
    return f"{sources_dir(tenant)}/{source}/{version}/log"


def segment_path(tenant: str, source: str, version: str, first_seq: int, segment_id: uuid.UUID) -> str:
    """A log segment's path: named by its first seq (so a listing sorts by seq) and a fresh uuid (so two
    writers racing for the same seqs never write the same file)."""
    return f"{source_log_dir(tenant, source, version)}/{first_seq:020d}-{segment_id}.parquet"


def index_dir(tenant: str, index: str, version: str) -> str:
    """The folder of every generation of one index."""
    return f"{indexes_dir(tenant)}/{index}/{version}"


def shard_dir(tenant: str, index: str, version: str, generation: int, shard_no: int) -> str:
    """The folder of one shard of one generation of an index; its index segments are uuid-named folders in it."""
    return f"{index_dir(tenant, index, version)}/gen-{generation}/shard-{shard_no}"


def index_segment_dir(shard_folder: str, segment_id: uuid.UUID) -> str:
    """The folder of one index segment (rows table, engine files, deletion files) inside a shard folder."""
    return f"{shard_folder}/{segment_id}"


def dataset_dir(tenant: str, name: str) -> str:
    """The folder of a dataset's own files (its `dataset_metadata.json` mirror)."""
    return f"{ROOT}/{tenant}/datasets/{name}"


def dataset_metadata_path(tenant: str, name: str) -> str:
    """The dataset's `dataset_metadata.json` mirror."""
    return f"{dataset_dir(tenant, name)}/dataset_metadata.json"


def trash_dir(tenant: str, source_id: int) -> str:
    """What a soft-deleted data source keeps in the trash: keyed by the source's id, since its name may be
    reused meanwhile."""
    return f"{ROOT}/{tenant}/trash/{source_id}"


@dataclass(frozen=True)
class LogOwner:
    """Whose log a path belongs to."""

    tenant: str
    source: str
    version: str


@dataclass(frozen=True)
class IndexOwner:
    """Whose index folder a path belongs to."""

    tenant: str
    index: str
    version: str
    generation: int
    shard_no: int


def parse_log_path(path: str) -> LogOwner | None:
    """The owner of a file directly inside a log folder; None for any other path."""
    parts = path.split("/")
    if len(parts) == 7 and parts[0] == ROOT and parts[2] == "sources" and parts[5] == "log" and parts[6]:
        return LogOwner(parts[1], parts[3], parts[4])
    return None


def parse_index_path(path: str) -> IndexOwner | None:
    """The owner of a file anywhere below a shard folder (`.../gen-G/shard-N/...`); None for any other path."""
    parts = path.split("/")
    if len(parts) < 8 or parts[0] != ROOT or parts[2] != "indexes" or not all(parts[7:]):
        return None
    gen, shard = parts[5], parts[6]
    if not (gen.startswith("gen-") and shard.startswith("shard-")):
        return None
    try:
        return IndexOwner(parts[1], parts[3], parts[4], int(gen[4:]), int(shard[6:]))
    except ValueError:
        return None


@dataclass(frozen=True)
class FolderOwner:
    """Whose folder a file of a tenant's `datasets` or `trash` folder is in: a dataset's name, or a trashed
    data source's id (as text)."""

    tenant: str
    kind: str
    owner: str


def parse_owner_path(path: str) -> FolderOwner | None:
    """The owner of a file below `tenants/{tenant}/datasets/{name}/` or `tenants/{tenant}/trash/{id}/`; None for
    any other path."""
    parts = path.split("/")
    if len(parts) >= 5 and parts[0] == ROOT and parts[2] in ("datasets", "trash") and all(parts[3:]):
        return FolderOwner(parts[1], parts[2], parts[3])
    return None


def is_managed(path: str) -> bool:
    """True for a file in a folder the garbage collector owns: a log folder, or anywhere below a tenant's
    indexes, datasets or trash folder."""
    parts = path.split("/")
    if len(parts) < 4 or parts[0] != ROOT or parts[2] not in FOLDERS:
        return False
    return parse_log_path(path) is not None if parts[2] == "sources" else all(parts[3:])
