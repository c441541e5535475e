"""Vektonn's JSON search query (SearchQueryDto) read with orjson, and its values checked against the data source:
the query vectors as the searcher takes them, the split filter as {attribute: value}.

The JSON types are checked as the pydantic DTO checked them (shoal.vektonn.json_fields, keys in any case; `k` and
int64 or float64 values may be written as decimal strings, as Vektonn reads them); the values as the former
conversion checked them, with the same problems (and, for the search routes, Vektonn's rule that a sparse query
vector has a coordinate).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from shoal.errors import Problem, ValidationError
from shoal.log.records import DataSourceSpec
from shoal.log.validation import to_float32, unfit_rows
from shoal.vektonn.json_fields import (
    attributes_dict,
    canon,
    integer_text,
    jtype,
    load,
    read_entry,
    read_vector,
    shape_body,
    stdlib_loads,
    vector_value,
    wrong_number,
)

_BEYOND_INT64 = 2.0**63  # orjson reads integers from here on as floats


@dataclass(frozen=True)
class SearchQuery:
    """Vektonn's SearchQueryDto with its JSON types checked. Query vectors are canonical dicts
    `{"isSparse", "coordinates" (floats), "coordinateIndices" (ints or None)}`; split filter entries are
    `{"key", "value": {slot: value}}` with guids as uuid.UUID and dateTimes as datetime, as the DTO held them."""

    k: int
    query_vectors: list[dict[str, Any]]
    split_filter: list[dict[str, Any]] | None
    retrieve_vectors: bool = False
    # Shoal's extension: an attribute filter (shoal.searcher.filters) as JSON, or None when not sent.
    filter: dict[str, Any] | None = None


def decode_search(body: bytes, max_vectors: int | None = None) -> SearchQuery:
    """Vektonn's SearchQueryDto (`k`, `queryVectors`, `splitFilter`, `retrieveVectors`; keys in any case), plus
    Shoal's optional `filter` (attribute filters, shoal.searcher.filters), with
    its JSON types checked; ValidationError naming the field otherwise, and naming SHOAL_MAX_QUERY_VECTORS
    when the query holds more than `max_vectors` vectors (refused before any of them is read). Values are
    checked against the data source by query_vectors() and split_filter(); that k is positive is left to the
    caller, as before."""
    loaded = load(body, ValidationError)
    query = shape_body(body, loaded, partial(_search_shape, max_vectors=max_vectors))
    assert query is not None  # _search_shape gives None only with problems, which shape_body raises
    if query.filter is not None and not loaded[1] and _holds_wide_float(query.filter):
        # orjson reads an integer past 64 bits as a float: the filter as Python's json reads it, so such an
        # operand is judged as the integer it is ("out of range"), not as a float ("got float").
        again = _search_shape(stdlib_loads(body), max_vectors)[0]
        if again is not None:
            query = dataclasses.replace(query, filter=again.filter)
    return query


def _holds_wide_float(value: Any) -> bool:
    """True when `value` (parsed JSON) holds a float of magnitude 2^63 or more anywhere (walked without
    recursion: a filter may nest deeper than the parser allows, which the searcher refuses by name)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is float and not -_BEYOND_INT64 < item < _BEYOND_INT64:
            return True
        if type(item) is dict:
            stack.extend(item.values())
        elif type(item) is list:
            stack.extend(item)
    return False


def _search_shape(raw: Any, max_vectors: int | None = None) -> tuple[SearchQuery | None, list[Problem]]:
    """The query with its fields' JSON types checked, or None and the problems found."""
    if type(raw) is not dict:
        return None, [Problem(f"a search query must be a JSON object, got {jtype(raw)}")]
    query = canon(raw)
    problems: list[Problem] = []
    k = query.get("k")
    if type(k) is str and (number := integer_text(k)) is not None:
        k = number  # Vektonn reads numbers from JSON strings too ("k": "2")
    if k is None:
        problems.append(Problem("a search query needs k", attribute="k"))
    elif type(k) is not int:
        problems.append(Problem(wrong_number("k", "integer", k), attribute="k"))
    vectors: list[dict[str, Any]] = []
    raw_vectors = query.get("queryVectors")
    if type(raw_vectors) is list and max_vectors is not None and len(raw_vectors) > max_vectors:
        # A search's cost grows with its query vectors: refuse a batch of them before reading one.
        return None, [Problem(f"a search may carry at most {max_vectors} query vectors (SHOAL_MAX_QUERY_VECTORS), "
                              f"got {len(raw_vectors)}", attribute="queryVectors")]
    if raw_vectors is None:
        problems.append(Problem("a search query needs queryVectors", attribute="queryVectors"))
    elif type(raw_vectors) is not list:
        problems.append(Problem(f"queryVectors must be a JSON array of vectors, got {jtype(raw_vectors)}",
                                attribute="queryVectors"))
    else:
        for i, raw_vector in enumerate(raw_vectors):
            vector = read_vector(raw_vector, i, "queryVectors", problems)
            if vector is not None:
                vectors.append({"isSparse": vector[0], "coordinates": vector[1], "coordinateIndices": vector[2]})
    split: list[dict[str, Any]] | None = None
    raw_split = query.get("splitFilter")
    if raw_split is not None:
        if type(raw_split) is not list:
            problems.append(Problem(f"splitFilter must be a JSON array of attributes, got {jtype(raw_split)}",
                                    attribute="splitFilter"))
        else:
            split = []
            for raw_entry in raw_split:
                entry = read_entry(raw_entry, None, "splitFilter", problems)
                if entry is not None:
                    split.append({"key": entry[0], "value": {entry[1]: entry[2]}})
    retrieve = query.get("retrieveVectors", False)
    if type(retrieve) is not bool:
        problems.append(Problem(f"retrieveVectors must be a JSON boolean, got {jtype(retrieve)}",
                                attribute="retrieveVectors"))
    # `filter` is Shoal's, not Vektonn's: read only when sent (under any key case), so Vektonn's bodies
    # read exactly as before. Its content is checked against the data source by the searcher.
    raw_filter = next((v for key, v in query.items() if key.lower() == "filter"), None)
    if raw_filter is not None and type(raw_filter) is not dict:
        problems.append(Problem(f"filter must be a JSON object, got {jtype(raw_filter)}", attribute="filter"))
    if problems:
        return None, problems
    assert isinstance(k, int)
    return SearchQuery(k, vectors, split, retrieve is True, raw_filter), []


def query_vectors(spec: DataSourceSpec, query: SearchQuery, *, empty_sparse: bool = True) -> list[Any] | np.ndarray:
    """The query vectors as the searcher takes them: dense ones as one float32 [n, dim] array when they have
    one length (else the list, which the searcher refuses by name), sparse ones as SparseVectors. ValidationError
    with the former query_vectors's problems (attribute `queryVectors`) when one is of the wrong kind.
    `empty_sparse=False` refuses a sparse query vector without coordinates, as Vektonn does (the search routes);
    by default it is the all-zero query the searcher takes from Python, as decode_upload's default is."""
    problems: list[Problem] = []
    out: list[Any] = []
    for i, vector in enumerate(query.query_vectors):
        triple = (vector["isSparse"], vector["coordinates"], vector["coordinateIndices"])
        out.append(vector_value(spec, triple, i, "queryVectors", problems, empty_sparse=empty_sparse))
    if problems:
        raise ValidationError(problems)
    if not spec.vectors_are_sparse and out and len(set(map(len, out))) == 1:
        # Through float64, as np.asarray(list of floats, float32) rounds them in the searcher. With a double
        # beyond float32's range, or a vector past the norm bound, the float64 rows go on: the searcher names
        # the problem (the float32 cast would only show an infinity).
        given = np.array(out, dtype=np.float64)
        vectors = to_float32(given)
        return given if unfit_rows(vectors).size else vectors
    return out


def split_filter(spec: DataSourceSpec, query: SearchQuery) -> dict[str, Any] | None:
    """The split filter as {attribute: value} (None when absent or empty), with the former split_filter's rules."""
    if not query.split_filter:
        return None
    entries = [(e["key"], *next(iter(e["value"].items()))) for e in query.split_filter]
    problems: list[Problem] = []
    out = attributes_dict(spec, entries, None, problems)
    if problems:
        raise ValidationError(problems)
    return out
