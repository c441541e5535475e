"""`shoal api`: the HTTP service (FastAPI under uvicorn) in the foreground."""

from __future__ import annotations

from typing import Annotated

import typer

from shoal.cli.common import load_settings, out


def api(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8080,
    workers: Annotated[int, typer.Option(help="uvicorn worker processes.")] = 1,
) -> None:
    """Serve the HTTP API: Vektonn's upload and search routes, management, /healthz, /metrics, /docs."""
    import uvicorn

    from shoal.api.app import create_app

    settings = load_settings()
    anonymous = settings.resolved_anonymous_tenant
    out.print(
        f"Shoal API on http://{host}:{port} (OpenAPI at /docs); "
        + (f"requests without a key are tenant {anonymous!r}" if anonymous else "every request needs an API key")
    )
    if workers > 1:
        uvicorn.run("shoal.api.app:create_app", factory=True, host=host, port=port, workers=workers)
    else:
        uvicorn.run(create_app(settings), host=host, port=port)
