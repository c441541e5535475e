"""Exact search over sparse vectors (algorithm `flat_sparse`, Vektonn's SparnnIndex); every metric.

A separate algorithm rather than a flag on `flat`, because whether an engine takes dense or sparse vectors is
fixed per class (`Engine.sparse`), which index validation checks against the data source. Each query costs
O(nnz) with float64 accumulation and the same formulas as `exact_distances`, so results equal the reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

import numpy as np

from shoal.engines.base import Engine, register
from shoal.engines.envelope import array_section
from shoal.engines.metrics import Metric, from_products, sort_keys, top_k_of
from shoal.engines.sparse import SparseRows


@register
class FlatSparseEngine(Engine):
    """Exact kNN over SparseRows."""

    algorithm = "flat_sparse"
    supported_metrics = frozenset(Metric)
    sparse = True

    def __init__(self, rows: SparseRows, metric: Metric, params: dict[str, Any]) -> None:
        super().__init__(metric, params, rows.dim, len(rows))
        self._rows = rows
        self._sq_norms = rows.squared_norms() if metric is not Metric.MANHATTAN else None

    @classmethod
    def _build(cls, vectors: SparseRows, metric: Metric, params: dict[str, Any], threads: int) -> Self:
        return cls(vectors, metric, params)

    def _sections(self) -> list[bytes | memoryview]:
        r = self._rows
        return [array_section(r.indptr, "<i8"), array_section(r.indices, "<i4"), array_section(r.values, "<f4")]

    @classmethod
    def _load(cls, header: dict[str, Any], sections: list[memoryview], metric: Metric, params: dict[str, Any]) -> Self:
        indptr, indices, values = (
            np.frombuffer(s, dtype=t) for s, t in zip(sections, ("<i8", "<i4", "<f4"), strict=True)
        )
        return cls(SparseRows(indptr, indices, values, int(header["dim"])), metric, params)

    def _distances(self, q_indices: np.ndarray, q_values: np.ndarray) -> np.ndarray:
        if self.metric is Metric.MANHATTAN:
            return self._rows.l1_distances(q_indices, q_values)
        qv = q_values.astype(np.float64)
        return from_products(self.metric, self._rows.dot(q_indices, q_values), np.dot(qv, qv), self._sq_norms)

    def _search(
        self, queries: SparseRows, k: int, threads: int, params: Mapping[str, int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        out_d = np.empty((len(queries), k), dtype=np.float32)
        out_l = np.empty((len(queries), k), dtype=np.int64)
        for i in range(len(queries)):
            dist = self._distances(*queries.row(i))
            keys = sort_keys(self.metric, dist)
            # Only rows at most as far as the k-th nearest can be in the answer; keeping every row tied
            # with it lets the label tie-break pick the lowest labels, as the reference does.
            kth = np.partition(keys, k - 1)[k - 1]
            cand = np.flatnonzero(keys <= kth)
            d, lab = top_k_of(self.metric, dist[cand][None, :], cand[None, :], k)
            out_d[i], out_l[i] = d[0], lab[0]
        return out_d, out_l
