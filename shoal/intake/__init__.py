"""Event-driven intake: upstream processors publish upload messages; `shoal consume` appends them to the log.

`Publisher` (and `publish`) send messages; `IntakeConsumer` consumes a consumer group's queue exactly once
into the log; `codec` defines the message bodies; `topology` the exchange, queues and headers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoal.intake.consumer import IntakeConsumer
    from shoal.intake.publisher import Publisher, publish

__all__ = ["IntakeConsumer", "Publisher", "publish"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the codec or topology must not pull in the consumer's dependencies.
    if name == "IntakeConsumer":
        from shoal.intake.consumer import IntakeConsumer

        return IntakeConsumer
    if name in ("Publisher", "publish"):
        from shoal.intake import publisher

        return getattr(publisher, name)
    raise AttributeError(name)
