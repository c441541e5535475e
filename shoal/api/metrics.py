"""Prometheus metrics: upload rate, search latency, fan-out failures, and lag per shard (read from the catalog at
scrape).

A scrape shows what its caller may see (`MetricsView`): with the metrics token, every tenant's series; with an
admin key, its own tenant's series; anyone else gets totals over all tenants, in which no tenant, index or data
source is named. (Never both for one family: a total beside its parts would be counted twice by a sum.) The
fan-out counters name no tenant and are shown to every caller alike: their labels are a placed node's name (the
placement file's, a few) and a failure kind of a fixed few, and the missing shards are counted over every index,
whose names are tenants' own (and a label per index would grow with them).

Under `shoal api --workers N` the supervisor sets PROMETHEUS_MULTIPROC_DIR before starting the workers, and the
counter and histogram are prometheus_client's multiprocess values: every worker writes them to a file of its own
there, and a scrape (whichever worker answers it) sums every worker's. The gauges stay those of the process that
answers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from shoal.catalog.db import catalog_unreachable
from shoal.catalog.indexes import freshness_rows
from shoal.index.segment_cache import SegmentCache

log = logging.getLogger(__name__)

TENANT = "tenant"
MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"


@dataclass(frozen=True)
class MetricsView:
    """Which series a scrape shows: every tenant's, one tenant's, or (neither named) totals over all tenants."""

    every_tenant: bool = False
    tenant: str | None = None

    def shows(self, tenant: str) -> bool:
        """True when the series of `tenant` may be shown."""
        return self.every_tenant or tenant == self.tenant


class _LagCollector(Collector):
    """Lag per shard read from the catalog when collected: the largest over every shard (no names), and the
    per-shard series of the tenants the view shows. Shards of every index's serving generation only: those kept
    for rollback or a tag serve no search, and a reindex's generation being built reports its progress in its
    job (`shoal reindex --status`), not here (its lag from 0 would look like an index falling behind)."""

    def __init__(self, engine: Engine, view: MetricsView) -> None:
        self.engine = engine
        self.view = view

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The lag families; none at all while the catalog cannot be reached (logged, one line a scrape), so the
        rest of the scrape is still served: a lag of 0 would claim every shard is up to date."""
        try:
            rows = freshness_rows(self.engine)
        except DBAPIError as exc:
            if not catalog_unreachable(exc):
                raise  # a bug, not an outage: the scrape fails loudly
            # The driver's message spans lines (and may name hosts): its first line, to the log only.
            reason = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [""])[0]
            log.warning("the lag gauges are left out of this scrape: the catalog is unavailable (%s: %s)",
                        type(exc).__name__, reason)
            return
        labels = ["tenant", "index", "version", "shard"]
        built = GaugeMetricFamily("shoal_index_built_lag_seqs", "Log entries not indexed yet", labels=labels)
        served = GaugeMetricFamily("shoal_index_served_lag_seqs", "Log entries searchers do not serve", labels=labels)
        max_built = max_served = 0
        for tenant, index, version, shard, head, built_w, served_w, building in rows:
            if building:
                continue
            max_built, max_served = max(max_built, head - built_w), max(max_served, head - served_w)
            if self.view.shows(tenant):
                values = [tenant, index, version, str(shard)]
                built.add_metric(values, head - built_w)
                served.add_metric(values, head - served_w)
        if self.view.every_tenant or self.view.tenant is not None:
            yield built
            yield served
        yield GaugeMetricFamily("shoal_index_built_lag_seqs_max", "Largest built lag of any shard of any tenant",
                                value=max_built)
        yield GaugeMetricFamily("shoal_index_served_lag_seqs_max", "Largest served lag of any shard of any tenant",
                                value=max_served)


class _CacheCollector(Collector):
    """The process's loaded index segments: bytes, budget and count (process-wide, no tenant in it)."""

    def __init__(self, cache: SegmentCache, young_bytes: int) -> None:
        self.cache = cache
        self.young_bytes = young_bytes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("shoal_searcher_cache_bytes", "Bytes of index segments loaded by this process's "
                                "searchers (estimated at load)", value=self.cache.bytes)
        # The young tiers' share of the budget: with the segments' bytes, what the budget is held against.
        yield GaugeMetricFamily("shoal_searcher_young_tier_bytes", "Bytes of the young tiers this process's "
                                "searchers hold (estimated)", value=self.young_bytes)
        yield GaugeMetricFamily("shoal_searcher_cache_budget_bytes", "The budget loaded segments and young tiers "
                                "are kept under together (SHOAL_SEARCHER_CACHE_BYTES)", value=self.cache.budget)
        yield GaugeMetricFamily("shoal_searcher_cache_segments", "Index segments loaded by this process's searchers",
                                value=len(self.cache))


class _YoungCollector(Collector):
    """The young tier this process's searcher holds per shard (log entries searched exactly because no built
    version reflects them yet): keys and age, per shard for the tenants the view shows, largest otherwise."""

    def __init__(self, rows: list[tuple[str, str, str, int, int, float]], view: MetricsView) -> None:
        self.rows = rows
        self.view = view

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["tenant", "index", "version", "shard"]
        size = GaugeMetricFamily("shoal_young_tier_keys", "Keys this process's searcher serves from the log, not "
                                 "yet in a built version", labels=labels)
        age = GaugeMetricFamily("shoal_young_tier_age_seconds", "Seconds since this process's searcher read the "
                                "oldest entry of its young tier", labels=labels)
        max_size, max_age = 0, 0.0
        for tenant, index, version, shard, keys, seconds in self.rows:
            max_size, max_age = max(max_size, keys), max(max_age, seconds)
            if self.view.shows(tenant):
                size.add_metric([tenant, index, version, str(shard)], keys)
                age.add_metric([tenant, index, version, str(shard)], seconds)
        if self.view.every_tenant or self.view.tenant is not None:
            yield size
            yield age
        yield GaugeMetricFamily("shoal_young_tier_keys_max", "Largest young tier of any shard served here",
                                value=max_size)
        yield GaugeMetricFamily("shoal_young_tier_age_seconds_max", "Oldest young tier entry of any shard served "
                                "here (seconds)", value=max_age)


class _Viewed(Collector):
    """The per-tenant counters and histograms of a registry as a view allows: the series of the tenants it
    shows, or (when it names none) the totals over all tenants, without the tenant label. Series without a tenant
    label (the fan-out's) are every view's."""

    def __init__(self, families: Iterable[Metric], view: MetricsView) -> None:
        self.families = list(families)
        self.view = view

    def collect(self) -> Iterator[Metric]:
        named = self.view.every_tenant or self.view.tenant is not None
        for family in self.families:
            out = Metric(family.name, family.documentation, family.type, family.unit)
            totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            for sample in family.samples:
                tenant = sample.labels.get(TENANT)
                if named:
                    if tenant is None or self.view.shows(tenant):
                        out.add_sample(sample.name, sample.labels, sample.value, sample.timestamp)
                    continue
                rest = tuple(sorted((k, v) for k, v in sample.labels.items() if k != TENANT))
                key = (sample.name, rest)
                if sample.name.endswith("_created"):  # a creation time: the earliest, not a sum
                    totals[key] = min(totals.get(key, sample.value), sample.value)
                else:
                    totals[key] = totals.get(key, 0.0) + sample.value
            for (name, rest), value in totals.items():
                out.add_sample(name, dict(rest), value)
            yield out


class Metrics:
    """The service's metrics in a registry of its own (several apps may live in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.uploaded = Counter(
            "shoal_upload_points", "Data points and tombstones accepted by uploads", [TENANT], registry=self.registry
        )
        self.search_seconds = Histogram(
            "shoal_search_seconds", "Search request latency", [TENANT], registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        )
        self._search_by_tenant: dict[str, Any] = {}
        # Searches of placed indexes (shoal.api.fanout), as the process fanning them out saw the nodes.
        self._failed_parts = Counter(
            "shoal_fanout_part_failures", "Parts of fanned-out searches a node did not answer, by node and why "
            "(timeout, connect, dns, status_5xx, status_4xx, bad_body)", ["node", "reason"],
            registry=self.registry,
        )
        self._hedged_parts = Counter(
            "shoal_fanout_hedged_parts", "Parts of fanned-out searches asked of a replica too because their node "
            "had not answered in time, by that node", ["node"], registry=self.registry,
        )
        self._missing_shards = Counter(
            "shoal_fanout_missing_shards", "Shards no node answered for in fanned-out searches (each search's, "
            "answered 503 or partial)", registry=self.registry,
        )
        # prometheus_client picks its value class when first imported: shared files only if the variable was set
        # then (a worker of `shoal api --workers N`, spawned with it); a variable set later changes nothing here.
        shared = getattr(values.ValueClass, "_multiprocess", False)
        self.multiprocess_dir = os.environ.get(MULTIPROC_DIR) if shared else None

    def search_timer(self, tenant: str) -> Any:
        """A context manager timing one search of `tenant`: one observation, whether the search answers or
        raises."""
        return self._search_child(tenant).time()

    def observe_search(self, tenant: str, seconds: float) -> None:
        """Record one search of `tenant` that took `seconds` (for a caller that times it itself)."""
        self._search_child(tenant).observe(seconds)

    def fanout_part_failed(self, node: str, reason: str) -> None:
        """Count one part a placed node did not answer; `reason` is one of shoal.api.fanout.FAILURE_KINDS."""
        self._failed_parts.labels(node, reason).inc()

    def fanout_hedged(self, node: str) -> None:
        """Count one part of `node` asked of a replica too (the node had not answered yet)."""
        self._hedged_parts.labels(node).inc()

    def fanout_missing(self, shards: int) -> None:
        """Count `shards` shards one fanned-out search got no answer for."""
        self._missing_shards.inc(shards)

    def _search_child(self, tenant: str) -> Any:
        # The labelled child is looked up once per tenant: labels() costs more than the observation.
        child = self._search_by_tenant.get(tenant)
        if child is None:
            child = self._search_by_tenant.setdefault(tenant, self.search_seconds.labels(tenant))
        return child

    def exposition(
        self, engine: Engine, view: MetricsView, cache: SegmentCache,
        young: list[tuple[str, str, str, int, int, float]] | None = None, young_bytes: int = 0,
    ) -> bytes:
        """The metrics in Prometheus's text format as `view` allows, with the lag of shards read from the catalog,
        the process's segment cache and its searcher's young tier (`young`: SearchService.young_tier rows;
        `young_bytes`: SearchService.young_bytes)."""
        now = CollectorRegistry()
        now.register(_Viewed(self._counted(), view))
        now.register(_LagCollector(engine, view))
        now.register(_CacheCollector(cache, young_bytes))
        now.register(_YoungCollector(young or [], view))
        return generate_latest(now)

    def _counted(self) -> Iterable[Metric]:
        """The counter and histogram families: this process's, or every worker's summed (multiprocess mode)."""
        if self.multiprocess_dir is None:
            return self.registry.collect()
        ours = {family.name for family in self.registry.collect()}
        every = MultiProcessCollector(None, path=self.multiprocess_dir).collect()
        return [family for family in every if family.name in ours]
