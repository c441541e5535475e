"""What a data source or an index deleted for good leaves behind outside its own rows, and its removal.

Two kinds of leftovers, which nothing else expires:

- A data source's two Redis keys: its announced head (`shoal:head:<id>`, `shoal.log.heads.head_key`, set by every
  commit) and its index token (`shoal:indexes:<id>`, `shoal.searcher.announce.index_token_key`, set anew by every
  index drop, swap and rollback, and by the announcement of the source's own drop). `forget_source_keys` deletes
  them when a trash purge deletes the source's rows (the soft delete announced the drop before); those of a
  source deleted for good otherwise (a hard delete, an owner's drop, whose announcement follows the drop) go with
  the next full purge's `sweep`. Harmless to searchers: a strong search that reads no head asks the catalog, which
  answers NotFoundError for a deleted source (`shoal.searcher.searcher`), and a searcher stops serving the
  source's indexes when the drop's announcement (or its poll) tells it. Never for a source in the trash: a
  restore brings it back under the same id, with its keys.
- The reindex jobs of an index dropped for good: `shoal.index.generations.forget_jobs` marks them (with the time
  of the drop) and the deletion of the index rows leaves both their generation links NULL. They stay readable
  by id for JOB_RETENTION (7 days; no setting has that meaning: SHOAL_REINDEX_KEEP_S is how long a replaced
  generation is kept for rollback) after they ended and after the drop, then `sweep_jobs` deletes them. A live
  index's own jobs whose generations were swept link none either; those stay (its `jobs` lists them).

`sweep` is the backstop, run by every full trash purge (beat's `purge_trash`, every SHOAL_PURGE_INTERVAL_S): it
deletes the keys of every id no data_sources row has (live or in the trash): those a best-effort deletion missed
(Redis away), those set again after it (an announcement that trailed the drop), those of sources deleted before
this existed or with their tenant; and the jobs past their retention. A data source created meanwhile keeps its
keys: its row commits before its first key is set (the head is announced after the commit), and a key is looked
up in the catalog only after the scan found it, so the row of any key found is already visible. Ids are never
reused, so a key of a deleted id never belongs to a live source.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis
from sqlalchemy import DateTime, Engine, case, cast, delete, exists, func, or_, select

from shoal.catalog.models import DataSource, Index, ReindexJob
from shoal.index.generations import DROPPED, HIDDEN
from shoal.log.heads import head_key
from shoal.searcher.announce import index_token_key

log = logging.getLogger(__name__)

JOB_RETENTION = dt.timedelta(days=7)  # how long a dropped index's job stays readable by id
_KEYS_OF: tuple[Callable[[int], str], ...] = (head_key, index_token_key)  # a data source's keys: `<prefix><id>`
_BATCH = 500  # keys looked up in the catalog (and deleted) at once


@dataclass(frozen=True)
class Swept:
    """What one backstop run deleted."""

    keys: int  # Redis keys of data sources no row has
    jobs: int  # reindex jobs of dropped indexes past JOB_RETENTION


def source_keys(source_id: int) -> list[str]:
    """The Redis keys of a data source: its announced head and its index token."""
    return [key_of(source_id) for key_of in _KEYS_OF]


def forget_source_keys(client: redis.Redis | None, source_ids: Iterable[int]) -> int:
    """Delete the Redis keys of data sources whose rows were deleted for good (never of one in the trash), after
    any announcement of their drop was published; how many keys went. Best effort: with no client, or Redis
    away (logged), none go, and the next full purge's `sweep` deletes them."""
    ids = sorted(set(source_ids))
    if client is None or not ids:
        return 0
    try:
        return int(client.delete(*(key for source_id in ids for key in source_keys(source_id))))
    except (redis.RedisError, OSError) as exc:
        log.warning("could not delete the Redis keys of deleted data sources %s (the next purge will): %s", ids, exc)
        return 0


def sweep(engine: Engine, client: redis.Redis | None, retention: dt.timedelta = JOB_RETENTION) -> Swept:
    """The backstop: delete the Redis keys of ids no data_sources row has (`sweep_keys`; skipped without a
    client, and, logged, while Redis is away) and the jobs of dropped indexes past `retention` (`sweep_jobs`)."""
    keys = 0
    if client is not None:
        try:
            keys = sweep_keys(engine, client)
        except (redis.RedisError, OSError) as exc:
            log.warning("could not sweep the Redis keys of deleted data sources (the next purge will): %s", exc)
    return Swept(keys, sweep_jobs(engine, retention))


def sweep_keys(engine: Engine, client: redis.Redis) -> int:
    """Delete the head and index-token keys whose data source id has no data_sources row (live or in the
    trash); how many went. Raises redis.RedisError when Redis does not answer."""
    deleted = 0
    for key_of in _KEYS_OF:
        prefix = key_of(0)[:-1]
        found: list[str] = []
        for key in client.scan_iter(match=f"{prefix}*", count=_BATCH):
            found.append(key.decode() if isinstance(key, bytes) else str(key))
            if len(found) >= _BATCH:
                deleted += _delete_orphans(engine, client, prefix, found)
                found = []
        deleted += _delete_orphans(engine, client, prefix, found)
    return deleted


def _delete_orphans(engine: Engine, client: redis.Redis, prefix: str, keys: list[str]) -> int:
    """Of `keys` (`<prefix><id>`, read from Redis before this), delete those whose id has no data_sources row."""
    ids = {int(k[len(prefix):]): k for k in keys if k[len(prefix):].isascii() and k[len(prefix):].isdigit()}
    if not ids:
        return 0
    with engine.connect() as conn:  # after the scan: the row of a key found is visible (see the module doc)
        rows = set(conn.scalars(select(DataSource.id).where(DataSource.id.in_(list(ids)))))
    gone = sorted(set(ids) - rows)
    if not gone:
        return 0
    count = int(client.delete(*(ids[i] for i in gone)))
    log.info("leftovers: deleted %d Redis keys %s* of deleted data sources (ids %s%s)", count, prefix, gone[:20],
             " ..." if len(gone) > 20 else "")
    return count


def sweep_jobs(engine: Engine, retention: dt.timedelta = JOB_RETENTION) -> int:
    """Delete the reindex jobs of indexes dropped for good that ended, and were dropped, longer than `retention`
    ago: both generation links NULL, and marked as a dropped index's (`forget_jobs`) or of an index no row of the
    name holds any more (dropped before the mark existed). How many. Jobs of a live index or of one in the trash
    stay, as does one still building."""
    mark = ReindexJob.definition[DROPPED]
    # The time of the drop, which forget_jobs writes as the mark (marks of before hold `true`: the job's own
    # times decide alone then). GREATEST ignores NULLs.
    dropped_at = case(
        (func.jsonb_typeof(mark) == "string", cast(ReindexJob.definition[DROPPED].astext, DateTime(timezone=True))),
        else_=None,
    )
    last = func.greatest(ReindexJob.finished_at, ReindexJob.updated_at, dropped_at)
    # An index row of the job's name (serving version or a generation `{version}~g{n}`), live or in the trash.
    # `startswith` over a column is a LIKE: a `_` or `%` in the version may match more rows, so keep more jobs.
    named = exists().where(
        Index.tenant_id == ReindexJob.tenant_id, Index.name == ReindexJob.index_name,
        or_(Index.version == ReindexJob.index_version, Index.version.startswith(ReindexJob.index_version + HIDDEN)),
    )
    with engine.begin() as conn:
        ids = list(conn.scalars(
            delete(ReindexJob)
            .where(
                ReindexJob.from_index_id.is_(None), ReindexJob.to_index_id.is_(None), ReindexJob.state != "building",
                last < func.now() - retention,
                or_(ReindexJob.definition.has_key(DROPPED), ~named),
            )
            .returning(ReindexJob.id)
        ))
    if ids:
        log.info("leftovers: deleted %d reindex jobs of dropped indexes, ended more than %s ago (ids %s%s)",
                 len(ids), retention, sorted(ids)[:20], " ..." if len(ids) > 20 else "")
    return len(ids)
