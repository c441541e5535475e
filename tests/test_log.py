"""The log on local storage and on S3: writes, tokens, idempotency, reading, folding, plain Parquet."""

from __future__ import annotations

import datetime as dt
import threading
import uuid

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shoal import DataPoint, DataSourceSpec, Shoal, SparseVector, Tombstone
from shoal.errors import AlreadyExistsError, CorruptSegmentError, NotFoundError

SPEC = DataSourceSpec(
    "Docs.Chunks", "1.0", 4,
    {"doc": "guid", "chunk": "int64", "text": "string", "at": "datetime", "score": "float64", "ok": "bool"},
    ["doc", "chunk"],
)
DOCS = [uuid.UUID(int=i + 1) for i in range(5)]


def point(doc: int, chunk: int, text: str, v: float) -> DataPoint:
    return DataPoint(
        {"doc": DOCS[doc], "chunk": chunk, "text": text, "at": dt.datetime(2024, 5, 1, tzinfo=dt.UTC),
         "score": v, "ok": chunk % 2 == 0},
        [v, v + 1, v + 2, v + 3],
    )


def state(shoal: Shoal, up_to: int | None = None) -> dict[tuple[str, int], str]:
    table = shoal.fold(SPEC.name, SPEC.version, up_to)
    return {(r["doc"], r["chunk"]): r["text"] for r in table.select(["doc", "chunk", "text"]).to_pylist()}


def test_round_trip_last_write_wins_and_tombstones(shoal: Shoal) -> None:
    shoal.create_data_source(SPEC)
    producer = shoal.producer(SPEC.name, SPEC.version)
    t1 = producer.upload([point(0, 0, "a", 1.0), point(0, 1, "b", 2.0), point(1, 0, "c", 3.0)])
    t2 = producer.upload([point(0, 1, "b2", 4.0), Tombstone({"doc": str(DOCS[1]), "chunk": 0})])
    t3 = producer.upload([point(1, 0, "c-again", 5.0)])
    assert (t1.seq, t2.seq, t3.seq) == (3, 5, 6)
    assert str(t2) == "Docs.Chunks/1.0@5"

    d0, d1 = str(DOCS[0]), str(DOCS[1])
    assert state(shoal, 3) == {(d0, 0): "a", (d0, 1): "b", (d1, 0): "c"}
    assert state(shoal, 5) == {(d0, 0): "a", (d0, 1): "b2"}
    assert state(shoal) == {(d0, 0): "a", (d0, 1): "b2", (d1, 0): "c-again"}

    folded = shoal.fold(SPEC.name, SPEC.version)
    assert folded["__seq"].to_pylist() == [1, 4, 6]
    assert folded["__vector"].to_pylist()[1] == [4.0, 5.0, 6.0, 7.0]
    assert folded["at"].to_pylist()[0] == dt.datetime(2024, 5, 1, tzinfo=dt.UTC)

    entries = pa.Table.from_batches(list(shoal.read_log(SPEC.name, SPEC.version, after_seq=2, up_to_seq=5)))
    assert entries["__seq"].to_pylist() == [3, 4, 5]
    assert entries["__op"].to_pylist() == ["upsert", "upsert", "delete"]
    record = shoal.get_data_source(SPEC.name, SPEC.version)
    assert record.head_seq == 6 and record.head_committed_at is not None
    segments = shoal.log_segments(SPEC.name, SPEC.version)
    assert [(s.first_seq, s.last_seq, s.upsert_count, s.tombstone_count) for s in segments] == [
        (1, 3, 3, 0), (4, 5, 1, 1), (6, 6, 1, 0)
    ]
    for s in segments:
        assert s.path.startswith(f"tenants/{shoal.tenant}/sources/Docs.Chunks/1.0/log/{s.first_seq:020d}-")
        assert shoal.storage.exists(s.path)


def test_repeated_batch_id_returns_the_original_token_and_writes_nothing(shoal: Shoal) -> None:
    shoal.create_data_source(SPEC)
    producer = shoal.producer(SPEC.name, SPEC.version)
    first = producer.upload([point(0, 0, "a", 1.0), point(0, 1, "b", 1.0)], batch_id="upstream-17")
    producer.upload([point(2, 0, "z", 1.0)])
    again = producer.upload([point(0, 0, "a", 1.0), point(0, 1, "b", 1.0)], batch_id="upstream-17")
    assert again == first and again.seq == 2
    assert shoal.get_data_source(SPEC.name, SPEC.version).head_seq == 3
    assert len(shoal.log_segments(SPEC.name, SPEC.version)) == 2
    # Another process (another Shoal) sees the same batch id as committed.
    with Shoal(shoal.settings) as other:
        repeat = [point(0, 0, "a", 1.0), point(0, 1, "b", 1.0)]
        assert other.producer(SPEC.name, SPEC.version).upload(repeat, batch_id="upstream-17") == first


def test_concurrent_uploads_share_segments_and_get_dense_tokens(shoal: Shoal) -> None:
    shoal.create_data_source(SPEC)
    producer = shoal.producer(SPEC.name, SPEC.version)
    threads, per_thread = 32, 10
    barrier = threading.Barrier(threads)
    tokens: list[int] = []
    lock = threading.Lock()

    def run(t: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            seq = producer.upload([point(t % 5, t * 1000 + i, f"{t}-{i}", float(i))]).seq
            with lock:
                tokens.append(seq)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    uploads = threads * per_thread
    assert sorted(tokens) == list(range(1, uploads + 1))
    segments = shoal.log_segments(SPEC.name, SPEC.version)
    # Group commit: one-point uploads racing each other share files and transactions.
    assert len(segments) < uploads / 2
    assert sum(s.last_seq - s.first_seq + 1 for s in segments) == uploads
    assert len(state(shoal)) == uploads


def test_sparse_source_round_trip(shoal: Shoal) -> None:
    spec = DataSourceSpec("Sparse.Words", "2", 50_00, {"id": "int64"}, ["id"], vectors_are_sparse=True)
    shoal.create_data_source(spec)
    producer = shoal.producer(spec.name, spec.version)
    producer.upload([
        DataPoint({"id": 1}, SparseVector([3, 4999, 7], [0.5, 1.5, -2.0])),
        DataPoint({"id": 2}, SparseVector([], [])),
        Tombstone({"id": 3}),
    ])
    folded = shoal.fold(spec.name, spec.version)
    assert folded["id"].to_pylist() == [1, 2]
    assert folded["__sparse_indices"].to_pylist() == [[3, 4999, 7], []]
    assert folded["__sparse_values"].to_pylist() == [[0.5, 1.5, -2.0], []]


def test_segments_are_plain_parquet_readable_by_duckdb(shoal: Shoal) -> None:
    shoal.create_data_source(SPEC)
    producer = shoal.producer(SPEC.name, SPEC.version)
    n = 300
    vectors = np.random.default_rng(1).random((n, 4), dtype=np.float32)
    producer.upload_columns(vectors, {
        "doc": [str(DOCS[i % 5]) for i in range(n)], "chunk": np.arange(n), "text": [f"t{i}" for i in range(n)],
        "at": [dt.datetime(2024, 1, 1, tzinfo=dt.UTC)] * n, "score": np.linspace(0, 1, n), "ok": np.ones(n, bool),
    })
    segment = shoal.log_segments(SPEC.name, SPEC.version)[0]
    raw = shoal.storage.read(segment.path)
    with_pyarrow = pq.read_table(pa.BufferReader(raw))
    con = duckdb.connect()
    local = shoal.storage.path(segment.path) if shoal.storage.local else None
    if local is None:
        path = f"{shoal.settings.data_dir}/seg.parquet"
        shoal.settings.data_dir.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(raw.to_pybytes())
        local = path
    rows = con.execute(
        f"SELECT __seq_offset, chunk, text, __vector FROM read_parquet('{local}') ORDER BY __seq_offset"
    ).fetchall()
    assert len(rows) == n
    assert [r[1] for r in rows] == list(range(n))
    assert [r[2] for r in rows] == [f"t{i}" for i in range(n)]
    np.testing.assert_array_equal(np.array([r[3] for r in rows], dtype=np.float32), vectors)
    assert with_pyarrow.schema.field("__vector").type == pa.list_(pa.float32(), 4)


def test_create_get_list_drop(shoal: Shoal) -> None:
    a = shoal.create_data_source(SPEC)
    assert shoal.create_data_source(SPEC, exist_ok=True).id == a.id
    # The attribute order is the definition's (it is the column order of every segment).
    assert list(shoal.get_data_source(SPEC.name, SPEC.version).spec.attribute_types) == list(SPEC.attribute_types)
    with pytest.raises(AlreadyExistsError, match="already exists"):
        shoal.create_data_source(SPEC)
    other = DataSourceSpec(SPEC.name, SPEC.version, 8, {"id": "int64"}, ["id"])
    with pytest.raises(AlreadyExistsError, match="another definition"):
        shoal.create_data_source(other, exist_ok=True)
    shoal.create_data_source(DataSourceSpec(SPEC.name, "2.0", 8, {"id": "int64"}, ["id"]))
    assert [(r.spec.name, r.spec.version) for r in shoal.list_data_sources()] == [
        ("Docs.Chunks", "1.0"), ("Docs.Chunks", "2.0")
    ]
    shoal.producer(SPEC.name, SPEC.version).upload([point(0, 0, "a", 1.0)])
    files = shoal.storage.list_files(shoal.log_dir(SPEC.name, SPEC.version))
    assert len(files) == 1
    assert shoal.drop_data_source(SPEC.name, SPEC.version) == 1
    # The drop queued the file; GC deletes it once the grace period (searchers may still read it) ends.
    shoal.collect_garbage(now=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=shoal.settings.gc_grace_s + 1))
    assert shoal.storage.list_files(shoal.log_dir(SPEC.name, SPEC.version)) == []
    with pytest.raises(NotFoundError):
        shoal.get_data_source(SPEC.name, SPEC.version)
    assert [(r.spec.name, r.spec.version) for r in shoal.list_data_sources()] == [("Docs.Chunks", "2.0")]


def test_tenants_are_isolated(make_settings, storage_kind: str) -> None:  # type: ignore[no-untyped-def]
    with Shoal(make_settings(storage_kind)) as a, Shoal(make_settings(storage_kind)) as b:
        a.create_data_source(SPEC)
        a.producer(SPEC.name, SPEC.version).upload([point(0, 0, "a", 1.0)])
        assert b.list_data_sources() == []
        with pytest.raises(NotFoundError):
            b.producer(SPEC.name, SPEC.version)
        b.create_data_source(SPEC)
        assert b.get_data_source(SPEC.name, SPEC.version).head_seq == 0
        assert state(b) == {}


def test_a_corrupt_segment_is_detected(local_shoal: Shoal) -> None:
    local_shoal.create_data_source(SPEC)
    local_shoal.producer(SPEC.name, SPEC.version).upload([point(0, 0, "a", 1.0)])
    segment = local_shoal.log_segments(SPEC.name, SPEC.version)[0]
    path = local_shoal.storage.path(segment.path)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptSegmentError, match="checksum"):
        local_shoal.fold(SPEC.name, SPEC.version)


def test_catalog_times_come_back_in_utc_whatever_zone_the_session_has(
    make_shoal, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    """psycopg hands timestamptz values over in the session's zone: with a server, database or client (PGTZ) set
    to another one, `shoal source list --json`, the trash and the dataset API answered +14:00 beside +00:00."""
    monkeypatch.setenv("PGTZ", "Pacific/Kiritimati")  # libpq's way to start every session in that zone
    shoal = make_shoal()
    shoal.create_data_source(SPEC)
    shoal.producer(SPEC.name, SPEC.version).upload([point(0, 0, "a", 1.0)])
    record = shoal.get_data_source(SPEC.name, SPEC.version)
    assert record.head_committed_at is not None and record.created_at is not None
    assert record.head_committed_at.utcoffset() == dt.timedelta(0)
    assert record.created_at.utcoffset() == dt.timedelta(0)
