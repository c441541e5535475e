"""The publisher takes and refuses what the other write paths take and refuse: `Publisher.publish_columns` refuses,
before sending, the vectors and attribute columns `Producer.upload_columns` refuses (nothing converted);
`Publisher.publish` sends every datetime the Python producer takes in a form `shoal consume` reads, and a guid's
text as every path reads it; an Arrow body of tombstones refuses unknown and partial columns as the other paths
do. Real Publisher, real `IntakeConsumer` on the embedded Valkey, real HTTP server; nothing is mocked."""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import numpy as np
import pytest
from conftest import wait_for

from shoal import Shoal
from shoal.config.settings import Settings
from shoal.errors import ValidationError
from shoal.intake.codec import ARROW, encode_arrow
from shoal.intake.consumer import IntakeConsumer, dead_letters
from shoal.intake.publisher import Publisher
from shoal.log.records import AttributeType, DataPoint, DataSourceSpec
from shoal.log.validation import VECTOR

SPEC = DataSourceSpec("pub", "1", 2, {"id": AttributeType.INT64, "at": AttributeType.DATETIME,
                                      "uid": AttributeType.GUID}, ["id"])
# Europe/Amsterdam kept local mean time until 1937: an offset of +00:19:32, seconds included.
LMT = dt.datetime(1900, 1, 1, tzinfo=ZoneInfo("Europe/Amsterdam"))
UID = uuid.UUID(int=5)
AT = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)


@pytest.fixture
def consume(intake_settings: Callable[..., Settings]) -> Iterator[Callable[[Settings, int], IntakeConsumer]]:
    """Start a consumer in a thread and wait until it has committed or dead-lettered `n` messages."""
    started: list[tuple[IntakeConsumer, threading.Thread]] = []

    def run(settings: Settings, n: int) -> IntakeConsumer:
        consumer = IntakeConsumer(settings)
        thread = threading.Thread(target=consumer.run, daemon=True)
        thread.start()
        started.append((consumer, thread))
        wait_for(lambda: consumer.stats.messages + consumer.stats.dead >= n, 60, f"{n} messages consumed")
        return consumer

    yield run
    for consumer, thread in started:
        consumer.stop.set()
        thread.join(30)


def _rows(shoal: Shoal) -> dict[int, dict[str, Any]]:
    return {row["id"]: row for row in shoal.fold(SPEC.name, SPEC.version).to_pylist()}


def _columns(i: int, **extra: Any) -> dict[str, Any]:
    return {"id": [i], "at": [AT], "uid": [str(UID)], **extra}


@pytest.mark.parametrize(("vectors", "columns", "says"), [
    (np.array([["1.5", "2"]]), _columns(1), "vectors must be numbers"),
    (np.array([[1 + 5j, 2 + 0j]]), _columns(2), "vectors must be numbers"),
    (np.ma.masked_array([[1.0, 99.0]], mask=[[False, True]]), _columns(3), "must not be a masked array"),
    (np.array([[1e39, 0.0]]), _columns(4), "1e\\+39 at index 0 is past float32's range"),
    (np.zeros((1, 2)), _columns(5, at=np.array(["2024-01-01"], dtype="datetime64[s]")), "'at'.*datetime64"),
])
def test_publish_columns_refuses_what_upload_columns_refuses_and_sends_nothing(
    intake_settings: Callable[..., Settings], consume: Callable[[Settings, int], IntakeConsumer],
    vectors: Any, columns: dict[str, Any], says: str,
) -> None:
    settings = intake_settings()
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(SPEC)
        with pytest.raises(ValidationError, match=says):
            shoal.producer(SPEC.name, SPEC.version).upload_columns(vectors, columns)
        with Publisher(settings) as p:
            with pytest.raises(ValidationError, match=says):
                p.publish_columns(SPEC.name, SPEC.version, vectors, columns)
            # Then a message the consumer takes: a datetime with a seconds offset and a guid as uuid.UUID are sent
            # as the instant and the guid; a tombstone row's vector is never read, so a placeholder NaN is fine.
            p.publish_columns(SPEC.name, SPEC.version, np.array([[0.5, 2.0], [np.nan, np.nan]]),
                              {"id": [100, 101], "at": [LMT, None], "uid": [UID, None]}, deleted=[False, True])
        consumer = consume(settings, 1)
        assert consumer.stats.dead == 0, consumer.stats.reasons
        rows = _rows(shoal)
    # Only the good message was sent: nothing converted from the refused one was stored.
    assert list(rows) == [100]
    assert rows[100][VECTOR] == [0.5, 2.0]
    assert rows[100]["at"] == LMT.astimezone(dt.UTC) and rows[100]["uid"] == str(UID)


def test_publish_sends_a_datetime_with_a_seconds_offset_as_the_producer_stores_it(
    intake_settings: Callable[..., Settings], consume: Callable[[Settings, int], IntakeConsumer],
) -> None:
    settings = intake_settings()
    assert LMT.utcoffset() == dt.timedelta(minutes=19, seconds=32)
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(SPEC)
        shoal.producer(SPEC.name, SPEC.version).upload([DataPoint({"id": 1, "at": LMT, "uid": UID}, [1.0, 0.0])])
        with Publisher(settings) as p:
            p.publish(SPEC.name, SPEC.version, [DataPoint({"id": 2, "at": LMT, "uid": UID}, [0.0, 1.0]),
                                                DataPoint({"id": 3, "at": dt.datetime(2024, 5, 6, 7, 8), "uid": UID},
                                                          [0.0, 1.0])])
        consumer = consume(settings, 1)
        assert consumer.stats.dead == 0, consumer.stats.reasons
        rows = _rows(shoal)
    assert rows[2]["at"] == rows[1]["at"] == LMT.astimezone(dt.UTC)  # the same instant as the producer's
    assert rows[3]["at"] == dt.datetime(2024, 5, 6, 7, 8, tzinfo=dt.UTC)  # naive taken as UTC, as ever


def test_publish_guid_text_the_json_route_refuses_is_refused_not_stored(
    intake_settings: Callable[..., Settings], consume: Callable[[Settings, int], IntakeConsumer],
) -> None:
    settings = intake_settings()
    text = "12-345678123412341234123456789abc"  # uuid.UUID reads it (hyphens anywhere); no write path takes it
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(SPEC)
        with pytest.raises(ValidationError, match="not a guid"):
            shoal.producer(SPEC.name, SPEC.version).upload([DataPoint({"id": 1, "at": AT, "uid": text}, [1, 0])])
        with Publisher(settings) as p:
            p.publish(SPEC.name, SPEC.version, [DataPoint({"id": 1, "at": AT, "uid": text}, [1.0, 0.0])])
            p.publish(SPEC.name, SPEC.version, [  # the forms every path takes
                DataPoint({"id": 2, "at": AT, "uid": UID}, [1.0, 0.0]),
                DataPoint({"id": 3, "at": AT, "uid": "{" + str(UID).upper() + "}"}, [1.0, 0.0])])
        consumer = consume(settings, 2)
        rows = _rows(shoal)
        reasons = [d["headers"]["shoal-dead-reason"] for d in dead_letters(settings)]
    assert sorted(rows) == [2, 3] and {rows[i]["uid"] for i in rows} == {str(UID)}
    assert consumer.stats.dead == 1 and len(reasons) == 1
    assert "point 0, attribute 'uid': expected a guid value, got string" in reasons[0]  # no guid: sent as text


TOMB = DataSourceSpec("tomb", "1", 2, {"id": AttributeType.INT64, "s": AttributeType.STRING,
                                       "t": AttributeType.STRING}, ["id"])


def test_arrow_tombstones_refuse_unknown_and_partial_columns(served: tuple[str, Settings]) -> None:
    url, settings = served
    upload = f"{url}/api/v1/upload/{TOMB.name}/{TOMB.version}"
    with Shoal(settings, notify=False) as shoal, httpx.Client(timeout=30) as http:
        shoal.create_data_source(TOMB)
        shoal.producer(TOMB.name, TOMB.version).upload([DataPoint({"id": 1, "s": "a", "t": "b"}, [1.0, 0.0])])

        def post(columns: dict[str, Any]) -> httpx.Response:
            return http.post(upload, content=encode_arrow(None, columns), headers={"Content-Type": ARROW})

        for columns, says in [
            ({"id": [1], "no_such_attr": ["junk"]}, "attribute 'no_such_attr': unknown attribute"),
            ({"id": [1], "s": ["a"]}, "attribute 's': a tombstone carries only the permanent (key) attributes, or "
                                      "every attribute"),
        ]:
            r = post(columns)
            assert r.status_code == 400, r.text
            assert any(says in m for m in r.json()["errorMessages"]), r.json()
            assert list(_ids(shoal)) == [1]  # nothing deleted
        # The two forms every path takes: the key alone, or every attribute.
        assert post({"id": [1], "s": [None], "t": ["b"]}).status_code == 200
        assert list(_ids(shoal)) == []
        shoal.producer(TOMB.name, TOMB.version).upload([DataPoint({"id": 2, "s": "a", "t": "b"}, [1.0, 0.0])])
        assert post({"id": [2]}).status_code == 200
        assert list(_ids(shoal)) == []


def _ids(shoal: Shoal) -> list[int]:
    return sorted(shoal.fold(TOMB.name, TOMB.version)["id"].to_pylist())


@pytest.mark.parametrize("message_id", ["", 0])
def test_a_message_id_given_empty_or_zero_is_refused_not_replaced(
    intake_settings: Callable[..., Settings], message_id: Any
) -> None:
    """A falsy message id ("" or 0) was silently replaced by a random one: each retry of the same message then
    went out under a new id, which the consumer cannot tell from another message (written twice)."""
    settings = intake_settings()
    with Publisher(settings) as p, pytest.raises(ValidationError, match="message id must be a string"):
        p.publish(SPEC.name, SPEC.version, [DataPoint({"id": 1, "at": LMT, "uid": UID}, [1.0, 0.0])],
                  message_id=message_id)


def test_an_attribute_named_vector_of_the_wrong_length_is_named_like_any_other() -> None:
    """The vectors' row count was kept under the name `vector`, over an attribute of that name's own: a short
    `vector` attribute column passed the length check and pyarrow raised ArrowInvalid instead of the
    ValidationError naming the column that any other attribute gets."""
    for name in ("vector", "is_deleted", "tag"):
        with pytest.raises(ValidationError, match=f"attribute '{name}': column has 1 values, expected 2"):
            encode_arrow(np.zeros((2, 2), dtype=np.float32), {"id": [1, 2], name: ["a"]}, deleted=[False, False])


def test_encode_arrow_refuses_upserts_without_vectors() -> None:
    """With no vectors, every row `deleted` leaves an upsert went out without a vector: the publisher answered and
    the consumer dead-lettered the message. Refused before sending, naming the rows."""
    says = r"point 1, attribute 'vector': vectors are required for upserts"
    with pytest.raises(ValidationError, match=says) as caught:
        encode_arrow(None, {"id": [1, 2, 3]}, deleted=[True, False, False])
    assert [p.position for p in caught.value.problems] == [1, 2]
    assert encode_arrow(None, {"id": [1, 2]}, deleted=[True, True])  # tombstones alone need none
