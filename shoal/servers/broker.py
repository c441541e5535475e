"""Where the broker is: the configured Redis URL, or the embedded Valkey's."""

from __future__ import annotations

from shoal.config.settings import Settings


def broker_url(settings: Settings) -> str:
    """The configured Redis URL, or the embedded Valkey's (started if needed)."""
    if settings.redis_url:
        return settings.redis_url
    from shoal.servers.embedded import ensure_valkey

    return ensure_valkey(settings.data_dir)
