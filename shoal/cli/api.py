"""`shoal api`: the HTTP service (FastAPI under uvicorn) in the foreground."""

from __future__ import annotations

from typing import Annotated

import typer

from shoal.cli.common import load_settings, out
from shoal.cli.worker import check_catalog


def api(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8080,
    workers: Annotated[int, typer.Option(min=1, help="uvicorn worker processes (one per core scales search).")] = 1,
    access_log: Annotated[bool, typer.Option("--access-log/--no-access-log", help="Log every request.")] = True,
    allow_anonymous_writes: Annotated[
        bool,
        typer.Option(
            "--allow-anonymous-writes",
            help="Serve uploads and creates without an API key on an address beyond loopback (refused otherwise; "
            "also SHOAL_ALLOW_ANONYMOUS_WRITES).",
        ),
    ] = False,
) -> None:
    """Serve the HTTP API: Vektonn's upload and search routes, management, /healthz, /metrics, /docs.

    The API alone does not index: run `shoal worker` beside it (or everything at once with `shoal up`).
    """
    from shoal.api.app import create_app
    from shoal.api.security import check_exposure
    from shoal.api.serve import check_port_free, serve
    from shoal.searcher.placement import Placement
    from shoal.storage import Storage

    settings = load_settings()
    if allow_anonymous_writes:
        settings = settings.model_copy(update={"allow_anonymous_writes": True})
    check_exposure(settings, host)  # before anything starts: a refusal must cost nothing and say why
    placement = Placement.load(settings.placement_file, settings.node)  # a bad file: its error, no traceback
    # The storage too: opened inside uvicorn's startup, its ConfigurationError came out as a traceback.
    Storage.from_settings(settings)
    # The catalog too (reachable, its schema this Shoal's; the embedded default migrated): checked inside the app's
    # startup, a refusal came out as uvicorn's traceback, and with --workers as worker processes restarted in a loop.
    check_catalog(settings)
    # Before the banner: "Shoal API on ..." printed above the refusal read as if the API had started.
    check_port_free(host, port)
    anonymous = settings.resolved_anonymous_tenant
    if anonymous is None:
        who = "every request needs an API key"
    else:
        who = (f"requests without a key are tenant {anonymous!r} with role {settings.anonymous_role} "
               "(they never delete)")
    out.print(f"Shoal API on http://{host}:{port} (OpenAPI at /docs); {who}")
    if placement.indexes:
        here = f"node {placement.node}" if placement.node else "no node (a router: serves no placed shard)"
        out.print(f"placement {settings.placement_file}: {len(placement.indexes)} placed index(es); this process is "
                  f"{here}")
    serve(None if workers > 1 else create_app(settings), host=host, port=port, workers=workers,
          access_log=access_log)
