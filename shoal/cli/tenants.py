"""`shoal tenant create | list` and `shoal key create | list | revoke`: tenants and their API keys.

These are operator commands: whoever can reach the catalog can run them, so they take tenant names
explicitly instead of authenticating. `key create` prints the key itself alone on stdout (so
`KEY=$(shoal key create ...)` captures it) and everything else on stderr; the key cannot be shown again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from shoal.auth import KeyRecord, Role, create_key, create_tenant, list_keys, list_tenants, revoke_key
from shoal.auth.cache import CACHE_TTL_S
from shoal.catalog.db import ensure_schema, make_engine, resolve_database_url
from shoal.cli.common import AsJson, err, first_line, load_settings, out, typer_app
from shoal.cli.formatting import echo_json, when
from shoal.config.settings import mask_url
from shoal.errors import ConfigurationError

tenant_app = typer_app("Create and list tenants.")
key_app = typer_app("Create, list and revoke the API keys of tenants.")

KeyTenant = Annotated[str, typer.Option("--tenant", help="Tenant the key belongs to.")]


@contextlib.contextmanager
def catalog_engine() -> Iterator[Engine]:
    """An engine on the configured (migrated) catalog, without touching any tenant; disposed afterwards."""
    # Not open_shoal(): a Shoal creates its tenant on first use, and `tenant create` must see it absent.
    settings = load_settings()
    url = resolve_database_url(settings)
    engine = make_engine(url)
    try:
        try:
            ensure_schema(engine, url, auto_migrate=settings.database_url is None)
        except OperationalError as exc:
            raise ConfigurationError(f"cannot reach the catalog at {mask_url(url)}: {first_line(exc)}") from None
        yield engine
    finally:
        engine.dispose()


def _key_json(record: KeyRecord) -> dict[str, object]:
    return {
        "key_id": record.key_id,
        "tenant": record.tenant,
        "role": record.role.value,
        "name": record.name,
        "created_at": record.created_at.isoformat(),
        "last_used_at": record.last_used_at.isoformat() if record.last_used_at else None,
        "revoked_at": record.revoked_at.isoformat() if record.revoked_at else None,
    }


@tenant_app.command("create")
def tenant_create(
    name: Annotated[str, typer.Argument(help="Tenant name: lower-case letters, digits, '_' and '-'.")],
) -> None:
    """Create a tenant (an error if it exists already)."""
    with catalog_engine() as engine:
        tenant_id = create_tenant(engine, name)
    out.print(f"Tenant [bold]{escape(name)}[/] created (id {tenant_id}).", markup=True)


@tenant_app.command("list")
def tenant_list(as_json: AsJson = False) -> None:
    """List every tenant with its number of unrevoked API keys."""
    with catalog_engine() as engine:
        tenants = list_tenants(engine)
    if as_json:
        echo_json([
            {"id": t.id, "name": t.name, "created_at": t.created_at.isoformat(), "active_keys": t.active_keys}
            for t in tenants
        ])
        return
    table = Table("tenant", "id", "created", "active keys", title_justify="left")
    for t in tenants:
        table.add_row(t.name, str(t.id), when(t.created_at), str(t.active_keys))
    out.print(table)


@key_app.command("create")
def key_create(
    tenant: KeyTenant,
    role: Annotated[Role, typer.Option("--role", case_sensitive=False, help="What the key may do.")],
    name: Annotated[str, typer.Option("--name", help="A label saying who or what uses the key.")] = "",
) -> None:
    """Create an API key and print it once: it is stored hashed and cannot be shown again."""
    with catalog_engine() as engine:
        record, plaintext = create_key(engine, tenant, role, name)
    # The secret first, plainly: it exists nowhere else, so nothing printed before it may stand in its way.
    typer.echo(plaintext)
    err.print(
        f"API key [bold]{escape(record.key_id)}[/] created for tenant [bold]{escape(tenant)}[/] with role "
        f"{record.role.value}" + (f" ({escape(name)})" if name else "") + ".",
        markup=True,
    )
    err.print(
        "[bold yellow]Store the key now: it cannot be shown again.[/] "
        "Send it as the header 'Authorization: ApiKey <key>'.",
        markup=True,
    )


@key_app.command("list")
def key_list(tenant: KeyTenant, as_json: AsJson = False) -> None:
    """List a tenant's API keys (never their secrets), revoked ones included."""
    with catalog_engine() as engine:
        keys = list_keys(engine, tenant)
    if as_json:
        echo_json([_key_json(k) for k in keys])
        return
    table = Table("key id", "role", "name", "created", "last used", "revoked", title=f"API keys of {tenant}",
                  title_justify="left")
    for k in keys:
        table.add_row(k.key_id, k.role.value, k.name or "-", when(k.created_at), when(k.last_used_at),
                      when(k.revoked_at))
    out.print(table)


@key_app.command("revoke")
def key_revoke(key_id: Annotated[str, typer.Argument(help="The key id (the 12 hex digits after 'shoal_').")]) -> None:
    """Revoke an API key for good; running services stop accepting it within the key cache's TTL."""
    with catalog_engine() as engine:
        record = revoke_key(engine, key_id)
    out.print(
        f"API key [bold]{escape(record.key_id)}[/] of tenant [bold]{escape(record.tenant)}[/] revoked at "
        f"{when(record.revoked_at)}; "
        f"running services stop accepting it within {CACHE_TTL_S:.0f} s.",
        markup=True,
    )
