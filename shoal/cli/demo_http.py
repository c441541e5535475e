"""The HTTP step of `shoal demo`: serve the API in a child process and search it as a Vektonn client would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

from shoal.cli.common import out
from shoal.config.settings import Settings


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_search(settings: Settings, tenant: str, index: str, version: str, query: np.ndarray, k: int) -> None:
    """Start `shoal api`, send one Vektonn search (no key: the anonymous tenant), print the answer, stop it."""
    port = _free_port()
    env = os.environ | {"SHOAL_ANONYMOUS_TENANT": tenant, "SHOAL_DATA_DIR": str(settings.data_dir)}
    server = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "api", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                out.print("HTTP API: did not start (skipped)")
                return
            time.sleep(0.1)
        body = {"k": k, "queryVectors": [{"isSparse": False, "coordinates": query.astype(float).tolist()}]}
        answer = httpx.post(f"{base}/api/v1/search/{index}/{version}", json=body, timeout=30).json()
        hits = answer[0]["nearestDataPoints"]
        names = [next(a["value"]["string"] for a in h["attributes"] if a["key"] == "package") for h in hits]
        out.print(f"HTTP API at {base} (Vektonn routes, /docs): POST /api/v1/search/{index}/{version} -> "
                  f"{', '.join(names)}")
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
