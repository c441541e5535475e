"""Sparse vectors as CSR rows (no scipy): storage, slicing and the products the sparse metrics need.

Rows are canonical: within a row the indices are strictly increasing, so a row never names a dimension twice.
All products accumulate in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shoal.errors import ValidationError

# Above this dimension a query is not scattered into a dense float64 array (8 bytes per dimension);
# its coordinates are looked up by binary search instead.
_DENSE_QUERY_MAX_DIM = 1 << 22
# Cells of the (rows x query coordinates) mask `missing_sums` fills per block.
_MISSING_BLOCK = 1 << 20


@dataclass(frozen=True, eq=False)
class SparseRows:
    """n sparse vectors of dimension `dim` in CSR form: row i is indices/values[indptr[i]:indptr[i+1]]."""

    indptr: np.ndarray  # int64 [n + 1], indptr[0] == 0, non-decreasing
    indices: np.ndarray  # int32 [nnz], strictly increasing within a row, each in [0, dim)
    values: np.ndarray  # float32 [nnz], finite
    dim: int

    def __post_init__(self) -> None:
        indptr = np.ascontiguousarray(self.indptr, dtype=np.int64)
        indices = np.ascontiguousarray(self.indices, dtype=np.int32)
        values = np.ascontiguousarray(self.values, dtype=np.float32)
        object.__setattr__(self, "indptr", indptr)
        object.__setattr__(self, "indices", indices)
        object.__setattr__(self, "values", values)
        if isinstance(self.dim, bool) or not isinstance(self.dim, int | np.integer) or self.dim < 1:
            raise ValidationError(f"sparse dimension must be a positive integer (got {self.dim!r})")
        object.__setattr__(self, "dim", int(self.dim))
        if indptr.ndim != 1 or len(indptr) < 1 or indptr[0] != 0 or np.any(np.diff(indptr) < 0):
            raise ValidationError("sparse indptr must start at 0 and never decrease")
        if indices.shape != (indptr[-1],) or values.shape != (indptr[-1],):
            raise ValidationError("sparse indices and values must both hold indptr[-1] entries")
        if len(indices) and (indices.min() < 0 or indices.max() >= self.dim):
            raise ValidationError(f"sparse indices must lie in [0, {self.dim})")
        if not np.isfinite(values).all():
            raise ValidationError("sparse values must be finite")
        # Strictly increasing within each row: a step that is not positive is allowed only at a row start.
        steps_ok = np.diff(indices) > 0
        row_start = np.zeros(len(indices), dtype=bool)
        row_start[indptr[:-1][indptr[:-1] < len(indices)]] = True
        if not np.all(steps_ok | row_start[1:]):
            raise ValidationError("sparse indices must be unique and sorted within each row")

    @classmethod
    def from_lists(cls, indices: Sequence[Sequence[int]], values: Sequence[Sequence[float]], dim: int) -> SparseRows:
        """Rows from per-row index and value lists (any order inside a row); duplicates raise ValidationError."""
        if len(indices) != len(values):
            raise ValidationError("sparse rows need as many value lists as index lists")
        lengths = np.fromiter((len(r) for r in indices), dtype=np.int64, count=len(indices))
        value_lengths = np.fromiter((len(r) for r in values), dtype=np.int64, count=len(values))
        if not np.array_equal(lengths, value_lengths):
            bad = int(np.flatnonzero(lengths != value_lengths)[0])
            raise ValidationError(f"sparse row {bad} has {lengths[bad]} indices but {value_lengths[bad]} values")
        indptr = np.zeros(len(indices) + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])
        flat_idx = np.array([i for row in indices for i in row], dtype=np.int64)
        flat_val = np.array([v for row in values for v in row], dtype=np.float64)
        if len(flat_idx) and (flat_idx.min() < 0 or flat_idx.max() >= dim):
            raise ValidationError(f"sparse indices must lie in [0, {dim})")
        # Sort within rows (row id is the primary key, so rows keep their place).
        order = np.lexsort((flat_idx, np.repeat(np.arange(len(indices)), lengths)))
        return cls(indptr, flat_idx[order], flat_val[order], dim)

    @classmethod
    def from_dense(cls, dense: np.ndarray) -> SparseRows:
        """Rows holding the non-zero coordinates of a dense [n, dim] array."""
        dense = np.asarray(dense)
        if dense.ndim != 2:
            raise ValidationError("a dense matrix to sparsify must be two-dimensional")
        rows, cols = np.nonzero(dense)
        indptr = np.zeros(dense.shape[0] + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=dense.shape[0]), out=indptr[1:])
        return cls(indptr, cols, dense[rows, cols], int(dense.shape[1]))

    def __len__(self) -> int:
        return len(self.indptr) - 1

    @property
    def nnz(self) -> int:
        """Number of stored coordinates."""
        return int(self.indptr[-1])

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Row i as (indices, values) views."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        i %= len(self)
        a, b = self.indptr[i], self.indptr[i + 1]
        return self.indices[a:b], self.values[a:b]

    def to_dense(self) -> np.ndarray:
        """The rows as a dense float32 [n, dim] array (tests and small data only)."""
        out = np.zeros((len(self), self.dim), dtype=np.float32)
        out[self.row_ids(), self.indices] = self.values
        return out

    def take(self, rows: slice | Sequence[int] | np.ndarray) -> SparseRows:
        """The selected rows, in the given order (a step-1 slice shares memory with self)."""
        if isinstance(rows, slice):
            start, stop, step = rows.indices(len(self))
            if step == 1:
                stop = max(start, stop)
                a, b = self.indptr[start], self.indptr[stop]
                return SparseRows(self.indptr[start : stop + 1] - a, self.indices[a:b], self.values[a:b], self.dim)
            rows = np.arange(start, stop, step)
        sel = np.asarray(rows, dtype=np.int64)
        if sel.ndim != 1:
            raise ValidationError("rows to take must be a one-dimensional index list")
        if len(sel) and (sel.min() < -len(self) or sel.max() >= len(self)):
            raise IndexError(f"row index out of range for {len(self)} rows")
        sel = np.where(sel < 0, sel + len(self), sel)  # never in place: `sel` may be the caller's array
        starts, lengths = self.indptr[sel], self.indptr[sel + 1] - self.indptr[sel]
        indptr = np.zeros(len(sel) + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])
        # Position of every taken entry in the source arrays: its row's start plus its offset in the row.
        src = np.repeat(starts - indptr[:-1], lengths) + np.arange(indptr[-1])
        return SparseRows(indptr, self.indices[src], self.values[src], self.dim)

    def row_ids(self) -> np.ndarray:
        """The row of every stored coordinate (int64 [nnz])."""
        return np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.indptr))

    def segment_sums(self, per_entry: np.ndarray) -> np.ndarray:
        """Per-row sums of a float64 value per stored coordinate; empty rows sum to 0."""
        out = np.zeros(len(self), dtype=np.float64)
        nonempty = self.indptr[1:] > self.indptr[:-1]
        if nonempty.any():
            # reduceat over the starts of non-empty rows only: an empty row would otherwise yield the next
            # row's first value, and consecutive non-empty starts delimit exactly one row's entries.
            out[nonempty] = np.add.reduceat(per_entry, self.indptr[:-1][nonempty])
        return out

    def squared_norms(self) -> np.ndarray:
        """Squared L2 norm of every row (float64 [n])."""
        v = self.values.astype(np.float64)
        return self.segment_sums(v * v)

    def l1_norms(self) -> np.ndarray:
        """L1 norm of every row (float64 [n])."""
        return self.segment_sums(np.abs(self.values.astype(np.float64)))

    def gather(self, q_indices: np.ndarray, q_values: np.ndarray) -> np.ndarray:
        """The query's coordinate at each stored index (float64 [nnz]); the query is one sparse row."""
        q_values = np.asarray(q_values, dtype=np.float64)
        if self.dim <= _DENSE_QUERY_MAX_DIM:
            dense = np.zeros(self.dim, dtype=np.float64)
            dense[q_indices] = q_values
            return dense[self.indices]
        if len(q_indices) == 0:
            return np.zeros(len(self.indices), dtype=np.float64)
        pos = np.minimum(np.searchsorted(q_indices, self.indices), len(q_indices) - 1)
        return np.where(q_indices[pos] == self.indices, q_values[pos], 0.0)

    def dot(self, q_indices: np.ndarray, q_values: np.ndarray) -> np.ndarray:
        """Inner product of every row with one sparse query (float64 [n])."""
        return self.segment_sums(self.values.astype(np.float64) * self.gather(q_indices, q_values))

    def missing_sums(self, q_indices: np.ndarray, per_query: np.ndarray) -> np.ndarray:
        """Per row (float64 [n]), the sum of `per_query` (one non-negative float64 per coordinate of the sorted
        query indices `q_indices`) over the query coordinates the row lacks, summed directly: the query's total
        less the row's share would lose a small remainder beside a large coordinate the row holds (|q|_1 = 1e18
        swallows a 60). Costs O(nnz) plus the query's length for each row sharing a coordinate with it."""
        out = np.full(len(self), float(per_query.sum()), dtype=np.float64)
        nq = len(q_indices)
        if nq == 0 or self.nnz == 0:
            return out
        pos = np.minimum(np.searchsorted(q_indices, self.indices), nq - 1)
        hit = q_indices[pos] == self.indices
        if not hit.any():
            return out
        touched, local = np.unique(self.row_ids()[hit], return_inverse=True)  # rows increasing, so `local` too
        pos = pos[hit]
        step = max(1, _MISSING_BLOCK // nq)
        for s in range(0, len(touched), step):
            a, b = np.searchsorted(local, [s, s + step])
            lacks = np.ones((min(step, len(touched) - s), nq), dtype=bool)
            lacks[local[a:b] - s, pos[a:b]] = False
            out[touched[s : s + step]] = np.where(lacks, per_query, 0.0).sum(axis=1)
        return out

    def l1_distances(self, q_indices: np.ndarray, q_values: np.ndarray) -> np.ndarray:
        """L1 distance of every row to one sparse query (float64 [n]), summed directly over the union of their
        coordinates: non-negative terms only, so each is within float64 rounding of the distance itself."""
        qg = self.gather(q_indices, q_values)
        q_abs = np.abs(np.asarray(q_values, dtype=np.float64))
        return (self.segment_sums(np.abs(self.values.astype(np.float64) - qg))
                + self.missing_sums(np.asarray(q_indices), q_abs))

    def sq_l2_distances(self, q_indices: np.ndarray, q_values: np.ndarray) -> np.ndarray:
        """Squared L2 distance of every row to one sparse query (float64 [n]), summed directly as `l1_distances`
        is (so a small distance beside large norms is kept, unlike |q|^2 + |v|^2 - 2 q.v)."""
        qg = self.gather(q_indices, q_values)
        q64 = np.asarray(q_values, dtype=np.float64)
        diff = self.values.astype(np.float64) - qg
        return self.segment_sums(diff * diff) + self.missing_sums(np.asarray(q_indices), q64 * q64)

    def l1_estimates(self, q_indices: np.ndarray, q_values: np.ndarray) -> np.ndarray:
        """L1 distances of every row to one sparse query (float64 [n]) from one O(nnz) pass: |q|_1 plus, over
        the row's entries, |v_k - q_k| - |q_k|. Exact only to a bound relative to |q|_1 + |v|_1
        (`metrics.rounding_bounds`): the exact searches choose candidates with it, then sum them directly."""
        qg = self.gather(q_indices, q_values)
        q_l1 = float(np.abs(np.asarray(q_values, dtype=np.float64)).sum())
        return q_l1 + self.segment_sums(np.abs(self.values.astype(np.float64) - qg) - np.abs(qg))
