"""The JSON fields Vektonn's upload and search bodies share (attributes, attribute values, vectors), read from
orjson-parsed values with the rules the pydantic DTOs and the former conversion to records applied.

Two phases live here, used by shoal.vektonn.upload_json and shoal.vektonn.search_json alike:

1. shape: the JSON type of every field (what the pydantic DTOs checked), keys matched ignoring case
   (read_entry, read_vector);
2. records: the value slot against the declared type, repeated attributes, the vector's kind (what the former
   points_from_dtos and query conversion checked: attributes_dict, vector_value).

Each reader notes what is wrong as a Problem naming the point (or query vector) position and the attribute, and
goes on, so a body that breaks several rules reports all of them as the DTO path did.

Types are stricter than pydantic's lax mode was: a slot, `isDeleted`, `isSparse`, `k` or `retrieveVectors`
holding a JSON value of another type (1 or "yes" for a bool, 1.0 for an integer, a number of seconds for a
dateTime) is refused instead of coerced. The one coercion kept is Vektonn's own: its HttpJson reads numbers from
JSON strings (System.Text.Json's NumberHandling.AllowReadingFromString), so an int64 slot, `k` or a sparse
coordinate index takes a decimal integer string ("9007199254740993", beyond a double's exact range) and a float64
slot or a coordinate a decimal number string ("1.5e3"); not "NaN" or "Infinity", nor spaces. A JSON boolean is no
coordinate (Vektonn reads no double from `true`). A dateTime is ISO 8601's extended form as System.Text.Json reads
a DateTime (see `iso_datetime_text`), never a Unix time.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import orjson
import pydantic

from shoal.errors import Problem, ValidationError
from shoal.log.records import AttributeType, DataSourceSpec, SparseVector, unicode_text
from shoal.log.validation import HYPHENATED_GUID, MAX_PROBLEMS, NOT_UNICODE, SUB_MICROSECOND, sub_microsecond_text

JSON = "application/json"

VALUE_KINDS = ("string", "guid", "bool", "int64", "float64", "dateTime")
# Every field name of Vektonn's DTOs: input keys are matched to these ignoring case, as Vektonn (and dto.py) do.
_FIELDS = (
    "attributes", "key", "value", "vector", "isSparse", "coordinates", "coordinateIndices", "isDeleted", "k",
    "queryVectors", "splitFilter", "retrieveVectors", *VALUE_KINDS,
)
CANONICAL = {name.lower(): name for name in _FIELDS}
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
# A rule that a JSON integer too large for 64 bits may break only because orjson reads it as a float (see load).
_INTEGER_WANTED = "must be a JSON integer, got number"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

# Guids and datetimes are parsed by pydantic, as the DTOs parsed them: the same strings are accepted.
GUID = pydantic.TypeAdapter(uuid.UUID)
_DATETIME = pydantic.TypeAdapter(dt.datetime)
_COORDINATE_TYPES = frozenset((float, int))  # JSON numbers; strings that spell one are read apart (_coordinate)
# A dateTime as System.Text.Json reads a DateTime (JsonHelpers.TryParseAsISO): YYYY-MM-DD, optionally THH:MM,
# then :SS and a fraction of 1 to 16 digits (digits past the 7th read as zeros), then Z or an offset +HH or
# +HH:MM of at most 14 hours. Upper-case T and Z only; no space, no basic form (+0300), no Unix time. Ranges
# (month, day, hour 00-23, second 00-59) are pydantic's to check, as .NET checks them.
_ISO_DATETIME = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    r"(?:T[0-9]{2}:[0-9]{2}(?::[0-9]{2}(?:\.[0-9]{1,16})?)?"
    r"(?:Z|[+-](?:(?:0[0-9]|1[0-3])(?::[0-5][0-9])?|14(?::00)?))?)?"
)
# Numbers written as JSON strings, as .NET's parser reads them there: a sign, ASCII digits and, for a float, a
# fraction and an exponent. An integer of more digits than Python's int() reads is far past any range anyway.
_INTEGER_TEXT = re.compile(r"[+-]?[0-9]+")
_NUMBER_TEXT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_MAX_INTEGER_DIGITS = 4000

# An attribute after phase 1: (key, slot, value); a vector: (is sparse, coordinates, coordinate indices).
Entry = tuple[str, str, Any]
Vector = tuple[bool, list[float], list[int] | None]

Shaped = TypeVar("Shaped")


@dataclass(frozen=True)
class SubMicrosecond:
    """A dateTime slot's value with non-zero digits below the microsecond (.NET writes 7 fractional digits), as
    phase 1 gives it: `floored` is what pydantic read (it drops the digits past the sixth). Phase 2
    (attributes_dict) refuses it where the instant is part of a point's key or compared (a permanent attribute,
    a split filter) and takes it as `floored` elsewhere (an upload's payload attributes)."""

    floored: dt.datetime


# -- the body -------------------------------------------------------------------------------------------------


def load(body: bytes, error: type[ValidationError]) -> tuple[Any, bool]:
    """The parsed body and whether Python's json parsed it (because orjson refused it); raises `error` when
    neither takes it."""
    try:
        return orjson.loads(body), False
    except orjson.JSONDecodeError as exc:
        refusal = exc
    # FastAPI parsed request bodies with Python's json, which takes what orjson refuses: NaN and Infinity,
    # numbers beyond a double, a byte order mark. Take them too, so such a body meets the rules it met before
    # (a non-finite coordinate is a point's problem, not a parse error).
    try:
        parsed = stdlib_loads(body)
    except (ValueError, TypeError, RecursionError):
        raise error(f"the body is not JSON: {refusal}") from None
    try:
        json.dumps(parsed, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate ("\ud800" escaped) cannot be stored as UTF-8 (the DTO path failed on it with a
        # server error): name the field that holds it.
        position, attribute = _where(parsed, _unencodable(parsed) or [])
        raise error(Problem(NOT_UNICODE, position, attribute)) from None
    except (ValueError, TypeError, RecursionError):
        raise error(f"the body is not JSON: {refusal}") from None
    return parsed, True


def _unencodable(parsed: Any) -> list[Any] | None:
    """The path (object keys and array indices) to the first string or object key UTF-8 cannot encode; None
    when every one encodes. Iterative: the body may nest as deep as Python's json parses."""
    stack: list[tuple[Any, list[Any]]] = [(parsed, [])]
    while stack:
        value, path = stack.pop()
        kind = type(value)
        if kind is str:
            if not unicode_text(value):
                return path
        elif kind is dict:
            for key, item in value.items():
                if not unicode_text(key):
                    return [*path, key]
                stack.append((item, [*path, key]))
        elif kind is list:
            stack.extend((item, [*path, i]) for i, item in enumerate(value))
    return None


def _where(parsed: Any, path: list[Any]) -> tuple[int | None, str | None]:
    """The (point or query vector position, attribute or field name) a path into a Vektonn body points at."""
    position: int | None = None
    node = parsed
    if type(node) is list and path:  # an upload: the data point's position
        position, node, path = path[0], node[path[0]], path[1:]
    if type(node) is not dict or not path or not unicode_text(path[0]):
        return position, None
    field = CANONICAL.get(path[0].lower(), path[0])
    if field in ("attributes", "splitFilter") and len(path) >= 2 and type(node[path[0]]) is list:
        entry = node[path[0]][path[1]]
        key = entry.get("key") if type(entry) is dict else None
        if type(key) is str and unicode_text(key):
            return position, key  # the attribute whose key or value holds it
    if field == "queryVectors" and len(path) >= 2:
        position = path[1]
    return position, field


def shape_body(
    body: bytes, loaded: tuple[Any, bool], shape: Callable[[Any], tuple[Shaped, list[Problem]]]
) -> Shaped:
    """The loaded body put through `shape` (phase 1), or a ValidationError listing shape's problems.

    orjson reads an integer beyond 64 bits as a float, which Python's json (the DTO path's parser) kept as an
    integer: when a problem may come from that, the body is parsed again with Python's json and shaped anew, so
    such a body meets the rules it met before.
    """
    parsed, by_stdlib = loaded
    shaped, problems = shape(parsed)
    if problems and not by_stdlib and any(_INTEGER_WANTED in p.rule for p in problems):
        try:
            shaped, problems = shape(stdlib_loads(body))
        except (ValueError, TypeError, RecursionError):
            pass  # orjson's reading stands, and so do its problems
    if problems:
        raise ValidationError(problems[:MAX_PROBLEMS])
    return shaped


def stdlib_loads(body: bytes | bytearray | memoryview | str) -> Any:
    """The body parsed by Python's json (integers of any size kept as integers)."""
    # Python's json takes bytes and str but not a memoryview.
    return json.loads(bytes(body) if isinstance(body, memoryview) else body)


def canon(obj: dict[str, Any]) -> dict[str, Any]:
    """The object with its keys spelled as Vektonn's fields are (the last of two spellings wins, as in dto.py)."""
    if obj.keys() <= _FIELD_SET:
        return obj
    return {CANONICAL.get(k.lower(), k): v for k, v in obj.items()}


def jtype(value: Any) -> str:
    """The JSON type name of a parsed value."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def json_object(
    raw: Any, expected: str, position: int | None, attribute: str, problems: list[Problem]
) -> dict[str, Any] | None:
    """`raw` with its keys canonical when it is a JSON object; otherwise None after noting the rule `expected`
    states ("a vector must be a JSON object {...}") with the JSON type found."""
    if type(raw) is not dict:
        problems.append(Problem(f"{expected}, got {jtype(raw)}", position, attribute))
        return None
    return canon(raw)


# -- phase 1: JSON shape --------------------------------------------------------------------------------------


def read_entry(raw: Any, position: int | None, field: str, problems: list[Problem]) -> Entry | None:
    """One AttributeDto `{key, value: {<slot>: v}}` as (key, slot, value), or None after noting the problem."""
    entry = json_object(raw, "an attribute must be a JSON object {key, value}", position, field, problems)
    if entry is None:
        return None
    key = entry.get("key")
    name = key if type(key) is str else None
    if name is None:
        rule = (
            "an attribute needs a key" if key is None else f"an attribute key must be a JSON string, got {jtype(key)}"
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
    slots = json_object(raw, f"an attribute value must be a JSON object holding one of {', '.join(VALUE_KINDS)}",
                        position, attribute, problems)
    if slots is None:
        return None
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


def integer_text(raw: str) -> int | None:
    """The integer a decimal string spells ("42", "-7", "+3"), which Vektonn reads where it wants an integer;
    None when it spells none."""
    if len(raw) > _MAX_INTEGER_DIGITS + 1 or not _INTEGER_TEXT.fullmatch(raw):
        return None
    return int(raw)


def iso_datetime_text(raw: str) -> str | None:
    """The text pydantic parses for a dateTime slot's `raw` when Vektonn's parser (System.Text.Json's DateTime)
    takes its form (`_ISO_DATETIME`), else None. An offset of hours alone ("+03"), which pydantic refuses, is
    given its minutes."""
    if not _ISO_DATETIME.fullmatch(raw):
        return None
    # After the date, a sign three from the end can only open an offset of hours alone.
    return raw + ":00" if len(raw) > 10 and raw[-3] in "+-" else raw


def iso_datetime_texts(raws: list[str]) -> bool:
    """Whether every one of `raws` (strings) has the form `iso_datetime_text` takes: the fast path's column-wise
    test (a regex match per value, in C). An offset of hours alone passes here and pydantic then refuses it, so
    such a column goes the exact way, which reads it."""
    return all(map(_ISO_DATETIME.fullmatch, raws))


def _number_text(raw: str) -> float | None:
    """The double a decimal number string spells ("1.5", "-2e3"); None when it spells none ("NaN" included)."""
    return float(raw) if _NUMBER_TEXT.fullmatch(raw) else None


def _slot_value(slot: str, raw: Any) -> tuple[Any, str | None]:
    """(the slot's Python value, None), or (None, the rule the JSON value breaks). An int64 or float64 slot
    takes its number written as a JSON string too, as Vektonn does; the range checks that follow are the same."""
    kind = type(raw)
    if slot == "string":
        return (raw, None) if kind is str else (None, _wrong_type(slot, "string", raw))
    if slot == "int64":
        if kind is int:
            return raw, None
        if kind is str and (number := integer_text(raw)) is not None:
            return number, None
        return None, _wrong_type(slot, "integer", raw)
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
        if kind is str and (double := _number_text(raw)) is not None:
            return double, None
        return None, _wrong_type(slot, "number", raw)
    if kind is not str:
        return None, _wrong_type(slot, "string", raw)
    if slot == "guid":
        if HYPHENATED_GUID.fullmatch(raw):
            return uuid.UUID(raw), None  # the common form, read alike by both and faster by uuid
        try:
            return GUID.validate_python(raw), None
        except pydantic.ValidationError:
            return None, f"not a guid: {raw[:50]!r}"
    text = iso_datetime_text(raw)
    if text is None:  # checked first: pydantic also reads "2021" or "20210101" as Unix seconds, and more forms
        return None, f"not an ISO 8601 date and time: {raw[:50]!r}"
    try:
        moment = _DATETIME.validate_python(text)
    except pydantic.ValidationError:
        return None, f"not an ISO 8601 date and time: {raw[:50]!r}"
    if moment.tzinfo is not None:
        try:
            moment.astimezone(dt.UTC)  # "0001-01-01T00:00:00+01:00" is before year 1 in UTC, where it is stored
        except OverflowError:
            return None, f"date and time out of range in UTC: {raw[:50]!r}"
    # A naive value is UTC as it stands (never converted: astimezone would take it as the host's local time, and
    # "0001-01-01T00:00:00", .NET's DateTime.MinValue, raised ValueError east of UTC).
    # pydantic drops (floors) digits past the sixth: whether that lost anything is phase 2's question (see
    # SubMicrosecond).
    return (SubMicrosecond(moment) if sub_microsecond_text(raw) else moment), None


def _wrong_type(slot: str, wanted: str, raw: Any) -> str:
    if wanted in ("integer", "number"):
        return wrong_number(f"{slot} value", wanted, raw)
    return f"{slot} value must be a JSON {wanted}, got {jtype(raw)}"


def wrong_number(field: str, wanted: str, raw: Any) -> str:
    """The rule a value that is no number (`wanted`: integer or number) breaks where Vektonn reads one, naming
    the string given when it is one that spells no decimal number."""
    if type(raw) is str:
        return f"{field} must be a JSON {wanted}, got string {raw[:50]!r}, which spells no decimal {wanted}"
    return f"{field} must be a JSON {wanted}, got {jtype(raw)}"


def read_vector(raw: Any, position: int | None, attribute: str, problems: list[Problem]) -> Vector | None:
    """A VectorDto as (is sparse, coordinates as floats, indices or None), or None after noting the problem."""
    vector = json_object(raw, "a vector must be a JSON object {isSparse, coordinates, coordinateIndices}",
                         position, attribute, problems)
    if vector is None:
        return None
    before = len(problems)
    sparse = vector.get("isSparse", False)
    if type(sparse) is not bool:
        problems.append(Problem(f"isSparse must be a JSON boolean, got {jtype(sparse)}", position, attribute))
    coordinates: list[float] = []
    if "coordinates" not in vector:
        problems.append(Problem("a vector needs coordinates", position, attribute))
    else:
        raw_coordinates = vector["coordinates"]
        numbers = dense_numbers(raw_coordinates) if sparse is False else None
        if numbers is not None:
            coordinates = numbers  # type: ignore[assignment]
        else:
            read, rule = _coordinates(raw_coordinates)
            if rule is not None:
                problems.append(Problem(rule, position, attribute))
            coordinates = read or []
    indices = vector.get("coordinateIndices")
    if indices is not None:
        indices, rule = _coordinate_indices(indices)
        if rule is not None:
            problems.append(Problem(rule, position, attribute))
    if len(problems) != before:
        return None
    return sparse, coordinates, indices


def _coordinates(raw: Any) -> tuple[list[float] | None, str | None]:
    """(coordinates as doubles, None) or (None, the rule broken): a JSON array of numbers, each a JSON number or
    a string spelling a decimal number ("1.5", read as Vektonn's AllowReadingFromString reads it); no boolean."""
    if type(raw) is not list:
        return None, f"coordinates must be a JSON array of numbers, got {jtype(raw)}"
    try:
        if set(map(type, raw)) <= _COORDINATE_TYPES:
            return list(map(float, raw)), None  # as the DTO's list[float] held them
        out: list[float] = []
        for i, value in enumerate(raw):  # only a vector that holds some other JSON value comes here
            number = _coordinate(value)
            if number is None:
                return None, _not_a_coordinate(value, i)
            out.append(number)
        return out, None
    except OverflowError:  # an integer beyond a double
        return None, "a coordinate is out of the range of a double"


def _not_a_coordinate(value: Any, index: int) -> str:
    if type(value) is str:
        return (f"coordinates must be JSON numbers, got string {value[:50]!r} at index {index}, which spells no "
                "decimal number")
    return f"coordinates must be JSON numbers, got {jtype(value)} at index {index}"


def _coordinate(value: Any) -> float | None:
    """One coordinate's double, or None when it is no JSON number nor a string that spells one."""
    kind = type(value)
    if kind is float or kind is int:
        return float(value)
    return _number_text(value) if kind is str else None


def _coordinate_indices(raw: Any) -> tuple[list[int] | None, str | None]:
    """(sparse indices, None) or (None, the rule broken): a JSON array of integers, each a JSON integer or a
    string spelling a decimal integer ("7", as Vektonn reads int[] from strings); no boolean."""
    if type(raw) is not list:
        return None, f"coordinateIndices must be a JSON array of integers, got {jtype(raw)}"
    if set(map(type, raw)) <= {int}:
        return raw, None
    out: list[int] = []
    for i, value in enumerate(raw):
        index = value if type(value) is int else integer_text(value) if type(value) is str else None
        if index is None:
            return None, wrong_number(f"coordinateIndices[{i}]", "integer", value)
        out.append(index)
    return out, None


def dense_numbers(raw: Any) -> np.ndarray | None:
    """A dense vector's coordinates as float64, when they are a JSON array of numbers; None otherwise (a boolean,
    a string, ...), and the per-value checks then read or name what is wrong.

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
    if array.ndim != 1 or array.dtype.kind not in "fiu" or may_hold_booleans(raw, array):
        return None
    return array.astype(np.float64, copy=False)


def may_hold_booleans(raw: list[Any], array: np.ndarray) -> bool:
    """Whether the JSON array `raw`, read by NumPy as the numeric `array`, holds a boolean: NumPy reads true
    among numbers as 1, so only a vector holding a 0 or a 1 pays for a look at the JSON types (in C)."""
    if array.dtype.kind == "b":
        return True
    if not ((array == 0) | (array == 1)).any():
        return False
    return bool in set(map(type, raw))


# -- phase 2: values against the data source ------------------------------------------------------------------


def attributes_dict(
    spec: DataSourceSpec, entries: list[Entry], position: int | None, problems: list[Problem],
    *, exact: Collection[str] | None = None,
) -> dict[str, Any]:
    """{key: value}: each key once, each declared attribute in its type's slot, guids as canonical text.

    A dateTime with digits below the microsecond is a problem (SUB_MICROSECOND) for the attributes in `exact`
    (every one when None, as for a split filter): flooring a key's instant could make two points one, and a
    filter would compare another instant. Elsewhere (an upload's non-permanent attributes: payload, or a
    tombstone's, never stored) it is floored to the microsecond, as .NET's DateTime.UtcNow (7 fraction digits)
    cannot be stored otherwise and no two points can merge over it."""
    out: dict[str, Any] = {}
    for key, slot, value in entries:
        if key in out:
            problems.append(Problem("attribute given twice", position, key))
            continue
        declared = spec.attribute_types.get(key)
        if declared is not None and slot != SLOT[declared]:
            problems.append(Problem(f"expected a {SLOT[declared]} value, got {slot}", position, key))
            continue
        if type(value) is SubMicrosecond:
            if declared is not None and (exact is None or key in exact):
                problems.append(Problem(SUB_MICROSECOND, position, key))
                continue
            value = value.floored  # payload, or not an attribute at all (points_to_table says so)
        out[key] = str(value) if declared is AttributeType.GUID else value
    return out


def vector_value(
    spec: DataSourceSpec, vector: Vector, position: int | None, attribute: str, problems: list[Problem],
    *, empty_sparse: bool = True,
) -> list[float] | SparseVector | None:
    """A vector as the records take it (a list, or a SparseVector), or None after noting the problem. A sparse
    vector without coordinates is the records' all-zero vector; `empty_sparse=False` refuses it, as Vektonn's
    SparseVectorValidator does ("Vector must have coordinates")."""
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
    if not empty_sparse and not len(coordinates):
        problems.append(Problem("a sparse vector must have at least one coordinate", position, attribute))
        return None
    if any(i < _INT64_MIN or i > _INT64_MAX for i in indices):
        # Beyond int64 NumPy cannot even hold the index (the DTO path failed there with a server error).
        problems.append(Problem(f"sparse index out of range 0..{spec.vector_dimension - 1}", position, attribute))
        return None
    return SparseVector(indices, coordinates)
