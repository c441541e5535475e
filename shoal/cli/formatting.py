"""How the CLI writes numbers, sizes, times, cells and JSON for people."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import typer

from shoal.catalog.repo import SourceRecord
from shoal.records import DataSourceSpec


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


def echo_json(value: Any) -> None:
    """Print `value` as indented JSON on stdout (plain, no markup), for scripts."""
    typer.echo(json.dumps(value, indent=2, default=str))
