"""Taking messages off a kombu queue on Redis without a moment where only a process's memory holds them.

kombu's Redis transport pops a message (BRPOP) and only then records it as unacknowledged, in a second
command from the client: a consumer SIGKILLed between the two loses the message (bench and
tests/test_intake.py's consumer kills found it). Here a message is moved atomically (BLMOVE) from the queue's
list into a processing list of this consumer, and removed from there only when acknowledged. A consumer
refreshes a liveness key while it runs; any consumer puts the processing list of one whose key expired back
on the queue. Publishing, exchanges, bindings and the message format stay kombu's: the list is the one kombu's
Redis transport keeps for the queue, and its envelopes decode with kombu's own channel.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from typing import Any

import redis
from kombu.message import Message

log = logging.getLogger(__name__)


class ReliableQueue:
    """One consumer's view of a kombu queue on Redis: get, ack, requeue, and recovery of dead consumers."""

    def __init__(self, client: redis.Redis, channel: Any, queue: str, lease_s: float) -> None:
        self.client = client
        self.channel = channel  # a kombu Redis channel: decodes kombu's envelopes into Messages
        self.queue = queue
        self.lease_s = max(1.0, lease_s)
        self.consumer_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.processing = f"{queue}.processing.{self.consumer_id}"

    def _alive_key(self, processing: str) -> str:
        return f"{processing}.alive"

    def heartbeat(self) -> None:
        """Say this consumer runs (for `lease_s`); call more often than that."""
        self.client.set(self._alive_key(self.processing), "1", px=int(self.lease_s * 1000))

    def get(self, timeout: float) -> Message | None:
        """The next message, now held in this consumer's processing list; None after `timeout` seconds."""
        raw = self.client.blmove(self.queue, self.processing, max(timeout, 0.01), "RIGHT", "LEFT")
        if raw is None:
            return None
        message = self.channel.message_to_python(json.loads(raw))
        message.shoal_raw = raw  # what ack and requeue remove from the processing list
        return message

    def ack(self, message: Message) -> None:
        """Forget a message for good (it is committed, or dead-lettered)."""
        self.client.lrem(self.processing, 1, message.shoal_raw)

    def requeue(self, message: Message) -> None:
        """Put a message back on the queue, to be taken next, in one atomic step."""
        pipe = self.client.pipeline(transaction=True)
        pipe.lrem(self.processing, 1, message.shoal_raw)
        pipe.rpush(self.queue, message.shoal_raw)
        pipe.execute()

    def recover(self) -> int:
        """Put back on the queue what consumers whose liveness expired were holding; how many messages."""
        moved = 0
        for key in self.client.scan_iter(match=f"{self.queue}.processing.*", count=100):
            name = key.decode() if isinstance(key, bytes) else str(key)
            if name.endswith(".alive") or name == self.processing or self.client.exists(self._alive_key(name)):
                continue
            while self.client.lmove(name, self.queue, "RIGHT", "RIGHT") is not None:
                moved += 1
        if moved:
            log.warning("put %d messages of stopped consumers back on %s", moved, self.queue)
        return moved

    def release(self) -> None:
        """On a clean stop: hand back what this consumer still holds and drop its liveness key."""
        while self.client.lmove(self.processing, self.queue, "RIGHT", "RIGHT") is not None:
            pass
        self.client.delete(self._alive_key(self.processing))
