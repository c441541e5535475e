"""Prometheus metrics: upload rate, search latency, and lag per shard (read from the catalog at scrape)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Engine

from shoal.catalog.indexes import freshness_rows


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
    def exposition(self, engine: Engine, tenant: str) -> bytes:
        """The metrics in Prometheus's text format, with the lag of `tenant`'s shards read from the catalog."""
        lag = CollectorRegistry()
        lag.register(_LagCollector(engine, tenant))
        return generate_latest(self.registry) + generate_latest(lag)
