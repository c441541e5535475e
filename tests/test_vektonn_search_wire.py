"""shoal.vektonn's search query decoder and result encoder against the DTO path they replace: the same queries, the
same errors, the same response bytes.

The old path is what the HTTP routes did before: the pydantic SearchQueryDto, tests/helpers/dto_path.py's
query_vectors and split_filter, and search results through hit_dto/vector_dto and FastAPI's
dump_json(by_alias=True, exclude_none=True).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import uuid
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pydantic
import pytest
from helpers.dto_path import hit_dto, vector_dto
from helpers.dto_path import query_vectors as old_query_vectors
from helpers.dto_path import split_filter as old_split_filter
from helpers.wire_cases import PROPERTY, attribute_value, odd_case, outcome, source_spec, vector
from hypothesis import given
from hypothesis import strategies as st

from shoal.errors import Problem, ValidationError
from shoal.log.records import AttributeType, DataSourceSpec, SparseVector
from shoal.log.validation import ARROW_TYPES, SPARSE_INDICES, SPARSE_VALUES, VECTOR
from shoal.searcher.hits import Hit, Hits, RowSource
from shoal.vektonn.dto import SearchQueryDto, SearchResultDto
from shoal.vektonn.search_json import SearchQuery, decode_search, query_vectors, split_filter
from shoal.vektonn.search_response import encode_search_results

_RESULTS = pydantic.TypeAdapter(list[SearchResultDto])


# -- search -------------------------------------------------------------------------------------------------------


def test_decode_search_reads_vektonn_queries() -> None:
    query = decode_search(b'{"K": 2, "QueryVectors": [{"IsSparse": false, "Coordinates": [0, 2.5]}], '
                          b'"splitFilter": [{"key": "tag", "value": {"string": "a"}}], "RETRIEVEVECTORS": true}')
    assert (query.k, query.split_filter, query.retrieve_vectors) == (
        2, [{"key": "tag", "value": {"string": "a"}}], True)
    [vector] = query.query_vectors
    assert (vector["isSparse"], list(vector["coordinates"]), vector["coordinateIndices"]) == (False, [0.0, 2.5], None)
    spec = DataSourceSpec("S", "1", 2, {"tag": "string", "id": "int64"}, ["id"])
    vectors = query_vectors(spec, query)
    assert isinstance(vectors, np.ndarray) and vectors.dtype == np.float32 and vectors.tolist() == [[0.0, 2.5]]
    assert split_filter(spec, query) == {"tag": "a"}
    assert decode_search(b'{"k": 1, "queryVectors": []}').split_filter is None


@pytest.mark.parametrize(
    ("body", "attribute", "says"),
    [
        (b'{"queryVectors": []}', "k", "a search query needs k"),
        (b'{"k": 1}', "queryVectors", "a search query needs queryVectors"),
        (b'{"k": true, "queryVectors": []}', "k", "k must be a JSON integer, got boolean"),
        # Vektonn reads numbers from JSON strings ("k": "3" is k 3); a string that spells no integer is refused.
        (b'{"k": "three", "queryVectors": []}', "k", "k must be a JSON integer, got string 'three'"),
        (b'{"k": "3.0", "queryVectors": []}', "k", "k must be a JSON integer, got string '3.0'"),
        (b'{"k": 3.0, "queryVectors": []}', "k", "k must be a JSON integer, got number"),
        (b'{"k": 3, "queryVectors": {}}', "queryVectors", "must be a JSON array"),
        (b'{"k": 3, "queryVectors": [{"coordinates": ["a"]}]}', "queryVectors", "coordinates must be JSON numbers"),
        (b'{"k": 3, "queryVectors": [], "retrieveVectors": "yes"}', "retrieveVectors", "must be a JSON boolean"),
        (b'{"k": 3, "queryVectors": [], "splitFilter": [{"key": "t", "value": {"int64": "x"}}]}', "t",
         "int64 value must be a JSON integer, got string"),
        (b"[]", None, "a search query must be a JSON object, got array"),
        (b"{", None, "the body is not JSON"),
    ],
)
def test_bad_search_queries_name_the_field(body: bytes, attribute: str | None, says: str) -> None:
    with pytest.raises(ValidationError) as err:
        decode_search(body)
    assert err.value.problems[0].attribute == attribute
    assert says in str(err.value)


def test_search_values_are_checked_as_convert_checks_them() -> None:
    spec = DataSourceSpec("S", "1", 2, {"tag": "string", "id": "int64", "g": "guid"}, ["id"])
    query = decode_search(b'{"k": 1, "queryVectors": [{"coordinates": [1, 2]}, {"isSparse": true, "coordinates": [1],'
                          b' "coordinateIndices": [0]}], "splitFilter": [{"key": "tag", "value": {"int64": 1}},'
                          b' {"key": "g", "value": {"guid": "0000000A-0000-0000-0000-00000000000B"}}]}')
    with pytest.raises(ValidationError) as err:
        query_vectors(spec, query)
    assert err.value.problems == [Problem("the data source holds dense vectors", 1, "queryVectors")]
    with pytest.raises(ValidationError) as err:
        split_filter(spec, query)
    assert err.value.problems == [Problem("expected a string value, got int64", None, "tag")]
    ragged = decode_search(b'{"k": 1, "queryVectors": [{"coordinates": [1, 2]}, {"coordinates": [1]}]}')
    # the searcher refuses these by name
    assert [list(v) for v in query_vectors(spec, ragged)] == [[1.0, 2.0], [1.0]]


@st.composite
def search_body(draw: st.DrawFn) -> tuple[DataSourceSpec, bytes]:
    spec = draw(source_spec())
    vectors = draw(st.lists(vector(spec), max_size=3).filter(lambda vs: all(type(v) is dict for v in vs)))
    # Query vectors take the DTO's shape rules only: drop the values the DTOs coerced or NaN (none in a query).
    vectors = [v for v in vectors if all(type(c) in (int, float) and math.isfinite(c)
                                         for k, c_list in v.items() if k.lower() == "coordinates"
                                         for c in (c_list if type(c_list) is list else []))
               and all(type(s) is bool for k, s in v.items() if k.lower() == "issparse")]
    query: dict[str, Any] = {draw(odd_case("k")): draw(st.integers(-2, 100)), draw(odd_case("queryVectors")): vectors}
    if draw(st.booleans()):
        names = [*spec.attribute_types, "unknown"]
        entries = []
        for name in draw(st.lists(st.sampled_from(names), max_size=3)):
            kind = spec.attribute_types.get(name, draw(st.sampled_from(list(AttributeType))))
            value = draw(attribute_value(kind))
            if all(v is None or type(v) is not str or k.lower() not in ("int64", "bool", "float64")
                   for k, v in value.items()):
                entries.append({"key": name, "value": value})
        query[draw(odd_case("splitFilter"))] = entries
    if draw(st.booleans()):
        query["retrieveVectors"] = draw(st.booleans())
    return spec, json.dumps(query).encode()


@PROPERTY
@given(search_body())
def test_search_decoding_equals_the_dto_path(case: tuple[DataSourceSpec, bytes]) -> None:
    spec, body = case
    try:
        dto = SearchQueryDto.model_validate(json.loads(body))
    except pydantic.ValidationError:
        with pytest.raises(ValidationError):
            decode_search(body)
        return
    query = decode_search(body)
    assert (query.k, query.retrieve_vectors) == (dto.k, dto.retrieveVectors)
    old_kind, old = outcome(lambda: old_query_vectors(spec, dto.queryVectors))
    new_kind, new = outcome(lambda: query_vectors(spec, query))
    assert old_kind == new_kind
    if old_kind == "table":
        if isinstance(new, np.ndarray):
            np.testing.assert_array_equal(new, np.asarray(old, dtype=np.float32))
            assert new.dtype == np.float32 and new.flags.c_contiguous
        else:
            assert new == old
    else:
        assert new == old
    assert outcome(lambda: split_filter(spec, query)) == outcome(lambda: old_split_filter(spec, dto.splitFilter))


# -- search results -------------------------------------------------------------------------------------------

RESULT_SPEC = DataSourceSpec(
    "Results", "1", 3,
    {"id": "int64", "tag": "string", "score": "float64", "flag": "bool", "uid": "guid", "at": "datetime"}, ["id"],
)


def old_results(spec: DataSourceSpec, vectors: list[Any], results: list[Any]) -> bytes:
    """What the search routes answered: SearchResultDto through FastAPI's dump_json(by_alias, exclude_none)."""
    dtos = [SearchResultDto(queryVector=vector_dto(v), nearestDataPoints=[hit_dto(spec, h) for h in hits])
            for v, hits in zip(vectors, results, strict=True)]
    return _RESULTS.dump_json(_RESULTS.validate_python(dtos, from_attributes=True), by_alias=True, exclude_none=True)


def row_values(draw: st.DrawFn, kind: AttributeType, n: int) -> list[Any]:
    def one() -> Any:
        if draw(st.integers(0, 5)) == 0:
            return None  # left out of the hit's attributes
        if kind is AttributeType.INT64:
            return draw(st.integers(-(2**63), 2**63 - 1))
        if kind is AttributeType.FLOAT64:
            return draw(st.floats(allow_nan=False))
        if kind is AttributeType.BOOL:
            return draw(st.booleans())
        if kind is AttributeType.STRING:
            return draw(st.text(max_size=6))
        if kind is AttributeType.GUID:
            return str(draw(st.uuids()))
        return draw(st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31)))
    return [one() for _ in range(n)]


def source_table(draw: st.DrawFn, spec: DataSourceSpec, n: int) -> pa.Table:
    columns: dict[str, pa.Array] = {}
    if spec.vectors_are_sparse:
        indices = [sorted(draw(st.sets(st.integers(0, spec.vector_dimension - 1), max_size=3))) for _ in range(n)]
        columns[SPARSE_INDICES] = pa.array(indices, pa.list_(pa.int32()))
        columns[SPARSE_VALUES] = pa.array([draw(st.lists(st.floats(-10, 10, width=32), min_size=len(i),
                                                         max_size=len(i))) for i in indices], pa.list_(pa.float32()))
    else:
        flat = np.array(draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=3 * n, max_size=3 * n)), np.float32)
        columns[VECTOR] = pa.FixedSizeListArray.from_arrays(pa.array(flat), 3)
    for name, kind in spec.attribute_types.items():
        columns[name] = pa.array(row_values(draw, kind, n), ARROW_TYPES[kind])
    return pa.table(columns)


@st.composite
def search_results(draw: st.DrawFn) -> tuple[DataSourceSpec, SearchQuery, list[Any], bool]:
    sparse = draw(st.booleans())
    spec = RESULT_SPEC if not sparse else DataSourceSpec("R", "1", 3, RESULT_SPEC.attribute_types, ["id"],
                                                          vectors_are_sparse=True)
    n = draw(st.integers(1, 8))
    stored = tuple(draw(st.permutations(list(spec.attribute_types)))[: draw(st.integers(1, 6))])
    retrieve = draw(st.booleans())
    sources = tuple(RowSource(source_table(draw, spec, n), stored) for _ in range(draw(st.integers(1, 2))))
    vectors = []
    for _ in range(draw(st.integers(1, 3))):
        if sparse:
            idx = draw(st.lists(st.integers(0, 2), max_size=3, unique=True))
            vectors.append({"isSparse": True, "coordinates": draw(st.lists(st.floats(-5, 5) | st.integers(-5, 5),
                                                                            min_size=len(idx), max_size=len(idx))),
                            "coordinateIndices": idx})
        else:
            vectors.append({"coordinates": draw(st.lists(st.floats(-5, 5) | st.integers(-5, 5), min_size=3,
                                                         max_size=3))})
    query = decode_search(orjson.dumps({"k": 5, "queryVectors": vectors, "retrieveVectors": retrieve}))
    results: list[Any] = []
    for _ in vectors:
        k = draw(st.integers(0, 5))
        rows = draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k))
        distances = draw(st.lists(st.floats(allow_nan=False, width=32), min_size=k, max_size=k))
        style = draw(st.integers(0, 2))
        if style == 0 or len(sources) == 1:
            results.append(Hits(rows, distances, sources[:1], None, retrieve))
        elif style == 1:
            owners = draw(st.lists(st.integers(0, len(sources) - 1), min_size=k, max_size=k))
            results.append(Hits(rows, distances, sources, owners, retrieve))
        else:
            results.append(list(Hits(rows, distances, sources[:1], None, retrieve)))  # plain Hit objects
    return spec, query, results, retrieve


@PROPERTY
@given(search_results())
def test_encode_search_results_writes_the_bytes_pydantic_wrote(case: tuple[DataSourceSpec, SearchQuery, list[Any],
                                                                            bool]) -> None:
    spec, query, results, retrieve = case
    old_vectors = old_query_vectors(spec, SearchQueryDto.model_validate({"k": 1, "queryVectors": query.query_vectors})
                                    .queryVectors)
    expected = old_results(spec, old_vectors, results)
    assert encode_search_results(spec, query.query_vectors, results, retrieve) == expected
    # The decoded vectors (a float32 array for dense ones) echo their float32 values.
    decoded = query_vectors(spec, query)
    assert orjson.loads(encode_search_results(spec, decoded, results, retrieve)) == orjson.loads(
        old_results(spec, [np.asarray(v, np.float32).tolist() if not isinstance(v, SparseVector) else v
                           for v in old_vectors], results))


def test_search_results_as_the_quick_start_shows_them() -> None:
    table = pa.table({
        VECTOR: pa.FixedSizeListArray.from_arrays(pa.array(np.array([0, 1, 0, 1, 0, 0], np.float32)), 3),
        "id": pa.array([1, 2]), "tag": pa.array(["first", None]), "score": pa.array([0.5, 2.0]),
        "flag": pa.array([True, False]), "uid": pa.array([str(uuid.UUID(int=7))] * 2),
        "at": pa.array([dt.datetime(2024, 1, 2, 3, 4, 5), dt.datetime(2024, 1, 2, 3, 4, 5, 500000)],
                       pa.timestamp("us", tz="UTC")),
    })
    source = RowSource(table, ("id", "tag", "score", "flag", "uid", "at"))
    query = decode_search(b'{"k": 2, "queryVectors": [{"coordinates": [0, 2, 0.1]}], "retrieveVectors": true}')
    out = orjson.loads(encode_search_results(RESULT_SPEC, query.query_vectors,
                                             [Hits([0, 1], [1.0, 4.25], (source,), None, True)], True))
    [result] = out
    assert result["queryVector"] == {"isSparse": False, "coordinates": [0.0, 2.0, 0.1]}
    first, second = result["nearestDataPoints"]
    assert list(first) == ["vector", "attributes", "distance"]
    assert first["vector"] == {"isSparse": False, "coordinates": [0.0, 1.0, 0.0]}
    assert first["attributes"] == [
        {"key": "id", "value": {"int64": 1}}, {"key": "tag", "value": {"string": "first"}},
        {"key": "score", "value": {"float64": 0.5}}, {"key": "flag", "value": {"bool": True}},
        {"key": "uid", "value": {"guid": "00000000-0000-0000-0000-000000000007"}},
        {"key": "at", "value": {"dateTime": "2024-01-02T03:04:05Z"}},
    ]
    assert [a["key"] for a in second["attributes"]] == ["id", "score", "flag", "uid", "at"]  # the null tag left out
    assert second["attributes"][-1]["value"]["dateTime"] == "2024-01-02T03:04:05.500000Z"
    assert second["distance"] == 4.25
    without = orjson.loads(encode_search_results(RESULT_SPEC, query.query_vectors,
                                                 [Hits([0], [1.0], (source,), None, False)], False))
    assert list(without[0]["nearestDataPoints"][0]) == ["attributes", "distance"]


def test_hits_without_sources_and_plain_hit_lists() -> None:
    assert encode_search_results(RESULT_SPEC, [[1.0, 2.0, 3.0]], [Hits([], [], ())], False) == (
        b'[{"queryVector":{"isSparse":false,"coordinates":[1.0,2.0,3.0]},"nearestDataPoints":[]}]'
    )
    hits = [Hit({"id": 3, "tag": None}, 0.5, SparseVector([1], [2.0]))]
    assert orjson.loads(encode_search_results(RESULT_SPEC, [SparseVector([0], [1])], [hits], True)) == [{
        "queryVector": {"isSparse": True, "coordinates": [1.0], "coordinateIndices": [0]},
        "nearestDataPoints": [{"vector": {"isSparse": True, "coordinates": [2.0], "coordinateIndices": [1]},
                               "attributes": [{"key": "id", "value": {"int64": 3}}], "distance": 0.5}],
    }]
