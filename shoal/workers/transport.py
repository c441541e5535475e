"""The broker transport of Shoal's Celery app: kombu's Redis transport, made to fail like a lost connection
when it is used after its connection was closed.

When the broker goes away, Celery releases the broken connection and reconnects. Channels of the released
connection may still be used afterwards: closing it restores unacknowledged messages (late acknowledgement
leaves some), and a task that finishes acknowledges its message on the channel it came from. kombu's Redis
channel then builds a client from a connection that no longer has one and raises AttributeError ("'NoneType'
object has no attribute 'hostname'"), which Celery calls unrecoverable: the worker exited. Raised as the
connection error it is, Celery ignores it and goes on reconnecting; the message stays unacknowledged and the
broker redelivers it after the visibility timeout (the beat sweeps queue the same work well before that, and
every task is idempotent).
"""

from __future__ import annotations

from typing import Any

import redis
from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):  # type: ignore[misc]
    """kombu's Redis channel, whose use after its connection was closed raises a connection error."""

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection.client is None:
            raise redis.ConnectionError("the broker connection of this channel was closed (the broker went away)")
        params: dict[str, Any] = super()._connparams(asynchronous=asynchronous)
        return params


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    """kombu's Redis transport with the Channel above (`broker_transport` of the Shoal app)."""

    Channel = Channel
