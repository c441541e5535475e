"""`shoal consume`: the message consumer in the foreground; `shoal consume --dead` shows dead letters."""

from __future__ import annotations

import logging
import signal
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from shoal.cli.common import load_settings, out, visible
from shoal.cli.probes import check_broker
from shoal.cli.worker import check_catalog, check_storage


def consume(
    group: Annotated[str | None, typer.Option(help="Consumer group (default SHOAL_INTAKE_GROUP).")] = None,
    dead: Annotated[
        bool, typer.Option("--dead", help="Print (and remove) the group's dead letters, then exit.")
    ] = False,
    consumer_id: Annotated[str | None, typer.Option(hidden=True, help="This consumer's id (shoal up sets it).")
                           ] = None,
    replaces: Annotated[str | None, typer.Option(
        hidden=True, help="The id of a consumer of the group that ended (shoal up saw it exit): its lead is freed.")
    ] = None,
) -> None:
    """Consume upload messages from the intake exchange into data-source logs until interrupted.

    Messages name their tenant, data source and version in headers; bodies are Vektonn's upload JSON or the
    compact Arrow form. Invalid messages go to the group's dead-letter queue with their reason.
    """
    from shoal.config.settings import mask_url
    from shoal.intake.consumer import IntakeConsumer, dead_letters
    from shoal.intake.delivery import check_consumer_id
    from shoal.servers.broker import broker_url

    for option, value in (("--consumer-id", consumer_id), ("--replaces", replaces)):
        if value is not None:
            try:
                check_consumer_id(value)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint=option) from None
    settings = load_settings()
    if dead:
        name = group or settings.intake_group

        def show(letters: list[dict[str, Any]]) -> None:
            # Called before the letters are removed: a table that fails to print (or a closed pipe) loses none.
            table = Table(title=f"dead letters of group {name} ({len(letters)}, now removed)")
            for col in ("tenant", "source", "version", "message id", "reason"):
                table.add_column(col)
            for d in letters:
                h = d["headers"]
                # Text: a reason quotes what the message held, which rich must not read as markup; visible
                # here (not only when printed) so the columns are measured on what is shown.
                keys = ("shoal-tenant", "shoal-source", "shoal-version", "shoal-message-id", "shoal-dead-reason")
                table.add_row(*(Text(visible(str(h.get(k, "")))) for k in keys))
            out.print(table)

        dead_letters(settings, group, show=show)
        return
    # As `shoal api` and `shoal worker` do: a consumer started on a storage it cannot use requeued every message
    # about once a second, for ever.
    check_storage(settings)
    # And the catalog (README: consumers refuse an older schema at start): the consumer reads it only with the first
    # message, and took a schema it cannot use for a transient failure, requeueing every message for ever.
    check_catalog(settings)
    # And the broker, as `shoal worker` does: a consumer started on one it cannot reach retried for ever, silently.
    # (One that goes away later is waited for: the consumer reconnects by itself.)
    broker = broker_url(settings)
    check_broker(broker)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    consumer = IntakeConsumer(settings, group=group, consumer_id=consumer_id, replaces=replaces)

    def _stop(*_: Any) -> None:
        consumer.stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # A closed terminal stops it cleanly too (its messages handed back, its lead freed at once): killed outright,
    # its group waited SHOAL_INTAKE_VISIBILITY_TIMEOUT_S for another consumer to lead. Under nohup it stays ignored.
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _stop)
    out.print(
        f"consuming queue {consumer.queue.name} of exchange {consumer.exchange_name} on "
        f"{mask_url(broker_url(settings))}; up to {settings.intake_max_points:,} points or "
        f"{settings.intake_max_wait_ms} ms per commit"
    )
    consumer.run()
    s = consumer.stats
    out.print(f"stopped: {s.messages:,} messages ({s.points:,} points) committed, {s.duplicates:,} duplicates, "
              f"{s.dead:,} dead letters")
