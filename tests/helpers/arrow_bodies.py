"""Arrow IPC upload bodies built by hand, as a client other than Shoal's might send them (Shoal's own encoder
refuses some of the bodies the tests need)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa


def arrow_stream(columns: pa.Table | dict[str, Any]) -> bytes:
    """One Arrow IPC stream holding these columns (a table, or a mapping of name to values pyarrow can type)."""
    table = columns if isinstance(columns, pa.Table) else pa.table(columns)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()
