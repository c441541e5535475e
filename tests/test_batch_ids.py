"""Batch ids: only a repeat of a batch gets its token back (another batch under the id is refused, that batch
alone); clients cannot take the ids Shoal gives its own batches; a float key's -0.0 is its 0.0."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable

import httpx
import numpy as np
import pyarrow as pa
import pytest
from conftest import wait_for
from sqlalchemy import update

from shoal import DataPoint, DataSourceSpec, Shoal, Tombstone
from shoal.catalog.locks import lock_source
from shoal.catalog.models import ProducerBatch
from shoal.config.settings import Settings
from shoal.errors import BatchIdReusedError, ConflictError, ValidationError
from shoal.intake import producer as producer_module
from shoal.intake import topology
from shoal.intake.codec import ARROW, encode_arrow
from shoal.log import retention
from shoal.log.validation import columns_to_table, key_strings, points_to_table
from shoal.log.writer import batch_fingerprint

SPEC = DataSourceSpec("Batches", "1", 3, {"id": "int64", "title": "string"}, ["id"])
VECTORS = np.array([[1.0, 0.5, -1.0], [2.0, 0.5, -1.0], [3.0, 0.5, -1.0]], dtype=np.float32)


def points(ids: list[int]) -> list[DataPoint]:
    return [DataPoint({"id": i, "title": f"t{i}"}, VECTORS[i - 1].tolist()) for i in ids]


def json_points(ids: list[int]) -> list[dict[str, object]]:
    return [
        {"attributes": [{"key": "id", "value": {"int64": i}}, {"key": "title", "value": {"string": f"t{i}"}}],
         "vector": {"isSparse": False, "coordinates": VECTORS[i - 1].tolist()}}
        for i in ids
    ]


def live_ids(shoal: Shoal, spec: DataSourceSpec = SPEC) -> list[int]:
    return sorted(shoal.fold(spec.name, spec.version).column("id").to_pylist())


def head(shoal: Shoal, spec: DataSourceSpec = SPEC) -> int:
    return shoal.get_data_source(spec.name, spec.version).head_seq


# -- a batch id reused with another batch ------------------------------------------------------------------


def test_an_idempotency_key_reused_with_another_body_is_refused(served: tuple[str, Settings]) -> None:
    """The second body under a key is neither stored nor acknowledged as if it were: 400 naming the key. A
    repeat of the first body, JSON or Arrow, still gets the first token and writes nothing."""
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(SPEC)
        first = http.post("/api/v1/upload/Batches/1", json=json_points([1]), headers={"Idempotency-Key": "k1"})
        assert first.status_code == 200 and first.headers["X-Shoal-Write-Token"] == "1", first.text

        other = http.post("/api/v1/upload/Batches/1", json=json_points([2, 3]), headers={"Idempotency-Key": "k1"})
        assert other.status_code == 400, other.text
        assert "X-Shoal-Write-Token" not in other.headers
        message = other.json()["errorMessages"][0]
        assert "'k1'" in message and "already used for another batch" in message, message
        assert live_ids(shoal) == [1] and head(shoal) == 1

        again = http.post("/api/v1/upload/Batches/1", json=json_points([1]), headers={"Idempotency-Key": "k1"})
        body = encode_arrow(VECTORS[:1], {"id": [1], "title": ["t1"]})
        as_arrow = http.post("/api/v1/upload/Batches/1", content=body,
                             headers={"Content-Type": ARROW, "Idempotency-Key": "k1"})
        for r in (again, as_arrow):
            assert r.status_code == 200 and r.headers["X-Shoal-Write-Token"] == "1", r.text
        assert head(shoal) == 1


def test_an_idempotency_key_may_not_take_a_prefix_shoal_keeps(served: tuple[str, Settings]) -> None:
    """`Idempotency-Key: msg:order-7` would make broker message `order-7` pass for a redelivery (never
    written): refused 400 naming the prefix, and nothing written; an ordinary key is taken."""
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(SPEC)
        for key in ("msg:order-7", "shoal-retention:4:0"):
            r = http.post("/api/v1/upload/Batches/1", json=json_points([1]), headers={"Idempotency-Key": key})
            assert r.status_code == 400, r.text
            assert f"must not start with '{key.split(':')[0]}:'" in r.json()["errorMessages"][0], r.text
        assert head(shoal) == 0
        r = http.post("/api/v1/upload/Batches/1", json=json_points([1]), headers={"Idempotency-Key": "order-7"})
        assert r.status_code == 200, r.text


def test_python_uploads_refuse_another_batch_under_a_known_id(make_shoal: Callable[..., Shoal]) -> None:
    shoal = make_shoal()
    shoal.create_data_source(SPEC)
    producer = shoal.producer(SPEC.name, SPEC.version)
    first = producer.upload(points([1, 2]), batch_id="upstream-17")
    # The same batch in another form is a repeat: the columnar path validates it to the same content.
    assert producer.upload_columns(VECTORS[:2], {"id": [1, 2], "title": ["t1", "t2"]}, batch_id="upstream-17") == first
    for attempt in (
        lambda: producer.upload(points([1, 3]), batch_id="upstream-17"),
        lambda: producer.upload_columns(VECTORS[:2] * 2, {"id": [1, 2], "title": ["t1", "t2"]}, batch_id="upstream-17"),
        lambda: producer.delete({"id": [1, 2]}, batch_id="upstream-17"),
    ):
        with pytest.raises(BatchIdReusedError) as err:
            attempt()
        assert isinstance(err.value, ValidationError) and not isinstance(err.value, ConflictError)
        assert err.value.batch_id == "upstream-17" and err.value.problems[0].attribute == "batch_id"
    assert head(shoal) == 2 and live_ids(shoal) == [1, 2]
    # Tombstones repeat like any batch.
    gone = producer.delete({"id": [2]}, batch_id="drop-2")
    assert producer.upload([Tombstone({"id": 2})], batch_id="drop-2") == gone and head(shoal) == 3


def test_a_reused_id_fails_only_its_own_batch_in_a_group_commit(make_shoal: Callable[..., Shoal]) -> None:
    """Uploads of several callers queued behind one commit share the next one; the one reusing a batch id with
    another batch is refused, the others are committed and acknowledged in that same commit."""
    shoal = make_shoal()
    shoal.create_data_source(SPEC)
    producer = shoal.producer(SPEC.name, SPEC.version)
    producer.upload(points([1]), batch_id="taken")
    record = shoal.get_data_source(SPEC.name, SPEC.version)
    writer = shoal.runtime.writer(record)
    outcomes: dict[str, object] = {}

    def upload(name: str, ids: list[int], batch_id: str | None) -> None:
        try:
            outcomes[name] = producer.upload(points(ids), batch_id=batch_id).seq
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            outcomes[name] = exc

    # Hold the source's row lock so that the first upload's commit waits on it and the others queue up behind
    # it; released, they all go in the next commit together.
    commits = writer.commits
    with shoal.engine.begin() as holder:
        lock_source(holder, record.id)
        leader = threading.Thread(target=upload, args=("leader", [2], None))
        leader.start()
        wait_for(lambda: writer._busy, 30, "the first upload to lead a commit")  # noqa: SLF001
        threads = [
            threading.Thread(target=upload, args=args)
            for args in [("fresh", [3], "fresh"), ("reused", [2, 3], "taken"), ("plain", [1], None),
                         ("twin", [3], "fresh"), ("pending-reused", [1], "fresh")]
        ]
        for t in threads:
            t.start()
            # One at a time, so the batches queue in this order (which of two batches under one id came first).
            wait_for(lambda n=threads.index(t) + 1: len(writer._queue) == n, 30, "the upload to queue")  # noqa: SLF001
    for t in [leader, *threads]:
        t.join(60)
    assert writer.commits == commits + 2
    assert outcomes["leader"] == 2
    assert outcomes["fresh"] == 3 and outcomes["twin"] == 3  # a repeat within the commit: the first one's token
    assert outcomes["plain"] == 4
    for name, batch_id in [("reused", "taken"), ("pending-reused", "fresh")]:
        assert isinstance(outcomes[name], BatchIdReusedError), outcomes[name]
        assert outcomes[name].batch_id == batch_id  # type: ignore[union-attr]
    assert head(shoal) == 4 and live_ids(shoal) == [1, 2, 3]


def test_a_batch_id_committed_before_fingerprints_keeps_answering_any_batch(make_shoal: Callable[..., Shoal]) -> None:
    """Rows from before the fingerprint column have none: any batch under their id is still taken for a repeat."""
    shoal = make_shoal()
    shoal.create_data_source(SPEC)
    producer = shoal.producer(SPEC.name, SPEC.version)
    first = producer.upload(points([1]), batch_id="old")
    with shoal.engine.begin() as conn:
        conn.execute(update(ProducerBatch).where(ProducerBatch.batch_id == "old").values(fingerprint=None))
    assert producer.upload(points([2, 3]), batch_id="old") == first
    assert head(shoal) == 1 and live_ids(shoal) == [1]


def test_fingerprints_move_with_their_batches_when_the_log_is_compacted(make_shoal: Callable[..., Shoal]) -> None:
    shoal = make_shoal()
    shoal.create_data_source(SPEC)
    producer = shoal.producer(SPEC.name, SPEC.version)
    tokens = [producer.upload(points([i]), batch_id=f"b{i}") for i in (1, 2, 3)]
    assert shoal.compact(SPEC.name, SPEC.version).changed
    assert len(shoal.log_segments(SPEC.name, SPEC.version)) == 1
    assert [producer.upload(points([i]), batch_id=f"b{i}") for i in (1, 2, 3)] == tokens
    with pytest.raises(BatchIdReusedError):
        producer.upload(points([2]), batch_id="b1")
    assert head(shoal) == 3


def test_fingerprints_are_of_content_not_of_layout() -> None:
    table = points_to_table(SPEC, [*points([1]), Tombstone({"id": 2})], 10)
    same = [
        columns_to_table(SPEC, VECTORS[:1], {"id": np.array([1]), "title": pa.array(["t1"])}, 10),
        pa.concat_tables([table.slice(0, 1), table.slice(1)]),  # chunked
        pa.concat_tables([table, table]).slice(2),  # sliced: buffers start past the rows
    ]
    fingerprint = batch_fingerprint(table)
    assert fingerprint.startswith("sha256:")
    assert batch_fingerprint(same[0]) == batch_fingerprint(table.slice(0, 1))
    assert batch_fingerprint(same[1]) == batch_fingerprint(same[2]) == fingerprint
    for other in (points([1, 2]), [*points([1]), Tombstone({"id": 3})], [DataPoint({"id": 1, "title": "t1 "},
                                                                                    VECTORS[0].tolist())]):
        assert batch_fingerprint(points_to_table(SPEC, other, 10)) != fingerprint


# -- Shoal's own batch ids ---------------------------------------------------------------------------------


def test_the_reserved_prefixes_are_the_ones_shoal_uses() -> None:
    assert set(producer_module.RESERVED_PREFIXES) == {topology.BATCH_ID_PREFIX, retention.BATCH_PREFIX}


@pytest.mark.parametrize("batch_id", ["msg:order-7", "shoal-retention:4:0"])
def test_a_client_batch_id_may_not_pass_for_one_of_shoals(make_shoal: Callable[..., Shoal], batch_id: str) -> None:
    shoal = make_shoal()
    shoal.create_data_source(SPEC)
    producer = shoal.producer(SPEC.name, SPEC.version)
    table = points_to_table(SPEC, points([1]), 10)
    for attempt in (
        lambda: producer.upload(points([1]), batch_id=batch_id),
        lambda: producer.upload_columns(VECTORS[:1], {"id": [1], "title": ["t1"]}, batch_id=batch_id),
        lambda: producer.delete({"id": [1]}, batch_id=batch_id),
        lambda: producer.append_tables([(table, batch_id)], client=True),
    ):
        with pytest.raises(ValidationError) as err:
            attempt()
        problem = err.value.problems[0]
        assert problem.attribute == "batch_id" and repr(batch_id.split(":")[0] + ":") in problem.rule, str(err.value)
    assert head(shoal) == 0
    # Shoal's own writers still use them (the broker consumer appends its messages this way).
    assert producer.append_tables([(table, "msg:order-7")])[0].seq == 1


@pytest.mark.parametrize("fingerprinted", [False, True])
def test_retention_is_not_fooled_by_a_batch_holding_its_batch_id(
    make_shoal: Callable[..., Shoal], fingerprinted: bool
) -> None:
    """A batch committed under the id retention's expiry will take (a client's, from before such ids were
    refused: without a fingerprint it is answered to the expiry as a repeat, with one it refuses the expiry's
    batch) does not pass for the expiry: retention expires the points anyway, under another id, and says how
    many it expired."""
    shoal = make_shoal()
    spec = DataSourceSpec("Retained", "1", 3, {"id": "int64", "title": "string"}, ["id"],
                          custom_metadata={"retention_days": 1})
    shoal.create_data_source(spec)
    producer = shoal.producer(spec.name, spec.version)
    producer.upload(points([1, 2, 3]))
    producer.append_tables([(points_to_table(spec, points([3]), 10), f"{retention.BATCH_PREFIX}4:0")])
    assert head(shoal, spec) == 4
    if not fingerprinted:
        with shoal.engine.begin() as conn:
            conn.execute(update(ProducerBatch).values(fingerprint=None))
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=2)

    result = shoal.apply_retention(spec.name, spec.version, now=later)
    assert live_ids(shoal, spec) == []
    assert result.expired == 3 and result.token == head(shoal, spec) == 7
    again = shoal.apply_retention(spec.name, spec.version, now=later)
    assert (again.expired, again.token) == (0, None) and head(shoal, spec) == 7


# -- float keys --------------------------------------------------------------------------------------------

FLOAT_KEYED = DataSourceSpec("Floats", "1", 2, {"id": "float64", "title": "string"}, ["id"])


def test_negative_zero_and_zero_are_one_float_key(make_shoal: Callable[..., Shoal]) -> None:
    shoal = make_shoal()
    shoal.create_data_source(FLOAT_KEYED)
    producer = shoal.producer(FLOAT_KEYED.name, FLOAT_KEYED.version)
    producer.upload([DataPoint({"id": 0.0, "title": "zero"}, [0.0, 1.0])])
    producer.upload([Tombstone({"id": -0.0})])
    assert shoal.fold(FLOAT_KEYED.name, FLOAT_KEYED.version).num_rows == 0

    producer.upload_columns(np.ones((1, 2), dtype=np.float32), {"id": np.array([-0.0]), "title": ["negative"]})
    producer.upload([DataPoint({"id": 0.0, "title": "positive"}, [0.0, 1.0])])
    folded = shoal.fold(FLOAT_KEYED.name, FLOAT_KEYED.version)
    assert folded.column("title").to_pylist() == ["positive"]
    producer.delete({"id": np.array([-0.0])})
    assert shoal.fold(FLOAT_KEYED.name, FLOAT_KEYED.version).num_rows == 0
    assert key_strings(FLOAT_KEYED, [{"id": -0.0}]) == key_strings(FLOAT_KEYED, [{"id": 0.0}])
