"""Catalog access for indexes: definitions, shards (active pointer, lease, freshness) and versions."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, Connection, Engine, String, and_, bindparam, delete, func, or_, select, update
from sqlalchemy.dialects.postgresql import ARRAY, insert
from sqlalchemy.orm import Session

from shoal.catalog.models import DataSource, Index, IndexAlias, IndexFile, IndexShard, IndexVersion, Tenant
from shoal.catalog.repo import SourceRecord, _record
from shoal.errors import AlreadyExistsError, ConflictError, NotFoundError
from shoal.log.records import GENERATION_MARK, IndexSpec, check_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardRecord:
    """One index shard as the catalog holds it."""

    id: int
    index_id: int
    shard_no: int
    active_version_id: int | None
    built_watermark: int
    served_watermark: int
    served_at: dt.datetime | None


@dataclass(frozen=True)
class IndexRecord:
    """An index definition with its identity, data source and shards."""

    id: int
    tenant: str
    spec: IndexSpec
    source_id: int
    generation: int
    shards: tuple[ShardRecord, ...]


@dataclass(frozen=True)
class VersionRecord:
    """An immutable index version: the manifest of one shard at a watermark."""

    id: int
    shard_id: int
    parent_id: int | None
    generation: int
    watermark: int
    manifest: dict[str, Any]
    created_at: dt.datetime


def _shard(row: IndexShard) -> ShardRecord:
    return ShardRecord(
        row.id,
        row.index_id,
        row.shard_no,
        row.active_version_id,
        row.built_watermark,
        row.served_watermark,
        row.served_at,
    )


def _version(row: IndexVersion) -> VersionRecord:
    return VersionRecord(
        row.id, row.shard_id, row.parent_id, row.generation, row.watermark, row.manifest, row.created_at
    )


def _index(s: Session, row: Index, source: DataSource, tenant: str) -> IndexRecord:
    """The record of an index row and its data source's row, read together (see `_with_source`): a drop of the
    source may commit between two statements, so the source is never looked up on its own."""
    spec = IndexSpec(
        name=row.name,
        version=row.version,
        source_name=source.name,
        source_version=source.version,
        algorithm=row.algorithm,
        metric=row.metric,
        params=row.params,
        id_attributes=row.id_attributes,
        split_attributes=row.split_attributes,
        shard_attributes=row.shard_attributes,
        payload_attributes=row.payload_attributes,
        shard_count=row.shard_count,
    )
    shards = s.scalars(select(IndexShard).where(IndexShard.index_id == row.id).order_by(IndexShard.shard_no))
    return IndexRecord(row.id, tenant, spec, row.data_source_id, row.generation, tuple(_shard(r) for r in shards))



def insert_index_rows(
    s: Session, tenant_id: int, source_id: int, spec: IndexSpec, generation: int,
    created_at: dt.datetime | None = None,
) -> int | None:
    """Insert the index row of `spec` and its shards in the caller's transaction; the new index id, or None
    (nothing written) when a live index of that name and version exists already. `created_at` (default: now)
    is when the index was made: a reindex's generation takes the one of the index it rebuilds."""
    index_id = s.execute(
        insert(Index)
        .values(
            **({"created_at": created_at} if created_at is not None else {}),
            tenant_id=tenant_id,
            data_source_id=source_id,
            name=spec.name,
            version=spec.version,
            algorithm=spec.algorithm,
            metric=spec.metric,
            params=dict(spec.params),
            id_attributes=list(spec.id_attributes),
            split_attributes=list(spec.split_attributes),
            shard_attributes=list(spec.shard_attributes),
            payload_attributes=list(spec.payload_attributes or ()),
            shard_count=spec.shard_count,
            generation=generation,
        )
        .on_conflict_do_nothing(
            index_elements=["tenant_id", "name", "version"], index_where=Index.deleted_at.is_(None)
        )
        .returning(Index.id)
    ).scalar_one_or_none()
    if index_id is not None:
        s.execute(insert(IndexShard), [{"index_id": index_id, "shard_no": n} for n in range(spec.shard_count)])
    return index_id


def _with_source() -> Any:
    """Index rows joined with their data source's row: one statement sees both or neither (READ COMMITTED gives
    each statement its own snapshot, so a source dropped between two reads would leave an index without one)."""
    return select(Index, DataSource).join(DataSource, DataSource.id == Index.data_source_id)


ServingKey = tuple[int, str, str]  # (tenant id, index name, index version): how a searcher names a served index

# What `IndexCatalog.serving` reads of a shard's row (a ShardRecord): its lease columns are left out, a worker
# renews those every few seconds and a searcher serves nothing of them.
_SHARD_COLUMNS = (IndexShard.id, IndexShard.shard_no, IndexShard.active_version_id, IndexShard.built_watermark,
                  IndexShard.served_watermark, IndexShard.served_at)


def serving_fingerprints(engine: Engine, keys: Collection[ServingKey]) -> dict[ServingKey, tuple[Any, ...]]:
    """Per key of a live index (any tenant's), a value that changes whenever what `IndexCatalog.serving` would
    read for it changes: the whole index row the name holds (a reindex swap or rollback, or the index made
    again, puts another row there), its data source's whole row (head, trash, definition) and its shards'
    rows but for their leases. Keys absent from the answer have no live index (dropped, or in the trash).
    One statement for any number of keys (they go as three arrays), so it also reads one snapshot."""
    if not keys:
        return {}
    ordered = list(keys)
    wanted = (
        func.unnest(
            bindparam("tenant_ids", [k[0] for k in ordered], type_=ARRAY(BigInteger)),
            bindparam("names", [k[1] for k in ordered], type_=ARRAY(String)),
            bindparam("versions", [k[2] for k in ordered], type_=ARRAY(String)),
        )
        .table_valued("tenant_id", "name", "version")
        .render_derived(name="wanted")
    )
    query = (
        select(wanted.c.tenant_id, wanted.c.name, wanted.c.version, *Index.__table__.c, *DataSource.__table__.c,
               *_SHARD_COLUMNS)
        .select_from(wanted)
        .join(Index, and_(Index.tenant_id == wanted.c.tenant_id, Index.name == wanted.c.name,
                          Index.version == wanted.c.version, Index.deleted_at.is_(None)))
        .join(DataSource, DataSource.id == Index.data_source_id)
        .outerjoin(IndexShard, IndexShard.index_id == Index.id)
        .order_by(Index.id, IndexShard.shard_no)
    )
    rows: dict[ServingKey, list[tuple[Any, ...]]] = {}
    with engine.connect() as conn:
        for row in conn.execute(query):
            rows.setdefault((int(row[0]), row[1], row[2]), []).append(tuple(row[3:]))
    return {key: tuple(found) for key, found in rows.items()}


class IndexCatalog:
    """Index definitions of one tenant, plus the by-id operations the workers use."""

    def __init__(self, engine: Engine, tenant_id: int, tenant: str) -> None:
        self.engine = engine
        self.tenant_id = tenant_id
        self.tenant = tenant

    # -- definitions (tenant scoped) ------------------------------------------------------------------

    def create_index(
        self, spec: IndexSpec, source: SourceRecord, *, exist_ok: bool = False, generation: int = 1
    ) -> IndexRecord:
        """Create the index and its shards; `spec` must already be resolved against `source`. A reindex
        creates later generations (shoal.index.generations)."""
        with Session(self.engine) as s, s.begin():
            # The source row's key share lock until COMMIT (what the index row's foreign key takes anyway, but
            # taken first and checked): a drop or soft delete of the source committed since `source` was read is
            # seen here (NotFoundError), and one starting now waits for this insert (then drops the index too).
            live = s.scalar(
                select(DataSource.id)
                .where(DataSource.id == source.id, DataSource.deleted_at.is_(None))
                .with_for_update(read=True, key_share=True)
            )
            if live is None:
                raise NotFoundError(f"data source {source.spec.name!r} version {source.spec.version!r} not found "
                                    f"in tenant {self.tenant!r}: it was dropped or moved to the trash meanwhile")
            index_id = insert_index_rows(s, self.tenant_id, source.id, spec, generation)
        record = self.get_index(spec.name, spec.version)
        if index_id is None:
            if not exist_ok:
                raise AlreadyExistsError(f"index {spec.name!r} version {spec.version!r} already exists")
            if record.spec != spec:
                raise AlreadyExistsError(f"index {spec.name!r} version {spec.version!r} exists with another definition")
        return record

    def _row(self, s: Session, name: str, version: str) -> tuple[Index, DataSource]:
        """The live index's row with its data source's row, read in one statement; NotFoundError if absent."""
        row = s.execute(
            _with_source().where(
                Index.tenant_id == self.tenant_id,
                Index.name == name,
                Index.version == version,
                Index.deleted_at.is_(None),  # an index in the trash (with its source) is not found
            )
        ).one_or_none()
        if row is None:
            raise NotFoundError(f"index {name!r} version {version!r} not found in tenant {self.tenant!r}")
        return row[0], row[1]

    def get_index(self, name: str, version: str) -> IndexRecord:
        """The index, or NotFoundError (also when its data source is dropped meanwhile)."""
        with Session(self.engine) as s:
            return _index(s, *self._row(s, name, version), self.tenant)

    def serving(
        self, name: str, version: str, held: Collection[int] = ()
    ) -> tuple[IndexRecord, SourceRecord, dict[int, VersionRecord]]:
        """What a searcher needs to serve the index, read over one connection: the index with its shards, its
        data source, and the active versions of its shards but those in `held` (version ids it has loaded) by
        id. NotFoundError when the index or its data source is gone or in the trash."""
        with Session(self.engine) as s:
            row, source = self._row(s, name, version)
            index = _index(s, row, source, self.tenant)
            if source.deleted_at is not None:
                raise NotFoundError(f"the data source of index {name!r} version {version!r} is gone")
            wanted = {sh.active_version_id for sh in index.shards if sh.active_version_id is not None} - set(held)
            rows = s.scalars(select(IndexVersion).where(IndexVersion.id.in_(wanted))) if wanted else ()
            return index, _record(source, self.tenant), {r.id: _version(r) for r in rows}

    def list_indexes(self, source_id: int | None = None) -> list[IndexRecord]:
        """The tenant's live indexes (of one data source when `source_id` is given), by name and version."""
        with Session(self.engine) as s:
            q = _with_source().where(
                Index.tenant_id == self.tenant_id,
                Index.deleted_at.is_(None),
                # Generations built aside or kept for rollback are not indexes of their own.
                Index.version.not_like(f"%{GENERATION_MARK}%"),
            )
            if source_id is not None:
                q = q.where(Index.data_source_id == source_id)
            rows = s.execute(q.order_by(Index.name, Index.version)).all()
            return [_index(s, index, source, self.tenant) for index, source in rows]


_ALIAS_ATTEMPTS = 5  # lookups of an alias's index a burst of swaps or drops may void before set() gives up


@dataclass(frozen=True)
class AliasRecord:
    """An alias and the index it names."""

    name: str
    index_name: str
    index_version: str
    updated_at: dt.datetime


class AliasCatalog:
    """Aliases of one tenant's indexes. Moving an alias is a single UPDATE: a search resolving it sees either
    the old index or the new one, never a mix."""

    def __init__(self, engine: Engine, tenant_id: int, tenant: str) -> None:
        self.engine = engine
        self.tenant_id = tenant_id
        self.tenant = tenant

    def set(self, alias: str, index_name: str, index_version: str) -> AliasRecord:
        """Point `alias` at the index (creating the alias, or moving it atomically). The alias names the
        generation serving (name, version) when it commits, even while a reindex swaps or rolls the index back
        (the swap moves it along if it commits later); NotFoundError when no such live index exists, also when
        it is dropped meanwhile; ConflictError when the alias names an index in the trash (it comes back with
        the index's restore, so its name is not free until that is purged)."""
        check_name("alias", alias)
        for _ in range(_ALIAS_ATTEMPTS):
            if self._set_once(alias, index_name, index_version):
                return self.get(alias)
        # Each attempt lost only to a swap, rollback or drop that committed meanwhile: rare, never endless.
        raise ConflictError(f"index {index_name!r} version {index_version!r} kept changing while alias "
                            f"{alias!r} was set; try again")

    def _set_once(self, alias: str, index_name: str, index_version: str) -> bool:
        """One attempt: False (nothing written) when the index row read first no longer held the name once
        locked, because a swap, rollback or drop committed in between."""
        with Session(self.engine) as s, s.begin():
            found = s.execute(
                select(Index.id, Index.data_source_id).where(
                    Index.tenant_id == self.tenant_id,
                    Index.name == index_name,
                    Index.version == index_version,
                    Index.deleted_at.is_(None),
                )
            ).one_or_none()
            if found is None:
                raise NotFoundError(
                    f"index {index_name!r} version {index_version!r} not found in tenant {self.tenant!r}"
                )
            # Share locks until COMMIT, the source row first, then the index row: the order swaps, soft deletes
            # and drops take them in (FOR UPDATE), so one of those racing this waits for it (and then moves or
            # drops the alias with the row), or commits first, and the row read again under the lock shows it
            # (renamed to its hidden version, in the trash, or gone): then the name is looked up once more.
            # Without the lock the alias could name a generation a swap just hid, or an index a drop just
            # deleted (a foreign key violation).
            key_share = {"read": True, "key_share": True}
            s.execute(select(DataSource.id).where(DataSource.id == found.data_source_id)
                      .with_for_update(**key_share))
            held = s.scalar(
                select(Index.id).where(
                    Index.id == found.id, Index.version == index_version, Index.deleted_at.is_(None)
                ).with_for_update(**key_share)
            )
            if held is None:
                return False
            # An alias of an index in the trash is hidden, not free: taking it over here would rewrite its row,
            # and restoring the dataset would then bring it back without the alias.
            trashed = s.execute(
                select(Index.name, Index.version)
                .join(IndexAlias, IndexAlias.index_id == Index.id)
                .where(IndexAlias.tenant_id == self.tenant_id, IndexAlias.name == alias,
                       Index.deleted_at.is_not(None))
            ).one_or_none()
            if trashed is not None:
                raise ConflictError(
                    f"alias {alias!r} is taken in tenant {self.tenant!r}: it names index {trashed.name!r} version "
                    f"{trashed.version!r}, which is in the trash (the alias is hidden until that is restored, and "
                    "comes back with it); purge that from the trash first, or choose another alias name"
                )
            s.execute(
                insert(IndexAlias)
                .values(tenant_id=self.tenant_id, name=alias, index_id=held)
                .on_conflict_do_update(
                    index_elements=[IndexAlias.tenant_id, IndexAlias.name],
                    set_={"index_id": held, "updated_at": func.now()},
                )
            )
        return True

    def _query(self) -> Any:
        return (
            select(IndexAlias.name, Index.name, Index.version, IndexAlias.updated_at)
            .join(Index, Index.id == IndexAlias.index_id)
            # An alias of an index in the trash is hidden with it (and back when the index is restored).
            .where(IndexAlias.tenant_id == self.tenant_id, Index.deleted_at.is_(None))
        )

    def get(self, alias: str) -> AliasRecord:
        """The alias, or NotFoundError."""
        with Session(self.engine) as s:
            row = s.execute(self._query().where(IndexAlias.name == alias)).one_or_none()
        if row is None:
            raise NotFoundError(f"alias {alias!r} not found in tenant {self.tenant!r}")
        return AliasRecord(*row)

    def list(self) -> list[AliasRecord]:
        """Every alias of the tenant, by name."""
        with Session(self.engine) as s:
            return [AliasRecord(*r) for r in s.execute(self._query().order_by(IndexAlias.name))]

    def drop(self, alias: str) -> None:
        """Remove the alias (the index stays); NotFoundError if there is none, also when its index is in the
        trash (the alias is hidden with it, as by `get` and `list`, and comes back when the index is restored)."""
        live = select(Index.id).where(Index.tenant_id == self.tenant_id, Index.deleted_at.is_(None))
        with Session(self.engine) as s, s.begin():
            gone = s.execute(
                delete(IndexAlias).where(IndexAlias.tenant_id == self.tenant_id, IndexAlias.name == alias,
                                         IndexAlias.index_id.in_(live))
            ).rowcount
        if not gone:
            raise NotFoundError(f"alias {alias!r} not found in tenant {self.tenant!r}")


class ShardCatalog:
    """By-id access to shards for workers and searchers (ids come from tenant-scoped calls)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def shard_context(self, shard_id: int) -> tuple[ShardRecord, IndexRecord, SourceRecord]:
        """The shard, its index and its data source; NotFoundError when the shard is gone (also when its index or
        data source is dropped meanwhile)."""
        with Session(self.engine) as s:
            # One statement: a drop committing between reads would leave a shard without its index or source.
            found = s.execute(
                select(IndexShard, Index, DataSource, Tenant.name)
                .join(Index, Index.id == IndexShard.index_id)
                .join(DataSource, DataSource.id == Index.data_source_id)
                .join(Tenant, Tenant.id == Index.tenant_id)
                .where(IndexShard.id == shard_id)
            ).one_or_none()
            if found is None:
                raise NotFoundError(f"index shard {shard_id} not found")
            shard, index, source, tenant = found
            if source.deleted_at is not None:  # in the trash: no builds until it is restored
                raise NotFoundError(f"index shard {shard_id} belongs to a data source in the trash")
            return _shard(shard), _index(s, index, source, tenant), _record(source, tenant)

    def index_by_id(self, index_id: int) -> tuple[int, IndexRecord, SourceRecord] | None:
        """(tenant id, index, data source) of an index row (any generation), or None when it is gone."""
        with Session(self.engine) as s:
            found = s.execute(
                _with_source().add_columns(Tenant.name).join(Tenant, Tenant.id == Index.tenant_id)
                .where(Index.id == index_id)
            ).one_or_none()
            if found is None:
                return None
            index, source, tenant = found
            return index.tenant_id, _index(s, index, source, tenant), _record(source, tenant)

    def shards_of_source(self, source_id: int) -> list[int]:
        """Ids of every shard of every index over the data source."""
        with Session(self.engine) as s:
            return list(
                s.scalars(
                    select(IndexShard.id)
                    .join(Index, Index.id == IndexShard.index_id)
                    .where(Index.data_source_id == source_id)
                )
            )

    def all_shards(self) -> list[tuple[int, int, int]]:
        """(shard id, built watermark, data source head) of every shard, for the sweep."""
        with Session(self.engine) as s:
            rows = s.execute(
                select(IndexShard.id, IndexShard.built_watermark, DataSource.head_seq)
                .join(Index, Index.id == IndexShard.index_id)
                .join(DataSource, DataSource.id == Index.data_source_id)
                .where(DataSource.deleted_at.is_(None))
            )
            return [(r[0], r[1], r[2]) for r in rows]

    def index_lag(self, source_ids: Sequence[int] | None = None) -> dict[int, int]:
        """Data source id -> the largest lag (head - built watermark) of any shard of any serving index over it;
        every source when `source_ids` is None. Sources without one are absent. A generation a reindex builds
        aside (or keeps for rollback) is left out: it starts at watermark 0, so it held every upload to its source
        at 429 until it caught up, while the serving one kept up. So are indexes and sources in the trash: no
        worker builds them, so their lag never shrank and held intake until the trash was purged."""
        with Session(self.engine) as s:
            query = (
                select(Index.data_source_id, func.max(DataSource.head_seq - IndexShard.built_watermark))
                .select_from(IndexShard)
                .join(Index, Index.id == IndexShard.index_id)
                .join(DataSource, DataSource.id == Index.data_source_id)
                .where(
                    Index.version.not_like(f"%{GENERATION_MARK}%"),
                    Index.deleted_at.is_(None),
                    DataSource.deleted_at.is_(None),
                )
                .group_by(Index.data_source_id)
            )
            if source_ids is not None:
                query = query.where(Index.data_source_id.in_(list(source_ids)))
            return {int(r[0]): int(r[1]) for r in s.execute(query)}

    def active_version(self, shard_id: int) -> VersionRecord | None:
        """The version the shard's active pointer names, or None before the first materialization."""
        with Session(self.engine) as s:
            row = s.scalars(
                select(IndexVersion)
                .join(IndexShard, IndexShard.active_version_id == IndexVersion.id)
                .where(IndexShard.id == shard_id)
            ).one_or_none()
            return _version(row) if row is not None else None

    def acquire_lease(
        self, shard_id: int, owner: str, seconds: float, *, owner_is_dead: Callable[[str], bool] | None = None
    ) -> bool:
        """Take (or renew) the shard's build lease for `seconds`; False when another owner holds an unexpired
        one, unless `owner_is_dead` says that owner is a process that no longer runs: then its lease is
        taken over at once (by compare-and-swap on the owner, so two successors never both win).
        NotFoundError when the shard is gone (its index was dropped): there is nothing to build, and no
        other worker to wait for."""
        now = func.clock_timestamp()
        with Session(self.engine) as s, s.begin():
            taken = s.execute(
                update(IndexShard)
                .where(
                    IndexShard.id == shard_id,
                    or_(
                        IndexShard.lease_owner.is_(None),
                        IndexShard.lease_owner == owner,
                        IndexShard.lease_expires_at < now,
                    ),
                )
                .values(lease_owner=owner, lease_expires_at=now + dt.timedelta(seconds=seconds))
            ).rowcount
            if taken == 1:
                return True
            # Nothing updated: another owner holds the lease, or there is no such shard (a task queued before
            # its index was dropped), which no retry will change.
            row = s.execute(select(IndexShard.lease_owner).where(IndexShard.id == shard_id)).one_or_none()
            if row is None:
                raise NotFoundError(f"index shard {shard_id} not found")
            holder = row[0]
            if owner_is_dead is None or holder is None or not owner_is_dead(holder):
                return False
            taken = s.execute(
                update(IndexShard)
                .where(IndexShard.id == shard_id, IndexShard.lease_owner == holder)
                .values(lease_owner=owner, lease_expires_at=now + dt.timedelta(seconds=seconds))
            ).rowcount
        if taken == 1:
            log.warning("index shard %s: took over the build lease of %s, a process that no longer runs",
                        shard_id, holder)
        return taken == 1

    def renew_lease(self, shard_id: int, owner: str, seconds: float) -> bool:
        """Extend `owner`'s lease to `seconds` from now; False when `owner` no longer holds it (another worker
        took it over, or it was released), and then nothing changes."""
        now = func.clock_timestamp()
        with Session(self.engine) as s, s.begin():
            renewed = s.execute(
                update(IndexShard)
                .where(IndexShard.id == shard_id, IndexShard.lease_owner == owner)
                .values(lease_expires_at=now + dt.timedelta(seconds=seconds))
            ).rowcount
            return renewed == 1

    def lease_holder(self, shard_id: int) -> tuple[str | None, float | None]:
        """(owner, seconds until its lease expires) of the shard's lease; (None, None) when none is held."""
        with Session(self.engine) as s:
            row = s.execute(
                select(
                    IndexShard.lease_owner,
                    func.extract("epoch", IndexShard.lease_expires_at - func.clock_timestamp()),
                ).where(IndexShard.id == shard_id)
            ).one_or_none()
        if row is None or row[0] is None:
            return None, None
        return row[0], (float(row[1]) if row[1] is not None else None)

    def release_lease(self, shard_id: int, owner: str) -> None:
        """Give the lease back if `owner` still holds it."""
        with Session(self.engine) as s, s.begin():
            s.execute(
                update(IndexShard)
                .where(IndexShard.id == shard_id, IndexShard.lease_owner == owner)
                .values(lease_owner=None, lease_expires_at=None)
            )

    def publish_version(
        self,
        shard_id: int,
        expected_active: int | None,
        generation: int,
        watermark: int,
        manifest: dict[str, Any],
        *,
        files: Collection[str],
        precondition: Callable[[Connection], bool] | None = None,
        lease_owner: str | None = None,
    ) -> int | None:
        """Insert a version naming `files` (every path its manifest references, recorded in `index_files`)
        and move the shard's active pointer to it by compare-and-swap, all in one transaction.

        Returns the new version id, or None when the pointer no longer names `expected_active` (someone
        else published first), when `lease_owner` is given and no longer holds the shard's lease (another
        worker took it over: its build will publish instead), or when `precondition`, asked last inside the
        transaction, says no; nothing was changed then. NotFoundError when the shard is gone (its index, a
        reindex's generation or its data source was dropped while the build ran): there is nothing to publish to.
        """
        with Session(self.engine) as s:
            # The lock the version's foreign key takes anyway, taken first so that a shard deleted meanwhile is
            # seen as gone instead of failing the insert (an IntegrityError). A drop holds the shard rows
            # (FOR UPDATE, `gc_queue.lock_shards`) until it commits: this waits for it, then finds no row; a
            # drop starting after this holds the lock waits until the publish committed (and lists its files).
            if s.execute(
                select(IndexShard.id).where(IndexShard.id == shard_id).with_for_update(read=True, key_share=True)
            ).one_or_none() is None:
                raise NotFoundError(f"index shard {shard_id} not found (dropped while this build ran)")
            version_id = s.execute(
                insert(IndexVersion)
                .values(
                    shard_id=shard_id,
                    parent_id=expected_active,
                    generation=generation,
                    watermark=watermark,
                    manifest=manifest,
                )
                .returning(IndexVersion.id)
            ).scalar_one()
            pointer = (
                IndexShard.active_version_id.is_(None)
                if expected_active is None
                else IndexShard.active_version_id == expected_active
            )
            guard = [IndexShard.lease_owner == lease_owner] if lease_owner is not None else []
            moved = s.execute(
                update(IndexShard)
                .where(IndexShard.id == shard_id, pointer, *guard)
                .values(active_version_id=version_id, built_watermark=watermark)
            ).rowcount
            if moved != 1 or (precondition is not None and not precondition(s.connection())):
                s.rollback()  # the version row goes too: it was never active
                return None
            if files:  # GC's reference check: a file no kept version lists here may be collected
                s.execute(insert(IndexFile), [{"version_id": version_id, "path": p} for p in sorted(set(files))])
            s.commit()
            return int(version_id)

    def mark_served_many(self, watermarks: Mapping[int, int]) -> None:
        """Record that a searcher now serves each shard (shard id: watermark) at its watermark, never moving one
        backwards; one transaction, its statements sent at once."""
        if not watermarks:
            return
        shards = IndexShard.__table__
        stmt = (
            update(shards)
            .where(shards.c.id == bindparam("shard"), shards.c.served_watermark <= bindparam("mark"))
            .values(served_watermark=bindparam("mark"), served_at=func.clock_timestamp())
        )
        # By shard id: searchers marking the same shards at once take their row locks in one order (no deadlock).
        rows = [{"shard": shard, "mark": mark} for shard, mark in sorted(watermarks.items())]
        with Session(self.engine) as s, s.begin():
            s.execute(stmt, rows)


def freshness_rows(engine: Engine) -> list[tuple[str, str, str, int, int, int, int, bool]]:
    """(tenant, index, version, shard, head, built, served, building) of the shards of every live index's
    serving generation (`building` False) and of every generation a running reindex builds (`building` True,
    under its hidden version `{version}~g{n}`): for the metrics endpoint and the health report.

    Generations kept for rollback or for a tag are left out, and so are indexes in the trash: no searcher
    serves them, so their served watermark stays where it was and head minus it says nothing of what searches
    answer. A building generation is not served either (its served lag means nothing); its built lag is work
    the workers owe, which the caller may count."""
    from shoal.catalog.models import ReindexJob  # here: only this query needs the jobs

    building = (
        select(ReindexJob.id)
        .where(ReindexJob.to_index_id == Index.id, ReindexJob.state == "building")
        .exists()
    )
    with Session(engine) as s:
        rows = s.execute(
            select(
                Tenant.name, Index.name, Index.version, IndexShard.shard_no, DataSource.head_seq,
                IndexShard.built_watermark, IndexShard.served_watermark, building,
            )
            .join(Index, Index.id == IndexShard.index_id)
            .join(Tenant, Tenant.id == Index.tenant_id)
            .join(DataSource, DataSource.id == Index.data_source_id)
            .where(
                DataSource.deleted_at.is_(None),
                Index.deleted_at.is_(None),
                # Hidden generations (see list_indexes) only while a reindex builds them.
                or_(Index.version.not_like(f"%{GENERATION_MARK}%"), building),
            )
        )
        return [(*r[:7], bool(r[7])) for r in rows]  # type: ignore[misc]
