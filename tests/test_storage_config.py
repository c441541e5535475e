"""Storage configuration: a misconfigured storage stops startup with one line naming the setting to fix (never a
secret), local storage URIs mean one absolute directory, and a log segment the catalog references but storage
lost is a CorruptSegmentError like a damaged one."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pydantic
import pytest
from conftest import S3_BUCKET, free_port

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.errors import ConfigurationError, CorruptSegmentError
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec
from shoal.storage import Storage

SECRET = "s3cr3t-never-shown-4711"


def refusal(settings: Settings) -> str:
    """The one-line ConfigurationError opening the settings' storage gives."""
    with pytest.raises(ConfigurationError) as caught:
        Storage.from_settings(settings)
    message = str(caught.value)
    assert "\n" not in message and SECRET not in message, message
    return message


@pytest.fixture
def s3_settings(make_settings: Callable[..., Settings]) -> Callable[..., Settings]:
    """S3 settings on the test server, with the given fields changed (bypassing validation, as code may)."""

    def make(**changes: object) -> Settings:
        return make_settings("s3").model_copy(update=changes)

    return make


# -- misconfigured storage --------------------------------------------------------------------------------


def test_an_unreachable_endpoint_names_the_endpoint_setting(s3_settings: Callable[..., Settings]) -> None:
    message = refusal(s3_settings(s3_endpoint_url=f"http://127.0.0.1:{free_port()}", s3_secret_key=SECRET))
    assert "SHOAL_S3_ENDPOINT_URL" in message and "NETWORK_CONNECTION" in message


def test_an_endpoint_without_a_scheme_names_the_endpoint_setting(
    s3_settings: Callable[..., Settings], s3_endpoint: str
) -> None:
    bare = s3_endpoint.removeprefix("http://")
    message = refusal(s3_settings(s3_endpoint_url=bare))
    assert message.startswith(f"SHOAL_S3_ENDPOINT_URL '{bare}' is not an http:// or https:// URL"), message


@pytest.mark.parametrize("missing", ["s3_secret_key", "s3_access_key"])
def test_half_of_the_credentials_is_refused(s3_settings: Callable[..., Settings], missing: str) -> None:
    given = {"s3_access_key": "test", "s3_secret_key": SECRET} | {missing: None}
    message = refusal(s3_settings(**given))
    assert "SHOAL_S3_ACCESS_KEY and SHOAL_S3_SECRET_KEY go together" in message


def test_a_missing_bucket_is_named(s3_settings: Callable[..., Settings]) -> None:
    assert refusal(s3_settings(storage_uri="s3://no-such-bucket/p")) == (
        "S3 bucket 'no-such-bucket' of storage 's3://no-such-bucket/p' does not exist"
    )


@pytest.mark.parametrize("uri", [f"s3://{S3_BUCKET}//p", f"s3://{S3_BUCKET}/p//q", "s3:///p", f"s3://{S3_BUCKET}//"])
def test_a_malformed_s3_uri_is_refused_at_startup(
    s3_settings: Callable[..., Settings], make_settings: Callable[..., Settings], uri: str
) -> None:
    # They were accepted, then every upload failed with a raw ArrowInvalid.
    assert refusal(s3_settings(storage_uri=uri)).startswith(f"SHOAL_STORAGE_URI: {uri!r}")
    with pytest.raises(pydantic.ValidationError, match="storage_uri"):
        make_settings("s3", storage_uri=uri)


def test_a_storage_uri_that_is_a_file_is_refused(make_settings: Callable[..., Settings], tmp_path: Path) -> None:
    file = tmp_path / "a-file"
    file.write_text("not a directory")
    message = refusal(make_settings(storage_uri=str(file)))
    assert message == f"SHOAL_STORAGE_URI: cannot use {file} as the storage directory: it is not a directory"


def test_a_data_dir_that_is_a_file_is_named(make_settings: Callable[..., Settings], tmp_path: Path) -> None:
    file = tmp_path / "a-file"
    file.write_text("not a directory")
    message = refusal(make_settings(data_dir=file, storage_uri=None))
    assert message.startswith(f"SHOAL_DATA_DIR: cannot use {file / 'storage'} as the storage directory"), message


@pytest.mark.parametrize("command", [["source", "list"], ["api", "--port", "1"]])
def test_the_cli_says_it_in_one_line(make_settings: Callable[..., Settings], tmp_path: Path,
                                     command: list[str]) -> None:
    """A command, `shoal api` included (its storage was opened inside uvicorn's startup: a traceback), refuses
    a misconfigured storage in one line, before serving anything."""
    file = tmp_path / "a-file"
    file.write_text("not a directory")
    settings = make_settings(storage_uri=str(file))
    result = subprocess.run([sys.executable, "-m", "shoal.cli", *command], env=settings.child_env(),
                            capture_output=True, text=True, timeout=120)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 1
    assert lines == [f"error: SHOAL_STORAGE_URI: cannot use {file} as the storage directory: it is not a directory"]


# -- local storage URIs -----------------------------------------------------------------------------------


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A home directory and a working directory of the test's own."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    yield tmp_path


@pytest.mark.parametrize(("uri", "where"), [
    ("~/vectors", "home/vectors"),
    ("relative/vectors", "work/relative/vectors"),
    ("file://{root}/my%20dir", "my dir"),
    ("file://localhost{root}/local", "local"),
    ("{root}/plain%20name", "plain%20name"),  # a plain path is taken as written
])
def test_local_storage_uris_mean_one_absolute_directory(
    make_settings: Callable[..., Settings], elsewhere: Path, uri: str, where: str
) -> None:
    settings = make_settings(storage_uri=uri.format(root=elsewhere))
    expected = str(elsewhere.resolve() / where)
    assert settings.storage_uri == expected  # so every process, whatever its cwd, means the same directory
    storage = Storage.from_settings(settings)
    assert storage.root == expected and Path(expected).is_dir()


def test_a_file_uri_naming_another_host_is_refused(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    uri = f"file://otherhost{tmp_path}/x"
    with pytest.raises(pydantic.ValidationError, match=r"storage_uri\n.*names host 'otherhost'"):
        make_settings(storage_uri=uri)
    message = refusal(make_settings().model_copy(update={"storage_uri": uri}))
    assert message.startswith(f"SHOAL_STORAGE_URI: {uri!r} names host 'otherhost'"), message
    assert not (tmp_path / "x").exists()


# -- a lost log segment -----------------------------------------------------------------------------------


@pytest.fixture
def made(make_settings: Callable[..., Settings], storage_kind: str) -> Iterator[Shoal]:
    """A Shoal queueing no Celery work, on a fresh tenant, once per storage kind."""
    client = Shoal(make_settings(storage_kind), notify=False)
    yield client
    client.close()


def test_a_deleted_log_segment_is_a_corrupt_segment(made: Shoal) -> None:
    made.create_data_source(DataSourceSpec("Src", "1", 2, {"id": "int64"}, ["id"]))
    producer = made.producer("Src", "1")
    producer.upload_columns(np.zeros((2, 2), np.float32), {"id": np.array([1, 2])})
    producer.upload_columns(np.ones((1, 2), np.float32), {"id": np.array([1])})
    index = made.create_index(IndexSpec("Src.Index", "1", "Src", "1", algorithm="FaissIndex.L2"))
    for shard in index.shards:
        ShardBuilder(made.engine, made.storage).materialize(shard.id)
    lost = made.log_segments("Src", "1")[0].path
    made.storage.fs.delete_file(made.storage.path(lost))
    missing = f"segment {lost} referenced by the catalog is missing"
    with pytest.raises(CorruptSegmentError, match=missing):
        made.fold("Src", "1")
    with pytest.raises(CorruptSegmentError, match=missing):
        made.compact("Src", "1")
