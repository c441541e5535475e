"""Index segment files: dense vectors are stored packed (one fixed-size binary value per row) and read back as
the log's float32 lists, bit for bit; segments written before that (a list column) still load and extend; the
keys are also stored alone, for builds."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs
import pyarrow.parquet as pq
import pytest

from shoal.errors import CorruptArtifactError
from shoal.index.manifest import SegmentEntry
from shoal.index.segment import _digest, build_segment, extend_segment, load_keys, load_rows, load_segment
from shoal.log.records import IndexSpec
from shoal.log.validation import KEY, SEQ, VECTOR
from shoal.storage import Storage

DIM = 24


def _rows(start: int, n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, DIM)).astype(np.float32)
    return pa.table({
        KEY: pa.array([f"k{i}".encode() for i in range(start, start + n)], pa.binary()),
        SEQ: pa.array(np.arange(start + 1, start + n + 1, dtype=np.int64)),
        "id": pa.array(np.arange(start, start + n, dtype=np.int64)),
        VECTOR: pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), DIM),
    })


def _spec(algorithm: str) -> IndexSpec:
    return IndexSpec("segs", "1", "src", "1", algorithm=algorithm, metric="cosine", id_attributes=["id"])


def _vectors(table: pa.Table) -> np.ndarray:
    col = table[VECTOR].combine_chunks()
    assert col.type == pa.list_(pa.float32(), DIM)  # the log's type, whatever the file holds
    return col.flatten().to_numpy().reshape(-1, DIM)


@pytest.mark.parametrize("algorithm", ["flat", "hnsw"])
def test_segment_vectors_are_stored_packed_and_read_back_unchanged(tmp_path: Path, algorithm: str) -> None:
    storage = Storage(pa.fs.LocalFileSystem(), str(tmp_path), local=True)
    rows = _rows(0, 300, seed=1)
    # A sliced, multi-chunk input: packing must respect each chunk's offset.
    rows = pa.concat_tables([rows.slice(0, 120), rows.slice(120, 180)])
    spec = _spec(algorithm)
    entry = build_segment(storage, "shard-0", spec, False, DIM, rows)
    stored = pq.read_schema(storage.path(entry.rows_path))
    assert stored.field(VECTOR).type == pa.binary(DIM * 4)
    loaded = load_segment(storage, entry, spec)
    np.testing.assert_array_equal(_vectors(loaded.rows), _vectors(rows))
    np.testing.assert_array_equal(_vectors(load_rows(storage, entry)), _vectors(rows))
    assert load_rows(storage, entry, columns=[KEY]).column_names == [KEY]
    # The engine answers each row's own vector with that row.
    _, labels = loaded.splits[0].engine.search(_vectors(rows)[:50], 1)
    np.testing.assert_array_equal(labels[:, 0], np.arange(50))

    if algorithm == "hnsw":  # an extension keeps the base rows' numbers and stores everything packed again
        more = _rows(300, 40, seed=2)
        grown = extend_segment(storage, "shard-0", spec, False, DIM, entry, loaded.rows, more)
        assert grown is not None and grown.rows == 340
        assert pq.read_schema(storage.path(grown.rows_path)).field(VECTOR).type == pa.binary(DIM * 4)
        again = load_segment(storage, grown, spec)
        np.testing.assert_array_equal(_vectors(again.rows), np.vstack([_vectors(rows), _vectors(more)]))


def test_segments_written_with_a_list_column_still_load_and_extend(tmp_path: Path) -> None:
    storage = Storage(pa.fs.LocalFileSystem(), str(tmp_path), local=True)
    spec = _spec("hnsw")
    rows = _rows(0, 200, seed=3)
    entry = build_segment(storage, "shard-0", spec, False, DIM, rows)
    # Rewrite the rows file as segments were written before vectors were packed: the list column as is.
    path = storage.path(entry.rows_path)
    table = pq.read_table(path).set_column(3, pa.field(VECTOR, pa.list_(pa.float32(), DIM)), rows[VECTOR])
    pq.write_table(table, path, compression="none")
    old = replace(entry, rows_checksum=_digest(Path(path).read_bytes()))
    assert pq.read_schema(path).field(VECTOR).type == pa.list_(pa.float32(), DIM)
    loaded = load_segment(storage, old, spec)
    np.testing.assert_array_equal(_vectors(loaded.rows), _vectors(rows))
    grown = extend_segment(storage, "shard-0", spec, False, DIM, old, loaded.rows, _rows(200, 30, seed=4))
    assert grown is not None
    np.testing.assert_array_equal(_vectors(load_segment(storage, grown, spec).rows)[:200], _vectors(rows))
    # The checksum still guards the file.
    with pytest.raises(CorruptArtifactError, match="does not match its recorded checksum"):
        load_segment(storage, entry, spec)


def test_builds_read_a_segments_keys_from_its_keys_file(tmp_path: Path) -> None:
    """A segment carries its keys alone (keys.parquet, checksummed, referenced by the manifest entry so that GC
    keeps it); a segment written without one gives its keys from the rows file."""
    storage = Storage(pa.fs.LocalFileSystem(), str(tmp_path), local=True)
    spec = _spec("hnsw")
    rows = _rows(0, 150, seed=5)
    entry = build_segment(storage, "shard-0", spec, False, DIM, rows)
    assert entry.keys_path is not None and entry.keys_path in entry.files()
    assert SegmentEntry.from_json(entry.to_json()) == entry  # stored and read back
    assert pq.read_schema(storage.path(entry.keys_path)).names == [KEY]
    keys = load_keys(storage, entry)
    assert keys.equals(load_rows(storage, entry, [KEY])[KEY].combine_chunks())
    assert sorted(keys.to_pylist()) == sorted(rows[KEY].to_pylist())
    grown = extend_segment(storage, "shard-0", spec, False, DIM, entry, load_rows(storage, entry), _rows(150, 20, 6))
    assert grown is not None and grown.keys_path is not None
    assert load_keys(storage, grown).equals(load_rows(storage, grown, [KEY])[KEY].combine_chunks())

    # Written before keys files: the entry has no keys checksum, its stored form no such key.
    old = replace(entry, keys_checksum=None)
    assert "keys_checksum" not in old.to_json() and old.keys_path is None
    assert load_keys(storage, old).equals(keys)

    # The checksum guards the keys file too.
    Path(storage.path(entry.keys_path)).write_bytes(b"not the keys")
    with pytest.raises(CorruptArtifactError, match="does not match its recorded checksum"):
        load_keys(storage, entry)
