"""The `shoal` command line: data sources, bulk import, the log, indexes, search, freshness, the worker, the
embedded servers, settings, the demo.

Every command reads its settings from SHOAL_* environment variables (and SHOAL_CONFIG or ./shoal.toml);
`--tenant` overrides the tenant. Errors Shoal raises on purpose are printed as one red line on stderr with
exit code 1; bad usage exits with 2. This module only assembles `app` (the `shoal` console script) from
the command modules beside it.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Annotated

import typer

from shoal.cli.aliases import alias_app
from shoal.cli.api import api
from shoal.cli.apply import apply
from shoal.cli.common import fit_consoles, typer_app
from shoal.cli.consume import consume
from shoal.cli.demo import demo
from shoal.cli.flower import FLOWER_CONTEXT, flower
from shoal.cli.imports import import_file
from shoal.cli.indexes import index_app
from shoal.cli.maintenance import gc, log_app
from shoal.cli.migrate import migrate_command
from shoal.cli.reindex import reindex, rollback
from shoal.cli.search import search
from shoal.cli.server import server_app, settings_command
from shoal.cli.sources import source_app
from shoal.cli.status import status
from shoal.cli.tenants import key_app, tenant_app
from shoal.cli.trash import trash_app
from shoal.cli.up import up
from shoal.cli.worker import worker

__all__ = ["app"]

app = typer_app("Shoal: an event-driven ingestion pipeline for vector data.")
app.add_typer(source_app, name="source")
app.add_typer(index_app, name="index")
app.add_typer(alias_app, name="alias")
app.add_typer(server_app, name="server")
app.add_typer(tenant_app, name="tenant")
app.add_typer(key_app, name="key")
app.add_typer(trash_app, name="trash")
app.command("import")(import_file)
app.add_typer(log_app, name="log")
app.command("gc")(gc)
app.command("search")(search)
app.command("reindex")(reindex)
app.command("rollback")(rollback)
app.command("status")(status)
app.command("worker")(worker)
app.command("up")(up)
app.command("flower", context_settings=FLOWER_CONTEXT)(flower)
app.command("settings")(settings_command)
app.command("migrate")(migrate_command)
app.command("demo")(demo)
app.command("api")(api)
app.command("apply")(apply)
app.command("consume")(consume)


def _version(value: bool) -> None:
    if value:
        try:
            typer.echo(f"shoal {package_version('shoal')}")
        except PackageNotFoundError:  # pragma: no cover - only when run from a source tree
            typer.echo("shoal (not installed)")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Shoal: an event-driven ingestion pipeline for vector data.

    Settings come from SHOAL_* environment variables and an optional TOML file (SHOAL_CONFIG, else
    ./shoal.toml); see `shoal settings`.
    """
    fit_consoles()
