"""Split values the catalog's JSON cannot hold as given: a NUL character (jsonb holds none) and a float64 that
comes back as an integer (1e300 read back as 10**300). Both were accepted on upload, then broke the index:
every build of the shard failed for good, or a split filter found nothing once the split was built."""

from __future__ import annotations

from typing import Any

import pytest

from shoal import DataPoint, DataSourceSpec, Shoal
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec
from shoal.searcher.consistency import Consistency


def _setup(shoal: Shoal, kind: str) -> None:
    shoal.create_data_source(DataSourceSpec("Sv", "1", 2, {"id": "int64", "s": kind}, ["id", "s"]))
    shoal.create_index(IndexSpec("SvI", "1", "Sv", "1", algorithm="flat", metric="euclidean",
                                 split_attributes=("s",)))


def _build(shoal: Shoal) -> None:
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for shard in shoal.get_index("SvI", "1").shards:
        builder.materialize(shard.id)


def _ids(shoal: Shoal, split: Any) -> list[int]:
    searcher = shoal.searcher(follow=False)
    try:
        hits = searcher.search("SvI", "1", [[0.0, 0.0]], 10, split_filter={"s": split},
                               consistency=Consistency.strong())[0]
        return sorted(h.attributes["id"] for h in hits)
    finally:
        searcher.close()


@pytest.mark.parametrize(("kind", "odd", "plain"), [("string", "a\x00b", "ok"), ("float64", 1e300, 1.5),
                                                    ("float64", 2.0**60, 0.0)])
def test_a_split_value_the_catalog_json_cannot_hold_as_given_builds_and_is_found(
    local_shoal: Shoal, kind: str, odd: Any, plain: Any
) -> None:
    shoal = local_shoal
    _setup(shoal, kind)
    producer = shoal.producer("Sv", "1")
    producer.upload([DataPoint({"id": 1, "s": odd}, [0.0, 1.0]), DataPoint({"id": 2, "s": plain}, [1.0, 1.0])])
    _build(shoal)
    assert _ids(shoal, odd) == [1] and _ids(shoal, plain) == [2]
    producer.upload([DataPoint({"id": 3, "s": odd}, [2.0, 2.0])])
    _build(shoal)  # the shard still builds: its versions publish
    assert all(s.built_watermark == 3 for s in shoal.get_index("SvI", "1").shards)
    assert _ids(shoal, odd) == [1, 3]
