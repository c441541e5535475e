"""Filter masks (shoal.searcher.filters) against a plain Python reading of the filter language: every operator,
and/or/not, over columns of every comparable kind with nulls, in one chunk or several, with the per-table cache
reused across filters. The masks compare numpy arrays derived once per table (numbers, bools, datetimes, and
strings by their ranks among the column's distinct strings) where they can, and arrow's kernels where they cannot;
both must mean what the language says. The same for the fields of a JSON attribute (the dataset API's metadata)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.datasets.stats import metadata_value
from shoal.errors import ValidationError
from shoal.log.records import AttributeType
from shoal.searcher.filters import parse_filter

T0 = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
WORDS = ["", "a", "ab", "b", "libs", "net", "utils", "zz", "é"]
TYPES = {"n": AttributeType.INT64, "x": AttributeType.FLOAT64, "s": AttributeType.STRING,
         "u": AttributeType.STRING, "t": AttributeType.DATETIME, "b": AttributeType.BOOL}
ARROW = {"n": pa.int64(), "x": pa.float64(), "s": pa.string(), "u": pa.string(),
         "t": pa.timestamp("us", tz="UTC"), "b": pa.bool_()}
ORDERED = {"n", "x", "s", "u", "t"}

Row = dict[str, Any]


def values(name: str) -> st.SearchStrategy[Any]:
    """Values of one column (and operands for it): small domains, so that filters hit rows."""
    if name == "n":
        return st.integers(-5, 5) | st.sampled_from([-(2**63), 2**63 - 1])
    if name == "x":
        return st.sampled_from([-1.5, -0.0, 0.0, 0.5, 1.0, 2.25, 1e300])
    if name == "s":
        return st.sampled_from(WORDS)  # few distinct values
    if name == "u":
        # Mostly distinct values, ordered by code point as UTF-8 bytes order them (not as UTF-16 would).
        return st.text(alphabet="ab\u00e9\uffff\U0001f600", max_size=6)
    if name == "t":
        return st.integers(0, 6).map(lambda d: T0 + dt.timedelta(days=d, microseconds=d % 2))
    return st.booleans()


@st.composite
def tables(draw: st.DrawFn) -> tuple[pa.Table, list[Row]]:
    n = draw(st.integers(0, 40))
    rows: list[Row] = []
    for _ in range(n):
        row = {}
        for name in TYPES:
            null = draw(st.booleans()) and draw(st.booleans())  # about a quarter of the values missing
            row[name] = None if null else draw(values(name))
        rows.append(row)
    columns = {name: pa.array([r[name] for r in rows], ARROW[name]) for name in TYPES}
    table = pa.table(columns)
    cut = draw(st.integers(0, n))
    if 0 < cut < n and draw(st.booleans()):  # several chunks per column, as tables read in parts come
        table = pa.concat_tables([table.slice(0, cut), table.slice(cut)])
    return table, rows


def operand_text(name: str, value: Any) -> Any:
    return value.isoformat().replace("+00:00", "Z") if isinstance(value, dt.datetime) else value


COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "$eq": lambda a, b: a == b, "$ne": lambda a, b: a != b, "$gt": lambda a, b: a > b,
    "$gte": lambda a, b: a >= b, "$lt": lambda a, b: a < b, "$lte": lambda a, b: a <= b,
}


@st.composite
def leaf(draw: st.DrawFn) -> tuple[Any, Callable[[Row], bool]]:
    name = draw(st.sampled_from(sorted(TYPES)))
    ops = ["$eq", "$ne", "$in", "$nin"] + (["$gt", "$gte", "$lt", "$lte"] if name in ORDERED else [])
    chosen = draw(st.lists(st.sampled_from(ops), min_size=1, max_size=2, unique=True))
    spec: dict[str, Any] = {}
    tests: list[Callable[[Any], bool]] = []
    for op in chosen:
        if op in ("$in", "$nin"):
            wanted = draw(st.lists(values(name), max_size=8))  # more than a few: looked up by rank
            spec[op] = [operand_text(name, v) for v in wanted]
            inside = op == "$in"
            tests.append(lambda v, w=wanted, inside=inside: v is not None and (any(v == x for x in w) == inside))
        else:
            target = draw(values(name))
            spec[op] = operand_text(name, target)
            tests.append(lambda v, t=target, f=COMPARE[op]: v is not None and f(v, t))
    raw: Any = spec
    if chosen == ["$eq"] and draw(st.booleans()):
        raw = spec["$eq"]  # the bare value spells equality
    return {name: raw}, lambda row: all(t(row[name]) for t in tests)


def combined(leaves: st.SearchStrategy[tuple[Any, Callable[[Any], bool]]]
             ) -> st.SearchStrategy[tuple[Any, Callable[[Any], bool]]]:
    """Filters of `leaves` (each with its plain reading) combined by $and, $or and $not, a few levels deep."""
    def extend(inner: st.SearchStrategy[tuple[Any, Callable[[Any], bool]]]
               ) -> st.SearchStrategy[tuple[Any, Callable[[Any], bool]]]:
        many = st.lists(inner, min_size=1, max_size=3)
        return (
            many.map(lambda ps: ({"$and": [p[0] for p in ps]}, lambda r, ps=ps: all(p[1](r) for p in ps)))
            | many.map(lambda ps: ({"$or": [p[0] for p in ps]}, lambda r, ps=ps: any(p[1](r) for p in ps)))
            | inner.map(lambda p: ({"$not": p[0]}, lambda r, p=p: not p[1](r)))
        )

    return st.recursive(leaves, extend, max_leaves=5)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables(), st.lists(combined(leaf()), min_size=1, max_size=4))
def test_masks_mean_what_the_filter_language_says(table_rows: tuple[pa.Table, list[Row]],
                                                   fs: list[tuple[Any, Callable[[Row], bool]]]) -> None:
    """Each filter's mask is the rows it matches by the language's rules (a missing value matches no
    comparison, so it matches that comparison's $not), whatever column kind, chunking or cache state."""
    table, rows = table_rows
    cache: dict[Any, Any] = {}  # one per table, as a segment keeps one: shared by every filter over it
    for raw, keep in fs:
        flt = parse_filter(raw, TYPES)
        assert flt is not None
        mask = flt.mask(table, cache)
        assert mask.dtype == np.bool_ and mask.shape == (len(rows),)
        assert mask.tolist() == [keep(r) for r in rows], raw
        assert flt.mask(table, cache).tolist() == mask.tolist()  # the derived columns, reused



def test_a_column_of_long_texts_compares_as_python_strings() -> None:
    """Strings too large to copy into Python objects (texts of several MB in all) are ranked and bisected in
    arrow: every operator still means what Python's comparison of the strings says, nulls matching none."""
    rng = np.random.default_rng(7)
    texts = [None if i % 50 == 0 else ("\u00e9" if i % 3 else "a") * int(rng.integers(0, 4)) +
             f"text {int(rng.integers(0, 1500)):05d} " * 200 for i in range(3000)]
    table = pa.table({"u": pa.array(texts, pa.string())})
    assert table["u"].nbytes > 4 << 20  # past the bytes bisected as Python strings
    cache: dict[Any, Any] = {}
    probes = [t for t in texts[:40] if t is not None] + ["", "text", "\u00e9" * 9]
    for probe in probes:
        for op, keep in COMPARE.items():
            flt = parse_filter({"u": {op: probe}}, TYPES)
            assert flt is not None
            assert flt.mask(table, cache).tolist() == [t is not None and keep(t, probe) for t in texts], op
    wanted = probes[:9]
    for op, inside in (("$in", True), ("$nin", False)):
        flt = parse_filter({"u": {op: wanted}}, TYPES)
        assert flt is not None
        assert flt.mask(table, cache).tolist() == [t is not None and (t in wanted) == inside for t in texts]

# ---- fields of a JSON attribute (the dataset API's metadata) ------------------------------------------------

JSON_TYPES = {"id": AttributeType.INT64, "metadata": AttributeType.STRING}
# Integers past float64's exact range and past 64 bits, beside the floats they round to: equal in float64, not
# as numbers; and past float64's range altogether (a JSON number of 401 digits), below or above every float.
NUMBERS = [-1, 0, 1, 0.5, -0.0, 2**53, 2**53 + 1, float(2**53), 2**64 + 1, float(2**64), 10**30, 1e30, 10**400,
           -(10**400), 1.7e308]
DATES = ["1970-01-01T00:00:00Z", "2024-01-01", "2024-01-01T00:00:00Z", "2024-01-01T05:00:00+05:00",
         "2024-01-02T00:00:00", "2024-01-01T00:00:00.000001Z", "2024-13-01", "0001-01-01T00:00:00+05:00"]
FIELDS = ["f", "metadata.f", "g", "nested.h", "absent"]


def json_values() -> st.SearchStrategy[Any]:
    """A field's values (and operands): every JSON kind, in small domains so that values meet operands."""
    return st.one_of(st.none(), st.booleans(), st.sampled_from(NUMBERS), st.sampled_from(["", "a", "b", "é"]),
                     st.sampled_from(DATES))


@st.composite
def json_tables(draw: st.DrawFn) -> tuple[pa.Table, list[Any]]:
    """A table whose `metadata` is JSON text per row (or no text, or text that is no JSON), and the documents."""
    docs: list[Any] = []
    texts: list[str | None] = []
    for _ in range(draw(st.integers(0, 30))):
        doc: dict[str, Any] = {}
        for name in ("f", "g"):
            if draw(st.integers(0, 4)):  # a fifth of the fields missing
                doc[name] = draw(json_values() | st.sampled_from([[1], {"a": 1}]))
        if draw(st.booleans()):
            doc["nested"] = {"h": draw(json_values())} if draw(st.integers(0, 3)) else 7
        shape = draw(st.integers(0, 9))
        if shape == 0:
            docs.append(None)
            texts.append(None)
        elif shape == 1:
            docs.append(None)
            texts.append("{not json")
        else:
            docs.append(doc)
            texts.append(json.dumps(doc))
    return pa.table({"id": pa.array(range(len(texts)), pa.int64()), "metadata": pa.array(texts, pa.string())}), docs


def _read_datetime(s: str) -> dt.datetime | None:
    """An ISO 8601 string as an aware datetime (naive: UTC), as the language reads datetime strings."""
    if len(s) < 10 or not s[:4].isdigit() or s[4] != "-":
        return None
    try:
        value = dt.datetime.fromisoformat(s[:-1] + "+00:00" if s.endswith("Z") else s)
    except ValueError:
        return None
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def _kind_of(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int | float):
        return "number"
    return "string" if isinstance(v, str) else "other"


def _reads(v: Any, target: Any) -> Any:
    """The stored value as it compares with `target`, or None where it cannot (another kind, no value)."""
    if v is None:
        return None
    if isinstance(target, dt.datetime):
        return _read_datetime(v) if isinstance(v, str) else None
    return v if _kind_of(v) == _kind_of(target) else None


def _field(doc: Any, field: str) -> Any:
    for part in field.removeprefix("metadata.").split("."):
        doc = doc.get(part) if isinstance(doc, dict) else None
    return doc


@st.composite
def json_leaf(draw: st.DrawFn) -> tuple[Any, Callable[[Any], bool]]:
    field = draw(st.sampled_from(FIELDS))
    chosen = draw(st.lists(st.sampled_from(["$eq", "$ne", "$in", "$nin", "$gt", "$gte", "$lt", "$lte"]),
                           min_size=1, max_size=2, unique=True))
    spec: dict[str, Any] = {}
    tests: list[Callable[[Any], bool]] = []
    for op in chosen:
        if op in ("$in", "$nin"):
            wanted = draw(st.lists(json_values(), max_size=3))
            spec[op] = wanted
            targets = [(_read_datetime(w) if isinstance(w, str) else None) or w for w in wanted]
            inside = op == "$in"
            tests.append(lambda v, ts=targets, inside=inside: any(
                t is not None and _reads(v, t) is not None and _reads(v, t) == t for t in ts) == inside)
            continue
        ranged = json_values().filter(lambda x: x is not None and not isinstance(x, bool))  # ranges refuse these
        operand = draw(ranged if op not in ("$eq", "$ne") else json_values())
        spec[op] = operand
        target = (_read_datetime(operand) if isinstance(operand, str) else None) or operand
        if target is None:
            tests.append(lambda v, op=op: (v is None) == (op == "$eq"))
        elif op in ("$eq", "$ne"):
            tests.append(lambda v, t=target, eq=op == "$eq": (_reads(v, t) is not None and _reads(v, t) == t) == eq)
        else:
            tests.append(lambda v, t=target, f=COMPARE[op]: _reads(v, t) is not None and f(_reads(v, t), t))
    return {field: spec}, lambda doc: all(t(_field(doc, field)) for t in tests)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_tables(), st.lists(combined(json_leaf()), min_size=1, max_size=4))
def test_metadata_field_masks_mean_what_the_filter_language_says(table_docs: tuple[pa.Table, list[Any]],
                                                                 fs: list[tuple[Any, Callable[[Any], bool]]]) -> None:
    """A filter on metadata fields matches each row by the language's rules for schemaless fields: a value
    compares only with a value of its kind (datetime strings as datetimes where the operand is one), integers
    past float64's exact range exactly, and a missing field, null, object or list matches no comparison."""
    table, docs = table_docs
    cache: dict[Any, Any] = {}
    for raw, keep in fs:
        flt = parse_filter(raw, JSON_TYPES, json_attribute="metadata")
        assert flt is not None
        mask = flt.mask(table, cache)
        assert mask.dtype == np.bool_ and mask.shape == (len(docs),)
        assert mask.tolist() == [keep(d) for d in docs], raw
        assert flt.mask(table, cache).tolist() == mask.tolist()


def test_a_document_nested_past_python_s_stack_has_no_fields() -> None:
    """Metadata text nested deeper than Python's json can read (orjson refuses it past 1,024 levels) has no
    fields: a filter on it matches no comparison, as for text that is no JSON (it raised RecursionError, a 500)."""
    deep = "[" * 3000 + "]" * 3000
    table = pa.table({"metadata": pa.array(['{"lang": "en"}', deep, '{"lang": "de"}'])})
    for raw, want in (({"lang": "en"}, [True, False, False]), ({"lang": {"$ne": "en"}}, [False, True, True]),
                      ({"lang": None}, [False, True, False])):
        flt = parse_filter(raw, JSON_TYPES, json_attribute="metadata")
        assert flt is not None
        assert flt.mask(table, {}).tolist() == want, raw


def test_metadata_answered_as_text_has_no_fields_to_filter() -> None:
    """Metadata text that is JSON only to Python's decoder (a number past a float's range, NaN), escapes a lone
    surrogate, or nests past the dataset API's 32 levels is answered as the text it is: a filter finds no field in
    it either (a field beside `1e400` matched a filter while the answer showed the metadata as a string)."""
    deep = '{"b": 1, "c": ' + "[" * 40 + "]" * 40 + "}"
    texts = ['{"a": 1e400, "b": 1}', '{"a": NaN, "b": 1}', '{"a": "\\ud800", "b": 1}', deep, '{"a": 10e3, "b": 1}']
    table = pa.table({"metadata": pa.array(texts)})
    answered = [metadata_value(t) for t in texts]
    assert answered[:4] == texts[:4] and answered[4] == {"a": 10000.0, "b": 1}
    for raw, want in (({"b": 1}, [False] * 4 + [True]), ({"a": {"$gt": 0}}, [False] * 4 + [True]),
                      ({"b": {"$ne": 1}}, [True] * 4 + [False])):
        flt = parse_filter(raw, JSON_TYPES, json_attribute="metadata")
        assert flt is not None
        assert flt.mask(table, {}).tolist() == want, raw


def test_a_range_over_a_metadata_field_refuses_a_bool() -> None:
    """Ranges compare numbers, datetimes and strings (README); `{"$gt": true}` is refused, naming the field."""
    for op in ("$gt", "$gte", "$lt", "$lte"):
        try:
            parse_filter({"flag": {op: True}}, JSON_TYPES, json_attribute="metadata")
        except ValidationError as err:
            assert err.problems[0].attribute == "flag" and "needs a number" in str(err), str(err)
        else:
            raise AssertionError(f"{op}: true was taken")


def test_in_over_metadata_fields_mixes_kinds_in_one_pass_each() -> None:
    """`$in` over a metadata field matches each row equal to one of the values, whatever their kinds (numbers,
    strings, datetimes, bools, null), as a pass per value did (a pass per value cost the list's length times the
    rows: 200,000 values over 5,700 rows took 6.9 s a search)."""
    docs = [{"g": 1}, {"g": 2.5}, {"g": "a"}, {"g": "2024-01-01T00:00:00Z"}, {"g": True}, {"g": None}, {}, {"g": 7},
            {"g": [1]}, {"g": "b"}, {"g": False}, {"g": 1000.0}]
    table = pa.table({"metadata": pa.array([json.dumps(d) for d in docs])})
    wanted = [1, "a", "2024-01-01T00:00:00+00:00", True, None, *range(1000, 10_000)]
    want = [True, False, True, True, True, False, False, False, False, False, False, True]
    for op, expected in (("$in", want), ("$nin", [not w for w in want])):
        flt = parse_filter({"g": {op: wanted}}, JSON_TYPES, json_attribute="metadata")
        assert flt is not None
        assert flt.mask(table, {}).tolist() == expected, op
    # A column holding an integer past float64's exact range is compared exactly, row by row.
    exact = pa.table({"metadata": pa.array([json.dumps({"g": v}) for v in (2**60, 2**60 + 1, 3, "3")])})
    flt = parse_filter({"g": {"$in": [2**60, 3]}}, JSON_TYPES, json_attribute="metadata")
    assert flt is not None
    assert flt.mask(exact, {}).tolist() == [True, False, True, False]


def test_a_filter_names_a_bounded_number_of_metadata_fields_each_valid_text() -> None:
    """Each metadata field a filter names is read from every row's JSON in a pass of its own: a filter naming 999
    took 7.5 s a search over 5,700 vectors. At most 32 distinct fields; a field name must be valid Unicode, as a
    value's text must; an empty one is named as given. At most 10,000 values in all the $in / $nin lists."""
    fine = parse_filter({"$or": [{f"f{i}": 1} for i in range(32)] + [{"f0": 2}]}, JSON_TYPES,
                        json_attribute="metadata")
    assert fine is not None
    for raw, attribute, says in (
        ({"$or": [{f"f{i}": 1} for i in range(33)]}, "filter", "at most 32 distinct metadata fields"),
        ({"\ud800": 1}, "\ud800", "lone surrogate"),
        ({"": 1}, "", "not a metadata field name"),
        ({"g": {"$in": list(range(6000))}, "h": {"$nin": list(range(4001))}}, "h", "at most 10,000 values"),
    ):
        try:
            parse_filter(raw, JSON_TYPES, json_attribute="metadata")
        except ValidationError as err:
            assert err.problems[0].attribute == attribute and says in str(err), str(err)
        else:
            raise AssertionError(f"{raw!r} was taken")
