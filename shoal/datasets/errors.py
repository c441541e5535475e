"""The dataset service's error codes, and helpers that build its errors.

The error class itself is `shoal.errors.DatasetError` (the project's one exceptions module); what HTTP status
and body each code answers with is `shoal.api.errors`' business, never the service's.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from shoal.errors import DatasetError, ValidationError

__all__ = ["ACTIONS", "DatasetError", "ErrorCode", "action_of", "already_exists", "invalid", "not_found",
           "problems_of"]


class ErrorCode(StrEnum):
    """Every code a dataset operation can fail with (the dataset API answers with these names)."""

    DATASET_NOT_FOUND = "DATASET_NOT_FOUND"
    DATASET_ALREADY_EXISTS = "DATASET_ALREADY_EXISTS"
    INVALID_DATASET_CONFIG = "INVALID_DATASET_CONFIG"
    INVALID_DATASET_NAME = "INVALID_DATASET_NAME"
    RESERVED_DATASET_NAME = "RESERVED_DATASET_NAME"
    INVALID_DIMENSIONS = "INVALID_DIMENSIONS"
    VALIDATION_ERROR = "VALIDATION_ERROR"
    NOT_IMPLEMENTED = "NOT_IMPLEMENTED"
    REINDEX_CONFLICT = "REINDEX_CONFLICT"
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    UNAUTHORIZED = "UNAUTHORIZED"
    FORBIDDEN = "FORBIDDEN"
    TOO_MANY_REQUESTS = "TOO_MANY_REQUESTS"
    SERVICE_UNAVAILABLE = "SERVICE_UNAVAILABLE"
    INTERNAL_ERROR = "INTERNAL_ERROR"


# What the caller can do about an error (`details.action`), by code; an error may carry a more precise one.
ACTIONS: dict[ErrorCode, str] = {
    ErrorCode.DATASET_NOT_FOUND: "check the dataset id; GET /api/v1/datasets lists the tenant's datasets "
    "(a deleted one may be in GET /api/v1/trash)",
    ErrorCode.DATASET_ALREADY_EXISTS: "choose another name, or create with overwrite=true (an admin key) to "
    "replace the dataset",
    ErrorCode.INVALID_DATASET_CONFIG: "correct the field named in details and send the request again",
    ErrorCode.INVALID_DATASET_NAME: "use a name matching ^[a-z0-9_-]{1,100}$ that starts with a letter or digit",
    ErrorCode.RESERVED_DATASET_NAME: "choose a name that is not in details.reserved_names",
    ErrorCode.INVALID_DIMENSIONS: "send vectors with the dataset's number of dimensions",
    ErrorCode.VALIDATION_ERROR: "correct the request as the message says and send it again",
    ErrorCode.NOT_IMPLEMENTED: "this operation is not available",
    ErrorCode.REINDEX_CONFLICT: "wait for the running reindex to end (GET /api/v1/indexes/{dataset_id}/1/reindex)",
    ErrorCode.QUOTA_EXCEEDED: "delete vectors, or raise metadata.quota_limit with PUT /api/v1/datasets/{dataset_id}",
    ErrorCode.UNAUTHORIZED: "send a valid key as 'Authorization: ApiKey <key>'",
    ErrorCode.FORBIDDEN: "use a key whose role allows this operation",
    ErrorCode.TOO_MANY_REQUESTS: "retry after the Retry-After header's seconds",
    ErrorCode.SERVICE_UNAVAILABLE: "retry after the Retry-After header's seconds",
    ErrorCode.INTERNAL_ERROR: "retry later; report the error if it persists",
}


def action_of(code: str) -> str:
    """The action hint of a code (a generic one for a code without its own)."""
    try:
        return ACTIONS[ErrorCode(code)]
    except ValueError:
        return "correct the request and send it again"


def not_found(name: str) -> DatasetError:
    """The dataset does not exist in the caller's tenant (also what another tenant's dataset looks like)."""
    return DatasetError(ErrorCode.DATASET_NOT_FOUND, f"dataset {name!r} not found", {"dataset_id": name})


def already_exists(name: str, conflict: str = "dataset") -> DatasetError:
    """A dataset (or, per `conflict`, another object) of that name exists already; the hint names
    `overwrite=true`, which replaces a dataset (never another object)."""
    details: dict[str, Any] = {"dataset_id": name, "conflict": conflict}
    if conflict != "dataset":
        details["action"] = "choose another name (overwrite replaces datasets only)"
    return DatasetError(ErrorCode.DATASET_ALREADY_EXISTS, f"dataset {name!r} already exists", details)


def invalid(message: str, **details: Any) -> DatasetError:
    """A request value breaks a rule that has no more specific code (VALIDATION_ERROR)."""
    return DatasetError(ErrorCode.VALIDATION_ERROR, message, details)


def problems_of(exc: ValidationError) -> list[str]:
    """The problems of a core validation error, as text."""
    return [str(p) for p in exc.problems]
