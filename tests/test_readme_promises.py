"""README promises the code broke: an empty Vektonn upload held to the Idempotency-Key rules, a reindex to a new
algorithm given some of its params, `shoal api` on a port in use (one worker), and a malformed dataset API body."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import free_port, settings_env
from typer.testing import CliRunner

from shoal import DataSourceSpec, Shoal
from shoal.cli import app
from shoal.config.settings import Settings
from shoal.log.records import IndexSpec

runner = CliRunner()
HNSW_DEFAULTS = {"ef_construction": 200, "ef_search": 64}


def _point(i: int) -> dict[str, object]:
    return {"attributes": [{"key": "id", "value": {"int64": i}}],
            "vector": {"isSparse": False, "coordinates": [float(i), 1.0]}}


def _source(shoal: Shoal, name: str) -> None:
    shoal.create_data_source(DataSourceSpec(name=name, version="1", vector_dimension=2,
                                            attribute_types={"id": "int64"}, permanent_attributes=["id"]))


def test_an_empty_upload_is_held_to_the_idempotency_key_rules(served: tuple[str, Settings]) -> None:
    """`[]` skipped every Idempotency-Key check: a key used by another body, a `msg:` key and a 300-character key
    all answered 200 with the head's token. They are refused (400, naming the key or the rule) as for any body;
    `[]` under a fresh key still writes nothing, answers the head, and leaves the key free for a batch."""
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=f"{url}/api/v1", timeout=30) as http:
        _source(shoal, "E.Source")

        def up(body: list[dict[str, object]], key: str) -> httpx.Response:
            return http.post("/upload/E.Source/1", json=body, headers={"Idempotency-Key": key})

        first = up([_point(1)], "k1")
        assert first.status_code == 200, first.text
        assert up([_point(2)], "k2").status_code == 200

        reused = up([], "k1")
        assert reused.status_code == 400, reused.text
        assert "batch id 'k1' was already used for another batch (write token 1)" in reused.json()["errorMessages"][0]
        reserved = up([], "msg:x")
        assert reserved.status_code == 400, reserved.text
        assert "must not start with 'msg:'" in reserved.json()["errorMessages"][0]
        too_long = up([], "a" * 201)
        assert too_long.status_code == 400, too_long.text
        assert "1 to 200 characters" in too_long.json()["errorMessages"][0]

        fresh = up([], "k3")
        assert fresh.status_code == 200, fresh.text
        assert fresh.headers["X-Shoal-Write-Token"] == "2"  # the head: nothing written
        batch = up([_point(3)], "k3")  # the key was not taken by the empty upload
        assert batch.status_code == 200, batch.text
        assert batch.headers["X-Shoal-Write-Token"] == "3"
        assert shoal.get_data_source("E.Source", "1").head_seq == 3


def test_a_reindex_to_a_new_algorithm_takes_the_rest_of_its_params_from_its_defaults(
    served: tuple[str, Settings], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """`shoal reindex I 1 --algorithm hnsw --param M=32` from a flat index failed ("HNSW parameters must be given
    all or none"); README: with a new algorithm, the params given are all it takes, the rest its defaults. The
    same through the CLI, Python and the management route."""
    url, settings = served
    with Shoal(settings, notify=False) as shoal:
        _source(shoal, "R.Source")
        for name in ("R.Cli", "R.Py", "R.Http"):
            shoal.create_index(IndexSpec(name=name, version="1", source_name="R.Source", source_version="1",
                                         algorithm="flat", metric="euclidean"))
        job = shoal.reindex("R.Py", "1", algorithm="hnsw", params={"M": 32})
        assert job.definition["algorithm"] == "hnsw"
        assert job.definition["params"] == {"M": 32, **HNSW_DEFAULTS}

    r = httpx.post(f"{url}/api/v1/indexes/R.Http/1/reindex", json={"algorithm": "hnsw", "params": {"M": 24}},
                   timeout=30)
    assert r.status_code == 202, r.text
    assert r.json()["definition"]["params"] == {"M": 24, **HNSW_DEFAULTS}

    monkeypatch.chdir(tmp_path)  # no stray ./shoal.toml is read
    monkeypatch.delenv("SHOAL_CONFIG", raising=False)
    for key, value in settings.child_env().items():
        if key.startswith("SHOAL_"):
            monkeypatch.setenv(key, value)
    result = runner.invoke(app, ["reindex", "R.Cli", "1", "--algorithm", "hnsw", "--param", "M=32", "--json"])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    with Shoal(settings, notify=False) as shoal:
        [job] = shoal.reindex_jobs("R.Cli", "1")
    assert job.definition["params"] == {"M": 32, **HNSW_DEFAULTS}


def test_one_api_process_refuses_a_port_in_use_in_one_line(make_settings: Callable[..., Settings]) -> None:
    """`shoal api` without --workers on a port something else listens on printed uvicorn's `[Errno 98]` lines and
    exited 3; as with --workers, it is refused in one line (`port P on HOST is in use`), exit 1."""
    settings = make_settings("local")
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        proc = subprocess.run(
            [sys.executable, "-m", "shoal.cli", "api", "--port", str(port), "--no-access-log"],
            env=settings_env(settings), capture_output=True, text=True, timeout=120,
        )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: port {port} on 127.0.0.1 is in use: cannot start the HTTP API (choose another port or stop "
        "what uses it)"
    ], proc.stderr


def test_a_malformed_dataset_body_names_the_body(served: tuple[str, Settings]) -> None:
    """`{bad` answered 400 VALIDATION_ERROR "invalid request: body.1: JSON decode error" without `field`; README:
    a body that is no JSON the API can read (malformed, ...) is a 400 VALIDATION_ERROR with `field: "body"`."""
    url, _ = served
    r = httpx.post(f"{url}/api/v1/datasets", content=b"{bad", headers={"Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["error_code"] == "VALIDATION_ERROR"
    assert body["details"]["field"] == "body"
    assert body["message"].startswith("invalid request: the body could not be parsed: Expecting property name")
