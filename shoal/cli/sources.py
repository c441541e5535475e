"""`shoal source create | get | list | drop`: the data sources of a tenant."""

from __future__ import annotations

import contextlib
import json
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from shoal.cli.common import AsJson, Name, Tenant, Version, open_shoal, out, split_all, split_pairs, typer_app
from shoal.cli.formatting import attributes_text, count, echo_json, print_listing, record_json, when
from shoal.errors import NotFoundError
from shoal.log.records import DataSourceSpec

source_app = typer_app("Create, inspect, list and drop data sources.")


def _parse_attributes(values: list[str]) -> dict[str, str]:
    types: dict[str, str] = {}
    for name, kind in split_pairs(values, ":", "NAME:TYPE", "--attr"):
        if name in types:
            raise typer.BadParameter(f"attribute {name!r} is given twice", param_hint="--attr")
        types[name] = kind.lower()
    return types


def _parse_metadata(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        custom = json.loads(text)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint="--metadata") from None
    if not isinstance(custom, dict):
        raise typer.BadParameter("must be a JSON object", param_hint="--metadata")
    return custom


@source_app.command("create")
def source_create(
    name: Annotated[str, typer.Argument(help="Data source name, e.g. debian.packages.")],
    version: Annotated[str, typer.Argument(help="Data source version, e.g. 1.0.")],
    dim: Annotated[int, typer.Option("--dim", help="Vector dimension (1 to 10000).")],
    attr: Annotated[
        list[str],
        typer.Option(
            "--attr",
            help="An attribute as NAME:TYPE; repeat it or separate with commas. "
            "Types: bool, int64, float64, string, guid, datetime.",
        ),
    ],
    permanent: Annotated[
        list[str],
        typer.Option("--permanent", help="A permanent (key) attribute; repeat it or separate with commas."),
    ],
    sparse: Annotated[bool, typer.Option("--sparse", help="The data source holds sparse vectors.")] = False,
    description: Annotated[str, typer.Option("--description", help="Free text describing the data.")] = "",
    metadata: Annotated[
        str | None, typer.Option("--metadata", help='Custom metadata as a JSON object, e.g. \'{"team": "search"}\'.')
    ] = None,
    exist_ok: Annotated[
        bool, typer.Option("--exist-ok", help="Succeed if it exists already with the same definition.")
    ] = False,
    tenant: Tenant = None,
) -> None:
    """Create a data source: vector dimension, attribute types and the permanent attributes forming the key."""
    spec = DataSourceSpec(
        name=name,
        version=version,
        vector_dimension=dim,
        attribute_types=_parse_attributes(attr),  # type: ignore[arg-type]
        permanent_attributes=split_all(permanent),
        vectors_are_sparse=sparse,
        description=description,
        custom_metadata=_parse_metadata(metadata),
    )
    with open_shoal(tenant) as shoal:
        existed = False
        if exist_ok:
            with contextlib.suppress(NotFoundError):
                existed = shoal.get_data_source(name, version) is not None
        record = shoal.create_data_source(spec, exist_ok=exist_ok)
    what = "exists already (same definition)" if existed else "created"
    # Text, not markup: names and attributes are the user's text, printed as they are.
    out.print(Text.assemble(
        "Data source ", (name, "bold"), "/", (version, "bold"),
        f" {what} in tenant {record.tenant!r}: "
        f"{spec.vector_dimension}-d {'sparse' if sparse else 'dense'}, "
        f"attributes {attributes_text(spec)}, key ({', '.join(spec.permanent_attributes)})"
        + (f", head seq {record.head_seq}" if existed else ""),
    ))


@source_app.command("get")
def source_get(name: Name, version: Version, as_json: AsJson = False, tenant: Tenant = None) -> None:
    """Show a data source's definition and log head."""
    with open_shoal(tenant, existing=True) as shoal:
        record = shoal.get_data_source(name, version)
    if as_json:
        echo_json(record_json(record))
        return
    spec = record.spec
    table = Table(title=f"{spec.name}/{spec.version}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("tenant", record.tenant)
    table.add_row("vector dimension", str(spec.vector_dimension))
    table.add_row("vectors", "sparse" if spec.vectors_are_sparse else "dense")
    for attr_name, kind in spec.attribute_types.items():
        key = " (permanent)" if attr_name in spec.permanent_attributes else ""
        table.add_row("attribute", f"{attr_name}: {kind.value}{key}")
    table.add_row("permanent", ", ".join(spec.permanent_attributes))
    table.add_row("description", spec.description or "-")
    table.add_row("metadata", json.dumps(spec.custom_metadata) if spec.custom_metadata else "-")
    table.add_row("head seq", count(record.head_seq))
    table.add_row("head committed at", when(record.head_committed_at))
    table.add_row("created at", when(record.created_at))
    out.print(table)


@source_app.command("list")
def source_list(as_json: AsJson = False, tenant: Tenant = None) -> None:
    """List the tenant's data sources."""
    with open_shoal(tenant, existing=True) as shoal:
        records = shoal.list_data_sources()
        tenant_name = shoal.tenant
    names = ("name", "version", "dim", "sparse", "attributes", "permanent")
    print_listing(
        records, as_json=as_json, to_json=record_json,
        empty=f"No data sources in tenant {tenant_name!r}.", title=f"Data sources of tenant {tenant_name!r}",
        columns=[(n, "left") for n in names] + [("head seq", "right")],
        row=lambda r: [
            r.spec.name, r.spec.version, str(r.spec.vector_dimension), "yes" if r.spec.vectors_are_sparse else "no",
            attributes_text(r.spec), ", ".join(r.spec.permanent_attributes), count(r.head_seq),
        ],
    )


@source_app.command("drop")
def source_drop(
    name: Name,
    version: Version,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    tenant: Tenant = None,
) -> None:
    """Delete a data source with its whole log and its indexes; their files are queued for GC (deleted after
    SHOAL_GC_GRACE_S). Cannot be undone."""
    with open_shoal(tenant, existing=True) as shoal:
        record = shoal.get_data_source(name, version)
        segments = shoal.log_segments(name, version)
        if not yes:
            typer.confirm(
                f"Drop data source {name}/{version} of tenant {record.tenant!r} with its "
                f"{count(record.head_seq)} log entries in {len(segments)} segments?",
                abort=True,
                err=True,
            )
        files = shoal.drop_data_source(name, version)
    out.print(f"Dropped data source {name}/{version} of tenant {record.tenant!r} ({files} files queued for GC).")
