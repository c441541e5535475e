"""Taking messages off a kombu queue on Redis without a moment where only a process's memory holds them.

kombu's Redis transport pops a message (BRPOP) and only then records it as unacknowledged, in a second
command from the client: a consumer SIGKILLed between the two loses the message (bench and
tests/test_intake.py's consumer kills found it). Here a message is moved atomically (BLMOVE) from the queue's
list into a processing list of this consumer, and removed from there only when acknowledged. A consumer
refreshes a liveness key while it runs; any consumer puts the processing list of one whose key expired back
on the queue. Publishing, exchanges, bindings and the message format stay kombu's: the list is the one kombu's
Redis transport keeps for the queue, and its envelopes decode with kombu's own channel.

One consumer of a group takes messages at a time: the leader, holding the group's lease (a key renewed with its
liveness key, in the same step; every take checks it in the same step too, so a leader whose lease ran out while
it stalled takes nothing more). Two consumers taking from one queue would each hold some of a data source's
messages and commit them in whichever order their group commits finished: a tombstone could land before the
upsert it deletes. The others stand by and lead once the lease is free: at once after a clean stop, within the
lease after a crash. Taking the lead hands back, in the same step, what the last leader still holds (a key names
it), so nothing it took is committed after what the new leader takes.

Order: kombu publishes with LPUSH and takes from the right, so the right end of the queue's list is its head.
A message taken is pushed on the left of the processing list (the oldest held is rightmost); whatever goes back
(requeued after a failed commit, a stopped consumer's list recovered or released) goes back on the queue's head
with the oldest rightmost, in one atomic step, so it is taken again in the order it was published: a tombstone
is never committed before the upsert it deletes, nor an older update after a newer one.

A full Redis (maxmemory with the noeviction policy) refuses every command that may grow memory, BLMOVE and SET
among them, though moving a message between lists and refreshing a key grow nothing: those steps run as scripts
flagged `allow-oom` (Redis and Valkey 7 or later; on Redis 6.2 they run unflagged, as plain commands would), so
consumers keep draining a full broker, which frees it.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import socket
import time
import uuid
from typing import Any

import redis
from kombu.message import Message

log = logging.getLogger(__name__)

# Scripts (`#!lua` with flags: run even when the server is out of memory; they move entries between lists or
# refresh one small key, nothing that grows).
# Every one names the keys it touches in KEYS, as Redis Cluster and ACLs want.

# KEYS[1]: queue, KEYS[2]: processing list, KEYS[3]: the group's leader key; ARGV[1]: this consumer's id. Take
# the queue's head into the processing list (no wait), only while this consumer leads: -1 when it does not (a
# leader whose lease ran out while it stalled must not take a message another leader's newer ones overtake).
_TAKE = """#!lua flags=allow-oom
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return -1 end
return redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT')
"""
# KEYS[1]: the liveness key, KEYS[2]: the group's leader key, KEYS[3]: the key naming the group's last leader,
# KEYS[4]: the queue, KEYS[5]: the last leader's processing list (as read before); ARGV[1]: the lease in ms,
# ARGV[2]: this consumer's id, ARGV[3]: the last leader's id as read before ('' for none). Refresh the liveness key
# and the lead if this consumer holds it: 1. Another leads: 0. The lead is free: take it, after handing back, in
# the same step, what the last leader still holds (it took those as leader, before anything on the queue now), so
# nothing it took is committed after what this one takes: 1. The last leader changed since read: -2 (read again).
_BEAT = """#!lua flags=allow-oom
redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
local leader = redis.call('GET', KEYS[2])
if leader then
  if leader ~= ARGV[2] then return 0 end
  redis.call('PEXPIRE', KEYS[2], ARGV[1])
  return 1
end
local last = redis.call('GET', KEYS[3])
if (last or '') ~= ARGV[3] then return -2 end
if last and last ~= ARGV[2] then
  while redis.call('LMOVE', KEYS[5], KEYS[4], 'LEFT', 'RIGHT') do end
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[1])
redis.call('SET', KEYS[3], ARGV[2])
return 1
"""
# KEYS[1]: the group's leader key; ARGV[1]: this consumer's id. Give up the lead if this consumer holds it.
_RESIGN = """#!lua flags=allow-oom
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS[1]: processing list, KEYS[2]: queue, KEYS[3]: the list's liveness key; ARGV[1]: '1' to leave the list
# alone while that key exists. The whole list onto the queue's head, oldest rightmost (taken first).
_MOVE_BACK = """#!lua flags=allow-oom
if ARGV[1] == '1' and redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
local moved = 0
while redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT') do moved = moved + 1 end
return moved
"""
# KEYS[1]: processing list, KEYS[2]: queue; ARGV: entries in the order they were taken. Each one this consumer
# still holds goes back on the queue's head, the first taken rightmost (taken first again); one it no longer
# holds (recovered by another consumer after this one's lease ran out) is not pushed twice.
_REQUEUE = """#!lua flags=allow-oom
local moved = 0
for i = #ARGV, 1, -1 do
  if redis.call('LREM', KEYS[1], 1, ARGV[i]) == 1 then
    redis.call('RPUSH', KEYS[2], ARGV[i])
    moved = moved + 1
  end
end
return moved
"""

# What follows `{queue}.processing.` in a processing list's name: host (no dot: group names may hold dots, so
# a dotted host could make another group's list look like one of ours), pid, random suffix.
_CONSUMER_ID = re.compile(r"[A-Za-z0-9_-]+:[0-9]+:[0-9a-f]{8}")
_GLOB_SPECIAL = re.compile(r"([\\*?\[\]])")

# What kombu's envelope adds to a body: headers, properties and JSON punctuation (a body itself grows by a third,
# base64-encoded by kombu's Redis transport).
ENVELOPE_ALLOWANCE = 64 * 1024
# How much of an entry too large to read is kept as its dead letter's body: enough to tell what it was.
OVERSIZE_KEPT = 64 * 1024


def max_entry_bytes(max_body_bytes: int) -> int:
    """The longest queue entry holding a body of at most `max_body_bytes`: its base64 form in kombu's envelope."""
    return (max_body_bytes + 2) // 3 * 4 + ENVELOPE_ALLOWANCE


def _glob_escape(text: str) -> str:
    """`text` matched literally by Redis's glob-style MATCH patterns."""
    return _GLOB_SPECIAL.sub(r"\\\1", text)


def _script_flags(client: redis.Redis) -> bool:
    """Whether the server reads script flags (a `#!lua` first line): Redis 7 and later, every Valkey (which
    reports Redis 7.2 compatibility). Redis 6.2 (which has BLMOVE) refuses such a script."""
    try:
        version = str(client.info("server").get("redis_version", "7"))
    except redis.exceptions.ResponseError:  # INFO not allowed to this user: assume a current server
        return True
    major = re.match(r"\d+", version)
    return major is None or int(major.group()) >= 7


def envelope_problem(envelope: Any) -> str | None:
    """What makes a queue entry (parsed JSON) no kombu envelope this consumer can read, None when nothing: kombu
    raises on some of these and hands on others that would fail later (headers that are no mapping)."""
    if not isinstance(envelope, dict):
        return f"the entry is a JSON {type(envelope).__name__}, not a kombu message envelope (an object)"
    properties = envelope.get("properties")
    if not isinstance(properties, dict):
        return "the envelope has no properties object"
    tag = properties.get("delivery_tag")
    if not isinstance(tag, str) or not tag:
        return "the envelope's properties carry no delivery tag"
    if not isinstance(properties.get("delivery_info", {}), dict):
        return "the envelope's delivery_info is not an object"
    if not isinstance(envelope.get("headers") or {}, dict):
        return "the envelope's headers are not an object"
    for field in ("content-type", "content-encoding"):
        if not isinstance(envelope.get(field) or "", str):
            return f"the envelope's {field} is not a string"
    if not isinstance(envelope.get("body") or "", str):
        return "the envelope's body is not a string"
    return None


class NotLeading(Exception):
    """Raised by ReliableQueue.get when this consumer no longer leads its group (its lease ran out): it took
    nothing."""


def new_consumer_id() -> str:
    """A consumer id no other consumer has: host, pid and a random suffix (what `_CONSUMER_ID` matches)."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname()) or "host"
    return f"{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def check_consumer_id(text: str) -> str:
    """`text` if it has the form of a consumer id (host:pid:8 hex digits), else ValueError saying so."""
    if not _CONSUMER_ID.fullmatch(text):
        raise ValueError(f"{text[:100]!r} is no consumer id (host:pid:8 hex digits, as consumers make them)")
    return text


class ReliableQueue:
    """One consumer's view of a kombu queue on Redis: get, ack, requeue, and recovery of dead consumers."""

    def __init__(self, client: redis.Redis, channel: Any, queue: str, lease_s: float,
                 consumer_id: str | None = None, max_body_bytes: int | None = None) -> None:
        """`max_body_bytes`: the largest message body taken (SHOAL_MAX_BODY_BYTES); an entry too long to hold
        one is returned unread, for the caller to dead-letter (None: no limit)."""
        self.client = client
        self.max_body_bytes = max_body_bytes
        self.channel = channel  # a kombu Redis channel: decodes kombu's envelopes into Messages
        self.queue = queue
        self.lease_s = max(1.0, lease_s)
        self.consumer_id = consumer_id or new_consumer_id()
        self.processing = f"{queue}.processing.{self.consumer_id}"
        flags = _script_flags(client)
        # ':' is no character of a group name: no group's queue or lists can be these keys.
        self.leader_key = f"{queue}:leader"
        self.last_leader_key = f"{queue}:last-leader"
        self._take, self._beat, self._move_back, self._requeue, self._resign = (
            client.register_script(text if flags else text.split("\n", 1)[1])
            for text in (_TAKE, _BEAT, _MOVE_BACK, _REQUEUE, _RESIGN)
        )

    def _alive_key(self, processing: str) -> str:
        return f"{processing}.alive"

    def heartbeat(self) -> bool:
        """Say this consumer runs (for `lease_s`; call more often than that), and lead the group unless another
        live consumer does: whether this one leads. Only the leader takes messages, so the group commits them in
        the order they were published (two consumers each holding some of one source's messages would commit
        them in whichever order their group commits finished)."""
        for _ in range(5):
            last = self.client.get(self.last_leader_key)
            last_id = last.decode(errors="replace") if isinstance(last, bytes) else (last or "")
            # The last leader's list (a name no consumer has when the key holds something else: nothing to move).
            last_list = (f"{self.queue}.processing.{last_id}" if _CONSUMER_ID.fullmatch(last_id)
                         else f"{self.queue}.processing.-")
            answer = int(self._beat(
                keys=[self._alive_key(self.processing), self.leader_key, self.last_leader_key, self.queue, last_list],
                args=[int(self.lease_s * 1000), self.consumer_id, last_id]))
            if answer != -2:  # -2: another consumer took the lead meanwhile; read its id again
                return answer == 1
        return False

    def get(self, timeout: float) -> Message | None:
        """The next message, now held in this consumer's processing list; None after `timeout` seconds. An entry
        that is no kombu envelope comes back as a message whose `shoal_problem` says why (its body: the entry as
        it was), for the caller to dead-letter; it is never left to fail every consumer that takes it. So does an
        entry longer than a message within `max_body_bytes` takes, unparsed (its first OVERSIZE_KEPT bytes as its
        body): parsing it held several copies, and a MemoryError crashed every consumer that took it."""
        raw = self._take_led()
        if raw is None:
            # Nothing there: wait for a message without taking it (a BLMOVE of the list's head onto itself leaves
            # the list as it was; a blocking command cannot run in a script), then take it while leading.
            try:
                waited = self.client.blmove(self.queue, self.queue, max(timeout, 0.01), "RIGHT", "RIGHT")
            except redis.exceptions.OutOfMemoryError:
                # Redis is full: BLMOVE is refused even when it would change nothing; nothing can be published
                # while it is full anyway, so wait here.
                waited = None
                time.sleep(min(max(timeout, 0.01), 0.5))
            if waited is None:
                return None
            raw = self._take_led()
            if raw is None:
                return None
        if self.max_body_bytes is not None and len(raw) > max_entry_bytes(self.max_body_bytes):
            return self._oversize(raw)
        try:
            envelope = json.loads(raw)
            problem = envelope_problem(envelope)
            message = None if problem else self.channel.message_to_python(envelope)
        except Exception as exc:  # noqa: BLE001 - a foreign entry may fail kombu in any way; it is dead-lettered
            problem, message = f"not a kombu message envelope ({type(exc).__name__}: {str(exc)[:200]})", None
        if message is None:
            message = self._unreadable(raw, str(problem))
        message.shoal_raw = raw  # what ack and requeue remove from the processing list
        message.shoal_problem = problem
        return message

    def _take_led(self) -> bytes | None:
        """The queue's head, moved into this consumer's processing list, if any; NotLeading when another consumer
        leads (the take and the check are one step: see _TAKE)."""
        raw = self._take(keys=[self.queue, self.processing, self.leader_key], args=[self.consumer_id])
        if raw == -1:
            raise NotLeading(f"consumer {self.consumer_id} does not lead {self.queue}")
        return raw  # type: ignore[no-any-return]

    def _oversize(self, raw: bytes) -> Message:
        """The entry `raw`, too long to be a message within the body limit, as a message to dead-letter unread."""
        assert self.max_body_bytes is not None
        limit, kept = max_entry_bytes(self.max_body_bytes), min(len(raw), OVERSIZE_KEPT)
        problem = (f"the queue entry is {len(raw)} bytes, past the {limit} bytes of a message within the body "
                   f"limit of {self.max_body_bytes} bytes (SHOAL_MAX_BODY_BYTES): refused unread, its first "
                   f"{kept} bytes kept as this dead letter's body; send fewer points per message")
        message = self._unreadable(raw[:OVERSIZE_KEPT], problem)
        message.shoal_raw = raw  # what ack and requeue remove from the processing list: the whole entry
        message.shoal_problem = problem
        return message

    def _unreadable(self, raw: bytes, problem: str) -> Message:
        """A kombu message whose body is the unreadable entry `raw` as it was, to be dead-lettered with `problem`."""
        log.warning("unreadable entry on %s: %s", self.queue, problem)
        return self.channel.message_to_python({
            "body": base64.b64encode(raw).decode(),
            "content-encoding": "binary",
            "content-type": "application/octet-stream",
            "headers": {},
            "properties": {"body_encoding": "base64", "delivery_tag": uuid.uuid4().hex,
                           "delivery_info": {"exchange": "", "routing_key": ""}},
        })

    def ack(self, message: Message) -> None:
        """Forget a message for good (it is committed, or dead-lettered)."""
        self.client.lrem(self.processing, 1, message.shoal_raw)

    def requeue(self, messages: list[Message]) -> int:
        """Put messages (in the order they were taken) back on the queue's head, to be taken next in that order,
        in one atomic step; how many went back (one no longer held is not put back twice)."""
        if not messages:
            return 0
        return int(self._requeue(keys=[self.processing, self.queue], args=[m.shoal_raw for m in messages]))

    def _other_lists(self) -> list[str]:
        """The processing lists of the group's other consumers (names only; empty ones are no keys)."""
        prefix = f"{self.queue}.processing."
        found = []
        for key in self.client.scan_iter(match=_glob_escape(prefix) + "*", count=100):
            name = key.decode() if isinstance(key, bytes) else str(key)
            # Exactly a consumer id after the prefix: not a liveness key, nor a list of another group whose name
            # begins with this one's (group "a" and group "a.processing.x").
            if name != self.processing and _CONSUMER_ID.fullmatch(name[len(prefix):]):
                found.append(name)
        return found

    def recover(self) -> int:
        """Put back on the queue what consumers whose liveness expired were holding; how many messages."""
        moved = 0
        for name in self._other_lists():
            moved += max(0, int(self._move_back(keys=[name, self.queue, self._alive_key(name)], args=["1"])))
        if moved:
            log.warning("put %d messages of stopped consumers back on %s", moved, self.queue)
        return moved

    def others_holding(self) -> list[str]:
        """Other consumers of the group that hold messages while alive (their ids). Under the lead only the
        leader holds any, and whoever takes the lead hands the last leader's back: one found here is a consumer
        of an older release (which took without a lead), and the leader must not take before its messages are
        back on the queue (when it stops, or its liveness key expires), or it would commit newer ones first."""
        prefix = len(f"{self.queue}.processing.")
        return [name[prefix:] for name in self._other_lists() if self.client.llen(name)]

    def reclaim(self) -> int:
        """Put back on the queue's head what this consumer's list still holds from an earlier connection (the
        process forgot it when the broker went away); how many messages."""
        return max(0, int(self._move_back(keys=[self.processing, self.queue, self._alive_key(self.processing)],
                                          args=["0"])))

    def release_dead(self, consumer_id: str) -> None:
        """End, now, the lead and the liveness of a consumer of this group that is known to have ended (its
        supervisor saw it exit: `shoal up` restarting it), rather than after its lease runs out. What it held is
        handed back by whoever takes the lead next, in that same step (it was the last leader), or by `recover`.
        Never call it for a consumer that may still run: it would take again while the next leader does."""
        self._resign(keys=[self.leader_key], args=[consumer_id])
        self.client.delete(self._alive_key(f"{self.queue}.processing.{consumer_id}"))

    def release(self) -> None:
        """On a clean stop: hand back what this consumer still holds, drop its liveness key, and give up the lead
        (last: the next leader finds what this one held back at the queue's head)."""
        self._move_back(keys=[self.processing, self.queue, self._alive_key(self.processing)], args=["0"])
        self.client.delete(self._alive_key(self.processing))
        self._resign(keys=[self.leader_key], args=[self.consumer_id])
