"""A dataset's exact figures: live vectors (its log folded by id), bytes in storage, metadata and index stats.

The log is read through the standard reader (`shoal.log.reader.read_log`: every segment checked against its
recorded checksum) and only its small columns are decoded, so the cost is O(log entries), not
O(vectors x dimensions).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from shoal.catalog.repo import SegmentRecord, list_segments
from shoal.datasets import rules
from shoal.datasets.catalog import DatasetRecord, LogTotals
from shoal.datasets.errors import not_found
from shoal.datasets.results import Dataset, DatasetStats, IndexBuild, IndexStats, MetadataStats, StorageUse
from shoal.datasets.scope import DatasetScope
from shoal.errors import NotFoundError
from shoal.log.json_text import stored_json
from shoal.log.reader import fold, read_log
from shoal.log.validation import KEY, OP
from shoal.storage.layout import dataset_dir, indexes_dir

METADATA_SAMPLE = 100_000  # live vectors whose metadata keys are counted (the first ones in seq order)
TOP_METADATA_KEYS = 50
STATS_COLUMNS = (KEY, OP, "document_id", "content", "metadata")
COUNTED_KEYS = ("language", "content_type")  # metadata keys whose values /stats counts


def metadata_value(text: Any) -> Any:
    """A vector's stored metadata decoded: JSON text as its value, other text as it is (`stored_json`: what
    filters read as its fields), anything else None."""
    return stored_json(text)


class Stats(DatasetScope):
    """Exact statistics of a dataset."""

    def stats(self, name: Any) -> DatasetStats:
        """Exact live vector count, storage bytes, metadata stats and per-shard freshness. Reads the log and
        lists the storage: StorageUnavailableError (503) while the storage cannot be reached."""
        record = self._current([self.record(name)])[0]
        segments = list_segments(self.shoal.engine, record.source_id)
        live = self._live_state(record.source_id, segments)
        log_bytes = sum(s.bytes for s in segments)
        index_bytes, index_files = self._index_bytes(record)
        mirror_bytes, _ = self._bytes_under(dataset_dir(self.tenant, record.name))
        try:
            shards = tuple(self.shoal.index_status(record.name, rules.VERSION))
        except NotFoundError:
            self._forget(record.name)
            raise not_found(record.name) from None
        totals = self.catalog.log_totals([record.source_id]).get(record.source_id, LogTotals())
        dataset = Dataset.of(record, totals, live=live.num_rows, tenant_id=self.tenant,
                             storage_location=self.storage_location(record.name))
        return DatasetStats(
            dataset_id=record.name,
            vector_count=live.num_rows,
            storage=StorageUse(log_bytes, index_bytes, index_files, mirror_bytes),
            metadata=self._metadata_stats(live, segments),
            index=IndexStats(record.index_type, record.metric_type, record.index_params, shards),
            build=self._build(record.name),
            dataset=dataset,
        )

    def _build(self, name: str) -> IndexBuild:
        """The bytes of the files serving the index (what a searcher holds in memory for it) and its last
        rebuild."""
        memory = sum(self.shoal.storage.file_sizes(self.catalog.served_files(name)).values())
        rebuild = self.catalog.last_rebuild(name)
        if rebuild is None:
            return IndexBuild(memory, None, None)
        started, finished = rebuild
        return IndexBuild(memory, finished, max(0.0, (finished - started).total_seconds()))

    def _live_state(self, source_id: int, segments: Sequence[SegmentRecord]) -> pa.Table:
        """The live vectors (last write per id, minus deletions) in seq order, up to the last listed segment."""
        if not segments:
            return pa.table({c: pa.array([], pa.string()) for c in STATS_COLUMNS})
        up_to = max(s.last_seq for s in segments)
        batches = read_log(self.shoal.engine, self.shoal.storage, source_id, 0, up_to, columns=list(STATS_COLUMNS))
        live = fold(batches)
        if live.num_rows == 0 and not live.column_names:  # every entry was compacted away
            return pa.table({c: pa.array([], pa.string()) for c in STATS_COLUMNS})
        return live

    def _metadata_stats(self, live: pa.Table, segments: Sequence[SegmentRecord]) -> MetadataStats:
        doc_ids = [d for d in live["document_id"].to_pylist() if d]
        with_content = sum(1 for c in live["content"].to_pylist() if c)
        keys: Counter[str] = Counter()
        by: dict[str, Counter[str]] = {k: Counter() for k in COUNTED_KEYS}
        with_metadata = 0
        sample = live["metadata"].slice(0, METADATA_SAMPLE).to_pylist()
        for text in sample:
            value = metadata_value(text)
            if isinstance(value, dict) and value:
                with_metadata += 1
                keys.update(value.keys())
                for k, counter in by.items():
                    if isinstance(value.get(k), str):  # a language or content type is a name
                        counter[value[k]] += 1
        return MetadataStats(
            log_entries=sum(s.upsert_count + s.tombstone_count for s in segments),  # compaction leaves gaps
            log_segments=len(segments),
            upserts=sum(s.upsert_count for s in segments),
            tombstones=sum(s.tombstone_count for s in segments),
            vectors_with_document_id=len(doc_ids),
            distinct_document_ids=len(set(doc_ids)),
            vectors_with_content=with_content,
            vectors_with_metadata=with_metadata,
            metadata_keys=dict(keys.most_common(TOP_METADATA_KEYS)),
            metadata_sampled_vectors=len(sample),
            languages=dict(by["language"].most_common(TOP_METADATA_KEYS)),
            content_types=dict(by["content_type"].most_common(TOP_METADATA_KEYS)),
        )

    def _index_bytes(self, record: DatasetRecord) -> tuple[int, int]:
        """Bytes and number of the files in storage of every generation of the dataset's index that the catalog
        references: the serving generation, one being built and the one kept for rollback (SHOAL_REINDEX_KEEP_S).
        The index folders (`indexes/{name}/1/gen-{n}/`, and `1~g{n}/` where an earlier release built
        generations) are keyed by name, so they also hold the files of a trashed or hard-deleted dataset of the
        same name: only the files the catalog's rows for this dataset's data source name count (files no row
        references, such as pruned versions awaiting GC, do not). One catalog query, one listing."""
        owned = self.catalog.index_files(record.source_id, record.name)
        if not owned:
            return 0, 0
        files = [f for f in self.shoal.storage.describe_files(f"{indexes_dir(self.tenant)}/{record.name}")
                 if f.path in owned]
        return sum(f.size for f in files), len(files)

    def _bytes_under(self, folder: str) -> tuple[int, int]:
        """Bytes and number of files anywhere under a layout-relative folder (0, 0 if there is none)."""
        files = self.shoal.storage.describe_files(folder)
        return sum(f.size for f in files), len(files)
