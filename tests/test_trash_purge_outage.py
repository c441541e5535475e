"""A purge of the trash refused by a storage outage leaves what it did not purge restorable.

`Trash.purge` (`DELETE /api/v1/trash/{id}`, `shoal trash purge --now`) ends the retention of what it purges
first, in a commit of its own, then lists each source's trash folder in the transaction that deletes its rows.
With S3 refusing connections that listing failed: the client was told "retry later" (503), the dataset stayed in
the trash, yet its retention had ended, so its restore answered 404 ("its retention ended ... being purged"). The
purge puts the retention back now: the source stays in the trash as it was, and restores once S3 is back.

S3 is a moto server of the test's own, stopped (connections refused) and started again on the same port, as in
test_storage_outages.py and test_storage_outages2.py (whose helpers this file reuses).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator

import pytest
from conftest import serve_api
from test_storage_outages import OwnS3, _s3_settings, _unavailable
from test_storage_outages2 import _anonymous, _client, _create

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.errors import StorageUnavailableError
from shoal.log.records import IndexSpec
from shoal.storage.layout import trash_dir
from shoal.upkeep.trash import Trash, due_sources


@pytest.fixture
def s3() -> Iterator[OwnS3]:
    """A moto S3 server of this test's own, stopped afterwards."""
    server = OwnS3()
    yield server
    if server.up:
        server.stop()


def test_a_dataset_whose_purge_s3_refused_stays_restorable_and_a_later_purge_deletes_it(
    make_settings: Callable[..., Settings], s3: OwnS3
) -> None:
    """The hunter's sequence: delete (to the trash), purge with S3 refusing connections (503), restore. The
    restore answered 404 since the failed purge had ended the retention; it restores the dataset now, with its
    vectors, and the trash listing shows the retention unchanged meanwhile. A purge once S3 is back deletes."""
    settings = _anonymous(_s3_settings(make_settings, s3))
    with serve_api(settings) as url, _client(settings, url) as http, Shoal(settings, notify=False) as shoal:
        _create(http, "out-ds", ("a", [1.0, 0.0]), ("b", [0.0, 1.0]))
        deleted = http.delete("/datasets/out-ds")
        assert deleted.status_code == 200, deleted.text
        trash_id, purge_after = deleted.json()["trash_id"], deleted.json()["purge_after"]

        s3.stop()
        _unavailable(http.delete("/trash/out-ds"), "dataset", s3)
        listed = http.get("/trash").json()["datasets"]  # the catalog alone answers this
        assert [(d["trash_id"], d["purge_after"]) for d in listed] == [(trash_id, purge_after)], listed

        s3.start()
        restored = http.post("/trash/out-ds/restore")
        assert restored.status_code == 200, restored.text
        assert http.get("/datasets/out-ds").json()["vector_count"] == 2
        assert http.get("/trash").json()["total"] == 0

        # A purge that S3 lets through still deletes, rows and files.
        trash_id = http.delete("/datasets/out-ds").json()["trash_id"]
        folder = trash_dir(settings.tenant, trash_id)
        assert shoal.storage.list_files(folder)
        purged = http.delete("/trash/out-ds")
        assert purged.status_code == 200, purged.text
        assert (purged.json()["purged"], purged.json()["trash_id"]) == (True, trash_id)
        assert http.get("/trash").json()["total"] == 0
        assert http.post("/trash/out-ds/restore").status_code == 404
        assert shoal.storage.list_files(folder) == []


def test_a_purge_now_of_data_sources_s3_refused_puts_their_retention_back(
    make_settings: Callable[..., Settings], s3: OwnS3
) -> None:
    """Data sources (with their indexes) through the catalog's trash, purged all at once as `shoal trash purge
    --now` does (`Trash.purge` over the whole trash): refused by S3, the purge raises the outage and leaves every
    source in the trash with its retention as it was, due to no purge run, restorable once S3 is back; the next
    purge deletes the rest."""
    settings = _s3_settings(make_settings, s3)
    with Shoal(settings, notify=False) as shoal:
        for name in ("first", "second"):
            shoal.create_data_source(DataSourceSpec(name, "1", 2, {"id": "int64"}, ["id"]))
            shoal.create_index(IndexSpec(f"{name}-ix", "1", name, "1", algorithm="flat", metric="euclidean"))
            shoal.producer(name, "1").upload_columns([[0.0, 1.0]], {"id": [1]})
        trash = Trash(shoal.engine, shoal.catalog.tenant_id, shoal.tenant)
        first = trash.soft_delete("first", "1", dt.timedelta(days=1))
        second = trash.soft_delete("second", "1", dt.timedelta(days=1))
        before = {t.id: t.purge_after for t in trash.list()}
        assert set(before) == {first.id, second.id}

        s3.stop()
        with pytest.raises(StorageUnavailableError):
            trash.purge(shoal.storage)
        assert {t.id: t.purge_after for t in trash.list()} == before
        assert due_sources(shoal.engine, list(before)) == []  # beat's run leaves them to their retention

        s3.start()
        trash.restore(first.id)
        assert shoal.get_index("first-ix", "1").source_id == first.id
        assert shoal.fold("first", "1").num_rows == 1

        result = trash.purge(shoal.storage)
        assert [i for _, _, _, i in result.sources] == [second.id]
        assert trash.list() == []
        assert shoal.get_data_source("first", "1").id == first.id
