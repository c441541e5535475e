"""Object storage through pyarrow.fs: a local directory or an S3-compatible bucket, one root for all tenants.

Writes are atomic and durable: locally a temp file is written, fsynced and renamed (and its directory
fsynced); on S3 one PUT publishes the whole object or nothing.
"""

from __future__ import annotations

import datetime as dt
import errno
import logging
import os
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, BinaryIO, TypeVar
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs

from shoal.config.settings import Settings, check_s3_endpoint_url, mask_url, storage_location
from shoal.errors import ConfigurationError, StorageUnavailableError, StorageUnreachableError

T = TypeVar("T")
log = logging.getLogger(__name__)

# pyarrow raises a plain OSError for every S3 failure; its message names the AWS SDK's error ("AWS Error
# NETWORK_CONNECTION during HeadObject operation: ...", "AWS Error UNKNOWN (HTTP status 503) during ...").
_AWS_ERROR = re.compile(r"AWS Error (\w+)(?: \(HTTP status (\d+)\))?")
# The errors that mean S3 was not reached or said "try again": an outage, retried. A missing bucket or refused
# credentials (below) are a setting or permission an operator must fix: StorageRefusedError. Any other error
# stays the OSError it is.
_AWS_OUTAGES = frozenset({
    "NETWORK_CONNECTION", "REQUEST_TIMEOUT", "SERVICE_UNAVAILABLE", "SLOW_DOWN", "THROTTLING", "INTERNAL_FAILURE",
})
# The AWS SDK's names (as pyarrow prints them) for credentials S3 refuses: denied, unknown, wrongly signed.
_AWS_CREDENTIALS = frozenset({
    "ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "INVALID_SIGNATURE",
    "INCOMPLETE_SIGNATURE", "INVALID_CLIENT_TOKEN_ID", "MISSING_AUTHENTICATION_TOKEN", "UNRECOGNIZED_CLIENT",
})
_AWS_NO_BUCKET = "NO_SUCH_BUCKET"
# What a network filesystem (NFS, SMB, a FUSE-mounted bucket) answers while its server is away, beyond what
# Python already makes a ConnectionError or TimeoutError. A local disk that is full (ENOSPC), read-only or
# forbids access (EACCES), or a file where a directory should be, is no outage: waiting does not fix it.
_NETWORK_ERRNOS = frozenset({
    errno.ETIMEDOUT, errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENETDOWN, errno.ENETUNREACH, errno.ENOTCONN,
    errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED,
})
# How many times a local write makes its folder again when the folder was removed (by GC, once empty) between
# its creation and the opening of the temp file in it: each retry means a removal landed right then. A GC run
# removes each folder of the chain above a file once, so even several runs at once stay well within this.
FOLDER_ATTEMPTS = 20
# Answers about a path, never about reaching the storage.
_PATH_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)


def is_outage(exc: BaseException, *, local: bool) -> bool:
    """True when `exc`, raised by the storage's filesystem, means the storage cannot be reached right now (see
    StorageUnavailableError): a connection refused or lost, a timeout, an S3 5xx or throttling. False for a
    missing path, a refused permission or credential, a full or read-only disk."""
    if isinstance(exc, ConnectionError | TimeoutError):  # StorageUnavailableError included
        return True
    if not isinstance(exc, OSError) or isinstance(exc, _PATH_ERRORS):
        return False
    if exc.errno in _NETWORK_ERRNOS:
        return True
    if local:
        return False
    text = str(exc)
    if "curlCode" in text:  # the HTTP client's own failure: no answer from S3 at all
        return True
    found = _AWS_ERROR.search(text)
    if found is None:
        return False
    name, status = found.groups()
    # An error the SDK has no name for is told by its HTTP status: 5xx, 429 (too many requests), 0 (no answer).
    return name in _AWS_OUTAGES or (status is not None and (status in ("0", "429") or status.startswith("5")))


class StorageRefusedError(ConfigurationError, OSError):
    """The storage answers, but refuses every request until an operator acts: its bucket does not exist (deleted
    while Shoal runs) or it refuses the credentials. What `Storage.from_settings` refuses at start-up, met by a
    running process: a ConfigurationError, so the HTTP API answers 503 with this message, which names the problem
    and the settings to check but no bucket or object key (the log has those, and so has `detail`), and no commit
    or task retries it. An OSError, as pyarrow's error was, so every `except OSError` still catches it."""

    NO_BUCKET = (
        "the storage bucket does not exist (it was deleted, or SHOAL_STORAGE_URI names another): nothing was "
        "written; an operator must create the bucket or fix SHOAL_STORAGE_URI"
    )
    CREDENTIALS = (
        "the storage refused the credentials (access denied, an unknown key or a wrong signature): nothing was "
        "written; an operator must fix SHOAL_S3_ACCESS_KEY and SHOAL_S3_SECRET_KEY (or the AWS credential chain) "
        "or the bucket's policy"
    )

    def __init__(self, message: str, *, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


def refusal(exc: BaseException) -> str | None:
    """StorageRefusedError's message for an error of pyarrow's S3 filesystem that means its bucket does not exist
    or S3 refuses the credentials; None for any other error."""
    found = _AWS_ERROR.search(str(exc)) if isinstance(exc, OSError) else None
    if found is None:
        return None
    name, status = found.groups()
    if name == _AWS_NO_BUCKET:
        return StorageRefusedError.NO_BUCKET
    # An error the SDK has no name for is told by its HTTP status: 403 is S3 refusing who asks.
    if name in _AWS_CREDENTIALS or status == "403":
        return StorageRefusedError.CREDENTIALS
    return None


def _s3_filesystem(**options: Any) -> pafs.S3FileSystem:
    """pyarrow's S3 filesystem with `options`, opening its output streams on the first part or on close: a file
    smaller than one part (every log segment and manifest) is then one PutObject, as DESIGN's commit says, not a
    multipart upload's three requests (which also leave a billed, unfinished upload behind a writer that dies
    before it completes). A pyarrow too old for `allow_delayed_open` writes every file as a multipart upload."""
    try:
        return pafs.S3FileSystem(**options, allow_delayed_open=True)
    except TypeError:  # the option is unknown to this pyarrow
        return pafs.S3FileSystem(**options)


@dataclass(frozen=True)
class StoredFile:
    """A file in the storage: its layout-relative path, its size in bytes and when it was last written (None
    when the storage does not say)."""

    path: str
    size: int
    mtime: dt.datetime | None


class Storage:
    """A pyarrow filesystem plus the root under which Shoal's layout lives. Everything outside this package goes
    through its methods, never `fs` itself: they raise StorageUnavailableError when the storage cannot be
    reached, and StorageRefusedError when its S3 bucket is gone or S3 refuses the credentials (pyarrow raises a
    plain OSError)."""

    def __init__(self, fs: pafs.FileSystem, root: str, *, local: bool) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.local = local

    @classmethod
    def from_settings(cls, settings: Settings) -> Storage:
        """Open the storage the settings name; create the local root or check the bucket can be reached.

        Any misconfiguration (a malformed URI, an endpoint, credentials or bucket S3 refuses, a local root that
        cannot be a directory) is a ConfigurationError naming the setting to fix, never showing a secret.
        """
        uri = settings.resolved_storage_uri
        # SHOAL_DATA_DIR places the storage when SHOAL_STORAGE_URI is unset.
        setting = "SHOAL_STORAGE_URI" if settings.storage_uri else "SHOAL_DATA_DIR"
        try:
            # Settings read from the environment are normalized already; ones built by model_copy are not.
            location = storage_location(uri)
        except ValueError as exc:
            raise ConfigurationError(f"{setting}: {exc}") from None
        if urlparse(location).scheme == "s3":
            return cls._open_s3(settings, location)
        try:
            os.makedirs(location, exist_ok=True)
        except OSError as exc:
            problem = "it is not a directory" if os.path.exists(location) else exc.strerror or str(exc)
            raise ConfigurationError(f"{setting}: cannot use {location} as the storage directory: {problem}") from None
        return cls(pafs.LocalFileSystem(), location, local=True)

    @classmethod
    def _open_s3(cls, settings: Settings, uri: str) -> Storage:
        """The S3 storage of `uri` (checked by storage_location), once its bucket answered."""
        parsed = urlparse(uri)
        bucket = parsed.netloc
        if bool(settings.s3_access_key) != bool(settings.s3_secret_key):
            raise ConfigurationError(
                "SHOAL_S3_ACCESS_KEY and SHOAL_S3_SECRET_KEY go together: set both, or neither for the AWS "
                "default credential chain"
            )
        endpoint = None
        if settings.s3_endpoint_url:
            try:
                # Settings read from the environment are checked already; ones built by model_copy are not.
                endpoint = urlparse(check_s3_endpoint_url(settings.s3_endpoint_url))
            except ValueError as exc:
                raise ConfigurationError(str(exc)) from None
        try:
            fs = _s3_filesystem(
                access_key=settings.s3_access_key,
                secret_key=settings.s3_secret_key,
                region=settings.s3_region,
                endpoint_override=endpoint.netloc if endpoint else None,
                scheme=endpoint.scheme if endpoint else "https",
                allow_bucket_creation=False,
            )
            found = fs.get_file_info(bucket).type != pafs.FileType.NotFound
        except (OSError, ValueError, pa.ArrowException) as exc:
            # An endpoint that does not answer may be a wrong URL or an outage: refused at startup as either,
            # retried by a task (StorageUnreachableError is both); refused credentials are only a setting.
            unreachable = isinstance(exc, OSError) and is_outage(exc, local=False)
            raise (StorageUnreachableError if unreachable else ConfigurationError)(
                _s3_problem(settings, uri, exc)) from None
        if not found:
            raise ConfigurationError(f"S3 bucket {bucket!r} of storage {mask_url(uri)!r} does not exist")
        return cls(fs, f"{bucket}{parsed.path}".rstrip("/"), local=False)

    def path(self, relative: str) -> str:
        """The full filesystem path of a layout-relative path."""
        return f"{self.root}/{relative}"

    @contextmanager
    def _reaching(self, action: str, *, refusals: bool = True) -> Iterator[None]:
        """Raise an OSError of the block that means the storage is unreachable (`is_outage`) as
        StorageUnavailableError naming `action` and the reason; with `refusals`, one that means the S3 bucket is
        gone or S3 refuses the credentials as StorageRefusedError (the reason logged); every other error as it
        is."""
        try:
            yield
        except (StorageUnavailableError, StorageRefusedError):
            raise
        except OSError as exc:
            failure = self._failure(exc, action, refusals=refusals)
            if failure is None:
                raise
            raise failure from exc

    def _failure(self, exc: OSError, action: str, *, refusals: bool) -> OSError | None:
        """The error to raise for `exc`, met while trying to `action`: StorageUnavailableError, or (with
        `refusals`) StorageRefusedError; None to raise `exc` as it is."""
        if is_outage(exc, local=self.local):
            reason = " ".join(str(exc).split()) or type(exc).__name__
            return StorageUnavailableError(f"storage unavailable: cannot {action}: {reason}")
        if self.local or not refusals:
            return None
        if isinstance(exc, FileNotFoundError):
            return self._missing_bucket(action)
        message = refusal(exc)
        return None if message is None else self._refused(message, action, " ".join(str(exc).split()))

    def _missing_bucket(self, action: str) -> OSError | None:
        """StorageRefusedError when the S3 bucket is gone, StorageUnavailableError when S3 cannot say; None
        when the bucket is there (a missing object is only that)."""
        # S3 answers a HEAD of an object in a bucket that is gone with a bare 404, as for a missing object (a HEAD
        # has no body to name the error): only the bucket itself tells the two apart. One more request, made only
        # when an object was missing.
        bucket = self.root.split("/", 1)[0]
        try:
            gone = self.fs.get_file_info(bucket).type == pafs.FileType.NotFound
        except OSError as exc:  # an outage now is one; any other answer says nothing of the bucket
            return self._failure(exc, f"{action} (looking up its bucket)", refusals=False)
        if not gone:
            return None
        return self._refused(StorageRefusedError.NO_BUCKET, action, f"S3 bucket {bucket!r} does not exist")

    def _refused(self, message: str, action: str, reason: str) -> StorageRefusedError:
        detail = f"cannot {action}: {reason}"
        # The public message names no bucket or key: the operator finds them here.
        log.error("storage refused: %s", detail)
        return StorageRefusedError(message, detail=detail)

    def write_atomic(self, relative: str, data: pa.Buffer) -> None:
        """Publish `data` at `relative` all at once and durably; a crash leaves nothing or a stray temp file.
        StorageUnavailableError when the storage cannot be reached."""
        with self._reaching(f"write {relative}"):
            self._write_atomic(relative, data)

    def _write_atomic(self, relative: str, data: pa.Buffer) -> None:
        final = self.path(relative)
        parent = str(PurePosixPath(final).parent)
        if not self.local:
            with self.fs.open_output_stream(final) as out:
                out.write(data)
            return
        tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
        try:
            with self._open_in_folder(parent, lambda: self.fs.open_output_stream(tmp)) as out:
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
        with self._reaching(f"write {relative}"):
            return self._write_atomic_with(relative, produce)

    def _write_atomic_with(self, relative: str, produce: Callable[[BinaryIO], T]) -> T:
        final = self.path(relative)
        parent = str(PurePosixPath(final).parent)
        tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
        try:
            with self._open_in_folder(parent, lambda: open(tmp, "wb")) as out:
                result = produce(out)
                out.flush()
                os.fsync(out.fileno())
            self.fs.move(tmp, final)
            _fsync_path(parent)  # the rename itself is durable only once the directory is synced
        except BaseException:
            self.delete_quietly(tmp, absolute=True)
            raise
        return result

    def _open_in_folder(self, parent: str, open_file: Callable[[], T]) -> T:
        """Create the local folder `parent` (and those above it) and open a new file in it with `open_file`.

        GC removes a folder once its last file is gone (`remove_empty_dir`), and a new owner of the same name may
        write into it meanwhile: the folder can vanish between its creation and the open (FileNotFoundError), or
        while pyarrow makes it, between its mkdir finding it there and its check that it is a directory
        (FileExistsError: "non-directory entry exists"). Then it is made again, a few times at most (a file where
        the folder should be stays an error); a file opened in it keeps it from being removed."""
        attempt = 1
        while True:
            try:
                self.fs.create_dir(parent, recursive=True)
                return open_file()
            except (FileNotFoundError, FileExistsError):
                if attempt >= FOLDER_ATTEMPTS:
                    raise
                attempt += 1

    def read(self, relative: str) -> pa.Buffer:
        """The whole object at `relative`: FileNotFoundError when there is none, StorageUnavailableError when the
        storage cannot be reached, StorageRefusedError when its S3 bucket is gone (never FileNotFoundError then)
        or S3 refuses the credentials, any other OSError (a local permission, a disk error) as it is."""
        with self._reaching(f"read {relative}"), self.fs.open_input_file(self.path(relative)) as f:
            return f.read_buffer()

    def exists(self, relative: str) -> bool:
        """True when an object exists at `relative` (StorageUnavailableError when the storage cannot say)."""
        with self._reaching(f"look up {relative}"):
            return self.fs.get_file_info(self.path(relative)).type == pafs.FileType.File

    def enclosing_files(self, name: str) -> list[str]:
        """The full paths of the files called `name` in the folders enclosing the root (its parent, the parent's
        parent, ... up to the bucket or the filesystem root), nearest first: one lookup per folder.

        A folder the storage refuses to look into (an S3 policy granting only this root's prefix) is skipped:
        nothing can be said about it. StorageUnavailableError when the storage cannot be reached."""
        found: list[str] = []
        for folder in PurePosixPath(self.root).parents:
            if str(folder) == ".":  # above an S3 bucket: nothing
                break
            candidate = str(folder / name)
            try:
                # A folder above the root may be refused where the root is not: no StorageRefusedError.
                with self._reaching(f"look up {candidate}", refusals=False):
                    if self.fs.get_file_info(candidate).type == pafs.FileType.File:
                        found.append(candidate)
            except StorageUnavailableError:
                raise
            except OSError:  # refused (ACCESS_DENIED), or not a folder one may look into
                continue
        return found

    def delete_quietly(self, path: str, *, absolute: bool = False) -> None:
        """Delete a file if present; never raises (used for garbage whose deletion is best effort)."""
        try:
            self.fs.delete_file(path if absolute else self.path(path))
        except (OSError, FileNotFoundError):
            pass

    def remove_empty_dir(self, relative_dir: str) -> bool:
        """Remove the folder `relative_dir` if it holds nothing: locally an empty directory, on S3 the directory
        marker object pyarrow writes when it deletes a folder's last file (removing it writes the parent's marker
        when the parent holds nothing else). True when removed; a folder with anything in it, or none there,
        stays (False). Locally the removal itself refuses a non-empty directory, and a write into a folder
        removed meanwhile makes it again (`write_atomic`). On S3 a listing checks first and pyarrow removes a
        marker only with every object under it, so call it only for a folder nothing writes into any more (an
        object written between the two would go with the marker)."""
        full = self.path(relative_dir)
        if self.local:
            try:
                os.rmdir(full)
            except OSError:  # not empty, or gone already
                return False
            return True
        with self._reaching(f"remove the folder {relative_dir}"):
            if self.fs.get_file_info(pafs.FileSelector(full, recursive=False, allow_not_found=True)):
                return False
            try:
                self.fs.delete_dir(full)
            except FileNotFoundError:
                return False
        return True

    def delete(self, relative: str) -> bool:
        """Delete the file at `relative`; False when it was already gone. StorageUnavailableError when the
        storage cannot be reached, any other OSError (a permission, a disk error) as it is."""
        with self._reaching(f"delete {relative}"):
            try:
                # Not asked first: pyarrow asks itself (on S3 a HEAD, the DELETE, then a PUT of the folder's marker).
                self.fs.delete_file(self.path(relative))
            except FileNotFoundError:
                return False
        return True

    def list_files(self, relative_dir: str) -> list[str]:
        """Layout-relative paths of every file under `relative_dir` (empty when it does not exist;
        StorageUnavailableError when the storage cannot be reached)."""
        return [f.path for f in self.describe_files(relative_dir)]

    def describe_files(self, relative_dir: str) -> list[StoredFile]:
        """Every file anywhere under `relative_dir` with its size and mtime, by path (empty when the folder does
        not exist; StorageUnavailableError when the storage cannot be reached)."""
        selector = pafs.FileSelector(self.path(relative_dir), recursive=True, allow_not_found=True)
        prefix = len(self.root) + 1
        with self._reaching(f"list {relative_dir}"):
            infos = self.fs.get_file_info(selector)
        return sorted(
            (StoredFile(i.path[prefix:], int(i.size or 0), i.mtime) for i in infos if i.type == pafs.FileType.File),
            key=lambda f: f.path,
        )

    def holds_files(self, relative_dir: str) -> bool:
        """True when any file lies under `relative_dir`. Folder by folder, stopping at the first file: a full
        listing of a big bucket takes minutes, and empty folders (left by drops) hold nothing anyone could lose.
        StorageUnavailableError when the storage cannot be reached."""
        pending = [self.path(relative_dir)]
        while pending:
            selector = pafs.FileSelector(pending.pop(), recursive=False, allow_not_found=True)
            with self._reaching(f"list {relative_dir}"):
                infos = self.fs.get_file_info(selector)
            if any(info.type == pafs.FileType.File for info in infos):
                return True
            pending += [info.path for info in infos if info.type == pafs.FileType.Directory]
        return False

    def subfolders(self, relative_dir: str) -> list[str]:
        """The names of the folders right inside `relative_dir`, sorted (empty when it does not exist;
        StorageUnavailableError when the storage cannot be reached)."""
        selector = pafs.FileSelector(self.path(relative_dir), recursive=False, allow_not_found=True)
        with self._reaching(f"list {relative_dir}"):
            infos = self.fs.get_file_info(selector)
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)

    def file_sizes(self, relatives: Sequence[str]) -> dict[str, int]:
        """The size in bytes of each of the files `relatives` that exists (a missing one is left out);
        StorageUnavailableError when the storage cannot be reached."""
        if not relatives:
            return {}
        with self._reaching(f"look up {len(relatives)} files such as {relatives[0]}"):
            infos = self.fs.get_file_info([self.path(r) for r in relatives])
        # get_file_info answers in the order asked.
        return {r: int(i.size or 0) for r, i in zip(relatives, infos, strict=True) if i.type == pafs.FileType.File}


def _s3_problem(settings: Settings, uri: str, exc: BaseException) -> str:
    """Why the bucket of `uri` could not be reached, naming the settings to check (never their secrets)."""
    # The secret key never leaves this process (requests are signed with it), so S3's answer cannot echo it,
    # and pyarrow's own messages name the bucket and operation only.
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    where = mask_url(settings.s3_endpoint_url) if settings.s3_endpoint_url else "AWS"
    if refusal(exc) == StorageRefusedError.CREDENTIALS:  # as a running process tells refused credentials
        check = "check SHOAL_S3_ACCESS_KEY and SHOAL_S3_SECRET_KEY (or the AWS credential chain)"
    else:
        check = "check SHOAL_S3_ENDPOINT_URL and SHOAL_S3_REGION"
    bucket = urlparse(uri).netloc
    return f"cannot reach S3 bucket {bucket!r} of storage {mask_url(uri)!r} at {where}: {reason}; {check}"


def _fsync_path(path: str) -> None:
    # pyarrow's local output streams do not fsync; a read-only descriptor of the same inode flushes it.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

