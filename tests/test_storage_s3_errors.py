"""S3 errors that are no outage, met by a running Shoal: its bucket deleted, or its credentials refused. At start-up
they already stop Shoal with one line (a ConfigurationError); at run time they passed through `Storage` as pyarrow's
bare OSError. A Vektonn upload answered 500 quoting the object key and bucket after three retries that could not
help, a first search called the missing bucket a corrupt index, and a dataset create answered 500 INTERNAL_ERROR.
They are StorageRefusedError now (a ConfigurationError): 503 naming the problem class and the setting to fix, no
object key or bucket in the body (the log has them), no retry, nothing written to the catalog.

S3 is the session's moto server (tests/conftest.py) with a bucket of each test's own, deleted while Shoal runs;
refused credentials come from a moto server of the test's own that checks them (INITIAL_NO_AUTH_ACTION_COUNT=0)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import httpx
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from conftest import free_port, serve_api, stop_process, wait_for

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.errors import CommitError, ConfigurationError, CorruptArtifactError, StorageUnavailableError
from shoal.index.builder import ShardBuilder
from shoal.index.manifest import Manifest
from shoal.index.segment import load_segment
from shoal.log.commit import BatchSlot, commit_group
from shoal.log.records import IndexSpec
from shoal.log.segment_file import WrittenSegment
from shoal.storage import Storage, StorageRefusedError, is_outage, refusal

DIM = 2


class Bucket:
    """A bucket of the test's own on the session's moto server, which the test can delete (with its objects)."""

    def __init__(self, endpoint: str) -> None:
        self.name = f"gone-{uuid.uuid4().hex[:12]}"
        self.endpoint = endpoint
        self.client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test",
                                   aws_secret_access_key="test", region_name="us-east-1")
        self.client.create_bucket(Bucket=self.name)

    def delete(self) -> None:
        """Empty the bucket and delete it, as an operator (or a lifecycle rule gone wrong) would."""
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name):
            for item in page.get("Contents", []):
                self.client.delete_object(Bucket=self.name, Key=item["Key"])
        self.client.delete_bucket(Bucket=self.name)


@pytest.fixture
def bucket(s3_endpoint: str) -> Bucket:
    return Bucket(s3_endpoint)


def _settings(make_settings: Callable[..., Settings], bucket: Bucket, **overrides: object) -> Settings:
    settings = make_settings("local", storage_uri=f"s3://{bucket.name}/root", s3_endpoint_url=bucket.endpoint,
                             s3_access_key="test", s3_secret_key="test", **overrides)
    return settings.model_copy(update={"anonymous_tenant": settings.tenant})


def _point(i: int) -> dict[str, object]:
    return {"attributes": [{"key": "id", "value": {"int64": i}}],
            "vector": {"isSparse": False, "coordinates": [float(i), 1.0]}}


def _query() -> dict[str, object]:
    return {"k": 2, "queryVectors": [{"isSparse": False, "coordinates": [1.0, 1.0]}]}


def _names_nothing_internal(response: httpx.Response, bucket: Bucket) -> None:
    for word in (bucket.name, "tenants/", ".parquet", "AWS", "NO_SUCH_BUCKET", "Traceback", "attempts"):
        assert word not in response.text, (word, response.text)


def _refused(response: httpx.Response, shape: str, bucket: Bucket) -> None:
    """A 503 saying the storage's bucket does not exist, in the route's shape, naming nothing internal."""
    assert response.status_code == 503, (response.status_code, response.text)
    body = response.json()
    if shape == "vektonn":
        assert body == {"errorMessages": [StorageRefusedError.NO_BUCKET]}, body
    else:
        assert body["success"] is False and body["error_code"] == "SERVICE_UNAVAILABLE", body
        assert body["message"] == StorageRefusedError.NO_BUCKET, body
    _names_nothing_internal(response, bucket)


def test_a_running_api_answers_503_naming_a_deleted_bucket(
    make_settings: Callable[..., Settings], bucket: Bucket, caplog: pytest.LogCaptureFixture
) -> None:
    """The bucket deleted while the API runs: an upload, a search that loads its index first and a dataset create
    answer 503 saying the storage bucket does not exist (the upload at once, without its retries); nothing is
    written to the catalog, and the log names the bucket and the object the request needed."""
    settings = _settings(make_settings, bucket, commit_retries=3)
    with Shoal(settings, notify=False) as shoal, serve_api(settings) as url, \
            httpx.Client(base_url=f"{url}/api/v1", timeout=60) as http:
        assert http.post("/data-sources", json={
            "name": "Docs", "version": "1", "vectorDimension": DIM, "attributeValueTypes": {"id": "int64"},
            "permanentAttributes": ["id"]}).status_code == 201
        assert http.post("/indexes", json={"name": "Docs.Flat", "version": "1", "dataSourceName": "Docs",
                                           "dataSourceVersion": "1", "algorithm": "FaissIndex.L2"}).status_code == 201
        r = http.post("/upload/Docs/1", json=[_point(i) for i in range(3)])
        assert r.status_code == 200, r.text
        for shard in shoal.get_index("Docs.Flat", "1").shards:
            ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
        head = shoal.get_data_source("Docs", "1").head_seq

        bucket.delete()
        caplog.clear()
        with caplog.at_level(logging.INFO):
            _refused(http.post("/upload/Docs/1", json=[_point(9)]), "vektonn", bucket)
            _refused(http.post("/search/Docs.Flat/1", json=_query()), "vektonn", bucket)
            _refused(http.post("/datasets", json={"name": "fresh", "dimensions": DIM, "index_type": "flat",
                                                  "metric_type": "euclidean"}), "dataset", bucket)
        assert shoal.get_data_source("Docs", "1").head_seq == head  # the upload wrote nothing
        assert http.get("/datasets/fresh").status_code == 404  # nor did the create
        assert "fresh" not in [d["name"] for d in http.get("/datasets").json()["datasets"]]
        logged = caplog.text
        assert "commit attempt" not in logged, logged  # no retry of what no retry can help
        assert "is missing" not in logged and "corrupt" not in logged.lower(), logged
        assert f"S3 bucket {bucket.name!r} does not exist" in logged or "NO_SUCH_BUCKET" in logged, logged
        assert "/log/" in logged, logged  # the upload's object key, for the operator

        # The operator makes the bucket again: uploads work again (they are no failure of Shoal's own).
        bucket.client.create_bucket(Bucket=bucket.name)
        r = http.post("/upload/Docs/1", json=[_point(9)])
        assert r.status_code == 200, r.text


def test_storage_reports_a_deleted_bucket_as_refused_never_as_a_missing_or_corrupt_file(
    make_settings: Callable[..., Settings], bucket: Bucket
) -> None:
    """Reading an object of a deleted bucket raised FileNotFoundError (S3 answers a HEAD with a bare 404), which
    an index load took for a corrupt artifact; a write raised the bare OSError a commit retried. StorageRefusedError
    now, at once; an object missing from a bucket that is there is still FileNotFoundError."""
    settings = _settings(make_settings, bucket, commit_retries=3)
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec("src", "1", DIM, {"id": "int64"}, ["id"]))
        index = shoal.create_index(IndexSpec("ix", "1", "src", "1", algorithm="flat", metric="euclidean"))
        shoal.producer("src", "1").upload_columns(np.ones((3, DIM), np.float32), {"id": np.arange(3)})
        shard = index.shards[0].id
        ShardBuilder(shoal.engine, shoal.storage).materialize(shard)
        active = shoal.shards.active_version(shard)
        assert active is not None
        entry = Manifest.of(active.manifest).segments[0]
        spec = shoal.get_index("ix", "1").spec
        with pytest.raises(FileNotFoundError):
            shoal.storage.read("tenants/no/such/object")
        head = shoal.get_data_source("src", "1").head_seq

        bucket.delete()
        with pytest.raises(StorageRefusedError) as read:
            shoal.storage.read("tenants/no/such/object")
        assert str(read.value) == StorageRefusedError.NO_BUCKET
        assert bucket.name in read.value.detail and "tenants/no/such/object" in read.value.detail
        assert isinstance(read.value, ConfigurationError) and isinstance(read.value, OSError)
        assert not isinstance(read.value, FileNotFoundError | StorageUnavailableError)
        with pytest.raises(StorageRefusedError):
            load_segment(shoal.storage, entry, spec)
        with pytest.raises(StorageRefusedError, match="bucket does not exist"):
            shoal.storage.write_atomic("tenants/x", pa.py_buffer(b"1"))
        with pytest.raises(StorageRefusedError) as upload:  # raised as it is: no CommitError after 3 attempts
            shoal.producer("src", "1").upload_columns(np.zeros((1, DIM), np.float32), {"id": np.array([7])})
        assert not isinstance(upload.value, CommitError | CorruptArtifactError)
        assert shoal.get_data_source("src", "1").head_seq == head


@pytest.fixture
def checking_s3(tmp_path: Path) -> Iterator[str]:
    """A moto server that checks credentials (it knows none, so it refuses every key), as a child process: the
    session's moto, in this process, must keep accepting any."""
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}, stdout=open(tmp_path / "moto.log", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )

    def up() -> bool:
        assert proc.poll() is None, (tmp_path / "moto.log").read_text()
        try:
            return httpx.get(f"http://127.0.0.1:{port}/", timeout=2).status_code > 0
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, 30, "moto with credential checks to answer")
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(proc)


def test_refused_credentials_at_run_time_are_refused_storage_never_an_outage(checking_s3: str) -> None:
    """Credentials S3 stops taking while Shoal runs (a key revoked or rotated) answer ACCESS_DENIED or
    INVALID_ACCESS_KEY_ID: StorageRefusedError saying the storage refused the credentials, naming no key. A
    folder above the root that S3 refuses to look into is still only skipped."""
    fs = pafs.S3FileSystem(access_key="revoked", secret_key="revoked", region="us-east-1",
                           endpoint_override=checking_s3, scheme="http", allow_bucket_creation=False)
    storage = Storage(fs, "some-bucket/deep/root", local=False)
    for action in (lambda: storage.read("tenants/a/file"),
                   lambda: storage.write_atomic("tenants/a/file", pa.py_buffer(b"1")),
                   lambda: storage.list_files("tenants")):
        with pytest.raises(StorageRefusedError) as refused:
            action()
        assert str(refused.value) == StorageRefusedError.CREDENTIALS
        assert "some-bucket" not in str(refused.value) and "tenants/" not in str(refused.value)
        assert "some-bucket" in refused.value.detail
    assert storage.enclosing_files("marker.json") == []


@pytest.mark.parametrize(("text", "expected"), [
    ("When initiating multiple part upload for key 'a/b.parquet' in bucket 'b': AWS Error NO_SUCH_BUCKET during "
     "CreateMultipartUpload operation: The specified bucket does not exist", StorageRefusedError.NO_BUCKET),
    ("When reading information for key 'a' in bucket 'b': AWS Error ACCESS_DENIED during HeadObject operation: "
     "No response body.", StorageRefusedError.CREDENTIALS),
    ("When listing objects under key 'a/' in bucket 'b': AWS Error INVALID_ACCESS_KEY_ID during ListObjectsV2 "
     "operation: The AWS Access Key Id you provided does not exist in our records.", StorageRefusedError.CREDENTIALS),
    ("When getting information for key 'a' in bucket 'b': AWS Error SIGNATURE_DOES_NOT_MATCH during HeadObject "
     "operation: The request signature we calculated does not match", StorageRefusedError.CREDENTIALS),
    ("When reading 'a': AWS Error UNKNOWN (HTTP status 403) during GetObject", StorageRefusedError.CREDENTIALS),
    ("When reading 'a': AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 7", None),
    ("When reading 'a': AWS Error SLOW_DOWN during PutObject operation: Please reduce your request rate.", None),
    ("[Errno 28] No space left on device", None),
])
def test_refusal_names_the_problem_class_of_an_s3_error(text: str, expected: str | None) -> None:
    """pyarrow's spelling of the AWS SDK's errors: a missing bucket and refused credentials are refusals (no
    outage, so never retried as one); outages and anything else are not."""
    assert refusal(OSError(text)) == expected
    if expected is not None:
        assert not is_outage(OSError(text), local=False)


def test_a_commit_names_no_object_key_and_never_retries_a_refused_storage(
    local_shoal: Shoal, caplog: pytest.LogCaptureFixture
) -> None:
    """A commit that gave up on a storage error put the error's text, with its object key and bucket, into the
    CommitError that the API answers; the log keeps it now, and the message says only what kind of error it was.
    A refused storage (StorageRefusedError) is raised as it is after one attempt."""
    local_shoal.create_data_source(DataSourceSpec("src", "1", DIM, {"id": "int64"}, ["id"]))
    source = local_shoal.get_data_source("src", "1").id
    calls: list[int] = []

    def failing(error: OSError) -> Callable[[int, list[int]], WrittenSegment]:
        def write(first_seq: int, keep: list[int]) -> WrittenSegment:
            calls.append(first_seq)
            raise error
        return write

    key = "When writing key 'root/tenants/t/sources/src/1/log/0001.parquet' in bucket 'secret-bucket': disk error"
    with caplog.at_level(logging.WARNING, logger="shoal.log.commit"), pytest.raises(CommitError) as failed:
        commit_group(local_shoal.engine, source, [BatchSlot(1, None)], failing(OSError(key)),
                     local_shoal.storage.delete_quietly, retries=2, lock_timeout_ms=5000)
    assert "secret-bucket" not in str(failed.value) and ".parquet" not in str(failed.value), failed.value
    assert "after 2 attempts" in str(failed.value) and "storage failed" in str(failed.value), failed.value
    assert "secret-bucket" in caplog.text and len(calls) == 2

    calls.clear()
    refused = StorageRefusedError(StorageRefusedError.CREDENTIALS, detail=key)
    with pytest.raises(StorageRefusedError):
        commit_group(local_shoal.engine, source, [BatchSlot(1, None)], failing(refused),
                     local_shoal.storage.delete_quietly, retries=3, lock_timeout_ms=5000)
    assert len(calls) == 1
    assert local_shoal.get_data_source("src", "1").head_seq == 0
