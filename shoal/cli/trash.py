"""`shoal trash list | restore NAME | purge [--now]`: the tenant's soft-deleted datasets (and data sources).

`DELETE /api/v1/datasets/{id}` moves a dataset to the trash; these commands list it, restore it while its
retention lasts, or purge what is due (beat's `purge_trash` does that for every tenant on its own).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated, Any

import typer

from shoal.cli.common import AsJson, Tenant, open_shoal, out, typer_app
from shoal.cli.formatting import count, echo_json, print_listing, when
from shoal.client import Shoal
from shoal.errors import NotFoundError
from shoal.upkeep.trash import Trash, TrashedSource, due_sources, purge_due

trash_app = typer_app("List, restore and purge the tenant's soft-deleted datasets.")

MARKER = "shoal.dataset"  # the dataset definition's key in custom metadata (shoal.datasets.catalog.MARKER)


def _trash(shoal: Shoal) -> Trash:
    return Trash(shoal.engine, shoal.catalog.tenant_id, shoal.tenant)


def _json(t: TrashedSource) -> dict[str, Any]:
    return {
        "trash_id": t.id,
        "tenant": t.tenant,
        "name": t.spec.name,
        "version": t.spec.version,
        "dataset": MARKER in t.spec.custom_metadata,
        "indexes": [f"{n}/{v}" for n, v in t.indexes],
        "head_seq": t.head_seq,
        "created_at": t.created_at.isoformat(),
        "deleted_at": t.deleted_at.isoformat(),
        "purge_after": t.purge_after.isoformat(),
    }


def _api_caches(shoal: Shoal) -> bool:
    """Whether an API server may cache the tenant's datasets: in the configured broker, or else in the data dir's
    embedded Valkey while it runs (when it does not, nothing is cached there, and none is started just for this)."""
    if shoal.settings.redis_url:
        return True
    from shoal.cli.probes import embedded_valkey_status

    return embedded_valkey_status(shoal.settings.data_dir)[0] == "running"


@contextlib.contextmanager
def _dataset_service(shoal: Shoal) -> Iterator[Any]:
    """The dataset service of the tenant, with the API's Redis cache (the configured broker, or the embedded
    Valkey `shoal up` and `shoal api` cache in), so servers do not serve a stale list, and a searcher that never
    polls."""
    from shoal.datasets.cache import DatasetCache
    from shoal.datasets.service import DatasetService

    searcher = shoal.searcher(follow=False)
    # The broker's URL is the one the API's cache uses (for the embedded Valkey: found running, not started).
    cache = DatasetCache(shoal.broker_url) if _api_caches(shoal) else None
    try:
        yield DatasetService(shoal, searcher, cache)
    finally:
        searcher.close()
        if cache is not None:
            cache.close()


@trash_app.command("list")
def trash_list(as_json: AsJson = False, tenant: Tenant = None) -> None:
    """List what is in the tenant's trash, most recently deleted first, with when each is purged."""
    with open_shoal(tenant, existing=True) as shoal:
        items = _trash(shoal).list()
        tenant_name = shoal.tenant
    names = ("trash id", "name", "version", "kind", "entries", "deleted at", "purge after")
    print_listing(
        items, as_json=as_json, to_json=_json,
        empty=f"The trash of tenant {tenant_name!r} is empty.", title=f"Trash of tenant {tenant_name!r}",
        columns=[(n, "right" if n in ("trash id", "entries") else "left") for n in names],
        row=lambda t: [
            str(t.id), t.spec.name, t.spec.version, "dataset" if MARKER in t.spec.custom_metadata else "data source",
            count(t.head_seq), when(t.deleted_at), when(t.purge_after),
        ],
    )


@trash_app.command("restore")
def trash_restore(
    name: Annotated[str, typer.Argument(help="Name of the dataset (or data source) to restore.")],
    version: Annotated[str | None, typer.Option("--version", help="Data source version (default: any).")] = None,
    trash_id: Annotated[
        int | None, typer.Option("--trash-id", help="Which one, when several of that name are in the trash.")
    ] = None,
    tenant: Tenant = None,
) -> None:
    """Restore the most recently deleted dataset of that name (or the one --trash-id names). Fails if the name
    was taken meanwhile or its retention ended."""
    with open_shoal(tenant, existing=True) as shoal:
        trash = _trash(shoal)
        items = [t for t in trash.list(name)
                 if (version is None or t.spec.version == version) and (trash_id is None or t.id == trash_id)]
        if not items:
            raise NotFoundError(f"nothing named {name!r} in the trash of tenant {shoal.tenant!r}"
                                + (f" with trash id {trash_id}" if trash_id is not None else ""))
        chosen = items[0]
        if MARKER in chosen.spec.custom_metadata:
            with _dataset_service(shoal) as svc:
                svc.restore(name, chosen.id)
        else:
            trash.restore(chosen.id)
        tenant_name = shoal.tenant
    out.print(f"Restored {name}/{chosen.spec.version} (trash id {chosen.id}) in tenant {tenant_name!r}.")


@trash_app.command("purge")
def trash_purge(
    now: Annotated[bool, typer.Option("--now", help="Purge everything in the trash, retention or not.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation (with --now).")] = False,
    as_json: AsJson = False,
    tenant: Tenant = None,
) -> None:
    """Delete for good the datasets whose retention ended (with --now: all of the trash): rows, then files."""
    with open_shoal(tenant, existing=True) as shoal:
        trash = _trash(shoal)
        items = trash.list()
        if now:
            if items and not yes:
                typer.confirm(f"Delete for good the {len(items)} datasets in the trash of tenant {shoal.tenant!r}?",
                              abort=True, err=True)
            result = trash.purge(shoal.storage, redis_client=shoal.runtime.redis_if_any(),
                                 lock_timeout_ms=shoal.settings.lock_timeout_ms)
        else:
            result = purge_due(shoal.engine, shoal.storage, source_ids=due_sources(shoal.engine, [t.id for t in items]),
                               redis_client=shoal.runtime.redis_if_any())
        left = len(trash.list())
        tenant_name = shoal.tenant
    if as_json:
        echo_json(result.to_json() | {"left_in_trash": left})
        return
    for t, name, version, source_id in result.sources:
        out.print(f"Purged {name}/{version} (trash id {source_id}) of tenant {t!r}.")
    out.print(f"{len(result.sources)} purged, {result.files} files deleted; "
              f"{left} left in the trash of tenant {tenant_name!r}.")
