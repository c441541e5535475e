"""How the CLI writes numbers, sizes, times, cells and JSON for people."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import typer
from rich.table import Table

from shoal.catalog.indexes import IndexRecord
from shoal.catalog.repo import SourceRecord
from shoal.cli.common import out
from shoal.client import ShardStatus
from shoal.log.records import DataSourceSpec


def count(value: int) -> str:
    """An integer with thousands separators: 12,345."""
    return f"{value:,}"


def size(num: int) -> str:
    """A byte count in binary units: 512 B, 1.5 KB, 3.2 MB."""
    value = float(num)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TB"


def when(value: dt.datetime | None) -> str:
    """A timestamp to the second, or "-" when there is none."""
    return value.isoformat(sep=" ", timespec="seconds") if value is not None else "-"


def cell(value: Any) -> str:
    """An attribute value as a table cell: "-" for null, ISO format for datetimes."""
    if value is None:
        return "-"
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    return str(value)


def attributes_text(spec: DataSourceSpec) -> str:
    """The attributes in definition order as name:type, comma-separated."""
    return ", ".join(f"{name}:{kind.value}" for name, kind in spec.attribute_types.items())


def record_json(record: SourceRecord) -> dict[str, Any]:
    """A data source's definition, tenant and head as a JSON-ready dict."""
    return {
        "tenant": record.tenant,
        **record.spec.to_json(),
        "head_seq": record.head_seq,
        "head_committed_at": record.head_committed_at.isoformat() if record.head_committed_at else None,
        "created_at": record.created_at.isoformat(),
    }


def json_default(value: Any) -> Any:
    """How echo_json writes what JSON has no type for: datetimes, dates and times in ISO 8601 (as every
    created_at of a --json output is), anything else as str()."""
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    return str(value)


def echo_json(value: Any) -> None:
    """Print `value` as indented JSON on stdout (plain, no markup), for scripts."""
    typer.echo(json.dumps(value, indent=2, default=json_default))


def params_text(params: Mapping[str, Any]) -> str:
    """Engine parameters as k=v, comma-separated, or "-" when there are none."""
    return ", ".join(f"{k}={v}" for k, v in params.items()) if params else "-"


def names_text(names: Sequence[str] | None) -> str:
    """Attribute names comma-separated, or "-" when there are none."""
    return ", ".join(names) if names else "-"


def index_json(record: IndexRecord) -> dict[str, Any]:
    """An index's definition, tenant, generation and shards as a JSON-ready dict."""
    spec = record.spec
    return {
        "tenant": record.tenant,
        "name": spec.name,
        "version": spec.version,
        "source_name": spec.source_name,
        "source_version": spec.source_version,
        "algorithm": spec.algorithm,
        "metric": spec.metric,
        "params": dict(spec.params),
        "id_attributes": list(spec.id_attributes),
        "split_attributes": list(spec.split_attributes),
        "shard_attributes": list(spec.shard_attributes),
        "payload_attributes": list(spec.payload_attributes or ()),
        "shard_count": spec.shard_count,
        "generation": record.generation,
        "shards": [
            {
                "shard": s.shard_no,
                "active_version_id": s.active_version_id,
                "built_watermark": s.built_watermark,
                "served_watermark": s.served_watermark,
                "served_at": s.served_at.isoformat() if s.served_at else None,
            }
            for s in record.shards
        ],
    }


def status_json(status: ShardStatus) -> dict[str, Any]:
    """One shard's freshness as a JSON-ready dict."""
    return dataclasses.asdict(status)


def print_listing(
    items: list[Any],
    *,
    as_json: bool,
    to_json: Callable[[Any], Any],
    empty: str,
    title: str,
    columns: list[tuple[str, str]],
    row: Callable[[Any], list[str]],
) -> None:
    """Print a list command's answer: the JSON list with `--json`, a sentence when there is nothing, or a
    table with `columns` (name, justify) and one `row` per item."""
    if as_json:
        echo_json([to_json(item) for item in items])
        return
    if not items:
        out.print(empty)
        return
    table = Table(title=title, title_justify="left")
    for name, justify in columns:
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for item in items:
        table.add_row(*row(item))
    out.print(table)
