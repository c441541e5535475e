"""`shoal server start | stop | status` and `shoal settings`: where Shoal runs and how it is configured."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from shoal.cli.common import AsJson, load_settings, out, typer_app
from shoal.cli.formatting import echo_json
from shoal.cli.probes import database_status, embedded_postgres_status, embedded_valkey_status, redis_status
from shoal.config.settings import Settings, config_file, mask_url

server_app = typer_app("The embedded Postgres (catalog) and Valkey (broker) of SHOAL_DATA_DIR.")


@server_app.command("start")
def server_start() -> None:
    """Start (or find running) the embedded Postgres and Valkey of SHOAL_DATA_DIR and print their URLs.

    Servers configured with SHOAL_DATABASE_URL or SHOAL_REDIS_URL are used instead and not started.
    """
    from shoal.servers.embedded import ensure_postgres, ensure_valkey

    settings = load_settings()
    if settings.database_url:
        out.print(f"catalog: uses SHOAL_DATABASE_URL {mask_url(settings.database_url)} (no embedded Postgres)")
    else:
        out.print(f"catalog: embedded Postgres running at {ensure_postgres(settings.data_dir)}")
    if settings.redis_url:
        out.print(f"broker:  uses SHOAL_REDIS_URL {mask_url(settings.redis_url)} (no embedded Valkey)")
    else:
        out.print(f"broker:  embedded Valkey running at {mask_url(ensure_valkey(settings.data_dir))}")
    storage = settings.resolved_storage_uri  # an s3:// URI masked (a local path is no URL: shown as it is)
    out.print(f"storage: {mask_url(storage) if storage.startswith('s3://') else storage}")


@server_app.command("stop")
def server_stop() -> None:
    """Stop the embedded Postgres and Valkey of SHOAL_DATA_DIR (every shoal process using them loses them)."""
    from shoal.servers.embedded import stop_embedded

    settings = load_settings()
    stale: list[str] = []
    stopped = stop_embedded(settings.data_dir, stale=stale)
    if stopped:
        out.print(f"Stopped {' and '.join(stopped)} under {settings.data_dir}.")
    for name in stale:
        out.print(f"{name}: not running (stale pid file removed) under {settings.data_dir}.")
    if not stopped and not stale:
        out.print(f"No embedded server was running under {settings.data_dir}.")
    configured = [k for k, v in (("SHOAL_DATABASE_URL", settings.database_url),
                                 ("SHOAL_REDIS_URL", settings.redis_url)) if v]
    if configured:
        out.print(f"Servers configured with {' and '.join(configured)} are not managed by shoal and keep running.")


@server_app.command("status")
def server_status() -> None:
    """Show whether the catalog and the broker are up (embedded or configured) and where storage is."""
    settings = load_settings()
    table = Table(title=f"Servers (data dir {settings.data_dir})", title_justify="left")
    for column in ("component", "mode", "state", "address"):
        table.add_column(column, overflow="fold")
    if settings.database_url:
        table.add_row("catalog", "configured", database_status(settings), mask_url(settings.database_url))
    else:
        table.add_row("catalog", "embedded Postgres", *embedded_postgres_status(settings.data_dir))
    if settings.redis_url:
        table.add_row("broker", "configured", redis_status(settings.redis_url), mask_url(settings.redis_url))
    else:
        table.add_row("broker", "embedded Valkey", *embedded_valkey_status(settings.data_dir))
    storage = settings.resolved_storage_uri
    s3 = storage.startswith("s3://")
    table.add_row("storage", "S3" if s3 else "local", "-" if s3 else ("exists" if Path(storage).is_dir() else "absent"),
                  mask_url(storage) if s3 else storage)
    out.print(table)


def settings_command(as_json: AsJson = False) -> None:
    """Print the effective settings (environment, then config file, then defaults); secrets masked."""
    shown = load_settings().describe()
    if as_json:
        echo_json(shown)
        return
    config = config_file()
    table = Table(title=f"Settings (config file: {config if config else 'none'})", title_justify="left")
    table.add_column("setting", style="bold")
    table.add_column("value", overflow="fold")
    table.add_column("environment variable")
    table.add_column("meaning")
    fields = Settings.model_fields
    for key, value in shown.items():
        info = fields.get(key)
        table.add_row(
            key,
            "(unset)" if value is None else str(value),
            f"SHOAL_{key.upper()}",
            (info.description or "") if info else "",
        )
    out.print(table)
