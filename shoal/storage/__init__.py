"""Object storage through pyarrow.fs: a local directory or an S3-compatible bucket, one root for all tenants.

Writes are atomic and durable: locally a temp file is written, fsynced and renamed (and its directory
fsynced); on S3 one PUT publishes the whole object or nothing.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import BinaryIO, TypeVar
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs

from shoal.config.settings import Settings
from shoal.errors import ConfigurationError

T = TypeVar("T")


class Storage:
    """A pyarrow filesystem plus the root under which Shoal's layout lives."""

    def __init__(self, fs: pafs.FileSystem, root: str, *, local: bool) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.local = local

    @classmethod
    def from_settings(cls, settings: Settings) -> Storage:
        """Open the storage the settings name; create the local root or check the bucket exists."""
        uri = settings.resolved_storage_uri
        parsed = urlparse(uri)
        if parsed.scheme == "s3":
            endpoint = urlparse(settings.s3_endpoint_url) if settings.s3_endpoint_url else None
            fs = pafs.S3FileSystem(
                access_key=settings.s3_access_key,
                secret_key=settings.s3_secret_key,
                region=settings.s3_region,
                endpoint_override=endpoint.netloc if endpoint else None,
                scheme=endpoint.scheme if endpoint else "https",
                allow_bucket_creation=False,
            )
            root = f"{parsed.netloc}{parsed.path}".rstrip("/")
            bucket = parsed.netloc
            if fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                raise ConfigurationError(f"S3 bucket {bucket!r} of storage {uri!r} does not exist")
            return cls(fs, root, local=False)
        if parsed.scheme not in ("", "file"):
            raise ConfigurationError(f"unsupported storage URI {uri!r}: use a local path or s3://bucket/prefix")
        path = os.path.abspath(parsed.path if parsed.scheme == "file" else uri)
        os.makedirs(path, exist_ok=True)
        return cls(pafs.LocalFileSystem(), path, local=True)

    def path(self, relative: str) -> str:
        """The full filesystem path of a layout-relative path."""
        return f"{self.root}/{relative}"

    def write_atomic(self, relative: str, data: pa.Buffer) -> None:
        """Publish `data` at `relative` all at once and durably; a crash leaves nothing or a stray temp file."""
        final = self.path(relative)
        parent = str(PurePosixPath(final).parent)
        if not self.local:
            with self.fs.open_output_stream(final) as out:
                out.write(data)
            return
        self.fs.create_dir(parent, recursive=True)
        tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
        try:
            with self.fs.open_output_stream(tmp) as out:
                out.write(data)
            _fsync_path(tmp)
            self.fs.move(tmp, final)
            _fsync_path(parent)  # the rename itself is durable only once the directory is synced
        except BaseException:
            self.delete_quietly(tmp, absolute=True)
            raise

    def write_atomic_with(self, relative: str, produce: Callable[[BinaryIO], T]) -> T:
        """Like `write_atomic`, but `produce(file)` streams the bytes into the temp file; return its result.

        Local storage only: pyarrow's S3 streams publish on close even after an error, so object stores
        must get a finished buffer through `write_atomic`.
        """
        if not self.local:
            raise ValueError("streamed atomic writes need local storage; use write_atomic")
        final = self.path(relative)
        parent = str(PurePosixPath(final).parent)
        self.fs.create_dir(parent, recursive=True)
        tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as out:
                result = produce(out)
                out.flush()
                os.fsync(out.fileno())
            self.fs.move(tmp, final)
            _fsync_path(parent)  # the rename itself is durable only once the directory is synced
        except BaseException:
            self.delete_quietly(tmp, absolute=True)
            raise
        return result

    def read(self, relative: str) -> pa.Buffer:
        """The whole object at `relative`."""
        with self.fs.open_input_file(self.path(relative)) as f:
            return f.read_buffer()

    def exists(self, relative: str) -> bool:
        """True when an object exists at `relative`."""
        return self.fs.get_file_info(self.path(relative)).type == pafs.FileType.File

    def delete_quietly(self, path: str, *, absolute: bool = False) -> None:
        """Delete a file if present; never raises (used for garbage whose deletion is best effort)."""
        try:
            self.fs.delete_file(path if absolute else self.path(path))
        except (OSError, FileNotFoundError):
            pass

    def list_files(self, relative_dir: str) -> list[str]:
        """Layout-relative paths of every file under `relative_dir` (empty when it does not exist)."""
        selector = pafs.FileSelector(self.path(relative_dir), recursive=True, allow_not_found=True)
        prefix = len(self.root) + 1
        return sorted(i.path[prefix:] for i in self.fs.get_file_info(selector) if i.type == pafs.FileType.File)


def _fsync_path(path: str) -> None:
    # pyarrow's local output streams do not fsync; a read-only descriptor of the same inode flushes it.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

