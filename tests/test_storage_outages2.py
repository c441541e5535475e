"""The rest of the storage outages (see test_storage_outages.py): what listed or looked up files through pyarrow
directly, rather than through `Storage`, raised pyarrow's bare OSError while S3 could not be reached. The dataset
`/stats` route answered 500, a trash purge failed for good (its Celery task was not retried) and a restore's
cleanup of the trash folder raised the bare OSError too. They all meet StorageUnavailableError now: the API answers
503 with Retry-After, the task is retried, and everything works again once S3 is back.

S3 is a moto server of the test's own (test_storage_outages.OwnS3), stopped and started again on the same port;
the one test that needs S3 to fail some requests only puts a small HTTP proxy in front of it, which answers those
with S3's own "503 Slow Down"."""

from __future__ import annotations

import http.client
import re
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import serve_api, start_worker, stop_process, wait_for
from test_storage_outages import OwnS3, _s3_settings, _unavailable

from shoal import Shoal
from shoal.auth import create_key
from shoal.config.settings import Settings
from shoal.errors import StorageUnavailableError
from shoal.index.builder import ShardBuilder
from shoal.storage.layout import trash_dir
from shoal.upkeep import gc_queue as garbage
from shoal.upkeep.drops import release_files
from shoal.upkeep.trash import Trash, purge_due
from shoal.workers.names import PURGE_TRASH, QUEUE
from shoal.workers.triggers import producer_app

API = "/api/v1"


@pytest.fixture
def s3() -> Iterator[OwnS3]:
    """A moto S3 server of this test's own, stopped afterwards."""
    server = OwnS3()
    yield server
    if server.up:
        server.stop()


class FaultyS3:
    """An HTTP proxy in front of an S3 endpoint: it passes every request on, except those `refuse(method, path)`
    picks, which it answers as an overloaded S3 does (503 SlowDown): a real outage of part of the bucket."""

    def __init__(self, upstream: OwnS3) -> None:
        self.refuse: Callable[[str, str], bool] = lambda method, path: False
        self.refused = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the AWS SDK expects

            def _body(self) -> bytes | None:
                """The request's body as it came: by its length, or its chunks as they are (the AWS SDK sends
                some uploads chunked), for the upstream to decode."""
                if "chunked" not in self.headers.get("Transfer-Encoding", ""):
                    length = int(self.headers.get("Content-Length") or 0)
                    return self.rfile.read(length) if length else None
                raw = b""
                while True:
                    line = self.rfile.readline()
                    raw += line
                    size = int(line.split(b";")[0], 16)
                    if size == 0:  # the last chunk, then trailers up to an empty line
                        while (line := self.rfile.readline()) not in (b"\r\n", b"\n", b""):
                            raw += line
                        return raw + line
                    raw += self.rfile.read(size + 2)

            def _pass(self) -> None:
                body = self._body()
                if proxy.refuse(self.command, self.path):
                    proxy.refused += 1
                    error = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(error)
                    return
                conn = http.client.HTTPConnection(upstream.host, upstream.port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
                    answer = conn.getresponse()
                    data = answer.read()
                finally:
                    conn.close()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(key, value)
                # A HEAD answer carries the object's length, and no body.
                self.send_header("Content-Length", answer.getheader("Content-Length", "0") if self.command == "HEAD"
                                 else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _pass

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the proxy."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


def _client(settings: Settings, url: str) -> httpx.Client:
    """A client of the API at `url` with an admin key of the settings' tenant (purges need one)."""
    with Shoal(settings, notify=False) as shoal:
        key = create_key(shoal.engine, settings.tenant, "admin")[1]
    return httpx.Client(base_url=url + API, headers={"Authorization": f"ApiKey {key}"}, timeout=60)


def _anonymous(settings: Settings) -> Settings:
    return settings.model_copy(update={"anonymous_tenant": settings.tenant})


def _create(http: httpx.Client, name: str, *vectors: tuple[str, list[float]]) -> None:
    r = http.post("/datasets", json={"name": name, "dimensions": 2, "metric_type": "euclidean", "index_type": "flat"})
    assert r.status_code == 201, r.text
    if vectors:
        r = http.post(f"/datasets/{name}/vectors", json={"vectors": [{"id": i, "values": v} for i, v in vectors]})
        assert r.status_code == 200, r.text


def test_dataset_stats_answer_503_while_s3_is_down_and_200_once_it_is_back(
    make_settings: Callable[..., Settings], s3: OwnS3
) -> None:
    """`GET /datasets/{id}/stats` listed the index folders with pyarrow itself: with S3 refusing connections it
    answered 500 (a dataset with no vectors yet, whose empty log reads nothing first). 503 with Retry-After now,
    naming no endpoint; the same figures once S3 is back."""
    settings = _anonymous(_s3_settings(make_settings, s3))
    with serve_api(settings) as url, _client(settings, url) as http:
        _create(http, "empty")
        before = http.get("/datasets/empty/stats")
        assert before.status_code == 200, before.text

        s3.stop()
        _unavailable(http.get("/datasets/empty/stats"), "dataset", s3)

        s3.start()
        after = http.get("/datasets/empty/stats")
        assert after.status_code == 200, after.text
        assert (after.json()["vector_count"], after.json()["storage"]) == (0, before.json()["storage"])


def test_dataset_stats_answer_503_when_s3_fails_the_index_files_it_serves(
    make_settings: Callable[..., Settings], s3: OwnS3
) -> None:
    """The memory figure of `/stats` (the bytes of the files serving the index) looked them up with pyarrow
    itself: S3 answering "503 Slow Down" for them (and for them only: the log reads fine) made the route answer
    500. 503 now; the figure once S3 answers again."""
    proxy = FaultyS3(s3)
    try:
        settings = _anonymous(_s3_settings(make_settings, s3).model_copy(update={"s3_endpoint_url": proxy.endpoint}))
        with serve_api(settings) as url, _client(settings, url) as http:
            _create(http, "docs", ("a", [1.0, 0.0]), ("b", [0.0, 1.0]))
            with Shoal(settings, notify=False) as shoal:
                for shard in shoal.get_index("docs", "1").shards:
                    ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
            served = http.get("/datasets/docs/stats")
            assert served.status_code == 200, served.text
            assert served.json()["memory_usage_bytes"] > 0 and served.json()["vector_count"] == 2

            # Looking up an index file's size is a HEAD request; the log's segments are under sources/.
            proxy.refuse = lambda method, path: method == "HEAD" and "/indexes/" in path
            r = http.get("/datasets/docs/stats")
            assert proxy.refused > 0
            assert r.status_code == 503, (r.status_code, r.text)
            assert int(r.headers["retry-after"]) > 0
            assert r.json()["message"] == StorageUnavailableError.PUBLIC, r.text

            proxy.refuse = lambda method, path: False
            r = http.get("/datasets/docs/stats")
            assert r.status_code == 200, r.text
            assert r.json()["memory_usage_bytes"] == served.json()["memory_usage_bytes"]
    finally:
        proxy.close()


def test_purging_a_dataset_while_s3_is_down_answers_503_and_purges_once_it_is_back(
    make_settings: Callable[..., Settings], s3: OwnS3
) -> None:
    """A purge lists the trash folder (the dataset's mirror) in the transaction that deletes the rows: with S3
    refusing connections `DELETE /trash/{id}` answered 500. 503 now, with the dataset still in the trash (the
    transaction rolled back), and purged once S3 is back."""
    settings = _anonymous(_s3_settings(make_settings, s3))
    with serve_api(settings) as url, _client(settings, url) as http, Shoal(settings, notify=False) as shoal:
        _create(http, "docs", ("a", [1.0, 0.0]))
        trash_id = http.delete("/datasets/docs").json()["trash_id"]
        folder = trash_dir(settings.tenant, trash_id)
        assert shoal.storage.list_files(folder), "the soft delete keeps the mirror in the trash folder"

        s3.stop()
        _unavailable(http.delete("/trash/docs"), "dataset", s3)
        assert http.get("/trash").json()["total"] == 1  # the catalog alone answers this

        s3.start()
        r = http.delete("/trash/docs")
        assert r.status_code == 200, r.text
        assert (r.json()["purged"], r.json()["trash_id"]) == (True, trash_id)
        assert http.get("/trash").json()["total"] == 0
        assert shoal.storage.list_files(folder) == []


def test_the_purge_task_is_retried_while_s3_is_down_and_purges_once_it_is_back(
    make_settings: Callable[..., Settings], s3: OwnS3, redis_url: str, worker_catalog: str
) -> None:
    """beat's purge_trash failed for good ("raised unexpected" OSError) when S3 refused connections while it
    listed a due dataset's trash folder. A real worker retries it now, and the retry purges the dataset once S3
    is back."""
    settings = _anonymous(_s3_settings(make_settings, s3, database_url=worker_catalog, redis_url=redis_url,
                                       trash_retention_days=0))  # due at once
    with serve_api(settings) as url, _client(settings, url) as http, Shoal(settings, notify=False) as shoal:
        app = producer_app(shoal.broker_url())
        worker = start_worker(settings)
        log: Path = worker.log_path  # type: ignore[attr-defined]
        try:
            # A first run while S3 is up: the worker opens its storage (opening it during an outage is retried
            # on its own account) and finds nothing due.
            app.send_task(PURGE_TRASH, queue=QUEUE)
            wait_for(lambda: re.search(r"purge_trash\[[^]]+\] succeeded", log.read_text()) is not None, 60,
                     "the first purge_trash to finish")
            _create(http, "docs", ("a", [1.0, 0.0]))
            trash_id = http.delete("/datasets/docs").json()["trash_id"]
            folder = trash_dir(settings.tenant, trash_id)
            assert shoal.storage.list_files(folder)

            s3.stop()
            app.send_task(PURGE_TRASH, queue=QUEUE)
            wait_for(lambda: re.search(r"purge_trash\[[^]]+\] retry: Retry in .*StorageUnavailableError",
                                       log.read_text()) is not None, 60, "purge_trash to be retried")
            assert "raised unexpected" not in log.read_text(), log.read_text()
            assert http.get("/trash").json()["total"] == 1

            s3.start()
            wait_for(lambda: http.get("/trash").json()["total"] == 0, 90, "the retried purge to purge the dataset")
            wait_for(lambda: shoal.storage.list_files(folder) == [], 30, "the purge to delete the trash folder")
            assert "raised unexpected" not in log.read_text(), log.read_text()
        finally:
            stop_process(worker)


def test_releasing_a_restored_datasets_trash_folder_while_s3_is_down_is_an_outage(
    make_settings: Callable[..., Settings], s3: OwnS3
) -> None:
    """A restore ends by giving up the dataset's trash folder (`release_files(folders=...)`), which listed it with
    pyarrow itself: a bare OSError while S3 refused connections. StorageUnavailableError now, with nothing queued
    for deletion; the same call deletes the folder's files once S3 is back."""
    settings = _anonymous(_s3_settings(make_settings, s3))
    with serve_api(settings) as url, _client(settings, url) as http, Shoal(settings, notify=False) as shoal:
        _create(http, "docs", ("a", [1.0, 0.0]))
        trash_id = http.delete("/datasets/docs").json()["trash_id"]
        folder = trash_dir(settings.tenant, trash_id)
        mirror = shoal.storage.list_files(folder)
        assert mirror
        # The restore's catalog step: from here on the trash folder is the restored source's no more.
        Trash(shoal.engine, shoal.catalog.tenant_id, shoal.tenant).restore(trash_id)
        queued = garbage.pending(shoal.engine, tenant=shoal.tenant)

        s3.stop()
        with pytest.raises(StorageUnavailableError, match=rf"cannot list {re.escape(folder)}"):
            release_files(shoal.engine, shoal.storage, folders=[folder])
        assert garbage.pending(shoal.engine, tenant=shoal.tenant) == queued

        s3.start()
        assert release_files(shoal.engine, shoal.storage, folders=[folder]) == len(mirror)
        assert shoal.storage.list_files(folder) == []


def test_a_dataset_deleted_while_s3_is_down_is_deleted_and_says_so(
    make_settings: Callable[..., Settings], s3: OwnS3
) -> None:
    """A soft delete commits to the catalog, then gives up the dataset's metadata mirror on storage: with S3 away
    that step failed the request after the delete had committed, so the client was told it failed and its retry
    found the dataset gone (404). The delete answers 200 now; the mirror goes once S3 is back (GC)."""
    settings = _anonymous(_s3_settings(make_settings, s3))
    with serve_api(settings) as url, _client(settings, url) as http:
        _create(http, "docs")
        s3.stop()
        deleted = http.delete("/datasets/docs")
        assert deleted.status_code == 200, deleted.text
        s3.start()
        assert http.get("/datasets/docs").status_code == 404
        trash = http.get("/trash")
        assert trash.status_code == 200, trash.text
        assert [t["name"] for t in trash.json()["datasets"]] == ["docs"], trash.text


def test_a_dataset_restored_while_s3_is_down_is_restored_and_says_so(
    make_settings: Callable[..., Settings], s3: OwnS3
) -> None:
    """A restore commits to the catalog, then counted the dataset's vectors by reading its log: with S3 away
    that step failed the request (503) after the restore had committed, so the client was told it failed and its
    retry found the trash empty (404). The restore answers 200 with the dataset now (its vector count the
    catalog's); once S3 is back it counts and searches as before the delete."""
    settings = _anonymous(_s3_settings(make_settings, s3))
    with serve_api(settings) as url, _client(settings, url) as http:
        _create(http, "docs", ("a", [1.0, 0.0]), ("b", [0.0, 1.0]))
        assert http.delete("/datasets/docs").status_code == 200

        s3.stop()
        restored = http.post("/trash/docs/restore")
        assert restored.status_code == 200, restored.text
        assert (restored.json()["name"], restored.json()["dimensions"], restored.json()["vector_count"]) == (
            "docs", 2, 2), restored.text
        assert http.get("/trash").json()["total"] == 0  # the catalog alone answers this

        s3.start()
        assert http.get("/datasets/docs").json()["vector_count"] == 2
        found = http.post("/datasets/docs/search", json={"vector": [0.0, 1.0], "top_k": 2, "consistency": "strong"})
        assert found.status_code == 200, found.text
        assert [r["id"] for r in found.json()["results"]] == ["b", "a"]


def test_a_dataset_purged_while_s3_fails_its_file_deletions_is_purged_and_says_so(
    make_settings: Callable[..., Settings], s3: OwnS3
) -> None:
    """A purge deletes the dataset's rows (listing its trash folder in that transaction), then its files: with
    S3 failing the deletions ("503 Slow Down") that step failed the request after the purge had committed, so
    the client was told it failed and its retry found the trash empty (404). The purge answers 200 now; the
    files, still queued, go with the next purge run once S3 answers again."""
    proxy = FaultyS3(s3)
    try:
        settings = _anonymous(_s3_settings(make_settings, s3).model_copy(update={"s3_endpoint_url": proxy.endpoint}))
        with serve_api(settings) as url, _client(settings, url) as http, Shoal(settings, notify=False) as shoal:
            _create(http, "docs", ("a", [1.0, 0.0]))
            trash_id = http.delete("/datasets/docs").json()["trash_id"]
            folder = trash_dir(settings.tenant, trash_id)
            assert shoal.storage.list_files(folder)

            proxy.refuse = lambda method, path: method == "DELETE" or (method == "POST" and "?delete" in path)
            purged = http.delete("/trash/docs")
            assert proxy.refused > 0
            assert purged.status_code == 200, purged.text
            assert (purged.json()["purged"], purged.json()["trash_id"]) == (True, trash_id)
            assert http.get("/trash").json()["total"] == 0
            assert http.get("/datasets/docs").status_code == 404

            proxy.refuse = lambda method, path: False
            purge_due(shoal.engine, shoal.storage)  # what beat's purge_trash task runs
            assert shoal.storage.list_files(folder) == []
    finally:
        proxy.close()
