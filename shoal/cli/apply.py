"""`shoal apply DIR`: create, or check, the data sources and indexes a Vektonn configuration folder declares."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

from shoal.catalog.db import application_name
from shoal.catalog.repo import tenant_exists
from shoal.cli.common import Tenant, err, load_settings, out
from shoal.client import Shoal
from shoal.errors import AlreadyExistsError, InvalidNameError, NotFoundError
from shoal.index.spec import resolve_index
from shoal.log.records import GENERATION_MARK, DataSourceSpec, IndexSpec, check_tenant_name
from shoal.runtime import Runtime
from shoal.vektonn.yaml_config import SOURCES_DIR, Declared, naming_file, read_folder

# The fields `DataSourceSpec.same_definition` compares, by the names the YAML gives them.
SOURCE_FIELDS = {"vector_dimension": "vectorDimension", "vectors_are_sparse": "vectorsAreSparse",
                 "attribute_types": "attributeValueTypes", "permanent_attributes": "permanentAttributes"}


@dataclass
class Plan:
    """What to create once every file checked out: definitions, each marked as already in the catalog or not."""

    sources: list[tuple[DataSourceSpec, bool]] = field(default_factory=list)
    indexes: list[tuple[IndexSpec, bool]] = field(default_factory=list)


def _differences(mine: dict[str, Any], theirs: dict[str, Any], names: dict[str, str] | None = None) -> str:
    """`field: X here, Y in the catalog` for each field that differs; `names` (field -> name shown) picks and
    renames the fields compared, else all of `mine` are."""
    names = names or {name: name for name in mine}
    return "; ".join(
        f"{shown}: {mine[name]!r} here, {theirs[name]!r} in the catalog"
        for name, shown in names.items()
        if mine[name] != theirs[name]
    )


def _source_spec(shoal: Shoal | None, name: str, version: str) -> DataSourceSpec | None:
    if shoal is None:  # a tenant the catalog does not hold has no data source
        return None
    try:
        return shoal.get_data_source(name, version).spec
    except NotFoundError:
        return None


def _index_spec(shoal: Shoal | None, spec: IndexSpec) -> IndexSpec | None:
    if shoal is None:
        return None
    try:
        return shoal.get_index(spec.name, spec.version).spec
    except NotFoundError:
        return None


def check(shoal: Shoal | None, folder: Path, declared: Declared, *, tenant: str) -> Plan:
    """Check every declared definition against the others and the catalog of `tenant`, writing nothing (not even
    the tenant): each index against its data source (declared in the folder or already in the catalog) by the
    same rules `Shoal.create_index` applies, and each definition that exists already against the stored one.
    `shoal` is a Shoal on the tenant, or None when the catalog does not hold the tenant (then it holds nothing:
    every definition is new). The first error names its file; only a Plan that passed every check is ever
    applied, so no file is half applied."""
    plan = Plan()
    in_folder: dict[tuple[str, str], DataSourceSpec] = {}
    for spec in declared.sources:
        with naming_file(declared.source_files[(spec.name, spec.version)]):
            existing = _source_spec(shoal, spec.name, spec.version)
            # What `create_data_source(exist_ok=True)` would refuse, found before anything is written.
            if existing is not None and not existing.same_definition(spec):
                raise AlreadyExistsError(
                    f"data source {spec.name!r} version {spec.version!r} exists with another definition: "
                    + _differences(spec.to_json(), existing.to_json(), SOURCE_FIELDS)
                )
            spec.check_storable()
        plan.sources.append((spec, existing is not None))
        # An index is resolved against what the catalog will hold: the stored spec when there is one. Equal by
        # same_definition, the two may still list attributes in another order, and resolve_index's default
        # payload follows that order: resolved against the folder's copy, an index created now would differ
        # from itself at the next apply (create_index resolves against the stored copy).
        in_folder[(spec.name, spec.version)] = existing or spec
    for index in declared.indexes:
        with naming_file(declared.index_files[(index.name, index.version)]):
            if GENERATION_MARK in index.version:  # as Shoal.create_index refuses it
                raise InvalidNameError(f"index version {index.version!r}: '~' is reserved for reindex generations")
            key = (index.source_name, index.source_version)
            source = in_folder.get(key)
            if source is None:
                source = _source_spec(shoal, *key)
                if source is None:
                    raise NotFoundError(
                        f"dataSourceId names data source {key[0]!r} version {key[1]!r}, which is neither in "
                        f"{folder / SOURCES_DIR} nor in tenant {tenant!r}"
                    )
            resolved = resolve_index(index, source)
            existing_index = _index_spec(shoal, index)
            # The catalog compares resolved definitions; so does this.
            if existing_index is not None and existing_index != resolved:
                raise AlreadyExistsError(
                    f"index {index.name!r} version {index.version!r} exists with another definition: "
                    + _differences(asdict(resolved), asdict(existing_index))
                )
        plan.indexes.append((index, existing_index is not None))
    return plan


@contextlib.contextmanager
def applying_alone(engine: Engine, tenant: str) -> Iterator[None]:
    """Hold, for the block, a Postgres session advisory lock that every `shoal apply` on `tenant` takes: two
    applies at once would each check against a catalog the other is changing, and the loser fail half applied.
    Waits for as long as the other apply runs, saying so on stderr. Released when the block ends, on error too
    (and by Postgres if the process dies)."""
    # A connection of its own, outside `engine`'s pool: taken from a pool of one (SHOAL_DB_POOL_SIZE=1, no
    # overflow) it left none for the block, which timed out. Closing it ends the session, releasing the lock.
    own = create_engine(engine.url, poolclass=NullPool, connect_args={"application_name": application_name()})
    try:
        with own.connect() as conn:
            key = {"k": "shoal apply " + tenant}
            # SET LOCAL: no lock_timeout the server may set cuts the wait short.
            conn.execute(text("SET LOCAL lock_timeout = 0"))
            if not conn.scalar(text("SELECT pg_try_advisory_lock(hashtextextended(:k, 0))"), key):
                err.print(f"waiting for another `shoal apply` on tenant {tenant!r} to finish", soft_wrap=True)
                conn.execute(text("SELECT pg_advisory_lock(hashtextextended(:k, 0))"), key)
            conn.commit()  # a session lock outlives the transaction: none is left open while the block runs
            yield
    finally:
        own.dispose()


def apply(
    folder: Annotated[Path, typer.Argument(exists=True, file_okay=False, help="Holds data-sources/ and indices/.")],
    tenant: Tenant = None,
) -> None:
    """Read `data-sources/{name}/{version}.yaml` and `indices/{name}/{version}.yaml`; create what is missing and
    check that what exists has the same definition. Every file is checked before anything is written (its fields,
    each index against its data source, each definition against the one the tenant holds already); an error
    names the file and, for a definition the tenant holds with other values, the fields that differ. Two applies
    on one tenant run one after the other. Files and folders named `.*` are skipped; `*.yml` files are not read
    (a warning says so)."""
    declared = read_folder(folder)  # before the runtime: a malformed folder starts no server
    for path in declared.ignored:
        err.print(f"warning: {path} is not read: only .yaml files are (rename it to .yaml to apply it)",
                  soft_wrap=True)
    settings = load_settings()
    name = check_tenant_name(tenant or settings.tenant)
    with Runtime(settings) as runtime, applying_alone(runtime.engine, name):
        # A Shoal makes its tenant on first use: checked with one only when the catalog holds the tenant already,
        # so a refused folder (or one applied to a mistyped --tenant) leaves no tenant behind. A Shoal on a runtime
        # it was given releases nothing when closed.
        held = Shoal(runtime=runtime, tenant=name) if tenant_exists(runtime.engine, name) else None
        plan = check(held, folder, declared, tenant=name)
        # Every file checked out: the tenant is made now if it is new, and the definitions are written. Another
        # apply waits for the lock; another writer (the HTTP API) may still get in first, hence the file named.
        shoal = held or Shoal(runtime=runtime, tenant=name)
        for spec, existed in plan.sources:
            with naming_file(declared.source_files[(spec.name, spec.version)]):
                shoal.create_data_source(spec, exist_ok=True)
            out.print(f"data source {spec.name}/{spec.version}: {'unchanged' if existed else 'created'}")
        for index, existed in plan.indexes:
            with naming_file(declared.index_files[(index.name, index.version)]):
                shoal.create_index(index, exist_ok=True)
            out.print(f"index {index.name}/{index.version}: {'unchanged' if existed else 'created'}")
