"""The servers Shoal stands on: resolving the broker URL, and the embedded Postgres and Valkey."""
