"""Searching datasets: one dataset's nearest vectors, or one query over several merged (`shoal.datasets.merge`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shoal.datasets import rules
from shoal.datasets.catalog import DatasetRecord
from shoal.datasets.errors import DatasetError, ErrorCode, invalid, not_found, problems_of
from shoal.datasets.merge import STRATEGIES, merge
from shoal.datasets.results import Match, MultiSearchResults, RankedMatch, SearchResults
from shoal.datasets.scope import DatasetScope
from shoal.datasets.stats import metadata_value
from shoal.engines.metrics import higher_is_nearer
from shoal.errors import NotFoundError, QueryError, ValidationError
from shoal.searcher.consistency import Consistency
from shoal.searcher.execute import Hit
from shoal.searcher.filters import Filter, parse_filter


def consistency_of(level: str | None, min_write_token: int | None) -> Consistency:
    """`strong` if asked; else at least `min_write_token` when given; else `eventual`."""
    if level not in (None, "eventual", "strong"):
        raise invalid(f"consistency must be eventual or strong, got {level!r}", field="consistency")
    if level == "strong":
        return Consistency.strong()
    if min_write_token is not None:
        if isinstance(min_write_token, bool) or not isinstance(min_write_token, int) or min_write_token < 0:
            raise invalid("min_write_token must be a non-negative integer", field="min_write_token")
        return Consistency.at_least(min_write_token)
    return Consistency.eventual()


def filter_of(raw: Any, field: str) -> Filter | None:
    """A dataset search's filters (shoal.searcher.filters) over `id`, `document_id`, `content` and the fields
    of each vector's metadata (`metadata.<field>`, or the bare field name); None for none. A bad filter is
    VALIDATION_ERROR naming the field and the attribute."""
    if raw is None or raw == {}:
        return None
    if not isinstance(raw, dict):
        raise invalid(f"{field} must be a JSON object", field=field)
    try:
        return parse_filter(raw, rules.ATTRIBUTES, json_attribute="metadata")
    except ValidationError as exc:
        raise invalid(f"{field}: {QueryError.of(exc)}", field=field, problems=problems_of(exc)) from None


def match_of(hit: Hit) -> Match:
    """A search hit as a dataset match: empty document_id and content read as none, metadata decoded."""
    a = hit.attributes
    return Match(
        id=a.get("id"),
        score=float(hit.distance),
        content=a.get("content") or None,
        metadata=metadata_value(a.get("metadata")),
        document_id=a.get("document_id") or None,
    )


class Search(DatasetScope):
    """kNN search over one dataset or several."""

    @staticmethod
    def _check_query(record: DatasetRecord, vector: Sequence[float], top_k: int) -> None:
        if len(vector) != record.dimensions:
            raise DatasetError(
                ErrorCode.INVALID_DIMENSIONS,
                f"query vector of dataset {record.name!r}: expected {record.dimensions} values, got {len(vector)}",
                {"dataset_id": record.name, "expected": record.dimensions, "got": len(vector)},
            )
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= rules.MAX_TOP_K:
            raise invalid(f"top_k must be an integer in 1..{rules.MAX_TOP_K}", field="top_k")

    def _hits(
        self, record: DatasetRecord, vector: Sequence[float], top_k: int, consistency: Consistency,
        filters: Filter | None = None,
    ) -> Sequence[Hit]:
        self._check_query(record, vector, top_k)
        try:
            if self.searcher.view(record.name, rules.VERSION).source.id != record.source_id:
                self.searcher.refresh()  # a view of a dataset since deleted and recreated under the same name
            return self.searcher.search(record.name, rules.VERSION, [list(vector)], top_k, consistency=consistency,
                                        filters=filters)[0]
        except NotFoundError:
            self._forget(record.name)
            raise not_found(record.name) from None
        except ValidationError as exc:
            raise invalid(str(QueryError.of(exc)), problems=problems_of(exc)) from None  # a search writes nothing

    def search(
        self,
        name: Any,
        vector: Sequence[float],
        top_k: int = 10,
        *,
        consistency: str | None = None,
        min_write_token: int | None = None,
        filters: Any = None,
    ) -> SearchResults:
        """The `top_k` nearest vectors, nearest first; `score` is the metric's distance. `filters`: only vectors
        matching it (see `filter_of`) are searched."""
        record = self.record(name)
        level = consistency_of(consistency, min_write_token)
        flt = filter_of(filters, "filters")
        hits = self._hits(record, vector, top_k, level, flt)
        return SearchResults(record.name, record.metric_type, higher_is_nearer(record.metric_type), level.level,
                             tuple(match_of(h) for h in hits))

    def multi_search(
        self,
        dataset_ids: Sequence[Any],
        vector: Sequence[float],
        top_k: int = 10,
        *,
        merge_strategy: str = "interleave",
        consistency: str | None = None,
        filters: Any = None,
    ) -> MultiSearchResults:
        """Search several datasets with one vector and merge their results (see `shoal.datasets.merge`); every
        problem with the query is reported before any search runs. `filters` (see `filter_of`) apply to
        every dataset searched."""
        flt = filter_of(filters, "options.filters")
        if not dataset_ids or len(dataset_ids) > rules.MAX_MULTI_DATASETS:
            raise invalid(f"dataset_ids must name 1 to {rules.MAX_MULTI_DATASETS} datasets", field="dataset_ids")
        if len(set(dataset_ids)) != len(dataset_ids):
            raise invalid("dataset_ids must not repeat", field="dataset_ids")
        if merge_strategy not in STRATEGIES:
            raise invalid(f"merge_strategy must be one of {', '.join(STRATEGIES)}", field="merge_strategy")
        level = consistency_of(consistency, None)
        records = [self.record(n) for n in dataset_ids]
        directions = {higher_is_nearer(r.metric_type) for r in records}
        if merge_strategy == "score" and len(directions) > 1:
            raise DatasetError(
                ErrorCode.INVALID_DATASET_CONFIG,
                "merge_strategy 'score' cannot merge metrics that rank in opposite directions "
                "(dot_product: higher is nearer; cosine, euclidean, manhattan: lower is nearer)",
                {"metric_types": {r.name: r.metric_type for r in records}, "merge_strategy": merge_strategy},
            )
        for r in records:
            self._check_query(r, vector, top_k)
        lists = [self._hits(r, vector, top_k, level, flt) for r in records]
        merged = merge(merge_strategy, lists, [[h.distance for h in hits] for hits in lists],
                       directions == {True}, top_k)
        return MultiSearchResults(
            merge_strategy, tuple(r.name for r in records), top_k, level.level,
            tuple(RankedMatch(records[d].name, rank, match_of(hit)) for d, rank, hit in merged),
        )
