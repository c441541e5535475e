"""The JSON the search routes answer (a list of SearchResultDto), written with orjson straight from the searcher's
hits: the bytes pydantic wrote (same keys, order and values), without a DTO per hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from shoal.log.records import DataSourceSpec, SparseVector
from shoal.log.validation import VECTOR
from shoal.searcher.hits import Hit, Hits
from shoal.vektonn.json_fields import SLOT


def encode_search_results(
    spec: DataSourceSpec, query_vectors: Sequence[Any] | np.ndarray, results: Sequence[Sequence[Hit]],
    retrieve_vectors: bool,
) -> bytes:
    """The JSON the search routes answer: a list of SearchResultDto with null fields left out, as pydantic wrote
    it (same keys, order and values; floats and datetimes as pydantic's JSON writes them).

    `query_vectors` are echoed as each result's queryVector: pass `SearchQuery.query_vectors` to echo them
    exactly as sent (a float32 array echoes the float32 values). Hit vectors are written only with
    `retrieve_vectors`.
    """
    out = [
        {"queryVector": _vector_json(query), "nearestDataPoints": _found(spec, hits, retrieve_vectors)}
        for query, hits in zip(query_vectors, results, strict=True)
    ]
    # OPT_UTC_Z: pydantic writes a UTC datetime with "Z", orjson would write "+00:00".
    return orjson.dumps(out, option=orjson.OPT_UTC_Z | orjson.OPT_SERIALIZE_NUMPY)


def _found(spec: DataSourceSpec, hits: Sequence[Hit], retrieve_vectors: bool) -> list[dict[str, Any]]:
    """FoundDataPointDto of each hit: `vector` (when retrieved), `attributes` without null values, `distance`."""
    n = len(hits)
    if n == 0:
        return []
    types = spec.attribute_types
    by_column = _hit_columns(hits)
    if by_column is not None:
        names, columns = by_column
        distances = list(map(float, hits.distances))  # type: ignore[attr-defined]
        per_hit: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        for name, column in zip(names, columns, strict=True):
            slot = SLOT[types[name]]
            for attributes, value in zip(per_hit, column, strict=True):
                if value is not None:
                    attributes.append({"key": name, "value": {slot: value}})
    else:
        hit_list = list(hits)
        distances = [float(h.distance) for h in hit_list]
        per_hit = [
            [{"key": k, "value": {SLOT[types[k]]: v}} for k, v in h.attributes.items() if v is not None]
            for h in hit_list
        ]
    if retrieve_vectors:
        vectors = _dense_hit_vectors(hits)
        if vectors is None:
            vectors = [h.vector for h in hits]
        return [
            {"vector": _vector_json(v), "attributes": a, "distance": d} if v is not None else
            {"attributes": a, "distance": d}
            for v, a, d in zip(vectors, per_hit, distances, strict=True)
        ]
    return [{"attributes": a, "distance": d} for a, d in zip(per_hit, distances, strict=True)]


def _hit_columns(hits: Sequence[Hit]) -> tuple[tuple[str, ...], list[list[Any]]] | None:
    """The carried attributes of every hit, one list per attribute in the order each Hit's dict has them, read
    column-wise without making Hit objects; None when that order cannot be known (then Hit objects are read).

    Hits exposes column() but not which attributes it carries in what order; that is its sources' `stored`,
    read here defensively so a change in Hits' internals only costs speed.
    """
    if not isinstance(hits, Hits):
        return None
    sources = getattr(hits, "_sources", None)
    if not sources:
        return None
    stored = getattr(sources[0], "stored", None)
    if not stored or any(getattr(s, "stored", None) != stored for s in sources[1:]):
        return None
    try:
        return stored, [hits.column(name) for name in stored]
    except KeyError:
        return None


def _dense_hit_vectors(hits: Sequence[Hit]) -> list[Any] | None:
    """The dense vector of every hit as a float64 row (orjson writes those as it writes floats, without a Python
    float per coordinate), taken column-wise from the rows the hits point into; None when the hits do not
    show those rows (then Hit objects are read)."""
    if not isinstance(hits, Hits):
        return None
    sources = getattr(hits, "_sources", None)
    owners = getattr(hits, "_owners", None)
    if not sources:
        return None
    rows = hits.rows
    if owners is None:  # every hit is a row of the first source
        groups = [(sources[0], list(range(len(rows))))]
    else:
        groups = [(source, [i for i, owner in enumerate(owners) if owner == o]) for o, source in enumerate(sources)]
    out: list[Any] = [None] * len(rows)
    for source, where in groups:
        if not where:
            continue
        table = getattr(source, "table", None)
        if not isinstance(table, pa.Table) or VECTOR not in table.column_names:
            return None
        picked = table[VECTOR].take([rows[i] for i in where]).combine_chunks()
        if not pa.types.is_fixed_size_list(picked.type) or picked.null_count:
            return None
        matrix = picked.flatten().to_numpy(zero_copy_only=False).astype(np.float64).reshape(len(where), -1)
        for i, row in zip(where, matrix, strict=True):
            out[i] = row
    return out


def _vector_json(vector: Any) -> dict[str, Any]:
    """A VectorDto as pydantic wrote it: coordinates as floats, coordinateIndices only for sparse vectors."""
    if isinstance(vector, dict):
        if vector["isSparse"]:
            return {"isSparse": True, "coordinates": list(map(float, vector["coordinates"])),
                    "coordinateIndices": list(map(int, vector["coordinateIndices"]))}
        coordinates = vector["coordinates"]
        if isinstance(coordinates, np.ndarray) and coordinates.dtype == np.float64:
            # orjson writes a float64 array as it writes the same Python floats, in C.
            return {"isSparse": False, "coordinates": coordinates}
        return {"isSparse": False, "coordinates": list(map(float, coordinates))}
    if isinstance(vector, SparseVector):
        return {"isSparse": True, "coordinates": list(map(float, vector.values)),
                "coordinateIndices": list(map(int, vector.indices))}
    if isinstance(vector, np.ndarray):
        # float64, not float32: orjson writes a float32 with float32's shortest digits, pydantic wrote the double.
        return {"isSparse": False, "coordinates": np.ascontiguousarray(vector, dtype=np.float64).reshape(-1)}
    return {"isSparse": False, "coordinates": list(map(float, vector))}
