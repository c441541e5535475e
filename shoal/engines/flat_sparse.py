"""Exact search over sparse vectors (algorithm `flat_sparse`, Vektonn's SparnnIndex); every metric.

A separate algorithm rather than a flag on `flat`, because whether an engine takes dense or sparse vectors is
fixed per class (`Engine.sparse`), which index validation checks against the data source. Each query costs
O(nnz) with float64 accumulation, plus a direct sum over the few rows that can be nearest
(`metrics.sparse_top_k`, which `exact_top_k` uses too), so results equal the reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

import numpy as np

from shoal.engines.base import Engine, register
from shoal.engines.envelope import array_section
from shoal.engines.metrics import Metric, sparse_top_k
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
        self._magnitudes = rows.l1_norms() if metric is Metric.MANHATTAN else rows.squared_norms()

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

    def _search(
        self, queries: SparseRows, k: int, threads: int, params: Mapping[str, int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        d, labels = sparse_top_k(self.metric, queries, self._rows, k, self._magnitudes)
        return d.astype(np.float32), labels
