"""Fuzzing: schemathesis generates requests from the served OpenAPI document; no route answers 5xx."""

from __future__ import annotations

import collections
import socket
import threading
from collections.abc import Iterator

import pytest
import schemathesis
import uvicorn
from conftest import wait_for
from hypothesis import HealthCheck, given, settings

from shoal import DataSourceSpec, Shoal
from shoal.api.app import create_app
from shoal.log.records import IndexSpec


@pytest.fixture(scope="module")
def api_url(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A served API with one data source and one index, so fuzzed requests also reach the real code paths."""
    from shoal.config.settings import Settings

    root = tmp_path_factory.mktemp("fuzz")
    cfg = Settings(
        data_dir=root,
        database_url=pg_url,
        redis_url="redis://127.0.0.1:1/0",
        storage_uri=str(root / "storage"),
        tenant="fuzz",
        anonymous_tenant="fuzz",
    )
    with Shoal(cfg, notify=False) as shoal:
        shoal.create_data_source(
            DataSourceSpec("QS", "1", 2, {"id": "int64", "payload": "string"}, ["id"]), exist_ok=True
        )
        shoal.create_index(IndexSpec("QS.Index", "1", "QS", "1", algorithm="FaissIndex.L2"), exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(cfg), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "the API server to start")
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.mark.slow
def test_no_route_answers_5xx(api_url: str) -> None:
    schema = schemathesis.openapi.from_url(f"{api_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 4  # upload, search (GET and POST), healthz
    failures: list[str] = []
    codes: list[int] = []
    for operation in operations:

        @given(case=operation.as_strategy())
        # derandomize: CI runs the same examples every time, so a pass here is a pass there.
        @settings(
            max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True
        )
        def run(case) -> None:  # type: ignore[no-untyped-def]
            # Aim half the requests at the real data source and index, not only at names that 404.
            params = case.path_parameters or {}
            if params and hash(str(case.body)) % 2:
                if "dataSourceName" in params:
                    params.update(dataSourceName="QS", dataSourceVersion="1")
                if "indexName" in params:
                    params.update(indexName="QS.Index", indexVersion="1")
            response = case.call(base_url=api_url)
            codes.append(response.status_code)
            if response.status_code >= 500:
                failures.append(
                    f"{case.method} {case.formatted_path} {case.body!r}: {response.status_code} {response.text[:300]}"
                )

        run()
    seen = collections.Counter(codes)
    assert seen[400] and seen[404], seen  # the fuzzer reached both validation and lookup, not just one wall
    assert not failures, "\n".join(failures[:10])
