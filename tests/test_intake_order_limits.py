"""Intake that keeps a data source's order when a commit fails midway, refuses messages past the body limit unread,
and survives a catalog blip while it sorts out a reused message id. Real broker (embedded Valkey), catalog
(Postgres) and consumer threads; the one fault no real server can time (the catalog away for exactly one query) is
injected into that query alone."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

import psycopg
import pyarrow as pa
import pytest
from conftest import dead_count, wait_for
from kombu import Connection
from kombu import Producer as KombuProducer
from sqlalchemy.exc import OperationalError

from shoal import Shoal
from shoal.catalog.repo import head_of
from shoal.config.settings import Settings
from shoal.errors import ValidationError
from shoal.intake import codec, topology
from shoal.intake.consumer import IntakeConsumer, dead_letters
from shoal.intake.publisher import Publisher
from shoal.log.records import AttributeType, DataPoint, DataSourceSpec, Tombstone
from shoal.servers.broker import broker_url

EVENTS = DataSourceSpec("events", "1", 4, {"id": AttributeType.INT64, "tag": AttributeType.STRING}, ["id"])


def point(i: int, tag: str = "t") -> DataPoint:
    return DataPoint({"id": i, "tag": tag}, [float(i % 100 + 1), 1.0, 0.5, 0.25])


def head(shoal: Shoal) -> int:
    return head_of(shoal.engine, shoal.get_data_source(EVENTS.name, EVENTS.version).id)[0]


def log_rows(shoal: Shoal) -> list[tuple[int, bool]]:
    """(id, is a tombstone) of every log entry, in seq order."""
    table = pa.Table.from_batches(list(shoal.read_log("events", "1")))
    return [(int(i), op == "delete") for i, op in zip(table["id"].to_pylist(), table["__op"].to_pylist(), strict=True)]


def publish_unchecked(settings: Settings, body: bytes, message_id: str) -> None:
    """Publish a JSON body as `Publisher.publish_raw` does but without its checks (an upstream that is no
    Publisher: a plain kombu client, another language's)."""
    target = topology.target(settings.tenant, EVENTS.name, EVENTS.version)
    queue = topology.group_queue(settings.intake_exchange, settings.intake_group, settings.intake_binding)
    with Connection(broker_url(settings)) as conn:
        KombuProducer(conn.default_channel, exchange=topology.exchange(settings.intake_exchange)).publish(
            body, routing_key=target.routing_key, content_type=codec.JSON, content_encoding="binary",
            delivery_mode=2, message_id=message_id, declare=[queue],
            headers={topology.TENANT: target.tenant, topology.SOURCE: target.source,
                     topology.VERSION: target.version, topology.MESSAGE_ID: message_id},
        )


# -- order: a commit that fails midway ------------------------------------------------------------------------


def fail_first_segment(settings: Settings, source_id: int) -> Callable[[], None]:
    """Make the catalog refuse the first log segment the data source commits, once, as a lock timeout refuses it
    (SQLSTATE 55P03, an OperationalError: a transient failure); the ones after it go through. A trigger counting
    on a sequence, which no rollback takes back. Returns what removes them."""
    tag = "f" + uuid.uuid4().hex[:10]
    url = str(settings.database_url).replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SEQUENCE {tag}_seq")
        conn.execute(f"""
            CREATE FUNCTION {tag}_fn() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              IF nextval('{tag}_seq') = 1 THEN
                RAISE EXCEPTION 'injected: the first segment of source {source_id} is refused'
                  USING ERRCODE = 'lock_not_available';
              END IF;
              RETURN NEW;
            END $$""")
        conn.execute(f"CREATE TRIGGER {tag}_tr BEFORE INSERT ON log_segments FOR EACH ROW "
                     f"WHEN (NEW.data_source_id = {source_id}) EXECUTE FUNCTION {tag}_fn()")

    def remove() -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP TRIGGER IF EXISTS {tag}_tr ON log_segments")
            conn.execute(f"DROP FUNCTION IF EXISTS {tag}_fn()")
            conn.execute(f"DROP SEQUENCE IF EXISTS {tag}_seq")

    return remove


def test_batches_after_a_failed_group_never_land_before_it(
    intake_settings: Callable[..., Settings],
    consumer_in_thread: Callable[[Settings], tuple[IntakeConsumer, threading.Thread]],
) -> None:
    """One flush of an upsert and its tombstone, split by SHOAL_GROUP_COMMIT_MAX_POINTS into two group commits:
    the first failed, the second (the tombstone) was committed all the same, and on redelivery the upsert landed
    after it: the deleted point came back. A failed group now withdraws its caller's later batches."""
    settings = intake_settings(intake_max_wait_ms=500, group_commit_max_points=3, commit_retries=1)
    with Shoal(settings, notify=False) as shoal:
        source = shoal.create_data_source(EVENTS)
        remove = fail_first_segment(settings, source.id)
        try:
            with Publisher(settings) as p:
                p.publish("events", "1", [point(1), point(2), point(3)], message_id="upsert")
                p.publish("events", "1", [Tombstone({"id": 1})], message_id="delete")
            consumer, thread = consumer_in_thread(settings)
            wait_for(lambda: all(shoal.message_token("events", "1", m) is not None for m in ("upsert", "delete")),
                     60, "both messages to land")
        finally:
            remove()
        assert log_rows(shoal) == [(1, False), (2, False), (3, False), (1, True)]
        assert sorted(shoal.fold("events", "1")["id"].to_pylist()) == [2, 3]
        assert thread.is_alive()
        assert consumer.stats.requeued == 2  # the flush failed as a whole, and went back as a whole
        assert (consumer.stats.messages, consumer.stats.duplicates) == (2, 0)  # nothing of it had landed


# -- size: messages past the body limit -----------------------------------------------------------------------


def test_messages_past_the_body_limit_are_dead_lettered_unread_and_refused_by_the_publisher(
    intake_settings: Callable[..., Settings],
    consumer_in_thread: Callable[[Settings], tuple[IntakeConsumer, threading.Thread]],
) -> None:
    """The consumer parsed a body of any size (the HTTP routes answer 413 past SHOAL_MAX_BODY_BYTES): a huge one
    held several copies and a MemoryError killed it, and every consumer after it, the message at the queue's head.
    A body past the limit, and a queue entry too long to hold one (not even parsed), go to the dead letters, named;
    the next message lands. The publisher refuses such a body before sending it."""
    settings = intake_settings(max_body_bytes=4096)
    over = codec.encode_json([point(i, tag="x" * 40) for i in range(60)])  # past 4096, well within the entry bound
    huge = codec.encode_json([point(i, tag="x" * 1000) for i in range(200)])  # an entry past 64 KiB + 4/3 x 4096
    assert 4096 < len(over) < 65536 < len(huge)
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)
        with Publisher(settings) as p:
            with pytest.raises(ValidationError, match=r"past the limit of 4096 bytes \(SHOAL_MAX_BODY_BYTES\)"):
                p.publish_raw("events", "1", over, codec.JSON, message_id="refused")
            assert dead_count(settings) == 0
            publish_unchecked(settings, over, "over")
            publish_unchecked(settings, huge, "huge")
            p.publish("events", "1", [point(7)], message_id="after")
        consumer, thread = consumer_in_thread(settings)
        wait_for(lambda: dead_count(settings) == 2 and shoal.message_token("events", "1", "after") is not None, 60,
                 "two dead letters and the next message")
        assert thread.is_alive()
        assert shoal.fold("events", "1")["id"].to_pylist() == [7]
        over_dead, huge_dead = dead_letters(settings)
        assert over_dead["headers"]["shoal-message-id"] == "over"
        assert over_dead["body"] == over  # kept whole: it is within the entry bound
        assert over_dead["headers"]["shoal-dead-reason"] == (
            f"the message body is {len(over)} bytes, past the limit of 4096 bytes (SHOAL_MAX_BODY_BYTES): send fewer "
            "points per message, or raise the limit")
        reason = huge_dead["headers"]["shoal-dead-reason"]
        assert "the queue entry is" in reason and "(SHOAL_MAX_BODY_BYTES): refused unread" in reason, reason
        assert len(huge_dead["body"]) == 65536  # the entry's head, enough to tell what it was
        assert consumer.stats.dead == 2


# -- a catalog blip while a reused message id is sorted out ----------------------------------------------------


def test_a_catalog_blip_while_a_reused_id_is_looked_up_requeues(
    intake_settings: Callable[..., Settings],
    consumer_in_thread: Callable[[Settings], tuple[IntakeConsumer, threading.Thread]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A message id reused for other content: the consumer reads the fingerprint its id committed with, outside the
    handling of transient failures, so a catalog away at that moment killed the consumer. It now requeues, and the
    retry dead-letters the reused id and commits the rest. (The catalog cannot be made to fail that one read and
    not the commit before it, a moment earlier, on the same pool: the failure is injected into that read.)"""
    settings = intake_settings(intake_max_wait_ms=300)
    real = IntakeConsumer._fingerprint
    blips: list[str] = []

    def blip_once(self: IntakeConsumer, producer: object, batch_id: str) -> str | None:
        if not blips:
            blips.append(batch_id)
            raise OperationalError("SELECT ... FROM producer_batches", {}, ConnectionError("catalog away"))
        return real(self, producer, batch_id)  # type: ignore[arg-type]

    monkeypatch.setattr(IntakeConsumer, "_fingerprint", blip_once)
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)
        with Publisher(settings) as p:
            p.publish("events", "1", [point(1)], message_id="doc-1")
        consumer, thread = consumer_in_thread(settings)
        wait_for(lambda: head(shoal) == 1, 60, "the first message")
        with Publisher(settings) as p:
            p.publish("events", "1", [point(1, tag="changed")], message_id="doc-1")  # other content, same id
            p.publish("events", "1", [point(2)], message_id="doc-2")
        wait_for(lambda: dead_count(settings) == 1 and head(shoal) == 2, 60, "the reused id's dead letter and doc-2")
        assert thread.is_alive()
        assert blips == ["msg:doc-1"]
        assert consumer.stats.requeued >= 2
        [dead] = dead_letters(settings)
        assert dead["headers"]["shoal-message-id"] == "doc-1"
        assert sorted(shoal.fold("events", "1")["id"].to_pylist()) == [1, 2]
