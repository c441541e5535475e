"""Vektonn's wire format straight to and from columns: orjson in, NumPy and Arrow out, no DTO per data point.

Decoding gives exactly what the routes' former path gave (pydantic DTOs, their conversion to records, then
shoal.log.validation.points_to_table; tests/helpers/dto_path.py keeps it as the tests' oracle): the same Arrow table,
or a ValidationError with the same problems (where the DTOs refused the JSON shape with pydantic's errors, the
problems here name the same points in Shoal's words). Those check a batch in three phases, and so does this
module, so a batch that breaks rules of several kinds reports the same ones:

1. shape: the JSON type of every field (what the pydantic DTOs checked), keys matched ignoring case;
2. records: the value slot against the declared type, repeated attributes, vector present or absent (what
   the former points_from_dtos checked);
3. batch: batch.points_to_table's rules (size, attributes present, values, dimension, finiteness).

A batch of dense upserts and tombstones first takes a fast path that checks all three column-wise and hands the
columns to columns_to_table. Whatever the fast path cannot prove valid goes the exact way (records and
points_to_table), which finds and reports the problems, so errors are always those of the exact way.

Types are stricter than pydantic's lax mode was: a slot, `isDeleted`, `isSparse`, `k` or `retrieveVectors`
holding a JSON value of another type ("5" for an int64, 1 or "yes" for a bool, 1.0 for an integer, a number of
seconds for a dateTime) is refused instead of coerced. Coordinates are JSON numbers; a JSON boolean among them
still reads as 1 or 0, as before (refusing it would cost a type check per coordinate on every batch).
"""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pydantic

from shoal.errors import Problem, ValidationError
from shoal.log.validation import ARROW_TYPES, MAX_PROBLEMS, VECTOR, columns_to_table, points_to_table
from shoal.log.records import AttributeType, DataPoint, DataSourceSpec, SparseVector, Tombstone
from shoal.searcher.hits import Hit, Hits

JSON = "application/json"
ARROW = "application/vnd.apache.arrow.stream"
VECTOR_COLUMN = "vector"  # Arrow form: fixed-size (or equal-length) list of float per row
DELETED_COLUMN = "is_deleted"  # Arrow form, optional: true rows are tombstones (key columns only matter)

VALUE_KINDS = ("string", "guid", "bool", "int64", "float64", "dateTime")
# Every field name of Vektonn's DTOs: input keys are matched to these ignoring case, as Vektonn (and dto.py) do.
_FIELDS = (
    "attributes", "key", "value", "vector", "isSparse", "coordinates", "coordinateIndices", "isDeleted", "k",
    "queryVectors", "splitFilter", "retrieveVectors", *VALUE_KINDS,
)
_CANONICAL = {name.lower(): name for name in _FIELDS}
_FIELD_SET = frozenset(_FIELDS)

# The slot each attribute type travels in.
SLOT: dict[AttributeType, str] = {
    AttributeType.STRING: "string",
    AttributeType.GUID: "guid",
    AttributeType.BOOL: "bool",
    AttributeType.INT64: "int64",
    AttributeType.FLOAT64: "float64",
    AttributeType.DATETIME: "dateTime",
}
_JSON_TYPES: dict[type, str] = {
    bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null", list: "array",
    dict: "object",
}
# A rule that a JSON integer too large for 64 bits may break only because orjson reads it as a float (see _load).
_INTEGER_WANTED = "must be a JSON integer, got number"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

# Guids and datetimes are parsed by pydantic, as the DTOs parsed them: the same strings are accepted.
_UUID = pydantic.TypeAdapter(uuid.UUID)
_DATETIME = pydantic.TypeAdapter(dt.datetime)
_DATETIMES = pydantic.TypeAdapter(list[dt.datetime])
# The hyphenated form: pydantic and uuid.UUID both take it and agree on its canonical (lower-case) text.
_HYPHENATED_GUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_UNSET: Any = object()
# The keys the fast path takes, spelled exactly; anything else goes the exact way.
_ITEM_KEYS = frozenset(("attributes", "vector", "isDeleted"))
_DENSE_KEYS = frozenset(("isSparse", "coordinates"))
_NUMBERS = frozenset((int, float))
_COORDINATE_TYPES = frozenset((float, int, bool))  # a JSON boolean reads as 1 or 0, as the DTO read it


def _dense_numbers(raw: Any) -> np.ndarray | None:
    """A dense vector's coordinates as float64, when they are a JSON array of numbers (booleans reading as 1 or
    0, as the DTO read them); None otherwise, and the per-value checks then name what is wrong.

    NumPy's type discovery runs in C: a list of numbers becomes a numeric array, anything else (a string, a
    null, a nested array, an integer beyond 64 bits) an array of another kind. The values are the doubles
    float() gives, so they round to float32 as before.
    """
    if type(raw) is not list:
        return None
    try:
        array = np.asarray(raw)
    except (ValueError, OverflowError):  # ragged nesting and the like
        return None
    if array.ndim != 1 or array.dtype.kind not in "fiub":
        return None
    return array.astype(np.float64, copy=False)

# An attribute after phase 1: (key, slot, value); a vector: (is sparse, coordinates, coordinate indices).
Entry = tuple[str, str, Any]
Vector = tuple[bool, list[float], list[int] | None]


class UploadBodyError(ValidationError):
    """The body is not a Vektonn upload at all: not JSON, not a JSON array, or an array of non-objects."""


class EmptyUploadError(ValidationError):
    """The upload body is an empty JSON array (refused as points_to_table refuses an empty batch)."""


@dataclass(frozen=True)
class SearchQuery:
    """Vektonn's SearchQueryDto with its JSON types checked. Query vectors are canonical dicts
    `{"isSparse", "coordinates" (floats), "coordinateIndices" (ints or None)}`; split filter entries are
    `{"key", "value": {slot: value}}` with guids as uuid.UUID and dateTimes as datetime, as the DTO held them."""

    k: int
    query_vectors: list[dict[str, Any]]
    split_filter: list[dict[str, Any]] | None
    retrieve_vectors: bool = False


# -- upload ---------------------------------------------------------------------------------------------------


def decode_upload(spec: DataSourceSpec, body: bytes, max_points: int) -> pa.Table:
    """Vektonn's upload body (a JSON array of InputDataPointOrTombstoneDto) as the validated batch table.

    Promises the table `points_to_table(spec, points_from_dtos(spec, dtos), max_points)` gives for the same
    body, or a ValidationError naming each problem's point position and attribute: UploadBodyError when the
    body is no JSON array of objects, EmptyUploadError ("batch is empty") for an empty array, BatchTooLargeError
    beyond `max_points`. Nothing is written by this function either way.
    """
    items, by_stdlib = _load(body, UploadBodyError)
    if type(items) is not list:
        raise UploadBodyError(f"the body must be a JSON array of data points, got {_jtype(items)}")
    not_objects = [Problem(f"a data point must be a JSON object, got {_jtype(item)}", pos)
                   for pos, item in enumerate(items) if type(item) is not dict]
    if not_objects:
        raise UploadBodyError(not_objects[:MAX_PROBLEMS])
    if not items:
        raise EmptyUploadError("batch is empty")
    if not spec.vectors_are_sparse:
        table = _fast_batch(spec, items, max_points)
        if table is not None:
            return table
    parsed, problems = _shape(items)
    if problems and not by_stdlib and _maybe_wide_integer(problems):
        parsed, problems = _shape(_reload(body, items))
    if problems:
        raise ValidationError(problems[:MAX_PROBLEMS])
    return points_to_table(spec, _records(spec, parsed), max_points)


def _fast_batch(spec: DataSourceSpec, items: list[dict[str, Any]], max_points: int) -> pa.Table | None:
    """The batch's table when every item is a well-formed dense upsert or tombstone that breaks no rule; None
    otherwise (the exact path then decides, and reports what is wrong)."""
    n = len(items)
    if n > max_points:
        return None
    types = spec.attribute_types
    permanent = frozenset(spec.permanent_attributes)
    # attribute -> (its slot, its values by position): filled in one pass over the points.
    columns: dict[str, tuple[str, list[Any]]] = {name: (SLOT[kind], [_UNSET] * n) for name, kind in types.items()}
    rows: list[Any] = [None] * n
    deleted = [False] * n
    for pos, item in enumerate(items):
        # Exact key spelling only: any other case, or an extra key, takes the exact path (which canonicalises).
        if not item.keys() <= _ITEM_KEYS:
            return None
        tombstone = item.get("isDeleted", False)
        vector = item.get("vector")
        if tombstone is True:
            if vector is not None:
                return None
            deleted[pos] = True
            expected: Any = permanent
        elif tombstone is not False:
            return None
        elif type(vector) is not dict or vector.get("isSparse", False) is not False or not vector.keys() <= _DENSE_KEYS:
            return None
        else:
            rows[pos] = vector.get("coordinates")
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

    # Runs of upserts and of tombstones, in order, each one columnar batch (as the Arrow form is decoded).
    edges = [0, *(i for i in range(1, n) if deleted[i] != deleted[i - 1]), n]
    parts: list[pa.Table] = []
    for start, end in zip(edges, edges[1:], strict=False):
        names = spec.permanent_attributes if deleted[start] else types
        arrays: dict[str, Any] = {}
        for name in names:
            array = _fast_column(types[name], columns[name][1][start:end])
            if array is None:
                return None
            arrays[name] = array
        vectors = None if deleted[start] else _dense_matrix(rows[start:end], end - start, spec.vector_dimension)
        if vectors is None and not deleted[start]:
            return None
        try:
            parts.append(columns_to_table(spec, vectors, arrays, max_points, delete=deleted[start]))
        except ValidationError:  # a rule the checks above missed: let the exact path report it as it would
            return None
    # One chunk per column, as points_to_table makes it.
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts).combine_chunks()


def _fast_column(kind: AttributeType, values: list[Any]) -> Any:
    """One attribute's values as a column columns_to_table takes without a per-value check where it can, or
    None when a value is of the wrong JSON type or breaks a rule."""
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
            if _HYPHENATED_GUID.fullmatch(text):
                out.append(text)  # columns_to_table canonicalises (lower case), as points_to_table does
                continue
            try:
                out.append(str(_UUID.validate_python(text)))
            except pydantic.ValidationError:
                return None
        return out
    try:
        moments = _DATETIMES.validate_python(values)
    except pydantic.ValidationError:
        return None
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
    if matrix.dtype.kind not in "fib" or matrix.shape != (n, dim):
        return None
    if matrix.dtype.kind != "f":
        matrix = matrix.astype(np.float64)  # an int64 straight to float32 could round differently
    with np.errstate(over="ignore"):
        vectors = matrix.astype(np.float32)
    # A double beyond float32's range becomes inf: the exact path names the point and index.
    return vectors if np.isfinite(vectors).all() else None


# -- phase 1: JSON shape --------------------------------------------------------------------------------------


def _shape(items: list[dict[str, Any]]) -> tuple[list[tuple[list[Entry], Vector | None, bool]], list[Problem]]:
    """Every data point's fields checked for their JSON types, as the DTOs checked them."""
    problems: list[Problem] = []
    out: list[tuple[list[Entry], Vector | None, bool]] = []
    for pos, raw in enumerate(items):
        item = _canon(raw)
        entries: list[Entry] = []
        if "attributes" not in item:
            problems.append(Problem("a data point needs attributes", pos, "attributes"))
        elif type(item["attributes"]) is not list:
            problems.append(
                Problem(f"attributes must be a JSON array, got {_jtype(item['attributes'])}", pos, "attributes")
            )
        else:
            for attribute in item["attributes"]:
                entry = _entry(attribute, pos, "attributes", problems)
                if entry is not None:
                    entries.append(entry)
        vector = item.get("vector")
        if vector is not None:
            vector = _vector(vector, pos, "vector", problems)
        deleted = item.get("isDeleted", False)
        if type(deleted) is not bool:
            problems.append(Problem(f"isDeleted must be a JSON boolean, got {_jtype(deleted)}", pos, "isDeleted"))
        out.append((entries, vector, deleted is True))
    return out, problems


def _entry(raw: Any, position: int | None, field: str, problems: list[Problem]) -> Entry | None:
    """One AttributeDto `{key, value: {<slot>: v}}` as (key, slot, value), or None after noting the problem."""
    if type(raw) is not dict:
        problems.append(Problem(f"an attribute must be a JSON object {{key, value}}, got {_jtype(raw)}", position,
                                field))
        return None
    entry = _canon(raw)
    key = entry.get("key")
    name = key if type(key) is str else None
    if name is None:
        rule = (
            "an attribute needs a key" if key is None else f"an attribute key must be a JSON string, got {_jtype(key)}"
        )
        problems.append(Problem(rule, position, field))
    if "value" not in entry:
        problems.append(Problem("an attribute needs a value", position, name or field))
        return None
    value = _value(entry["value"], position, name or field, problems)
    if name is None or value is None:
        return None
    return name, value[0], value[1]


def _value(raw: Any, position: int | None, attribute: str, problems: list[Problem]) -> tuple[str, Any] | None:
    """An AttributeValueDto as (slot, value): exactly one slot holds a value of the slot's JSON type."""
    if type(raw) is not dict:
        problems.append(Problem(
            f"an attribute value must be a JSON object holding one of {', '.join(VALUE_KINDS)}, got {_jtype(raw)}",
            position, attribute,
        ))
        return None
    slots = _canon(raw)
    if "bool" not in slots and "bool_" in slots:
        # The DTO also took its Python field name for the bool slot (populate_by_name): keep taking it.
        slots = {**slots, "bool": slots["bool_"]}
    given: list[tuple[str, Any]] = []
    valid = True
    for slot in VALUE_KINDS:
        held = slots.get(slot)
        if held is None:  # a null slot is an empty slot, as in the DTO
            continue
        value, rule = _slot_value(slot, held)
        if rule is not None:
            problems.append(Problem(rule, position, attribute))
            valid = False
        else:
            given.append((slot, value))
    if not valid:
        return None
    if len(given) != 1:
        problems.append(Problem(
            f"an attribute value needs exactly one of {', '.join(VALUE_KINDS)} (got {len(given)})", position, attribute
        ))
        return None
    return given[0]


def _slot_value(slot: str, raw: Any) -> tuple[Any, str | None]:
    """(the slot's Python value, None), or (None, the rule the JSON value breaks)."""
    kind = type(raw)
    if slot == "string":
        return (raw, None) if kind is str else (None, _wrong_type(slot, "string", raw))
    if slot == "int64":
        return (raw, None) if kind is int else (None, _wrong_type(slot, "integer", raw))
    if slot == "bool":
        return (raw, None) if kind is bool else (None, _wrong_type(slot, "boolean", raw))
    if slot == "float64":
        if kind is float:
            return raw, None
        if kind is int:
            try:
                return float(raw), None
            except OverflowError:
                return None, "float64 value out of range"
        return None, _wrong_type(slot, "number", raw)
    if kind is not str:
        return None, _wrong_type(slot, "string", raw)
    if slot == "guid":
        try:
            return _UUID.validate_python(raw), None
        except pydantic.ValidationError:
            return None, f"not a guid: {raw[:50]!r}"
    try:
        moment = _DATETIME.validate_python(raw)
    except pydantic.ValidationError:
        return None, f"not an ISO 8601 date and time: {raw[:50]!r}"
    try:
        moment.astimezone(dt.UTC)  # "0001-01-01T00:00:00+01:00" is before year 1 in UTC, where it is stored
    except OverflowError:
        return None, f"date and time out of range in UTC: {raw[:50]!r}"
    return moment, None


def _wrong_type(slot: str, wanted: str, raw: Any) -> str:
    return f"{slot} value must be a JSON {wanted}, got {_jtype(raw)}"


def _vector(raw: Any, position: int | None, attribute: str, problems: list[Problem]) -> Vector | None:
    """A VectorDto as (is sparse, coordinates as floats, indices or None), or None after noting the problem."""
    if type(raw) is not dict:
        problems.append(Problem(
            f"a vector must be a JSON object {{isSparse, coordinates, coordinateIndices}}, got {_jtype(raw)}",
            position, attribute,
        ))
        return None
    vector = _canon(raw)
    before = len(problems)
    sparse = vector.get("isSparse", False)
    if type(sparse) is not bool:
        problems.append(Problem(f"isSparse must be a JSON boolean, got {_jtype(sparse)}", position, attribute))
    coordinates: list[float] = []
    if "coordinates" not in vector:
        problems.append(Problem("a vector needs coordinates", position, attribute))
    else:
        raw_coordinates = vector["coordinates"]
        numbers = _dense_numbers(raw_coordinates) if sparse is False else None
        if numbers is not None:
            coordinates = numbers  # type: ignore[assignment]
        elif type(raw_coordinates) is not list:
            problems.append(Problem(f"coordinates must be a JSON array of numbers, got {_jtype(raw_coordinates)}",
                                    position, attribute))
        elif not set(map(type, raw_coordinates)) <= _COORDINATE_TYPES:
            bad = next(i for i, c in enumerate(raw_coordinates) if type(c) not in _COORDINATE_TYPES)
            problems.append(Problem(
                f"coordinates must be JSON numbers, got {_jtype(raw_coordinates[bad])} at index {bad}",
                position, attribute,
            ))
        else:
            try:
                coordinates = list(map(float, raw_coordinates))  # as the DTO's list[float] held them
            except OverflowError:
                problems.append(Problem("a coordinate is out of the range of a double", position, attribute))
    indices = vector.get("coordinateIndices")
    if indices is not None:
        if type(indices) is not list:
            problems.append(Problem(f"coordinateIndices must be a JSON array of integers, got {_jtype(indices)}",
                                    position, attribute))
        elif not set(map(type, indices)) <= {int}:
            bad = next(i for i, c in enumerate(indices) if type(c) is not int)
            problems.append(Problem(
                f"coordinateIndices[{bad}] must be a JSON integer, got {_jtype(indices[bad])}", position, attribute
            ))
    if len(problems) != before:
        return None
    return sparse, coordinates, indices


# -- phase 2: records -----------------------------------------------------------------------------------------


def _records(
    spec: DataSourceSpec, items: list[tuple[list[Entry], Vector | None, bool]]
) -> list[DataPoint | Tombstone]:
    """The batch as records, with the former points_from_dtos's rules; ValidationError listing what breaks them."""
    problems: list[Problem] = []
    records: list[DataPoint | Tombstone] = []
    for pos, (entries, vector, deleted) in enumerate(items):
        attributes = _attributes(spec, entries, pos, problems)
        if deleted:
            if vector is not None:
                problems.append(Problem("a tombstone carries no vector", pos, "vector"))
            records.append(Tombstone(attributes))
            continue
        if vector is None:
            problems.append(Problem("a data point needs a vector", pos, "vector"))
            continue
        value = _vector_value(spec, vector, pos, "vector", problems)
        if value is not None:
            records.append(DataPoint(attributes, value))
    if problems:
        raise ValidationError(problems)
    return records


def _attributes(
    spec: DataSourceSpec, entries: list[Entry], position: int | None, problems: list[Problem]
) -> dict[str, Any]:
    """{key: value}: each key once, each declared attribute in its type's slot, guids as canonical text."""
    out: dict[str, Any] = {}
    for key, slot, value in entries:
        if key in out:
            problems.append(Problem("attribute given twice", position, key))
            continue
        declared = spec.attribute_types.get(key)
        if declared is not None and slot != SLOT[declared]:
            problems.append(Problem(f"expected a {SLOT[declared]} value, got {slot}", position, key))
            continue
        out[key] = str(value) if declared is AttributeType.GUID else value
    return out


def _vector_value(
    spec: DataSourceSpec, vector: Vector, position: int | None, attribute: str, problems: list[Problem]
) -> list[float] | SparseVector | None:
    """A vector as the records take it (a list, or a SparseVector), or None after noting the problem."""
    sparse, coordinates, indices = vector
    if sparse != spec.vectors_are_sparse:
        want = "sparse" if spec.vectors_are_sparse else "dense"
        problems.append(Problem(f"the data source holds {want} vectors", position, attribute))
        return None
    if not sparse:
        return coordinates
    if indices is None:
        problems.append(Problem("a sparse vector needs coordinateIndices", position, attribute))
        return None
    if any(i < _INT64_MIN or i > _INT64_MAX for i in indices):
        # Beyond int64 NumPy cannot even hold the index (the DTO path failed there with a server error).
        problems.append(Problem(f"sparse index out of range 0..{spec.vector_dimension - 1}", position, attribute))
        return None
    return SparseVector(indices, coordinates)


# -- search ---------------------------------------------------------------------------------------------------


def decode_search(body: bytes) -> SearchQuery:
    """Vektonn's SearchQueryDto (`k`, `queryVectors`, `splitFilter`, `retrieveVectors`; keys in any case) with
    its JSON types checked; ValidationError naming the field otherwise. Values are checked against the data
    source by query_vectors() and split_filter(); that k is positive is left to the caller, as before."""
    raw, by_stdlib = _load(body, ValidationError)
    query, problems = _search_shape(raw)
    if problems and not by_stdlib and _maybe_wide_integer(problems):
        query, problems = _search_shape(_reload(body, raw))
    if problems or query is None:
        raise ValidationError(problems[:MAX_PROBLEMS])
    return query


def _search_shape(raw: Any) -> tuple[SearchQuery | None, list[Problem]]:
    if type(raw) is not dict:
        return None, [Problem(f"a search query must be a JSON object, got {_jtype(raw)}")]
    query = _canon(raw)
    problems: list[Problem] = []
    k = query.get("k")
    if k is None:
        problems.append(Problem("a search query needs k", attribute="k"))
    elif type(k) is not int:
        problems.append(Problem(f"k must be a JSON integer, got {_jtype(k)}", attribute="k"))
    vectors: list[dict[str, Any]] = []
    raw_vectors = query.get("queryVectors")
    if raw_vectors is None:
        problems.append(Problem("a search query needs queryVectors", attribute="queryVectors"))
    elif type(raw_vectors) is not list:
        problems.append(Problem(f"queryVectors must be a JSON array of vectors, got {_jtype(raw_vectors)}",
                                attribute="queryVectors"))
    else:
        for i, raw_vector in enumerate(raw_vectors):
            vector = _vector(raw_vector, i, "queryVectors", problems)
            if vector is not None:
                vectors.append({"isSparse": vector[0], "coordinates": vector[1], "coordinateIndices": vector[2]})
    split: list[dict[str, Any]] | None = None
    raw_split = query.get("splitFilter")
    if raw_split is not None:
        if type(raw_split) is not list:
            problems.append(Problem(f"splitFilter must be a JSON array of attributes, got {_jtype(raw_split)}",
                                    attribute="splitFilter"))
        else:
            split = []
            for raw_entry in raw_split:
                entry = _entry(raw_entry, None, "splitFilter", problems)
                if entry is not None:
                    split.append({"key": entry[0], "value": {entry[1]: entry[2]}})
    retrieve = query.get("retrieveVectors", False)
    if type(retrieve) is not bool:
        problems.append(Problem(f"retrieveVectors must be a JSON boolean, got {_jtype(retrieve)}",
                                attribute="retrieveVectors"))
    if problems:
        return None, problems
    assert isinstance(k, int)
    return SearchQuery(k, vectors, split, retrieve is True), []


def query_vectors(spec: DataSourceSpec, query: SearchQuery) -> list[Any] | np.ndarray:
    """The query vectors as the searcher takes them: dense ones as one float32 [n, dim] array when they have
    one length (else the list, which the searcher refuses by name), sparse ones as SparseVectors. ValidationError
    with the former query_vectors's problems (attribute `queryVectors`) when one is of the wrong kind."""
    problems: list[Problem] = []
    out: list[Any] = []
    for i, vector in enumerate(query.query_vectors):
        triple = (vector["isSparse"], vector["coordinates"], vector["coordinateIndices"])
        out.append(_vector_value(spec, triple, i, "queryVectors", problems))
    if problems:
        raise ValidationError(problems)
    if not spec.vectors_are_sparse and out and len(set(map(len, out))) == 1:
        # Through float64, as np.asarray(list of floats, float32) rounds them in the searcher. A double beyond
        # float32's range becomes inf here, which the searcher refuses by name: no overflow warning for it.
        with np.errstate(over="ignore"):
            return np.array(out, dtype=np.float64).astype(np.float32)
    return out


def split_filter(spec: DataSourceSpec, query: SearchQuery) -> dict[str, Any] | None:
    """The split filter as {attribute: value} (None when absent or empty), with the former split_filter's rules."""
    if not query.split_filter:
        return None
    entries = [(e["key"], *next(iter(e["value"].items()))) for e in query.split_filter]
    problems: list[Problem] = []
    out = _attributes(spec, entries, None, problems)
    if problems:
        raise ValidationError(problems)
    return out


def encode_search_results(
    spec: DataSourceSpec, query_vectors: Sequence[Any] | np.ndarray, results: Sequence[Sequence[Hit]],
    retrieve_vectors: bool,
) -> bytes:
    """The JSON the search routes answer: a list of SearchResultDto with null fields left out, as pydantic wrote
    it (same keys, order and values; floats and datetimes as pydantic's JSON writes them).

    `query_vectors` are echoed as each result's queryVector: pass `SearchQuery.query_vectors` to echo them
    exactly as sent (a float32 array echoes the float32 values). Hit vectors are written only with
    `retrieve_vectors`.
    """
    out = [
        {"queryVector": _vector_json(query), "nearestDataPoints": _found(spec, hits, retrieve_vectors)}
        for query, hits in zip(query_vectors, results, strict=True)
    ]
    # OPT_UTC_Z: pydantic writes a UTC datetime with "Z", orjson would write "+00:00".
    return orjson.dumps(out, option=orjson.OPT_UTC_Z | orjson.OPT_SERIALIZE_NUMPY)


def _found(spec: DataSourceSpec, hits: Sequence[Hit], retrieve_vectors: bool) -> list[dict[str, Any]]:
    """FoundDataPointDto of each hit: `vector` (when retrieved), `attributes` without null values, `distance`."""
    n = len(hits)
    if n == 0:
        return []
    types = spec.attribute_types
    by_column = _hit_columns(hits)
    if by_column is not None:
        names, columns = by_column
        distances = list(map(float, hits.distances))  # type: ignore[attr-defined]
        per_hit: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        for name, column in zip(names, columns, strict=True):
            slot = SLOT[types[name]]
            for attributes, value in zip(per_hit, column, strict=True):
                if value is not None:
                    attributes.append({"key": name, "value": {slot: value}})
    else:
        hit_list = list(hits)
        distances = [float(h.distance) for h in hit_list]
        per_hit = [
            [{"key": k, "value": {SLOT[types[k]]: v}} for k, v in h.attributes.items() if v is not None]
            for h in hit_list
        ]
    if retrieve_vectors:
        vectors = _dense_hit_vectors(hits)
        if vectors is None:
            vectors = [h.vector for h in hits]
        return [
            {"vector": _vector_json(v), "attributes": a, "distance": d} if v is not None else
            {"attributes": a, "distance": d}
            for v, a, d in zip(vectors, per_hit, distances, strict=True)
        ]
    return [{"attributes": a, "distance": d} for a, d in zip(per_hit, distances, strict=True)]


def _hit_columns(hits: Sequence[Hit]) -> tuple[tuple[str, ...], list[list[Any]]] | None:
    """The carried attributes of every hit, one list per attribute in the order each Hit's dict has them, read
    column-wise without making Hit objects; None when that order cannot be known (then Hit objects are read).

    Hits exposes column() but not which attributes it carries in what order; that is its sources' `stored`,
    read here defensively so a change in Hits' internals only costs speed.
    """
    if not isinstance(hits, Hits):
        return None
    sources = getattr(hits, "_sources", None)
    if not sources:
        return None
    stored = getattr(sources[0], "stored", None)
    if not stored or any(getattr(s, "stored", None) != stored for s in sources[1:]):
        return None
    try:
        return stored, [hits.column(name) for name in stored]
    except KeyError:
        return None


def _dense_hit_vectors(hits: Sequence[Hit]) -> list[Any] | None:
    """The dense vector of every hit as a float64 row (orjson writes those as it writes floats, without a Python
    float per coordinate), taken column-wise from the rows the hits point into; None when the hits do not
    show those rows (then Hit objects are read)."""
    if not isinstance(hits, Hits):
        return None
    sources = getattr(hits, "_sources", None)
    owners = getattr(hits, "_owners", None)
    if not sources:
        return None
    rows = hits.rows
    if owners is None:  # every hit is a row of the first source
        groups = [(sources[0], list(range(len(rows))))]
    else:
        groups = [(source, [i for i, owner in enumerate(owners) if owner == o]) for o, source in enumerate(sources)]
    out: list[Any] = [None] * len(rows)
    for source, where in groups:
        if not where:
            continue
        table = getattr(source, "table", None)
        if not isinstance(table, pa.Table) or VECTOR not in table.column_names:
            return None
        picked = table[VECTOR].take([rows[i] for i in where]).combine_chunks()
        if not pa.types.is_fixed_size_list(picked.type) or picked.null_count:
            return None
        matrix = picked.flatten().to_numpy(zero_copy_only=False).astype(np.float64).reshape(len(where), -1)
        for i, row in zip(where, matrix, strict=True):
            out[i] = row
    return out


def _vector_json(vector: Any) -> dict[str, Any]:
    """A VectorDto as pydantic wrote it: coordinates as floats, coordinateIndices only for sparse vectors."""
    if isinstance(vector, dict):
        if vector["isSparse"]:
            return {"isSparse": True, "coordinates": list(map(float, vector["coordinates"])),
                    "coordinateIndices": list(map(int, vector["coordinateIndices"]))}
        coordinates = vector["coordinates"]
        if isinstance(coordinates, np.ndarray) and coordinates.dtype == np.float64:
            # orjson writes a float64 array as it writes the same Python floats, in C.
            return {"isSparse": False, "coordinates": coordinates}
        return {"isSparse": False, "coordinates": list(map(float, coordinates))}
    if isinstance(vector, SparseVector):
        return {"isSparse": True, "coordinates": list(map(float, vector.values)),
                "coordinateIndices": list(map(int, vector.indices))}
    if isinstance(vector, np.ndarray):
        # float64, not float32: orjson writes a float32 with float32's shortest digits, pydantic wrote the double.
        return {"isSparse": False, "coordinates": np.ascontiguousarray(vector, dtype=np.float64).reshape(-1)}
    return {"isSparse": False, "coordinates": list(map(float, vector))}


# -- Arrow ----------------------------------------------------------------------------------------------------


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
    edges = [0, *(np.flatnonzero(deleted[1:] != deleted[:-1]) + 1).tolist(), table.num_rows]
    parts = []
    for start, end in zip(edges, edges[1:], strict=False):
        part = table.slice(start, end - start)
        attrs = {name: part[name].combine_chunks() for name in part.column_names if name != VECTOR_COLUMN}
        if deleted[start]:
            keys = {name: attrs[name] for name in spec.permanent_attributes if name in attrs}
            parts.append(columns_to_table(spec, None, keys, max_points, delete=True))
        else:
            parts.append(columns_to_table(spec, _arrow_vectors(part, spec.vector_dimension), attrs, max_points))
    out = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    if out.num_rows > max_points:
        raise ValidationError(f"the message holds {out.num_rows} points, more than the {max_points} allowed")
    return out


def _arrow_vectors(part: pa.Table, dim: int) -> np.ndarray:
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


# -- JSON -----------------------------------------------------------------------------------------------------


def _load(body: bytes | bytearray | memoryview | str, error: type[ValidationError]) -> tuple[Any, bool]:
    """The parsed body and whether Python's json parsed it (because orjson refused it); `error` otherwise."""
    try:
        return orjson.loads(body), False
    except orjson.JSONDecodeError as exc:
        refusal = exc
    # FastAPI parsed request bodies with Python's json, which takes what orjson refuses: NaN and Infinity,
    # numbers beyond a double, a byte order mark. Take them too, so such a body meets the rules it met before
    # (a non-finite coordinate is a point's problem, not a parse error).
    try:
        parsed = json.loads(bytes(body) if isinstance(body, memoryview) else body)
        # Lone surrogates cannot be stored as UTF-8 (the DTO path failed on them with a server error).
        json.dumps(parsed, ensure_ascii=False).encode("utf-8")
    except (ValueError, TypeError, RecursionError):  # UnicodeError is a ValueError
        raise error(f"the body is not JSON: {refusal}") from None
    return parsed, True


def _maybe_wide_integer(problems: list[Problem]) -> bool:
    """True when a problem may come from orjson reading an integer beyond 64 bits as a float."""
    return any(_INTEGER_WANTED in p.rule for p in problems)


def _reload(body: bytes | bytearray | memoryview | str, parsed: Any) -> Any:
    """The body as Python's json parses it (integers of any size stay integers, as the DTO path had them)."""
    try:
        return json.loads(bytes(body) if isinstance(body, memoryview) else body)
    except (ValueError, TypeError, RecursionError):
        return parsed


def _canon(obj: dict[str, Any]) -> dict[str, Any]:
    """The object with its keys spelled as Vektonn's fields are (the last of two spellings wins, as in dto.py)."""
    if obj.keys() <= _FIELD_SET:
        return obj
    return {_CANONICAL.get(k.lower(), k): v for k, v in obj.items()}


def _jtype(value: Any) -> str:
    """The JSON type name of a parsed value."""
    return _JSON_TYPES.get(type(value), type(value).__name__)
