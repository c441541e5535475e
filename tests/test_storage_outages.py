"""A storage that cannot be reached is an outage, never a corrupt file: with S3 refusing connections, reads and
writes raise StorageUnavailableError (a ConnectionError), a real Celery worker retries its tasks until S3 is back
and then finishes them, and the HTTP API answers 503 with Retry-After, naming no endpoint. A local disk's own
trouble (a missing file, a file in the way, a full disk) is no outage.

S3 here is a moto server of the test's own, stopped and started again on the same port: moto keeps its objects
in this process, so they survive it, as a real bucket survives a network outage."""

from __future__ import annotations

import errno
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import httpx
import numpy as np
import pyarrow as pa
import pytest
from botocore.exceptions import ClientError
from conftest import serve_api, start_worker, stop_process, wait_for

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.errors import (
    CommitError,
    ConfigurationError,
    CorruptArtifactError,
    CorruptSegmentError,
    StorageUnavailableError,
)
from shoal.index.builder import ShardBuilder
from shoal.index.manifest import Manifest, SegmentEntry
from shoal.index.segment import load_segment
from shoal.log.records import IndexSpec
from shoal.storage import Storage, is_outage
from shoal.workers.base import TRANSIENT
from shoal.workers.names import COMPACT_LOG, MATERIALIZE_SHARD, QUEUE
from shoal.workers.triggers import producer_app

BUCKET = "shoal-outage"
DIM = 4


class OwnS3:
    """A moto S3 server on a fixed loopback port that a test can stop (connections refused) and start again."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        self.host, self.port = self._server.get_host_and_port()
        self.endpoint = f"http://{self.host}:{self.port}"
        self.up = True
        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="test",
                              aws_secret_access_key="test", region_name="us-east-1")
        try:
            client.create_bucket(Bucket=BUCKET)
        except ClientError as exc:  # moto keeps buckets per process: another test of the session made it
            if exc.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    def stop(self) -> None:
        """Take S3 away: every connection to its endpoint is refused from now on."""
        self._server.stop()
        self.up = False

    def start(self) -> None:
        """Bring S3 back on the same endpoint, with every object it held."""
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.up = True


@pytest.fixture
def own_s3() -> Iterator[OwnS3]:
    """A moto S3 server of this test's own (see OwnS3), stopped afterwards."""
    server = OwnS3()
    yield server
    if server.up:
        server.stop()


def _s3_settings(make_settings: Callable[..., Settings], s3: OwnS3, **overrides: object) -> Settings:
    return make_settings(  # type: ignore[no-any-return]
        "local", storage_uri=f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}", s3_endpoint_url=s3.endpoint,
        s3_access_key="test", s3_secret_key="test", **overrides,
    )


def _source_and_index(shoal: Shoal, *, second_upload: bool = True) -> tuple[int, int]:
    """A data source with two uploads (two log segments; the second left out on request) and a flat index over
    it; (source id, shard id)."""
    shoal.create_data_source(DataSourceSpec("src", "1", DIM, {"id": "int64"}, ["id"]))
    index = shoal.create_index(IndexSpec("ix", "1", "src", "1", algorithm="flat", metric="euclidean"))
    shoal.producer("src", "1").upload_columns(np.ones((3, DIM), np.float32), {"id": np.arange(3)})
    if second_upload:
        _second_upload(shoal)
    return shoal.get_data_source("src", "1").id, index.shards[0].id


def _second_upload(shoal: Shoal) -> None:
    shoal.producer("src", "1").upload_columns(np.zeros((2, DIM), np.float32), {"id": np.arange(3, 5)})


def _caught_up(shoal: Shoal) -> bool:
    return all(s.built_watermark == s.head for s in shoal.index_status("ix", "1"))


def _built_segment(shoal: Shoal) -> SegmentEntry:
    """The index segment a first build of the test's index made (its manifest entry)."""
    _, shard_id = _source_and_index(shoal)
    ShardBuilder(shoal.engine, shoal.storage).materialize(shard_id)
    active = shoal.shards.active_version(shard_id)
    assert active is not None
    return Manifest.of(active.manifest).segments[0]


def test_reads_and_writes_of_an_unreachable_s3_are_outages_not_corrupt_files(
    make_settings: Callable[..., Settings], own_s3: OwnS3
) -> None:
    """p17's misreport: an index artifact read while S3 refused connections was a CorruptArtifactError ("cannot
    be read"), and a log segment read a bare OSError. Both are StorageUnavailableError now, which the workers'
    retry map holds, and everything reads again once S3 is back."""
    settings = _s3_settings(make_settings, own_s3)
    with Shoal(settings, notify=False) as shoal:
        entry = _built_segment(shoal)
        spec = shoal.get_index("ix", "1").spec

        own_s3.stop()
        with pytest.raises(StorageUnavailableError, match=r"cannot read .*rows\.parquet: .*NETWORK_CONNECTION"):
            load_segment(shoal.storage, entry, spec)
        with pytest.raises(StorageUnavailableError, match=r"cannot read .*/log/.*\.parquet"):
            shoal.fold("src", "1")
        with pytest.raises(StorageUnavailableError):
            shoal.storage.list_files("tenants")
        # A worker process opens its storage on its first task: an outage then is a ConfigurationError at a
        # startup check (one line naming the endpoint setting) and transient in a task, both at once.
        with pytest.raises(ConfigurationError, match="SHOAL_S3_ENDPOINT_URL") as opening:
            Storage.from_settings(settings)
        assert isinstance(opening.value, StorageUnavailableError), opening.value
        # An upload gives up after its retries; what it gave up on is the outage.
        with pytest.raises(CommitError) as failed:
            shoal.producer("src", "1").upload_columns(np.ones((1, DIM), np.float32), {"id": np.array([9])})
        assert isinstance(failed.value.__cause__, StorageUnavailableError)
        # Transient for the workers: Celery retries it (a ConnectionError, so `except OSError` still holds too).
        assert issubclass(StorageUnavailableError, TRANSIENT) and issubclass(StorageUnavailableError, OSError)
        assert not issubclass(StorageUnavailableError, CorruptArtifactError | CorruptSegmentError)

        own_s3.start()
        assert load_segment(shoal.storage, entry, spec).rows.num_rows == 5
        assert sorted(shoal.fold("src", "1")["id"].to_pylist()) == [0, 1, 2, 3, 4]


def test_a_local_disk_problem_or_a_missing_file_is_no_outage(make_settings: Callable[..., Settings]) -> None:
    """What waiting cannot fix stays what it is: a missing artifact is a CorruptArtifactError naming it, a file
    where a folder should be a plain OSError; so are a full or forbidden local disk, and S3 refusing the
    credentials. S3 not answering, or answering "slow down" or a 5xx, is an outage (pyarrow's own messages)."""
    settings = make_settings("local")
    with Shoal(settings, notify=False) as shoal:
        entry = _built_segment(shoal)
        Path(shoal.storage.path(entry.rows_path)).unlink()
        with pytest.raises(CorruptArtifactError, match=r"rows\.parquet referenced by its manifest is missing"):
            load_segment(shoal.storage, entry, shoal.get_index("ix", "1").spec)

        Path(shoal.storage.path("tenants/in-the-way")).write_text("a file where a folder goes")
        with pytest.raises(OSError) as refused:
            shoal.storage.write_atomic("tenants/in-the-way/x.bin", pa.py_buffer(b"x"))
        assert not isinstance(refused.value, StorageUnavailableError), refused.value

    assert not is_outage(OSError(errno.ENOSPC, "No space left on device"), local=True)
    assert not is_outage(PermissionError(errno.EACCES, "Permission denied"), local=True)
    assert is_outage(OSError(errno.EHOSTDOWN, "Host is down"), local=True)  # a network mount whose server is away
    aws = "When reading information for key 'x/y' in bucket 'b': AWS Error {} during HeadObject operation: no"
    for name, outage in [("NETWORK_CONNECTION", True), ("SLOW_DOWN", True), ("UNKNOWN (HTTP status 503)", True),
                         ("INTERNAL_FAILURE", True), ("ACCESS_DENIED", False), ("INVALID_ACCESS_KEY_ID", False),
                         ("UNKNOWN (HTTP status 400)", False)]:
        assert is_outage(OSError(aws.format(name)), local=False) is outage, name
    assert not is_outage(FileNotFoundError(errno.ENOENT, "Path does not exist"), local=False)


def test_a_worker_retries_its_tasks_while_s3_is_down_and_finishes_them_once_it_is_back(
    make_settings: Callable[..., Settings], own_s3: OwnS3, redis_url: str, worker_catalog: str
) -> None:
    """p16: with S3 refusing connections, materialize_shard and compact_log failed for good on pyarrow's bare
    OSError ("raised unexpected"). They are retried now, and the retries finish them once S3 is back (no beat
    runs: nothing else would queue them again)."""
    settings = _s3_settings(make_settings, own_s3, database_url=worker_catalog, redis_url=redis_url)
    with Shoal(settings, notify=False) as shoal:
        source_id, shard_id = _source_and_index(shoal, second_upload=False)
        app = producer_app(shoal.broker_url())
        worker = start_worker(settings)
        log: Path = worker.log_path  # type: ignore[attr-defined]
        try:
            app.send_task(MATERIALIZE_SHARD, args=[shard_id], queue=QUEUE)
            wait_for(lambda: _caught_up(shoal), 60, "the worker to build the first upload")
            _second_upload(shoal)
            own_s3.stop()
            app.send_task(MATERIALIZE_SHARD, args=[shard_id], queue=QUEUE)
            app.send_task(COMPACT_LOG, args=[source_id], queue=QUEUE)
            for task in ("materialize_shard", "compact_log"):
                wait_for(lambda task=task: re.search(  # type: ignore[misc]
                    rf"{task}\[[^]]+\] retry: Retry in .*StorageUnavailableError", log.read_text()) is not None,
                    60, f"{task} to be retried")
            assert "raised unexpected" not in log.read_text(), log.read_text()
            own_s3.start()
            wait_for(lambda: _caught_up(shoal), 90, "the retried materialization to build the shard")
            wait_for(lambda: re.search(r"compact_log\[[^]]+\] succeeded", log.read_text()) is not None, 90,
                     "the retried compaction to finish")
            assert "raised unexpected" not in log.read_text(), log.read_text()
        finally:
            stop_process(worker)
        assert sorted(shoal.fold("src", "1")["id"].to_pylist()) == [0, 1, 2, 3, 4]


def _unavailable(response: httpx.Response, shape: str, s3: OwnS3) -> None:
    """A 503 with Retry-After in the route's shape, naming neither the S3 endpoint nor pyarrow's error."""
    assert response.status_code == 503, (response.status_code, response.text)
    assert int(response.headers["retry-after"]) > 0
    body = response.json()
    if shape == "vektonn":
        assert body == {"errorMessages": [StorageUnavailableError.PUBLIC]}, body
    else:
        assert body["success"] is False and body["error_code"] == "SERVICE_UNAVAILABLE", body
        assert body["message"] == StorageUnavailableError.PUBLIC, body
    for word in (str(s3.port), "AWS", "curl", "tenants/", "Traceback"):
        assert word not in response.text, (word, response.text)


def _point(i: int, vector: list[float]) -> dict[str, object]:
    return {"attributes": [{"key": "id", "value": {"int64": i}}], "vector": {"isSparse": False, "coordinates": vector}}


def _query(vector: list[float], k: int = 2) -> dict[str, object]:
    return {"k": k, "queryVectors": [{"isSparse": False, "coordinates": vector}]}


def test_uploads_and_first_searches_answer_503_while_s3_is_down(
    make_settings: Callable[..., Settings], own_s3: OwnS3
) -> None:
    """An upload while S3 refused connections answered 500 (the commit gave up on a bare OSError), and a search
    that had to load the index 500 (a CorruptArtifactError). Both answer 503 with Retry-After now, as a catalog
    outage does, in Vektonn's shape and the dataset API's, and work again once S3 is back."""
    settings = _s3_settings(make_settings, own_s3, commit_retries=1)
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with Shoal(settings, notify=False) as shoal, serve_api(settings) as url, \
            httpx.Client(base_url=f"{url}/api/v1", timeout=60) as http:
        assert http.post("/data-sources", json={
            "name": "Docs", "version": "1", "vectorDimension": DIM, "attributeValueTypes": {"id": "int64"},
            "permanentAttributes": ["id"]}).status_code == 201
        assert http.post("/indexes", json={"name": "Docs.Flat", "version": "1", "dataSourceName": "Docs",
                                           "dataSourceVersion": "1", "algorithm": "FaissIndex.L2"}).status_code == 201
        r = http.post("/upload/Docs/1", json=[_point(i, [float(i)] * DIM) for i in range(5)])
        assert r.status_code == 200, r.text
        assert http.post("/datasets", json={"name": "notes", "dimensions": DIM, "index_type": "flat",
                                               "metric_type": "euclidean"}).status_code == 201
        for shard in shoal.get_index("Docs.Flat", "1").shards:
            ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)

        own_s3.stop()
        _unavailable(http.post("/upload/Docs/1", json=[_point(9, [9.0] * DIM)]), "vektonn", own_s3)
        _unavailable(http.post("/search/Docs.Flat/1", json=_query([1.0] * DIM)), "vektonn", own_s3)
        one = {"vectors": [{"id": "x", "values": [0.0] * DIM}]}
        _unavailable(http.post("/datasets/notes/vectors", json=one), "dataset", own_s3)

        own_s3.start()
        r = http.post("/upload/Docs/1", json=[_point(9, [9.0] * DIM)])
        assert r.status_code == 200, r.text
        r = http.post("/search/Docs.Flat/1", json=_query([1.0] * DIM), headers={"X-Shoal-Consistency": "strong"})
        assert r.status_code == 200, r.text
        assert [p["attributes"][0]["value"]["int64"] for p in r.json()[0]["nearestDataPoints"]] == [1, 0]
        assert http.post("/datasets/notes/vectors", json=one).status_code == 200


def test_healthz_says_when_the_storage_cannot_be_reached(
    make_settings: Callable[..., Settings], own_s3: OwnS3
) -> None:
    """While S3 refused connections, every upload, strong search and first load answered 503, and `/healthz` said
    "ok": a probe watching it never saw the storage go. It names the storage among its problems, and drops it once
    S3 is back."""
    from shoal.workers.liveness import STORAGE_SENTENCE

    settings = _s3_settings(make_settings, own_s3)
    with Shoal(settings, notify=False), serve_api(settings) as url, httpx.Client(base_url=url, timeout=60) as http:

        def problems() -> list[str]:
            r = http.get("/healthz")
            assert r.status_code == 200, r.text
            return list(r.json()["problems"])

        assert STORAGE_SENTENCE not in problems()
        own_s3.stop()
        wait_for(lambda: STORAGE_SENTENCE in problems(), 30, "/healthz to name the storage")
        assert http.get("/healthz").json()["status"] == "degraded"
        own_s3.start()
        wait_for(lambda: STORAGE_SENTENCE not in problems(), 30, "/healthz to drop the storage once S3 is back")
