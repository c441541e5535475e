"""Prometheus metrics: upload rate, search latency, and lag per shard (read from the catalog at scrape)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Engine

from shoal.catalog.indexes import freshness_rows
from shoal.index.segment_cache import SegmentCache


class _LagCollector(Collector):
    """Per-shard lag of one tenant, read from the catalog when collected (a scrape shows only its tenant)."""

    def __init__(self, engine: Engine, tenant: str) -> None:
        self.engine = engine
        self.tenant = tenant

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["tenant", "index", "version", "shard"]
        built = GaugeMetricFamily("shoal_index_built_lag_seqs", "Log entries not indexed yet", labels=labels)
        served = GaugeMetricFamily("shoal_index_served_lag_seqs", "Log entries searchers do not serve", labels=labels)
        for tenant, index, version, shard, head, built_w, served_w in freshness_rows(self.engine):
            if tenant != self.tenant:
                continue
            values = [tenant, index, version, str(shard)]
            built.add_metric(values, head - built_w)
            served.add_metric(values, head - served_w)
        yield built
        yield served


class _CacheCollector(Collector):
    """The process's loaded index segments: bytes, budget and count (process-wide, no tenant in it)."""

    def __init__(self, cache: SegmentCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("shoal_searcher_cache_bytes", "Bytes of index segments loaded by this process's "
                                "searchers (estimated at load)", value=self.cache.bytes)
        yield GaugeMetricFamily("shoal_searcher_cache_budget_bytes", "The budget loaded segments are kept under "
                                "(SHOAL_SEARCHER_CACHE_BYTES)", value=self.cache.budget)
        yield GaugeMetricFamily("shoal_searcher_cache_segments", "Index segments loaded by this process's searchers",
                                value=len(self.cache))


class Metrics:
    """The service's metrics in a registry of its own (several apps may live in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.uploaded = Counter(
            "shoal_upload_points", "Data points and tombstones accepted by uploads", ["tenant"], registry=self.registry
        )
        self.search_seconds = Histogram(
            "shoal_search_seconds", "Search request latency", ["tenant"], registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        )
        self._search_by_tenant: dict[str, Any] = {}

    def search_timer(self, tenant: str) -> Any:
        """A context manager timing one search of `tenant` (the labelled child is looked up once per tenant)."""
        child = self._search_by_tenant.get(tenant)
        if child is None:
            child = self._search_by_tenant.setdefault(tenant, self.search_seconds.labels(tenant))
        return child.time()

    def exposition(self, engine: Engine, tenant: str, cache: SegmentCache) -> bytes:
        """The metrics in Prometheus's text format, with the lag of `tenant`'s shards read from the catalog and
        the process's segment cache."""
        now = CollectorRegistry()
        now.register(_LagCollector(engine, tenant))
        now.register(_CacheCollector(cache))
        return generate_latest(self.registry) + generate_latest(now)
