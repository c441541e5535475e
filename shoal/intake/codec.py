"""Message bodies: Vektonn's upload JSON, or a compact columnar Arrow IPC stream, chosen by content type.

Both decode to the same validated Arrow batch the log writer appends, so a message is checked by exactly the
rules an HTTP upload or the Python producer is checked by. One allowance in the JSON form, for what
`encode_json` writes without knowing the data source: an integer given for a float64 attribute (sent in the int64
slot) and a guid given as text (sent in the string slot) are taken, as the Python producer takes them.
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
from shoal.log.records import AttributeType, DataPoint, DataSourceSpec, SparseVector, Tombstone
from shoal.log.validation import (
    MAX_PROBLEMS,
    check_value,
    column_shape_problem,
    number_array,
    numbers_to_float32,
    unfit_rows,
    vector_problem,
)
from shoal.vektonn.arrow_upload import (
    ARROW,
    DELETED_COLUMN,
    RESERVED_DELETED_COLUMN,
    RESERVED_VECTOR_COLUMN,
    VECTOR_COLUMN,
    decode_arrow_upload,
)
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
    try:
        return _decode_upload(spec, body, max_points)
    except ValidationError:
        # Only a refused body pays for another parse: the slots a publisher picked by the Python type of a value
        # the producer takes for the declared type, moved to the declared slot, and the body judged again.
        retyped = _producer_slots(spec, body)
        if retyped is None:
            raise
    return _decode_upload(spec, retyped, max_points)


def _decode_upload(spec: DataSourceSpec, body: bytes, max_points: int) -> pa.Table:
    # The HTTP route's decoder (orjson straight to columns), with this codec's wording for a body that is no
    # upload at all, which dead letters carry as their reason.
    try:
        return decode_upload(spec, body, max_points)
    except UploadBodyError as exc:
        raise ValidationError(f"not a Vektonn upload body: {'; '.join(str(p) for p in exc.problems)}") from None
    except EmptyUploadError:
        raise ValidationError("the message holds no data point") from None


def _producer_slots(spec: DataSourceSpec, body: bytes) -> bytes | None:
    """The body with each attribute value `encode_json` put in another slot than the declared type's, where the
    Python producer takes that value for the type, moved to the declared slot: an integer for a float64 attribute
    (`{"int64": 2}` -> `{"float64": 2}`) and a guid's text for a guid attribute (`{"string": s}` -> `{"guid": s}`,
    when `check_value` reads it as a guid, as every write path does). None when nothing moved (or the body is no
    JSON array)."""
    try:
        items = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(items, list):
        return None
    moved = False
    for item in items:
        attributes = item.get("attributes") if isinstance(item, dict) else None
        for attribute in attributes if isinstance(attributes, list) else ():
            if not isinstance(attribute, dict) or not isinstance(attribute.get("key"), str):
                continue
            kind, value = spec.attribute_types.get(attribute["key"]), attribute.get("value")
            if not isinstance(value, dict) or len(value) != 1:
                continue
            ((slot, raw),) = value.items()
            if kind is AttributeType.FLOAT64 and slot == "int64" and type(raw) is int:
                attribute["value"], moved = {"float64": raw}, True
            elif kind is AttributeType.GUID and slot == "string" and isinstance(raw, str):
                # Read as every write path reads a guid's text (not uuid.UUID's, which takes hyphens anywhere);
                # text it refuses stays a string, refused where a guid belongs.
                guid, err = check_value(kind, raw)
                if err is None:
                    attribute["value"], moved = {"guid": guid}, True
    return json.dumps(items).encode() if moved else None


# -- encoding, for publishers ------------------------------------------------------------------------------


def encode_json(items: Sequence[DataPoint | Tombstone]) -> bytes:
    """Data points and tombstones as Vektonn's upload JSON (the attribute slot follows each value's type)."""
    out = []
    for pos, item in enumerate(items):
        if isinstance(item, Tombstone):
            out.append({"attributes": _attributes(item.key, pos), "isDeleted": True})
        elif isinstance(item, DataPoint):
            out.append({"attributes": _attributes(item.attributes, pos), "vector": _vector(item.vector, pos)})
        else:
            raise ValidationError(Problem(f"expected DataPoint or Tombstone, got {type(item).__name__}", pos))
    return json.dumps(out, separators=(",", ":")).encode()


def _attributes(values: Mapping[str, Any], pos: int) -> list[dict[str, Any]]:
    return [{"key": k, "value": _slot(k, v, pos)} for k, v in values.items()]


def _slot(key: str, value: Any, pos: int) -> dict[str, Any]:
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
        # Sent as the UTC instant the producer stores (naive taken as UTC): the offset itself is never stored,
        # and one with seconds (Europe/Amsterdam before 1937, +00:19:32) is no ISO 8601 offset the consumer reads.
        utc, err = check_value(AttributeType.DATETIME, value)
        if err:
            raise ValidationError(Problem(err, pos, key))
        return {"dateTime": utc.isoformat()}
    raise ValidationError(Problem(f"unsupported attribute value type {type(value).__name__}", pos, key))


def _vector(vector: Any, pos: int) -> dict[str, Any]:
    """The vector as Vektonn's JSON, refused (ValidationError) by the rules the Python producer checks without the
    data source's definition: numbers only (no text, complex or dates), integer sparse indices, as many values as
    indices, none repeated, finite coordinates within the norm bound. Nothing is converted into another value (a
    float index truncated, a text parsed): the coordinates sent are the float32 values the producer would store,
    and the consumer checks the rest (dimension, index range) against the data source."""
    if isinstance(vector, SparseVector):
        indices, wrong = number_array(vector.indices, "sparse indices")
        given, wrong_values = number_array(vector.values, "sparse values")
        if indices is None or given is None:
            raise ValidationError(Problem(str(wrong or wrong_values), pos, VECTOR_COLUMN))
        if indices.size and (indices.dtype.kind not in "iuO" or (
                indices.dtype.kind == "O" and not all(_is_integer(i) for i in indices.reshape(-1)))):
            # Even 3.0 (and True): never truncated into another dimension than the one given.
            raise ValidationError(Problem("sparse indices must be integers", pos, VECTOR_COLUMN))
        values = numbers_to_float32(given)
        if indices.ndim != 1 or indices.shape != values.shape:
            raise ValidationError(Problem("sparse vector needs as many values as indices", pos, VECTOR_COLUMN))
        if len(set(indices.tolist())) != indices.size:
            raise ValidationError(Problem("sparse vector repeats an index", pos, VECTOR_COLUMN))
        wrong = vector_problem(given, values)
        if wrong is not None:
            raise ValidationError(Problem(wrong, pos, VECTOR_COLUMN))
        return {"isSparse": True, "coordinates": values.tolist(), "coordinateIndices": indices.tolist()}
    given, wrong = number_array(vector, "vector coordinates")
    if given is None:
        raise ValidationError(Problem(str(wrong), pos, VECTOR_COLUMN))
    row = numbers_to_float32(given)
    if row.ndim != 1:
        raise ValidationError(Problem(f"a vector must be one row of coordinates, got shape {row.shape}", pos,
                                      VECTOR_COLUMN))
    wrong = vector_problem(given, row)
    if wrong is not None:
        raise ValidationError(Problem(wrong, pos, VECTOR_COLUMN))
    return {"isSparse": False, "coordinates": row.tolist()}


def _is_integer(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def encode_arrow(
    vectors: np.ndarray | None,
    attributes: Mapping[str, Sequence[Any] | np.ndarray | pa.Array],
    *,
    deleted: Sequence[bool] | np.ndarray | None = None,
) -> bytes:
    """A columnar batch as an Arrow IPC stream: `vectors` [n, dim] (None for tombstones only), one column per
    attribute, and optionally `deleted` marking tombstone rows. The vectors and the flags go in the columns
    `vector` and `is_deleted`, or `__vector` and `__is_deleted` when an attribute has the plain name (the decoder
    then reads the plain name as that attribute).

    Refused (ValidationError), before anything is sent, by the rules `Producer.upload_columns` checks without the
    data source's definition: vectors of numbers only (no text, complex, dates or masked array), finite within
    float32's range and the norm bound (tombstone rows' vectors are not read); attribute columns of values some
    attribute type takes (bool, integer, float, text, guid, datetime; no NumPy datetime64, date, bytes, ...);
    flags of booleans; with no vectors, no row left an upsert; columns of one length. Nothing is converted into
    another value: the coordinates sent are the float32 values the producer would store, and the consumer checks
    the rest against the data source."""
    if not isinstance(attributes, Mapping):
        raise ValidationError(Problem(f"columns must be a mapping {{attribute name: column}}, got "
                                      f"{type(attributes).__name__}", attribute="attributes"))
    reserved = [name for name in attributes if name in (RESERVED_VECTOR_COLUMN, RESERVED_DELETED_COLUMN)]
    if reserved:
        raise ValidationError(Problem("attribute names may not start with '__'", attribute=reserved[0]))
    columns: dict[str, pa.Array] = {name: _attribute_column(name, values) for name, values in attributes.items()}
    vector_column = RESERVED_VECTOR_COLUMN if VECTOR_COLUMN in columns else VECTOR_COLUMN
    deleted_column = RESERVED_DELETED_COLUMN if DELETED_COLUMN in columns else DELETED_COLUMN
    flags = _deleted_flags(deleted) if deleted is not None else None
    lengths = {name: len(column) for name, column in columns.items()}
    if vectors is not None:
        given, wrong = number_array(vectors, "vectors")
        if given is None:
            raise ValidationError(Problem(str(wrong), attribute=VECTOR_COLUMN))
        if given.ndim != 2:
            raise ValidationError(Problem("vectors must be a 2-d array [points, dimension]", attribute=VECTOR_COLUMN))
        lengths[vector_column] = given.shape[0]
    if flags is not None:
        lengths[deleted_column] = len(flags)
    n = lengths.get(vector_column, next(iter(lengths.values()), 0))  # the vectors' rows, as upload_columns counts
    uneven = [Problem(f"column has {count} values, expected {n}", attribute=name)
              for name, count in lengths.items() if count != n]
    if uneven:
        raise ValidationError(uneven)
    if n == 0:
        raise ValidationError("nothing to publish: the batch is empty")
    if vectors is None:
        if flags is not None and not flags.all():
            # Rows `deleted` leaves as upserts would go without a vector, which the consumer dead-letters.
            raise ValidationError([Problem("vectors are required for upserts (deleted is false here)", int(pos),
                                           VECTOR_COLUMN) for pos in np.flatnonzero(~flags)[:MAX_PROBLEMS]])
        flags = np.ones(n, dtype=bool) if flags is None else flags
    else:
        arr = np.ascontiguousarray(numbers_to_float32(given))
        # The consumer never reads a tombstone row's vector: only the upserts' must be fit to store.
        unfit = unfit_rows(arr)
        if flags is not None:
            unfit = unfit[~flags[unfit]]
        if unfit.size:
            raise ValidationError([Problem(str(vector_problem(given[pos], arr[pos])), int(pos), VECTOR_COLUMN)
                                   for pos in unfit[:MAX_PROBLEMS]])
        columns[vector_column] = pa.FixedSizeListArray.from_arrays(pa.array(arr.reshape(-1)), arr.shape[1])
    if flags is not None:
        columns[deleted_column] = pa.array(flags)
    table = pa.table(columns)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


# What some attribute type takes in a column (`check_value`): a value of none of these types is refused by every
# write path, whatever the attribute's type (None is left to the consumer: a tombstone's other attributes may be
# empty).
_ATTRIBUTE_VALUE_TYPES = (bool, int, float, str, uuid.UUID, dt.datetime, np.bool_, np.integer, np.floating)


def _attribute_column(name: str, values: Any) -> pa.Array | pa.ChunkedArray:
    """One attribute column as Arrow, refused (ValidationError naming it) when `upload_columns` would refuse it
    for every attribute type: not one column (a mapping, a string, a masked or 2-d array ...), a NumPy array of
    datetime64, timedelta, complex or bytes, or a value of another type than `_ATTRIBUTE_VALUE_TYPES`. A guid
    goes as its text, which the consumer reads as a guid attribute's value (and refuses for any other type)."""
    wrong = column_shape_problem(values)
    if wrong is not None:
        raise ValidationError(Problem(wrong, attribute=name))
    if isinstance(values, pa.Array | pa.ChunkedArray):
        return values  # typed: the consumer checks it as upload_columns checks an Arrow column
    if isinstance(values, np.ndarray) and values.dtype.kind != "O":
        if values.dtype.kind not in "biufU":
            raise ValidationError(Problem(
                f"expected bool, integer, float, text, guid or datetime values, got a NumPy array of {values.dtype} "
                "(give datetime.datetime values or an Arrow timestamp column for a datetime attribute)",
                attribute=name))
        return pa.array(values)
    items = list(values)
    problems = []
    for pos, value in enumerate(items):
        if value is None:
            continue
        if not isinstance(value, _ATTRIBUTE_VALUE_TYPES):
            problems.append(Problem(f"expected bool, integer, float, text, guid or datetime, got "
                                    f"{type(value).__name__}", pos, name))
        elif isinstance(value, uuid.UUID):
            items[pos] = str(value)
        elif isinstance(value, dt.datetime):
            _, err = check_value(AttributeType.DATETIME, value)  # an instant past year 9999 in UTC
            if err:
                problems.append(Problem(err, pos, name))
        if len(problems) >= MAX_PROBLEMS:
            break
    if problems:
        raise ValidationError(problems)
    try:
        return pa.array(items)
    except (pa.ArrowException, OverflowError) as exc:
        # Values of types no one attribute takes together (an integer and a text, a bool and an integer), or an
        # integer past 64 bits: every write path refuses such a column for an attribute of any type but float64.
        raise ValidationError(Problem(f"cannot be sent as one column: {exc}", attribute=name)) from None


def _deleted_flags(deleted: Any) -> np.ndarray:
    """The tombstone flags as a 1-d bool array; ValidationError unless they are booleans (0 and 1, or text, are
    not taken for them: nothing is converted)."""
    if isinstance(deleted, np.ma.MaskedArray | Mapping | str | bytes):
        raise ValidationError(Problem(f"must be a list or 1-d array of bools, got {type(deleted).__name__}",
                                      attribute=DELETED_COLUMN))
    try:
        flags = np.asarray(deleted)
    except (TypeError, ValueError):
        flags = np.asarray(None)
    if flags.size == 0 or (flags.dtype.kind == "O" and flags.ndim == 1
                           and all(isinstance(f, bool | np.bool_) for f in flags)):
        flags = flags.astype(bool)
    if flags.ndim != 1 or flags.dtype.kind != "b":
        raise ValidationError(Problem("must be a list or 1-d array of bools", attribute=DELETED_COLUMN))
    return flags
