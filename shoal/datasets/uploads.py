"""Writing vectors into a dataset: checked as a whole, appended all or nothing, acknowledged with a write token."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shoal.datasets import rules
from shoal.datasets.catalog import DatasetRecord, LogTotals
from shoal.datasets.errors import DatasetError, ErrorCode, invalid, not_found, problems_of
from shoal.datasets.live import live_ids
from shoal.datasets.results import Upserted
from shoal.datasets.scope import DatasetScope
from shoal.errors import NotFoundError, ValidationError
from shoal.log.records import DataPoint


class Uploads(DatasetScope):
    """Upsert vectors into a dataset."""

    def upsert(self, name: Any, vectors: Sequence[Mapping[str, Any]]) -> Upserted:
        """Append the vectors (an id already there is replaced), all or nothing, once durable; the batch's
        write token. A refused batch writes nothing."""
        record = self.record(name)
        if not vectors:
            raise invalid("vectors must not be empty", field="vectors")
        most = self.shoal.settings.max_batch_points
        if len(vectors) > most:  # before any vector is checked or the quota read, as every upload path does
            raise invalid(f"the batch holds {len(vectors)} vectors, more than the configured maximum {most} "
                          "(SHOAL_MAX_BATCH_POINTS); nothing written", field="vectors")
        for i, v in enumerate(vectors):  # a wrong width is its own code, reported before any other problem
            values = v.get("values")
            if not isinstance(values, list | tuple) or len(values) != record.dimensions:
                got = len(values) if isinstance(values, list | tuple) else None
                raise DatasetError(
                    ErrorCode.INVALID_DIMENSIONS,
                    f"vector {i}: expected {record.dimensions} values, got {got}",
                    {"position": i, "expected": record.dimensions, "got": got},
                )
        problems: list[str] = []
        points = []
        for i, v in enumerate(vectors):
            vid = v.get("id")
            if not rules.is_text(vid) or not 1 <= len(vid) <= rules.MAX_VECTOR_ID:
                problems.append(f"vector {i}: id must be a string of 1 to {rules.MAX_VECTOR_ID} characters")
            for field in ("document_id", "content"):
                if v.get(field) is not None and not rules.is_text(v.get(field)):
                    problems.append(f"vector {i}: {field} must be null or a string")
            meta = v.get("metadata")
            try:
                rules.check_metadata(meta, "metadata", rules.MAX_VECTOR_METADATA_BYTES, nul=True)
            except DatasetError as exc:
                problems.append(f"vector {i}: {exc.message}")
                meta = None
            attrs = {
                "id": vid,
                "document_id": v.get("document_id") or "",
                "content": v.get("content") or "",
                "metadata": rules.json_text(meta),
            }
            points.append(DataPoint(attrs, v["values"]))
        if problems:
            raise invalid(f"invalid vectors, nothing written: {'; '.join(problems[:10])}", problems=problems[:100])
        self._check_quota(record, [v["id"] for v in vectors])
        try:
            self.shoal.check_backpressure(record.name, rules.VERSION)
            token = self.shoal.producer(record.name, rules.VERSION).upload(points)
        except NotFoundError:
            self._forget(record.name)
            raise not_found(record.name) from None
        except ValidationError as exc:
            raise invalid(str(exc), problems=problems_of(exc)[:100]) from None
        return Upserted(record.name, len(points), token.seq)

    def _check_quota(self, record: DatasetRecord, ids: Sequence[str]) -> None:
        """QUOTA_EXCEEDED (nothing written) when the batch would leave more live vectors than the dataset's
        `metadata.quota_limit`; ids already live are replaced and count once. Checked against the log's state
        before the write: uploads racing each other may pass it together."""
        # The quota as the catalog holds it now, not as a cached entry does: an upload after a PUT that lowered
        # it answered is checked against the lowered one, whatever another process cached.
        record = self.catalog.get(record.name)  # DATASET_NOT_FOUND if it went meanwhile
        limit = rules.quota_limit(record.metadata)
        if limit is None:
            return
        totals = self.catalog.log_totals([record.source_id]).get(record.source_id, LogTotals())
        live = live_ids(self.shoal.engine, self.shoal.storage, record.source_id, totals.head) if totals.head else set()
        new = set(ids) - live
        if len(live) + len(new) > limit:
            why = (f"{len(new)} new vectors would exceed it" if len(live) <= limit
                   else "it holds more than its quota already (the quota was lowered): delete vectors first")
            raise DatasetError(
                ErrorCode.QUOTA_EXCEEDED,
                f"dataset {record.name!r} holds {len(live)} vectors and its quota_limit is {limit}: {why}; "
                "nothing written",
                {"dataset_id": record.name, "field": "metadata.quota_limit", "quota_limit": limit,
                 "vector_count": len(live), "new_vectors": len(new)},
            )
