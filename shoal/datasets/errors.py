"""The dataset API's errors: a machine-readable code, an HTTP status, a message and details."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from shoal.errors import ShoalError


class ErrorCode(StrEnum):
    """Every code the dataset API answers with, each with one HTTP status (see `STATUS`)."""

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
    SERVICE_UNAVAILABLE = "SERVICE_UNAVAILABLE"
    INTERNAL_ERROR = "INTERNAL_ERROR"


STATUS: dict[ErrorCode, int] = {
    ErrorCode.DATASET_NOT_FOUND: 404,
    ErrorCode.DATASET_ALREADY_EXISTS: 409,
    ErrorCode.INVALID_DATASET_CONFIG: 400,
    ErrorCode.INVALID_DATASET_NAME: 400,
    ErrorCode.RESERVED_DATASET_NAME: 400,
    ErrorCode.INVALID_DIMENSIONS: 400,
    ErrorCode.VALIDATION_ERROR: 400,
    ErrorCode.NOT_IMPLEMENTED: 501,
    ErrorCode.REINDEX_CONFLICT: 409,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.SERVICE_UNAVAILABLE: 503,
    ErrorCode.INTERNAL_ERROR: 500,
}


class DatasetError(ShoalError):
    """A refused dataset operation; nothing was changed unless the message says otherwise."""

    def __init__(self, code: ErrorCode, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details or {}

    @property
    def status(self) -> int:
        """The HTTP status of this error's code."""
        return STATUS[self.code]

    def to_json(self) -> dict[str, Any]:
        """The error in the dataset API's shape."""
        return {"success": False, "error_code": self.code.value, "message": self.message, "details": self.details}


def not_found(name: str) -> DatasetError:
    """The dataset does not exist in the caller's tenant (also what another tenant's dataset looks like)."""
    return DatasetError(ErrorCode.DATASET_NOT_FOUND, f"dataset {name!r} not found", {"dataset_id": name})
