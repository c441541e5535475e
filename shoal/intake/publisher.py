"""A publisher for upstream processors: sends upload messages to Shoal's intake exchange.

Every message gets a unique id (the consumer dedupes redeliveries and repeated publishes on it), is
persistent, and is sent with confirms where the broker has them (AMQP); on Redis a publish returns once the
server has stored the message. A publish that meets a broken connection is retried with backoff, on a new
connection, up to `max_retries` times; retrying with the same message id can never write twice.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from kombu import Connection, Producer

from shoal.config.settings import Settings
from shoal.errors import ValidationError
from shoal.intake import codec, topology
from shoal.log.records import DataPoint, Tombstone, storable_text
from shoal.servers.broker import broker_url

MAX_MESSAGE_ID = 190  # the consumer prefixes it into a batch id, which holds at most 200 characters


def message_id_problem(message_id: object) -> str | None:
    """What is wrong with a message id (None when nothing): it becomes a batch id in the catalog, so it must be a
    string of 1 to MAX_MESSAGE_ID characters that Postgres can store (valid Unicode, no NUL). The consumer
    dead-letters a message whose id breaks this; the publisher refuses to send one."""
    if not isinstance(message_id, str) or not 0 < len(message_id) <= MAX_MESSAGE_ID:
        return f"message id must be a string of 1 to {MAX_MESSAGE_ID} characters"
    if "\x00" in message_id:
        return f"message id must not contain NUL characters (the catalog cannot store them), got {message_id!r}"
    if not storable_text(message_id):
        return f"message id must be valid Unicode: a lone surrogate cannot be stored, got {message_id!r}"
    return None


class Publisher:
    """Publishes data points and tombstones for one tenant. Not thread-safe: one per thread."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        tenant: str | None = None,
        url: str | None = None,
        max_retries: int = 20,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.settings = settings or Settings()
        self.tenant = tenant or self.settings.tenant
        self.exchange = topology.exchange(self.settings.intake_exchange)
        # Declared by the publisher too, so messages sent before any consumer started are kept.
        self.queue = topology.group_queue(
            self.settings.intake_exchange, self.settings.intake_group, self.settings.intake_binding
        )
        self._url = url or broker_url(self.settings)
        self._conn = self._connect()
        self._producer: Producer | None = None
        self.retry_policy = {
            "max_retries": max_retries,
            "interval_start": 0.1,
            "interval_step": 0.5,
            "interval_max": max_backoff_s,
        }

    def _connect(self) -> Connection:
        return Connection(self._url, transport_options={"confirm_publish": True})

    def _ensure_producer(self) -> Producer:
        if self._producer is None:
            self._producer = Producer(self._conn.default_channel, exchange=self.exchange)
        return self._producer

    def publish_raw(
        self, source: str, version: str, body: bytes, content_type: str, *, message_id: str | None = None
    ) -> str:
        """Publish an already encoded body (`codec.JSON` or `codec.ARROW`); returns the message id. A body longer
        than SHOAL_MAX_BODY_BYTES is refused (ValidationError) before it is sent, as consumers would refuse it."""
        if content_type not in codec.CONTENT_TYPES:
            raise ValidationError(f"unsupported content type {content_type!r}: use {' or '.join(codec.CONTENT_TYPES)}")
        limit = self.settings.body_limit_bytes
        if len(body) > limit:  # a consumer dead-letters it unread: refused here, before it is sent
            raise ValidationError(f"the message body is {len(body)} bytes, past the limit of {limit} bytes "
                                  "(SHOAL_MAX_BODY_BYTES) consumers take: send fewer points per message")
        target = topology.target(self.tenant, source, version)
        # Only a message id left out is made up: an empty one (or 0) is the caller's, refused, or each retry of
        # it would get a new id and could be written twice.
        message_id = uuid.uuid4().hex if message_id is None else message_id
        problem = message_id_problem(message_id)
        if problem:
            raise ValidationError(problem)
        producer = self._ensure_producer()
        publish = self._conn.ensure(producer, producer.publish, **self.retry_policy)
        try:
            publish(
                body,
                exchange=self.exchange,
                routing_key=target.routing_key,
                content_type=content_type,
                content_encoding="binary",
                delivery_mode=2,
                message_id=message_id,
                headers={
                    topology.TENANT: target.tenant,
                    topology.SOURCE: target.source,
                    topology.VERSION: target.version,
                    topology.MESSAGE_ID: message_id,
                },
                declare=[self.queue],
            )
        except BaseException:
            # kombu records a binding as made before the broker has taken it: after a refused declare (a full
            # broker), this connection would skip the binding for good and route every later message nowhere while
            # answering success. A new connection declares it again.
            self._producer = None
            with contextlib.suppress(Exception):  # a broken connection may fail to close; it is dropped anyway
                self._conn.release()
            self._conn = self._connect()
            raise
        return message_id

    def publish(
        self, source: str, version: str, items: Sequence[DataPoint | Tombstone], *, message_id: str | None = None
    ) -> str:
        """Publish data points and tombstones as one Vektonn upload JSON message; returns the message id."""
        if not items:
            raise ValidationError("nothing to publish: the batch is empty")
        return self.publish_raw(source, version, codec.encode_json(items), codec.JSON, message_id=message_id)

    def publish_columns(
        self,
        source: str,
        version: str,
        vectors: np.ndarray | None,
        attributes: Mapping[str, Sequence[Any] | np.ndarray | pa.Array],
        *,
        deleted: Sequence[bool] | np.ndarray | None = None,
        message_id: str | None = None,
    ) -> str:
        """Publish a columnar batch in the compact Arrow form (vectors [n, dim] float32, one column per
        attribute, `deleted` marking tombstones); returns the message id. What `Producer.upload_columns` refuses
        without the data source's definition (text, complex or masked vectors, coordinates past float32's range,
        NumPy datetime64 columns, ...) is refused here, ValidationError, before anything is sent: nothing is
        converted (`codec.encode_arrow`)."""
        body = codec.encode_arrow(vectors, attributes, deleted=deleted)
        return self.publish_raw(source, version, body, codec.ARROW, message_id=message_id)

    def close(self) -> None:
        """Release the broker connection."""
        self._producer = None
        self._conn.release()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def publish(
    source: str,
    version: str,
    items: Sequence[DataPoint | Tombstone],
    *,
    settings: Settings | None = None,
    tenant: str | None = None,
) -> str:
    """One-off publish of a batch (opens and closes a connection); returns the message id."""
    with Publisher(settings, tenant=tenant) as p:
        return p.publish(source, version, items)
