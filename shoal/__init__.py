"""Shoal: an event-driven ingestion pipeline for vector data."""

from shoal.client import Producer, Shoal
from shoal.log.records import (
    AttributeType,
    DataPoint,
    DataSourceSpec,
    SparseVector,
    Tombstone,
    WriteToken,
)

__all__ = [
    "AttributeType",
    "DataPoint",
    "DataSourceSpec",
    "Producer",
    "Shoal",
    "SparseVector",
    "Tombstone",
    "WriteToken",
]
