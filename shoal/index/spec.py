"""Checking an index definition against its data source (Vektonn's rules) and filling its defaults."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from shoal.engines import get_engine
from shoal.engines.metrics import Metric
from shoal.errors import IndexDefinitionError, Problem, ValidationError
from shoal.log.records import MAX_SHARDS, DataSourceSpec, IndexSpec
from shoal.vektonn.algorithms import VEKTONN_TYPES, from_vektonn

# IndexSpec's metric when none is given: a Python IndexSpec cannot tell it from the same metric given explicitly.
DEFAULT_METRIC: str = next(f.default for f in fields(IndexSpec) if f.name == "metric")


def vektonn_metric_problem(algorithm: str, metric: str, *, explicit: bool = True) -> Problem | None:
    """The problem with `metric` given beside a Vektonn index type that implies another one (FaissIndex.L2:
    l2_squared), else None: the type carries its metric, and a metric is refused, never silently replaced.
    The implied metric itself is fine. With `explicit=False` (a definition whose metric may be IndexSpec's default
    rather than one the caller gave), the default passes too and the type's metric replaces it."""
    implied = VEKTONN_TYPES.get(algorithm) if isinstance(algorithm, str) else None
    if implied is None or metric == implied[1].value or (not explicit and metric == DEFAULT_METRIC):
        return None
    return Problem(f"the Vektonn type {algorithm} carries its own metric ({implied[1].value}), not {metric!r}: "
                   f"leave the metric out")


def resolve_index(spec: IndexSpec, source: DataSourceSpec) -> IndexSpec:
    """This definition checked against its data source, with defaults filled in.

    Raises ValidationError listing every broken rule: id, split and shard attributes must be permanent
    attributes of the source; id minus split must be non-empty; a sparse algorithm needs a sparse
    source and a dense one a dense source; the metric must be one the algorithm supports; parameters
    must be the algorithm's (HNSW: all or none). A Vektonn type (FaissIndex.L2, ...) implies its metric: any
    other metric is refused, except IndexSpec's default (cosine), which a definition cannot tell from one given.
    """
    problems: list[Problem] = []
    if spec.algorithm in VEKTONN_TYPES:
        # Vektonn's names carry the metric (and HNSW-ness) in the type: translate, then check as usual.
        contradiction = vektonn_metric_problem(spec.algorithm, spec.metric, explicit=False)
        if contradiction is not None:
            problems.append(contradiction)
        try:
            algorithm, metric, params = from_vektonn(spec.algorithm, spec.params)
        except ValidationError as exc:
            raise IndexDefinitionError([*problems, *exc.problems]) from None
        spec = replace(spec, algorithm=algorithm, metric=metric.value, params=params)
    permanent = set(source.permanent_attributes)
    id_attrs = spec.id_attributes or tuple(a for a in source.permanent_attributes if a not in spec.split_attributes)
    for kind, names in (("id", id_attrs), ("split", spec.split_attributes), ("shard", spec.shard_attributes)):
        if len(set(names)) != len(names):
            problems.append(Problem(f"{kind} attributes must not repeat"))
        for a in names:
            if a not in permanent:
                problems.append(Problem(f"{kind} attribute must be a permanent attribute of the source", attribute=a))
    if not set(id_attrs) - set(spec.split_attributes):
        problems.append(Problem("id attributes minus split attributes must not be empty"))
    payload = spec.payload_attributes
    if payload is None:
        payload = tuple(source.attribute_types)
    for a in payload:
        if a not in source.attribute_types:
            problems.append(Problem("payload attribute is not an attribute of the source", attribute=a))
    if (
        isinstance(spec.shard_count, bool)
        or not isinstance(spec.shard_count, int)
        or not (1 <= spec.shard_count <= MAX_SHARDS)
    ):
        problems.append(Problem(f"shard count must be an integer in 1..{MAX_SHARDS}"))
    try:
        metric = Metric(spec.metric)
    except ValueError:
        metric = None
        problems.append(Problem(f"unknown metric {spec.metric!r}; known: {', '.join(m.value for m in Metric)}"))
    params: dict[str, Any] = dict(spec.params)
    try:
        engine = get_engine(spec.algorithm)
        if engine.sparse != source.vectors_are_sparse:
            problems.append(
                Problem(
                    f"algorithm {spec.algorithm!r} is for {'sparse' if engine.sparse else 'dense'} vectors, "
                    f"but the source holds {'sparse' if source.vectors_are_sparse else 'dense'} ones"
                )
            )
        if metric is not None:
            engine.check_metric(metric)
        params = engine.normalize_params(spec.params)
    except ValidationError as exc:
        problems.extend(exc.problems)
    if problems:
        raise IndexDefinitionError(problems)
    shard_attrs = spec.shard_attributes or id_attrs
    return replace(
        spec,
        id_attributes=id_attrs,
        shard_attributes=shard_attrs,
        payload_attributes=tuple(payload),
        params=params,
    )
