"""The one interface every kNN engine offers, and the registry of engines by algorithm name.

An engine indexes the n vectors of one split of one immutable index segment; their labels are the row
positions 0..n-1. Engines are immutable once built, so one may serve searches from several threads.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Self, TypeVar

import numpy as np

from shoal.engines import envelope
from shoal.engines.metrics import Metric, as_metric, worst_distance
from shoal.engines.params import int_param, reject_unknown
from shoal.engines.sparse import SparseRows
from shoal.errors import ValidationError

Vectors = np.ndarray | SparseRows


def available_cores() -> int:
    """The number of cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _dense(what: str, data: Any, dim: int | None = None) -> np.ndarray:
    arr = np.asarray(data)
    if arr.ndim != 2 or arr.shape[1] < 1 or arr.dtype.kind not in "fiu":
        raise ValidationError(f"{what} must be a 2-d numeric array [rows, dim] with dim >= 1 (got {arr.shape})")
    if dim is not None and arr.shape[1] != dim:
        raise ValidationError(f"{what} have dimension {arr.shape[1]}, the index has {dim}")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    # min and max propagate NaN and expose inf without allocating an n x d mask.
    if arr.size and not (np.isfinite(arr.min()) and np.isfinite(arr.max())):
        raise ValidationError(f"{what} must be finite float32 values")
    return arr


def _sparse(what: str, data: Any, dim: int | None = None) -> SparseRows:
    if not isinstance(data, SparseRows):
        raise ValidationError(f"{what} must be SparseRows for a sparse algorithm (got {type(data).__name__})")
    if dim is not None and data.dim != dim:
        raise ValidationError(f"{what} have dimension {data.dim}, the index has {dim}")
    return data


class Engine(ABC):
    """A kNN index over n vectors: build, search, serialize. Subclasses implement the underscored hooks."""

    algorithm: ClassVar[str]
    supported_metrics: ClassVar[frozenset[Metric]]
    sparse: ClassVar[bool] = False
    # Whether `_search` may return label -1 (fewer than k found, e.g. IVF probing few lists); an engine that
    # never does says False and skips the masking pass.
    may_miss: ClassVar[bool] = True
    # Parameters a single search may override (name -> inclusive integer range), e.g. HNSW's ef_search.
    search_params: ClassVar[dict[str, tuple[int, int]]] = {}
    # Whether `extend_bytes` can add rows to a built engine (else callers build anew over all the rows).
    extends: ClassVar[bool] = False

    def __init__(self, metric: Metric, params: dict[str, Any], dim: int, count: int) -> None:
        self.metric = metric
        self._params = dict(params)
        self.dim = dim
        self._count = count

    @property
    def params(self) -> dict[str, Any]:
        """The effective parameters (defaults filled, values fitted to the data); a copy: engines are immutable."""
        return dict(self._params)

    # ---- parameters and metrics -------------------------------------------------------------------------

    @classmethod
    def normalize_params(cls, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """The parameters with defaults filled in; unknown keys or bad values raise ValidationError.

        Idempotent: normalizing normalized parameters returns them unchanged. The base takes no parameters.
        """
        reject_unknown(cls.algorithm, params or {}, ())
        return {}

    @classmethod
    def check_metric(cls, metric: Metric | str) -> Metric:
        """The metric, if this algorithm supports it; otherwise ValidationError (never a silent fallback)."""
        m = as_metric(metric)
        if m not in cls.supported_metrics:
            supported = ", ".join(sorted(x.value for x in cls.supported_metrics))
            raise ValidationError(
                f"algorithm {cls.algorithm!r} does not support metric {m.value!r} (supported: {supported})"
            )
        return m

    @classmethod
    def check_search_params(cls, params: Mapping[str, Any] | None) -> dict[str, int] | None:
        """Per-search parameter overrides, checked: None or {} gives None (the index's own); an unknown name or
        a value out of range raises ValidationError naming it, and so does anything but a mapping of name to
        value (a list of pairs, a bare name)."""
        if params is None:
            return None
        if not isinstance(params, Mapping):
            raise ValidationError(
                f"search_params must be a mapping of parameter name to value, e.g. {{'ef_search': 64}} "
                f"(got {type(params).__name__} {params!r:.100})"
            )
        if not params:
            return None
        known, checked = cls.search_params, {}
        for name, value in params.items():
            limits = known.get(name)
            if limits is None or type(value) is not int or not limits[0] <= value <= limits[1]:
                break  # the slow path below names what is wrong
            checked[name] = value
        else:
            return checked  # every value a plain int in range: the usual call, checked per search
        named = [name for name in params if not isinstance(name, str)]
        if named:  # sorted() below cannot order an int among strings: name what is wrong instead
            raise ValidationError(f"search_params keys must be parameter names (strings), got {named[0]!r:.100}")
        unknown = sorted(set(params) - set(cls.search_params))
        if unknown:
            accepted = ", ".join(sorted(cls.search_params)) or "none"
            raise ValidationError(
                f"algorithm {cls.algorithm!r} takes no search parameter(s) {', '.join(map(repr, unknown))} "
                f"(accepted: {accepted})"
            )
        return {name: int_param(name, value, *cls.search_params[name]) for name, value in params.items()}

    # ---- building and searching -------------------------------------------------------------------------

    @classmethod
    def build(
        cls, vectors: Vectors, metric: Metric | str, params: Mapping[str, Any] | None, *, threads: int | None = None
    ) -> Self:
        """An engine over `vectors` (float32 [n, d], or SparseRows for sparse engines; n may be 0).

        `threads` bounds the cores used while building; None means every core this process may use.
        """
        m = cls.check_metric(metric)
        p = cls.normalize_params(params)
        data = _sparse("vectors", vectors) if cls.sparse else _dense("vectors", vectors)
        return cls._build(data, m, p, max(1, threads or available_cores()))

    def search(
        self,
        queries: Vectors,
        k: int,
        *,
        threads: int = 1,
        checked: bool = False,
        params: Mapping[str, int] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The k nearest rows of each query: (distances float32 [q, k], labels int64 [q, k]).

        Nearest first in the metric's own distance (dot_product: decreasing score, others increasing), so
        results of several engines merge by distance. Missing results have label -1 and the metric's worst
        distance (+inf, or -inf for dot_product). `threads` bounds the cores used by this call (the searcher
        parallelises across segments, hence 1 by default); the flat engines use numpy's BLAS threads.
        `checked`: the caller already made `queries` what `_dense`/`_sparse` return, with this dimension
        (the searcher does, once per search, in prepare_queries); skips checking them again per engine.
        `params`: overrides of query-time parameters for this call, as `check_search_params` returns them.
        """
        if type(k) is not int or k < 0:  # the exact-type test first: this runs once per query and segment
            if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0:
                raise ValidationError(f"k must be a non-negative integer (got {k!r})")
            k = int(k)
        if checked:
            q = queries
        else:
            q = _sparse("queries", queries, self.dim) if self.sparse else _dense("queries", queries, self.dim)
        k_eff = min(k, len(self))
        if not (len(q) and k_eff):
            return (np.full((len(q), k), worst_distance(self.metric), dtype=np.float32),
                    np.full((len(q), k), -1, dtype=np.int64))
        d, lab = self._search(q, k_eff, max(1, int(threads)), params)
        if k_eff == k and not self.may_miss:
            return d, lab  # the common case of HNSW: nothing to pad or mask, no copies (runs once per query)
        missing = lab < 0
        if k_eff == k:
            return (np.where(missing, worst_distance(self.metric), d).astype(np.float32) if missing.any() else d), lab
        distances = np.full((len(q), k), worst_distance(self.metric), dtype=np.float32)
        labels = np.full((len(q), k), -1, dtype=np.int64)
        distances[:, :k_eff] = np.where(missing, worst_distance(self.metric), d)
        labels[:, :k_eff] = lab
        return distances, labels

    def search_lists(
        self, queries: Vectors, k: int, params: Mapping[str, int] | None = None
    ) -> tuple[list[list[float]], list[list[int]]]:
        """`search` of checked queries (as `_dense`/`_sparse` return them) as Python lists per query, nearest
        first, with missing results dropped rather than padded: the form search results are built from."""
        distances, labels = self.search(queries, min(k, len(self)), checked=True, params=params)
        d_rows, l_rows = distances.tolist(), labels.tolist()
        if self.may_miss:
            for i, row in enumerate(l_rows):
                if row and min(row) < 0:
                    kept = [j for j, label in enumerate(row) if label >= 0]
                    d_rows[i], l_rows[i] = [d_rows[i][j] for j in kept], [row[j] for j in kept]
        return d_rows, l_rows

    def search_one(
        self, query: Any, k: int, params: Mapping[str, int] | None = None
    ) -> tuple[list[float], list[int]] | None:
        """An optional shortcut for the commonest search, one query as the caller gave it (unchecked): its k
        nearest rows as (distances, labels) lists, or None where the shortcut does not apply (the caller then
        checks the query and calls `search_lists`). A query with NaN or inf raises ValidationError."""
        return None

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.algorithm}/{self.metric.value} n={len(self)} dim={self.dim}>"

    # ---- serialization ----------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The engine as bytes that `from_bytes` restores to identical search results."""
        header = {
            "algorithm": self.algorithm,
            "metric": self.metric.value,
            "dim": self.dim,
            "count": len(self),
            "params": self._params,
            **self._header(),
        }
        return envelope.pack(header, self._sections())

    @classmethod
    def from_bytes(cls, data: bytes, metric: Metric | str, params: Mapping[str, Any] | None) -> Self:
        """The engine `to_bytes` wrote; its algorithm and metric must be this class's and `metric`.

        Structural parameters come from the data (what was built); query-time ones (ef_search, nprobe) from
        `params`, so they can be tuned without rebuilding.
        """
        header, sections = envelope.unpack(data)
        m = cls.check_metric(metric)
        if header.get("algorithm") != cls.algorithm or header.get("metric") != m.value:
            raise ValidationError(
                f"serialized engine is {header.get('algorithm')}/{header.get('metric')}, "
                f"expected {cls.algorithm}/{m.value}"
            )
        return cls._load(header, sections, m, cls.normalize_params(params))

    @classmethod
    def extend_bytes(
        cls, data: bytes, vectors: Vectors, metric: Metric | str, params: Mapping[str, Any] | None, *,
        threads: int | None = None,
    ) -> Self | None:
        """The engine `data` holds (as `to_bytes` wrote it) with `vectors` added after its rows (their labels
        continue from its count), made by adding to it rather than building anew; None where this algorithm
        cannot, or `data` is not this algorithm's and metric's (the caller then builds over all the rows)."""
        header, sections = envelope.unpack(data)
        m = cls.check_metric(metric)
        if header.get("algorithm") != cls.algorithm or header.get("metric") != m.value:
            return None
        add = _sparse("vectors", vectors) if cls.sparse else _dense("vectors", vectors, int(header["dim"]))
        return cls._extend(header, sections, m, cls.normalize_params(params), add,
                           max(1, threads or available_cores()))

    # ---- hooks ------------------------------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def _build(cls, vectors: Any, metric: Metric, params: dict[str, Any], threads: int) -> Self:
        """Build from checked vectors (float32 C-contiguous, or SparseRows) and normalized params."""

    @abstractmethod
    def _search(
        self, queries: Any, k: int, threads: int, params: Mapping[str, int] | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Search checked queries for 1 <= k <= len(self); labels -1 mark missing results. `params`: checked
        overrides of the query-time parameters (None: the engine's own)."""

    def _header(self) -> dict[str, Any]:
        """Extra JSON-able header fields for `_load`."""
        return {}

    @abstractmethod
    def _sections(self) -> list[bytes | memoryview]:
        """The binary payload."""

    @classmethod
    def _extend(cls, header: dict[str, Any], sections: list[memoryview], metric: Metric, params: dict[str, Any],
                vectors: Any, threads: int) -> Self | None:
        """`_load`'s engine with checked `vectors` added after its rows; None: this algorithm builds anew."""
        return None

    @classmethod
    @abstractmethod
    def _load(cls, header: dict[str, Any], sections: list[memoryview], metric: Metric, params: dict[str, Any]) -> Self:
        """Restore from `to_bytes` output (header and sections as written)."""


ENGINES: dict[str, type[Engine]] = {}
E = TypeVar("E", bound=type[Engine])


def register(cls: E) -> E:
    """Class decorator: make an engine reachable by its algorithm name."""
    ENGINES[cls.algorithm] = cls
    return cls


def get_engine(algorithm: str) -> type[Engine]:
    """The engine class of an algorithm name; unknown names raise ValidationError listing the known ones."""
    try:
        return ENGINES[algorithm]
    except (KeyError, TypeError):
        known = ", ".join(sorted(ENGINES))
        raise ValidationError(f"unknown algorithm {algorithm!r} (known: {known})") from None
