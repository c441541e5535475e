"""Producers: upload batches to one data source through the process's log writer (group commit)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from shoal.catalog.repo import SourceRecord
from shoal.errors import Problem, ValidationError
from shoal.log.records import DataPoint, DataSourceSpec, Tombstone, WriteToken, storable_text
from shoal.log.validation import columns_to_table, points_to_table
from shoal.log.writer import LogWriter

# Batch ids Shoal gives its own batches start with these (a client's batch id may not, or it would pass for one
# of them): the broker consumer's `msg:{message id}` (shoal.intake.topology.BATCH_ID_PREFIX) and retention's
# `shoal-retention:{head}:{n}` (shoal.log.retention.BATCH_PREFIX). Spelled out here so the Python API does not
# import the broker client; tests/test_batch_ids.py checks they are the same.
RESERVED_PREFIXES = ("msg:", "shoal-retention:")


class Producer:
    """Uploads batches to one data source. Thread-safe; concurrent uploads share commits."""

    def __init__(self, source: SourceRecord, writer: LogWriter, max_batch_points: int) -> None:
        self.source = source
        self._writer = writer
        self._max = max_batch_points

    @property
    def spec(self) -> DataSourceSpec:
        """The data source's definition batches are validated against."""
        return self.source.spec

    def _token(self, seq: int) -> WriteToken:
        return WriteToken(seq, self.source.spec.name, self.source.spec.version)

    def upload(self, items: Sequence[DataPoint | Tombstone], *, batch_id: str | None = None) -> WriteToken:
        """Append a batch of data points and tombstones, all or nothing.

        Returns once the batch is durable and committed; its token is the seq of its last entry. A batch
        id that already committed returns the original token and writes nothing when this is the same batch
        (a repeat), and is refused with BatchIdReusedError (a ValidationError) when it is another one. A batch
        id may not start with a prefix Shoal keeps for its own batches (RESERVED_PREFIXES).
        """
        table = points_to_table(self.spec, items, self._max)
        return self._token(self._writer.submit(table, check_batch_id(batch_id, client=True)))

    def upload_columns(
        self,
        vectors: np.ndarray,
        attributes: Mapping[str, Sequence[Any] | np.ndarray | pa.Array],
        *,
        batch_id: str | None = None,
    ) -> WriteToken:
        """Append a columnar batch of upserts: `vectors` [n, dim] and one column per attribute."""
        table = columns_to_table(self.spec, vectors, attributes, self._max)
        return self._token(self._writer.submit(table, check_batch_id(batch_id, client=True)))

    def append_tables(
        self, batches: Sequence[tuple[pa.Table, str | None]], *, client: bool = False
    ) -> list[WriteToken]:
        """Append batches already validated against this source (by `shoal.log.validation` or the intake codec),
        each all or nothing under its own batch id, sharing commits; their tokens, in order. A batch id that
        already committed returns its original token and writes nothing for the same batch, and refuses
        another (BatchIdReusedError, that batch alone: the others are committed; the first failure is raised).

        `client`: the batch ids came from a client (an HTTP `Idempotency-Key`), so one starting with a prefix
        Shoal keeps for its own batches is refused, as `upload` refuses it; without it they are taken for
        Shoal's own (the broker consumer's `msg:` ids)."""
        checked = [(table, check_batch_id(batch_id, client=client)) for table, batch_id in batches]
        return [self._token(seq) for seq in self._writer.submit_many(checked)]

    def delete(
        self, keys: Mapping[str, Sequence[Any] | np.ndarray | pa.Array], *, batch_id: str | None = None
    ) -> WriteToken:
        """Append tombstones for the keys given as one column per permanent attribute."""
        table = columns_to_table(self.spec, None, keys, self._max, delete=True)
        return self._token(self._writer.submit(table, check_batch_id(batch_id, client=True)))


def check_batch_id(batch_id: str | None, *, client: bool) -> str | None:
    """`batch_id` unchanged when the catalog can store it (and, from a `client`, when it does not pass for one of
    Shoal's own), else ValidationError naming batch_id. Checked before the batch is queued: the log writer commits
    many producers' batches in one transaction, so an id Postgres refuses (NUL, a lone surrogate) would fail
    every batch sharing that commit, not only its own."""
    if batch_id is None:
        return None
    if not isinstance(batch_id, str) or not 1 <= len(batch_id) <= 200:
        raise ValidationError(Problem("batch id must be a string of 1 to 200 characters", attribute="batch_id"))
    if not storable_text(batch_id):
        raise ValidationError(Problem(
            f"batch id must be valid Unicode without NUL characters (Postgres stores neither a lone surrogate nor "
            f"NUL), got {batch_id!r}", attribute="batch_id"))
    if client:
        # A client's `msg:order-7` would make broker message `order-7` pass for a redelivery (never written);
        # its `shoal-retention:{head}:0` would make retention's expiry at that head pass for done.
        reserved = next((p for p in RESERVED_PREFIXES if batch_id.startswith(p)), None)
        if reserved is not None:
            raise ValidationError(Problem(
                f"batch id must not start with {reserved!r}: Shoal gives its own batches ids with that prefix, "
                f"got {batch_id[:50]!r}", attribute="batch_id"))
    return batch_id
