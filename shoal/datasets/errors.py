"""The dataset service's error codes, and helpers that build its errors.

The error class itself is `shoal.errors.DatasetError` (the project's one exceptions module); what HTTP status
and body each code answers with is `shoal.api.errors`' business, never the service's.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from shoal.errors import DatasetError, ValidationError

__all__ = ["DatasetError", "ErrorCode", "already_exists", "invalid", "not_found", "problems_of"]


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
    UNAUTHORIZED = "UNAUTHORIZED"
    FORBIDDEN = "FORBIDDEN"
    TOO_MANY_REQUESTS = "TOO_MANY_REQUESTS"
    SERVICE_UNAVAILABLE = "SERVICE_UNAVAILABLE"
    INTERNAL_ERROR = "INTERNAL_ERROR"


def not_found(name: str) -> DatasetError:
    """The dataset does not exist in the caller's tenant (also what another tenant's dataset looks like)."""
    return DatasetError(ErrorCode.DATASET_NOT_FOUND, f"dataset {name!r} not found", {"dataset_id": name})


def already_exists(name: str, conflict: str = "dataset") -> DatasetError:
    """A dataset (or, per `conflict`, another object) of that name exists already."""
    return DatasetError(ErrorCode.DATASET_ALREADY_EXISTS, f"dataset {name!r} already exists",
                        {"dataset_id": name, "conflict": conflict})


def invalid(message: str, **details: Any) -> DatasetError:
    """A request value breaks a rule that has no more specific code (VALIDATION_ERROR)."""
    return DatasetError(ErrorCode.VALIDATION_ERROR, message, details)


def problems_of(exc: ValidationError) -> list[str]:
    """The problems of a core validation error, as text."""
    return [str(p) for p in exc.problems]
