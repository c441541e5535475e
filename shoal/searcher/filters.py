"""Attribute filters for kNN search: a small JSON language, checked against a data source's attribute types and
evaluated column-wise over a segment's rows or a log tail's upserts.

Shape (one JSON object; its entries are ANDed):

    {"section": "utils"}                                 equality
    {"section": {"$in": ["utils", "net"]}}               membership ($nin: not in)
    {"installed_size_kb": {"$gte": 100, "$lt": 500}}     ranges: $gt $gte $lt $lte (numbers, datetimes, strings)
    {"section": {"$ne": "doc"}}                          inequality ($eq spells equality out)
    {"$and": [f, ...]}  {"$or": [f, ...]}  {"$not": f}   combinations

Datetime operands are ISO 8601 strings (naive ones are UTC, as stored), to the microsecond: one with non-zero
digits below it is refused (Python's parser would floor it, and `$lt` the next microsecond would miss the stored
one). A row whose attribute is null matches no comparison (and so matches its `$not`). Anything else (an
attribute the data source lacks, a value of the wrong type, an unknown operator) raises ValidationError naming
the attribute.

The dataset API keeps each vector's metadata as JSON text in the attribute `metadata`: a filter built with
`json_attribute="metadata"` also takes metadata fields, as `metadata.<field>` or a bare name that is no
attribute. Those are schemaless, so a value of another type simply does not match.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shoal.errors import Problem, ValidationError
from shoal.log.records import AttributeType, unicode_text
from shoal.log.validation import ARROW_TYPES, NOT_UNICODE, check_value, sub_microsecond_text
from shoal.searcher.json_fields import comparable, field_values, json_scalar, row_test, sub_microsecond_datetime
from shoal.searcher.ranks import Ranked
from shoal.searcher.repeat_cache import RepeatCache

__all__ = ["Filter", "parse_filter"]

_COMPARE = {"$eq": pc.equal, "$ne": pc.not_equal, "$gt": pc.greater, "$gte": pc.greater_equal,
            "$lt": pc.less, "$lte": pc.less_equal}
_NP_COMPARE = {"$eq": np.equal, "$ne": np.not_equal, "$gt": np.greater, "$gte": np.greater_equal,
               "$lt": np.less, "$lte": np.less_equal}
_RANGE = frozenset({"$gt", "$gte", "$lt", "$lte"})
_ORDERED = frozenset({AttributeType.INT64, AttributeType.FLOAT64, AttributeType.DATETIME, AttributeType.STRING})
_OPERATORS = ", ".join([*_COMPARE, "$in", "$nin"])
MAX_FILTER_NODES = 1000  # a filter is a query, not a program: bounds parsing and evaluation work per search
# Nesting of $and/$or/$not: parsing and evaluating recurse a few frames per level, and Python's stack ends near
# 250 levels (a RecursionError, a 500 over HTTP, within MAX_FILTER_NODES).
MAX_FILTER_DEPTH = 32
# Distinct metadata fields one filter may name: each is read from every row's JSON text in a pass of its own (a
# filter naming 999 took 7.5 s a search over 5,700 vectors, within MAX_FILTER_NODES).
MAX_FILTER_FIELDS = 32
# Values of all the $in / $nin lists of one filter: each is checked and converted in Python before any row is
# read (200,000 took 0.4 s of parsing alone), and the body limit would let millions through.
MAX_FILTER_VALUES = 10_000

Mask = Callable[[pa.Table, dict[Any, Any]], np.ndarray]


def _bad(rule: str, attribute: str | None) -> ValidationError:
    return ValidationError(Problem(rule, attribute="filter" if attribute is None else attribute))


def _sub_microsecond(raw: str, name: str) -> ValidationError:
    return _bad(f"filter value {raw[:50]!r} has sub-microsecond precision; datetimes are kept to the microsecond", name)


def _datetime(raw: Any, name: str) -> dt.datetime:
    if isinstance(raw, dt.datetime):
        value = raw
    elif isinstance(raw, str):
        try:
            value = dt.datetime.fromisoformat(raw.replace("Z", "+00:00") if raw.endswith("Z") else raw)
        except ValueError:
            raise _bad(f"filter value is not an ISO 8601 datetime: {raw[:50]!r}", name) from None
        if sub_microsecond_text(raw):  # fromisoformat dropped digits past the sixth: it would compare another instant
            raise _sub_microsecond(raw, name)
    else:
        raise _bad(f"filter value must be a datetime (ISO 8601 string), got {type(raw).__name__}", name)
    checked, err = check_value(AttributeType.DATETIME, value)
    if err:
        raise _bad(err, name)
    return checked  # type: ignore[no-any-return]


def _operand(kind: AttributeType, raw: Any, name: str) -> Any:
    """A filter operand checked and converted for an attribute of type `kind`."""
    if kind is AttributeType.DATETIME:
        return _datetime(raw, name)
    value, err = check_value(kind, raw)
    if err is None and not unicode_text(value):
        err = NOT_UNICODE  # no stored string holds one; Arrow cannot take it as an operand
    if err:
        raise _bad(f"filter value: {err}", name)
    return value


@dataclass(frozen=True)
class Filter:
    """A checked filter: `mask(table)` is a bool per row of a table holding the attributes it names.

    `key` is a digest of the filter's canonical JSON (equal filters, equal keys), used to cache masks per
    segment: a fixed 32 characters, however long the filter (caches keyed by the text itself held every large
    filter a client sent, past their byte budgets)."""

    key: str
    attributes: frozenset[str]
    _mask: Mask

    def mask(self, table: pa.Table, cache: dict[Any, Any] | None = None) -> np.ndarray:
        """True for each row of `table` that matches. `cache`: per-table conversions (parsed JSON) to reuse."""
        return self._mask(table, {} if cache is None else cache)


def parse_filter(
    raw: Any, attribute_types: Mapping[str, AttributeType], *, json_attribute: str | None = None,
    key: str | None = None,
) -> Filter | None:
    """The filter `raw` (the JSON shape above) checked against the attribute types; None for no filter
    (None or {}). Errors raise ValidationError naming the attribute. `key`: the filter's canonical text when
    the caller made one already (equal filters, equal texts); else it is made here."""
    if raw is None or (isinstance(raw, dict) and not raw):
        return None
    parser = _Parser(attribute_types, json_attribute)
    mask = parser.node(raw)
    if key is None:
        try:
            text = json.dumps(raw, sort_keys=True, default=str, separators=(",", ":"))
        except (TypeError, ValueError):
            text = repr(raw)
        key = filter_key(text.encode("utf-8", "surrogateescape"))
    return Filter(key, frozenset(parser.used), mask)


def filter_key(text: bytes) -> str:
    """The cache key of a filter whose canonical text is `text`: a 128-bit digest (collisions are out of reach)."""
    return hashlib.blake2b(text, digest_size=16).hexdigest()


class _Parser:
    def __init__(self, types: Mapping[str, AttributeType], json_attribute: str | None) -> None:
        self.types = types
        self.json_attribute = json_attribute
        self.used: set[str] = set()
        self.fields: set[str] = set()  # the metadata fields named
        self.nodes = 0
        self.values = 0  # of $in / $nin lists

    def node(self, raw: Any, depth: int = 0) -> Mask:
        # Every entry counts: one object may name many attributes or fields, each a condition to evaluate.
        self.nodes += len(raw) if isinstance(raw, dict) and raw else 1
        if self.nodes > MAX_FILTER_NODES:
            raise _bad(f"a filter may have at most {MAX_FILTER_NODES} conditions", None)
        if depth > MAX_FILTER_DEPTH:
            raise _bad(f"a filter may nest $and, $or and $not at most {MAX_FILTER_DEPTH} levels deep", None)
        if not isinstance(raw, dict) or not raw:
            raise _bad("a filter is a non-empty JSON object: {attribute: value or {operator: value}, "
                       "$and/$or: [filters], $not: filter}", None)
        parts = [self.entry(str(name), value, depth) for name, value in raw.items()]
        return parts[0] if len(parts) == 1 else _all(parts)

    def entry(self, name: str, value: Any, depth: int) -> Mask:
        if name in ("$and", "$or"):
            if not isinstance(value, list) or not value:
                raise _bad(f"{name} takes a non-empty list of filters", name)
            parts = [self.node(v, depth + 1) for v in value]
            return _all(parts) if name == "$and" else _any(parts)
        if name == "$not":
            inner = self.node(value, depth + 1)
            return lambda t, c: ~inner(t, c)
        if name.startswith("$"):
            raise _bad(f"unknown filter operator {name!r} (combinations: $and, $or, $not)", name)
        kind = self.types.get(name)
        if self.json_attribute is not None and name == self.json_attribute:
            raise _bad(f"filter on the fields of {name}: {name}.<field> (or the bare field name)", name)
        if kind is None:
            if self.json_attribute is None:
                raise _bad("unknown attribute: the data source has no such attribute", name)
            field = name.removeprefix(f"{self.json_attribute}.")
            if not field or any(not part for part in field.split(".")):
                raise _bad("not a metadata field name", name)
            if not unicode_text(field):  # as a value's text is checked: no stored field can have such a name
                raise _bad(f"field name: {NOT_UNICODE}", name)
            self.fields.add(field)
            if len(self.fields) > MAX_FILTER_FIELDS:
                raise _bad(f"a filter may name at most {MAX_FILTER_FIELDS} distinct metadata fields", None)
            self.used.add(self.json_attribute)
            return self.json_condition(name, field, value)
        self.used.add(name)
        return self.condition(name, kind, value)

    def _ops(self, name: str, value: Any) -> list[tuple[str, Any]]:
        if isinstance(value, dict) and value and all(isinstance(k, str) and k.startswith("$") for k in value):
            for op, operand in value.items():
                if op not in _COMPARE and op not in ("$in", "$nin"):
                    raise _bad(f"unknown filter operator {op!r} (known: {_OPERATORS})", name)
                if op in ("$in", "$nin") and isinstance(operand, list):
                    self.values += len(operand)
                    if self.values > MAX_FILTER_VALUES:
                        raise _bad(f"the $in and $nin lists of a filter may hold at most {MAX_FILTER_VALUES:,} "
                                   "values together", name)
            return list(value.items())
        if isinstance(value, dict | list):
            raise _bad("compare an attribute with a value, or give {operator: value} ($in takes a list)", name)
        return [("$eq", value)]

    def condition(self, name: str, kind: AttributeType, value: Any) -> Mask:
        arrow_type = ARROW_TYPES[kind]
        parts: list[Mask] = []
        for op, operand in self._ops(name, value):
            if kind is AttributeType.FLOAT64:
                op, operand = _exact_on_floats(op, operand)
            if op in ("$in", "$nin"):
                if not isinstance(operand, list):
                    raise _bad(f"{op} takes a list of values", name)
                values = pa.array([_operand(kind, v, name) for v in operand], arrow_type)
                parts.append(_is_in(name, values, op == "$nin"))
                continue
            if op in _RANGE and kind not in _ORDERED:
                raise _bad(f"{op} needs a number, datetime or string attribute, not {kind.value}", name)
            parts.append(_compare(name, op, pa.scalar(_operand(kind, operand, name), arrow_type)))
        return parts[0] if len(parts) == 1 else _all(parts)

    def json_condition(self, name: str, field: str, value: Any) -> Mask:
        column = self.json_attribute
        assert column is not None
        conditions: list[tuple[str, Any]] = []
        for op, operand in self._ops(name, value):
            if op in ("$in", "$nin"):
                if not isinstance(operand, list) or not all(json_scalar(v) for v in operand):
                    raise _bad(f"{op} takes a list of JSON scalars", name)
                if not all(map(unicode_text, operand)):
                    raise _bad(f"filter value: {NOT_UNICODE}", name)
                for v in operand:
                    if sub_microsecond_datetime(v):
                        raise _sub_microsecond(v, name)
                conditions.append((op, [comparable(v) for v in operand]))
                continue
            if not json_scalar(operand):
                raise _bad(f"{op} takes a JSON scalar", name)
            if not unicode_text(operand):
                raise _bad(f"filter value: {NOT_UNICODE}", name)
            if sub_microsecond_datetime(operand):
                raise _sub_microsecond(operand, name)
            target = comparable(operand)
            # A bool is no number here (json_fields compares kinds apart), and no range reads it.
            if op in _RANGE and (isinstance(target, bool) or not isinstance(target, int | float | dt.datetime | str)):
                raise _bad(f"{op} needs a number, a datetime or a string", name)
            conditions.append((op, target))

        def mask(table: pa.Table, cache: dict[Any, Any]) -> np.ndarray:
            values = field_values(table, column, field, cache)
            out: np.ndarray | None = None
            for op, target in conditions:
                hit = values.match(op, target)
                if hit is None:  # numbers numpy cannot compare exactly: each row as the language reads it
                    test = row_test(op, target)
                    hit = np.fromiter(map(test, values.raw), dtype=bool, count=len(values.raw))
                out = hit if out is None else out & hit
            assert out is not None  # _ops gives at least one condition
            return out

        return mask


def _all(parts: list[Mask]) -> Mask:
    def mask(table: pa.Table, cache: dict[Any, Any]) -> np.ndarray:
        out = parts[0](table, cache)
        for p in parts[1:]:
            if not out.any():
                break  # nothing left to narrow
            out = out & p(table, cache)
        return out

    return mask


def _any(parts: list[Mask]) -> Mask:
    def mask(table: pa.Table, cache: dict[Any, Any]) -> np.ndarray:
        out = parts[0](table, cache)
        for p in parts[1:]:
            out = out | p(table, cache)
        return out

    return mask


def _bools(result: pa.ChunkedArray | pa.Array) -> np.ndarray:
    # Nulls (a missing value) match nothing.
    return np.asarray(pc.fill_null(result, False).to_numpy(zero_copy_only=False), dtype=bool)


@dataclass(frozen=True)
class _Values:
    """One attribute column of a table as filters compare it, derived once per table (and cache): numbers,
    bools, and datetimes as integers of the column's unit, as a numpy array; strings by their ranks among the
    column's distinct strings (shoal.searcher.ranks). A search with a filter of its own (a range, a name per
    request) then costs numpy passes over the rows, not arrow kernels and conversions."""

    numbers: np.ndarray | None
    valid: np.ndarray | None  # numbers: False where null; None when no value is
    strings: Ranked | None  # a null is no string

    def known(self, hits: np.ndarray) -> np.ndarray:
        """`hits` over the numbers, False where the value is null."""
        return hits & self.valid if self.valid is not None else hits


_NO_VALUES = _Values(None, None, None)  # a column compared by arrow's kernels, as it is


def _values(table: pa.Table, name: str, cache: dict[Any, Any]) -> _Values:
    key = ("filter values", name)
    found = cache.get(key)
    if found is None:
        found = cache[key] = _derive_values(table[name])
    return found  # type: ignore[no-any-return]


def _derive_values(column: pa.ChunkedArray) -> _Values:
    kind = column.type
    array = column.combine_chunks()
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_timestamp(kind) or \
            pa.types.is_boolean(kind):
        if pa.types.is_timestamp(kind):
            array = array.cast(pa.int64())
        valid = None
        if array.null_count:
            valid = _bools(pc.is_valid(array))
            array = pc.fill_null(array, pa.scalar(False if pa.types.is_boolean(kind) else 0, array.type))
        return _Values(array.to_numpy(zero_copy_only=False), valid, None)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        encoded = pc.dictionary_encode(array)
        codes = pc.fill_null(encoded.indices, len(encoded.dictionary)).to_numpy(zero_copy_only=False)
        return _Values(None, None, Ranked.of_codes(codes, encoded.dictionary))
    return _NO_VALUES


def _number(scalar: pa.Scalar, column_type: pa.DataType) -> Any:
    """A filter operand as the numbers of a column of `column_type` are compared with it; None when it
    cannot be (a datetime column of another unit or zone: arrow's kernels compare those)."""
    if pa.types.is_timestamp(column_type):
        return scalar.cast(pa.int64()).as_py() if scalar.type == column_type else None
    return scalar.as_py()


def _inexact(value: Any) -> bool:
    """Whether `value` is an integer no float64 holds exactly (past 2^53, within float64's range)."""
    if isinstance(value, bool) or not isinstance(value, int) or -(2**53) <= value <= 2**53:
        return False
    try:
        return float(value) != value
    except OverflowError:  # past float64's range: check_value refuses it, naming it
        return False


def _exact_on_floats(op: str, operand: Any) -> tuple[str, Any]:
    """The condition on a float64 attribute that compares stored floats with an integer operand exactly, as
    Python does (and as filters on the dataset API's metadata do), where the integer is one no float64 holds:
    converted, 2^53 + 1 became 2^53, so `$eq` matched a point holding 2^53 and `$lt` missed it. No float equals
    such an integer; a range compares with the float next to it on the operator's side."""
    if op in ("$in", "$nin"):  # not a list: refused by the caller, as on any attribute
        return op, [v for v in operand if not _inexact(v)] if isinstance(operand, list) else operand
    if not _inexact(operand):
        return op, operand
    if op == "$eq":
        return "$in", []
    if op == "$ne":
        return "$nin", []
    nearest = float(operand)
    if op in ("$lt", "$lte"):  # v < x, for a float v and an x no float equals: v <= the float below x
        return "$lte", nearest if nearest < operand else math.nextafter(nearest, -math.inf)
    return "$gte", nearest if nearest > operand else math.nextafter(nearest, math.inf)


def _compare(name: str, op: str, scalar: pa.Scalar) -> Mask:
    fn, np_fn = _COMPARE[op], _NP_COMPARE[op]
    target = scalar.as_py()  # what a string column's ranks are compared with: converted once, not per segment

    def mask(table: pa.Table, cache: dict[Any, Any]) -> np.ndarray:
        values = _values(table, name, cache)
        if values.strings is not None:
            strings = values.strings
            if op == "$eq":
                return strings.equal(target)
            if op == "$ne":
                return ~strings.equal(target) & strings.present()
            return strings.order(op, target)
        operand = None if values.numbers is None else _number(scalar, table.schema.field(name).type)
        if operand is None:
            return _bools(fn(table[name], scalar))
        return values.known(np_fn(values.numbers, operand))

    return mask


def _is_in(name: str, values_in: pa.Array, negate: bool) -> Mask:
    # The operands as the derived columns compare them, converted once rather than per segment.
    wanted = values_in.to_pylist()
    wanted_numbers = values_in.to_numpy(zero_copy_only=False)

    def mask(table: pa.Table, cache: dict[Any, Any]) -> np.ndarray:
        values = _values(table, name, cache)
        if values.strings is not None:
            hit = values.strings.among(wanted)
            return ~hit & values.strings.present() if negate else hit
        if values.numbers is not None and not pa.types.is_timestamp(values_in.type):
            found = np.isin(values.numbers, wanted_numbers)
            return values.known(~found if negate else found)
        column = table[name]
        hit = _bools(pc.is_in(column, value_set=values_in))
        return ~hit & _bools(pc.is_valid(column)) if negate else hit

    return mask


# ---- masks per segment ------------------------------------------------------------------------------------


class MaskCache:
    """Recent (segment id, filter key) -> mask, so a filter repeated over an immutable segment is evaluated
    once. Bounded by bytes (a mask is one byte per row); a mask is kept from the second time it is computed
    (shoal.searcher.repeat_cache: filters that differ per search would push out those that repeat)."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self._cache: RepeatCache[np.ndarray] = RepeatCache(max_bytes, lambda mask: mask.nbytes)

    def get(self, segment_id: str, flt: Filter, table: pa.Table, cache: dict[Any, Any]) -> np.ndarray:
        """The filter's mask over a segment's rows (read-only; computed unless kept)."""
        return self._cache.get((segment_id, flt.key), lambda: _read_only(flt.mask(table, cache)))


def _read_only(mask: np.ndarray) -> np.ndarray:
    mask.setflags(write=False)  # shared by every search that gets it from the cache
    return mask


MASKS = MaskCache()
