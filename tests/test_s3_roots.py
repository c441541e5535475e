"""Storage roots: one nested in another storage's folders, S3 prefixes with '.' or '..', credentials in a storage
or endpoint URL, an endpoint with a path.

The defects these guard against (session 24, S3 hunt): a deployment whose root lay inside another deployment's
folders lost every file to the other's garbage collection (its marker included); s3://bucket/x/../p was accepted
but S3 listings under it saw nothing (GC never deleted a stray file, stats counted 0 bytes); an s3:// URI or an
endpoint URL carrying credentials was printed in clear by errors, `shoal settings` and `shoal server status`; an
endpoint's path was silently dropped. Real catalogs (the session's and fresh databases) and real storage (a local
directory, and S3 on the session's moto server).
"""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pydantic
import pytest
from conftest import S3_BUCKET, new_database

from shoal import DataSourceSpec, Shoal
from shoal.catalog.db import migrate
from shoal.cli.worker import describe_servers
from shoal.config.settings import Settings
from shoal.errors import ConfigurationError
from shoal.storage import Storage, layout
from shoal.storage.identity import MARKER, read_marker
from shoal.upkeep.drops import release_files
from shoal.upkeep.gc import collect_garbage

DIM = 2
SPEC = DataSourceSpec("src", "1", DIM, {"id": "int64"}, ["id"])
SECRET = "wJalrXUtnSECRETKEY4711"
LATER = dt.timedelta(hours=2)  # past every grace period


@pytest.fixture
def other_db(pg_url: str) -> Iterator[str]:
    """A new, migrated catalog of its own (another deployment's), dropped afterwards."""
    with new_database(pg_url) as url:
        migrate(url)
        yield url


def fill(shoal: Shoal) -> None:
    """A data source with one log segment."""
    shoal.create_data_source(SPEC)
    shoal.producer("src", "1").upload_columns(np.ones((3, DIM), np.float32), {"id": np.arange(3)})


def inside(settings: Settings, folder: str) -> str:
    """A storage URI naming `folder` (layout-relative) of the settings' storage."""
    return f"{settings.storage_uri}/{folder}"


# -- a root nested in another storage -----------------------------------------------------------------------


@pytest.mark.parametrize("same_catalog", [False, True])
def test_a_root_inside_another_storage_is_refused_at_start(
    make_settings: Callable[..., Settings], storage_kind: str, other_db: str, same_catalog: bool
) -> None:
    """The hunt's scenario: A at ROOT, C at ROOT/tenants/{tenant}/indexes. C is refused in one line naming both
    roots, and writes nothing (A's GC would have deleted whatever it wrote), whichever catalog C has."""
    outer = make_settings(storage_kind)
    with Shoal(outer, notify=False) as a:
        fill(a)
        nested_uri = inside(outer, f"tenants/{outer.tenant}/indexes")
        nested = make_settings(storage_kind, storage_uri=nested_uri, tenant=outer.tenant,
                               **({} if same_catalog else {"database_url": other_db}))
        with pytest.raises(ConfigurationError) as refused:
            Shoal(nested, notify=False)
        message = str(refused.value)
        assert "\n" not in message, message
        assert message.startswith(f"storage {nested_uri} lies inside storage {outer.storage_uri} (its {MARKER} is "), \
            message
        assert ("this catalog's own" if same_catalog else f"catalog {a.runtime.catalog_id}'s") in message
        assert "SHOAL_STORAGE_URI" in message
        assert read_marker(Storage.from_settings(nested)) is None
        assert a.fold("src", "1").num_rows == 3


def test_a_root_beside_another_storages_tenants_folder_starts(
    make_settings: Callable[..., Settings], storage_kind: str, other_db: str
) -> None:
    """A root under another storage's root but outside its `tenants/` (s3://b/staging beside s3://b/tenants) is
    no part of what that storage's GC, purges or drops touch: it starts and keeps its data through A's GC."""
    outer = make_settings(storage_kind, gc_grace_s=0)
    with Shoal(outer, notify=False) as a:
        fill(a)
        sibling = make_settings(storage_kind, storage_uri=inside(outer, "staging"), database_url=other_db)
        with Shoal(sibling, notify=False) as b:
            fill(b)
            a.collect_garbage()
            assert b.fold("src", "1").num_rows == 3
        assert a.fold("src", "1").num_rows == 3


@pytest.mark.parametrize("where", ["indexes", "tenant", "dataset"])
def test_gc_spares_a_storage_nested_in_its_folders(
    make_settings: Callable[..., Settings], storage_kind: str, other_db: str, where: str
) -> None:
    """A deployment nested in A's folders that came first (A's storage had no marker yet, as before markers): A
    claims its storage again, and neither its GC nor a dropped folder's release deletes the nested storage's
    marker or files; the nested one reads its data as before. A's own stray file is still collected where no
    nested storage covers it."""
    outer = make_settings(storage_kind, gc_grace_s=0)
    a = Shoal(outer, notify=False)
    try:
        fill(a)
        stray = layout.segment_path(a.tenant, "src", "1", 99, uuid.uuid4())
        a.storage.write_atomic(stray, pa.py_buffer(b"left by a crashed commit"))
        a.storage.delete(MARKER)  # A as a Shoal before markers left its storage
        folder = {
            "indexes": layout.indexes_dir(a.tenant),
            "tenant": f"{layout.ROOT}/{a.tenant}",
            "dataset": layout.dataset_dir(a.tenant, "ds"),
        }[where]
        nested = make_settings(storage_kind, storage_uri=inside(outer, folder), database_url=other_db)
        with Shoal(nested, notify=False) as c:  # started while A's storage had no marker: not refused
            fill(c)
            c_files = c.storage.list_files(layout.ROOT)
            c_marker = read_marker(c.storage)
            assert len(c_files) == 1 and c_marker is not None
            a.close()
            a = Shoal(outer, notify=False)  # claims its storage (its own files are there): its marker written

            result = collect_garbage(a.engine, a.storage, grace_s=0, now=dt.datetime.now(dt.UTC) + LATER)
            if where == "dataset":  # a dropped dataset's folder is released whole
                assert release_files(a.engine, a.storage, folders=[folder]) == 0

            assert c.storage.list_files(layout.ROOT) == c_files and read_marker(c.storage) == c_marker
            assert c.fold("src", "1").num_rows == 3
        assert a.fold("src", "1").num_rows == 3
        # Only a nested storage at the tenant's folder hides A's log folder from the scan.
        assert a.storage.exists(stray) == (where == "tenant"), result
    finally:
        a.close()


# -- '.' and '..' in an S3 prefix ---------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["x/../p", "p/.", "./p", "..", "a/./b"])
def test_an_s3_prefix_with_dot_components_is_refused(
    make_settings: Callable[..., Settings], prefix: str
) -> None:
    """S3 keeps '.' and '..' in keys, but pyarrow's writes resolve them while listings match the prefix as
    written: under s3://bucket/x/../p, GC saw no stray file and stats counted nothing. Refused by the settings
    and when the storage is opened."""
    uri = f"s3://{S3_BUCKET}/{prefix}"
    with pytest.raises(pydantic.ValidationError, match=r"storage_uri\n.*has a '\.' or '\.\.' path component"):
        make_settings("s3", storage_uri=uri)
    with pytest.raises(ConfigurationError) as refused:
        Storage.from_settings(make_settings("s3").model_copy(update={"storage_uri": uri}))
    assert str(refused.value).startswith(f"SHOAL_STORAGE_URI: {uri!r} has a '.' or '..' path component")


def test_a_local_path_with_dot_components_is_resolved(make_settings: Callable[..., Settings], tmp_path: object) -> None:
    """Locally the same components mean one directory: resolved once, in the settings."""
    root = str(tmp_path)
    assert make_settings(storage_uri=f"{root}/a/../b/.").storage_uri == f"{root}/b"
    assert make_settings(storage_uri=f"file://{root}/a/./c/..").storage_uri == f"{root}/a"


# -- credentials in URLs ------------------------------------------------------------------------------------


CREDENTIAL_URLS = {
    "storage_uri": f"s3://AKIAEXAMPLE:{SECRET}@{S3_BUCKET}/p",
    "s3_endpoint_url": f"http://user:{SECRET}@127.0.0.1:9000",
}


@pytest.mark.parametrize("field", sorted(CREDENTIAL_URLS))
def test_credentials_in_a_url_are_refused_without_showing_them(
    make_settings: Callable[..., Settings], field: str
) -> None:
    """pyarrow's s3://ACCESS:SECRET@bucket/prefix, or user:password@ in the endpoint, was accepted and printed
    in clear; now refused by the settings, the storage and every CLI command, the secret in no message."""
    url = CREDENTIAL_URLS[field]
    setting = f"SHOAL_{field.upper()}"
    with pytest.raises(pydantic.ValidationError) as invalid:
        make_settings("s3", **{field: url})
    assert SECRET not in str(invalid.value) and "SHOAL_S3_ACCESS_KEY and SHOAL_S3_SECRET_KEY" in str(invalid.value)
    with pytest.raises(ConfigurationError) as refused:
        Storage.from_settings(make_settings("s3").model_copy(update={field: url}))
    assert SECRET not in str(refused.value) and "cannot carry credentials" in str(refused.value)

    env = make_settings("s3").child_env() | {setting: url}
    for command in (["settings", "--json"], ["server", "status"], ["source", "list"]):
        done = subprocess.run([sys.executable, "-m", "shoal.cli", *command], env=env, capture_output=True,
                              text=True, timeout=120)
        output = done.stdout + done.stderr
        assert done.returncode == 1 and SECRET not in output, (command, output)
        assert f"invalid settings: {field}: " in output and "cannot carry credentials" in output, output


def test_urls_are_shown_masked(make_settings: Callable[..., Settings]) -> None:
    """Should a URL with a password get past the checks (settings built by model_copy), what shows settings
    (`shoal settings`) and the worker's banner masks it."""
    settings = make_settings("s3").model_copy(update=CREDENTIAL_URLS)
    shown = settings.describe()
    assert SECRET not in str(shown)
    assert shown["storage_uri"] == f"s3://AKIAEXAMPLE:***@{S3_BUCKET}/p"
    assert shown["s3_endpoint_url"] == "http://user:***@127.0.0.1:9000"
    banner = describe_servers(settings, "redis://127.0.0.1:1/0")
    assert not any(SECRET in line for line in banner) and f"storage: s3://AKIAEXAMPLE:***@{S3_BUCKET}/p" in banner


# -- the endpoint's path ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("suffix", "what"), [("/some/path", "has a path ('/some/path')"),
                                               ("?region=eu", "has a query or fragment"),
                                               ("/#frag", "has a query or fragment")])
def test_an_endpoint_with_a_path_or_query_is_refused(
    make_settings: Callable[..., Settings], s3_endpoint: str, suffix: str, what: str
) -> None:
    """pyarrow takes the endpoint's host and port only: http://host:port/some/path was accepted and its path
    silently dropped (every request went to the host's root)."""
    url = s3_endpoint + suffix
    with pytest.raises(pydantic.ValidationError, match=r"s3_endpoint_url\n.*SHOAL_S3_ENDPOINT_URL"):
        make_settings("s3", s3_endpoint_url=url)
    with pytest.raises(ConfigurationError) as refused:
        Storage.from_settings(make_settings("s3").model_copy(update={"s3_endpoint_url": url}))
    assert str(refused.value).startswith(f"SHOAL_S3_ENDPOINT_URL {url!r} {what}"), refused.value
    # A bare trailing slash is no path.
    assert Storage.from_settings(make_settings("s3", s3_endpoint_url=s3_endpoint + "/")).root.startswith(S3_BUCKET)
