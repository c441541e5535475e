"""Vektonn's own Python client (the `vektonn` package, 0.7.1, unchanged) against Shoal's HTTP API: uploads of
every attribute kind, searches with several query vectors, a split filter and vectors retrieved, both kinds of
tombstones, its error type for Shoal's errors, and its async client.

The client pins pydantic 1.9, aiohttp 3.8, orjson 3.6 and requests 2.27, none of which installs on Python 3.11
(or beside the project's pydantic 2), so it runs in a venv of its own: the package as published, without its
pins, beside the newest pydantic 1 and current aiohttp, orjson and requests, as a user on Python 3.11 runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import serve_api

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.log.records import IndexSpec

pytestmark = pytest.mark.slow
RUN = Path(__file__).resolve().parent / "helpers" / "vektonn_client_run.py"
INSTALL_TIMEOUT_S = 600


def _client_venv(where: Path) -> Path:
    """A venv holding the published Vektonn client; its python."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))} | {"PIP_NO_INPUT": "1"}
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    pip = [str(where / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
    for args in (["--no-deps", "vektonn==0.7.1"],
                 ["pydantic>=1.10,<2", "aiohttp>=3.8", "orjson>=3.6", "requests>=2.27"]):
        done = subprocess.run(pip + args, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        assert done.returncode == 0, done.stderr[-4000:]
    return where / "bin" / "python"


@pytest.mark.timeout(2 * INSTALL_TIMEOUT_S + 300)
def test_the_vektonn_python_client_works_unchanged(
    make_settings: Callable[..., Settings], redis_url: str, tmp_path: Path
) -> None:
    python = _client_venv(tmp_path / "vektonn-venv")
    settings = make_settings("local", redis_url=redis_url)
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})  # Vektonn clients send no key
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec(
            "Client.Source", "1", 2,
            {"id": "int64", "region": "string", "uid": "guid", "flag": "bool", "score": "float64", "at": "datetime"},
            ["id", "region"]))
        shoal.create_index(IndexSpec("Client.Index", "1", "Client.Source", "1", algorithm="flat",
                                     metric="euclidean", id_attributes=["id"], split_attributes=["region"],
                                     payload_attributes=["uid", "flag", "score", "at"]))
    with serve_api(settings) as url:
        done = subprocess.run([str(python), str(RUN), url], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)

    def hit(i: int, region: str, distance: float, x: float | None) -> dict[str, object]:
        return {"id": i, "region": region, "uid_ok": True, "flag": i % 2 == 0, "score": i / 4, "at_ok": True,
                "distance": distance, "vector": None if x is None else [x, 0.0]}

    # The first search, right after the upload was acknowledged, shows it (the process loads the index then);
    # every attribute kind comes back typed as the client parses it, vectors as asked.
    assert report["first"] == [
        [hit(0, "eu", 0.0, 0.0), hit(10, "us", 0.5, 0.5), hit(1, "eu", 1.0, 1.0)],
        [hit(4, "eu", 0.0, 4.0), hit(3, "eu", 1.0, 3.0), hit(2, "eu", 2.0, 2.0)],
    ]
    assert report["split"] == [[hit(10, "us", 0.5, None)]]  # retrieveVectors unset: Vektonn's default, false
    assert report["after_delete"][0] == [hit(10, "us", 0.5, 0.5), hit(2, "eu", 2.0, 2.0), hit(3, "eu", 3.0, 3.0)]
    errors = report["errors"]
    assert errors["unknown_index"]["status"] == 404 and "Client.Nope" in errors["unknown_index"]["messages"][0]
    assert errors["unknown_source"]["status"] == 404 and "Client.Nope" in errors["unknown_source"]["messages"][0]
    assert errors["dimension"]["status"] == 400 and "dimension" in errors["dimension"]["messages"][0]
    assert errors["k"]["status"] == 400 and "k must be a positive integer" in errors["k"]["messages"][0]
    missing = errors["missing_attribute"]
    assert missing["status"] == 400 and any("'uid': missing attribute" in m for m in missing["messages"]), missing
    assert report["async"]["found"] == [[hit(20, "eu", 0.0, None) | {"score": 5.0}]]
    assert report["async"]["unknown_index"]["status"] == 404
