"""Index segments on storage: an immutable folder of one rows table plus one engine file per split.

A segment covers a set of data points of one shard (the upserts of one materialization, or the survivors of
a merge). Its rows are sorted by split, so each split's engine labels are a contiguous row range. Every file
is written once under a uuid-named folder and its sha256 recorded in the manifest entry (a
`shoal.index.manifest.SegmentEntry`); loading verifies them. Deletions never touch a segment: a version lists
deleted row numbers in a separate immutable file. Functions taking an entry accept it typed or in its JSON
form (a dict from a stored manifest).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shoal.engines import Engine, get_engine
from shoal.engines.metrics import Metric
from shoal.engines.sparse import SparseRows
from shoal.errors import CorruptArtifactError
from shoal.index.manifest import KEYS_FILE, ROWS_FILE, DeletionEntry, Manifest, SegmentEntry, SplitEntry, all_files
from shoal.index.sharding import split_keys
from shoal.log.records import IndexSpec
from shoal.log.validation import KEY, SEQ, SPARSE_INDICES, SPARSE_VALUES, VECTOR
from shoal.storage import Storage, layout

SPLIT = "__split"
# What a loaded row costs in memory beside its Arrow buffers: its key as a Python bytes object (about 40 bytes of
# header) and a reference to it; and per stored attribute, a value the searcher converts for picking hits (counted
# at a list entry's cost). The searcher's young tier estimates its rows the same way.
ROW_OVERHEAD_BYTES = 8 + 40
ATTRIBUTE_OVERHEAD_BYTES = 64
# What a loaded segment costs however few its rows, left out by the per-row counts: its Python objects (the
# LoadedSegment, its key and seq arrays' headers, its py_columns, the SegmentView and RowSource serving it, its
# share of the view), its Arrow table's schema and column objects (outside Arrow's pool), and per engine (one
# per split) the engine object and its arrays' headers. Measured as the RSS delta of loading and searching 400
# one-segment indexes of 10 rows (16-d, two stored attributes) in one searcher, divided: about 17 KB per flat or
# IVF index where the per-row counts said 4 KB; an engine restored alone: 2 to 3 KB past its file's bytes, an
# extra segment of an index: 15 KB where they said 4 KB. Rounded, so 900 tiny indexes count what they hold.
SEGMENT_OVERHEAD_BYTES = 10 << 10
ENGINE_OVERHEAD_BYTES = 4 << 10
# hnswlib allocates per graph a fixed table of 65,536 label locks (std::mutex, 40 bytes each) whatever its size:
# an HNSW engine of 10 rows took 2,627,000 bytes of RSS restored, its file 3,000.
HNSW_FIXED_BYTES = 65_536 * 40

EntryLike = SegmentEntry | Mapping[str, Any]  # a manifest entry, typed or as stored


def _digest(data: bytes | pa.Buffer) -> str:
    return "sha256:" + hashlib.sha256(memoryview(data)).hexdigest()


def _write(storage: Storage, path: str, data: bytes | pa.Buffer) -> str:
    buf = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
    storage.write_atomic(path, buf)
    return _digest(buf)


def _read(storage: Storage, path: str, checksum: str) -> pa.Buffer:
    """The bytes of the artifact a manifest records at `path`, checked against its checksum: CorruptArtifactError
    when the file is missing or its bytes are wrong. A storage that cannot be reached is no corrupt artifact:
    StorageUnavailableError (transient, retried), as `Storage.read` raises it; nor is an S3 bucket that is gone
    or credentials S3 refuses: StorageRefusedError (a ConfigurationError); any other OSError (a local
    permission or disk error) is raised as it is."""
    try:
        buf = storage.read(path)
    except FileNotFoundError as exc:  # only a missing object: `Storage.read` tells a missing bucket apart
        raise CorruptArtifactError(f"index artifact {path} referenced by its manifest is missing") from exc
    if _digest(buf) != checksum:
        raise CorruptArtifactError(f"index artifact {path} does not match its recorded checksum")
    return buf


def json_value(value: Any) -> Any:
    """An attribute value as a manifest stores it (datetimes as ISO text)."""
    return value.isoformat() if isinstance(value, dt.datetime) else value


def vectors_of(rows: pa.Table, sparse: bool, dim: int, start: int = 0, end: int | None = None) -> Any:
    """The vectors of rows[start:end] as the engines take them: float32 [n, dim] or SparseRows."""
    end = rows.num_rows if end is None else end
    if sparse:
        idx = rows[SPARSE_INDICES].slice(start, end - start).combine_chunks()
        val = rows[SPARSE_VALUES].slice(start, end - start).combine_chunks()
        return SparseRows.from_lists(idx.to_pylist(), val.to_pylist(), dim)
    col = rows[VECTOR].slice(start, end - start).combine_chunks()
    flat = col.flatten().to_numpy(zero_copy_only=False)
    return np.ascontiguousarray(flat, dtype=np.float32).reshape(end - start, dim)


def build_segment(
    storage: Storage, shard_dir: str, index: IndexSpec, sparse: bool, dim: int, rows: pa.Table
) -> SegmentEntry:
    """Write a segment for `rows` (live upserts: key, seq, attributes, vector) and return its manifest entry."""
    seg_id = uuid.uuid4()
    folder = layout.index_segment_dir(shard_dir, seg_id)
    table = _segment_table(rows, index, sparse)
    rows_checksum = _write_rows(storage, folder, table)
    keys_checksum = _write_keys(storage, folder, table)

    engine_cls = get_engine(index.algorithm)
    metric = Metric(index.metric)
    splits: list[SplitEntry] = []
    split_col = table[SPLIT].to_numpy(zero_copy_only=False)
    bounds = np.flatnonzero(split_col[1:] != split_col[:-1]) + 1 if len(split_col) else np.array([], dtype=np.int64)
    starts = [0, *bounds.tolist()] if len(split_col) else []
    ends = [*bounds.tolist(), len(split_col)] if len(split_col) else []
    for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
        engine = engine_cls.build(vectors_of(table, sparse, dim, start, end), metric, index.params)
        name = f"split-{i}.bin"
        checksum = _write(storage, f"{folder}/{name}", engine.to_bytes())
        first = table.slice(start, 1).to_pylist()[0]
        splits.append(
            SplitEntry(
                key=str(split_col[start]),
                values={a: json_value(first[a]) for a in index.split_attributes},
                start=start,
                end=end,
                file=name,
                checksum=checksum,
            )
        )
    seqs = table[SEQ].to_numpy()
    return SegmentEntry(
        id=str(seg_id),
        dir=folder,
        rows=table.num_rows,
        min_seq=int(seqs.min()) if len(seqs) else 0,
        max_seq=int(seqs.max()) if len(seqs) else 0,
        rows_checksum=rows_checksum,
        splits=tuple(splits),
        deleted=None,
        keys_checksum=keys_checksum,
    )


def _segment_table(rows: pa.Table, index: IndexSpec, sparse: bool) -> pa.Table:
    """`rows` as a segment stores them: key, seq, stored attributes, vector, split; sorted by split, then seq."""
    vector_cols = [SPARSE_INDICES, SPARSE_VALUES] if sparse else [VECTOR]
    table = rows.select([KEY, SEQ, *index.stored_attributes(), *vector_cols])
    table = table.append_column(SPLIT, split_keys(table, index.split_attributes))
    return table.take(pc.sort_indices(table, sort_keys=[(SPLIT, "ascending"), (SEQ, "ascending")]))


def _write_table(storage: Storage, path: str, table: pa.Table, **options: Any) -> str:
    """Write `table` as one uncompressed Parquet row group; its checksum."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="none", row_group_size=max(table.num_rows, 1), **options)
    return _write(storage, path, sink.getvalue())


def _read_table(storage: Storage, path: str, checksum: str, columns: list[str] | None = None) -> pa.Table:
    """A Parquet file `_write_table` wrote (only `columns` when given), checksum verified."""
    return pq.read_table(pa.BufferReader(_read(storage, path, checksum)), columns=columns)


def _write_rows(storage: Storage, folder: str, table: pa.Table) -> str:
    table = _packed(table)
    stats = [name for name in table.column_names if name != VECTOR]
    return _write_table(storage, f"{folder}/{ROWS_FILE}", table, use_dictionary=[SPLIT], write_statistics=stats)


def _write_keys(storage: Storage, folder: str, table: pa.Table) -> str:
    """Write the segment's key column alone (KEYS_FILE): a build reads the keys of every older segment of its
    shard, and the rows file of a merged segment is hundreds of megabytes to read and checksum for them."""
    return _write_table(storage, f"{folder}/{KEYS_FILE}", table.select([KEY]))


def load_keys(storage: Storage, entry: EntryLike) -> pa.Array:
    """A segment's keys in row order, checksum verified: from its keys file, or from its rows file when it was
    written without one."""
    entry = SegmentEntry.of(entry)
    if entry.keys_path is None or entry.keys_checksum is None:
        table = load_rows(storage, entry, [KEY])
    else:
        table = _read_table(storage, entry.keys_path, entry.keys_checksum)
    return table[KEY].combine_chunks()


def _packed(table: pa.Table) -> pa.Table:
    """`table` with its dense vectors as one fixed-size binary value per row (the float32 bytes), as a segment
    stores them. Parquet keeps a list column with a level per float, so a 384-d vector column decodes about
    12x slower than the same bytes stored whole (90,000 rows: 115 ms against 9, and writes 170 ms against 39);
    the searcher reads every new segment in full. A column of another type or with nulls (neither is written)
    stays as it is."""
    i = table.schema.get_field_index(VECTOR)
    col = table.column(i) if i >= 0 else None
    if (col is None or not pa.types.is_fixed_size_list(col.type) or col.type.value_type != pa.float32()
            or col.null_count):
        return table
    width = col.type.list_size * 4
    chunks = []
    for chunk in col.chunks:
        flat = np.ascontiguousarray(chunk.flatten().to_numpy(zero_copy_only=False), dtype=np.float32)
        chunks.append(pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(chunk), [None, pa.py_buffer(flat)]))
    return table.set_column(i, pa.field(VECTOR, pa.binary(width)), pa.chunked_array(chunks, pa.binary(width)))


def _unpacked(table: pa.Table) -> pa.Table:
    """A segment's rows table with its vectors as the log's fixed-size float32 lists again (no copy); tables
    written before vectors were packed come back unchanged."""
    i = table.schema.get_field_index(VECTOR)
    if i < 0 or not pa.types.is_fixed_size_binary(table.schema.field(i).type):
        return table
    col = table.column(i)
    dim = col.type.byte_width // 4
    chunks = []
    for chunk in col.chunks:
        values = pa.Array.from_buffers(pa.float32(), (chunk.offset + len(chunk)) * dim, [None, chunk.buffers()[1]])
        whole = pa.FixedSizeListArray.from_arrays(values, dim)
        chunks.append(whole.slice(chunk.offset, len(chunk)))
    kind = pa.list_(pa.float32(), dim)
    return table.set_column(i, pa.field(VECTOR, kind), pa.chunked_array(chunks, kind))


def extend_segment(
    storage: Storage, shard_dir: str, index: IndexSpec, sparse: bool, dim: int, base: EntryLike,
    base_rows: pa.Table, rows: pa.Table,
) -> SegmentEntry | None:
    """A new segment of `base`'s rows followed by `rows` (live upserts), its engine made by adding `rows` to
    `base`'s (`Engine.extend_bytes`) rather than built over all of them; None where that cannot be done (an
    index with split attributes, an algorithm that builds anew, rows of another type), found out before
    anything is written.

    `base_rows` is `base`'s rows table as loaded. Every row of `base` keeps its row number, dead ones too, so
    the caller gives the new segment `base`'s deletions; the result has none."""
    base = SegmentEntry.of(base)
    engine_cls = get_engine(index.algorithm)
    if not engine_cls.extends or index.split_attributes or len(base.splits) != 1 or not rows.num_rows:
        return None
    table = _segment_table(rows, index, sparse)
    try:
        table = table.cast(base_rows.schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError):
        return None  # a schema the base segment does not share: build anew
    split = base.splits[0]
    data = _read(storage, base.split_path(split), split.checksum).to_pybytes()
    combined = pa.concat_tables([base_rows, table])
    seg_id = uuid.uuid4()
    folder = layout.index_segment_dir(shard_dir, seg_id)
    # The rows first, the engine after, as build_segment writes them.
    rows_checksum = _write_rows(storage, folder, combined)
    keys_checksum = _write_keys(storage, folder, combined)
    engine = engine_cls.extend_bytes(data, vectors_of(table, sparse, dim), index.metric, index.params)
    if engine is None:
        return None  # not expected after the checks above; the rows file is unreferenced garbage for GC
    name = "split-0.bin"
    checksum = _write(storage, f"{folder}/{name}", engine.to_bytes())
    return SegmentEntry(
        id=str(seg_id),
        dir=folder,
        rows=combined.num_rows,
        min_seq=min(base.min_seq, int(pc.min(table[SEQ]).as_py())),
        max_seq=max(base.max_seq, int(pc.max(table[SEQ]).as_py())),
        rows_checksum=rows_checksum,
        splits=(replace(split, end=combined.num_rows, file=name, checksum=checksum),),
        deleted=None,
        keys_checksum=keys_checksum,
    )


def write_deletions(storage: Storage, entry: EntryLike, deleted: np.ndarray) -> SegmentEntry:
    """A copy of `entry` whose deletions are the sorted row numbers `deleted`, written as a new file."""
    entry = SegmentEntry.of(entry)
    if len(deleted) == 0:
        return entry.with_deletions(None)
    buf = io.BytesIO()
    np.save(buf, np.asarray(np.sort(deleted), dtype=np.int64), allow_pickle=False)
    path = f"{entry.dir}/deleted-{uuid.uuid4()}.npy"
    checksum = _write(storage, path, buf.getvalue())
    return entry.with_deletions(DeletionEntry(path, int(len(deleted)), checksum))


def read_deletions(storage: Storage, entry: EntryLike) -> np.ndarray:
    """The deleted row numbers of a manifest entry (empty when none)."""
    info = SegmentEntry.of(entry).deleted
    if info is None:
        return np.zeros(0, dtype=np.int64)
    return np.load(io.BytesIO(_read(storage, info.path, info.checksum).to_pybytes()), allow_pickle=False)


@dataclass(frozen=True)
class LoadedSplit:
    """One split of a loaded segment: its values, row range and engine."""

    key: str
    values: dict[str, Any]
    start: int
    end: int
    engine: Engine


@dataclass(frozen=True)
class LoadedSegment:
    """A segment's immutable content in memory (deletions are per version, kept apart)."""

    id: str
    rows: pa.Table
    keys: np.ndarray  # object array of encoded keys, row order
    seqs: np.ndarray
    splits: tuple[LoadedSplit, ...]
    # Columns of `rows` converted for picking values by row (lists or numpy arrays), filled by the searcher's
    # RowSource on first use and kept with the segment: every version and view that serves it shares them.
    py_columns: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # What the segment costs in memory, estimated once at load (see `load_segment`).
    nbytes: int = field(default=0, compare=False)


def load_rows(storage: Storage, entry: EntryLike, columns: list[str] | None = None) -> pa.Table:
    """A segment's rows (only `columns` when given), checksum verified; its engines are not read. What a build
    needs of the segments it rewrites or marks rows of: restoring their graphs would cost more than the rest."""
    entry = SegmentEntry.of(entry)
    return _unpacked(_read_table(storage, entry.rows_path, entry.rows_checksum, columns))


def load_segment(storage: Storage, entry: EntryLike, index: IndexSpec) -> LoadedSegment:
    """Read and verify a segment's rows and engines."""
    entry = SegmentEntry.of(entry)
    rows = load_rows(storage, entry)
    engine_cls = get_engine(index.algorithm)
    metric = Metric(index.metric)
    splits = []
    engine_bytes = 0
    for s in entry.splits:
        data = _read(storage, entry.split_path(s), s.checksum).to_pybytes()
        engine_bytes += len(data)  # an engine in memory is about the size of its file (graph or lists + vectors)
        splits.append(LoadedSplit(s.key, dict(s.values), s.start, s.end,
                                  engine_cls.from_bytes(data, metric, index.params)))
    keys = rows[KEY].to_numpy(zero_copy_only=False)
    seqs = rows[SEQ].to_numpy()
    n = rows.num_rows
    # Keys are Python bytes objects (about 40 bytes of header each); the searcher later converts each stored
    # attribute once into a numpy array or a list of Python values: counted up front at a list's cost.
    estimate = rows.nbytes + engine_bytes + seqs.nbytes + n * ROW_OVERHEAD_BYTES + rows[KEY].nbytes
    estimate += n * ATTRIBUTE_OVERHEAD_BYTES * len(index.stored_attributes())
    estimate += SEGMENT_OVERHEAD_BYTES + len(splits) * engine_overhead(engine_cls.algorithm)
    return LoadedSegment(entry.id, rows, keys, seqs, tuple(splits), nbytes=int(estimate))


def engine_overhead(algorithm: str) -> int:
    """Estimated bytes one loaded engine of `algorithm` (an engine's name, as `Engine.algorithm`) holds however
    few its rows, beside its file's bytes."""
    return ENGINE_OVERHEAD_BYTES + (HNSW_FIXED_BYTES if algorithm == "hnsw" else 0)


def manifest_files(manifests: Iterable[Manifest | Mapping[str, Any]]) -> set[str]:
    """Every storage path the segments of these version manifests (typed or as stored) reference."""
    return all_files(manifests)


def segment_files(entry: EntryLike) -> list[str]:
    """Every storage path a manifest entry (typed or as stored) references."""
    return SegmentEntry.of(entry).files()
