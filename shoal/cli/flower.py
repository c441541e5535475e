"""`shoal flower`: Flower, the Celery monitor, on Shoal's Celery app, every option passed to Flower."""

from __future__ import annotations

import sys

import typer

FLOWER_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def flower(ctx: typer.Context) -> None:
    """Run Flower on Shoal's workers and broker: `celery -A shoal.workers.app flower` with every option given
    here (`--port=5555`, `--address=0.0.0.0`, `--basic-auth=...`; `--help` is Flower's). Its Broker page (queue
    lengths) works here, and not under the plain celery command: see `run_flower`."""
    run_flower(list(ctx.args))


def run_flower(args: list[str]) -> None:
    """Flower with `args`, given the broker by its plain URL: Flower takes the broker's kind (for its Broker page)
    from the scheme of the app's connection URI, which the app's own transport class replaces ("'redis' broker is
    not supported"). Exits with Flower's status."""
    from shoal.workers.app import app

    # kombu's own Redis transport: Shoal's differs only in how a connection closed under it fails, which matters
    # to a worker's reconnects, not to Flower's reads of queue lengths and events. Read before it is set: the
    # app's on_configure fills its conf at the first read, over any earlier setting.
    if app.conf.broker_transport is not None:
        app.conf.broker_transport = None
    code = app.start(["flower", *args])
    sys.exit(code or 0)
