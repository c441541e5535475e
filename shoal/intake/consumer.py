"""`shoal consume`: takes upload messages off the broker and appends them to data-source logs, exactly once.

A consumer gathers messages until it holds `intake_max_points` points or the first of them has waited
`intake_max_wait_ms`, commits each data source's messages as batches of one group commit (one batch per
message, the message id as its batch id), and only then acknowledges them. So:

- a consumer that dies before the commit leaves its messages unacknowledged: the broker hands them out again
  after the visibility timeout;
- one that dies after the commit but before the acknowledgements gets them back too, and their message ids,
  already recorded with the commit, make the second commit write nothing;
- a message that fails validation (bad JSON, wrong dimension, unknown data source, a message id the catalog
  cannot store ...) is never retried: it goes to the group's dead-letter queue with the reason in a header and
  is acknowledged, so it never blocks the queue; one that fails for a transient reason (catalog or storage
  away) is requeued.

A data source's definition is read at most every `SOURCE_TTL_S` (as the HTTP upload routes read it), and again
before a message is refused or a batch dead-lettered for a source dropped in flight: a source dropped and made
again (with another definition, perhaps) is written to as soon as it exists, and every message is judged
against the definition of the source it is committed to.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import pyarrow as pa
import pydantic
import redis
from kombu import Connection, Producer
from kombu.exceptions import OperationalError as KombuOperationalError
from kombu.message import Message
from sqlalchemy.exc import OperationalError

import shoal.runtime as _runtime_module
from shoal.config.settings import Settings
from shoal.errors import BatchIdReusedError, CommitError, ConfigurationError, NotFoundError, ShoalError, ValidationError
from shoal.intake import codec, topology
from shoal.intake.delivery import NotLeading, ReliableQueue, check_consumer_id, new_consumer_id
from shoal.intake.producer import Producer as LogProducer
from shoal.intake.publisher import message_id_problem
from shoal.intake.topology import BATCH_ID_PREFIX, Target
from shoal.log.commit import held_batches
from shoal.log.writer import batch_fingerprint
from shoal.runtime import SOURCE_TTL_S, Runtime
from shoal.servers.broker import broker_url

log = logging.getLogger(__name__)

# Failures worth a retry of the same message later: the catalog or storage was briefly away.
TRANSIENT = (OperationalError, OSError, CommitError, ConfigurationError)

# Backpressure weighs the sources a consumer committed to within this many seconds: what it is writing now, with
# room for a slow trickle, but not a source it last wrote an hour ago.
RECENT_WRITES_S = 60.0

# A consumer group name: SHOAL_INTAKE_GROUP's own rule (a group named otherwise, `shoal consume --group 'a*'`,
# made glob patterns of the queue's name).
_GROUP = Settings.model_fields["intake_group"]
_GROUP_NAME: pydantic.TypeAdapter[str] = pydantic.TypeAdapter(Annotated[_GROUP.annotation, *_GROUP.metadata])


def check_group(group: str) -> str:
    """`group` if SHOAL_INTAKE_GROUP would take it as a consumer group name; ConfigurationError naming it and the
    rule otherwise."""
    try:
        return _GROUP_NAME.validate_python(group)
    except pydantic.ValidationError as exc:
        raise ConfigurationError(
            f"invalid consumer group {group!r}: {exc.errors()[0]['msg']} (as SHOAL_INTAKE_GROUP)"
        ) from None


@dataclass
class IntakeStats:
    """What a consumer did since it started (for logs, tests and the bench)."""

    messages: int = 0  # committed (first time)
    points: int = 0
    duplicates: int = 0  # redeliveries of messages whose id had committed already
    dead: int = 0
    requeued: int = 0
    commits: int = 0
    paused_s: float = 0.0
    reasons: list[str] = field(default_factory=list)  # last dead-letter reasons (at most 100)


@dataclass
class _Held:
    message: Message
    target: Target
    message_id: str | None
    table: pa.Table
    source_id: int  # the data source whose definition `table` was validated against


class IntakeConsumer:
    """One consumer of a consumer group's queue. `run()` blocks until `stop` is set."""

    def __init__(self, settings: Settings | None = None, *, group: str | None = None, consumer_id: str | None = None,
                 replaces: str | None = None) -> None:
        """A consumer of `group` (default SHOAL_INTAKE_GROUP) under `consumer_id` (default a new one). `replaces`:
        the id of a consumer of the group that is known to have ended (a supervisor saw it exit), whose lead
        and liveness end when this one first connects rather than when its lease runs out."""
        self.settings = settings or Settings()
        self.group = self.settings.intake_group if group is None else check_group(group)
        self.exchange_name = self.settings.intake_exchange
        self.queue = topology.group_queue(self.exchange_name, self.group, self.settings.intake_binding)
        self.dead_queue = topology.dead_queue(self.exchange_name, self.group)
        self.stats = IntakeStats()
        self.stop = threading.Event()
        self.paused = False  # true while backpressure holds intake
        self._runtime: Runtime | None = None  # the process's catalog pool, storage and log writers
        self._producers: dict[Target, tuple[float, LogProducer]] = {}  # (when read, producer) per data source
        self._held: list[_Held] = []
        self._held_points = 0
        self._first_held_at = 0.0
        self._parked: list[tuple[Message, str]] = []  # refused, waiting for room in a full broker's dead letters
        self._parked_at = 0.0
        self._dead_producer: Producer | None = None
        self._delivery: ReliableQueue | None = None
        self.leading = False  # whether this consumer leads its group (only the leader takes messages)
        self.consumer_id = new_consumer_id() if consumer_id is None else check_consumer_id(consumer_id)
        self._replaces = None if replaces is None else check_consumer_id(replaces)
        # Other consumers found holding messages when this one took the lead (`_waiting_for_others`).
        self._others: list[str] = []
        self._others_checked = False  # whether to look (again) for them
        self._others_checked_at = 0.0
        self._backoff = 0.0
        # (tenant, source id) -> when this consumer last committed to it (monotonic seconds).
        self._written_sources: dict[tuple[str, int], float] = {}
        self.recent_writes_s = RECENT_WRITES_S
        self._paused_at = 0.0
        self._swept_at = time.monotonic()

    # -- the loop ---------------------------------------------------------------------------------------

    def run(self) -> None:
        """Consume until `stop` is set, reconnecting to the broker whenever it goes away."""
        url = broker_url(self.settings)
        delay = 0.5
        while not self.stop.is_set():
            conn = Connection(url)
            client = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=5)
            try:
                conn.connect()
                delay = 0.5
                self._serve(conn, client)
            except (OSError, redis.RedisError, KombuOperationalError, *conn.recoverable_connection_errors,
                    *conn.recoverable_channel_errors, *conn.connection_errors) as exc:
                # What we held stays in our processing list: this consumer hands it back when it leads again
                # after reconnecting (its lease names it), or another puts it back once our lease expires; message
                # ids make redelivery harmless. (kombu raises OperationalError once its retries of a publish, a
                # dead letter, gave up: a broker that is away.)
                log.warning("broker connection lost (%s); reconnecting in %.1fs", exc, delay)
                self._drop_held()
                self.stop.wait(delay)
                delay = min(delay * 2, 5.0)
            finally:
                self._dead_producer = None
                for closing in (conn.release, client.close):
                    try:
                        closing()
                    except Exception:  # noqa: BLE001 - a broken connection may fail to close; it is gone anyway
                        pass
        self.close()

    def _serve(self, conn: Connection, client: redis.Redis) -> None:
        channel = conn.channel()
        self._dead_producer = Producer(conn.channel())
        # Declared (with its binding) so the exchange routes into the queue's list. (Dead letters need no binding:
        # they go straight to their queue's list.)
        try:
            self.queue(channel).declare()
        except redis.exceptions.OutOfMemoryError:
            # Redis is full (maxmemory, noeviction) and refuses to record the bindings again: messages waiting
            # were routed by them, so they exist; draining the queue is what frees the memory.
            log.warning("the broker is out of memory: consuming without declaring %s again", self.queue.name)
        # The same id on every connection: after a broker outage this consumer leads again at once (its lease
        # names it) and hands back first what its list still holds from before.
        self._delivery = delivery = ReliableQueue(
            client, channel, self.queue.name, self.settings.intake_visibility_timeout_s, self.consumer_id,
            max_body_bytes=self.settings.body_limit_bytes,
        )
        if self._replaces is not None:
            # The consumer this one was started in place of ended (`shoal up` saw it exit): the group need not
            # wait out its lease, up to SHOAL_INTAKE_VISIBILITY_TIMEOUT_S with no message taken.
            delivery.release_dead(self._replaces)
            log.info("consumer %s, which this one replaces, ended: its lead is free", self._replaces)
            self._replaces = None
        self.leading = False
        self._beat()
        beat_at = time.monotonic()
        log.info("consuming %s (group %s) on %s%s", self.queue.name, self.group, self.exchange_name,
                 "" if self.leading else ": standing by while another consumer of the group leads")
        try:
            while not self.stop.is_set():
                # A consumer standing by asks for the lead often (it is free at once after a clean stop).
                if time.monotonic() - beat_at > (delivery.lease_s / 3 if self.leading else 0.5):
                    self._beat()
                    beat_at = time.monotonic()
                if not self.leading or self._waiting_for_others(delivery):
                    self.stop.wait(0.5)
                    continue
                if self._parked and time.monotonic() - self._parked_at > 1.0:
                    self._retry_parked()
                if self._backoff:
                    self.stop.wait(self._backoff)
                    self._backoff = 0.0
                timeout = 0.5
                if self._held:
                    wait_s = self.settings.intake_max_wait_ms / 1000
                    timeout = max(0.0, self._first_held_at + wait_s - time.monotonic())
                if not self.paused:
                    try:
                        message = delivery.get(min(timeout, 0.5))
                    except NotLeading:  # our lease ran out (a stall): hand back what we hold, stand by
                        self._beat()
                        continue
                    if message is not None:
                        self._receive(message)
                else:
                    self.stop.wait(0.5)
                if self._held and (
                    self._held_points >= self.settings.intake_max_points
                    or len(self._held) >= self.settings.intake_prefetch
                    or time.monotonic() - self._first_held_at >= self.settings.intake_max_wait_ms / 1000
                ):
                    self._flush()
                # Backpressure: stop taking messages while an index we write to lags past the bound; they wait
                # in the broker, so the lag grows instead of this process's memory.
                lagging = self._lagging()
                if lagging and not self.paused:
                    self._flush()
                    self.paused, self._paused_at = True, time.monotonic()
                    log.warning("pausing intake: index lag past the bound (%s)", lagging)
                elif not lagging and self.paused:
                    self.paused = False
                    self.stats.paused_s += time.monotonic() - self._paused_at
                    log.info("resuming intake")
            self._flush()
            delivery.release()
        finally:
            self._delivery = None

    # -- receiving ----------------------------------------------------------------------------------------

    def _receive(self, message: Message) -> None:
        if message.shoal_problem:  # no kombu envelope at all: kept as it was, with the reason
            self._dead_letter(message, message.shoal_problem)
            return
        too_long = self._body_too_long(message)
        if too_long:
            self._dead_letter(message, too_long)
            return
        headers = message.headers or {}
        # A message published without an id (by a plain kombu client) is known by its delivery tag: kombu stamps
        # each envelope with a new one when it is published, and the envelope moves unchanged between the queue
        # and processing lists, so a redelivery (after a crash between commit and acknowledgement) carries the same
        # tag and its second commit writes nothing, as an id's would.
        message_id = headers.get(topology.MESSAGE_ID) or message.properties.get("message_id")
        tagged = message_id is None
        if tagged:
            message_id = message.delivery_tag
        try:
            # Before the id meets the catalog: a NUL or a lone surrogate there fails every commit of the batch
            # (and killed the consumer), so the message would never leave the queue.
            problem = message_id_problem(message_id)
            if problem:
                raise ValidationError(f"the message has no id, and its delivery tag cannot stand for one: {problem}"
                                      if tagged else problem)
            target = topology.target_of(headers)
            # The routing key decided which groups got the message (a group bound to `acme.#` takes acme's only):
            # headers naming another target would write past that binding, into another tenant even.
            routed = (message.delivery_info or {}).get("routing_key")
            if routed != target.routing_key:
                raise ValidationError(f"the message's routing key {routed!r} does not name the data source its "
                                      f"headers name ({target.routing_key!r})")
            producer, table = self._decode(target, message)
        except (ValidationError, NotFoundError) as exc:
            self._dead_letter(message, str(exc))
            return
        except TRANSIENT as exc:
            log.warning("requeued a message: %s", exc)
            self._requeue([message])
            self._backoff = 1.0
            return
        if not self._held:
            self._first_held_at = time.monotonic()
        self._held.append(_Held(message, target, message_id, table, producer.source.id))
        self._held_points += table.num_rows

    def _body_too_long(self, message: Message) -> str | None:
        """Why the message's body is refused unparsed (None: it is not): longer than SHOAL_MAX_BODY_BYTES, as
        the HTTP routes refuse one (413). Parsing it held several copies, and a MemoryError crashed every consumer
        that took it."""
        limit = self.settings.body_limit_bytes
        size = len(message.body or b"")
        if size <= limit:
            return None
        return (f"the message body is {size} bytes, past the limit of {limit} bytes (SHOAL_MAX_BODY_BYTES): "
                "send fewer points per message, or raise the limit")

    def _decode(self, target: Target, message: Message) -> tuple[LogProducer, pa.Table]:
        """The message's batch, validated against the data source's definition, and the producer of that source.
        A message refused by a definition read a moment ago is judged again by the current one, if the source
        was dropped and made again meanwhile: it is refused only by the definition it would be written with."""
        asked_at = time.monotonic()
        producer = self._producer(target)
        try:
            return producer, self._decode_for(producer, message)
        except ValidationError:
            if self._producers[target][0] >= asked_at:  # read just now: nothing newer to judge it by
                raise
            current = self._producer(target, fresh=True)  # NotFoundError (dropped for good): dead letter
            if current.source.id == producer.source.id:
                raise
            return current, self._decode_for(current, message)

    def _decode_for(self, producer: LogProducer, message: Message) -> pa.Table:
        try:
            return codec.decode(producer.spec, message.content_type, message.body, self.settings.max_batch_points,
                                self.settings.body_limit_bytes)
        except (ValidationError, MemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - the body alone is at fault: a decoder that fails on it otherwise
            # than by refusing it would fail every redelivery too (and crashed the consumer each time, so the queue
            # behind it never moved): it is refused as the decoder's failure names it.
            log.exception("decoding a message failed")
            raise ValidationError(f"the message body cannot be decoded: {type(exc).__name__}: {exc}") from None

    def _producer(self, target: Target, *, fresh: bool = False) -> LogProducer:
        """The data source's producer, its definition read from the catalog at most every SOURCE_TTL_S (one
        lookup per data source, not per message: bench/intake.py measured 3-4 ms each), or now with `fresh`.
        A source dropped or trashed since it was read is still refused: the commit re-reads it under its row
        lock (and `_commit` then reads the definition again)."""
        cached = self._producers.get(target)
        if cached is not None and not fresh and time.monotonic() - cached[0] < SOURCE_TTL_S:
            return cached[1]
        self._forget_idle_now_and_then()
        runtime = self.runtime()
        read_at = time.monotonic()
        try:
            # create=False: a message naming a tenant that does not exist is dead-lettered, and makes none.
            record = runtime.scope(target.tenant, create=False).catalog.get_data_source(target.source, target.version)
        except NotFoundError:
            self._forget(target)
            raise
        if cached is not None and cached[1].source.id != record.id:
            self._forget(target)  # dropped (and made again): its writer and cached shards go too
        producer = LogProducer(record, runtime.writer(record), self.settings.max_batch_points)
        self._producers[target] = (read_at, producer)
        return producer

    def _forget_idle_now_and_then(self) -> None:
        """Drop the producers and recent-write times of data sources idle past the runtime's IDLE_FORGET_S, at
        most every IDLE_FORGET_S / 4. Kept for ever, they grew one entry per data source ever written to (3-5 KB
        with the runtime's) when sources are made, written and dropped elsewhere. A producer's time is when its
        definition was read, again every SOURCE_TTL_S while messages come: an old one was not used since."""
        now = time.monotonic()
        idle = _runtime_module.IDLE_FORGET_S
        if now - self._swept_at < idle / 4:
            return
        self._swept_at = now
        for target in [t for t, (at, _) in self._producers.items() if now - at > idle]:
            del self._producers[target]
        if not self.paused:  # while paused, `_lagging` counts the sources written before the pause
            keep = max(idle, self.recent_writes_s)
            self._written_sources = {k: at for k, at in self._written_sources.items() if now - at <= keep}
        if self._runtime is not None:
            self._runtime.forget_idle(now)

    def _forget(self, target: Target) -> None:
        """Drop what this consumer keeps for the data source `target` named (gone, or made again)."""
        cached = self._producers.pop(target, None)
        if cached is not None:
            self._written_sources.pop((target.tenant, cached[1].source.id), None)
            if self._runtime is not None:
                self._runtime.forget_source(cached[1].source.id)

    def runtime(self) -> Runtime:
        """The consumer's runtime, made on first use (every tenant it writes for shares it)."""
        if self._runtime is None:
            self._runtime = Runtime(self.settings)
        return self._runtime

    # -- committing ---------------------------------------------------------------------------------------

    def _beat(self) -> None:
        """Refresh this consumer's liveness and lead, and act on a change of lead."""
        assert self._delivery is not None
        was, self.leading = self.leading, self._delivery.heartbeat()
        if self.leading:
            if not was:
                log.info("leading consumer group %s", self.group)
                if not self._held:
                    self._delivery.reclaim()
                self._others_checked, self._others_checked_at = True, 0.0  # look for others holding messages
            # Before anything is taken: what a dead leader held goes back to the queue's head first.
            self._delivery.recover()
        elif was:
            # Our lease ran out (this process stalled past it) and another consumer leads: what we hold must not
            # be committed after what it takes. Back to the queue's head, unless recovered already.
            log.warning("lost the lead of consumer group %s (stalled past the lease); standing by", self.group)
            self._requeue([h.message for h in self._held] + [m for m, _ in self._parked])
            self._drop_held()

    def _waiting_for_others(self, delivery: ReliableQueue) -> bool:
        """Whether this leader must wait before taking: another consumer (of an older release, which takes without
        a lead) holds messages it took before anything on the queue now. Checked once a second while it does, and
        whenever the lead is taken: their messages come back when they stop or their liveness key expires."""
        if not self._others_checked:
            return False
        if time.monotonic() - self._others_checked_at < 1.0:
            return True  # still waiting for those found a moment ago
        self._others_checked_at = time.monotonic()
        delivery.recover()
        others = delivery.others_holding()
        if others and others != self._others:
            log.warning("consumer group %s: waiting for the messages consumers %s hold (a consumer of an older "
                        "release: stop it cleanly, or wait for its liveness key to expire)", self.group,
                        ", ".join(others))
        self._others = others
        self._others_checked = bool(others)  # none: taking is safe until the lead changes hands again
        return bool(others)

    def _flush(self) -> None:
        if self._held and self._delivery is not None:
            self._beat()  # commit only while leading: another leader may have taken newer messages
            if not self.leading:
                return
        held, self._held, self._held_points = self._held, [], 0
        by_target: dict[Target, list[_Held]] = defaultdict(list)
        for h in held:
            by_target[h.target].append(h)
        for target, items in by_target.items():
            self._commit(target, items)

    def _commit(
        self, target: Target, items: list[_Held], *, again: bool = True, known: set[str] | None = None
    ) -> None:
        """Commit one data source's messages (one batch each, one group commit), then acknowledge them.
        `known`: the batch ids committed before an earlier attempt at these messages (to count duplicates)."""
        try:
            producer = self._producer(target)
            items = self._judged(producer, items)
            if not items:
                return
            ids = [BATCH_ID_PREFIX + h.message_id if h.message_id else None for h in items]
            before = self._committed_ids(producer, ids) if known is None else known
            producer.append_tables([(h.table, bid) for h, bid in zip(items, ids, strict=True)])
        except NotFoundError as exc:  # dropped (or trashed) between receipt and commit
            if again:
                # The definition read earlier may be of a source dropped since and made again: read it again
                # and commit once more (each message judged by the new definition); nothing was written.
                self._forget(target)
                self._commit(target, items, again=False)
                return
            for h in items:
                self._dead_letter(h.message, str(exc))
            return
        except BatchIdReusedError as exc:
            # A message id that committed other content before (a publisher reusing ids): dead-letter the
            # message under it; the rest of the group committed, or commits now as repeats of what landed.
            try:
                kept = self._fingerprint(producer, exc.batch_id)
            except TRANSIENT as blip:  # the catalog away while asked: nothing dead-lettered yet, all go back
                self._requeue_failed(items, blip)
                return
            rest = []
            for h, bid in zip(items, ids, strict=True):
                if bid == exc.batch_id and batch_fingerprint(h.table) != kept:
                    self._dead_letter(h.message, str(exc))
                else:  # another message, or a true repeat under the id (counted as a duplicate)
                    rest.append(h)
            if rest:  # what the refused group committed is no duplicate of an earlier delivery
                self._commit(target, rest, again=again, known=before)
            return
        except TRANSIENT as exc:
            self._requeue_failed(items, exc)
            return
        self.stats.commits += 1
        self._written_sources[(target.tenant, producer.source.id)] = time.monotonic()
        seen = set(before)
        for h, bid in zip(items, ids, strict=True):
            self._ack(h.message)
            if bid is not None and bid in seen:
                self.stats.duplicates += 1
            else:
                if bid is not None:
                    seen.add(bid)
                self.stats.messages += 1
                self.stats.points += h.table.num_rows

    def _requeue_failed(self, items: list[_Held], exc: BaseException) -> None:
        """Put back the messages of a commit that failed for a transient reason, taken again after a pause."""
        log.warning("commit of %d messages failed, requeued: %s", len(items), exc)
        self._requeue([h.message for h in items])
        self._backoff = 1.0

    def _judged(self, producer: LogProducer, items: list[_Held]) -> list[_Held]:
        """The messages `producer`'s data source takes: one validated against another source's definition (one
        dropped since, perhaps of another dimension) is decoded again against this one, and dead-lettered if
        that refuses it."""
        kept = []
        for h in items:
            if h.source_id != producer.source.id:
                try:
                    h.table, h.source_id = self._decode_for(producer, h.message), producer.source.id
                except ValidationError as exc:
                    self._dead_letter(h.message, str(exc))
                    continue
            kept.append(h)
        return kept

    def _fingerprint(self, producer: LogProducer, batch_id: str) -> str | None:
        """The fingerprint the batch id committed with (None: none recorded)."""
        with self.runtime().engine.connect() as conn:
            held = held_batches(conn, producer.source.id, [batch_id]).get(batch_id)
        return None if held is None else held.fingerprint

    def _committed_ids(self, producer: LogProducer, ids: list[str | None]) -> set[str]:
        """Which of these batch ids committed before (only to count redeliveries; the commit dedupes)."""
        wanted = [i for i in ids if i]
        if not wanted:
            return set()
        with self.runtime().engine.connect() as conn:
            return set(held_batches(conn, producer.source.id, wanted))

    def _ack(self, message: Message) -> None:
        assert self._delivery is not None
        self._delivery.ack(message)

    def _requeue(self, messages: list[Message]) -> None:
        """Put messages back on the queue's head in the order they were taken (one atomic step), so they are
        committed in their publish order after all."""
        assert self._delivery is not None
        self.stats.requeued += self._delivery.requeue(messages)

    def _drop_held(self) -> None:
        """Forget what this process holds (still in its processing list: put back by `reclaim` or recovery)."""
        self._held, self._held_points = [], 0
        self._parked = []

    def _dead_letter(self, message: Message, reason: str) -> None:
        try:
            self._publish_dead(message, reason)
        except KombuOperationalError as exc:
            if not isinstance(exc.__cause__, redis.exceptions.OutOfMemoryError):
                raise
            # The broker is full (maxmemory, noeviction) and takes no dead letter now. The message stays in our
            # processing list, unacknowledged, and is dead-lettered once there is room; meanwhile the queue behind
            # it drains, which is what frees the room. (Dropping the connection instead put it back on the
            # queue's head, to be refused again at once: the queue never drained.)
            if not self._parked:
                self._parked_at = time.monotonic()
            self._parked.append((message, reason))
            log.warning("the broker is out of memory: a refused message waits for room in the dead-letter queue")
            return
        self._ack(message)
        self.stats.dead += 1
        self.stats.reasons = [*self.stats.reasons[-99:], reason]
        log.warning("dead-lettered a message: %s", reason)

    def _retry_parked(self) -> None:
        """Dead-letter again what a full broker refused (those it still refuses wait on)."""
        parked, self._parked = self._parked, []
        self._parked_at = time.monotonic()
        for message, reason in parked:
            self._dead_letter(message, reason)

    def _publish_dead(self, message: Message, reason: str) -> None:
        assert self._dead_producer is not None
        headers = dict(message.headers or {})
        headers[topology.REASON] = reason[:1000]
        headers[topology.DEAD_AT] = dt.datetime.now(dt.UTC).isoformat()
        headers[topology.ORIGINAL_ROUTING_KEY] = message.delivery_info.get("routing_key", "")
        # Published before the original is acknowledged: a crash between the two leaves the message in both
        # queues (it is redelivered and refused again), never in neither.
        # Straight to the dead-letter queue's list (kombu's default exchange routes by queue name), not through
        # a binding: kombu records a binding as made before the broker has taken it, so after a declare a full
        # broker refused, a routed dead letter went nowhere and the message was lost.
        self._dead_producer.publish(
            message.body,
            exchange="",
            routing_key=self.dead_queue.name,
            headers=headers,
            content_type=message.content_type,
            content_encoding=message.content_encoding or "binary",
            message_id=message.properties.get("message_id"),
            retry=True,
        )

    # -- backpressure -------------------------------------------------------------------------------------

    def _lagging(self) -> dict[int, int]:
        """The sources this consumer wrote to lately whose indexes lag past the bound, with their lag. Lately:
        within `recent_writes_s` before now, or before the pause began while paused (a pause writes nothing, so
        the sources that caused it stay counted until they catch up). A source written long ago is not this
        consumer's load: an index made over it later, far behind its head, must not hold every other source."""
        if not self.settings.max_index_lag_seqs or not self._written_sources:
            return {}
        since = (self._paused_at if self.paused else time.monotonic()) - self.recent_writes_s
        if not self.paused:  # forget the others: the map stays as small as the sources written lately
            self._written_sources = {k: at for k, at in self._written_sources.items() if at >= since}
        recent = [k for k, at in self._written_sources.items() if at >= since]
        over: dict[int, int] = {}
        for tenant in {t for t, _ in recent}:
            ids = [sid for t, sid in recent if t == tenant]
            try:
                over |= self.runtime().backpressure.over(ids)
            except TRANSIENT as exc:
                log.warning("cannot read index lag: %s", exc)
        return over

    def close(self) -> None:
        """Release catalog connections."""
        self._producers.clear()
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None


def dead_letters(
    settings: Settings,
    group: str | None = None,
    *,
    limit: int = 1000,
    show: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Read and remove up to `limit` messages from a group's dead-letter queue: headers, content type, body.

    With `show`, it is called with the letters before any is removed: if it raises (SystemExit included), none
    is removed and all go back to the queue (`shoal consume --dead` prints them there: a table that failed to
    print, or a closed pipe, must not lose them).
    """
    group = settings.intake_group if group is None else check_group(group)
    queue = topology.dead_queue(settings.intake_exchange, group)
    out: list[dict[str, Any]] = []
    messages: list[Message] = []
    with Connection(broker_url(settings)) as conn:
        channel = conn.channel()
        try:
            bound = queue(channel)
            bound.declare()
            while len(out) < limit:
                message = bound.get(no_ack=False, accept=None)
                if message is None:
                    break
                messages.append(message)
                out.append({"headers": dict(message.headers or {}), "content_type": message.content_type,
                            "body": message.body})
            if show is not None:
                show(out)
            for message in messages:
                message.ack()
        finally:
            # Unacked messages (show raised) go back to the queue when their channel closes.
            channel.close()
    return out


def consume_forever(settings: Settings | None = None, *, group: str | None = None) -> IntakeConsumer:
    """Run a consumer in this thread until interrupted; returns it (with its stats) once stopped."""
    consumer = IntakeConsumer(settings, group=group)
    try:
        consumer.run()
    except KeyboardInterrupt:
        consumer.stop.set()
        consumer.close()
    except ShoalError:
        consumer.close()
        raise
    return consumer
