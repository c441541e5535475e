"""Where intake messages travel: one durable topic exchange, one queue per consumer group, a dead-letter queue.

Routing keys are `{tenant}.{data source}.{version}` so a consumer group may bind to a tenant (`acme.#`) or
one source (`acme.docs.#`); the headers below name the target exactly (names may themselves hold dots).
"""

from __future__ import annotations

from dataclasses import dataclass

from kombu import Exchange, Queue

from shoal.errors import ValidationError
from shoal.log.records import check_name, check_tenant_name

# Message headers (kombu application headers).
TENANT = "shoal-tenant"
SOURCE = "shoal-source"
VERSION = "shoal-version"
MESSAGE_ID = "shoal-message-id"  # also the AMQP message_id property; the consumer dedupes on it
REASON = "shoal-dead-reason"  # on dead letters: why the message was refused
DEAD_AT = "shoal-dead-at"
ORIGINAL_ROUTING_KEY = "shoal-routing-key"
# A committed message's batch id is this prefix plus its message id (how redeliveries are recognised).
BATCH_ID_PREFIX = "msg:"


@dataclass(frozen=True)
class Target:
    """The data source a message writes to."""

    tenant: str
    source: str
    version: str

    @property
    def routing_key(self) -> str:
        """The routing key publishers send this target's messages with."""
        return f"{self.tenant}.{self.source}.{self.version}"


def target(tenant: str, source: str, version: str) -> Target:
    """A checked target; InvalidNameError naming the bad part otherwise."""
    return Target(check_tenant_name(tenant), check_name("data source name", source),
                  check_name("data source version", version))


def target_of(headers: dict[str, object] | None) -> Target:
    """The target a message's headers name; ValidationError when they are missing or malformed."""
    headers = headers or {}
    missing = [h for h in (TENANT, SOURCE, VERSION) if not isinstance(headers.get(h), str)]
    if missing:
        raise ValidationError(f"message headers missing {', '.join(missing)}")
    return target(str(headers[TENANT]), str(headers[SOURCE]), str(headers[VERSION]))


def exchange(name: str) -> Exchange:
    """The durable topic exchange publishers send to."""
    return Exchange(name, type="topic", durable=True)


def group_queue(exchange_name: str, group: str, binding: str = "#") -> Queue:
    """The durable queue of one consumer group: every consumer of the group shares its messages."""
    return Queue(f"{exchange_name}.{group}", exchange(exchange_name), routing_key=binding, durable=True)


def dead_exchange(exchange_name: str) -> Exchange:
    """Where refused messages go (direct, keyed by consumer group)."""
    return Exchange(f"{exchange_name}.dead", type="direct", durable=True)


def dead_queue(exchange_name: str, group: str) -> Queue:
    """The dead-letter queue of a consumer group: refused messages wait here with the reason in a header."""
    return Queue(f"{exchange_name}.{group}.dead", dead_exchange(exchange_name), routing_key=group, durable=True)
