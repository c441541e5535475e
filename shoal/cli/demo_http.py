"""The HTTP step of `shoal demo`: serve the API in a child process and search it as a Vektonn client would.

Only the standard library talks HTTP here: the demo is the README's main job and must run after a plain
`pip install .`, which installs no HTTP client.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np

from shoal.cli.common import out
from shoal.config.settings import Settings


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _status(url: str, timeout: float) -> int | None:
    """The HTTP status of GET `url`, or None when nothing answers (yet)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:  # an answer, just not a 2xx one
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


def _post_json(url: str, body: Any, timeout: float) -> Any:
    """POST `body` as JSON to `url` and return the decoded JSON answer (HTTPError on a non-2xx status)."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


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
        # /healthz may take a second to answer (it pings the workers): wait for it rather than retry at once.
        while _status(f"{base}/healthz", timeout=5) != 200:
            if time.monotonic() > deadline or server.poll() is not None:
                out.print("HTTP API: did not start (skipped)")
                return
            time.sleep(0.1)
        body = {"k": k, "queryVectors": [{"isSparse": False, "coordinates": query.astype(float).tolist()}]}
        answer = _post_json(f"{base}/api/v1/search/{index}/{version}", body, timeout=30)
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
