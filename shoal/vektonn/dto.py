"""Vektonn's wire format: camelCase JSON, input keys matched case-insensitively, nulls left out of responses."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

VALUE_KINDS = ("string", "guid", "bool", "int64", "float64", "dateTime")
# Every field name of the DTOs below: input keys are matched to these ignoring case, as Vektonn does.
_FIELDS = (
    "attributes", "key", "value", "vector", "isSparse", "coordinates", "coordinateIndices", "isDeleted", "k",
    "queryVectors", "splitFilter", "retrieveVectors", *VALUE_KINDS,
)
_CANONICAL = {name.lower(): name for name in _FIELDS}


class _Dto(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _any_case(cls, data: Any) -> Any:
        # Vektonn matches input keys ignoring case ("IsDeleted", "isdeleted"): rewrite them to ours first.
        if isinstance(data, dict):
            return {_CANONICAL.get(k.lower(), k) if isinstance(k, str) else k: v for k, v in data.items()}
        return data


class AttributeValueDto(_Dto):
    """Exactly one of the typed slots holds the value."""

    string: str | None = None
    guid: uuid.UUID | None = None
    bool_: bool | None = Field(default=None, alias="bool")
    int64: int | None = None
    float64: float | None = None
    dateTime: dt.datetime | None = None  # noqa: N815 - Vektonn's field name

    @model_validator(mode="after")
    def _exactly_one(self) -> AttributeValueDto:
        given = [k for k in ("string", "guid", "bool_", "int64", "float64", "dateTime") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"an attribute value needs exactly one of {', '.join(VALUE_KINDS)} (got {len(given)})")
        return self

    def kind(self) -> str:
        """The name of the slot that holds the value (`bool`, `int64`, ...)."""
        for k in ("string", "guid", "int64", "float64", "dateTime"):
            if getattr(self, k) is not None:
                return k
        return "bool"

    def python(self) -> Any:
        """The value itself."""
        return self.bool_ if self.kind() == "bool" else getattr(self, self.kind())


class AttributeDto(_Dto):
    key: str
    value: AttributeValueDto


class VectorDto(_Dto):
    """Dense: the coordinates. Sparse: the coordinates at `coordinateIndices`."""

    isSparse: bool = False  # noqa: N815
    coordinates: list[float]
    coordinateIndices: list[int] | None = None  # noqa: N815


class InputDataPointOrTombstoneDto(_Dto):
    attributes: list[AttributeDto]
    vector: VectorDto | None = None
    isDeleted: bool = False  # noqa: N815


class SearchQueryDto(_Dto):
    k: int
    queryVectors: list[VectorDto]  # noqa: N815
    splitFilter: list[AttributeDto] | None = None  # noqa: N815
    retrieveVectors: bool = False  # noqa: N815


class FoundDataPointDto(_Dto):
    vector: VectorDto | None = None
    attributes: list[AttributeDto]
    distance: float


class SearchResultDto(_Dto):
    queryVector: VectorDto  # noqa: N815
    nearestDataPoints: list[FoundDataPointDto]  # noqa: N815


class ErrorDto(_Dto):
    errorMessages: list[str]  # noqa: N815
