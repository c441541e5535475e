"""The Vektonn routes' former path, kept as the oracle shoal.vektonn.wire is compared with: pydantic DTOs to
Shoal's records, checking each attribute's value slot against its declared type."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shoal.errors import Problem, ValidationError
from shoal.log.records import AttributeType, DataPoint, DataSourceSpec, SparseVector, Tombstone
from shoal.searcher.execute import Hit
from shoal.vektonn.dto import (
    AttributeDto,
    AttributeValueDto,
    FoundDataPointDto,
    InputDataPointOrTombstoneDto,
    VectorDto,
)

# The DTO slot each attribute type travels in.
SLOT = {
    AttributeType.STRING: "string",
    AttributeType.GUID: "guid",
    AttributeType.BOOL: "bool",
    AttributeType.INT64: "int64",
    AttributeType.FLOAT64: "float64",
    AttributeType.DATETIME: "dateTime",
}


def _attributes(
    spec: DataSourceSpec, attrs: list[AttributeDto], position: int | None, problems: list[Problem]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in attrs:
        if a.key in out:
            problems.append(Problem("attribute given twice", position, a.key))
            continue
        declared = spec.attribute_types.get(a.key)
        if declared is not None and a.value.kind() != SLOT[declared]:
            problems.append(Problem(f"expected a {SLOT[declared]} value, got {a.value.kind()}", position, a.key))
            continue
        value = a.value.python()
        out[a.key] = str(value) if declared is AttributeType.GUID else value
    return out


def vector_value(spec: DataSourceSpec, dto: VectorDto, position: int | None, problems: list[Problem]) -> Any:
    """A DTO vector as the records take it (a list, or a SparseVector), or None after noting the problem."""
    if dto.isSparse != spec.vectors_are_sparse:
        want = "sparse" if spec.vectors_are_sparse else "dense"
        problems.append(Problem(f"the data source holds {want} vectors", position, "vector"))
        return None
    if dto.isSparse:
        if dto.coordinateIndices is None:
            problems.append(Problem("a sparse vector needs coordinateIndices", position, "vector"))
            return None
        return SparseVector(dto.coordinateIndices, dto.coordinates)
    return dto.coordinates


def points_from_dtos(spec: DataSourceSpec, dtos: list[InputDataPointOrTombstoneDto]) -> list[DataPoint | Tombstone]:
    """The batch as records; ValidationError naming each point's position, attribute and rule otherwise."""
    problems: list[Problem] = []
    items: list[DataPoint | Tombstone] = []
    for pos, dto in enumerate(dtos):
        attrs = _attributes(spec, dto.attributes, pos, problems)
        if dto.isDeleted:
            if dto.vector is not None:
                problems.append(Problem("a tombstone carries no vector", pos, "vector"))
            items.append(Tombstone(attrs))
            continue
        if dto.vector is None:
            problems.append(Problem("a data point needs a vector", pos, "vector"))
            continue
        vector = vector_value(spec, dto.vector, pos, problems)
        if vector is not None:
            items.append(DataPoint(attrs, vector))
    if problems:
        raise ValidationError(problems)
    return items


def split_filter(spec: DataSourceSpec, attrs: list[AttributeDto] | None) -> dict[str, Any] | None:
    """A Vektonn split filter as {attribute: value}."""
    if not attrs:
        return None
    problems: list[Problem] = []
    out = _attributes(spec, attrs, None, problems)
    if problems:
        raise ValidationError(problems)
    return out


def _value_dto(kind: AttributeType, value: Any) -> AttributeValueDto:
    return AttributeValueDto.model_validate({SLOT[kind]: value})


def vector_dto(vector: Any) -> VectorDto:
    """A vector as Vektonn writes it."""
    if isinstance(vector, SparseVector):
        return VectorDto(isSparse=True, coordinates=list(vector.values), coordinateIndices=list(vector.indices))
    return VectorDto(isSparse=False, coordinates=[float(x) for x in vector])


def hit_dto(spec: DataSourceSpec, hit: Hit) -> FoundDataPointDto:
    """A search hit as Vektonn's FoundDataPointDto."""
    attributes = [
        AttributeDto(key=name, value=_value_dto(spec.attribute_types[name], value))
        for name, value in hit.attributes.items()
        if value is not None
    ]
    return FoundDataPointDto(
        vector=vector_dto(hit.vector) if hit.vector is not None else None, attributes=attributes, distance=hit.distance
    )


def query_vectors(spec: DataSourceSpec, dtos: list[VectorDto]) -> list[Any]:
    """Query vectors as the searcher takes them."""
    problems: list[Problem] = []
    out = [vector_value(spec, v, i, problems) for i, v in enumerate(dtos)]
    if problems:
        raise ValidationError([Problem(p.rule, p.position, "queryVectors") for p in problems])
    return out


def attribute_map(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Attributes as plain JSON values (for logs and tests)."""
    return {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in attrs.items()}
