"""Vektonn's JSON upload body (a JSON array of InputDataPointOrTombstoneDto) straight to the validated batch
table: orjson in, NumPy and Arrow out, no DTO per data point.

Decoding gives exactly what the routes' former path gave (pydantic DTOs, their conversion to records, then
shoal.log.validation.points_to_table; tests/helpers/dto_path.py keeps it as the tests' oracle): the same Arrow table,
or a ValidationError with the same problems (where the DTOs refused the JSON shape with pydantic's errors, the
problems here name the same points in Shoal's words). Those check a batch in three phases, and so does this
module, so a batch that breaks rules of several kinds reports the same ones:

1. shape: the JSON type of every field (shoal.vektonn.json_fields);
2. records: the value slot against the declared type, repeated attributes, vector present or absent;
3. batch: points_to_table's rules (size, attributes present, values, dimension, finiteness).

A batch of dense upserts and tombstones first takes a fast path that checks all three column-wise and hands the
columns to columns_to_table. Whatever the fast path cannot prove valid goes the exact way (records and
points_to_table), which finds and reports the problems, so errors are always those of the exact way.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import numpy as np
import pyarrow as pa
import pydantic

from shoal.errors import BatchTooLargeError, Problem, ValidationError
from shoal.log.records import AttributeType, DataPoint, DataSourceSpec, Tombstone
from shoal.log.validation import (
    ARROW_TYPES,
    MAX_PROBLEMS,
    any_sub_microsecond_text,
    columns_to_table,
    guid_text,
    points_to_table,
    to_float32,
)
from shoal.vektonn.json_fields import (
    SLOT,
    Entry,
    Vector,
    attributes_dict,
    canon,
    iso_datetime_texts,
    jtype,
    load,
    may_hold_booleans,
    read_entry,
    read_vector,
    shape_body,
    vector_value,
)
from shoal.vektonn.runs import runs
from shoal.vektonn.simd_upload import is_placeholder, load_dense

_DATETIMES = pydantic.TypeAdapter(list[dt.datetime])
_UNSET: Any = object()
# The keys the fast path takes, spelled exactly; anything else goes the exact way.
_ITEM_KEYS = frozenset(("attributes", "vector", "isDeleted"))
_DENSE_KEYS = frozenset(("isSparse", "coordinates"))
_NUMBERS = frozenset((int, float))

# A data point after phase 1: its attributes, its vector (None when absent) and whether it is a tombstone.
Shaped = tuple[list[Entry], Vector | None, bool]


class UploadBodyError(ValidationError):
    """The body is not a Vektonn upload at all: not JSON, not a JSON array, or an array of non-objects."""


class EmptyUploadError(ValidationError):
    """The upload body is an empty JSON array (refused as points_to_table refuses an empty batch)."""


def decode_upload(spec: DataSourceSpec, body: bytes, max_points: int, *, empty_sparse: bool = True) -> pa.Table:
    """Vektonn's upload body (a JSON array of InputDataPointOrTombstoneDto) as the validated batch table.

    Promises the table `points_to_table(spec, points_from_dtos(spec, dtos), max_points)` gives for the same
    body, or a ValidationError naming each problem's point position and attribute: UploadBodyError when the
    body is no JSON array of objects, EmptyUploadError ("batch is empty") for an empty array, BatchTooLargeError
    beyond `max_points` (before any point is checked). Nothing is written by this function either way.
    `empty_sparse=False` refuses a sparse vector without coordinates, as Vektonn does (the upload route); by
    default it is taken as the records take it (an all-zero vector), so a message the intake publisher encoded
    from SparseVector([], []) decodes as the producer would have written it.
    """
    if not spec.vectors_are_sparse:
        # The common case first: dense points with their coordinates read by simdjson into one matrix. Whatever
        # it cannot take (or the fast path cannot prove valid) is parsed again below, which decides.
        dense = load_dense(body)
        if dense is not None and type(dense[0]) is list and 0 < len(dense[0]) <= max_points:
            table = _fast_batch(spec, dense[0], max_points, dense[1])
            if table is not None:
                return table
    loaded = load(body, UploadBodyError)
    items = loaded[0]
    if type(items) is not list:
        raise UploadBodyError(f"the body must be a JSON array of data points, got {jtype(items)}")
    not_objects = [Problem(f"a data point must be a JSON object, got {jtype(item)}", pos)
                   for pos, item in enumerate(items) if type(item) is not dict]
    if not_objects:
        raise UploadBodyError(not_objects[:MAX_PROBLEMS])
    if not items:
        raise EmptyUploadError("batch is empty")
    if len(items) > max_points:
        # Refused before any point is read: checking each one first cost seconds per 100,000 points.
        raise BatchTooLargeError(
            Problem(f"batch holds {len(items)} points, more than the configured maximum {max_points}")
        )
    if not spec.vectors_are_sparse:
        table = _fast_batch(spec, items, max_points)
        if table is not None:
            return table
    return points_to_table(spec, _records(spec, shape_body(body, loaded, _shape), empty_sparse), max_points)


# -- the fast path --------------------------------------------------------------------------------------------


def _fast_batch(
    spec: DataSourceSpec, items: list[Any], max_points: int, matrix: np.ndarray | None = None
) -> pa.Table | None:
    """The batch's table when every item is a well-formed dense upsert or tombstone that breaks no rule; None
    otherwise (the exact path then decides, and reports what is wrong).

    With `matrix` (simd_upload.load_dense), the n-th upsert's coordinates must be the placeholder `[n]`, standing
    for row n of `matrix`, and every row must be some upsert's."""
    n = len(items)
    if n > max_points:
        return None
    types = spec.attribute_types
    permanent = frozenset(spec.permanent_attributes)
    # attribute -> (its slot, its values by position): filled in one pass over the points.
    columns: dict[str, tuple[str, list[Any]]] = {name: (SLOT[kind], [_UNSET] * n) for name, kind in types.items()}
    rows: list[Any] = [None] * n
    deleted = [False] * n
    upserts = 0
    for pos, item in enumerate(items):
        # Exact key spelling only: any other case, or an extra key, takes the exact path (which canonicalises).
        if type(item) is not dict or not item.keys() <= _ITEM_KEYS:
            return None
        tombstone = item.get("isDeleted", False)
        vector = item.get("vector")
        if tombstone is True:
            if vector is not None:
                return None
            deleted[pos] = True
            # The key alone (Shoal's form) or every attribute (Vektonn's): the count tells which, since the
            # checks below take each attribute of `expected` once.
            given = item.get("attributes")
            expected: Any = types if type(given) is list and len(given) == len(types) else permanent
        elif tombstone is not False:
            return None
        elif type(vector) is not dict or vector.get("isSparse", False) is not False or not vector.keys() <= _DENSE_KEYS:
            return None
        else:
            coordinates = vector.get("coordinates")
            if matrix is not None:
                # The placeholder of the next array in body order, else the body is not what load_dense assumed.
                if not is_placeholder(coordinates, upserts):
                    return None
                coordinates = upserts
                upserts += 1
            rows[pos] = coordinates
            expected = types
        attributes = item.get("attributes")
        if type(attributes) is not list or len(attributes) != len(expected):
            return None
        for attribute in attributes:
            if type(attribute) is not dict or len(attribute) != 2:
                return None
            key, value = attribute.get("key"), attribute.get("value")
            if type(key) is not str or type(value) is not dict or len(value) != 1 or key not in expected:
                return None
            slot, values = columns[key]
            raw = value.get(slot)
            # The declared slot, given once: with len(expected) attributes per point, all of them are present.
            if raw is None or values[pos] is not _UNSET:
                return None
            values[pos] = raw
    if matrix is not None and upserts != len(matrix):
        return None

    # Runs of upserts and of tombstones, in order, each one columnar batch (as the Arrow form is decoded).
    parts: list[pa.Table] = []
    for start, end in runs(deleted):
        names = spec.permanent_attributes if deleted[start] else types
        arrays: dict[str, Any] = {}
        for name in names:
            array = _fast_column(types[name], columns[name][1][start:end], exact=name in permanent)
            if array is None:
                return None
            arrays[name] = array
        if deleted[start]:
            # The other attributes of tombstones in Vektonn's form: checked for their type, then dropped.
            for name in types.keys() - permanent:
                given = [v for v in columns[name][1][start:end] if v is not _UNSET]
                if given and _fast_column(types[name], given, exact=False) is None:
                    return None
        if deleted[start]:
            vectors = None
        elif matrix is not None:
            vectors = _finite32(matrix[rows[start]:rows[end - 1] + 1], spec.vector_dimension)
        else:
            vectors = _dense_matrix(rows[start:end], end - start, spec.vector_dimension)
        if vectors is None and not deleted[start]:
            return None
        try:
            parts.append(columns_to_table(spec, vectors, arrays, max_points, delete=deleted[start]))
        except ValidationError:  # a rule the checks above missed: let the exact path report it as it would
            return None
    # One chunk per column, as points_to_table makes it.
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts).combine_chunks()


def _fast_column(kind: AttributeType, values: list[Any], *, exact: bool = True) -> Any:
    """One attribute's values as a column columns_to_table takes without a per-value check where it can, or
    None when a value is of the wrong JSON type or breaks a rule. `exact=False` (a payload attribute, or a
    tombstone's other attributes): a datetime below the microsecond is floored to it, not refused."""
    seen = set(map(type, values))  # C-level pass: the JSON types present in the column
    if kind is AttributeType.STRING:
        return pa.array(values, pa.string()) if seen == {str} else None
    if kind is AttributeType.INT64:
        if seen != {int}:  # bool is its own type here, so JSON booleans are refused
            return None
        try:
            return np.array(values, dtype=np.int64)
        except OverflowError:  # out of the int64 range: points_to_table words that problem
            return None
    if kind is AttributeType.FLOAT64:
        if not seen <= _NUMBERS:
            return None
        try:
            floats = np.array(values, dtype=np.float64)
        except OverflowError:
            return None
        return floats if np.isfinite(floats).all() else None
    if kind is AttributeType.BOOL:
        return np.array(values, dtype=np.bool_) if seen == {bool} else None
    if seen != {str}:
        return None
    if kind is AttributeType.GUID:
        out: list[str] = []
        for text in values:
            guid = guid_text(text)
            if guid is None:
                return None
            out.append(guid)
        return out
    if not iso_datetime_texts(values):  # pydantic reads Unix times and other forms Vektonn refuses
        return None
    try:
        moments = _DATETIMES.validate_python(values)  # digits past the sixth dropped: floored
    except pydantic.ValidationError:
        return None
    if exact and any_sub_microsecond_text(values):
        return None  # pydantic dropped digits below the microsecond: the exact path names the point
    try:
        # Naive datetimes are taken as UTC, as batch.check_value takes them.
        utc = [m.replace(tzinfo=dt.UTC) if m.tzinfo is None else m.astimezone(dt.UTC) for m in moments]
    except OverflowError:  # before year 1 in UTC: the exact path names the point
        return None
    return pa.array(utc, ARROW_TYPES[AttributeType.DATETIME])


def _dense_matrix(rows: list[Any], n: int, dim: int) -> np.ndarray | None:
    """The coordinates as one float32 [n, dim] array, rounded as the DTO path rounds them (to a double, then to
    float32); None when they are not n rows of `dim` finite numbers."""
    try:
        # No dtype: numpy's type discovery refuses strings, nulls and nested values (a float dtype would parse
        # "1.5" and turn null into NaN), and meets ragged rows with an error.
        matrix = np.array(rows)
    except (ValueError, TypeError, OverflowError):
        return None
    if matrix.dtype.kind not in "fiu" or matrix.shape != (n, dim):
        return None  # booleans alone make a bool matrix: no coordinate (the exact path names it)
    # NumPy reads true among numbers as 1: only rows holding a 0 or a 1 are looked at for a JSON boolean.
    maybe = np.flatnonzero(((matrix == 0) | (matrix == 1)).any(axis=1))
    if any(may_hold_booleans(rows[i], matrix[i]) for i in maybe):
        return None
    if matrix.dtype.kind != "f":
        matrix = matrix.astype(np.float64)  # an int64 straight to float32 could round differently
    return _finite32(matrix, dim)


def _finite32(matrix: np.ndarray, dim: int) -> np.ndarray | None:
    """A float64 [n, dim] matrix as float32, or None when it has another width or a value beyond float32."""
    if matrix.shape[1] != dim:
        return None
    vectors = to_float32(matrix)
    # A double beyond float32's range becomes inf: the exact path names the point and index.
    return vectors if np.isfinite(vectors).all() else None


# -- the exact path: phase 1 (shape) and phase 2 (records) ----------------------------------------------------


def _shape(items: list[dict[str, Any]]) -> tuple[list[Shaped], list[Problem]]:
    """Every data point's fields checked for their JSON types, as the DTOs checked them."""
    problems: list[Problem] = []
    out: list[Shaped] = []
    for pos, raw in enumerate(items):
        item = canon(raw)
        entries: list[Entry] = []
        if "attributes" not in item:
            problems.append(Problem("a data point needs attributes", pos, "attributes"))
        elif type(item["attributes"]) is not list:
            problems.append(
                Problem(f"attributes must be a JSON array, got {jtype(item['attributes'])}", pos, "attributes")
            )
        else:
            for attribute in item["attributes"]:
                entry = read_entry(attribute, pos, "attributes", problems)
                if entry is not None:
                    entries.append(entry)
        vector = item.get("vector")
        if vector is not None:
            vector = read_vector(vector, pos, "vector", problems)
        deleted = item.get("isDeleted", False)
        if type(deleted) is not bool:
            problems.append(Problem(f"isDeleted must be a JSON boolean, got {jtype(deleted)}", pos, "isDeleted"))
        out.append((entries, vector, deleted is True))
    return out, problems


def _records(spec: DataSourceSpec, items: list[Shaped], empty_sparse: bool = True) -> list[DataPoint | Tombstone]:
    """The batch as records, with the former points_from_dtos's rules; ValidationError listing what breaks them."""
    problems: list[Problem] = []
    records: list[DataPoint | Tombstone] = []
    for pos, (entries, vector, deleted) in enumerate(items):
        # Below the microsecond, a key's instant is refused and a payload's floored (see attributes_dict). A
        # tombstone stores its key alone: its other attributes are checked for their type only.
        attributes = attributes_dict(spec, entries, pos, problems, exact=spec.permanent_attributes)
        if deleted:
            if vector is not None:
                problems.append(Problem("a tombstone carries no vector", pos, "vector"))
            records.append(Tombstone(attributes))
            continue
        if vector is None:
            problems.append(Problem("a data point needs a vector", pos, "vector"))
            continue
        value = vector_value(spec, vector, pos, "vector", problems, empty_sparse=empty_sparse)
        if value is not None:
            records.append(DataPoint(attributes, value))
    if problems:
        raise ValidationError(problems)
    return records
