"""`shoal api`: the HTTP service (FastAPI under uvicorn) in the foreground."""

from __future__ import annotations

from typing import Annotated

import typer

from shoal.cli.common import load_settings, out


def api(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8080,
    workers: Annotated[int, typer.Option(min=1, help="uvicorn worker processes (one per core scales search).")] = 1,
    access_log: Annotated[bool, typer.Option("--access-log/--no-access-log", help="Log every request.")] = True,
) -> None:
    """Serve the HTTP API: Vektonn's upload and search routes, management, /healthz, /metrics, /docs.

    The API alone does not index: run `shoal worker` beside it (or everything at once with `shoal up`).
    """
    from shoal.api.app import create_app
    from shoal.api.serve import serve

    settings = load_settings()
    anonymous = settings.resolved_anonymous_tenant
    out.print(
        f"Shoal API on http://{host}:{port} (OpenAPI at /docs); "
        + (f"requests without a key are tenant {anonymous!r}" if anonymous else "every request needs an API key")
    )
    serve(None if workers > 1 else create_app(settings), host=host, port=port, workers=workers,
          access_log=access_log)
