"""Uploads that must be refused by name, never crash, loop or write: Arrow streams that decode to more than their
body (compressed buffers, declared rows, zero-byte columns), repeated columns, text that is not UTF-8, message ids
the catalog cannot store; and a consumer that follows a data source dropped and made again. Through the real
HTTP route (a served API) and a real consumer on the test broker (embedded Valkey) and catalog (Postgres)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable

import httpx
import numpy as np
import pyarrow as pa
import pytest
from conftest import dead_count, serve_api, wait_for
from kombu import Connection
from kombu import Producer as KombuProducer

from shoal import Shoal
from shoal.catalog.repo import head_of
from shoal.config.settings import Settings
from shoal.errors import ValidationError
from shoal.intake import codec, topology
from shoal.intake.consumer import IntakeConsumer, dead_letters
from shoal.intake.publisher import Publisher
from shoal.log.records import AttributeType, DataPoint, DataSourceSpec
from shoal.servers.broker import broker_url

ARROW = codec.ARROW
UP = DataSourceSpec("Up", "1", 3, {"id": AttributeType.INT64, "title": AttributeType.STRING}, ["id"])
EVENTS = DataSourceSpec("events", "1", 4, {"id": AttributeType.INT64, "tag": AttributeType.STRING}, ["id"])


def stream(table: pa.Table, *, compression: str | None = None, chunk: int | None = None) -> bytes:
    """`table` as an Arrow IPC stream, as pyarrow writes one (its record batches of at most `chunk` rows)."""
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table, max_chunksize=chunk)
    return sink.getvalue().to_pybytes()


def vectors(n: int, dim: int, start: float = 0.0) -> pa.FixedSizeListArray:
    values = (np.arange(n * dim, dtype=np.float32) + start).reshape(-1)
    return pa.FixedSizeListArray.from_arrays(pa.array(values), dim)


def not_utf8(*values: bytes, large: bool = False) -> pa.Array:
    """A string column holding these bytes as they are (pyarrow checks no UTF-8 when it is built from buffers,
    nor when it reads an IPC stream)."""
    offsets = np.cumsum([0, *(len(v) for v in values)])
    kind, width = (pa.large_string(), np.int64) if large else (pa.string(), np.int32)
    return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(offsets.astype(width).tobytes()),
                                                    pa.py_buffer(b"".join(values))])


def source_head(shoal: Shoal, spec: DataSourceSpec) -> int:
    return head_of(shoal.engine, shoal.get_data_source(spec.name, spec.version).id)[0]


def upload(http: httpx.Client, body: bytes) -> httpx.Response:
    return http.post("/api/v1/upload/Up/1", content=body, headers={"Content-Type": ARROW})


# -- the message headers the checks read ---------------------------------------------------------------------


def test_message_headers_are_read_from_real_pyarrow_streams() -> None:
    """The flatbuffer reader against what pyarrow writes: row counts, column lengths (depth first: the vector
    column, then its values), compression (zstd, lz4, none), several batches, a dictionary-encoded column."""
    from shoal.vektonn.arrow_upload import batch_header

    table = pa.table({
        "vector": vectors(10, 4),
        "id": pa.array(np.arange(10)),
        "tag": pa.array(["a", "b"] * 5).dictionary_encode(),
        "empty": pa.nulls(10),
    })
    for compression in (None, "zstd", "lz4"):
        body = stream(table, compression=compression, chunk=4)
        headers = [(m.type, batch_header(m.metadata.to_pybytes()))
                   for m in pa.ipc.MessageReader.open_stream(pa.py_buffer(body))]
        kinds = [kind for kind, _ in headers]
        assert kinds == ["schema", "dictionary", "record batch", "record batch", "record batch"], compression
        assert headers[0][1] is None
        dictionary = headers[1][1]
        assert dictionary is not None and dictionary.dictionary and dictionary.rows == 2
        batches = [h for _, h in headers[2:]]
        assert [b.rows for b in batches if b] == [4, 4, 2]
        assert [b.node_lengths for b in batches if b] == [(4, 16, 4, 4, 4), (4, 16, 4, 4, 4), (2, 8, 2, 2, 2)]
        assert {b.compressed for _, b in headers[1:] if b} == {compression is not None}, compression
        assert not any(b.dictionary for b in batches if b)


# -- HTTP: Arrow bodies past their limits ---------------------------------------------------------------------


# 4 million rows of zeros (112 MB of Arrow buffers) as a zstd-compressed stream of a few KB, on stdout.
BOMB = """
import sys, numpy as np, pyarrow as pa
n = 4_000_000
table = pa.table({"id": pa.array(np.zeros(n, dtype=np.int64)), "title": pa.nulls(n, pa.string()),
                  "vector": pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(n * 3, dtype=np.float32)), 3)})
sink = pa.BufferOutputStream()
with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
    writer.write_table(table, max_chunksize=n)
sys.stdout.buffer.write(sink.getvalue().to_pybytes())
"""


def test_compressed_arrow_upload_is_refused_before_it_is_decoded(served: tuple[str, Settings]) -> None:
    """An 8 KB body of zstd buffers made half a gigabyte when it was decoded to count its rows: compressed
    streams are refused from their headers (the body limit is what bounds a request), small or not."""
    url, settings = served
    bomb = subprocess.run([sys.executable, "-c", BOMB], check=True, capture_output=True, timeout=120).stdout
    assert len(bomb) < 8192
    small = pa.table({"vector": vectors(3, 3), "id": pa.array([1, 2, 3]), "title": pa.array(["a", "b", "c"])})
    pool = pa.default_memory_pool()
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=60) as http:
        shoal.create_data_source(UP)
        assert upload(http, stream(small)).status_code == 200  # the same batch, uncompressed, is taken
        head = source_head(shoal, UP)
        peak = pool.max_memory()
        for body in (bomb, stream(small, compression="zstd"), stream(small, compression="lz4")):
            r = upload(http, body)
            assert r.status_code == 400, r.text
            message = r.json()["errorMessages"][0]
            assert "compressed" in message and "send it uncompressed" in message, message
        # Nothing was decompressed: this process's Arrow memory peak did not grow by the bomb's 112 MB (made in a
        # child process, so that making it does not raise the peak here).
        assert pool.max_memory() < peak + 32 * 2**20
        assert source_head(shoal, UP) == head  # nothing written


def test_arrow_upload_declaring_more_rows_or_values_than_allowed_is_refused_unread(
    make_settings: Callable[..., Settings],
) -> None:
    """A null-typed column costs no byte per row: an uncompressed stream of a few hundred bytes declared ten
    million rows, or a list of thirty million nulls, and decoding it cost seconds and gigabytes. Refused from the
    headers: more rows than SHOAL_MAX_BATCH_POINTS (over all record batches), more values than a body holds."""
    settings = make_settings("local", max_batch_points=10)
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    rows = pa.table({"id": pa.nulls(10_000_000)})  # one batch of ten million rows, and no buffer
    several = pa.table({"vector": vectors(12, 3), "id": pa.array(np.arange(12)), "title": pa.array(["t"] * 12)})
    nulls = pa.ListArray.from_arrays(pa.array([0, 30_000_000], pa.int32()), pa.nulls(30_000_000))
    values = pa.table({"vector": vectors(1, 3), "id": pa.array([1]), "title": nulls})
    with serve_api(settings) as url, Shoal(settings, notify=False) as shoal, httpx.Client(
        base_url=url, timeout=60
    ) as http:
        shoal.create_data_source(UP)
        r = upload(http, stream(rows))
        assert r.status_code == 400, r.text
        assert r.json()["errorMessages"] == [
            "invalid input, nothing written: batch holds at least 10000000 points, more than the configured maximum 10"
        ]
        # Twelve rows in batches of five: each batch is within the limit of 10, together they are not.
        r = upload(http, stream(several, chunk=5))
        assert r.status_code == 400, r.text
        assert "batch holds at least 12 points, more than the configured maximum 10" in r.text, r.text
        r = upload(http, stream(values))
        assert r.status_code == 400, r.text
        assert "declares a column of 30000000 values" in r.text, r.text
        assert source_head(shoal, UP) == 0  # nothing written
        assert upload(http, stream(several.slice(0, 10), chunk=5)).status_code == 200  # ten fit, in two batches
        assert source_head(shoal, UP) == 10


def test_a_dictionary_column_decoding_past_the_body_limit_is_refused(
    make_settings: Callable[..., Settings],
) -> None:
    """A dictionary-encoded text column holds each value once and every row names it: one 100 KB title named
    by 2,000 rows is a 200 KB body that decoded to a 200 MB batch (716 MB at its peak). Such a column may decode
    to at most what a request could send plain (SHOAL_MAX_BODY_BYTES, 1 MB here); a small dictionary passes."""
    settings = make_settings("local", max_body_bytes=2**20)
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    n = 2_000
    titles = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)), pa.array(["x" * 100_000]))
    bomb = stream(pa.table({"vector": vectors(n, 3), "id": pa.array(np.arange(n)), "title": titles}))
    assert len(bomb) < 2**20
    labels = pa.DictionaryArray.from_arrays(pa.array(np.arange(n, dtype=np.int32) % 3), pa.array(["a", "b", "c"]))
    fine = stream(pa.table({"vector": vectors(n, 3), "id": pa.array(np.arange(n)), "title": labels}))
    with serve_api(settings) as url, Shoal(settings, notify=False) as shoal, \
            httpx.Client(base_url=url, timeout=60) as http:
        shoal.create_data_source(UP)
        r = upload(http, bomb)
        assert r.status_code == 400, r.text
        assert "attribute 'title': the dictionary-encoded column decodes to 200,000,000 bytes" in r.text, r.text
        assert source_head(shoal, UP) == 0
        assert upload(http, fine).status_code == 200
        assert shoal.fold("Up", "1")["title"].to_pylist()[:4] == ["a", "b", "c", "a"]


def test_a_problem_in_a_mixed_arrow_message_is_named_by_its_place_in_the_message() -> None:
    """A message of upserts and tombstones is validated run by run; a bad value is still named by its row in
    the message, not in its run (rows 0-1 upserts, 2 a tombstone, 3-4 upserts with a bad title at row 4)."""
    titles = pa.array(["a", "b", None, "d", None])
    table = pa.table({"vector": vectors(5, 3), "id": pa.array([1, 2, 1, 3, 4]), "title": titles,
                      "is_deleted": pa.array([False, False, True, False, False])})
    with pytest.raises(ValidationError) as caught:
        codec.decode(UP, ARROW, stream(table), 100)
    assert [(p.position, p.attribute) for p in caught.value.problems] == [(4, "title")], caught.value
    assert "point 4, attribute 'title'" in str(caught.value)


@pytest.mark.parametrize("repeated", ["title", "vector", "is_deleted", "id"])
def test_arrow_upload_with_a_repeated_column_is_refused_by_name(served: tuple[str, Settings], repeated: str) -> None:
    url, settings = served
    columns = {"vector": vectors(2, 3), "id": pa.array([1, 2]), "title": pa.array(["a", "b"]),
               "is_deleted": pa.array([False, False])}
    names = [*columns, repeated]
    body = stream(pa.Table.from_arrays([*columns.values(), columns[repeated]], names=names))
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(UP)
        r = upload(http, body)
        assert r.status_code == 400, r.text
        assert r.json()["errorMessages"] == [
            f"invalid input, nothing written: attribute {repeated!r}: the column appears more than once: "
            "send each column once"
        ]
        assert source_head(shoal, UP) == 0


@pytest.mark.parametrize("large", [False, True], ids=["string", "large_string"])
def test_arrow_text_that_is_not_utf8_is_refused_by_row_and_attribute(
    served: tuple[str, Settings], large: bool
) -> None:
    """Taken as it came, it was written, and every later read of the log or of search hits failed on it."""
    url, settings = served
    titles = not_utf8(b"fine", b"\xff\xfe", b"ok", b"caf\xc3", large=large)
    body = stream(pa.table({"vector": vectors(4, 3), "id": pa.array([1, 2, 3, 4]), "title": titles}))
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(UP)
        r = upload(http, body)
        assert r.status_code == 400, r.text
        assert r.json()["errorMessages"] == [
            "invalid input, nothing written: point 1, attribute 'title': text must be valid UTF-8",
            "invalid input, nothing written: point 3, attribute 'title': text must be valid UTF-8",
        ]
        assert source_head(shoal, UP) == 0
        good = stream(pa.table({"vector": vectors(2, 3), "id": pa.array([1, 2]), "title": pa.array(["é", "ü"])}))
        assert upload(http, good).status_code == 200
        assert sorted(shoal.fold("Up", "1")["title"].to_pylist()) == ["é", "ü"]  # the log reads back


# -- the consumer ---------------------------------------------------------------------------------------------


def publish_unchecked(settings: Settings, body: bytes, content_type: str, message_id: str) -> None:
    """Publish as `Publisher.publish_raw` does but without its checks: what an upstream that is no Publisher
    (another language's AMQP or Redis client) can send."""
    target = topology.target(settings.tenant, EVENTS.name, EVENTS.version)
    queue = topology.group_queue(settings.intake_exchange, settings.intake_group, settings.intake_binding)
    with Connection(broker_url(settings)) as conn:
        KombuProducer(conn.default_channel, exchange=topology.exchange(settings.intake_exchange)).publish(
            body, routing_key=target.routing_key, content_type=content_type, content_encoding="binary",
            delivery_mode=2, message_id=message_id, declare=[queue],
            headers={topology.TENANT: target.tenant, topology.SOURCE: target.source,
                     topology.VERSION: target.version, topology.MESSAGE_ID: message_id},
        )


def point(i: int, dim: int = 4) -> DataPoint:
    return DataPoint({"id": i, "tag": "t"}, (np.arange(dim, dtype=np.float64) + i).tolist())


def test_consumer_dead_letters_arrow_messages_past_their_limits_and_goes_on(
    intake_settings: Callable[..., Settings], consumer_in_thread: Callable[..., tuple[IntakeConsumer, threading.Thread]]
) -> None:
    """A repeated column raised KeyError, which kombu takes for a lost connection: the message came back for ever
    and blocked the queue. It, a compressed stream and text that is not UTF-8 go to the dead letters, named; the
    next message lands."""
    settings = intake_settings()
    base = {"vector": vectors(2, 4), "id": pa.array([1, 2])}
    repeated = stream(pa.Table.from_arrays([*base.values(), pa.array(["a", "b"]), pa.array(["c", "d"])],
                                           names=["vector", "id", "tag", "tag"]))
    compressed = stream(pa.table({**base, "tag": pa.array(["a", "b"])}), compression="zstd")
    bad_text = stream(pa.table({**base, "tag": not_utf8(b"ok", b"\xc3\x28")}))
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)
        with Publisher(settings) as p:
            for mid, body in (("repeated", repeated), ("compressed", compressed), ("bad-text", bad_text)):
                p.publish_raw("events", "1", body, ARROW, message_id=mid)
            p.publish("events", "1", [point(7)], message_id="after")
        consumer, thread = consumer_in_thread(settings)
        wait_for(lambda: dead_count(settings) == 3 and source_head(shoal, EVENTS) == 1, 60,
                 "three dead letters and the valid message")
        assert thread.is_alive()
        reasons = {d["headers"]["shoal-message-id"]: d["headers"]["shoal-dead-reason"] for d in dead_letters(settings)}
        assert "attribute 'tag': the column appears more than once" in reasons["repeated"]
        assert "compressed" in reasons["compressed"] and "send it uncompressed" in reasons["compressed"]
        assert reasons["bad-text"] == ("invalid input, nothing written: point 1, attribute 'tag': "
                                       "text must be valid UTF-8")
        assert shoal.fold("events", "1")["id"].to_pylist() == [7]
        assert shoal.message_token("events", "1", "after") is not None


@pytest.mark.parametrize(("message_id", "says"), [("order\x00-1", "NUL"), ("order\ud800-1", "lone surrogate")],
                         ids=["nul", "surrogate"])
def test_a_message_id_the_catalog_cannot_store_is_dead_lettered_not_fatal(
    intake_settings: Callable[..., Settings],
    consumer_in_thread: Callable[..., tuple[IntakeConsumer, threading.Thread]],
    message_id: str,
    says: str,
) -> None:
    """Such an id failed the catalog query (psycopg DataError, UnicodeEncodeError) and killed the consumer, and
    every consumer after it: the queue was blocked. The publisher refuses it before sending."""
    settings = intake_settings()
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)
        with Publisher(settings) as p:
            with pytest.raises(ValidationError, match=says):
                p.publish("events", "1", [point(1)], message_id=message_id)
            with pytest.raises(ValidationError, match="1 to 190 characters"):
                p.publish("events", "1", [point(1)], message_id="x" * 191)
        assert dead_count(settings) == 0
        publish_unchecked(settings, codec.encode_json([point(1)]), codec.JSON, message_id)
        with Publisher(settings) as p:
            p.publish("events", "1", [point(2)], message_id="ok-2")
        consumer, thread = consumer_in_thread(settings)
        wait_for(lambda: dead_count(settings) == 1 and source_head(shoal, EVENTS) == 1, 60,
                 "the bad id's dead letter and the next message")
        assert thread.is_alive()
        [dead] = dead_letters(settings)
        assert dead["headers"]["shoal-message-id"] == message_id
        assert says in dead["headers"]["shoal-dead-reason"] and repr(message_id) in dead["headers"]["shoal-dead-reason"]
        assert shoal.fold("events", "1")["id"].to_pylist() == [2]


def test_consumer_follows_a_data_source_dropped_and_made_again(
    intake_settings: Callable[..., Settings], consumer_in_thread: Callable[..., tuple[IntakeConsumer, threading.Thread]]
) -> None:
    """The consumer kept a source's definition for good: once the source was dropped and made again, every message
    was dead-lettered with the old definition's reason ("expected 4, got 8"), or as "dropped while the batch was
    in flight" for the same definition, until a restart. Each message is judged by the current definition."""
    settings = intake_settings()
    wider = DataSourceSpec("events", "1", 8, dict(EVENTS.attribute_types), ["id"])
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)
        consumer, thread = consumer_in_thread(settings)
        with Publisher(settings) as p:
            p.publish("events", "1", [point(1)], message_id="before")
            wait_for(lambda: source_head(shoal, EVENTS) == 1, 60, "the first message")

            # Made again with the same definition: the batch the consumer validated goes to the new source.
            shoal.drop_data_source("events", "1")
            shoal.create_data_source(EVENTS)
            p.publish("events", "1", [point(2)], message_id="same-1")
            wait_for(lambda: shoal.message_token("events", "1", "same-1") is not None, 60, "same-1 to land")

            # Made again with another dimension: its messages land, one of the old dimension is refused by the new.
            shoal.drop_data_source("events", "1")
            shoal.create_data_source(wider)
            for i in range(3):
                p.publish("events", "1", [point(100 + i, dim=8)], message_id=f"wide-{i}")
            p.publish("events", "1", [point(9, dim=4)], message_id="narrow")
            wait_for(lambda: source_head(shoal, wider) == 3 and dead_count(settings) == 1, 60,
                     "the wider source's messages and one dead letter")
        assert thread.is_alive()
        assert sorted(shoal.fold("events", "1")["id"].to_pylist()) == [100, 101, 102]
        assert [shoal.message_token("events", "1", f"wide-{i}") is not None for i in range(3)] == [True] * 3
        [dead] = dead_letters(settings)
        assert dead["headers"]["shoal-message-id"] == "narrow"
        assert "wrong dimension: expected 8, got 4" in dead["headers"]["shoal-dead-reason"]
        assert consumer.stats.dead == 1

        # Dropped for good: its messages are dead-lettered as for any unknown source, and the consumer goes on.
        shoal.drop_data_source("events", "1")
        with Publisher(settings) as p:
            p.publish("events", "1", [point(5, dim=8)], message_id="gone")
        wait_for(lambda: dead_count(settings) == 1, 60, "the dead letter of a message to a dropped source")
        [dead] = dead_letters(settings)
        assert "not found" in dead["headers"]["shoal-dead-reason"]
        assert thread.is_alive()
