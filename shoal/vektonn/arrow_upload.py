"""An upload as an Arrow IPC stream: a `vector` column of float lists, one column per attribute and an optional
boolean `is_deleted` column, decoded to the validated batch table column-wise (no JSON, no per-point object).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from shoal.errors import Problem, ValidationError
from shoal.log.records import DataSourceSpec
from shoal.log.validation import columns_to_table
from shoal.vektonn.runs import runs

ARROW = "application/vnd.apache.arrow.stream"
VECTOR_COLUMN = "vector"  # fixed-size (or equal-length) list of float per row
DELETED_COLUMN = "is_deleted"  # optional: true rows are tombstones (the key decides)


def decode_arrow_upload(spec: DataSourceSpec, body: bytes, max_points: int) -> pa.Table:
    """An Arrow IPC stream body (`vector` column of float lists, one column per attribute, optional boolean
    `is_deleted`) as the validated batch table, order kept; ValidationError naming what is wrong."""
    try:
        table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise ValidationError(f"not an Arrow IPC stream: {exc}") from None
    if not table.num_rows:
        raise ValidationError("the message holds no data point")
    if spec.vectors_are_sparse:
        raise ValidationError("the Arrow form carries dense vectors only: send sparse vectors as JSON")
    deleted = np.zeros(table.num_rows, dtype=bool)
    if DELETED_COLUMN in table.column_names:
        col = table[DELETED_COLUMN]
        if not pa.types.is_boolean(col.type) or col.null_count:
            raise ValidationError(Problem("must be a boolean column without nulls", attribute=DELETED_COLUMN))
        deleted = col.to_numpy(zero_copy_only=False).astype(bool)
        table = table.drop_columns([DELETED_COLUMN])
    # Runs of upserts and of tombstones, in message order: later entries win over earlier ones for a key.
    parts = []
    for start, end in runs(deleted):
        part = table.slice(start, end - start)
        attrs = {name: part[name].combine_chunks() for name in part.column_names if name != VECTOR_COLUMN}
        if deleted[start]:
            # Every attribute column present (Vektonn's form, or a message that also upserts): all go to the
            # validation, which checks the non-key values' types (nulls allowed) and keeps only the key.
            # Otherwise the key columns alone, as ever.
            full = all(name in attrs for name in spec.attribute_types)
            names = spec.attribute_types if full else spec.permanent_attributes
            keys = {name: attrs[name] for name in names if name in attrs}
            parts.append(columns_to_table(spec, None, keys, max_points, delete=True))
        else:
            parts.append(columns_to_table(spec, _arrow_vectors(part, spec.vector_dimension), attrs, max_points))
    out = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    if out.num_rows > max_points:
        raise ValidationError(f"the message holds {out.num_rows} points, more than the {max_points} allowed")
    return out


def _arrow_vectors(part: pa.Table, dim: int) -> np.ndarray:
    """The part's vectors as one float32 [rows, dim] array; ValidationError naming what is wrong with the column."""
    if VECTOR_COLUMN not in part.column_names:
        raise ValidationError(Problem("missing vector column", attribute=VECTOR_COLUMN))
    col = part[VECTOR_COLUMN].combine_chunks()
    if not (pa.types.is_fixed_size_list(col.type) or pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise ValidationError(Problem(f"must be a list of floats, not {col.type}", attribute=VECTOR_COLUMN))
    if col.null_count:
        raise ValidationError(Problem("a data point needs a vector (null found)", attribute=VECTOR_COLUMN))
    if not pa.types.is_fixed_size_list(col.type):
        lengths = pa.compute.list_value_length(col).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(lengths != dim)
        if bad.size:
            raise ValidationError(
                Problem(f"wrong vector dimension: expected {dim}, got {lengths[bad[0]]}", int(bad[0]), VECTOR_COLUMN)
            )
    values = col.flatten()
    if not (pa.types.is_floating(values.type) or pa.types.is_integer(values.type)):
        raise ValidationError(Problem(f"coordinates must be numbers, not {values.type}", attribute=VECTOR_COLUMN))
    flat = values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    if flat.size != len(col) * dim:
        raise ValidationError(Problem(f"wrong vector dimension: expected {dim}", attribute=VECTOR_COLUMN))
    return flat.reshape(len(col), dim)
