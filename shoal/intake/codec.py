"""Message bodies: Vektonn's upload JSON, or a compact columnar Arrow IPC stream, chosen by content type.

Both decode to the same validated Arrow batch the log writer appends, so a message is checked by exactly the
rules an HTTP upload or the Python producer is checked by.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pydantic

from shoal.api.convert import points_from_dtos
from shoal.api.dto import InputDataPointOrTombstoneDto
from shoal.errors import Problem, ValidationError
from shoal.ingest.batch import columns_to_table, points_to_table
from shoal.records import DataPoint, DataSourceSpec, SparseVector, Tombstone

JSON = "application/json"
ARROW = "application/vnd.apache.arrow.stream"
CONTENT_TYPES = (JSON, ARROW)
VECTOR_COLUMN = "vector"  # Arrow form: fixed-size (or equal-length) list of float per row
DELETED_COLUMN = "is_deleted"  # Arrow form, optional: true rows are tombstones (key columns only matter)

_DTOS = pydantic.TypeAdapter(list[InputDataPointOrTombstoneDto])


def decode(spec: DataSourceSpec, content_type: str | None, body: bytes, max_points: int) -> pa.Table:
    """The message's batch, validated against the data source; ValidationError naming what is wrong."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind == JSON:
        return _decode_json(spec, body, max_points)
    if kind == ARROW:
        return _decode_arrow(spec, body, max_points)
    raise ValidationError(f"unsupported content type {content_type!r}: use {JSON} or {ARROW}")


def _decode_json(spec: DataSourceSpec, body: bytes, max_points: int) -> pa.Table:
    try:
        dtos = _DTOS.validate_json(body)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValidationError(f"not a Vektonn upload body: {first['msg']} at {where or 'the top level'}") from None
    if not dtos:
        raise ValidationError("the message holds no data point")
    return points_to_table(spec, points_from_dtos(spec, dtos), max_points)


def _decode_arrow(spec: DataSourceSpec, body: bytes, max_points: int) -> pa.Table:
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
    edges = [0, *(np.flatnonzero(deleted[1:] != deleted[:-1]) + 1).tolist(), table.num_rows]
    parts = []
    for start, end in zip(edges, edges[1:], strict=False):
        part = table.slice(start, end - start)
        attrs = {name: part[name].combine_chunks() for name in part.column_names if name != VECTOR_COLUMN}
        if deleted[start]:
            keys = {name: attrs[name] for name in spec.permanent_attributes if name in attrs}
            parts.append(columns_to_table(spec, None, keys, max_points, delete=True))
        else:
            parts.append(columns_to_table(spec, _vectors(part, spec.vector_dimension), attrs, max_points))
    out = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    if out.num_rows > max_points:
        raise ValidationError(f"the message holds {out.num_rows} points, more than the {max_points} allowed")
    return out


def _vectors(part: pa.Table, dim: int) -> np.ndarray:
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


# -- encoding, for publishers ------------------------------------------------------------------------------


def encode_json(items: Sequence[DataPoint | Tombstone]) -> bytes:
    """Data points and tombstones as Vektonn's upload JSON (the attribute slot follows each value's type)."""
    out = []
    for item in items:
        if isinstance(item, Tombstone):
            out.append({"attributes": _attributes(item.key), "isDeleted": True})
        elif isinstance(item, DataPoint):
            out.append({"attributes": _attributes(item.attributes), "vector": _vector(item.vector)})
        else:
            raise ValidationError(f"expected DataPoint or Tombstone, got {type(item).__name__}")
    return json.dumps(out, separators=(",", ":")).encode()


def _attributes(values: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": _slot(k, v)} for k, v in values.items()]


def _slot(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool | np.bool_):
        return {"bool": bool(value)}
    if isinstance(value, int | np.integer):
        return {"int64": int(value)}
    if isinstance(value, float | np.floating):
        return {"float64": float(value)}
    if isinstance(value, str):
        return {"string": value}
    if isinstance(value, uuid.UUID):
        return {"guid": str(value)}
    if isinstance(value, dt.datetime):
        return {"dateTime": value.isoformat()}
    raise ValidationError(Problem(f"unsupported attribute value type {type(value).__name__}", attribute=key))


def _vector(vector: Any) -> dict[str, Any]:
    if isinstance(vector, SparseVector):
        return {"isSparse": True, "coordinates": [float(x) for x in vector.values],
                "coordinateIndices": [int(i) for i in vector.indices]}
    return {"isSparse": False, "coordinates": np.asarray(vector, dtype=np.float64).tolist()}


def encode_arrow(
    vectors: np.ndarray | None,
    attributes: Mapping[str, Sequence[Any] | np.ndarray | pa.Array],
    *,
    deleted: Sequence[bool] | np.ndarray | None = None,
) -> bytes:
    """A columnar batch as an Arrow IPC stream: `vectors` [n, dim] (None for tombstones only), one column per
    attribute, and optionally `deleted` marking tombstone rows."""
    columns: dict[str, pa.Array] = {name: pa.array(values) for name, values in attributes.items()}
    n = len(next(iter(columns.values()))) if columns else 0
    if vectors is not None:
        arr = np.ascontiguousarray(vectors, dtype=np.float32)
        if arr.ndim != 2:
            raise ValidationError(Problem("vectors must be a 2-d array [points, dimension]", attribute=VECTOR_COLUMN))
        n = arr.shape[0]
        columns[VECTOR_COLUMN] = pa.FixedSizeListArray.from_arrays(pa.array(arr.reshape(-1)), arr.shape[1])
    if deleted is not None:
        columns[DELETED_COLUMN] = pa.array(np.asarray(deleted, dtype=bool))
    elif vectors is None:
        columns[DELETED_COLUMN] = pa.array(np.ones(n, dtype=bool))
    table = pa.table(columns)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()
