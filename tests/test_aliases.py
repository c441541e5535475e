"""Index aliases: a search by alias is answered by the index it names; moving it is atomic, also under load."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest
from conftest import serve_api
from test_cli_index import cli_env, shoal_cli, tenant  # noqa: F401 - fixtures of the CLI tests

from shoal import DataSourceSpec, Shoal
from shoal.errors import NotFoundError, ValidationError
from shoal.index.builder import ShardBuilder
from shoal.log.records import AttributeType, IndexSpec

SPEC = DataSourceSpec("docs", "1", 4, {"id": AttributeType.INT64, "payload": AttributeType.STRING}, ["id"])


def _two_indexes(shoal: Shoal) -> np.ndarray:
    """Data source with 200 points; index `a` over euclidean and `b` over dot product (different answers)."""
    shoal.create_data_source(SPEC)
    rng = np.random.default_rng(7)
    vectors = rng.normal(size=(200, 4)).astype(np.float32)
    shoal.producer("docs", "1").upload_columns(vectors, {"id": np.arange(200), "payload": ["p"] * 200})
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for name, metric in (("a", "euclidean"), ("b", "dot_product")):
        shoal.create_index(IndexSpec(name, "1", "docs", "1", algorithm="flat", metric=metric, id_attributes=["id"]))
        for shard in shoal.get_index(name, "1").shards:
            builder.materialize(shard.id)
    return rng.normal(size=(20, 4)).astype(np.float32)


def _ids(results: list[list[object]]) -> list[list[int]]:
    return [[h.attributes["id"] for h in hits] for hits in results]  # type: ignore[attr-defined]


def test_alias_search_follows_moves_and_each_answer_is_one_index(local_shoal: Shoal) -> None:
    queries = _two_indexes(local_shoal)
    searcher = local_shoal.searcher(follow=False)
    try:
        by_index = {n: _ids(searcher.search(n, "1", queries, 5)) for n in ("a", "b")}
        assert by_index["a"] != by_index["b"]
        local_shoal.set_alias("live", "a", "1")
        assert _ids(searcher.search_alias("live", queries, 5)) == by_index["a"]
        assert local_shoal.get_alias("live").index_name == "a"

        # Searches run while the alias moves back and forth: every answer is wholly a's or wholly b's.
        answers: list[list[list[int]]] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def search_loop() -> None:
            try:
                while not stop.is_set():
                    answers.append(_ids(searcher.search_alias("live", queries, 5)))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=search_loop) for _ in range(4)]
        for t in threads:
            t.start()
        for i in range(40):
            local_shoal.set_alias("live", "b" if i % 2 == 0 else "a", "1")
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert answers
        assert all(a in (by_index["a"], by_index["b"]) for a in answers)
        assert local_shoal.get_alias("live").index_name == "a"  # the last move (i = 39) named a
    finally:
        searcher.close()


def test_alias_errors_and_drop(local_shoal: Shoal) -> None:
    _two_indexes(local_shoal)
    with pytest.raises(NotFoundError, match="'nope'"):
        local_shoal.set_alias("live", "nope", "1")
    with pytest.raises(NotFoundError, match="alias 'live'"):
        local_shoal.get_alias("live")
    with pytest.raises(ValidationError, match="alias"):
        local_shoal.set_alias("../x", "a", "1")
    local_shoal.set_alias("live", "a", "1")
    local_shoal.set_alias("other", "b", "1")
    assert [r.name for r in local_shoal.list_aliases()] == ["live", "other"]
    local_shoal.drop_alias("other")
    with pytest.raises(NotFoundError):
        local_shoal.drop_alias("other")
    local_shoal.drop_index("a", "1")  # dropping the index removes the aliases naming it
    assert local_shoal.list_aliases() == []


def test_aliases_over_http(make_settings) -> None:  # type: ignore[no-untyped-def]
    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with Shoal(settings) as shoal:
        queries = _two_indexes(shoal)
        searcher = shoal.searcher(follow=False)
        expected = _ids(searcher.search("b", "1", queries[:1], 3))
        searcher.close()
    with serve_api(settings) as base:
        api = f"{base}/api/v1"
        put = httpx.put(f"{api}/aliases/live", json={"indexName": "b", "indexVersion": "1"}, timeout=30)
        assert put.status_code == 200, put.text
        assert put.json()["indexName"] == "b"
        assert [a["name"] for a in httpx.get(f"{api}/aliases", timeout=30).json()] == ["live"]
        body = {"k": 3, "queryVectors": [{"isSparse": False, "coordinates": queries[0].tolist()}]}
        found = httpx.post(f"{api}/aliases/live/search", json=body, timeout=30)
        assert found.status_code == 200, found.text
        ids = [[a["value"]["int64"] for p in r["nearestDataPoints"] for a in p["attributes"] if a["key"] == "id"]
               for r in found.json()]
        assert ids == expected
        missing = httpx.post(f"{api}/aliases/nope/search", json=body, timeout=30)
        assert missing.status_code == 404
        assert "alias 'nope'" in missing.json()["errorMessages"][0]
        bad = httpx.put(f"{api}/aliases/live", json={"indexName": "zzz", "indexVersion": "1"}, timeout=30)
        assert bad.status_code == 404
        assert httpx.get(f"{api}/aliases/live", timeout=30).json()["indexName"] == "b"  # unchanged
        assert httpx.delete(f"{api}/aliases/live", timeout=30).status_code == 204
        assert httpx.get(f"{api}/aliases/live", timeout=30).status_code == 404


def test_alias_cli(tenant: str) -> None:  # noqa: F811 - the fixture imported above
    with Shoal() as shoal:
        _two_indexes(shoal)
    assert "alias live -> index a/1" in shoal_cli("alias", "set", "live", "a", "1").output
    shoal_cli("alias", "set", "live", "b", "1")
    assert '"index_name": "b"' in shoal_cli("alias", "get", "live", "--json").output
    assert "live" in shoal_cli("alias", "list").output
    shoal_cli("alias", "drop", "live")
    assert "not found" in shoal_cli("alias", "get", "live", code=1).output
