"""Event-driven intake: messages through a real broker (Valkey) into the log, exactly once, with dead letters,
consumer crashes, a broker restart and backpressure. Consumers and publishers are real processes or threads
on real sockets; nothing is mocked."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pytest
import redis
from conftest import dead_count, run_helper, serve_api, settings_env, stop_process, wait_for
from helpers.arrow_bodies import arrow_stream

from shoal import Shoal
from shoal.catalog.repo import head_of
from shoal.config.settings import Settings
from shoal.errors import BackpressureError, ValidationError
from shoal.index.builder import ShardBuilder
from shoal.intake import codec
from shoal.intake.consumer import IntakeConsumer, dead_letters
from shoal.intake.publisher import Publisher
from shoal.log.records import AttributeType, DataPoint, DataSourceSpec, IndexSpec, Tombstone
from shoal.log.validation import VECTOR

DIM = 8
SPEC = DataSourceSpec("events", "1", DIM, {"id": AttributeType.INT64, "tag": AttributeType.STRING}, ["id"])


def vector(i: int) -> list[float]:
    return (np.arange(DIM, dtype=np.float64) + i % 1000).tolist()


def start_consumer(settings: Settings, log: Path) -> subprocess.Popen[str]:
    """`shoal consume` as a real child process."""
    out = open(log, "a")  # noqa: SIM115 - the child writes to it until it ends
    return subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "consume"], env=settings_env(settings), stdout=out,
        stderr=subprocess.STDOUT, text=True,
    )


def head(shoal: Shoal) -> int:
    return head_of(shoal.engine, shoal.get_data_source(SPEC.name, SPEC.version).id)[0]


# -- codec ------------------------------------------------------------------------------------------------


def test_json_and_arrow_bodies_decode_to_the_same_batch() -> None:
    ids = np.arange(5)
    vectors = np.stack([vector(int(i)) for i in ids]).astype(np.float32)
    as_json = codec.decode(
        SPEC, codec.JSON, codec.encode_json([DataPoint({"id": int(i), "tag": "a"}, vectors[i]) for i in ids]), 100
    )
    as_arrow = codec.decode(SPEC, codec.ARROW, codec.encode_arrow(vectors, {"id": ids, "tag": ["a"] * 5}), 100)
    assert as_json.equals(as_arrow)
    # Tombstones: JSON isDeleted, or the Arrow form's is_deleted column (order kept across runs).
    mixed = codec.encode_arrow(vectors[:2], {"id": [7, 7], "tag": ["x", "x"]}, deleted=[False, True])
    table = codec.decode(SPEC, codec.ARROW, mixed, 100)
    assert table.num_rows == 2
    assert codec.decode(SPEC, codec.JSON, codec.encode_json([Tombstone({"id": 7})]), 100).num_rows == 1


@pytest.mark.parametrize(
    ("content_type", "body", "says"),
    [
        ("text/plain", b"[]", "unsupported content type"),
        (codec.JSON, b"[{", "not a Vektonn upload body"),
        (codec.JSON, b"[]", "no data point"),
        (codec.JSON, codec.encode_json([DataPoint({"id": 1, "tag": "a"}, [1.0])]), "wrong dimension"),
        (codec.JSON, codec.encode_json([DataPoint({"id": 1}, vector(1))]), "tag"),
        (codec.ARROW, b"garbage", "not an Arrow IPC stream"),
        (codec.ARROW, codec.encode_arrow(np.ones((2, 3)), {"id": [1, 2], "tag": ["a", "b"]}), "dimension"),
        # Built by hand: encode_arrow refuses an upsert without a vector before sending.
        (codec.ARROW, arrow_stream({"id": [1], "tag": ["a"], "is_deleted": [False]}), "missing vector"),
    ],
)
def test_bad_bodies_are_refused_by_name(content_type: str, body: bytes, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        codec.decode(SPEC, content_type, body, 100)


# -- consumer ---------------------------------------------------------------------------------------------


@pytest.fixture
def consumer_thread(intake_settings: Callable[..., Settings]) -> Iterator[Callable[[Settings], IntakeConsumer]]:
    started: list[tuple[IntakeConsumer, threading.Thread]] = []

    def start(settings: Settings) -> IntakeConsumer:
        consumer = IntakeConsumer(settings)
        thread = threading.Thread(target=consumer.run, daemon=True)
        thread.start()
        started.append((consumer, thread))
        return consumer

    yield start
    for consumer, thread in started:
        consumer.stop.set()
        thread.join(30)


def test_messages_land_once_and_poison_goes_to_the_dead_letter_queue(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer]
) -> None:
    settings = intake_settings()
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(SPEC)
        with Publisher(settings) as p:  # published before any consumer runs: the queue keeps them
            p.publish("events", "1", [DataPoint({"id": i, "tag": "a"}, vector(i)) for i in range(10)])
            p.publish_columns("events", "1", np.stack([vector(i) for i in range(10, 15)]),
                              {"id": np.arange(10, 15), "tag": ["b"] * 5})
            again = p.publish("events", "1", [Tombstone({"id": 3})])
            p.publish("events", "1", [Tombstone({"id": 3})], message_id=again)  # a repeated publish
            p.publish_raw("events", "1", b"[{", codec.JSON)
            p.publish("missing", "1", [DataPoint({"id": 1, "tag": "a"}, vector(1))])
        consumer = consumer_thread(settings)
        wait_for(lambda: head(shoal) >= 16 and dead_count(settings) == 2, 60, "the messages to be consumed")
        folded = shoal.fold("events", "1")
        assert sorted(folded["id"].to_pylist()) == [i for i in range(15) if i != 3]
        assert head(shoal) == 16  # the repeated tombstone message wrote nothing
        wait_for(lambda: consumer.stats.duplicates == 1, 30, "the duplicate to be counted")
        reasons = sorted(d["headers"]["shoal-dead-reason"] for d in dead_letters(settings))
        assert len(reasons) == 2
        assert "not a Vektonn upload body" in reasons[1] or "not a Vektonn upload body" in reasons[0]
        assert any("'missing'" in r and "not found" in r for r in reasons)


@pytest.mark.slow
def test_exactly_once_with_four_publishers_and_two_consumer_kills(
    intake_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    """100,000 points as 10,000 messages from 4 publisher processes; the consumer SIGKILLed twice midway."""
    settings = intake_settings(intake_max_points=2_000)
    publishers, messages, per_message, rate, poison_every = 4, 2_500, 10, 250.0, 500
    total = publishers * messages * per_message
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(SPEC)
        log = tmp_path / "consumer.log"
        consumer = start_consumer(settings, log)
        procs = [
            run_helper("intake_publisher.py", [str(w), str(messages), str(per_message), str(rate), str(poison_every)],
                       settings)
            for w in range(publishers)
        ]
        try:
            for kill_at in (total // 5, total // 2):
                wait_for(lambda k=kill_at: head(shoal) >= k, 120, f"{kill_at} points in the log")
                consumer.send_signal(signal.SIGKILL)
                consumer.wait(10)
                consumer = start_consumer(settings, log)
            results = []
            for proc in procs:
                stdout, stderr = proc.communicate(timeout=180)
                assert proc.returncode == 0, stderr
                results.append(json.loads(stdout))
            # Messages the killed consumers held come back after the visibility timeout (3 s here).
            wait_for(lambda: head(shoal) >= total, 400, "every point in the log")
            poisoned = [m for r in results for m in r["poisoned"]]
            wait_for(lambda: dead_count(settings) >= len(poisoned), 60, "every poison message dead-lettered")
        finally:
            stop_process(consumer)
            for proc in procs:
                stop_process(proc)  # type: ignore[arg-type]
        assert consumer.returncode is not None
        # Exactly once: the head is the point count (a redelivered message appends nothing), one batch per
        # message id, and the folded state is every point with its own vector.
        assert head(shoal) == total
        entries = shoal.read_log("events", "1")
        log_table = pa.Table.from_batches(list(entries))
        assert log_table.num_rows == total
        folded = shoal.fold("events", "1")
        ids = np.sort(np.asarray(folded["id"].to_pylist()))
        assert np.array_equal(ids, np.arange(total))
        got = dict(zip(folded["id"].to_pylist(), folded[VECTOR].to_pylist(), strict=True))
        for i in (0, 12_345, 54_321, total - 1):
            assert got[i] == pytest.approx(vector(i))
        published = {m for r in results for m in r["published"]}
        assert len(published) == publishers * messages
        letters = dead_letters(settings)
        assert sorted(d["headers"]["shoal-message-id"] for d in letters) == sorted(poisoned)
        for d in letters:
            reason = d["headers"]["shoal-dead-reason"]
            assert "wrong dimension" in reason or "not a Vektonn upload body" in reason


@pytest.mark.slow
def test_broker_restart_mid_stream_loses_nothing(
    make_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer], tmp_path: Path
) -> None:
    from shoal.servers.embedded import _port_free, ensure_valkey, stop_embedded

    broker_dir = tmp_path / "broker"
    url = ensure_valkey(broker_dir)
    try:
        settings = make_settings("local", redis_url=url, intake_max_wait_ms=50, intake_visibility_timeout_s=3)
        with Shoal(settings, notify=False) as shoal:
            shoal.create_data_source(SPEC)
            consumer_thread(settings)
            messages, per_message = 600, 5
            done = threading.Event()
            errors: list[BaseException] = []

            def publish() -> None:
                try:
                    with Publisher(settings) as p:
                        for m in range(messages):
                            first = m * per_message
                            p.publish("events", "1", [DataPoint({"id": i, "tag": "r"}, vector(i))
                                                      for i in range(first, first + per_message)])
                            if m % 50 == 0:
                                done.wait(0.05)  # keep the stream going while the broker restarts
                except BaseException as exc:  # noqa: BLE001 - reported by the test below
                    errors.append(exc)
                finally:
                    done.set()

            thread = threading.Thread(target=publish)
            thread.start()
            wait_for(lambda: head(shoal) >= 500, 60, "the stream to be under way")
            client = redis.Redis.from_url(url)
            try:
                client.shutdown()  # graceful: the append-only file is written out
            except redis.ConnectionError:
                pass
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            wait_for(lambda: _port_free(port), 30, "the broker to shut down")
            assert ensure_valkey(broker_dir) == url  # back on the same port
            thread.join(120)
            assert not errors, errors
            total = messages * per_message
            wait_for(lambda: head(shoal) >= total, 120, "every point in the log after the restart")
            assert head(shoal) == total
            folded = shoal.fold("events", "1")
            assert sorted(folded["id"].to_pylist()) == list(range(total))
    finally:
        stop_embedded(broker_dir)


# -- backpressure -----------------------------------------------------------------------------------------


def test_backpressure_pauses_the_consumer_until_the_index_catches_up(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer]
) -> None:
    settings = intake_settings(max_index_lag_seqs=40, intake_max_points=50)
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(SPEC)
        shoal.create_index(IndexSpec("events-flat", "1", "events", "1", algorithm="flat", metric="euclidean",
                                     id_attributes=["id"]))
        with Publisher(settings) as p:
            for m in range(20):
                batch = [DataPoint({"id": i, "tag": "b"}, vector(i)) for i in range(m * 10, m * 10 + 10)]
                p.publish("events", "1", batch)
        consumer = consumer_thread(settings)
        wait_for(lambda: consumer.paused, 60, "the consumer to pause on index lag")
        held_at = head(shoal)
        assert 40 < held_at < 200  # it stopped taking messages: the rest wait in the broker
        with pytest.raises(BackpressureError, match="lag"):
            shoal.check_backpressure("events", "1")
        shard = shoal.get_index("events-flat", "1").shards[0].id
        builder = ShardBuilder(shoal.engine, shoal.storage)
        # The indexer catches up (in-process here); the consumer resumes; repeat until everything landed.
        wait_for(lambda: builder.materialize(shard) is not None and head(shoal) >= 200, 120,
                 "intake to resume after the index caught up")
        assert sorted(shoal.fold("events", "1")["id"].to_pylist()) == list(range(200))


def test_backpressure_weighs_only_the_sources_the_consumer_wrote_lately(
    intake_settings: Callable[..., Settings], consumer_thread: Callable[[Settings], IntakeConsumer]
) -> None:
    """A source the consumer wrote to long ago does not hold intake when an index over it falls behind (one made
    later over a large source starts at built 0): every source of the group stopped until that index was built.
    A source written lately still pauses intake, and keeps it paused for as long as it lags."""
    settings = intake_settings(max_index_lag_seqs=40, intake_max_points=50)
    other = DataSourceSpec("other", "1", DIM, SPEC.attribute_types, ["id"])
    with Shoal(settings, notify=False) as shoal:
        for spec in (SPEC, other):
            shoal.create_data_source(spec)
            shoal.create_index(IndexSpec(f"{spec.name}-flat", "1", spec.name, "1", algorithm="flat",
                                         metric="euclidean", id_attributes=["id"]))
        consumer = consumer_thread(settings)
        consumer.recent_writes_s = 3.0  # past the 1 s the lag reading is cached
        with Publisher(settings) as p:
            p.publish("events", "1", [DataPoint({"id": 0, "tag": "a"}, vector(0))])
            wait_for(lambda: head(shoal) >= 1, 60, "the consumer to write to events")
            written_at = time.monotonic()
            wait_for(lambda: time.monotonic() > written_at + 2 * consumer.recent_writes_s, 10, "the write to age")
            # Far behind its head now, written by another client (HTTP, say); not by the consumer lately.
            shoal.producer("events", "1").upload([DataPoint({"id": i, "tag": "a"}, vector(i)) for i in range(1, 100)])
            with pytest.raises(BackpressureError, match="lag"):
                shoal.check_backpressure("events", "1")
            p.publish("other", "1", [DataPoint({"id": 1, "tag": "b"}, vector(1))])
            wait_for(lambda: shoal.fold("other", "1").num_rows == 1, 30, "the other source's message to land")
            assert not consumer.paused
            # Written lately and lagging: intake pauses, and stays paused past the window while the lag holds.
            p.publish("other", "1", [DataPoint({"id": i, "tag": "b"}, vector(i)) for i in range(2, 60)])
            wait_for(lambda: consumer.paused, 60, "the consumer to pause on the other source's lag")
            paused_at = time.monotonic()
            p.publish("other", "1", [DataPoint({"id": 60, "tag": "b"}, vector(60))])
            while time.monotonic() < paused_at + 3 * consumer.recent_writes_s:  # a window that ends on its own
                assert consumer.paused
                time.sleep(0.1)
        assert shoal.fold("other", "1").num_rows == 59


def test_http_upload_answers_429_with_retry_after_past_the_lag_bound(make_settings: Callable[..., Settings]) -> None:
    from test_api_vektonn import point

    settings = make_settings("local", max_index_lag_seqs=2, backpressure_retry_after_s=7)
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with Shoal(settings, notify=False) as shoal:
        types = {"id": AttributeType.INT64, "payload": AttributeType.STRING}
        shoal.create_data_source(DataSourceSpec("up", "1", 2, types, ["id"]))
        shoal.create_index(
            IndexSpec("up-flat", "1", "up", "1", algorithm="flat", metric="euclidean", id_attributes=["id"])
        )
    with serve_api(settings) as base:
        url = f"{base}/api/v1/upload/up/1"
        body = [point(i, "p", [float(i), 0.0]) for i in range(3)]
        assert httpx.post(url, json=body, timeout=30).status_code == 200  # lag 3 > 2 now; no worker runs
        refused = None

        def refused_now() -> bool:
            nonlocal refused
            refused = httpx.post(url, json=[point(9, "p", [9.0, 0.0])], timeout=30)
            return refused.status_code == 429

        wait_for(refused_now, 30, "an upload refused with 429")  # the lag is read at most once a second
        assert refused is not None
        assert refused.headers["Retry-After"] == "7"
        assert "lag" in refused.json()["errorMessages"][0]
        with Shoal(settings, notify=False) as shoal:
            before = head_of(shoal.engine, shoal.get_data_source("up", "1").id)[0]
            again = httpx.post(url, json=[point(10, "p", [1.0, 0.0])], timeout=30)
            assert again.status_code == 429
            assert head_of(shoal.engine, shoal.get_data_source("up", "1").id)[0] == before  # nothing written
