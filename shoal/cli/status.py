"""`shoal status`: how fresh every index shard is (DESIGN.md invariant 8), once or refreshed in place."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table

from shoal.cli.common import AsJson, Tenant, open_shoal, out
from shoal.cli.formatting import count, echo_json, status_json
from shoal.client import ShardStatus, Shoal

CAPTION = (
    "built: the watermark of the shard's active version; served: the newest watermark a searcher has loaded "
    "(0 until one has); lag: log head minus served"
)


def collect(shoal: Shoal, name: str | None, version: str | None) -> list[ShardStatus]:
    """Freshness of every shard of one index, or of all the tenant's indexes when `name` is None."""
    if name is not None and version is not None:
        return shoal.index_status(name, version)
    rows: list[ShardStatus] = []
    for record in shoal.list_indexes():
        rows.extend(shoal.index_status(record.spec.name, record.spec.version))
    return rows


def _indexes(shoal: Shoal, name: str | None, version: str | None) -> list[tuple[str, str]]:
    if name is not None and version is not None:
        return [(name, version)]
    return [(r.spec.name, r.spec.version) for r in shoal.list_indexes()]


def freshness_table(rows: list[ShardStatus], title: str) -> Table:
    """One row per index shard: head, built and served watermarks, lag in seqs and seconds, segments."""
    table = Table(title=title, title_justify="left", caption=CAPTION, caption_justify="left")
    table.add_column("index", overflow="fold")
    for column in ("shard", "head", "built watermark", "served watermark", "lag seqs", "lag s", "segments",
                   "version id"):
        table.add_column(column, justify="right")
    for s in rows:
        lagging = s.lag_seqs > 0
        table.add_row(
            s.index,
            str(s.shard),
            count(s.head),
            count(s.built_watermark),
            count(s.served_watermark),
            f"[yellow]{count(s.lag_seqs)}[/]" if lagging else "0",
            f"{s.lag_seconds:.1f}",
            str(s.segments),
            str(s.version_id) if s.version_id is not None else "-",
        )
    return table


def status(
    index: Annotated[str | None, typer.Argument(help="Index name (default: every index of the tenant).")] = None,
    version: Annotated[str | None, typer.Argument(help="Index version (required with an index name).")] = None,
    as_json: AsJson = False,
    watch: Annotated[
        float | None,
        typer.Option("--watch", metavar="SECONDS", min=0.1, help="Refresh the table every SECONDS until Ctrl-C."),
    ] = None,
    tenant: Tenant = None,
) -> None:
    """Show the freshness of index shards: log head, built and served watermarks, lag in seqs and seconds."""
    if (index is None) != (version is None):
        raise typer.BadParameter("give both an index name and its version, or neither", param_hint="INDEX VERSION")
    if watch is not None and as_json:
        raise typer.BadParameter("prints a table; leave --json out", param_hint="--watch")
    with open_shoal(tenant) as shoal:
        scope = f"{index}/{version}" if index else f"indexes of tenant {shoal.tenant!r}"

        def render() -> Table | Group | str:
            rows = collect(shoal, index, version)
            if not rows:
                return f"No indexes in tenant {shoal.tenant!r}."
            table = freshness_table(rows, f"Freshness of {scope} at {time.strftime('%H:%M:%S')}")
            running = [j for r in _indexes(shoal, index, version) for j in shoal.reindex_jobs(*r)[:1]
                       if j.state == "building"]
            if not running:
                return table
            from shoal.cli.reindex import jobs_table

            return Group(table, jobs_table(running, "Reindexing (progress of the new generation)"))

        if as_json:
            echo_json([status_json(s) for s in collect(shoal, index, version)])
            return
        if watch is None:
            out.print(render())
            return
        try:
            if out.is_terminal:
                with Live(render(), console=out, auto_refresh=False) as live:
                    while True:
                        time.sleep(watch)
                        live.update(render(), refresh=True)
            else:  # piped or captured: one table after the other
                while True:
                    out.print(render())
                    time.sleep(watch)
        except KeyboardInterrupt:
            pass
