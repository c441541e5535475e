"""Every error Shoal raises on purpose. Callers catch these, never library internals."""

from __future__ import annotations

from dataclasses import dataclass


class ShoalError(Exception):
    """Base of all Shoal errors."""


@dataclass(frozen=True)
class Problem:
    """One broken rule: where (point position, attribute) and what."""

    rule: str
    position: int | None = None
    attribute: str | None = None

    def __str__(self) -> str:
        where = []
        if self.position is not None:
            where.append(f"point {self.position}")
        if self.attribute is not None:
            where.append(f"attribute {self.attribute!r}")
        return f"{', '.join(where)}: {self.rule}" if where else self.rule


class ValidationError(ShoalError):
    """Input broke one or more rules; nothing was written."""

    prefix = "invalid input, nothing written"

    def __init__(self, problems: list[Problem] | Problem | str) -> None:
        if isinstance(problems, str):
            problems = [Problem(problems)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems: list[Problem] = problems
        shown = "; ".join(str(p) for p in problems[:10])
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        super().__init__(f"{self.prefix}: {shown}{more}")


class QueryError(ValidationError):
    """A search broke one or more rules. A search writes nothing, so its message does not say so (the
    ValidationError prefix speaks of writes); the HTTP routes answer it as any ValidationError (400)."""

    prefix = "invalid query"

    @classmethod
    def of(cls, exc: ValidationError) -> ValidationError:
        """`exc`'s problems as a query error; `exc` itself when its message does not speak of writes (a
        QueryError, an InvalidNameError)."""
        return cls(exc.problems) if exc.prefix == ValidationError.prefix else exc


class InvalidNameError(ValidationError):
    """A tenant, data source or version name breaks the naming rules."""

    prefix = "invalid name"


class IndexDefinitionError(ValidationError):
    """An index definition breaks Vektonn's rules or asks for what its algorithm lacks; nothing was created."""

    prefix = "invalid index definition"


class BatchTooLargeError(ValidationError):
    """A batch holds more points than the configured maximum."""


class BatchIdReusedError(ValidationError):
    """A batch id that already committed (or is committing in the same group commit) came with another batch:
    only a repeat of the same batch may reuse its id. Nothing of this batch was written; `batch_id` names the id.
    Not a ConflictError: a retry of the same request can only be refused again."""

    def __init__(self, batch_id: str, token: int) -> None:
        super().__init__(Problem(
            f"batch id {batch_id!r} was already used for another batch (write token {token}): a repeat must carry "
            f"the same batch to get that token back; a new batch needs a new batch id", attribute="batch_id"))
        self.batch_id = batch_id


class NotFoundError(ShoalError):
    """The named tenant or data source does not exist."""


class AlreadyExistsError(ShoalError):
    """A data source with that name and version exists already (with another definition)."""


class ConfigurationError(ShoalError):
    """Settings are inconsistent or a configured server cannot be reached."""


class CommitError(ShoalError):
    """A batch could not be committed after bounded retries; it was not acknowledged."""


class CatalogUnavailableError(ShoalError):
    """The catalog (Postgres) cannot be reached right now (HTTP 503): retry after `retry_after` seconds. The
    message names no host, socket or driver error: those go to the log only."""

    def __init__(self, message: str = "the catalog is unavailable right now; retry later",
                 retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StorageUnavailableError(ShoalError, ConnectionError):
    """The storage cannot be reached right now: S3 did not answer (connection refused or lost, a timeout) or
    answered "try again" (a 5xx, throttling); a network filesystem likewise. Transient: a ConnectionError, so
    Celery tasks retry it (`shoal.workers.base.TRANSIENT`) and every `except OSError` still catches it; HTTP
    answers 503 with Retry-After: `retry_after`, with PUBLIC as its message (the reason, which may name the
    endpoint, goes to the log only). Never a missing or damaged file (CorruptSegmentError,
    CorruptArtifactError), nor a local disk that is full or forbids access (the OSError as it is)."""

    PUBLIC = "the storage is unavailable right now; retry later"

    def __init__(self, message: str = PUBLIC, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StorageUnreachableError(ConfigurationError, StorageUnavailableError):
    """The configured storage did not answer when it was opened (`Storage.from_settings`). Both at once: a
    ConfigurationError, so a startup check stops with one line naming the endpoint setting to check; and a
    StorageUnavailableError, so a worker process that opens its storage on its first task, during an outage,
    retries that task instead of failing it for good."""


# -- the concurrency vocabulary ----------------------------------------------------------------------------
# Every lost race in Shoal is reported one of two ways. ConflictError: this caller lost a compare-and-swap or
# a precondition it stated; nothing it asked for was written, so it reloads what it read and tries again.
# StateUnknownError: the catalog could not say whether a commit landed; the caller must look before it
# retries (or retry only with an idempotency key, such as a producer batch id).


class ConflictError(ShoalError):
    """Lost a compare-and-swap or a stated precondition: nothing was written; reload and retry.

    `expected` is what the caller assumed (e.g. the head seq, the active version id) and `actual` what the
    catalog held instead, when known (None otherwise).
    """

    def __init__(self, message: str, *, expected: object = None, actual: object = None) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class LeaseBusyError(ConflictError):
    """Another worker holds the shard's build lease (or took it over while this build ran): try later.

    `retry_in`, when known, is how many seconds the holder's lease has left: by then it has renewed it (it
    is alive) or it has expired (it is not), so a retry need not wait longer."""

    def __init__(
        self, message: str, *, expected: object = None, actual: object = None, retry_in: float | None = None
    ) -> None:
        super().__init__(message, expected=expected, actual=actual)
        self.retry_in = retry_in


class StateUnknownError(CommitError):
    """A commit's outcome is unknown (e.g. the connection was lost during COMMIT): it may have landed.
    Check before retrying; a retry under the same batch id is safe, a blind one may write twice."""


class CorruptSegmentError(ShoalError):
    """A log segment's bytes do not match the checksum the catalog recorded."""


class CorruptArtifactError(ShoalError):
    """An index artifact is missing or does not match the checksum its manifest recorded."""


class AuthenticationError(ShoalError):
    """No usable credentials: the API key is missing, malformed, unknown, wrong or revoked (HTTP 401)."""


class PermissionDeniedError(ShoalError):
    """The caller is authenticated but its role does not allow the operation (HTTP 403)."""


class RateLimitedError(ShoalError):
    """Too many failed authentications from the caller's address: retry after `retry_after` seconds (HTTP 429)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class BackpressureError(ShoalError):
    """Indexes of the data source lag more than the configured bound: retry after `retry_after` seconds
    (HTTP 429 with Retry-After). Nothing was written."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ReindexConflictError(ShoalError):
    """A reindex or rollback cannot start or finish: another one runs, or the index changed under it (409)."""


class CapacityError(ShoalError):
    """Serving this would take more memory than the process's budget allows (SHOAL_SEARCHER_CACHE_BYTES)."""


class DatasetError(ShoalError):
    """A refused dataset operation, with a machine-readable `code` (a `shoal.datasets.errors.ErrorCode`) and
    JSON-ready `details`; nothing was changed unless the message says otherwise. HTTP statuses for the codes
    live in `shoal.api.errors`, not here."""

    def __init__(self, code: str, message: str, details: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details or {}


class ShardsUnavailableError(ShoalError):
    """A search needs shards that no process it can reach serves now (placement, SHOAL_PLACEMENT_FILE): answered
    503 naming them, never with a silently partial result."""

    def __init__(self, message: str, shards: list[int], retry_after: int | None = None) -> None:
        super().__init__(message)
        self.shards = sorted(shards)
        # Set where a retry can help (nodes that did not answer now); None where only the placement can change.
        self.retry_after = retry_after
