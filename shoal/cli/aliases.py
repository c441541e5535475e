"""`shoal alias set | get | list | drop`: names that point at one index and move atomically."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from shoal.catalog.indexes import AliasRecord
from shoal.cli.common import AsJson, Tenant, open_shoal, out, typer_app
from shoal.cli.formatting import echo_json

alias_app = typer_app("Index aliases: a name searches may use, pointing at one index (name, version).")

Alias = Annotated[str, typer.Argument(help="Alias name, e.g. packages-live.")]


def _json(r: AliasRecord) -> dict[str, str]:
    return {"name": r.name, "index_name": r.index_name, "index_version": r.index_version,
            "updated_at": r.updated_at.isoformat()}


@alias_app.command("set")
def alias_set(
    alias: Alias,
    index_name: Annotated[str, typer.Argument(help="Index name.")],
    index_version: Annotated[str, typer.Argument(help="Index version.")],
    tenant: Tenant = None,
) -> None:
    """Point ALIAS at an index: creates it, or moves it in one atomic step."""
    with open_shoal(tenant, existing=True) as shoal:
        r = shoal.set_alias(alias, index_name, index_version)
    out.print(f"alias {r.name} -> index {r.index_name}/{r.index_version}")


@alias_app.command("get")
def alias_get(alias: Alias, tenant: Tenant = None, as_json: AsJson = False) -> None:
    """The index ALIAS names."""
    with open_shoal(tenant, existing=True) as shoal:
        r = shoal.get_alias(alias)
    if as_json:
        echo_json(_json(r))
    else:
        out.print(f"alias {r.name} -> index {r.index_name}/{r.index_version} (since {r.updated_at:%Y-%m-%d %H:%M:%S})")


@alias_app.command("list")
def alias_list(tenant: Tenant = None, as_json: AsJson = False) -> None:
    """Every alias of the tenant."""
    with open_shoal(tenant, existing=True) as shoal:
        rows = shoal.list_aliases()
    if as_json:
        echo_json([_json(r) for r in rows])
        return
    table = Table(title=f"Aliases ({len(rows)})")
    for col in ("alias", "index", "version", "updated at"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.name, r.index_name, r.index_version, f"{r.updated_at:%Y-%m-%d %H:%M:%S}")
    out.print(table)


@alias_app.command("drop")
def alias_drop(alias: Alias, tenant: Tenant = None) -> None:
    """Remove ALIAS (the index stays)."""
    with open_shoal(tenant, existing=True) as shoal:
        shoal.drop_alias(alias)
    out.print(f"alias {alias} dropped")
