"""`shoal log`: what a data source's log holds (head, segments, bytes) and, on request, its folded state."""

from __future__ import annotations

from typing import Annotated

import pyarrow as pa
import pyarrow.compute as pc
import typer
from rich.table import Table

from shoal.catalog.repo import SegmentRecord, SourceRecord
from shoal.cli.common import Name, Tenant, Version, open_shoal, out
from shoal.cli.formatting import cell, count, size, when
from shoal.client import Shoal
from shoal.log.validation import SEQ, SPARSE_INDICES, VECTOR


def print_log(shoal: Shoal, name: str, version: str, *, segments: bool, show: int) -> None:
    """Print the log's summary; with `segments` a row per segment; with `show` > 0 the first live points."""
    record = shoal.get_data_source(name, version)
    segs = shoal.log_segments(name, version)
    state = shoal.fold(name, version, record.head_seq) if show else None
    summary = Table(title=f"Log of {name}/{version} (tenant {record.tenant!r})", show_header=False,
                    title_justify="left")
    summary.add_column(style="bold")
    summary.add_column()
    total = sum(s.bytes for s in segs)
    summary.add_row("head seq", count(record.head_seq))
    summary.add_row("head committed at", when(record.head_committed_at))
    summary.add_row("segments", count(len(segs)))
    summary.add_row("upserts", count(sum(s.upsert_count for s in segs)))
    summary.add_row("tombstones", count(sum(s.tombstone_count for s in segs)))
    summary.add_row("bytes", f"{count(total)} ({size(total)})")
    summary.add_row("folder", shoal.storage.path(shoal.log_dir(name, version)))
    if state is not None:
        summary.add_row("live points", count(state.num_rows))
    out.print(summary)
    if segments and segs:
        out.print(_segments_table(segs))
    if state is not None:
        out.print(_state_table(record, state, show))


def _segments_table(segs: list[SegmentRecord]) -> Table:
    table = Table(title="Segments", title_justify="left")
    for column in ("first_seq", "last_seq", "upserts", "tombstones", "bytes"):
        table.add_column(column, justify="right")
    table.add_column("file (in the folder above)", overflow="fold")
    for s in segs:
        table.add_row(
            str(s.first_seq), str(s.last_seq), count(s.upsert_count), count(s.tombstone_count), count(s.bytes),
            s.path.rsplit("/", 1)[-1],
        )
    return table


def _state_table(record: SourceRecord, state: pa.Table, show: int) -> Table:
    rows = state.slice(0, min(show, state.num_rows))  # --show has no upper bound; pyarrow's slice has one
    spec = record.spec
    title = f"State at seq {record.head_seq}: first {rows.num_rows} of {count(state.num_rows)} live points"
    table = Table(title=title, title_justify="left")
    table.add_column("seq", justify="right")
    for attr_name in spec.attribute_types:
        table.add_column(attr_name, overflow="fold")
    table.add_column("vector")
    # The vector's shape only: its coordinates say nothing to a reader of a table.
    if spec.vectors_are_sparse:
        nnz = pc.list_value_length(rows[SPARSE_INDICES]).to_pylist()
        shapes = [f"sparse, {k} of {spec.vector_dimension}" for k in nnz]
    else:
        shapes = [f"{spec.vector_dimension}-d" if rows[VECTOR][i].is_valid else "-" for i in range(rows.num_rows)]
    seqs = rows[SEQ].to_pylist()
    values = {a: rows[a].to_pylist() for a in spec.attribute_types}
    for i in range(rows.num_rows):
        table.add_row(str(seqs[i]), *(cell(values[a][i]) for a in spec.attribute_types), shapes[i])
    return table


def log(
    name: Name,
    version: Version,
    segments: Annotated[bool, typer.Option("--segments", help="List the log segments.")] = False,
    show: Annotated[
        int,
        typer.Option("--show", min=0, metavar="N",
                     help="Print the first N live points of the folded state (reads the whole log)."),
    ] = 0,
    tenant: Tenant = None,
) -> None:
    """Show what a data source's log holds: head, segments, upserts, tombstones, bytes."""
    with open_shoal(tenant, existing=True) as shoal:
        print_log(shoal, name, version, segments=segments, show=show)
