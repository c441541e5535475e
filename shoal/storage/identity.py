"""Which catalog a storage belongs to: a marker object at the storage's root naming the catalog's id.

A storage belongs to exactly one catalog. The catalog is the only record of which files are in use, so a process
of catalog A pointed at catalog B's storage takes every file there for unreferenced, and its garbage collection
deletes B's data. So the catalog has an id (table `catalog_identity`, a random uuid made by migration 0013) and
the storage root holds `shoal-catalog.json` naming it:

- every process that opens the runtime (API, worker, consumer, the Python API `Shoal`, `shoal` commands) checks
  the marker (`ensure_storage_identity`): one naming another catalog is refused with a ConfigurationError. An
  absent one is written: the first use of a storage, and every deployment's storage the first time a Shoal that
  knows markers opens it. Unless the storage already holds files and none of a sample of the files this
  catalog references is among them: that is another deployment's storage whose Shoal wrote no marker yet (or a
  catalog made anew beside an old storage), and it is refused too.
- garbage collection checks the marker before every run (`check_storage_identity`) and deletes nothing unless it
  names this catalog: the storage may have been swapped under a running process, or the marker removed.

One catalog may use several storage roots (tests do): each root's marker names the same catalog. The marker lives
beside `tenants/`, outside every folder GC scans, so nothing of Shoal's ever deletes it.

A root may not lie inside another storage's tenants' folders (s3://b/dep/tenants/x under s3://b/dep): that
storage's GC scans them and would delete every file of this one, its marker included. So the start also looks for
a marker in each folder enclosing the root (one lookup each) and refuses the root if it lies under that folder's
`tenants/`, whichever catalog the marker names (a sibling of `tenants/`, s3://b/dep/staging, is no part of it).
A storage nested so before its outer one had a marker is spared by GC itself, which skips any folder holding a
marker (`shoal.upkeep.gc`). Folders below the root are not searched at start: that would take a full listing of
the storage.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import PurePosixPath

import pyarrow as pa
from sqlalchemy import Engine, select

from shoal.catalog.models import CatalogIdentity, DataSource, GarbageFile, IndexFile, LogSegment, Tenant
from shoal.config.settings import Settings, mask_url
from shoal.errors import ConfigurationError, StorageUnavailableError
from shoal.log.records import DATASET_KEY
from shoal.storage import Storage, layout
from shoal.storage.layout import ROOT

MARKER = "shoal-catalog.json"  # at the storage root, beside `tenants/`
SAMPLE = 20  # referenced files of each kind looked for in a storage that holds files but no marker yet


@dataclass(frozen=True)
class Marker:
    """What a storage's marker says: the id of the catalog the storage belongs to, and when it was written."""

    catalog_id: str
    written_at: str | None


def catalog_id(engine: Engine) -> str:
    """The catalog's id (migration 0013 made it). ConfigurationError when its row is missing (removed by hand)."""
    with engine.connect() as conn:
        found = conn.scalars(select(CatalogIdentity.id)).first()
    if found is None:
        raise ConfigurationError(
            "the catalog has no identity (table catalog_identity is empty): restore its row from a backup of the "
            f"catalog (the {MARKER} of its storage names the id)"
        )
    return str(found)


def describe(storage: Storage) -> str:
    """The storage's root as an operator would name it (no secret: credentials are never part of it)."""
    return storage.root if storage.local else f"s3://{storage.root}"


def read_marker(storage: Storage) -> Marker | None:
    """The storage's marker; None when it has none. ConfigurationError when the object there is not one."""
    try:
        data = storage.read(MARKER)
    except FileNotFoundError:
        return None
    try:
        return _parse_marker(data)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigurationError(
            f"storage {describe(storage)}: {MARKER} is not a catalog marker ({type(exc).__name__}: {exc}); it names "
            "the catalog this storage belongs to: restore it, or remove it if this storage is this catalog's"
        ) from None


def _parse_marker(data: pa.Buffer) -> Marker:
    """The marker these bytes hold; ValueError, KeyError, TypeError or AttributeError when they hold none."""
    content = json.loads(data.to_pybytes())
    return Marker(str(uuid.UUID(content["catalog_id"])), content.get("written_at"))


def ensure_storage_identity(engine: Engine, storage: Storage, settings: Settings) -> str:
    """Check that the storage belongs to this catalog, writing its marker if it has none; return the catalog's id.

    Promises: a storage whose marker names another catalog, or one holding files without a marker of which none
    is a file this catalog references, is refused with a ConfigurationError in one line naming the storage, both
    catalogs and the settings to check; nothing is written then. Two processes of one catalog writing the marker
    at once both succeed.
    """
    mine = catalog_id(engine)
    _refuse_nested(storage, settings, mine)
    marker = read_marker(storage)
    if marker is None:
        if storage.holds_files(ROOT) and not _holds_any_of(storage, _referenced_sample(engine)):
            raise ConfigurationError(
                f"storage {_storage_name(settings)} holds files but no {MARKER}, and none of the files catalog "
                f"{_catalog_name(settings)} (id {mine}) references: it is another deployment's storage (or this "
                f"catalog is a new one); {_check(settings)}. If it really is this catalog's, write "
                f'{MARKER} there holding {{"catalog_id": "{mine}"}}'
            )
        try:
            _write_if_absent(storage, _marker_bytes(mine))
        except StorageUnavailableError:
            raise  # an outage: retried, or refused at start as one
        except OSError as exc:
            raise ConfigurationError(
                f"storage {_storage_name(settings)} has no {MARKER} yet and this process cannot write it ({exc}): "
                "start a process that may write to the storage first, or write it by hand holding "
                f'{{"catalog_id": "{mine}"}}'
            ) from None
        marker = read_marker(storage)  # another process may have written it first: its marker is the one
        if marker is None:
            raise ConfigurationError(f"storage {_storage_name(settings)}: {MARKER} was written but cannot be read back")
    if marker.catalog_id != mine:
        raise ConfigurationError(
            f"storage {_storage_name(settings)} belongs to another catalog: its {MARKER} names catalog "
            f"{marker.catalog_id}, but catalog {_catalog_name(settings)} is {mine}; {_check(settings)}"
        )
    return mine


def _refuse_nested(storage: Storage, settings: Settings, mine: str) -> None:
    """ConfigurationError when a folder enclosing the storage's root holds a marker: the root lies inside another
    storage (another deployment's, or another root of this catalog), whose garbage collection scans its tenants'
    folders and would take every file here for one of its own unreferenced ones. One lookup per enclosing
    folder; a folder the storage may not look into is skipped."""
    # Only a root under an enclosing storage's `tenants/` folder is at risk: that storage's GC, purges and drops
    # touch nothing else (a sibling such as s3://b/staging beside s3://b/tenants is no part of it).
    root = PurePosixPath(storage.root)
    found = [path for path in storage.enclosing_files(MARKER)
             if root.relative_to(PurePosixPath(path).parent).parts[:1] == (ROOT,)]
    if not found:
        return
    outer_root = found[0].removesuffix(f"/{MARKER}")
    outer = outer_root if storage.local else f"s3://{outer_root}"
    try:
        with storage.fs.open_input_file(found[0]) as f:
            named = _parse_marker(f.read_buffer()).catalog_id
        whose = "this catalog's own" if named == mine else f"catalog {named}'s"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        whose = "unreadable"
    raise ConfigurationError(
        f"storage {_storage_name(settings)} lies inside storage {outer} (its {MARKER} is {whose}): that "
        "storage's garbage collection would take this one's files for unreferenced ones of its own; give "
        "SHOAL_STORAGE_URI a root outside every other storage"
    )


def check_storage_identity(engine: Engine, storage: Storage) -> None:
    """Before garbage collection deletes anything: the storage's marker must name this catalog. A
    ConfigurationError saying why otherwise (no marker, another catalog's, one that cannot be read)."""
    mine = catalog_id(engine)
    marker = read_marker(storage)
    if marker is None:
        raise ConfigurationError(
            f"garbage collection deleted nothing: storage {describe(storage)} holds no {MARKER}, so nothing says it "
            f"belongs to this catalog ({mine}) (it may have been swapped, or the marker removed); check "
            "SHOAL_STORAGE_URI and SHOAL_DATABASE_URL; a Shoal process started on the right storage writes the "
            "marker again"
        )
    if marker.catalog_id != mine:
        raise ConfigurationError(
            f"garbage collection deleted nothing: storage {describe(storage)} belongs to another catalog (its "
            f"{MARKER} names {marker.catalog_id}, this catalog is {mine}); check SHOAL_STORAGE_URI and "
            "SHOAL_DATABASE_URL"
        )


def _storage_name(settings: Settings) -> str:
    return mask_url(settings.resolved_storage_uri)


def _catalog_name(settings: Settings) -> str:
    if settings.database_url:
        return mask_url(settings.database_url)
    return f"(the embedded Postgres in {settings.data_dir})"


def _check(settings: Settings) -> str:
    unset = [] if settings.storage_uri else ["SHOAL_STORAGE_URI"]
    unset += [] if settings.database_url else ["SHOAL_DATABASE_URL"]
    where = f" ({' and '.join(unset)} unset: SHOAL_DATA_DIR places {'it' if len(unset) == 1 else 'them'})"
    return "check SHOAL_STORAGE_URI and SHOAL_DATABASE_URL" + (where if unset else "")


def _marker_bytes(mine: str) -> bytes:
    content = {
        "catalog_id": mine,
        "written_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "about": "Shoal: this storage belongs to the catalog with this id; processes of any other catalog refuse it",
    }
    return (json.dumps(content, indent=2) + "\n").encode()


def _write_if_absent(storage: Storage, data: bytes) -> None:
    """Write the marker unless one is there. Locally the creation is exclusive (a hard link of a synced temp file,
    which fails if the name exists); S3 has no such write, so there the last of two writers wins, and each
    reads back what is there."""
    if not storage.local:
        storage.write_atomic(MARKER, pa.py_buffer(data))
        return
    final = storage.path(MARKER)
    tmp = storage.path(f".tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(tmp, final)
        except FileExistsError:
            return  # another process wrote one first
        fd = os.open(storage.root, os.O_RDONLY)  # the new name is durable once its directory is synced
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def _referenced_sample(engine: Engine) -> list[str]:
    """Some files this catalog references: its newest log segments, files of its newest index versions, files
    its GC queue still holds, and the metadata mirrors of its newest datasets (a dataset with no vector yet has
    no other file). Read once, when a storage without a marker is first opened."""
    with engine.connect() as conn:
        paths = list(conn.scalars(select(LogSegment.path).order_by(LogSegment.committed_at.desc()).limit(SAMPLE)))
        paths += conn.scalars(select(IndexFile.path).order_by(IndexFile.version_id.desc()).limit(SAMPLE))
        paths += conn.scalars(
            select(GarbageFile.path).where(GarbageFile.deleted_at.is_(None))
            .order_by(GarbageFile.delete_after.desc()).limit(SAMPLE)
        )
        datasets = conn.execute(
            select(Tenant.name, DataSource.name, DataSource.id, DataSource.deleted_at)
            .join(Tenant, Tenant.id == DataSource.tenant_id)
            .where(DataSource.custom_metadata.has_key(DATASET_KEY))
            .order_by(DataSource.id.desc()).limit(SAMPLE)
        )
        for tenant, name, source_id, deleted_at in datasets:
            folder = layout.trash_dir(tenant, source_id) if deleted_at is not None else layout.dataset_dir(tenant, name)
            paths.append(f"{folder}/dataset_metadata.json")
    return paths


def _holds_any_of(storage: Storage, paths: list[str]) -> bool:
    return any(storage.exists(path) for path in paths)
