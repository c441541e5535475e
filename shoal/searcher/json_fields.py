"""Filters over the fields of a JSON attribute (the dataset API's per-vector `metadata`): what a field's value
is per row, and how a condition compares it, over a whole table at once.

Fields are schemaless, so a condition compares a value only with a value of its own kind: numbers with numbers
(a bool is no number), strings with strings, bools with bools, and ISO 8601 strings as datetimes where the
operand is one. Operands are whole microseconds (the parser refuses one with non-zero digits below: see
sub_microsecond_datetime); a stored string with such digits compares as the instant it spells, between two
microseconds, never floored. Anything else (another kind, a missing field, a JSON null, an object or a list)
matches no comparison, and so matches `$ne` and `$nin`. `$eq: null` matches the rows without a value.

A field is read once per table into numpy arrays by kind (`FieldValues`); a condition is then a few numpy
passes, as an attribute's is, not a Python test per row. The per-row tests stay as the reading they must
agree with, and as the way to compare numbers that float64 cannot hold exactly.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from shoal.log.json_text import stored_json, within_depth
from shoal.log.validation import sub_microsecond_text
from shoal.searcher.ranks import Ranked
from shoal.searcher.repeat_cache import RepeatCache

__all__ = ["FieldValues", "comparable", "field_values", "json_scalar", "row_test", "sub_microsecond_datetime"]

Test = Callable[[Any], bool]

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MICROSECOND = dt.timedelta(microseconds=1)
_BEYOND_INT64 = 2.0**63  # orjson reads integers from here on as floats
_EXACT_INT = 2**53  # integers up to this magnitude are exact in float64, so numpy compares them as Python does
_NP_ORDER = {"$gt": np.greater, "$gte": np.greater_equal, "$lt": np.less, "$lte": np.less_equal}
_ORDER: dict[str, Callable[[Any, Any], bool]] = {
    "$gt": lambda a, b: a > b, "$gte": lambda a, b: a >= b, "$lt": lambda a, b: a < b, "$lte": lambda a, b: a <= b}

# Kinds: which values compare with which. 0: none (missing or null), 5: a value of no comparable kind.
_BOOL, _NUMBER, _DATETIME, _STRING, _OTHER = 1, 2, 3, 4, 5


def json_scalar(v: Any) -> bool:
    """Whether `v` may be a condition's operand: null, a bool, a string or a finite number (an integer of any
    size: it compares exactly with every value, per row where float64 cannot hold it)."""
    return v is None or isinstance(v, bool | str | int) or (isinstance(v, float) and math.isfinite(v))


def comparable(v: Any) -> Any:
    """An operand as values are compared with it: an ISO 8601 string as a datetime."""
    if isinstance(v, str):
        return _maybe_datetime(v) or v
    return v


def sub_microsecond_datetime(v: Any) -> bool:
    """Whether `v` is a string that reads as a datetime with non-zero digits below the microsecond: as an operand
    it is refused (Python's parser floors it, so it would compare as another instant)."""
    return isinstance(v, str) and _maybe_datetime(v) is not None and sub_microsecond_text(v)


def _maybe_datetime(s: str) -> dt.datetime | None:
    if len(s) < 10 or not s[:4].isdigit() or s[4] != "-":
        return None
    try:
        value = dt.datetime.fromisoformat(s.replace("Z", "+00:00") if s.endswith("Z") else s)
    except ValueError:
        return None
    return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value


def _kind(v: Any) -> int:
    if v is None:
        return 0
    if isinstance(v, bool):
        return _BOOL
    if isinstance(v, int | float):
        return _NUMBER
    if isinstance(v, dt.datetime):
        return _DATETIME
    if isinstance(v, str):
        return _STRING
    return _OTHER


def _instant(v: Any) -> int | None:
    """A row's value as a datetime operand compares with it: a string that reads as a datetime, as twice its
    microseconds since the epoch, plus 1 when it has digits below the microsecond (it then lies strictly between
    two whole microseconds, where every operand is: 2 × its microseconds); None for any other value."""
    if not isinstance(v, str):
        return None
    moment = _maybe_datetime(v)  # floored to the microsecond
    return None if moment is None else 2 * _micros(moment) + sub_microsecond_text(v)


def _equal(v: Any, target: Any) -> bool:
    if isinstance(target, dt.datetime):
        return _instant(v) == 2 * _micros(target)
    return v is not None and _kind(v) == _kind(target) and v == target


def row_test(op: str, target: Any) -> Test:
    """The condition `op` (`$eq`, `$ne`, a range, `$in`, `$nin`; for the last two `target` is a list) against
    a comparable operand, as a test of one row's value: the language's reading."""
    if op in ("$in", "$nin"):
        inside = op == "$in"
        return lambda v: (v is not None and any(_equal(v, x) for x in target)) == inside
    if op == "$eq":
        return lambda v: (v is None) if target is None else _equal(v, target)
    if op == "$ne":
        return lambda v: (v is not None) if target is None else not _equal(v, target)
    compare = _ORDER[op]
    if isinstance(target, dt.datetime):
        goal = 2 * _micros(target)

        def instant_test(v: Any) -> bool:
            instant = _instant(v)
            return instant is not None and bool(compare(instant, goal))

        return instant_test

    def test(v: Any) -> bool:
        return v is not None and _kind(v) == _kind(target) and bool(compare(v, target))

    return test


def _micros(value: dt.datetime) -> int:
    """An aware datetime as integer microseconds since the epoch: ordered and equal as the datetimes are."""
    return (value - _EPOCH) // _MICROSECOND


class FieldValues:
    """One field of a JSON attribute, per row of a table: Python values (`raw`, None where missing) and, by
    kind, numpy arrays that conditions compare in one pass. Strings are ranked among their distinct values
    (shoal.searcher.ranks); their datetime readings are made once per distinct string, on first use."""

    def __init__(self, raw: list[Any]) -> None:
        n = len(raw)
        self.raw = raw
        kinds = np.fromiter(map(_kind, raw), dtype=np.int8, count=n)
        self.present = kinds != 0
        self.is_bool = kinds == _BOOL
        self.bools = np.fromiter((v is True for v in raw), dtype=bool, count=n)
        self.is_number = kinds == _NUMBER
        numbers = [v for v in raw if type(v) is int or type(v) is float]
        # Numbers compare in float64 only where every integer is exact there (as Python compares int and float).
        self.exact = all(type(v) is float or -_EXACT_INT <= v <= _EXACT_INT for v in numbers)
        self.numbers = np.zeros(n, dtype=np.float64)
        if self.exact and numbers:
            self.numbers[self.is_number] = np.array(numbers, dtype=np.float64)
        self.strings = Ranked.of_values(raw)
        self._dates: tuple[np.ndarray, np.ndarray] | None = None

    def match(self, op: str, target: Any) -> np.ndarray | None:
        """The rows `row_test(op, target)` passes, as a bool array; None where numpy cannot decide it exactly
        (integers beyond float64's exact range): the caller then tests each row."""
        if op in ("$in", "$nin"):
            hit = self._among(target)
            if hit is None:
                return None
            return ~hit if op == "$nin" else hit
        if op in ("$eq", "$ne"):
            found = ~self.present if target is None else self._equal(target)
            if found is None:
                return None
            return ~found if op == "$ne" else found
        return self._order(op, target)

    def _among(self, targets: list[Any]) -> np.ndarray | None:
        """The rows equal to one of `targets`, in one pass per kind of value: a pass per value cost the list's
        length times the rows (200,000 values over 5,700 rows: 6.9 s a search); None as `_equal` gives it."""
        by_kind: dict[int, list[Any]] = {}
        for x in targets:
            by_kind.setdefault(_kind(x), []).append(x)
        hit = np.zeros(len(self.raw), dtype=bool)
        if strings := by_kind.get(_STRING):
            hit |= self.strings.among(strings)
        if numbers := by_kind.get(_NUMBER):
            if not all(map(self._exact, numbers)):
                return None
            hit |= self.is_number & np.isin(self.numbers, np.array(numbers, dtype=np.float64))
        if dates := by_kind.get(_DATETIME):
            instants, valid = self._datetimes()
            hit |= valid & np.isin(instants, np.array([2 * _micros(d) for d in dates], dtype=np.int64))
        for value in set(by_kind.get(_BOOL, ())):
            hit |= self.is_bool & (self.bools == value)
        return hit  # nulls are equal to no value

    def _equal(self, target: Any) -> np.ndarray | None:
        kind = _kind(target)
        if kind == _BOOL:
            return self.is_bool & (self.bools == target)
        if kind == _NUMBER:
            if not self._exact(target):
                return None
            return self.is_number & (self.numbers == target)
        if kind == _STRING:
            return self.strings.equal(target)
        if kind == _DATETIME:
            instants, valid = self._datetimes()
            return valid & (instants == 2 * _micros(target))
        return np.zeros(len(self.raw), dtype=bool)  # null: equal to no value (json_scalar admits nothing else)

    def _order(self, op: str, target: Any) -> np.ndarray | None:
        kind = _kind(target)
        if kind == _STRING:
            return self.strings.order(op, target)
        compare = _NP_ORDER[op]
        if kind == _NUMBER:
            return self.is_number & compare(self.numbers, target) if self._exact(target) else None
        instants, valid = self._datetimes()
        return valid & compare(instants, 2 * _micros(target))

    def _exact(self, target: int | float) -> bool:
        return self.exact and (type(target) is float or -_EXACT_INT <= target <= _EXACT_INT)

    def _datetimes(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row, its string read as a datetime (as `_instant` gives it), and whether it reads as one."""
        if self._dates is None:
            # Each distinct string is read once; the entry past the end is the rows without a string.
            read = [_instant(s) for s in self.strings.distinct]
            # Years 1..9999 are within ±2^58 microseconds of the epoch: twice that fits int64.
            instants = np.array([i if i is not None else 0 for i in read] + [0], dtype=np.int64)
            valid = np.array([i is not None for i in read] + [False], dtype=bool)
            self._dates = (instants[self.strings.ranks], valid[self.strings.ranks])
        return self._dates


class _Table:
    """Names one table's cache dict (a segment's, kept while it is loaded; or one search's) in FIELDS' keys: the
    key holds it, so no other table takes its identity while an entry names it."""

    __slots__ = ("__weakref__",)


_TABLE = " json fields"  # under this name in a table's cache dict: no attribute can have it


def _field_bytes(values: FieldValues) -> int:
    """About what `values` holds: its arrays, the list of row values and the distinct strings."""
    arrays = sum(a.nbytes for a in (values.present, values.is_bool, values.bools, values.is_number, values.numbers))
    strings = values.strings
    ranked = 0 if strings is None else strings.ranks.nbytes + sum(49 + len(t) for t in strings.distinct)
    return arrays + ranked + 8 * len(values.raw) + 32 * int(values.present.sum())


# Fields read from a table's JSON column, kept from the second time a (table, field) is asked for: fields that
# differ per search (a filter on a per-user field) are read and dropped, instead of growing each segment by a
# Python value per row for every field ever named (they were kept with the segment, outside every budget).
FIELDS: RepeatCache[FieldValues] = RepeatCache(256 << 20, _field_bytes)


def field_values(table: pa.Table, column: str, field: str, cache: dict[Any, Any]) -> FieldValues:
    """One field (a dotted path) of the JSON text in `column`, per row: read again, or kept in FIELDS if the
    same table (named by its `cache` dict) and field were asked for before. The parsed documents are not kept:
    a segment's would hold a Python object per value of every field, where a search needs the fields its
    filters name."""
    table_id = cache.get(_TABLE)
    if table_id is None:
        table_id = cache[_TABLE] = _Table()
    return FIELDS.get((table_id, column, field), lambda: _read_field(table, column, field))


def _read_field(table: pa.Table, column: str, field: str) -> FieldValues:
    path = field.split(".")
    values = []
    for text in table[column].to_pylist():
        value = _at(_loads(text), path)
        if type(value) is float and not -_BEYOND_INT64 < value < _BEYOND_INT64:
            # orjson reads an integer past 64 bits as a float; json reads it as the integer it is.
            value = _at(stored_json(text), path)
        values.append(value)
    return FieldValues(values)


def _at(doc: Any, path: list[str]) -> Any:
    for part in path:
        doc = doc.get(part) if isinstance(doc, dict) else None
    return doc


def _loads(text: Any) -> Any:
    """A row's JSON text as the dataset API answers it (`stored_json`), where a value it answers as plain text
    has no fields; None for no text."""
    if not isinstance(text, str):
        return None
    try:
        value = orjson.loads(text)  # a third of json's time
    except orjson.JSONDecodeError:
        # What orjson refuses and Python's decoder may read: integers past a float's range (JSON), or NaN,
        # infinities and lone surrogates (no JSON, answered as text).
        return stored_json(text)
    return value if within_depth(text, value) else None
