"""`shoal reindex` and `shoal rollback`: rebuild an index as a new generation and swap it in; go back."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from shoal.cli.common import AsJson, Tenant, open_shoal, out
from shoal.cli.formatting import echo_json
from shoal.cli.indexes import IndexName, IndexVersion, parse_params
from shoal.index.generations import JobRecord


def _row(job: JobRecord) -> dict[str, object]:
    return {
        "job": job.id, "state": job.state, "progress": round(job.progress, 4), "eta_s": job.eta_s,
        "recall": job.recall, "gate": job.gate, "definition": job.definition, "error": job.error,
        "started": job.created_at.isoformat(), "finished": job.finished_at.isoformat() if job.finished_at else None,
    }


def jobs_table(jobs: list[JobRecord], title: str) -> Table:
    """Reindex jobs as a table: state, progress and ETA, recall against the gate, what was built."""
    table = Table(title=title)
    for col in ("job", "state", "progress", "eta", "recall / gate", "definition", "started", "error"):
        table.add_column(col)
    for j in jobs:
        d = j.definition
        params = ", ".join(f"{k}={v}" for k, v in sorted(d.get("params", {}).items()))
        table.add_row(
            str(j.id), j.state, f"{j.progress:.0%}", f"{j.eta_s:.0f} s" if j.eta_s is not None else "",
            f"{j.recall:.4f} / {j.gate:.2f}" if j.recall is not None else f"- / {j.gate:.2f}",
            f"{d.get('algorithm')} {d.get('metric')} {params} (gen {d.get('generation')})",
            f"{j.created_at:%Y-%m-%d %H:%M:%S}", j.error or "",
        )
    return table


def reindex(
    name: IndexName,
    version: IndexVersion,
    algorithm: Annotated[str | None, typer.Option(help="New algorithm (default: the current one).")] = None,
    metric: Annotated[str | None, typer.Option(help="New metric (default: the current one).")] = None,
    param: Annotated[list[str] | None, typer.Option("--param", help="New parameter NAME=VALUE (repeat).")] = None,
    gate: Annotated[float | None, typer.Option(help="recall@10 needed to swap (default 0.95 ANN, 1.0 flat).")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Run the job here and wait for its end.")] = False,
    status: Annotated[bool, typer.Option("--status", help="Only show the index's reindex jobs.")] = False,
    cancel: Annotated[bool, typer.Option("--cancel", help="Cancel the running reindex.")] = False,
    tenant: Tenant = None,
    as_json: AsJson = False,
) -> None:
    """Rebuild an index with new settings as a new generation built aside, and swap it in atomically once it
    caught up with the log and its recall on a sample of stored vectors meets the gate. The old generation
    keeps serving meanwhile, and stays for `shoal rollback` for SHOAL_REINDEX_KEEP_S."""
    with open_shoal(tenant, existing=True) as shoal:
        if cancel:
            jobs = [shoal.cancel_reindex(name, version)]
        elif status:
            jobs = shoal.reindex_jobs(name, version)
        else:
            params = parse_params(param) if param else None
            jobs = [shoal.reindex(name, version, algorithm=algorithm, metric=metric, params=params, gate=gate,
                                  wait=wait)]
    if as_json:
        echo_json([_row(j) for j in jobs])
    else:
        out.print(jobs_table(jobs, f"Reindex jobs of {name}/{version}"))


def rollback(name: IndexName, version: IndexVersion, tenant: Tenant = None) -> None:
    """Serve again the generation the last reindex replaced (while it is kept)."""
    with open_shoal(tenant, existing=True) as shoal:
        shoal.rollback(name, version)
        index = shoal.get_index(name, version)
    spec = index.spec
    described = [spec.algorithm, spec.metric, *(f"{k}={v}" for k, v in sorted(spec.params.items()))]
    out.print(f"index {name}/{version} serves generation {index.generation} again ({', '.join(described)})")
