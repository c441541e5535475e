"""A float64 attribute filtered with an integer operand no float64 holds (past 2^53) compares exactly, as Python
compares an int with a float and as the dataset API's metadata filters do: the operand was rounded to float64
first, so `$eq` and `$in` matched a point holding another number and `$lt` / `$gte` answered for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from shoal import DataPoint, DataSourceSpec, Shoal
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec
from shoal.searcher.consistency import Consistency

VALUES = {1: 2.0**53, 2: 2.0**53 + 2, 3: -(2.0**53) - 2, 4: 1.5}
X = 2**53 + 1  # no float64 holds it: float(X) == 2**53
FILTERS: list[tuple[str, Any]] = [("$lt", X), ("$lte", X), ("$gt", X), ("$gte", X), ("$eq", X), ("$ne", X),
                                  ("$in", [X, 1.5]), ("$nin", [X]), ("$gt", -X - 2), ("$lte", -X - 2)]


def _python(op: str, operand: Any) -> list[int]:
    tests = {"$lt": lambda v: v < operand, "$lte": lambda v: v <= operand, "$gt": lambda v: v > operand,
             "$gte": lambda v: v >= operand, "$eq": lambda v: v == operand, "$ne": lambda v: v != operand,
             "$in": lambda v: v in operand, "$nin": lambda v: v not in operand}
    return sorted(i for i, v in VALUES.items() if tests[op](v))


@pytest.mark.parametrize("built", [False, True], ids=["log tail", "built"])
def test_integer_operands_past_2_53_compare_exactly_with_float64_values(
    make_shoal: Callable[..., Shoal], built: bool
) -> None:
    shoal = make_shoal()
    shoal.create_data_source(DataSourceSpec("S", "1", 2, {"id": "int64", "f": "float64"}, ["id"]))
    shoal.create_index(IndexSpec("F", "1", "S", "1", algorithm="flat", metric="euclidean"))
    shoal.producer("S", "1").upload([DataPoint({"id": i, "f": v}, [float(i), 0.0]) for i, v in VALUES.items()])
    if built:
        for shard in shoal.get_index("F", "1").shards:
            ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
    searcher = shoal.searcher(follow=False)
    try:
        for op, operand in FILTERS:
            hits = searcher.search("F", "1", [[0.0, 0.0]], 10, filters={"f": {op: operand}},
                                   consistency=Consistency.strong())[0]
            assert sorted(h.attributes["id"] for h in hits) == _python(op, operand), (op, operand)
    finally:
        searcher.close()


def test_in_given_a_big_integer_instead_of_a_list_is_refused(make_shoal: Callable[..., Shoal]) -> None:
    """`$in` / `$nin` need a list on a float64 attribute too: a bare integer past 2^53 was read as `$gte` it."""
    from shoal.errors import QueryError

    shoal = make_shoal()
    shoal.create_data_source(DataSourceSpec("S", "1", 2, {"id": "int64", "f": "float64"}, ["id"]))
    shoal.create_index(IndexSpec("F", "1", "S", "1", algorithm="flat", metric="euclidean"))
    shoal.producer("S", "1").upload([DataPoint({"id": i, "f": v}, [float(i), 0.0]) for i, v in VALUES.items()])
    searcher = shoal.searcher(follow=False)
    try:
        for op in ("$in", "$nin"):
            with pytest.raises(QueryError, match=r"\$n?in takes a list"):
                searcher.search("F", "1", [[0.0, 0.0]], 10, filters={"f": {op: X}}, consistency=Consistency.strong())
    finally:
        searcher.close()
