"""`shoal index create | get | list | drop`: the kNN indexes of a tenant, each over one data source."""

from __future__ import annotations

import contextlib
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from shoal.catalog.indexes import IndexRecord
from shoal.cli.common import AsJson, Tenant, open_shoal, out, split_all, split_pairs, typer_app
from shoal.cli.formatting import count, echo_json, index_json, names_text, params_text, print_listing, when
from shoal.errors import NotFoundError
from shoal.log.records import IndexSpec

index_app = typer_app("Create, inspect, list and drop kNN indexes over data sources.")

IndexName = Annotated[str, typer.Argument(help="Index name, e.g. debian.packages.hnsw.")]
IndexVersion = Annotated[str, typer.Argument(help="Index version, e.g. 1.0.")]

ALGORITHMS = "flat, flat_sparse, hnsw, ivf (or Vektonn's FaissIndex.L2, FaissIndex.IP, SparnnIndex.Cosine)"
METRICS = "cosine, euclidean, manhattan, dot_product, l2_squared"


def parse_param_value(text: str) -> int | float | str:
    """A parameter value as written on the command line: an int if it reads as one, else a float, else text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_params(values: list[str] | None) -> dict[str, Any]:
    """--param NAME=VALUE items (repeated or comma-separated) as a dict; a usage error for a repeated name."""
    params: dict[str, Any] = {}
    for name, value in split_pairs(values, "=", "NAME=VALUE", "--param"):
        if name in params:
            raise typer.BadParameter(f"parameter {name!r} is given twice", param_hint="--param")
        params[name] = parse_param_value(value)
    return params


def _describe(record: IndexRecord) -> str:
    spec = record.spec
    payload = f"payload ({names_text(spec.payload_attributes)})"
    return (
        f"over {spec.source_name}/{spec.source_version}: {spec.algorithm} ({params_text(spec.params)}), "
        f"metric {spec.metric}, id ({names_text(spec.id_attributes)}), split ({names_text(spec.split_attributes)}), "
        f"{spec.shard_count} shard{'s' if spec.shard_count != 1 else ''} by ({names_text(spec.shard_attributes)}), "
        f"{payload}"
    )


@index_app.command("create")
def index_create(
    name: IndexName,
    version: IndexVersion,
    source: Annotated[str, typer.Option("--source", help="Name of the data source to index.")],
    source_version: Annotated[str, typer.Option("--source-version", help="Version of the data source.")],
    algorithm: Annotated[str, typer.Option("--algorithm", help=f"Index algorithm: {ALGORITHMS}.")] = "flat",
    metric: Annotated[
        str | None,
        typer.Option("--metric", help=f"Distance metric: {METRICS} (default cosine; Vektonn types carry their own)."),
    ] = None,
    param: Annotated[
        list[str] | None,
        typer.Option(
            "--param",
            help="An algorithm parameter as NAME=VALUE (int, else float, else text); repeat it or separate "
            "with commas. hnsw: M, ef_construction, ef_search (all or none); ivf: nlist, nprobe.",
        ),
    ] = None,
    id_attr: Annotated[
        list[str] | None,
        typer.Option("--id-attr", help="Id attribute (permanent); default: the permanent attributes minus split ones."),
    ] = None,
    split_attr: Annotated[
        list[str] | None,
        typer.Option("--split-attr", help="Split attribute (permanent): one sub-index per value combination."),
    ] = None,
    shard_attr: Annotated[
        list[str] | None,
        typer.Option("--shard-attr", help="Shard attribute (permanent) hashed to pick a shard; default: the ids."),
    ] = None,
    payload_attr: Annotated[
        list[str] | None,
        typer.Option("--payload-attr", help="Attribute returned with every hit; default: all of the source's."),
    ] = None,
    shards: Annotated[int, typer.Option("--shards", help="Number of shards (1 to 1024).")] = 1,
    exist_ok: Annotated[
        bool, typer.Option("--exist-ok", help="Succeed if it exists already with the same definition.")
    ] = False,
    tenant: Tenant = None,
) -> None:
    """Create an index over a data source, checked by Vektonn's rules; workers build it (`shoal worker`).

    Id, split and shard attributes must be permanent attributes of the source, and the id attributes must
    not all be split attributes. The algorithm must fit the source (flat_sparse for sparse vectors) and
    support the metric.
    """
    from shoal.vektonn.algorithms import VEKTONN_TYPES

    if metric is not None and algorithm in VEKTONN_TYPES:
        raise typer.BadParameter(
            f"the Vektonn type {algorithm} carries its own metric; leave --metric out", param_hint="--metric"
        )
    payload = split_all(payload_attr)
    spec = IndexSpec(
        name=name,
        version=version,
        source_name=source,
        source_version=source_version,
        algorithm=algorithm,
        metric=metric or "cosine",
        params=parse_params(param),
        id_attributes=split_all(id_attr),
        split_attributes=split_all(split_attr),
        shard_attributes=split_all(shard_attr),
        payload_attributes=payload or None,
        shard_count=shards,
    )
    with open_shoal(tenant, existing=True) as shoal:
        existed = False
        if exist_ok:
            with contextlib.suppress(NotFoundError):
                existed = shoal.get_index(name, version) is not None
        record = shoal.create_index(spec, exist_ok=exist_ok)  # IndexDefinitionError names every broken rule
    what = "exists already (same definition)" if existed else "created"
    # Text, not markup: the names and the description are the user's text, printed as they are.
    out.print(Text.assemble(
        "Index ", (name, "bold"), "/", (version, "bold"),
        f" {what} in tenant {record.tenant!r} {_describe(record)}.",
    ))
    if not existed:
        out.print("Workers build it from the log (run `shoal worker`); `shoal status` shows how far they are.")


@index_app.command("get")
def index_get(name: IndexName, version: IndexVersion, as_json: AsJson = False, tenant: Tenant = None) -> None:
    """Show an index's definition and its shards (active version, built and served watermarks)."""
    with open_shoal(tenant, existing=True) as shoal:
        record = shoal.get_index(name, version)
    if as_json:
        echo_json(index_json(record))
        return
    spec = record.spec
    table = Table(title=f"Index {spec.name}/{spec.version}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    table.add_row("tenant", record.tenant)
    table.add_row("data source", f"{spec.source_name}/{spec.source_version}")
    table.add_row("algorithm", spec.algorithm)
    table.add_row("params", params_text(spec.params))
    table.add_row("metric", spec.metric)
    table.add_row("id attributes", names_text(spec.id_attributes))
    table.add_row("split attributes", names_text(spec.split_attributes))
    table.add_row("shard attributes", names_text(spec.shard_attributes))
    table.add_row("payload attributes", names_text(spec.payload_attributes))
    table.add_row("shards", str(spec.shard_count))
    table.add_row("generation", str(record.generation))
    out.print(table)
    shards = Table(title="Shards", title_justify="left")
    shards.add_column("shard", justify="right")
    shards.add_column("active version", justify="right")
    shards.add_column("built watermark", justify="right")
    shards.add_column("served watermark", justify="right")
    shards.add_column("served at")
    for s in record.shards:
        shards.add_row(
            str(s.shard_no),
            str(s.active_version_id) if s.active_version_id is not None else "-",
            count(s.built_watermark),
            count(s.served_watermark),
            when(s.served_at),
        )
    out.print(shards)


@index_app.command("list")
def index_list(as_json: AsJson = False, tenant: Tenant = None) -> None:
    """List the tenant's indexes."""
    with open_shoal(tenant, existing=True) as shoal:
        records = shoal.list_indexes()
        tenant_name = shoal.tenant
    names = ("name", "version", "data source", "algorithm", "params", "metric", "id", "split")
    print_listing(
        records, as_json=as_json, to_json=index_json,
        empty=f"No indexes in tenant {tenant_name!r}.", title=f"Indexes of tenant {tenant_name!r}",
        columns=[(n, "left") for n in names] + [("shards", "right"), ("built", "right")],
        row=lambda r: [
            r.spec.name, r.spec.version, f"{r.spec.source_name}/{r.spec.source_version}", r.spec.algorithm,
            params_text(r.spec.params), r.spec.metric, names_text(r.spec.id_attributes),
            names_text(r.spec.split_attributes), str(r.spec.shard_count),
            count(min((sh.built_watermark for sh in r.shards), default=0)),
        ],
    )


@index_app.command("drop")
def index_drop(
    name: IndexName,
    version: IndexVersion,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    tenant: Tenant = None,
) -> None:
    """Delete an index with all its versions; its files are queued for GC (deleted after SHOAL_GC_GRACE_S).
    The data source stays."""
    with open_shoal(tenant, existing=True) as shoal:
        record = shoal.get_index(name, version)
        if not yes:
            typer.confirm(
                f"Drop index {name}/{version} of tenant {record.tenant!r} with its "
                f"{record.spec.shard_count} shard(s)? Its data source {record.spec.source_name}/"
                f"{record.spec.source_version} stays.",
                abort=True,
                err=True,
            )
        files = shoal.drop_index(name, version)
    out.print(f"Dropped index {name}/{version} of tenant {record.tenant!r} ({files} files queued for GC).")
