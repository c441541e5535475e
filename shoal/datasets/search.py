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
from shoal.log.records import check_name
from shoal.searcher.consistency import Consistency, check_seq
from shoal.searcher.execute import Hit
from shoal.searcher.filters import Filter, parse_filter
from shoal.searcher.views import IndexView


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


def _travel_checked(tag: Any, as_of: Any, consistency: str | None, min_write_token: int | None) -> bool:
    """True when a search asks for an older state (`tag` or `as_of`), checked: a legal tag name, a seq, not both,
    and no consistency level or `min_write_token` besides (an older state is answered exactly as it was);
    otherwise VALIDATION_ERROR naming the field."""
    if tag is None and as_of is None:
        return False
    if tag is not None and as_of is not None:
        raise invalid("give a tag or an as_of seq, not both", field="tag")
    # `eventual` is every search's default, and says nothing a search of an older state would break.
    for given, value in (("consistency", None if consistency == "eventual" else consistency),
                         ("min_write_token", min_write_token)):
        if value is not None:
            raise invalid(f"a search of an older state (tag, as_of) takes no {given} {value!r}: it answers "
                          "that state exactly as it was", field=given)
    try:
        if tag is not None:
            check_name("tag", tag)
        else:
            check_seq(as_of, "as_of")
    except ValidationError as exc:
        field = "tag" if tag is not None else "as_of"
        raise invalid(str(QueryError.of(exc)), field=field, problems=problems_of(exc)) from None
    return True


def filter_of(raw: Any, field: str) -> Filter | None:
    """A dataset search's filters (shoal.searcher.filters) over `id`, `document_id`, `content` and the fields
    of each vector's metadata (`metadata.<field>`, or the bare field name); None for none. A bad filter is
    VALIDATION_ERROR naming the field and the attribute.

    A vector stored without a `document_id` or `content` has none (`stored_without`): conditions on those two
    read it as a metadata field without the key reads, not as the text ""."""
    if raw is None or raw == {}:
        return None
    if not isinstance(raw, dict):
        raise invalid(f"{field} must be a JSON object", field=field)
    try:
        return parse_filter(stored_without(raw), rules.ATTRIBUTES, json_attribute="metadata")
    except ValidationError as exc:
        raise invalid(f"{field}: {QueryError.of(exc)}", field=field, problems=problems_of(exc)) from None


# Attributes a dataset stores as "" when a vector has none (every upsert stores every attribute: never null).
OPTIONAL_TEXT = ("document_id", "content")


def stored_without(raw: dict[str, Any]) -> dict[str, Any]:
    """The filter `raw` with its conditions on `document_id` and `content` rewritten (`_optional_text`) so that
    a vector without one (stored as "") reads as a metadata field without the key does
    (shoal.searcher.json_fields): it matches no comparison (`""` included), and so matches `$ne`, `$nin` and
    `$not`; `null` (`$eq: null`) selects exactly the vectors without one, `$ne: null` those with one, and a null
    in `$in` / `$nin` equals nothing. Each condition stays one condition at its place, so the filter's size and
    depth are the caller's; anything malformed is left as it is, for the parser to refuse. Walked without
    recursion: the parser bounds the depth, this must not fail first."""
    root: dict[str, Any] = {"filter": raw}
    todo: list[tuple[Any, Any]] = [(root, "filter")]  # (container, key) of a node still to rewrite
    while todo:
        container, key = todo.pop()
        node = container[key]
        if not isinstance(node, dict):
            continue  # not a filter: the parser says so
        node = container[key] = dict(node)  # the caller's filter stays as it is
        for name, value in node.items():
            if name in ("$and", "$or") and isinstance(value, list):
                node[name] = list(value)
                todo.extend((node[name], i) for i in range(len(value)))
            elif name == "$not":
                todo.append((node, name))
            elif name in OPTIONAL_TEXT:
                node[name] = _optional_text(value)
    return root["filter"]  # type: ignore[no-any-return]


def _optional_text(value: Any) -> Any:
    """A condition on an optional text attribute (`stored_without`), over values that are "" (none) or a
    non-empty string. `$gt ""` is "has one"; `$gt`, `$gte` on a non-empty string, `$ne` and `$nin` read "" as
    the metadata language reads a missing value already; `$eq`, `$lt`, `$lte` and `$in` must not match it."""
    if isinstance(value, dict) and value and all(isinstance(op, str) and op.startswith("$") for op in value):
        ops = dict(value)
    elif isinstance(value, dict | list):
        return value  # neither a value nor {operator: value}: the parser refuses it
    else:
        ops = {"$eq": value}
    out: dict[str, Any] = {}
    guard = False  # the condition must not match a vector without a value
    for op, operand in ops.items():
        if op in ("$in", "$nin") and isinstance(operand, list):
            out[op] = [v for v in operand if v is not None and v != ""]  # no value equals a null or ""
        elif op == "$eq" and operand is None:
            out["$eq"] = ""
        elif op == "$ne" and operand is None:
            guard = True
        elif op == "$ne" and operand == "":
            continue  # every vector: none has the value ""
        elif op == "$gte" and operand == "":
            guard = True  # every string is >= "": the vectors with a value
        else:
            out[op] = operand  # $ne, $gt, $gte of a value; or what the parser refuses (a bad operator, a number)
            guard = guard or op in ("$eq", "$lt", "$lte")
    if guard:
        out.setdefault("$gt", "")  # a $gt given already excludes "" ("" is greater than no string)
    return out or {"$nin": []}  # only `$ne: ""`: every vector


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

    def _view(self, record: DatasetRecord) -> IndexView:
        """The dataset's index as this process serves it (loaded on first use); DATASET_NOT_FOUND if gone."""
        try:
            view = self.searcher.view(record.name, rules.VERSION)
            if view.source.id != record.source_id:
                self.searcher.refresh()  # a view of a dataset since deleted and recreated under the same name
                view = self.searcher.view(record.name, rules.VERSION)
            return view
        except NotFoundError:
            self._forget(record.name)
            raise not_found(record.name) from None

    def _hits(
        self, record: DatasetRecord, vector: Sequence[float], top_k: int, consistency: Consistency,
        filters: Filter | None = None,
    ) -> Sequence[Hit]:
        """The hits of a query already checked (`_check_query`) against a dataset whose view is loaded (`_view`)."""
        try:
            return self.searcher.search(record.name, rules.VERSION, [list(vector)], top_k, consistency=consistency,
                                        filters=filters)[0]
        except NotFoundError:
            self._forget(record.name)
            raise not_found(record.name) from None
        except ValidationError as exc:
            raise invalid(str(QueryError.of(exc)), problems=problems_of(exc)) from None  # a search writes nothing

    def _hits_then(
        self, record: DatasetRecord, vector: Sequence[float], top_k: int, tag: str | None, as_of: int | None,
        filters: Filter | None,
    ) -> tuple[Sequence[Hit], str]:
        """The hits of a query already checked (`_check_query`) over the state the dataset's index had at `tag`
        or at seq `as_of` (exactly one given; `_travel_checked`), and the metric their scores are distances of:
        the tagged generation's for a tag (a reindex since may have changed it), the serving one's for a seq (an
        `as_of` search reads the log as the generation serving now defines the index). A tag, or a seq, that
        cannot be answered (unknown, pruned, compacted away) is VALIDATION_ERROR naming `tag` or `as_of`; a seq
        past the log head VALIDATION_ERROR saying so; a dataset gone meanwhile DATASET_NOT_FOUND."""
        field = "tag" if tag is not None else "as_of"
        try:
            metric = self._tagged_metric(record, tag) if tag is not None else self._metric(record)
            hits = self.searcher.search(record.name, rules.VERSION, [list(vector)], top_k, tag=tag, as_of=as_of,
                                        filters=filters)[0]
        except NotFoundError as exc:
            self._forget(record.name)
            self.catalog.get(record.name)  # DATASET_NOT_FOUND when the dataset itself went
            raise invalid(str(exc), field=field, **{field: tag if tag is not None else as_of}) from None
        except ValidationError as exc:
            # Not necessarily the tag's or the seq's fault (a query value the searcher refuses): no field named.
            raise invalid(str(QueryError.of(exc)), problems=problems_of(exc)) from None
        return hits, metric

    def _tagged_metric(self, record: DatasetRecord, tag: str) -> str:
        """The metric of the index generation `tag` was taken on; NotFoundError when there is no such tag."""
        from shoal.index import history

        index = self._view(record).index
        tagged = history.tagged_versions(self.shoal.engine, index.id, tag)
        if tagged.index_id == index.id:
            return index.spec.metric
        found = self.shoal.runtime.shards.index_by_id(tagged.index_id)
        if found is None:  # its generation was swept since: the searcher finds no tag either
            raise NotFoundError(f"tag {tag!r} not found")
        return found[1].spec.metric

    def _metric(self, record: DatasetRecord) -> str:
        """The metric the dataset's scores are distances of: the served generation's. A reindex or rollback may
        have swapped another in since the (cached) record was read, by another process that cannot touch this
        one's cache; the served view follows the swap within one searcher poll, and is what answers."""
        return self._view(record).index.spec.metric

    def search(
        self,
        name: Any,
        vector: Sequence[float],
        top_k: int = 10,
        *,
        consistency: str | None = None,
        min_write_token: int | None = None,
        filters: Any = None,
        tag: str | None = None,
        as_of: int | None = None,
    ) -> SearchResults:
        """The `top_k` nearest vectors, nearest first; `score` is the metric's distance. `filters`: only vectors
        matching it (see `filter_of`) are searched. `tag` or `as_of` (time travel, one at most) answer the state
        the index had at that tag or seq, exactly as the Vektonn search of the dataset's index does (no
        consistency level or `min_write_token` with them: that state is answered as it was)."""
        record = self.record(name)
        level = consistency_of(consistency, min_write_token)
        flt = filter_of(filters, "filters")
        travel = _travel_checked(tag, as_of, consistency, min_write_token)
        self._check_query(record, vector, top_k)
        if travel:
            hits, metric = self._hits_then(record, vector, top_k, tag, as_of, flt)
        else:
            metric = self._metric(record)
            hits = self._hits(record, vector, top_k, level, flt)
        return SearchResults(record.name, metric, higher_is_nearer(metric), level.level,
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
        for r in records:
            self._check_query(r, vector, top_k)
        metrics = [self._metric(r) for r in records]
        directions = {higher_is_nearer(m) for m in metrics}
        if merge_strategy == "score" and len(directions) > 1:
            raise DatasetError(
                ErrorCode.INVALID_DATASET_CONFIG,
                "merge_strategy 'score' cannot merge metrics that rank in opposite directions "
                "(dot_product: higher is nearer; cosine, euclidean, manhattan: lower is nearer)",
                {"metric_types": {r.name: m for r, m in zip(records, metrics, strict=True)},
                 "merge_strategy": merge_strategy},
            )
        lists = [self._hits(r, vector, top_k, level, flt) for r in records]
        merged = merge(merge_strategy, lists, [[h.distance for h in hits] for hits in lists],
                       directions == {True}, top_k)
        return MultiSearchResults(
            merge_strategy, tuple(r.name for r in records), top_k, level.level,
            tuple(RankedMatch(records[d].name, rank, match_of(hit)) for d, rank, hit in merged),
        )
