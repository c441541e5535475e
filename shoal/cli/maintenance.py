"""`shoal log` (show, compact, expire) and `shoal gc`: the log's upkeep from the command line.

`shoal log NAME VERSION` still shows the log: a first argument naming no subcommand (a NAME or an option of
`show`, such as --tenant) means `show` (a data source literally named `compact` or `expire` is shown with
`shoal log show ...`).
"""

from __future__ import annotations

from typing import Annotated, Any

import click
import typer
from rich.table import Table
from typer.core import TyperGroup

from shoal.cli.common import AsJson, Name, ShoalTyper, Tenant, open_shoal, out
from shoal.cli.formatting import count, echo_json, size
from shoal.cli.logview import log


class _LogGroup(TyperGroup):
    """A group whose first argument, unless it names a subcommand or asks for the group's help, starts the
    `show` command's arguments: its NAME, or one of its options (`shoal log --tenant t NAME VERSION`)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # The group's only option of its own is --help; any other option belongs to `show`.
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = ["show", *args]
        return super().parse_args(ctx, args)


log_app = ShoalTyper(
    cls=_LogGroup,
    help="A data source's log: show it (`shoal log NAME VERSION`), compact it, expire old points.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    rich_markup_mode="markdown",
)
log_app.command("show")(log)

Version = Annotated[str, typer.Argument(help="Data source version.")]


def _print(title: str, rows: dict[str, Any]) -> None:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, value in rows.items():
        table.add_row(key, value if isinstance(value, str) else count(int(value)))
    out.print(table)


@log_app.command("compact")
def compact(name: Name, version: Version, as_json: AsJson = False, tenant: Tenant = None) -> None:
    """Compact the log now: keep the latest entry per key (seqs unchanged), drop tombstones older than
    SHOAL_TOMBSTONE_RETENTION_S, merge small segments; never above the lowest index watermark."""
    with open_shoal(tenant, existing=True) as shoal:
        result = shoal.compact(name, version)
    if as_json:
        echo_json(result.to_json())
        return
    what = "nothing worth rewriting" if not result.changed else "compacted"
    if result.raced:
        what = "another compaction won the race; nothing changed"
    _print(
        f"Compaction of {name}/{version} up to seq {result.bound}: {what}",
        {
            "segments before": result.segments_before,
            "segments after": result.segments_after,
            "segments rewritten": result.segments_rewritten,
            "entries dropped": result.entries_dropped,
            "tombstones dropped": result.tombstones_dropped,
            "bytes rewritten": f"{size(result.bytes_before)} -> {size(result.bytes_after)}",
        },
    )


@log_app.command("expire")
def expire(name: Name, version: Version, as_json: AsJson = False, tenant: Tenant = None) -> None:
    """Apply the data source's retention now: tombstones for points whose latest upsert is older than its
    `retention_days` (custom metadata)."""
    with open_shoal(tenant, existing=True) as shoal:
        result = shoal.apply_retention(name, version)
    if as_json:
        echo_json(result.to_json())
        return
    if result.retention_days is None:
        out.print(f"{name}/{version} has no retention_days in its custom metadata: nothing to expire")
        return
    cutoff = result.cutoff.isoformat(sep=" ", timespec="seconds") if result.cutoff else "-"
    _print(
        f"Retention of {name}/{version}: {result.retention_days:g} days",
        {"ingested before": cutoff, "points expired": result.expired,
         "write token": str(result.token) if result.token is not None else "-"},
    )


def gc(
    as_json: AsJson = False,
    no_scan: Annotated[
        bool, typer.Option("--no-scan", help="Only delete queued files; do not look for unreferenced ones.")
    ] = False,
    tenant: Tenant = None,
) -> None:
    """Delete the tenant's files no catalog row references, once SHOAL_GC_GRACE_S has passed; each deletion
    is logged."""
    with open_shoal(tenant, existing=True) as shoal:
        result = shoal.collect_garbage(scan=not no_scan)
    if as_json:
        echo_json(result.to_json())
        return
    _print(
        "Garbage collection",
        {
            "files scanned": result.scanned,
            "unreferenced files found": result.queued,
            "files deleted": result.deleted,
            "already gone": result.already_gone,
            "kept (referenced)": result.kept,
            "still in grace period": result.pending,
            "empty folders removed": result.folders_removed,
        },
    )
