"""Validation of a batch against its data source, and its conversion to the log's Arrow schema.

All or nothing: a batch either becomes one Arrow table or raises ValidationError listing the broken rules,
each naming the point's position in the batch, the attribute and the rule.
"""

from __future__ import annotations

import datetime as dt
import decimal
import itertools
import math
import operator
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence, Sized
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pydantic

from shoal.errors import BatchTooLargeError, Problem, ValidationError
from shoal.log.records import AttributeType, DataPoint, DataSourceSpec, SparseVector, Tombstone, unicode_text

OP = "__op"
KEY = "__key"
VECTOR = "__vector"
SPARSE_INDICES = "__sparse_indices"
SPARSE_VALUES = "__sparse_values"
SEQ_OFFSET = "__seq_offset"
INGESTED_AT = "__ingested_at"
SEQ = "__seq"  # absolute seq: never stored, added by the reader from the segment's first seq
UPSERT = "upsert"
DELETE = "delete"
MAX_PROBLEMS = 100  # report this many broken rules at most; the batch is rejected either way
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

ARROW_TYPES: dict[AttributeType, pa.DataType] = {
    AttributeType.BOOL: pa.bool_(),
    AttributeType.INT64: pa.int64(),
    AttributeType.FLOAT64: pa.float64(),
    AttributeType.STRING: pa.string(),
    AttributeType.GUID: pa.string(),  # canonical lower-case hyphenated text: readable by any Parquet reader
    AttributeType.DATETIME: pa.timestamp("us", tz="UTC"),
}


def batch_schema(spec: DataSourceSpec) -> pa.Schema:
    """The schema of a validated batch: op, key, vector column(s), one typed column per attribute."""
    fields = [pa.field(OP, pa.string(), nullable=False), pa.field(KEY, pa.string(), nullable=False)]
    if spec.vectors_are_sparse:
        fields += [pa.field(SPARSE_INDICES, pa.list_(pa.int32())), pa.field(SPARSE_VALUES, pa.list_(pa.float32()))]
    else:
        fields.append(pa.field(VECTOR, pa.list_(pa.float32(), spec.vector_dimension)))
    for name, kind in spec.attribute_types.items():
        fields.append(pa.field(name, ARROW_TYPES[kind], metadata={"shoal.type": kind.value}))
    return pa.schema(fields)


def segment_schema(spec: DataSourceSpec) -> pa.Schema:
    """The schema of a log segment file: a batch's columns plus seq offset and ingestion time."""
    base = batch_schema(spec)
    return base.insert(0, pa.field(SEQ_OFFSET, pa.int64(), nullable=False)).append(
        pa.field(INGESTED_AT, pa.timestamp("us", tz="UTC"), nullable=False)
    )


NOT_UNICODE = "text must be valid Unicode: a lone surrogate (such as \\ud800) cannot be stored"
# A guid's text is read as the JSON upload route reads it (shoal.vektonn.json_fields.GUID, as Vektonn's DTOs did):
# hyphenated, 32 hex digits, braced or `urn:uuid:`. uuid.UUID would also take hyphens anywhere ("12-3456...").
_GUID = pydantic.TypeAdapter(uuid.UUID)
# The hyphenated form, the one nearly every guid arrives in: pydantic and uuid.UUID agree on it, and matching it
# first spares pydantic's parse (about 8 µs a value, against under 1 for the match).
HYPHENATED_GUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def guid_text(text: str) -> str | None:
    """The canonical (lower-case, hyphenated) text of a guid written in any form the write paths accept; None
    when the text is not a guid."""
    if HYPHENATED_GUID.fullmatch(text):
        return text.lower()
    try:
        return str(_GUID.validate_python(text))
    except pydantic.ValidationError:
        return None


class _Problems:
    def __init__(self) -> None:
        self.items: list[Problem] = []

    def add(self, rule: str, position: int | None = None, attribute: str | None = None) -> None:
        if len(self.items) < MAX_PROBLEMS:
            self.items.append(Problem(rule, position, attribute))

    def raise_if_any(self) -> None:
        if self.items:
            raise ValidationError(self.items)


def check_value(kind: AttributeType, value: Any) -> tuple[Any, str | None]:
    """Normalise one attribute value of type `kind`; return (value, None) or (None, the rule it breaks)."""
    if value is None:
        return None, "value is missing (null)"
    if kind is AttributeType.BOOL:
        return (value, None) if isinstance(value, bool | np.bool_) else (None, f"expected bool, got {_tname(value)}")
    if kind is AttributeType.INT64:
        if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
            return None, f"expected int64, got {_tname(value)}"
        if not INT64_MIN <= int(value) <= INT64_MAX:
            return None, "int64 value out of range"
        return int(value), None
    if kind is AttributeType.FLOAT64:
        if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.integer | np.floating):
            return None, f"expected float64, got {_tname(value)}"
        try:
            as_float = float(value)
        except OverflowError:  # an integer past float64's range (a JSON number of 310 digits)
            return None, "float64 value out of range"
        if not math.isfinite(as_float):
            return None, "float64 value must be finite"
        return as_float, None
    if kind is AttributeType.STRING:
        return (value, None) if isinstance(value, str) else (None, f"expected string, got {_tname(value)}")
    if kind is AttributeType.GUID:
        if isinstance(value, uuid.UUID):
            return str(value), None
        if isinstance(value, str):
            text = guid_text(value)
            return (text, None) if text is not None else (None, f"not a guid: {value[:50]!r}")
        return None, f"expected guid, got {_tname(value)}"
    if kind is AttributeType.DATETIME:
        if not isinstance(value, dt.datetime):
            return None, f"expected datetime, got {_tname(value)}"
        # Naive datetimes are taken as UTC; everything is stored in UTC.
        try:
            return (value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)), None
        except OverflowError:  # 9999-12-31T23:59:59-14:00 is in year 10000 in UTC, where it would be stored
            return None, "date and time out of range in UTC (years 1..9999)"
    raise AssertionError(kind)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def to_float32(values: Any) -> np.ndarray:
    """`values` as a float32 array, a number past float32's range made infinite without an overflow warning:
    the check that follows names it (`coordinates_problem`)."""
    with np.errstate(over="ignore"):
        return np.asarray(values, dtype=np.float32)


_NUMBER_TYPES = (bool, int, float, np.bool_, np.integer, np.floating)


def number_array(values: Any, what: str) -> tuple[np.ndarray | None, str | None]:
    """`values` as a NumPy array of bool, integer or float numbers, not converted (so nothing is cast into
    something else): (array, None); or (None, the rule `what` breaks) for anything else: complex numbers, dates,
    text, an object array holding any of these, a masked array (its mask would be ignored), a mapping, or
    sequences of unequal lengths."""
    if isinstance(values, np.ma.MaskedArray):
        return None, f"{what} must not be a masked array (its mask would be ignored): fill or drop the masked values"
    if isinstance(values, Mapping | str | bytes):
        return None, f"{what} must be numbers, got {_tname(values)}"
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError):  # sequences of unequal lengths
        return None, f"{what} must be numbers, in rows of one length"
    if arr.dtype.kind in "biuf":
        return arr, None
    if arr.dtype.kind == "O":
        bad = next((v for v in arr.reshape(-1) if not isinstance(v, _NUMBER_TYPES)), None)
        if bad is None:
            return arr, None
        return None, f"{what} must be numbers (bool, integer or float), got {_tname(bad)}"
    return None, f"{what} must be numbers (bool, integer or float), got {arr.dtype}"


def numbers_to_float32(arr: np.ndarray) -> np.ndarray:
    """A `number_array` result as float32; a number past float32's range (even past float64's: a Python int of
    400 digits) made infinite without an error: `coordinates_problem` names it."""
    try:
        return to_float32(arr)
    except OverflowError:  # an object array holding an int past float64's range
        out = np.empty(arr.shape, dtype=np.float32)
        flat = out.reshape(-1)
        with np.errstate(over="ignore"):
            for i, value in enumerate(arr.reshape(-1)):
                try:
                    flat[i] = float(value)
                except OverflowError:
                    flat[i] = math.inf if value > 0 else -math.inf
        return out


def coordinates_problem(original: Any, row: np.ndarray) -> str | None:
    """None when every coordinate of `row` (`original` cast to float32, 1-d) is finite; else what is wrong with
    the first that is not: NaN or infinity, or a finite number past float32's range, which the cast made
    infinite (a JSON or float64 client sends such numbers, and "NaN or infinity" would not be what it sent)."""
    bad = np.flatnonzero(~np.isfinite(row))
    if not bad.size:
        return None
    at = int(bad[0])
    try:
        value = float(np.asarray(original, dtype=np.float64).reshape(-1)[at])
    except OverflowError:  # an integer past float64's range (10**400): finite as given
        given = np.asarray(original, dtype=object).reshape(-1)[at]
        return (f"coordinates must be finite float32 values: an integer of {len(str(abs(int(given))))} digits at "
                f"index {at} is past float32's range (magnitude at most {_FLOAT32_MAX:.7g})")
    except (TypeError, ValueError, IndexError):
        value = math.nan
    if math.isfinite(value):
        return (f"coordinates must be finite float32 values: {value:g} at index {at} is past float32's range "
                f"(magnitude at most {_FLOAT32_MAX:.7g})")
    return f"coordinates must be finite (NaN or infinity at index {at})"


# The largest Euclidean norm a vector (stored or queried) may have: 2^62.5 (about 6.52e18; its square, 2^125, is
# the bound every check compares with). The engines compute distances in float32 (hnswlib, faiss), summing up to
# MAX_VECTOR_DIMENSION (10,000) squares or products: between vectors of at most this norm |a - b|^2 <= (2 * norm)^2
# = 2^127 (faiss's |a|^2 + |b|^2 - 2 a.b too) and |a . b| <= 2^125, and float32's rounding of a sum of at most
# 10,000 such terms grows it by a factor of at most (1 + 2^-24)^10,002 < 1.0006 (measured: 1.00005 for 10,000
# equal terms summed in order), so every distance and product stays below 2^127 * 1.0006, about half float32's
# largest value (~2^128). At the former bound, sqrt(float32 max) / 2, there was no room left: two opposite
# vectors' distance rounded to infinity, and hnswlib answered inf while faiss dropped the row. Past it distances
# overflow, rankings come out wrong (cosine normalizes such a vector to zeros) and faiss's k-means aborts.
MAX_SQ_NORM = 2.0**125  # exact in float32 and float64: every check sums the squares in float64 and compares
MAX_NORM = math.sqrt(MAX_SQ_NORM)
# float32's unit roundoff: a float32 sum of n squares is within n * 2^-24 (relative, to first order) of the exact
# sum, so a float32 sum below MAX_SQ_NORM * (1 - 2 * (n + 2) * 2^-24) proves the float64 one within the bound.
_F32_U = 2.0**-24


def sq_norm_fits_f32(sq32: Any, terms: int) -> Any:
    """True when `sq32`, a float32 sum of `terms` squares (or an array of such sums: then per element), proves
    their float64 sum at most MAX_SQ_NORM and every term finite: a cheap first check; False means only that the
    float64 sum must decide."""
    return sq32 <= MAX_SQ_NORM * (1.0 - 2.0 * (terms + 2) * _F32_U)


def _norm_texts(norm: float) -> tuple[str, str]:
    """A norm past MAX_NORM and MAX_NORM, as a refusal shows them: to 4 significant digits, or as many more as
    it takes to tell them apart (a norm a few float32 steps past the bound is not shown as equal to it)."""
    for digits in range(4, 18):
        shown, bound = f"{norm:.{digits}g}", f"{MAX_NORM:.{digits}g}"
        if shown != bound:
            break
    return shown, bound


def _sq_norms64(rows: np.ndarray) -> np.ndarray:
    """Each row's squared norm summed in float64 (rows of a 2-d array), as every norm check sums it."""
    wide = rows.astype(np.float64)
    return np.einsum("ij,ij->i", wide, wide)


def vector_problem(original: Any, row: np.ndarray) -> str | None:
    """None when the float32 vector `row` (`original` cast) has finite coordinates and a norm of at most
    MAX_NORM (its squared norm summed in float64); else what is wrong (`coordinates_problem` first)."""
    wrong = coordinates_problem(original, row)
    if wrong is not None:
        return wrong
    sq = float(_sq_norms64(np.asarray(row).reshape(1, -1))[0])
    if sq <= MAX_SQ_NORM:
        return None
    shown, bound = _norm_texts(math.sqrt(sq))
    return (f"vector norm {shown} is past the largest allowed, {bound}: distances between such vectors could "
            f"overflow float32")


def unfit_rows(flat: np.ndarray) -> np.ndarray:
    """Positions of the rows of the float32 [n, d] `flat` that `vector_problem` refuses: a float32 sum of
    squares per row, and the float64 one for the rows that sum does not clear (non-finite, past or near the
    bound), so every row gets the float64 check's answer at the cost of a float32 pass."""
    with np.errstate(over="ignore", invalid="ignore"):
        sq = np.einsum("ij,ij->i", flat, flat)
        near = np.flatnonzero(~sq_norm_fits_f32(sq, flat.shape[1]))
        if not near.size:
            return near
        return near[~(_sq_norms64(flat[near]) <= MAX_SQ_NORM)]


def _tname(value: Any) -> str:
    return type(value).__name__


TOMBSTONE_FORMS = (
    "a tombstone carries only the permanent (key) attributes, or every attribute of the data source "
    "(as Vektonn clients send it)"
)


def _tombstone_attributes(spec: DataSourceSpec, values: Any) -> Sequence[str]:
    """The attributes a tombstone may carry: every attribute of the data source when it names them all
    (Vektonn's form: its server wants every attribute on every input point, tombstones included), else its
    key alone (Shoal's form; any other attribute is then refused naming both forms). Either way only the key
    decides what is deleted."""
    if isinstance(values, Mapping) and all(name in values for name in spec.attribute_types):
        return list(spec.attribute_types)
    return list(spec.permanent_attributes)


def _batch_items(items: Any, max_points: int) -> Sequence[DataPoint | Tombstone]:
    """The batch as a sequence: a list or tuple as given, any other iterable (a generator) read into a list, at
    most one point past `max_points` (enough to refuse it). Anything else is refused naming the batch."""
    if isinstance(items, list | tuple):
        return items
    if isinstance(items, Mapping | str | bytes) or not isinstance(items, Iterable):
        raise ValidationError(Problem(f"the batch must be a list of DataPoints and Tombstones, got {_tname(items)}",
                                      attribute="items"))
    taken = list(itertools.islice(items, max_points + 1))
    if len(taken) > max_points:
        raise BatchTooLargeError(Problem(f"batch holds more points than the configured maximum {max_points}"))
    return taken


def _check_points(spec: DataSourceSpec, items: Sequence[DataPoint | Tombstone], max_points: int) -> None:
    if len(items) == 0:
        raise ValidationError("batch is empty")
    if len(items) > max_points:
        raise BatchTooLargeError(
            Problem(f"batch holds {len(items)} points, more than the configured maximum {max_points}")
        )


def points_to_table(
    spec: DataSourceSpec, items: Sequence[DataPoint | Tombstone], max_points: int
) -> pa.Table:
    """Validate a batch of DataPoints and Tombstones, in order, and return it as one Arrow table."""
    items = _batch_items(items, max_points)
    _check_points(spec, items, max_points)
    problems = _Problems()
    attrs = spec.attribute_types
    permanent = set(spec.permanent_attributes)
    n, dim = len(items), spec.vector_dimension
    columns: dict[str, list[Any]] = {name: [None] * n for name in attrs}
    ops: list[str] = [UPSERT] * n
    dense = None if spec.vectors_are_sparse else np.zeros((n, dim), dtype=np.float32)
    present = np.ones(n, dtype=bool)
    sparse_idx: list[Any] = [None] * n
    sparse_val: list[Any] = [None] * n

    # A coordinate past float32's range becomes inf in the casts, which _check_dense and _check_sparse refuse by
    # name: no warning. (One errstate around the loop, not one per point.)
    with np.errstate(over="ignore"):
        for pos, item in enumerate(items):
            if isinstance(item, DataPoint):
                values, expected = item.attributes, attrs.keys()
            elif isinstance(item, Tombstone):
                values = item.key
                expected = _tombstone_attributes(spec, values)
                ops[pos] = DELETE
                present[pos] = False
            else:
                problems.add(f"expected a DataPoint or a Tombstone, got {_tname(item)}", pos)
                continue
            if not isinstance(values, Mapping):
                problems.add(f"attributes must be a mapping, got {_tname(values)}", pos)
                continue
            for name in expected:
                if name not in values:
                    problems.add("missing attribute" if ops[pos] == UPSERT else "missing key attribute", pos, name)
            for name, raw in values.items():
                if name not in expected:
                    rule = "unknown attribute (not in the data source)" if name not in attrs else TOMBSTONE_FORMS
                    problems.add(rule, pos, str(name))
                    continue
                value, err = check_value(attrs[name], raw)
                if err:
                    problems.add(err, pos, name)
                elif ops[pos] == UPSERT or name in permanent:
                    # A tombstone's other attributes are checked, never stored: its key alone says what goes.
                    columns[name][pos] = value
            if isinstance(item, DataPoint):
                if spec.vectors_are_sparse:
                    got = _check_sparse(item.vector, dim, pos, problems)
                    if got is not None:
                        sparse_idx[pos], sparse_val[pos] = got
                else:
                    row = _check_dense(item.vector, dim, pos, problems)
                    if row is not None and dense is not None:
                        dense[pos] = row
    problems.raise_if_any()

    arrays: dict[str, pa.Array] = {OP: pa.array(ops, pa.string())}
    if dense is not None:
        arrays[VECTOR] = pa.FixedSizeListArray.from_arrays(
            pa.array(dense.reshape(-1)), dim, mask=pa.array(~present)
        )
    else:
        arrays[SPARSE_INDICES] = pa.array(sparse_idx, pa.list_(pa.int32()))
        arrays[SPARSE_VALUES] = pa.array(sparse_val, pa.list_(pa.float32()))
    for name, kind in attrs.items():
        arrays[name] = _arrow_array(name, columns[name], ARROW_TYPES[kind], problems)
    problems.raise_if_any()
    return _finish(spec, arrays)


def _arrow_array(name: str, values: list[Any], target: pa.DataType, problems: _Problems) -> pa.Array:
    """Checked values as an Arrow column; a string UTF-8 cannot encode is a problem at its position (found only
    when Arrow refuses the column, so valid text costs no check of its own)."""
    try:
        return pa.array(values, target)
    except UnicodeEncodeError:
        for pos, value in enumerate(values):
            if not unicode_text(value):
                problems.add(NOT_UNICODE, pos, name)
        return pa.nulls(len(values), target)


def _check_dense(vector: Any, dim: int, pos: int, problems: _Problems) -> np.ndarray | None:
    if isinstance(vector, SparseVector):
        problems.add("the data source holds dense vectors, got a sparse one", pos, "vector")
        return None
    given, wrong = number_array(vector, "vector coordinates")
    if given is None:
        problems.add(str(wrong), pos, "vector")
        return None
    row = numbers_to_float32(given)  # past float32's range: inf, refused below by name
    if row.shape != (dim,):
        got = row.shape[0] if row.ndim == 1 else row.shape
        problems.add(f"wrong dimension: expected {dim}, got {got}", pos, "vector")
        return None
    wrong = vector_problem(given, row)
    if wrong is not None:
        problems.add(wrong, pos, "vector")
        return None
    return row


def _check_sparse(vector: Any, dim: int, pos: int, problems: _Problems) -> tuple[list[int], list[float]] | None:
    if not isinstance(vector, SparseVector):
        problems.add("the data source holds sparse vectors: give a SparseVector", pos, "vector")
        return None
    given_idx, wrong = number_array(vector.indices, "sparse indices")
    given_val, wrong_val = number_array(vector.values, "sparse values")
    if given_idx is None or given_val is None:
        problems.add(str(wrong or wrong_val), pos, "vector")
        return None
    # Indices are integers only: a float (even 3.0, as a JSON body must not send either) is refused, never
    # truncated into another dimension than the one given.
    if given_idx.size and given_idx.dtype.kind not in "iuO" or (
        given_idx.dtype.kind == "O" and not all(_is_integer(v) for v in given_idx.reshape(-1))
    ):
        problems.add("sparse indices must be integers", pos, "vector")
        return None
    try:
        idx = given_idx.astype(np.int64) if given_idx.dtype.kind != "u" else given_idx
    except OverflowError:  # an index beyond 64 bits (2**70): out of range whatever the dimension
        problems.add(f"sparse index out of range 0..{dim - 1}", pos, "vector")
        return None
    val = numbers_to_float32(given_val)  # past float32's range: inf, refused below by name
    if idx.ndim != 1 or idx.shape != val.shape:
        problems.add("sparse vector needs as many values as indices", pos, "vector")
        return None
    if idx.size and (idx.min() < 0 or idx.max() >= dim):
        problems.add(f"sparse index out of range 0..{dim - 1}", pos, "vector")
        return None
    if np.unique(idx).size != idx.size:
        problems.add("sparse vector repeats an index", pos, "vector")
        return None
    wrong = vector_problem(given_val, val) if val.ndim == 1 else None
    if wrong is not None:
        problems.add(wrong, pos, "vector")
        return None
    return idx.astype(np.int32).tolist(), val.tolist()


def _is_integer(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def columns_to_table(
    spec: DataSourceSpec,
    vectors: np.ndarray | None,
    attributes: Mapping[str, Sequence[Any] | np.ndarray | pa.Array],
    max_points: int,
    *,
    delete: bool = False,
) -> pa.Table:
    """Validate a columnar batch (upserts: vectors [n, dim] plus one column per attribute; or, with
    `delete`, tombstones: one column per permanent attribute) and return it as one Arrow table.

    The fast path for large batches: vectors are checked as one NumPy array, not point by point.
    """
    problems = _Problems()
    if not isinstance(attributes, Mapping):
        raise ValidationError(Problem(f"columns must be a mapping {{attribute name: column}}, got {_tname(attributes)}",
                                      attribute="keys" if delete else "attributes"))
    expected = _tombstone_attributes(spec, attributes) if delete else list(spec.attribute_types)
    permanent = set(spec.permanent_attributes)
    for name in expected:
        if name not in attributes:
            problems.add("missing attribute column" if not delete else "missing key attribute column", None, name)
    for name in attributes:
        if name not in expected:
            rule = "unknown attribute (not in the data source)" if name not in spec.attribute_types else (
                TOMBSTONE_FORMS
            )
            problems.add(rule, None, str(name))
    for name in (name for name in expected if name in attributes):
        wrong = column_shape_problem(attributes[name])
        if wrong is not None:
            problems.add(wrong, None, name)
    problems.raise_if_any()
    lengths = {name: len(attributes[name]) for name in expected}
    n = next(iter(lengths.values()))
    if not delete:
        if spec.vectors_are_sparse:
            raise ValidationError("the data source holds sparse vectors: upload them as DataPoints with SparseVector")
        if vectors is None:
            raise ValidationError(Problem("vectors are required for upserts", attribute="vector"))
        given, wrong = number_array(vectors, "vectors")
        if given is None:
            raise ValidationError(Problem(str(wrong), attribute="vector"))
        vectors = given
        if vectors.ndim != 2 or vectors.shape[1] != spec.vector_dimension:
            raise ValidationError(
                Problem(f"wrong dimension: expected [n, {spec.vector_dimension}], got {list(vectors.shape)}",
                        attribute="vector")
            )
        n = vectors.shape[0]
    for name, count in lengths.items():
        if count != n:
            problems.add(f"column has {count} values, expected {n}", None, name)
    problems.raise_if_any()
    if n == 0:
        raise ValidationError("batch is empty")
    if n > max_points:
        raise BatchTooLargeError(Problem(f"batch holds {n} points, more than the configured maximum {max_points}"))

    arrays: dict[str, pa.Array] = {OP: pa.array(np.full(n, DELETE if delete else UPSERT, dtype=object), pa.string())}
    if delete:
        if spec.vectors_are_sparse:
            arrays[SPARSE_INDICES] = pa.nulls(n, pa.list_(pa.int32()))
            arrays[SPARSE_VALUES] = pa.nulls(n, pa.list_(pa.float32()))
        else:
            arrays[VECTOR] = pa.nulls(n, pa.list_(pa.float32(), spec.vector_dimension))
    else:
        assert vectors is not None
        flat = np.ascontiguousarray(numbers_to_float32(vectors))
        for pos in unfit_rows(flat)[:MAX_PROBLEMS]:
            problems.add(str(vector_problem(vectors[pos], flat[pos])), int(pos), "vector")
        arrays[VECTOR] = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), spec.vector_dimension)
    for name, kind in spec.attribute_types.items():
        if name in expected and (not delete or name in permanent):
            arrays[name] = _column(name, kind, attributes[name], problems)
        else:
            if name in expected:  # a tombstone's other attribute: checked for its type, never stored
                _check_ignored(name, kind, attributes[name], problems)
            arrays[name] = pa.nulls(n, ARROW_TYPES[kind])
    problems.raise_if_any()
    return _finish(spec, arrays)


def column_shape_problem(values: Any) -> str | None:
    """What keeps `values` from being read as one column of values (None when nothing): it must be a list, a 1-d
    NumPy array (not masked: its mask would be ignored) or an Arrow array. A mapping (its keys would be read),
    a string (its characters), None or a scalar is refused."""
    if isinstance(values, pa.Array | pa.ChunkedArray):
        return None
    if isinstance(values, np.ma.MaskedArray):
        return "column must not be a masked array (its mask would be ignored): fill or drop the masked values"
    if isinstance(values, np.ndarray):
        return None if values.ndim == 1 else f"column must be 1-dimensional, got shape {list(values.shape)}"
    if isinstance(values, Mapping | str | bytes | AbstractSet) or not (
        isinstance(values, Sized) and isinstance(values, Iterable)
    ):
        return f"column must be a list, a 1-d NumPy array or an Arrow array of values, got {_tname(values)}"
    return None


def _int64_range(name: str, values: np.ndarray, problems: _Problems) -> bool:
    """True when the unsigned NumPy column `values` fits int64 (a signed one always does); else every value past
    INT64_MAX is noted, and False."""
    if values.dtype.kind != "u" or not values.size or values.max() <= INT64_MAX:
        return True
    for pos in np.flatnonzero(values > INT64_MAX)[:MAX_PROBLEMS]:
        problems.add("int64 value out of range", int(pos), name)
    return False


def _check_ignored(name: str, kind: AttributeType, values: Any, problems: _Problems) -> None:
    """Note every value of a tombstone's non-key column that is not of the attribute's type. Nulls pass: in a
    columnar batch a tombstone row may leave its other attributes empty, its key alone deciding."""
    if isinstance(values, pa.ChunkedArray | pa.Array):
        arr = _plain_arrow(name, kind, values, problems)
        if arr is None or not _valid_arrow(name, arr, problems):
            return
        if kind is AttributeType.DATETIME and pa.types.is_timestamp(arr.type):
            # Notes instants out of range; nulls stay nulls. Never stored, so a nanosecond part loses nothing.
            _utc_micros(name, arr, problems, exact=False)
            return
        if arr.type == ARROW_TYPES[kind] and kind not in (AttributeType.GUID, AttributeType.FLOAT64):
            return  # typed as the attribute: every value present is of its type
        values = arr.to_pylist()
    elif isinstance(values, np.ndarray) and kind in _FAST_NUMPY_KINDS and values.dtype.kind in _FAST_NUMPY_KINDS[kind]:
        if kind is AttributeType.INT64:
            _int64_range(name, values, problems)
        if kind is not AttributeType.FLOAT64:
            return
        for pos in np.flatnonzero(~np.isfinite(values.astype(np.float64)))[:MAX_PROBLEMS]:
            problems.add("float64 value must be finite", int(pos), name)
        return
    for pos, raw in enumerate(values):
        if raw is not None:
            _, err = check_value(kind, raw)
            if err:
                problems.add(err, pos, name)


_FAST_NUMPY_KINDS = {AttributeType.BOOL: "b", AttributeType.INT64: "iu", AttributeType.FLOAT64: "fiu"}
NOT_UTF8 = "text must be valid UTF-8"


def _valid_arrow(name: str, arr: pa.Array, problems: _Problems) -> bool:
    """True when an Arrow column holds what its type says, before any of its values is read or stored: text
    that is valid UTF-8 (Arrow takes a string column from an IPC stream as it comes, and every later reader of
    the log or of search hits would fail on it), offsets and dictionary indices in range. Else the column's
    bad rows (or, past text, the column) are noted and False. Valid UTF-8 costs one pass of Arrow's validator."""
    try:
        arr.validate(full=True)
        return True
    except pa.ArrowInvalid as exc:
        bad = _bad_utf8_rows(arr)
        if bad:
            for pos in bad[:MAX_PROBLEMS]:
                problems.add(NOT_UTF8, pos, name)
        else:
            problems.add(f"not a valid Arrow column: {exc}", None, name)
        return False


def _bad_utf8_rows(arr: pa.Array) -> list[int]:
    """The rows of a string column whose bytes are not UTF-8 (only on the way to an error: Python decodes each
    value); empty for any other column, or for one whose fault is not its text."""
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        return []
    raw = arr.view(pa.binary() if pa.types.is_string(arr.type) else pa.large_binary())
    try:
        raw.validate(full=True)  # offsets in range: its bytes can be read
    except pa.ArrowInvalid:
        return []
    bad = []
    for pos, value in enumerate(raw.to_pylist()):
        if value is not None:
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                bad.append(pos)
    return bad


def dictionary_structure(arr: pa.DictionaryArray) -> pa.DictionaryArray:
    """`arr` with a text dictionary viewed as binary: its `validate(full=True)` checks the indices (in range) and
    the dictionary's offsets, not whether the text is UTF-8, which the decoded column's check reports by row."""
    dictionary = arr.dictionary
    if pa.types.is_string(dictionary.type):
        dictionary = dictionary.view(pa.binary())
    elif pa.types.is_large_string(dictionary.type):
        dictionary = dictionary.view(pa.large_binary())
    else:
        return arr
    return pa.DictionaryArray.from_arrays(arr.indices, dictionary, safe=False)


def _plain_arrow(name: str, kind: AttributeType, values: pa.Array | pa.ChunkedArray,
                 problems: _Problems) -> pa.Array | None:
    """An Arrow column in one chunk, a dictionary-encoded one decoded, so that the checks below (and their
    errors) are those of a plain column. None, noted, when its indices are out of range or its dictionary holds
    no scalar values (nested ones: no attribute type, and decoding could repeat a large value on every row)."""
    arr = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    if not pa.types.is_dictionary(arr.type):
        return arr
    value_type = arr.type.value_type
    if pa.types.is_nested(value_type) or pa.types.is_dictionary(value_type):
        problems.add(f"expected {kind.value} values, got a column of {arr.type}", None, name)
        return None
    try:
        dictionary_structure(arr).validate(full=True)
    except pa.ArrowInvalid as exc:
        problems.add(f"not a valid Arrow column: {exc}", None, name)
        return None
    return arr.dictionary_decode()


def _column(name: str, kind: AttributeType, values: Any, problems: _Problems) -> pa.Array:
    target = ARROW_TYPES[kind]
    if isinstance(values, pa.ChunkedArray | pa.Array):
        decoded = _plain_arrow(name, kind, values, problems)
        if decoded is None or not _valid_arrow(name, decoded, problems):
            return pa.nulls(len(values), target)
        values = decoded
    # Fast paths: typed NumPy or Arrow columns need no per-value checks beyond nulls and NaN.
    if isinstance(values, np.ndarray) and kind in _FAST_NUMPY_KINDS and values.dtype.kind in _FAST_NUMPY_KINDS[kind]:
        if kind is AttributeType.INT64 and not _int64_range(name, values, problems):
            return pa.nulls(len(values), target)
        arr = pa.array(values.astype(np.float64 if kind is AttributeType.FLOAT64 else values.dtype), target)
    elif kind is AttributeType.DATETIME and isinstance(values, pa.ChunkedArray | pa.Array) and (
        pa.types.is_timestamp(values.type)
    ):
        arr = _utc_micros(name, values, problems)
    elif isinstance(values, pa.Array) and values.type == target and kind is not AttributeType.GUID:
        arr = values
    else:
        out: list[Any] = []
        for pos, raw in enumerate(values.to_pylist() if isinstance(values, pa.Array) else values):
            value, err = check_value(kind, raw)
            if err:
                problems.add(err, pos, name)
            out.append(value)
        return _arrow_array(name, out, target, problems) if not problems.items else pa.nulls(len(out), target)
    if arr.null_count:
        for pos in np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[:MAX_PROBLEMS]:
            problems.add("value is missing (null)", int(pos), name)
    if kind is AttributeType.FLOAT64:
        nan = pc.invert(pc.is_finite(arr)).to_numpy(zero_copy_only=False)
        for pos in np.flatnonzero(nan)[:MAX_PROBLEMS]:
            problems.add("float64 value must be finite", int(pos), name)
    return arr


# The instants a datetime attribute may hold, in microseconds since the epoch: years 1..9999 in UTC, as Python
# (and so every reader of the log) can represent them.
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MICROSECOND = dt.timedelta(microseconds=1)
_MIN_US = (dt.datetime.min.replace(tzinfo=dt.UTC) - _EPOCH) // _MICROSECOND
_MAX_US = (dt.datetime.max.replace(tzinfo=dt.UTC) - _EPOCH) // _MICROSECOND
_PER_UNIT_US = {"s": 1_000_000, "ms": 1_000, "us": 1}


SUB_MICROSECOND = "has sub-microsecond precision; datetimes are stored in microseconds"
# A fraction of a second (or, in an ISO 8601 offset, of its seconds) with a non-zero digit past the sixth.
_FRACTION_BELOW_MICROSECOND = re.compile(r"[.,][0-9]{6}[0-9]*[1-9]")
# A Unix time written as a string, which pydantic reads (in seconds, or in milliseconds past 2e10).
_UNIX_TIME_TEXT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)")
_UNIX_MILLISECONDS_FROM = 20_000_000_000


def sub_microsecond_text(text: str) -> bool:
    """Whether the date and time `text` spells (ISO 8601, or a Unix time as pydantic reads a number string) has
    non-zero digits below the microsecond. Python's and pydantic's parsers drop (or round) those digits, so a
    text they read is checked here first: such an instant is refused, never floored into another (two keys
    100 ns apart, as .NET writes DateTime, would become one point). Trailing zeros are whole microseconds."""
    if _FRACTION_BELOW_MICROSECOND.search(text):
        return True
    if not _UNIX_TIME_TEXT.fullmatch(text):
        return False
    # Seconds carry six digits to the microsecond, milliseconds three (Decimal compares exactly, however long).
    places = 3 if abs(decimal.Decimal(text)) > _UNIX_MILLISECONDS_FROM else 6
    return text.partition(".")[2][places:].strip("0") != ""


_SEVEN_DIGIT_FRACTION = re.compile(r"\.[0-9]{7}")  # starts with a literal: re scans for it in C
_YEAR_END = operator.itemgetter(slice(4, 5))  # "-" in ISO 8601 text as pydantic takes it ("2024-..."), not in a number


def any_sub_microsecond_text(texts: list[str]) -> bool:
    """Whether sub_microsecond_text holds for any of `texts`, for a column that pydantic read: a few scans in C
    over the column, and a test per value only when one may break the rule (a fraction of seven digits or more, a
    comma fraction, or a value that is no ISO 8601 text, such as a Unix time)."""
    joined = "\n".join(texts)
    if _SEVEN_DIGIT_FRACTION.search(joined) or "," in joined or {*map(_YEAR_END, texts)} - {"-"}:
        return any(map(sub_microsecond_text, texts))
    return False


def _utc_micros(name: str, values: pa.Array | pa.ChunkedArray, problems: _Problems, *, exact: bool = True) -> pa.Array:
    """An Arrow timestamp column (any unit; naive taken as UTC, as naive datetimes are) as UTC microseconds,
    noting every instant outside years 1..9999 in UTC: a reader of the log could not turn it into a datetime.
    With `exact` (values that are stored), every nanosecond value that is not a whole microsecond is noted too:
    it is refused rather than floored, which would store another instant (and merge two keys that differ below a
    microsecond into one point). Column-wise: no Python object per value."""
    arr = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    # The stored integers are instants since the epoch in the column's unit; a timezone only labels them.
    ticks = arr.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)  # a null is 0: a whole microsecond
    unit = arr.type.unit
    if unit == "ns":
        if exact:
            for pos in np.flatnonzero(ticks % 1_000)[:MAX_PROBLEMS]:
                problems.add(SUB_MICROSECOND, int(pos), name)
        micros = ticks // 1_000  # nanoseconds span years 1677..2262 only: always in range
    else:
        per = _PER_UNIT_US[unit]
        out = (ticks < -(-_MIN_US // per)) | (ticks > _MAX_US // per)
        for pos in np.flatnonzero(out)[:MAX_PROBLEMS]:
            problems.add("date and time out of range in UTC (years 1..9999)", int(pos), name)
        micros = np.where(out, 0, ticks) * per
    nulls = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else None
    return pa.array(micros.astype(np.int64), pa.int64(), mask=nulls).cast(ARROW_TYPES[AttributeType.DATETIME])


def _finish(spec: DataSourceSpec, arrays: dict[str, pa.Array]) -> pa.Table:
    arrays[KEY] = encode_keys([arrays[name] for name in spec.permanent_attributes])
    schema = batch_schema(spec)
    return pa.Table.from_arrays([arrays[f.name] for f in schema], schema=schema)


def encode_keys(columns: list[pa.Array]) -> pa.Array:
    """The key of each row: its permanent attribute values as one unambiguous string.

    Each value is written `length:text` and values are joined by `|`, so no two different keys can
    produce the same string whatever characters the values hold. A float key of -0.0 is the key 0.0 (they are
    equal numbers; the text cast would write "-0" and "0").
    """
    parts = []
    for col in columns:
        if pa.types.is_floating(col.type):
            # -0.0 == 0.0 is true, so this puts +0.0 in place of both zeros and leaves every other value.
            col = pc.if_else(pc.equal(col, 0.0), pa.scalar(0.0, col.type), col)
        text = col if pa.types.is_string(col.type) else pc.cast(col, pa.string())
        parts.append(pc.binary_join_element_wise(pc.cast(pc.utf8_length(text), pa.string()), text, ":"))
    if len(parts) == 1:
        return parts[0]
    return pc.binary_join_element_wise(*parts, "|")


def key_strings(spec: DataSourceSpec, keys: Sequence[Mapping[str, Any]]) -> list[str]:
    """Encode keys given as {permanent attribute: value} mappings, as the log encodes them."""
    cols = []
    for name in spec.permanent_attributes:
        kind = spec.attribute_types[name]
        vals = []
        for k in keys:
            value, err = check_value(kind, k.get(name))
            if err:
                raise ValidationError(Problem(err, attribute=name))
            vals.append(value)
        cols.append(pa.array(vals, ARROW_TYPES[kind]))
    return encode_keys(cols).to_pylist()
