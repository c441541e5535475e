"""Approximate search with an HNSW graph (hnswlib).

hnswlib's spaces return their own distances; they are converted to Shoal's definitions: 'cosine' is already
1 - cos, 'ip' returns 1 - ip (the score is 1 - d), and 'l2' returns the squared L2 distance (euclidean takes
the square root). Manhattan has no hnswlib space and is refused.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
from collections.abc import Mapping
from typing import Any, Self

import numpy as np

from shoal.engines.base import Engine, register
from shoal.engines.envelope import array_section
from shoal.engines.flat import FlatEngine
from shoal.engines.metrics import Metric, top_k_of
from shoal.engines.params import int_param, reject_unknown
from shoal.errors import Problem, ValidationError
from shoal.log.validation import MAX_SQ_NORM, vector_problem

MAX_SQ = float(MAX_SQ_NORM)  # a Python float: compared on every single-query search
DEFAULTS = {"M": 16, "ef_construction": 200, "ef_search": 64}
_LIMITS = {"M": (2, 512), "ef_construction": (1, 1 << 16), "ef_search": (1, 1 << 16)}
_SPACES = {Metric.COSINE: "cosine", Metric.DOT_PRODUCT: "ip", Metric.EUCLIDEAN: "l2", Metric.L2_SQUARED: "l2"}
# Metrics whose distance is hnswlib's own, unconverted.
_NATIVE = frozenset({Metric.COSINE, Metric.L2_SQUARED})
_F32 = np.dtype(np.float32)
# Fixed so that a single-threaded build is reproducible (a multi-threaded one depends on insertion timing).
SEED = 20261122
# From this fraction of matching rows up, a filtered search first tries a plain walk widened to 2k / fraction
# and keeps the matching results: at 50 % on the bench set (bench/filters.py) it costs about what an unfiltered
# search does, while hnswlib's filter callback costs a Python call per visited node (3x slower there).
POSTFILTER_MIN_FRACTION = 0.25


# A graph is stored as hnswlib's own pickled state: its scalars as JSON in the first section, then its arrays,
# restored in memory (`Index.__setstate__`). Graphs stored before that ("layout" absent: hnswlib's save_index
# file) still load, through a temporary file; that write, read and removal cost a version load 4x the restore.
_STATE = "state"
_STATE_ARRAYS = (("label_lookup_external", "<u8"), ("label_lookup_internal", "<u4"), ("element_levels", "<i4"),
                 ("data_level0", "<i1"), ("link_lists", "<i1"))


def _hnswlib() -> Any:
    import hnswlib  # imported late: only processes that build or load HNSW indexes pay for it

    return hnswlib


@register
class HnswEngine(Engine):
    """HNSW over dense float32 vectors: cosine, dot_product, euclidean, l2_squared."""

    algorithm = "hnsw"
    supported_metrics = frozenset(_SPACES)
    sparse = False

    # hnswlib raises rather than return fewer than k; _search then answers exactly: never a -1 label.
    may_miss = False
    search_params = {"ef_search": _LIMITS["ef_search"]}
    extends = True

    def __init__(self, index: Any, metric: Metric, params: dict[str, Any], dim: int, count: int) -> None:
        super().__init__(metric, params, dim, count)
        self._index = index  # None when there are no rows
        self._ef_search: int = params["ef_search"]
        self._native = metric in _NATIVE  # kept: an Enum hashes in Python, and search_one runs per query
        self._one_shape = (1, dim)
        # hnswlib keeps ef on the index, not per call: serialize "set ef, query" so concurrent searches with
        # different k or ef_search cannot run with each other's ef. `_ef` is the ef this engine last set (the
        # engine owns `_index`; nothing else sets it), so an unchanged ef is not set again.
        self._lock = threading.Lock()
        self._ef = 0

    @classmethod
    def normalize_params(cls, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """M, ef_construction, ef_search: all given or none (then 16, 200, 64)."""
        params = dict(params or {})
        reject_unknown(cls.algorithm, params, DEFAULTS)
        if not params:
            return dict(DEFAULTS)
        missing = [p for p in DEFAULTS if p not in params]
        if missing:
            raise ValidationError(
                f"HNSW parameters must be given all or none: missing {', '.join(missing)} "
                f"(given {', '.join(p for p in DEFAULTS if p in params)})"
            )
        return {p: int_param(p, params[p], *_LIMITS[p]) for p in DEFAULTS}

    @classmethod
    def _build(cls, vectors: np.ndarray, metric: Metric, params: dict[str, Any], threads: int) -> Self:
        n, dim = vectors.shape
        index = None
        if n:
            index = _hnswlib().Index(space=_SPACES[metric], dim=dim)
            index.init_index(max_elements=n, M=params["M"], ef_construction=params["ef_construction"], random_seed=SEED)
            index.add_items(vectors, np.arange(n), num_threads=threads)
        return cls(index, metric, params, dim, n)

    def _search(
        self, queries: np.ndarray, k: int, threads: int, params: Mapping[str, int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        found = self._knn(queries, k, threads, params)
        if found is None:
            return self._exact(queries, k)
        labels, dist = found
        # hnswlib's labels are uint64 row numbers below 2**63: the same bits read as int64, without a copy.
        labels = labels.view(np.int64)
        # hnswlib's float32 distances are converted in float32: widening would not restore lost precision,
        # and this runs once per query.
        d = dist
        if self.metric is Metric.DOT_PRODUCT:
            d = np.float32(1.0) - d
        elif self.metric is Metric.EUCLIDEAN:
            d = np.sqrt(np.maximum(d, np.float32(0.0)))
        # Re-sort so equal distances come in label order, like every other engine (hnswlib's own order is
        # already by distance, so only rows with ties need it: skipping it is most of a query's overhead).
        if k > 1 and _has_ties(d):
            d, labels = top_k_of(self.metric, d, labels, k)
            d = d.astype(np.float32, copy=False)
        return d, labels

    def search_lists(
        self, queries: np.ndarray, k: int, params: Mapping[str, int] | None = None
    ) -> tuple[list[list[float]], list[list[int]]]:
        """As Engine.search_lists; one query goes through `search_one` (checked queries pass its checks)."""
        one = self.search_one(queries, k, params)
        if one is None:
            return super().search_lists(queries, k, params)
        return [one[0]], [one[1]]

    def search_one(
        self, query: Any, k: int, params: Mapping[str, int] | None = None
    ) -> tuple[list[float], list[int]] | None:
        """Engine.search_one for a C-contiguous float32 [1, dim] array, k at most the row count and a metric
        that is hnswlib's own distance: a server's single-query search, in as few Python steps as possible
        (each costs microseconds, with the CPU caches cold after a graph walk, against hnswlib's 100-300).

        The query is checked by one dot product: non-finite coordinates or a norm past MAX_NORM raise
        ValidationError.
        """
        if not (
            self._native
            and type(query) is np.ndarray
            and query.dtype is _F32
            and query.shape == self._one_shape
            and query.flags.c_contiguous
            and 0 < k <= self._count
        ):
            return None
        # One dot product (0.6 us) checks the query: NaN and inf propagate into it, and a vector past MAX_NORM
        # makes it too large (its distances may overflow float32, or cosine normalize it to zeros).
        if not float(np.vdot(query, query)) <= MAX_SQ:
            raise ValidationError(Problem(f"query {vector_problem(query[0], query[0])}", 0, "queryVectors"))
        # `_knn` inlined on purpose: one Python call less on the path every single-query search takes.
        ef = params["ef_search"] if params and "ef_search" in params else self._ef_search
        if ef < k:
            ef = k
        with self._lock:
            if ef != self._ef:
                self._index.set_ef(ef)
                self._ef = ef
            try:
                labels, dist = self._index.knn_query(query, k, 1)  # positional: pybind11 parses them faster
            except RuntimeError:
                return None
        d_row = dist[0].tolist()
        l_row = labels[0].tolist()
        if len(set(d_row)) < len(d_row):  # ties (a sorted row: equal values are neighbours): label order
            pairs = sorted(zip(d_row, l_row, strict=True))
            d_row, l_row = [d for d, _ in pairs], [label for _, label in pairs]
        return d_row, l_row

    def _knn(
        self, queries: np.ndarray, k: int, threads: int, params: Mapping[str, int] | None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """hnswlib's (labels, distances) at the search's ef (at least k); None when hnswlib finds fewer than k.

        hnswlib raises when a graph walk reaches fewer than k rows. Pruning can leave rows no edge points to
        (especially in the non-metric 'ip' space), so with k near n no ef is enough: callers answer exactly.
        """
        ef = params["ef_search"] if params and "ef_search" in params else self._ef_search
        if ef < k:
            ef = k
        with self._lock:
            if ef != self._ef:
                self._index.set_ef(ef)
                self._ef = ef
            try:
                return self._index.knn_query(queries, k, threads)  # type: ignore[no-any-return]  # positional: faster
            except RuntimeError:
                return None

    def search_filtered(
        self, queries: np.ndarray, k: int, allowed: np.ndarray, count: int, params: Mapping[str, int] | None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The k nearest rows among those `allowed` marks (bool per row, `count` true; checked queries):
        (distances, labels) nearest first, label -1 where the walk found fewer (the searcher then answers that
        query exactly); None when there is no graph.

        Where most rows match, a plain walk widened to k / fraction (times 2) usually holds k matching rows,
        with no Python callback per visited node; queries it leaves short walk the graph with hnswlib's
        filter, which visits only toward allowed rows and so keeps recall where fewer rows match."""
        if self._index is None or k <= 0:
            return None
        nq = len(queries)
        out_d = np.full((nq, k), np.inf, dtype=np.float32)
        out_l = np.full((nq, k), -1, dtype=np.int64)
        pending = np.arange(nq)
        fraction = count / self._count
        if fraction >= POSTFILTER_MIN_FRACTION:
            wide = min(self._count, math.ceil(2 * k / fraction) + 8)
            found = self._knn(queries, wide, 1, params)
            if found is not None:
                labels = found[0].view(np.int64)
                keep = allowed[labels]
                enough = np.count_nonzero(keep, axis=1) >= k
                if enough.any():
                    # Matching results first, in the walk's (nearest first) order.
                    order = np.argsort(~keep[enough], axis=1, kind="stable")[:, :k]
                    out_l[enough] = np.take_along_axis(labels[enough], order, axis=1)
                    out_d[enough] = np.take_along_axis(found[1][enough], order, axis=1)
                pending = np.flatnonzero(~enough)
        if len(pending):
            test = allowed.tobytes().__getitem__  # 0 or 1 per label: the cheapest callable hnswlib can call
            ef = params["ef_search"] if params and "ef_search" in params else self._ef_search
            ef = max(ef, k)
            with self._lock:
                if ef != self._ef:
                    self._index.set_ef(ef)
                    self._ef = ef
                try:
                    labels, dist = self._index.knn_query(queries[pending], k, 1, test)
                except RuntimeError:  # fewer than k reachable: the searcher answers these exactly
                    labels = None
            if labels is not None:
                out_l[pending] = labels.view(np.int64)
                out_d[pending] = dist
        d = out_d
        if self.metric is Metric.DOT_PRODUCT:
            d = np.float32(1.0) - d
        elif self.metric is Metric.EUCLIDEAN:
            d = np.sqrt(np.maximum(d, np.float32(0.0)))
        if k > 1 and _has_ties(d):
            d, out_l = top_k_of(self.metric, d, out_l, k)
            d = d.astype(np.float32, copy=False)
        return d, out_l

    def _exact(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact results from the vectors the graph stores (for cosine hnswlib stores them normalised,
        which leaves cosine distances unchanged)."""
        stored = np.asarray(self._index.get_items(np.arange(len(self)), return_type="numpy"), dtype=np.float32)
        return FlatEngine(stored.reshape(len(self), self.dim), self.metric, {})._search(queries, k, 1)

    def _header(self) -> dict[str, Any]:
        return {"space": _SPACES[self.metric], "layout": _STATE}

    def _sections(self) -> list[bytes | memoryview]:
        if self._index is None:
            return []
        state = dict(self._index.__getstate__()[0])
        # Only the rows there are: room reserved for more is not stored (a restore makes its own).
        count, per_row = state["cur_element_count"], state["size_data_per_element"]
        state["data_level0"] = state["data_level0"][: count * per_row]
        state["element_levels"] = state["element_levels"][:count]
        state["max_elements"] = count
        # Stored alike however the graph came to be: the label map in row order (hnswlib dumps a hash map), ef
        # fixed (a query-time setting, set again before each search).
        order = np.argsort(state["label_lookup_internal"], kind="stable")
        state["label_lookup_internal"] = state["label_lookup_internal"][order]
        state["label_lookup_external"] = state["label_lookup_external"][order]
        state["ef"] = 10
        scalars = {k: v for k, v in state.items() if not isinstance(v, np.ndarray)}
        return [json.dumps(scalars).encode(), *(array_section(state[name], dtype) for name, dtype in _STATE_ARRAYS)]

    @classmethod
    def _load(cls, header: dict[str, Any], sections: list[memoryview], metric: Metric, params: dict[str, Any]) -> Self:
        return cls._restore(header, sections, metric, params, room=0)

    @classmethod
    def _restore(cls, header: dict[str, Any], sections: list[memoryview], metric: Metric, params: dict[str, Any],
                 room: int) -> Self:
        """The saved graph, with space for `room` more rows."""
        n, dim = int(header["count"]), int(header["dim"])
        # The graph's structure is what was built; only ef_search is taken from the caller's params.
        built = header["params"]
        effective = {"M": built["M"], "ef_construction": built["ef_construction"], "ef_search": params["ef_search"]}
        index = None
        if n and header.get("layout") == _STATE:
            index = _from_state(sections, n, room)
        elif n:
            index = _hnswlib().Index(space=header["space"], dim=dim)
            with tempfile.TemporaryDirectory(prefix="shoal-hnsw-") as tmp:
                path = os.path.join(tmp, "index.bin")
                with open(path, "wb") as f:
                    f.write(sections[0])
                index.load_index(path, max_elements=n + room)
        return cls(index, metric, effective, dim, n)

    @classmethod
    def _extend(cls, header: dict[str, Any], sections: list[memoryview], metric: Metric, params: dict[str, Any],
                vectors: Any, threads: int) -> Self | None:
        """The saved graph with `vectors` inserted (labels from its count on), at the graph's own M and
        ef_construction: inserting m rows into a graph of n costs about what building m alone does, where a
        rebuild pays for all n + m (a merge of small segments into a larger one, bench/freshness.py)."""
        base = cls._restore(header, sections, metric, params, room=len(vectors))
        if base._index is None or not len(vectors):
            return None  # nothing to add to, or nothing to add: a plain build is as cheap
        n = len(base)
        base._index.add_items(vectors, np.arange(n, n + len(vectors)), num_threads=threads)
        return cls(base._index, metric, base._params, base.dim, n + len(vectors))


def _from_state(sections: list[memoryview], count: int, room: int) -> Any:
    """The graph `_sections` stored, with space for `room` more rows (ValidationError when malformed)."""
    try:
        state = json.loads(bytes(sections[0]))
        for (name, dtype), section in zip(_STATE_ARRAYS, sections[1:], strict=True):
            state[name] = np.frombuffer(section, dtype=dtype)
        if state["cur_element_count"] != count:
            raise ValueError(f"{state['cur_element_count']} rows, the header says {count}")
        index_cls = _hnswlib().Index
        index = index_cls.__new__(index_cls)
        index.__setstate__((state,))
    except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as exc:
        raise ValidationError(f"serialized HNSW graph is malformed: {exc}") from None
    if room:
        index.resize_index(count + room)
    return index


def _has_ties(d: np.ndarray) -> bool:
    """Whether any row holds two equal neighbouring distances."""
    if len(d) == 1:
        # One query (a server's usual call): the row is sorted, so equal values are neighbours and a set of
        # its values is smaller exactly when two neighbours are equal; cheaper than three numpy calls.
        row = d[0].tolist()
        return len(set(row)) < len(row)
    return bool((d[:, 1:] == d[:, :-1]).any())
