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

from shoal.errors import Problem, ValidationError
from shoal.log.records import DataPoint, DataSourceSpec, SparseVector, Tombstone
from shoal.vektonn.arrow_upload import ARROW, DELETED_COLUMN, VECTOR_COLUMN, decode_arrow_upload
from shoal.vektonn.json_fields import JSON
from shoal.vektonn.upload_json import EmptyUploadError, UploadBodyError, decode_upload

CONTENT_TYPES = (JSON, ARROW)


def decode(spec: DataSourceSpec, content_type: str | None, body: bytes, max_points: int,
           max_bytes: int | None = None) -> pa.Table:
    """The message's batch, validated against the data source; ValidationError naming what is wrong
    (`max_bytes`: what a message may hold, see `decode_arrow_upload`)."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind == JSON:
        return _decode_json(spec, body, max_points)
    if kind == ARROW:
        return decode_arrow_upload(spec, body, max_points, max_bytes)
    raise ValidationError(f"unsupported content type {content_type!r}: use {JSON} or {ARROW}")


def _decode_json(spec: DataSourceSpec, body: bytes, max_points: int) -> pa.Table:
    # The HTTP route's decoder (orjson straight to columns), with this codec's wording for a body that is no
    # upload at all, which dead letters carry as their reason.
    try:
        return decode_upload(spec, body, max_points)
    except UploadBodyError as exc:
        raise ValidationError(f"not a Vektonn upload body: {'; '.join(str(p) for p in exc.problems)}") from None
    except EmptyUploadError:
        raise ValidationError("the message holds no data point") from None


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
