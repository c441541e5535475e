"""Approximate search with an HNSW graph (hnswlib).

hnswlib's spaces return their own distances; they are converted to Shoal's definitions: 'cosine' is already
1 - cos (clipped to [0, 2] as flat clips it: hnswlib's float32 1 - cos strays a few 1e-7 outside, so a vector
searched for itself came out at -4.8e-7), 'ip' returns 1 - ip (the score is 1 - d, unclipped like flat's), and
'l2' returns the squared L2 distance (euclidean takes the square root). Manhattan has no hnswlib space and is
refused.

Rows with equal vectors are one node of the graph, which stands for all of them. hnswlib's neighbour pruning
keeps one of several identical neighbours, so many copies of one vector (zero vectors, a default embedding)
fill each other's neighbour lists and cut the other rows off the graph: with 3,000 zero vectors and 30 distinct
ones (cosine), none of the 30 found itself. A search asks the graph for nodes and answers their rows.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
from collections.abc import Mapping
from functools import cache
from typing import Any, Self

import numpy as np

from shoal.engines.base import Engine, register
from shoal.engines.envelope import array_section
from shoal.engines.flat import FlatEngine
from shoal.engines.metrics import Metric, top_k_of
from shoal.engines.params import int_param, reject_unknown
from shoal.errors import Problem, ValidationError
from shoal.log.validation import sq_norm_fits_f32, vector_problem

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


# Copies are found by a 64-bit hash of each row's values, sorted (55 ms for 100k x 384 rows, against minutes
# for their graph), and confirmed by comparing the rows whose hashes agree: a hash is never trusted alone.
_HASH_ROWS = 2048  # rows hashed at once: their uint64 words are a few MB
# A stored graph node and an added row of the same cosine vector: hnswlib stores the normalised vector (in
# float32, 7e-8 from the exact one at most here), so they are compared within this, after equal hashes.
_COSINE_SAME = 1e-6


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

    def __init__(self, index: Any, metric: Metric, params: dict[str, Any], dim: int, count: int,
                 hashes: np.ndarray | None = None, node_of_row: np.ndarray | None = None) -> None:
        super().__init__(metric, params, dim, count)
        self._index = index  # None when there are no rows
        # `_row_hashes` of each graph node's vector (None: a graph stored before they were kept), and each row's
        # node (None: every row is its own node, label = row, the common case and every earlier graph).
        self._hashes = hashes
        self._node_of_row = node_of_row
        self._nodes = count
        if node_of_row is not None:
            # Each node's rows, ascending: rows[starts[node] : starts[node + 1]].
            sizes = np.bincount(node_of_row)
            self._nodes = len(sizes)
            self._rows = np.argsort(node_of_row, kind="stable")
            self._starts = np.concatenate(([0], np.cumsum(sizes)))
            # For the single-query path: each node's lowest row, and the nodes holding more than one row (few:
            # real data repeats some vectors, and a search that reaches none of them maps nodes to rows at once).
            self._first_row = self._rows[self._starts[:-1]]
            self._shared: frozenset[int] = frozenset(np.flatnonzero(sizes > 1).tolist())
        self._ef_search: int = params["ef_search"]
        self._native = metric in _NATIVE  # kept: an Enum hashes in Python, and search_one runs per query
        self._cosine = metric is Metric.COSINE
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
        if not n:
            return cls(None, metric, params, dim, n)
        hashes = _row_hashes(vectors)
        node_of_row = None
        lowest = _lowest_equal_rows(vectors, hashes)
        if lowest is not None:  # copies: the graph holds each vector once, numbered in the order of its first row
            firsts = np.flatnonzero(lowest == np.arange(n))
            node_of_row = np.searchsorted(firsts, lowest)
            vectors, hashes = vectors[firsts], hashes[firsts]
        m = len(vectors)
        index = _hnswlib().Index(space=_SPACES[metric], dim=dim)
        index.init_index(max_elements=m, M=params["M"], ef_construction=params["ef_construction"], random_seed=SEED)
        index.add_items(vectors, np.arange(m), num_threads=threads)
        return cls(index, metric, params, dim, n, hashes, node_of_row)

    def _search(
        self, queries: np.ndarray, k: int, threads: int, params: Mapping[str, int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        found = self._knn(queries, min(k, self._nodes), threads, params)
        if found is None:
            return self._exact(queries, k)
        labels, dist = found
        # hnswlib's labels are uint64 row numbers below 2**63: the same bits read as int64, without a copy.
        labels = labels.view(np.int64)
        if self._node_of_row is not None:  # graph nodes to rows (k nodes hold k rows at least)
            dist, labels = _expand(dist, labels, self._rows, self._starts, k)
        return self._as_metric(dist, labels, k)

    def _as_metric(self, dist: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """hnswlib's distances as the metric's, rows with equal distances in label order."""
        # hnswlib's float32 distances are converted in float32: widening would not restore lost precision,
        # and this runs once per query.
        d = dist
        if self._cosine:
            d = _clip_cosine(d)
        elif self.metric is Metric.DOT_PRODUCT:
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
        # makes it too large (its distances may overflow float32, or cosine normalize it to zeros). A sum that
        # does not clear the bound by its rounding error is decided in float64, as every norm check is.
        if not sq_norm_fits_f32(float(np.vdot(query, query)), query.size) and (
            wrong := vector_problem(query[0], query[0])
        ) is not None:
            raise ValidationError(Problem(f"query {wrong}", 0, "queryVectors"))
        # `_knn` inlined on purpose: one Python call less on the path every single-query search takes.
        grouped = self._node_of_row is not None
        nodes = min(k, self._nodes) if grouped else k
        ef = params["ef_search"] if params and "ef_search" in params else self._ef_search
        if ef < nodes:
            ef = nodes
        with self._lock:
            if ef != self._ef:
                self._index.set_ef(ef)
                self._ef = ef
            try:
                labels, dist = self._index.knn_query(query, nodes, 1)  # positional: pybind11 parses them faster
            except RuntimeError:
                return None
        if grouped:
            l_row = labels[0].tolist()
            if len(l_row) == k and self._shared.isdisjoint(l_row):  # one row per node: no expansion (~2 us)
                l_row = self._first_row[l_row].tolist()
            else:
                dist, labels = _expand(dist, labels.view(np.int64), self._rows, self._starts, k)
                l_row = labels[0].tolist()
        else:
            l_row = labels[0].tolist()
        d_row = dist[0].tolist()
        # Cosine within [0, 2] as in `_as_metric`: the row is sorted and holds no padding, so its ends tell
        # (two comparisons; the rare row past them is clipped before ties are looked for, as clipping makes some).
        if self._cosine and (d_row[0] < 0.0 or d_row[-1] > 2.0):
            d_row = [0.0 if d < 0.0 else 2.0 if d > 2.0 else d for d in d_row]
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
        filter, which visits only toward allowed rows and so keeps recall where fewer rows match.

        Where rows share a graph node, the walk looks for nodes with an allowed row and answers those rows."""
        if self._index is None or k <= 0:
            return None
        if self._node_of_row is None:
            out_d, out_l = self._walk_filtered(queries, k, allowed, count, params)
        else:
            rows = self._rows[allowed[self._rows]]  # the allowed rows, by node, ascending within one
            sizes = np.bincount(self._node_of_row[rows], minlength=self._nodes)
            node_ok = sizes > 0
            nodes = int(np.count_nonzero(node_ok))
            if nodes:  # min(k, nodes) nodes hold k allowed rows at least (the caller's k is at most `count`)
                d, found = self._walk_filtered(queries, min(k, nodes), node_ok, nodes, params)
                out_d, out_l = _expand(d, found, rows, np.concatenate(([0], np.cumsum(sizes))), k)
            else:
                out_d = np.full((len(queries), k), np.inf, dtype=np.float32)
                out_l = np.full((len(queries), k), -1, dtype=np.int64)
        return self._as_metric(out_d, out_l, k)

    def _walk_filtered(
        self, queries: np.ndarray, k: int, allowed: np.ndarray, count: int, params: Mapping[str, int] | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """hnswlib's k nearest graph nodes among those `allowed` marks (`count` true), as hnswlib's distances
        and labels, label -1 and distance +inf where the walk found fewer."""
        nq = len(queries)
        out_d = np.full((nq, k), np.inf, dtype=np.float32)
        out_l = np.full((nq, k), -1, dtype=np.int64)
        pending = np.arange(nq)
        fraction = count / self._nodes
        if fraction >= POSTFILTER_MIN_FRACTION:
            wide = min(self._nodes, math.ceil(2 * k / fraction) + 8)
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
        return out_d, out_l

    def _exact(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact results from the vectors the graph stores (for cosine hnswlib stores them normalised,
        which leaves cosine distances unchanged), each node's vector once per row it stands for."""
        stored = np.asarray(self._index.get_items(np.arange(self._nodes), return_type="numpy"), dtype=np.float32)
        stored = stored.reshape(self._nodes, self.dim)
        if self._node_of_row is not None:
            stored = stored[self._node_of_row]
        return FlatEngine(stored, self.metric, {})._search(queries, k, 1)

    def _same_nodes(self, vectors: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        """For each of `vectors` (their `_row_hashes`), the graph node holding the same vector, -1 for none
        (and for every vector when the graph's hashes were not stored)."""
        same = np.full(len(vectors), -1, dtype=np.int64)
        if self._hashes is None or not len(vectors):
            return same
        order = np.argsort(self._hashes, kind="stable")
        pos = np.minimum(np.searchsorted(self._hashes[order], hashes), len(order) - 1)
        hit = np.flatnonzero(self._hashes[order[pos]] == hashes)
        if not len(hit):
            return same
        # Equal hashes are confirmed on the stored vectors (two nodes' vectors never hash alike but by a
        # collision, which then only leaves the row a node of its own).
        nodes = order[pos[hit]]
        stored = np.asarray(self._index.get_items(nodes, return_type="numpy"), dtype=np.float32)
        stored = stored.reshape(len(nodes), self.dim)
        if self.metric is Metric.COSINE:  # hnswlib stores them normalised
            v = vectors[hit].astype(np.float64)
            norms = np.linalg.norm(v, axis=1, keepdims=True)
            v = np.divide(v, norms, out=np.zeros_like(v), where=norms > 0)
            equal = (np.abs(stored - v) <= _COSINE_SAME).all(axis=1)
        else:
            equal = (stored == vectors[hit]).all(axis=1)
        same[hit[equal]] = nodes[equal]
        return same

    def _header(self) -> dict[str, Any]:
        header: dict[str, Any] = {"space": _SPACES[self.metric], "layout": _STATE}
        # Sections after the graph's: its nodes' hashes, then each row's node (where rows share nodes).
        if self._hashes is not None:
            header["hashes"] = True
        if self._node_of_row is not None:
            header["nodes"] = self._nodes
        return header

    def _sections(self) -> list[bytes | memoryview]:
        if self._index is None:
            return []
        extra = [] if self._hashes is None else [array_section(self._hashes, "<u8")]
        if self._node_of_row is not None:
            extra.append(array_section(self._node_of_row, "<i8"))
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
        return [json.dumps(scalars).encode(), *(array_section(state[name], dtype) for name, dtype in _STATE_ARRAYS),
                *extra]

    @classmethod
    def _load(cls, header: dict[str, Any], sections: list[memoryview], metric: Metric, params: dict[str, Any]) -> Self:
        return cls._restore(header, sections, metric, params, room=0)

    @classmethod
    def _restore(cls, header: dict[str, Any], sections: list[memoryview], metric: Metric, params: dict[str, Any],
                 room: int) -> Self:
        """The saved graph, with space for `room` more nodes."""
        n, dim = int(header["count"]), int(header["dim"])
        # The graph's structure is what was built; only ef_search is taken from the caller's params.
        built = header["params"]
        effective = {"M": built["M"], "ef_construction": built["ef_construction"], "ef_search": params["ef_search"]}
        index = hashes = node_of_row = None
        if not n:
            return cls(index, metric, effective, dim, n)
        nodes = n
        if header.get("layout") == _STATE:
            # Graphs stored before rows shared nodes (or before node hashes were kept) end with the graph.
            sections = list(sections)
            if "nodes" in header:
                nodes = int(header["nodes"])
                node_of_row = _section_array(sections.pop(), "<i8", n, "row's node")
                if node_of_row.min() < 0 or node_of_row.max() != nodes - 1 or not np.bincount(node_of_row).all():
                    raise ValidationError(f"serialized HNSW graph is malformed: rows' nodes are not 0..{nodes - 1}")
            if header.get("hashes"):
                hashes = _section_array(sections.pop(), "<u8", nodes, "node hash")
            index = _from_state(sections, nodes, room)
        else:  # the earlier layout (hnswlib's save_index file): one node per row, no hashes
            index = _hnswlib().Index(space=header["space"], dim=dim)
            with tempfile.TemporaryDirectory(prefix="shoal-hnsw-") as tmp:
                path = os.path.join(tmp, "index.bin")
                with open(path, "wb") as f:
                    f.write(sections[0])
                index.load_index(path, max_elements=nodes + room)
        return cls(index, metric, effective, dim, n, hashes, node_of_row)

    @classmethod
    def _extend(cls, header: dict[str, Any], sections: list[memoryview], metric: Metric, params: dict[str, Any],
                vectors: Any, threads: int) -> Self | None:
        """The saved graph with `vectors` inserted (labels from its count on), at the graph's own M and
        ef_construction: inserting m rows into a graph of n costs about what building m alone does, where a
        rebuild pays for all n + m (a merge of small segments into a larger one, bench/freshness.py).

        A row whose vector a node holds (or an earlier added row) joins that node, as in a build; graphs stored
        before node hashes were kept are not searched for them, only the added rows among themselves."""
        base = cls._restore(header, sections, metric, params, room=len(vectors))
        if base._index is None or not len(vectors):
            return None  # nothing to add to, or nothing to add: a plain build is as cheap
        n, m, added = len(base), base._nodes, len(vectors)
        hashes = _row_hashes(vectors)
        lowest = _lowest_equal_rows(vectors, hashes)
        firsts = np.arange(added) if lowest is None else np.flatnonzero(lowest == np.arange(added))
        same = base._same_nodes(vectors[firsts], hashes[firsts])
        new = same < 0
        fresh = firsts[new]
        node_of_first = np.where(new, m + np.cumsum(new) - 1, same)
        if len(fresh):
            base._index.add_items(vectors[fresh], np.arange(m, m + len(fresh)), num_threads=threads)
        node_of_row = base._node_of_row
        if len(fresh) < added or node_of_row is not None:  # some rows share nodes
            own = node_of_first if lowest is None else node_of_first[np.searchsorted(firsts, lowest)]
            node_of_row = np.concatenate((np.arange(n) if node_of_row is None else node_of_row, own))
        all_hashes = None if base._hashes is None else np.concatenate((base._hashes, hashes[fresh]))
        return cls(base._index, metric, base._params, base.dim, n + added, all_hashes, node_of_row)


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


def _section_array(section: memoryview, dtype: str, count: int, what: str) -> np.ndarray:
    """A stored array of `count` values, copied (a view would keep the whole serialized engine in memory)."""
    if len(section) != count * np.dtype(dtype).itemsize:
        raise ValidationError(f"serialized HNSW graph is malformed: {len(section)} bytes of {what}s for {count}")
    return np.frombuffer(section, dtype=dtype).astype(dtype[1:])


@cache
def _multipliers(dim: int) -> np.ndarray:
    """`_row_hashes`' odd 64-bit factors, one per coordinate (splitmix64 of 1..dim: the same in every process
    and numpy version, as stored hashes are compared with new ones)."""
    z = np.arange(1, dim + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = (z ^ (z >> np.uint64(31))) | np.uint64(1)
    z.flags.writeable = False
    return z


def _row_hashes(vectors: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row of float32 `vectors` [n, dim]: equal rows (-0.0 equal to 0.0) hash alike."""
    n, dim = vectors.shape
    factors = _multipliers(dim)
    out = np.empty(n, dtype=np.uint64)
    for start in range(0, n, _HASH_ROWS):
        # + 0.0 makes -0.0 0.0: the bits of equal values are then equal.
        words = (vectors[start : start + _HASH_ROWS] + np.float32(0.0)).view(np.uint32).astype(np.uint64)
        words *= factors
        out[start : start + _HASH_ROWS] = words.sum(axis=1)  # modulo 2**64
    return out


def _lowest_equal_rows(vectors: np.ndarray, hashes: np.ndarray) -> np.ndarray | None:
    """Each row's lowest row holding an equal vector (itself when none is lower); None when all rows differ.
    `hashes` are the rows' `_row_hashes`: only rows whose hash another row shares are compared."""
    n = len(vectors)
    order = np.argsort(hashes, kind="stable")
    sorted_hashes = hashes[order]
    equal = sorted_hashes[1:] == sorted_hashes[:-1]
    if not equal.any():
        return None  # the common case: one sort of n hashes
    shared = np.zeros(n, dtype=bool)
    shared[1:] = equal
    shared[:-1] |= equal
    rows = np.sort(order[shared])
    # Compared by their bytes (-0.0 made 0.0), in row order: np.unique's first index is then the lowest row.
    keys = (vectors[rows] + np.float32(0.0)).view(np.dtype((np.void, 4 * vectors.shape[1])))[:, 0]
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    if len(first) == len(rows):
        return None  # only colliding hashes
    lowest = np.arange(n)
    lowest[rows] = rows[first[inverse.reshape(-1)]]
    return lowest


def _expand(
    dist: np.ndarray, nodes: np.ndarray, rows: np.ndarray, starts: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest rows per query from its nearest graph nodes (hnswlib's distances, nearest first, node -1
    where a walk found fewer), each node standing for rows[starts[node] : starts[node + 1]] at its distance:
    (hnswlib's distances, rows), nearest first, equal distances by lower row, padded with +inf and -1."""
    nq, width = nodes.shape
    valid = nodes >= 0
    node = np.where(valid, nodes, 0)
    # A node gives at most k rows (its lowest); the nodes after the k-th row only where they tie with it.
    sizes = np.where(valid, np.minimum(starts[node + 1] - starts[node], k), 0)
    ends = np.cumsum(sizes, axis=1)
    reached = ends >= k
    kth = np.where(reached.any(axis=1), dist[np.arange(nq), reached.argmax(axis=1)], np.float32(np.inf))
    sizes = np.where((ends - sizes < k) | (dist <= kth[:, None]), sizes, 0).ravel()
    entry = np.repeat(np.arange(nq * width), sizes)
    offset = np.arange(len(entry)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    row = rows[starts[node.ravel()[entry]] + offset]
    d = dist.ravel()[entry]
    query = entry // width
    order = np.lexsort((row, d, query))
    per_query = np.bincount(query, minlength=nq)
    take = np.minimum(per_query, k)
    col = np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take)
    src = order[np.repeat(np.cumsum(per_query) - per_query, take) + col]
    which = np.repeat(np.arange(nq), take)
    out_d = np.full((nq, k), np.inf, dtype=np.float32)
    out_l = np.full((nq, k), -1, dtype=np.int64)
    out_d[which, col] = d[src]
    out_l[which, col] = row[src]
    return out_d, out_l


def _clip_cosine(d: np.ndarray) -> np.ndarray:
    """hnswlib's float32 cosine distances clipped to [0, 2], as flat's are (the float32 1 - cos of normalised
    vectors strays a few 1e-7 past them); +inf padding stays +inf."""
    return np.where(d > np.float32(2.0), np.where(d == np.inf, d, np.float32(2.0)), np.maximum(d, np.float32(0.0)))


def _has_ties(d: np.ndarray) -> bool:
    """Whether any row holds two equal neighbouring distances."""
    if len(d) == 1:
        # One query (a server's usual call): the row is sorted, so equal values are neighbours and a set of
        # its values is smaller exactly when two neighbours are equal; cheaper than three numpy calls.
        row = d[0].tolist()
        return len(set(row)) < len(row)
    return bool((d[:, 1:] == d[:, :-1]).any())
