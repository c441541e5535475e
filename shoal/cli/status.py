"""`shoal status`: how fresh every index shard is (DESIGN.md invariant 8), once or refreshed in place."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from shoal.cli.common import AsJson, Tenant, err, open_shoal, out
from shoal.cli.formatting import count, echo_json, status_json
from shoal.client import ShardStatus, Shoal
from shoal.errors import NotFoundError
from shoal.index.generations import JobRecord
from shoal.workers.liveness import DEGRADED, health_report, lag_summary

CAPTION = (
    "built: the watermark of the shard's active version; served: the newest watermark a searcher has loaded "
    "(0 until one has); lag: log head minus served; young tier: the part of that lag following searchers "
    "search exactly from the log (eventual searches show it), at most SHOAL_YOUNG_TIER_MAX_SEQS"
)
MAX_WATCH_S = 86_400  # a day between refreshes; time.sleep overflows on much more (inf, 1e300)


def collect(shoal: Shoal, name: str | None, version: str | None) -> list[ShardStatus]:
    """Freshness of every shard of one index (NotFoundError when it is gone), or of all the tenant's indexes
    when `name` is None (an index dropped between the listing and its read is left out)."""
    if name is not None and version is not None:
        return shoal.index_status(name, version)
    rows: list[ShardStatus] = []
    for record in shoal.list_indexes():
        try:
            rows.extend(shoal.index_status(record.spec.name, record.spec.version))
        except NotFoundError:
            continue  # dropped since the listing: it is no index of the tenant's any more
    return rows


def running_jobs(shoal: Shoal, name: str | None, version: str | None) -> list[JobRecord]:
    """The reindex building, if any, of one index (NotFoundError when it is gone) or of each of the tenant's
    indexes when `name` is None (an index dropped meanwhile is left out)."""
    if name is not None and version is not None:
        indexes = [(name, version)]
    else:
        indexes = [(r.spec.name, r.spec.version) for r in shoal.list_indexes()]
    running: list[JobRecord] = []
    for index in indexes:
        try:
            jobs = shoal.reindex_jobs(*index)[:1]
        except NotFoundError:
            if name is not None:
                raise
            continue
        running.extend(j for j in jobs if j.state == "building")
    return running


def indexing_warnings(shoal: Shoal) -> list[str]:
    """Warnings for the table: why lagging shards will not catch up (no live worker, broker down), if so.

    Asks the workers (a ping, about a second) only when some shard lags and no build is under way.
    """
    try:
        lag = lag_summary(shoal.engine)
    except Exception:  # the table above came from the same catalog: nothing to add if it fails now
        return []
    if lag.lagging_shards == 0 or lag.building_shards > 0:
        return []
    report = health_report(shoal.engine, shoal.broker_url)
    return list(report.problems) if report.status == DEGRADED else []


def with_warnings(renderable: RenderableType, warnings: list[str]) -> RenderableType:
    """`renderable` followed by one yellow line per warning."""
    if not warnings:
        return renderable
    lines = [Text("warning: " + w, style="bold yellow") for w in warnings]
    return Group(renderable, *lines)


def freshness_table(rows: list[ShardStatus], title: str) -> Table:
    """One row per index shard: head, built and served watermarks, lag in seqs and seconds, segments."""
    table = Table(title=title, title_justify="left", caption=CAPTION, caption_justify="left")
    table.add_column("index", overflow="fold")
    for column in ("shard", "head", "built watermark", "served watermark", "lag seqs", "lag s", "young tier",
                   "young age s", "segments", "version id"):
        table.add_column(column, justify="right")
    for s in rows:
        lagging = s.lag_seqs > 0
        table.add_row(
            s.index,
            str(s.shard),
            count(s.head),
            count(s.built_watermark),
            count(s.served_watermark),
            Text(count(s.lag_seqs), style="yellow") if lagging else "0",
            f"{s.lag_seconds:.1f}",
            count(s.young_tier_seqs),
            f"{s.young_tier_age_s:.1f}",
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
        typer.Option("--watch", metavar="SECONDS", min=0.1, max=MAX_WATCH_S,
                     help=f"Refresh the table every SECONDS (0.1 to {MAX_WATCH_S}) until Ctrl-C."),
    ] = None,
    tenant: Tenant = None,
) -> None:
    """Show the freshness of index shards: log head, built and served watermarks, lag in seqs and seconds."""
    if (index is None) != (version is None):
        raise typer.BadParameter("give both an index name and its version, or neither", param_hint="INDEX VERSION")
    if watch is not None and as_json:
        raise typer.BadParameter("prints a table; leave --json out", param_hint="--watch")
    with open_shoal(tenant, existing=True) as shoal:
        scope = f"{index}/{version}" if index else f"indexes of tenant {shoal.tenant!r}"

        def tables() -> tuple[RenderableType, list[str]]:
            """The freshness table (and reindex progress), and the warnings that go with it."""
            rows = collect(shoal, index, version)
            if not rows:
                return f"No indexes in tenant {shoal.tenant!r}.", []
            table = freshness_table(rows, f"Freshness of {scope} at {time.strftime('%H:%M:%S')}")
            # Why its lag will not shrink, if so (workers serve every tenant: counts are global).
            warnings = indexing_warnings(shoal) if any(s.head > s.built_watermark for s in rows) else []
            running = running_jobs(shoal, index, version)
            if not running:
                return table, warnings
            from shoal.cli.reindex import jobs_table

            return Group(table, jobs_table(running, "Reindexing (progress of the new generation)")), warnings

        def render() -> RenderableType:
            """What --watch redraws: the tables with their warnings under them (the screen is one picture)."""
            return with_warnings(*tables())

        if as_json:
            rows = collect(shoal, index, version)
            # The list stays a list (scripts iterate it): each shard carries the /healthz report as "health".
            health = health_report(shoal.engine, shoal.broker_url).as_json() if rows else None
            echo_json([status_json(s) | {"health": health} for s in rows])
            return
        if watch is None:
            # Results on stdout, warnings on stderr: a script reading the table does not get them mixed in.
            renderable, warnings = tables()
            out.print(renderable)
            for warning in warnings:
                err.print(Text("warning: " + warning, style="bold yellow"), soft_wrap=True)
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
