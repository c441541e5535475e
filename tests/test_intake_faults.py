"""Intake under faults: malformed Arrow streams and queue entries that are no kombu envelope (dead-lettered, never
a crash or a 500), messages put back on the queue (after a failed commit, a killed or a stopped consumer) taken
again in publish order, a message without an id redelivered after its commit, a broker out of memory, consumer
groups whose names overlap, and the publisher agreeing with the Python producer on what it takes. Real broker
(embedded Valkey), catalog (Postgres), consumer threads and processes; nothing is mocked."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pytest
import redis
from conftest import dead_count, settings_env, stop_process, wait_for
from kombu import Connection
from kombu import Producer as KombuProducer
from kombu.exceptions import OperationalError as KombuOperationalError
from kombu.message import Message
from typer.testing import CliRunner

from shoal import Shoal
from shoal.catalog.repo import head_of
from shoal.cli import app
from shoal.config.settings import Settings
from shoal.errors import ValidationError
from shoal.intake import codec, topology
from shoal.intake.consumer import IntakeConsumer, dead_letters
from shoal.intake.delivery import NotLeading, ReliableQueue
from shoal.intake.publisher import Publisher
from shoal.log.records import AttributeType, DataPoint, DataSourceSpec, SparseVector, Tombstone
from shoal.servers.broker import broker_url

EVENTS = DataSourceSpec("events", "1", 4, {"id": AttributeType.INT64, "tag": AttributeType.STRING}, ["id"])


def head(shoal: Shoal, spec: DataSourceSpec = EVENTS) -> int:
    return head_of(shoal.engine, shoal.get_data_source(spec.name, spec.version).id)[0]


def point(i: int, tag: str = "t") -> DataPoint:
    return DataPoint({"id": i, "tag": tag}, [float(i % 100 + 1), 1.0, 0.5, 0.25])


def queue_name(settings: Settings, group: str | None = None) -> str:
    return f"{settings.intake_exchange}.{group or settings.intake_group}"


@pytest.fixture
def consumer_thread() -> Iterator[Callable[[Settings], IntakeConsumer]]:
    """Start consumers in threads of this process; stopped (cleanly) at teardown."""
    started: list[tuple[IntakeConsumer, threading.Thread]] = []

    def start(settings: Settings) -> IntakeConsumer:
        consumer = IntakeConsumer(settings)
        thread = threading.Thread(target=consumer.run, daemon=True)
        thread.start()
        consumer.thread = thread  # type: ignore[attr-defined]
        started.append((consumer, thread))
        return consumer

    yield start
    for consumer, thread in started:
        consumer.stop.set()
        thread.join(30)


@pytest.fixture
def broker(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


# -- malformed Arrow streams ----------------------------------------------------------------------------------


def stream(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def vectors(n: int, dim: int) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(np.arange(n * dim, dtype=np.float32)), dim)


def malformed_arrow() -> dict[str, bytes]:
    """Streams (for EVENTS) on which pyarrow raises what is no ValueError: a column name that is not UTF-8
    (UnicodeDecodeError), an integer column declared 5 bits wide (ArrowNotImplementedError), string offsets past
    the column's data in the middle of the column, which only slicing it meets (ArrowIndexError)."""
    good = stream(pa.table({"vector": vectors(2, 4), "id": pa.array([1, 2]), "tag": pa.array(["a", "b"])}))
    at = good.index(b"tag")
    bodies = {"name": good[:at] + b"\xa2" + good[at + 1:]}
    # The int64 column's bit width (64, one byte of the schema's flatbuffer): the byte 64 whose change to 5
    # makes pyarrow refuse the width when it reads the stream.
    for i in (i for i, byte in enumerate(good) if byte == 64):
        mutated = good[:i] + bytes([5]) + good[i + 1:]
        try:
            pa.ipc.open_stream(mutated).read_all()
        except pa.ArrowNotImplementedError:
            bodies["width"] = mutated
            break
        except pa.ArrowException:
            continue
    assert "width" in bodies
    offsets = pa.py_buffer(np.array([0, 1, 9, 2], dtype=np.int32).tobytes())  # 9: past the 2 bytes of data
    tags = pa.Array.from_buffers(pa.string(), 3, [None, offsets, pa.py_buffer(b"ab")])
    bodies["offsets"] = stream(pa.table({"vector": vectors(3, 4), "id": pa.array([1, 2, 3]), "tag": tags,
                                         "is_deleted": pa.array([False, True, False])}))
    return bodies


SAYS = {"name": "a column name is not valid UTF-8", "width": "Integers with less than 8 bits not implemented",
        "offsets": "buffer slice would exceed buffer length"}


def test_malformed_arrow_uploads_answer_400_naming_the_problem(served: tuple[str, Settings]) -> None:
    """They answered 500 (UnicodeDecodeError, ArrowNotImplementedError, ArrowIndexError out of the decoder)."""
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(EVENTS)
        for kind, body in malformed_arrow().items():
            r = http.post("/api/v1/upload/events/1", content=body, headers={"Content-Type": codec.ARROW})
            assert r.status_code == 400, (kind, r.status_code, r.text)
            [message] = r.json()["errorMessages"]
            assert "Arrow IPC stream" in message and SAYS[kind] in message, (kind, message)
        assert head(shoal) == 0


def test_consumer_dead_letters_malformed_arrow_messages_and_goes_on(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer]
) -> None:
    """Each one killed `shoal consume`, and every consumer after it (the message came back once the dead one's
    lease ran out): the good messages behind it never landed."""
    settings = intake_settings()
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)
        with Publisher(settings) as p:
            for kind, body in malformed_arrow().items():
                p.publish_raw("events", "1", body, codec.ARROW, message_id=kind)
            p.publish("events", "1", [point(7)], message_id="after")
        consumer = consumer_thread(settings)
        wait_for(lambda: dead_count(settings) == 3 and head(shoal) == 1, 60, "three dead letters and the good one")
        assert consumer.thread.is_alive()  # type: ignore[attr-defined]
        reasons = {d["headers"]["shoal-message-id"]: d["headers"]["shoal-dead-reason"] for d in dead_letters(settings)}
        assert set(reasons) == set(SAYS)
        for kind, says in SAYS.items():
            assert says in reasons[kind], (kind, reasons[kind])
        assert shoal.fold("events", "1")["id"].to_pylist() == [7]


# -- order of what goes back on the queue ---------------------------------------------------------------------


def take(q: ReliableQueue, n: int) -> list[Message]:
    """The next `n` messages `q` takes (each within a second)."""
    got = [q.get(1) for _ in range(n)]
    assert all(m is not None for m in got), got
    return [m for m in got if m is not None]


def message_ids(messages: list[Message]) -> list[str]:
    return [m.headers[topology.MESSAGE_ID] for m in messages]


def test_messages_put_back_on_the_queue_are_taken_again_in_the_order_they_were_taken(
    intake_settings: Callable[..., Settings], broker: redis.Redis
) -> None:
    """Requeued (a failed commit), recovered (a consumer that died holding them) and released (a clean stop):
    each came back reversed. They come back in the order they were taken, ahead of the messages still waiting,
    and as the very same envelopes (so the delivery tag a message without an id is known by is kept)."""
    settings = intake_settings()
    name = queue_name(settings)
    with Publisher(settings) as p:
        for i in range(6):
            p.publish("events", "1", [point(i)], message_id=f"m{i}")
    with Connection(broker_url(settings)) as conn:
        a = ReliableQueue(broker, conn.channel(), name, lease_s=60)
        a.heartbeat()
        messages = take(a, 4)
        assert message_ids(messages) == ["m0", "m1", "m2", "m3"]
        assert a.requeue(messages[:3]) == 3  # a failed commit of m0..m2 (m3 stays held)
        assert message_ids(take(a, 5)) == ["m0", "m1", "m2", "m4", "m5"]

        # `a` dies holding m3, m0, m1, m2, m4, m5 (taken in that order): once its lease and liveness key are gone
        # (they expire together), the next leader puts them back as it takes the lead, in that order and byte
        # for byte, before it takes anything.
        held = broker.lrange(a.processing, 0, -1)[::-1]
        b = ReliableQueue(broker, conn.channel(), name, lease_s=60)
        assert not b.heartbeat()  # `a` leads while its lease lasts
        broker.delete(f"{a.processing}.alive", a.leader_key)
        assert b.heartbeat()
        assert b.recover() == 0  # handed back already
        recovered = take(b, 6)
        assert message_ids(recovered) == ["m3", "m0", "m1", "m2", "m4", "m5"]
        assert [m.shoal_raw for m in recovered] == held
        assert not broker.exists(a.processing)

        # `b` stops cleanly holding them all, one more published meanwhile: handed back ahead of it, in order.
        with Publisher(settings) as p:
            p.publish("events", "1", [point(6)], message_id="m6")
        b.release()
        assert not broker.exists(f"{b.processing}.alive")
        c = ReliableQueue(broker, conn.channel(), name, lease_s=60)
        c.heartbeat()
        assert message_ids(take(c, 7)) == ["m3", "m0", "m1", "m2", "m4", "m5", "m6"]
        assert c.recover() == 0  # `c` lives: its list is nobody's to take
        c.release()


def test_a_leader_whose_lease_ran_out_takes_nothing_and_its_messages_go_first(
    intake_settings: Callable[..., Settings], broker: redis.Redis
) -> None:
    """A leader that stalled past its lease (a pause between its check of the lead and its take) still took the
    queue's head while another consumer led, and committed it after the newer messages that one took: a deleted
    key came back. The take and the check of the lead are one step now, and whoever takes the lead next hands
    back what the last leader held first, even when that one refreshed its liveness key just before."""
    settings = intake_settings()
    name = queue_name(settings)
    with Publisher(settings) as p:
        p.publish("events", "1", [point(1)], message_id="upsert")
    with Connection(broker_url(settings)) as conn:
        a = ReliableQueue(broker, conn.channel(), name, lease_s=60)
        assert a.heartbeat()
        assert message_ids(take(a, 1)) == ["upsert"]
        broker.delete(a.leader_key)  # its lease ran out while it stalled...
        broker.set(f"{a.processing}.alive", "1")  # ...and it woke just long enough to say it lives
        with Publisher(settings) as p:
            p.publish("events", "1", [Tombstone({"id": 1})], message_id="tombstone")
        b = ReliableQueue(broker, conn.channel(), name, lease_s=60)
        assert b.heartbeat()
        with pytest.raises(NotLeading):
            a.get(1)
        assert message_ids(take(b, 2)) == ["upsert", "tombstone"]
        assert broker.llen(a.processing) == 0


def start_consumer(settings: Settings, log: Path) -> subprocess.Popen[str]:
    """`shoal consume` as a real child process."""
    out = open(log, "a")  # noqa: SIM115 - the child writes to it until it ends
    return subprocess.Popen([sys.executable, "-m", "shoal.cli", "consume"], env=settings_env(settings), stdout=out,
                            stderr=subprocess.STDOUT, text=True)


def log_rows(shoal: Shoal) -> list[tuple[int, bool]]:
    """(id, is a tombstone) of every log entry, in seq order."""
    table = pa.Table.from_batches(list(shoal.read_log("events", "1")))
    return [(int(i), op == "delete") for i, op in zip(table["id"].to_pylist(), table["__op"].to_pylist(), strict=True)]


def test_messages_of_a_killed_consumer_are_committed_in_publish_order(
    intake_settings: Callable[..., Settings],
    consumer_thread: Callable[[Settings], IntakeConsumer],
    broker: redis.Redis,
    tmp_path: Path,
) -> None:
    """A consumer SIGKILLed holding an upsert, its tombstone, and two updates of another key: they were taken
    again reversed, so the deleted key came back and the older update won."""
    settings = intake_settings()
    holding = settings.model_copy(update={"intake_max_wait_ms": 600_000, "intake_max_points": 100_000})
    name = queue_name(settings)
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)
        with Publisher(settings) as p:
            p.publish("events", "1", [point(1, "v1")])
            p.publish("events", "1", [Tombstone({"id": 1})])
            p.publish("events", "1", [point(2, "old")])
            p.publish("events", "1", [point(2, "new")])
        child = start_consumer(holding, tmp_path / "consumer.log")
        try:
            def holds_all() -> bool:
                lists = [k for k in broker.scan_iter(match=f"{name}.processing.*") if not k.endswith(b".alive")]
                return broker.llen(name) == 0 and sum(broker.llen(k) for k in lists) == 4

            wait_for(holds_all, 60, "the consumer to hold the four messages")
            child.send_signal(signal.SIGKILL)
            child.wait(10)
        finally:
            stop_process(child)
        assert head(shoal) == 0
        consumer_thread(settings)  # puts them back once the dead one's lease (3 s) ran out, and commits them
        wait_for(lambda: head(shoal) == 4, 60, "the four messages committed")
        assert log_rows(shoal) == [(1, False), (1, True), (2, False), (2, False)]
        folded = shoal.fold("events", "1")
        assert list(zip(folded["id"].to_pylist(), folded["tag"].to_pylist(), strict=True)) == [(2, "new")]


def test_two_consumers_of_a_group_commit_a_source_in_publish_order(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer]
) -> None:
    """Two consumers of one group each took some of a source's messages and committed them in whichever order
    their group commits finished: tombstones landed before the upserts they delete, and deleted keys came back.
    One consumer leads the group and takes messages; the other stands by."""
    settings = intake_settings(intake_max_wait_ms=100)
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)
        first, second = consumer_thread(settings), consumer_thread(settings)
        with Publisher(settings) as p:
            for key in range(40):
                p.publish("events", "1", [point(key)])
                p.publish("events", "1", [Tombstone({"id": key})])
                if key % 4 == 3:  # spread over several group commits
                    wait_for(lambda k=key: head(shoal) == 2 * (k + 1), 60, "the messages so far committed")
        wait_for(lambda: head(shoal) == 80, 60, "every message committed")
        assert log_rows(shoal) == [(k, tombstone) for k in range(40) for tombstone in (False, True)]
        assert shoal.fold("events", "1").num_rows == 0
        assert sorted([first.leading, second.leading]) == [False, True]


def test_a_consumer_standing_by_leads_once_the_leader_stops(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer]
) -> None:
    """A clean stop hands the lead over at once (not after the lease): messages published after the leader
    stopped are committed by the consumer that stood by."""
    settings = intake_settings(intake_visibility_timeout_s=600)  # a lease that would outlast the test
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)
        first = consumer_thread(settings)
        wait_for(lambda: first.leading, 30, "the first consumer to lead")
        second = consumer_thread(settings)
        with Publisher(settings) as p:
            p.publish("events", "1", [point(1)])
            wait_for(lambda: head(shoal) == 1, 30, "the leader's commit")
            first.stop.set()
            first.thread.join(30)  # type: ignore[attr-defined]
            p.publish("events", "1", [point(2)])
            wait_for(lambda: head(shoal) == 2 and second.stats.messages == 1, 30,
                     "the commit of the consumer that stood by")
        assert second.leading


def test_a_consumer_that_lost_the_lead_commits_nothing_it_holds_and_hands_it_back(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer],
    broker: redis.Redis,
) -> None:
    """A leader that stalled past its lease while another consumer took the lead must not commit what it held
    after what the new leader takes: it hands its messages back to the queue's head, and stands by."""
    settings = intake_settings(intake_max_wait_ms=600_000, intake_max_points=100_000)
    name = queue_name(settings)
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)
        consumer = consumer_thread(settings)
        with Publisher(settings) as p:
            p.publish("events", "1", [point(1)], message_id="upsert")
            p.publish("events", "1", [Tombstone({"id": 1})], message_id="tombstone")
        wait_for(lambda: broker.llen(name) == 0 and len(consumer._held) == 2, 30, "the consumer to hold both")
        broker.set(f"{name}:leader", "another-consumer")  # as if its lease had run out and another took it
        wait_for(lambda: not consumer.leading and broker.llen(name) == 2, 30, "the messages handed back")
        assert head(shoal) == 0
        # Back in publish order (the right end is taken first).
        assert [json.loads(e)["headers"]["shoal-message-id"] for e in broker.lrange(name, 0, -1)] == [
            "tombstone", "upsert"]
        broker.delete(f"{name}:leader")  # the other leader gone: this one leads again, and commits on stopping
        wait_for(lambda: consumer.leading and len(consumer._held) == 2, 30, "the consumer to lead and hold both")
        consumer.stop.set()
        consumer.thread.join(30)  # type: ignore[attr-defined]
        assert log_rows(shoal) == [(1, False), (1, True)]


def test_a_new_leader_waits_for_what_a_consumer_of_an_older_release_holds(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer],
    broker: redis.Redis,
) -> None:
    """After an upgrade, a consumer of the previous release (which took messages without a lead) killed while
    holding an upsert left it in its processing list, its liveness key still live. The first leader took the
    lead at once and committed the tombstone published after the upsert first: the deleted point came back
    once the old list was recovered. It waits for that list to come back to the queue."""
    settings = intake_settings()  # liveness and lease: 3 s
    name = queue_name(settings)
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)
        with Publisher(settings) as p:
            p.publish("events", "1", [point(1)], message_id="upsert")
            old = f"{name}.processing.oldhost:4242:0badc0de"  # as the previous release named its lists
            assert broker.lmove(name, old, "RIGHT", "LEFT") is not None
            broker.set(f"{old}.alive", "1", px=3000)
            p.publish("events", "1", [Tombstone({"id": 1})], message_id="tombstone")
        consumer_thread(settings)
        wait_for(lambda: head(shoal) == 2, 60, "both messages committed")
        assert log_rows(shoal) == [(1, False), (1, True)]
        assert shoal.fold("events", "1").num_rows == 0


def test_a_commit_that_failed_is_retried_in_publish_order(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer]
) -> None:
    """Storage briefly unwritable: the commit fails and its messages are requeued. They were requeued one by one
    onto the queue's head, reversed: the tombstone was committed before the upsert it deletes, which came back."""
    settings = intake_settings(intake_max_wait_ms=300)
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)
        log_dir = Path(str(settings.storage_uri)) / "tenants" / settings.tenant / "sources" / "events" / "1" / "log"
        log_dir.parent.mkdir(parents=True, exist_ok=True)
        log_dir.write_text("in the way")  # a file where the log's directory goes: segment writes fail (OSError)
        with Publisher(settings) as p:
            p.publish("events", "1", [point(1)])
            p.publish("events", "1", [Tombstone({"id": 1})])
        consumer = consumer_thread(settings)
        wait_for(lambda: consumer.stats.requeued >= 2, 60, "the failed commit's messages requeued")
        log_dir.unlink()  # storage back (the consumer waits a second before it takes them again)
        wait_for(lambda: head(shoal) == 2, 60, "both messages committed")
        assert log_rows(shoal) == [(1, False), (1, True)]
        assert shoal.fold("events", "1").num_rows == 0  # deleted after it was written


# -- a message without an id ----------------------------------------------------------------------------------


def test_a_message_without_an_id_is_committed_once_when_it_is_delivered_again(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer],
    broker: redis.Redis,
) -> None:
    """Published by a plain kombu client (no message id), it was committed without a batch id: a consumer killed
    between the commit and the acknowledgement got it back (the same envelope, on the queue again) and wrote
    its points a second time. Its delivery tag, kept by the envelope, now stands for the id."""
    settings = intake_settings()
    name = queue_name(settings)
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)
        target = topology.target(settings.tenant, "events", "1")
        with Connection(broker_url(settings)) as conn:
            KombuProducer(conn.default_channel, exchange=topology.exchange(settings.intake_exchange)).publish(
                codec.encode_json([point(1), point(2)]), routing_key=target.routing_key, content_type=codec.JSON,
                content_encoding="binary", declare=[topology.group_queue(settings.intake_exchange,
                                                                         settings.intake_group)],
                headers={topology.TENANT: target.tenant, topology.SOURCE: target.source,
                         topology.VERSION: target.version},
            )
        [envelope] = broker.lrange(name, 0, -1)
        assert "message_id" not in json.loads(envelope)["properties"]
        consumer = consumer_thread(settings)
        wait_for(lambda: head(shoal) == 2, 60, "the message committed")
        broker.lpush(name, envelope)  # what a recovery puts back after a crash before the acknowledgement
        wait_for(lambda: consumer.stats.duplicates + consumer.stats.messages == 2, 60, "the redelivery handled")
        wait_for(lambda: broker.llen(name) == 0, 60, "the queue drained")
        assert head(shoal) == 2  # written once
        assert sorted(shoal.fold("events", "1")["id"].to_pylist()) == [1, 2]
        assert consumer.stats.duplicates == 1


# -- a broker out of memory -----------------------------------------------------------------------------------


def test_consumers_drain_a_broker_that_is_out_of_memory(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer], tmp_path: Path
) -> None:
    """maxmemory reached under noeviction: publishing is refused (as it should), but the consumer could not take
    anything either (BLMOVE and SET are refused then), so the queue never drained and the memory never came
    back. It drains it, and the broker takes messages again. A message refused while the broker is full (its dead
    letter cannot be written then) killed the consumer; it survives it, and the message ends in the dead-letter
    queue (it was sometimes lost: routed by a binding the full broker had refused, which kombu took as made)."""
    from shoal.servers.embedded import ensure_valkey, stop_embedded

    broker_dir = tmp_path / "full-broker"
    url = ensure_valkey(broker_dir)
    client = redis.Redis.from_url(url)
    try:
        settings = intake_settings(redis_url=url)
        name = queue_name(settings)
        with Shoal(settings, notify=False) as shoal:
            shoal.create_data_source(EVENTS)
            points = [DataPoint({"id": i, "tag": "x" * 200}, [1.0, 2.0, 3.0, float(i)]) for i in range(50)]
            with Publisher(settings, max_retries=1) as p:
                p.publish_raw("events", "1", b"not json", codec.JSON, message_id="poison")  # taken first
                p.publish("events", "1", points)  # the queue and its binding exist before the broker fills up
                client.config_set("maxmemory-policy", "noeviction")
                client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) + 2_000_000))
                sent = 1
                with pytest.raises(KombuOperationalError, match="maxmemory"):
                    for _ in range(10_000):
                        p.publish("events", "1", points)
                        sent += 1
            assert sent > 10 and client.llen(name) == sent + 1
            consumer = consumer_thread(settings)
            # Counted once acknowledged, just after the commit: waited on too.
            wait_for(lambda: client.llen(name) == 0 and head(shoal) == 50 * sent and consumer.stats.messages == sent,
                     120, "every message committed once")
            assert consumer.thread.is_alive()  # type: ignore[attr-defined]
            with Publisher(settings) as p:
                p.publish("events", "1", [point(1)])  # room again
            wait_for(lambda: head(shoal) == 50 * sent + 1, 60, "a message published after the drain")
            # The message refused while the broker was full is put back once its dead letter could not be
            # written (the broker was full), and dead-lettered once there is room.
            wait_for(lambda: dead_count(settings) == 1, 60, "the refused message in the dead-letter queue")
            [dead] = dead_letters(settings)
            assert dead["headers"]["shoal-message-id"] == "poison" and dead["body"] == b"not json"
    finally:
        client.close()
        stop_embedded(broker_dir)


def test_dead_letters_reach_their_queue_when_the_broker_lost_its_bindings(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer],
    broker: redis.Redis,
) -> None:
    """kombu keeps the bindings a connection declared in memory and never sends them again: a consumer whose
    broker lost the dead-letter exchange's binding (a refused declare on a full broker, a flushed or restarted
    broker) routed every later dead letter nowhere, and the refused messages were gone. Dead letters go
    straight to their queue."""
    settings = intake_settings()
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)
        consumer = consumer_thread(settings)
        with Publisher(settings) as p:
            p.publish_raw("events", "1", b"not json", codec.JSON, message_id="first")
            wait_for(lambda: consumer.stats.dead == 1, 60, "the first dead letter")
            broker.delete(*broker.keys(f"_kombu.binding.{settings.intake_exchange}.dead*") or ["-"])
            p.publish_raw("events", "1", b"[1]", codec.JSON, message_id="second")
            wait_for(lambda: consumer.stats.dead == 2, 60, "the second dead letter")
        assert [d["headers"]["shoal-message-id"] for d in dead_letters(settings)] == ["first", "second"]


def test_a_publisher_refused_by_a_full_broker_routes_its_later_messages(
    intake_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    """A publisher whose first publish met a full broker (its queue's binding refused) answered success for every
    later message on that connection, and routed them nowhere: kombu took the refused binding as made. The
    publish after the broker has room is in the queue."""
    from shoal.servers.embedded import ensure_valkey, stop_embedded

    broker_dir = tmp_path / "full-broker"
    url = ensure_valkey(broker_dir)
    client = redis.Redis.from_url(url)
    try:
        settings = intake_settings(redis_url=url)
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", "1")  # below what the server already holds: every write is refused
        with Publisher(settings, max_retries=0) as p:
            with pytest.raises(KombuOperationalError, match="maxmemory"):
                p.publish("events", "1", [point(1)], message_id="refused")
            client.config_set("maxmemory", "0")  # room again
            p.publish("events", "1", [point(2)], message_id="taken")
        assert client.llen(queue_name(settings)) == 1
    finally:
        client.close()
        stop_embedded(broker_dir)


def test_a_message_whose_headers_name_another_tenant_than_its_routing_key_is_dead_lettered(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer],
    make_settings: Callable[..., Settings],
) -> None:
    """A group bound to one tenant (`acme.#`) took a message routed to that tenant whose headers named another
    tenant's data source, and wrote it there: the binding did not hold. The headers must name the data source
    the routing key names."""
    other = make_settings("local")  # a second tenant with a data source of the same name
    settings = intake_settings()
    settings = settings.model_copy(update={"intake_binding": f"{settings.tenant}.#"})
    with Shoal(settings, notify=False) as shoal, Shoal(other, notify=False) as theirs:
        shoal.create_data_source(EVENTS)
        theirs.create_data_source(EVENTS)
        ours = topology.target(settings.tenant, "events", "1")
        with Connection(broker_url(settings)) as conn:
            KombuProducer(conn.default_channel, exchange=topology.exchange(settings.intake_exchange)).publish(
                codec.encode_json([point(1)]), routing_key=ours.routing_key, content_type=codec.JSON,
                content_encoding="binary", message_id="crossing",
                declare=[topology.group_queue(settings.intake_exchange, settings.intake_group,
                                              settings.intake_binding)],
                headers={topology.TENANT: other.tenant, topology.SOURCE: "events", topology.VERSION: "1",
                         topology.MESSAGE_ID: "crossing"},
            )
        consumer_thread(settings)
        wait_for(lambda: dead_count(settings) == 1, 60, "the message dead-lettered")
        [dead] = dead_letters(settings)
        assert "routing key" in dead["headers"]["shoal-dead-reason"]
        assert head(theirs) == 0 and head(shoal) == 0


# -- the publisher agrees with the Python producer -------------------------------------------------------------


TYPED = DataSourceSpec("typed", "1", 3, {"id": AttributeType.INT64, "score": AttributeType.FLOAT64,
                                         "ref": AttributeType.GUID}, ["id"])


def test_attribute_values_the_producer_takes_are_taken_from_the_publisher_too(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer]
) -> None:
    """An int (or NumPy int) for a float64 attribute and a guid given as text: the producer takes them, but the
    publisher sent them in the int64 and string slots and the consumer dead-lettered them."""
    settings = intake_settings()
    ref = uuid.UUID(int=7)
    points = [DataPoint({"id": 1, "score": 2, "ref": str(ref)}, [1.0, 2.0, 3.0]),
              DataPoint({"id": 2, "score": np.int64(3), "ref": "{" + str(ref).upper() + "}"}, [1.0, 2.0, 3.0]),
              DataPoint({"id": 3, "score": 2**60 + 1, "ref": ref}, [1.0, 2.0, 3.0])]
    other = DataSourceSpec("typed", "2", 3, dict(TYPED.attribute_types), ["id"])
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(TYPED)
        shoal.create_data_source(other)
        shoal.producer("typed", "2").upload(points)
        with Publisher(settings) as p:
            p.publish("typed", "1", points, message_id="typed")
            # What the producer refuses is still refused: text for a float64, text that is no guid.
            p.publish("typed", "1", [DataPoint({"id": 4, "score": "2", "ref": ref}, [1.0, 2.0, 3.0])],
                      message_id="text-score")
            p.publish("typed", "1", [DataPoint({"id": 5, "score": 1.5, "ref": "not-a-guid"}, [1.0, 2.0, 3.0])],
                      message_id="bad-guid")
        consumer_thread(settings)
        wait_for(lambda: head(shoal, TYPED) == 3 and dead_count(settings) == 2, 60, "the message and dead letters")
        columns = ["id", "score", "ref", "__vector"]
        published, uploaded = shoal.fold("typed", "1").select(columns), shoal.fold("typed", "2").select(columns)
        assert published.to_pylist() == uploaded.to_pylist()
        assert published["score"].to_pylist() == [2.0, 3.0, float(2**60 + 1)]
        assert published["ref"].to_pylist() == [str(ref)] * 3
        reasons = {d["headers"]["shoal-message-id"]: d["headers"]["shoal-dead-reason"] for d in dead_letters(settings)}
        assert "attribute 'score': expected a float64 value, got string" in reasons["text-score"]
        assert "attribute 'ref': expected a guid value, got string" in reasons["bad-guid"]


SPARSE = DataSourceSpec("sparse", "1", 10, {"id": AttributeType.INT64}, ["id"], vectors_are_sparse=True)


@pytest.mark.parametrize(("vector", "says"), [
    (SparseVector([5.9], [1.0]), "sparse indices must be integers"),
    (SparseVector([3.0], [1.0]), "sparse indices must be integers"),
    (SparseVector([True], [3.0]), "sparse indices must be integers"),
    (SparseVector(["7"], [1.0]), "sparse indices must be numbers"),
    (SparseVector([1], ["2.5"]), "sparse values must be numbers"),
    (SparseVector([1, 2], [1.0]), "as many values as indices"),
    (SparseVector([1, 1], [1.0, 2.0]), "repeats an index"),
    (SparseVector([1], [float("nan")]), "must be finite"),
    ([1 + 2j, 3, 4, 5], "vector coordinates must be numbers"),
    (["1", 2, 3, 4], "vector coordinates must be numbers"),
    ([1e39, 0, 0, 0], "past float32's range"),
], ids=["float-index", "float-index-3.0", "bool-index", "text-index", "text-value", "lengths", "repeated", "nan",
        "complex", "text", "past-float32"])
def test_the_publisher_refuses_vectors_every_other_write_path_refuses(
    intake_settings: Callable[..., Settings], broker: redis.Redis, vector: object, says: str
) -> None:
    """It converted them (a float index 5.9 stored as 5, text "7" as 7, True as 1, complex 1+2j as 1.0): the
    Python producer and the HTTP routes refuse them, and so does the publisher now, before sending anything."""
    settings = intake_settings()
    spec = SPARSE if isinstance(vector, SparseVector) else EVENTS
    attributes = {"id": 1} if spec is SPARSE else {"id": 1, "tag": "t"}
    item = DataPoint(attributes, vector)  # type: ignore[arg-type]
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(spec)
        with pytest.raises(ValidationError, match=says):
            shoal.producer(spec.name, spec.version).upload([item])
        with Publisher(settings) as p, pytest.raises(ValidationError) as refused:
            p.publish(spec.name, spec.version, [point(0), item] if spec is EVENTS else [item])
        assert says in str(refused.value)
        assert "point 1" in str(refused.value) if spec is EVENTS else "point 0" in str(refused.value)
        assert broker.llen(queue_name(settings)) == 0  # nothing sent


# -- queue entries that are no kombu envelope -----------------------------------------------------------------


ENVELOPE = {"content-encoding": "binary", "content-type": "application/json", "headers": {},
            "properties": {"body_encoding": "base64", "delivery_tag": "x",
                           "delivery_info": {"exchange": "", "routing_key": ""}}}
NOT_ENVELOPES = {
    "not-json": b"hello, not json",
    "list": b"[1, 2]",
    "headers-list": json.dumps({**ENVELOPE, "body": "W10=", "headers": [1]}).encode(),
    "bad-base64": json.dumps({**ENVELOPE, "body": "!!!not base64!!!"}).encode(),
    "no-properties": json.dumps({"body": "W10=", "headers": {}}).encode(),
}


def test_queue_entries_that_are_no_kombu_envelope_are_dead_lettered_as_they_were(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer],
    broker: redis.Redis,
) -> None:
    """Pushed by another Redis client, or malformed: each killed the consumer (or, caught as a lost connection,
    had it reconnect for ever), and every consumer after it, so nothing behind it landed. They go to the dead
    letters with the reason and the entry as it was; `shoal consume --dead` shows them; the queue goes on."""
    settings = intake_settings()
    name = queue_name(settings)
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)
        with Publisher(settings) as p:
            p.publish("events", "1", [point(1)])  # declares the queue
            for entry in NOT_ENVELOPES.values():
                broker.lpush(name, entry)
            p.publish("events", "1", [point(2)])
        consumer = consumer_thread(settings)
        wait_for(lambda: dead_count(settings) == len(NOT_ENVELOPES) and head(shoal) == 2, 60,
                 "the entries dead-lettered and both messages committed")
        assert consumer.thread.is_alive()  # type: ignore[attr-defined]
        assert sorted(shoal.fold("events", "1")["id"].to_pylist()) == [1, 2]
        assert not [k for k in broker.scan_iter(match=f"{name}.processing.*") if broker.type(k) == b"list"
                    and broker.llen(k)]
        letters = dead_letters(settings)
        assert sorted(d["body"] for d in letters) == sorted(NOT_ENVELOPES.values())
        reasons = [d["headers"]["shoal-dead-reason"] for d in letters]
        assert all(r.startswith(("not a kombu message envelope", "the entry is a JSON", "the envelope"))
                   for r in reasons), reasons


# -- consumer groups ------------------------------------------------------------------------------------------


def test_recovery_takes_only_its_own_groups_lists(intake_settings: Callable[..., Settings],
                                                  broker: redis.Redis) -> None:
    """Recovery matched `{queue}.processing.*` as a glob: group "a" swept group "a.processing.x"'s whole queue
    and its dead consumers' lists into its own, and a queue name with glob characters ("t[1]") matched others."""
    settings = intake_settings()
    x = settings.intake_exchange
    pairs = [(f"{x}.a", f"{x}.a.processing.x"), (f"{x}.a", f"{x}.a.processing"), (f"{x}[1].g", f"{x}1.g")]
    with Connection(broker_url(settings)) as conn:
        for mine, other in pairs:
            broker.lpush(other, *[json.dumps({**ENVELOPE, "body": base64.b64encode(b"[]").decode(),
                                              "properties": {**ENVELOPE["properties"], "delivery_tag": f"t{i}"}})
                                  for i in range(3)])
            dead = ReliableQueue(broker, conn.channel(), other, lease_s=60)  # leads, takes one, then dies
            assert dead.heartbeat()
            assert dead.get(1) is not None
            broker.delete(f"{dead.processing}.alive", dead.leader_key)
            mine_queue = ReliableQueue(broker, conn.channel(), mine, lease_s=60)
            mine_queue.heartbeat()
            assert mine_queue.recover() == 0, (mine, other)
            assert broker.llen(other) == 2 and broker.llen(dead.processing) == 1 and broker.llen(mine) == 0
            theirs = ReliableQueue(broker, conn.channel(), other, lease_s=60)
            assert theirs.heartbeat()  # their own group's next leader does recover it, as it takes the lead
            assert theirs.recover() == 0
            assert broker.llen(other) == 3
            theirs.release()


runner = CliRunner()


@pytest.mark.parametrize("group", ["a b*", "", "*", "x" * 101, "a.dead", "a.processing.x", "a.processing"])
@pytest.mark.parametrize("dead", [False, True], ids=["consume", "dead"])
def test_consume_refuses_a_group_name_the_setting_refuses(
    intake_settings: Callable[..., Settings], group: str, dead: bool
) -> None:
    """`--group` took names SHOAL_INTAKE_GROUP refuses ('*' made recovery sweep every group's lists)."""
    settings = intake_settings()
    args = ["consume", "--group", group, *(["--dead"] if dead else [])]
    result = runner.invoke(app, args, env=settings_env(settings))
    assert result.exit_code == 1, result.output
    assert "invalid consumer group" in result.output and "Traceback" not in result.output
    assert settings.intake_exchange not in result.output  # stopped before anything was consumed


# -- a message id reused for other content --------------------------------------------------------------------


def test_a_message_id_reused_for_other_content_is_dead_lettered_and_the_rest_commits(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer],
) -> None:
    """A publisher that reuses a message id (a document id) for changed content: the log refuses the second
    batch under the id (BatchIdReusedError), which is dead-lettered naming the id, where it would have stopped
    the consumer; messages around it commit, and a true repeat of the first still counts as a duplicate."""
    settings = intake_settings()
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)
        with Publisher(settings) as p:
            p.publish("events", "1", [point(1, "first")], message_id="doc-7")
        consumer = consumer_thread(settings)
        wait_for(lambda: head(shoal) == 1, 60, "the first message committed")
        with Publisher(settings) as p:
            p.publish("events", "1", [point(1, "changed")], message_id="doc-7")
            p.publish("events", "1", [point(2)], message_id="doc-8")
            p.publish("events", "1", [point(1, "first")], message_id="doc-7")
        wait_for(lambda: consumer.stats.messages + consumer.stats.duplicates + consumer.stats.dead == 4, 60,
                 "every message handled")
        assert dead_count(settings) == 1 and "'msg:doc-7' was already used" in consumer.stats.reasons[-1]
        assert consumer.stats.duplicates == 1 and head(shoal) == 2
        fold = shoal.fold("events", "1")
        assert sorted(zip(fold["id"].to_pylist(), fold["tag"].to_pylist(), strict=True)) == [(1, "first"), (2, "t")]
        assert consumer.thread.is_alive()  # type: ignore[attr-defined]


def test_a_message_for_a_tenant_that_does_not_exist_makes_none(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer],
) -> None:
    """Each message naming an unknown tenant created that tenant's catalog row (and a scope the consumer kept)
    before it was dead-lettered: any publisher could grow the tenants table without bound. It is dead-lettered
    as not found and creates nothing; the known tenant's messages commit as before."""
    from sqlalchemy import func, select

    from shoal.catalog.models import Tenant

    settings = intake_settings()
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(EVENTS)

        def tenants() -> int:
            with shoal.engine.connect() as conn:
                return int(conn.execute(select(func.count()).select_from(Tenant)).scalar_one())

        before = tenants()
        for i in range(3):
            with Publisher(settings, tenant=f"nobody{i}") as p:
                p.publish("events", "1", [point(i)])
        with Publisher(settings) as p:
            p.publish("events", "1", [point(9)])
        consumer = consumer_thread(settings)
        wait_for(lambda: consumer.stats.dead == 3 and head(shoal) == 1, 60, "the messages handled")
        assert "tenant 'nobody" in consumer.stats.reasons[-1] and "not found" in consumer.stats.reasons[-1]
        assert tenants() == before
