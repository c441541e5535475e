"""Filter masks (shoal.searcher.filters) against a plain Python reading of the filter language: every operator,
and/or/not, over columns of every comparable kind with nulls, in one chunk or several, with the per-table cache
reused across filters. The masks take numpy and dictionary-code shortcuts (numbers, datetimes, strings with few
distinct values) and fall back to arrow's kernels for the rest; both must mean the same thing."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
        return st.sampled_from(WORDS)  # few distinct values: compared through dictionary codes
    if name == "u":
        return st.text(alphabet="abc", max_size=6)  # mostly distinct values: compared by arrow's kernels
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
            wanted = draw(st.lists(values(name), max_size=3))
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


def filters() -> st.SearchStrategy[tuple[Any, Callable[[Row], bool]]]:
    def extend(inner: st.SearchStrategy[tuple[Any, Callable[[Row], bool]]]
               ) -> st.SearchStrategy[tuple[Any, Callable[[Row], bool]]]:
        many = st.lists(inner, min_size=1, max_size=3)
        return (
            many.map(lambda ps: ({"$and": [p[0] for p in ps]}, lambda r, ps=ps: all(p[1](r) for p in ps)))
            | many.map(lambda ps: ({"$or": [p[0] for p in ps]}, lambda r, ps=ps: any(p[1](r) for p in ps)))
            | inner.map(lambda p: ({"$not": p[0]}, lambda r, p=p: not p[1](r)))
        )

    return st.recursive(leaf(), extend, max_leaves=5)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables(), st.lists(filters(), min_size=1, max_size=4))
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
