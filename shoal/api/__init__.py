"""The HTTP API (FastAPI): Vektonn-compatible upload and search."""
