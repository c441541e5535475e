"""A small file written to S3 is one PutObject, as DESIGN's commit step says ("or one object PUT"): not a
multipart upload's three requests, which also leave an unfinished, billed upload behind a writer that dies."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import orjson
import pyarrow as pa
import pytest
from moto.server import ThreadedMotoServer

from shoal.config.settings import Settings
from shoal.storage import Storage

BUCKET = "single-put"


@pytest.fixture
def recorded_s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A moto server of this test's own (its request recorder is global to the server), with the bucket made;
    the recording goes to the test's temp dir (moto's default is a file in the working directory)."""
    monkeypatch.setenv("MOTO_RECORDER_FILEPATH", str(tmp_path / "moto_recording"))
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                 region_name="us-east-1").create_bucket(Bucket=BUCKET)
    try:
        yield endpoint
    finally:
        server.stop()


def _requests(endpoint: str) -> list[tuple[str, str]]:
    """(method, path and query) of each request the server recorded, the recorder's own left out."""
    text = httpx.get(f"{endpoint}/moto-api/recorder/download-recording").text
    entries = [orjson.loads(line) for line in text.splitlines() if line.strip()]
    return [(e["method"], e["url"].split("/", 3)[3]) for e in entries if "/moto-api/" not in e["url"]]


def test_a_small_file_is_one_put_and_a_large_one_still_arrives_whole(recorded_s3: str, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", storage_uri=f"s3://{BUCKET}/root", s3_endpoint_url=recorded_s3,
                        s3_access_key="test", s3_secret_key="test")
    storage = Storage.from_settings(settings)
    small = pa.py_buffer(b"s" * 100_000)
    large = pa.py_buffer(bytes(range(256)) * (12 * 4096))  # 12 MiB: past one 10 MiB part
    httpx.post(f"{recorded_s3}/moto-api/recorder/reset-recording")
    httpx.post(f"{recorded_s3}/moto-api/recorder/start-recording")
    try:
        storage.write_atomic("tenants/t/log/small.parquet", small)
    finally:
        httpx.post(f"{recorded_s3}/moto-api/recorder/stop-recording")
    writes = [r for r in _requests(recorded_s3) if r[0] in ("PUT", "POST")]
    assert writes == [("PUT", f"{BUCKET}/root/tenants/t/log/small.parquet")], writes
    storage.write_atomic("tenants/t/index/large.bin", large)
    assert storage.read("tenants/t/log/small.parquet") == small
    assert storage.read("tenants/t/index/large.bin") == large
