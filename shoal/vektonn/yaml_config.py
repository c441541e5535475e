"""Vektonn's YAML configuration: `data-sources/{name}/{version}.yaml` and `indices/{name}/{version}.yaml`.

Every scalar is read as text first (YAML's BaseLoader), so a version written `1.10` stays "1.10" instead of
becoming the number 1.1; numbers and booleans are converted only where a field needs one. Unknown keys are
ignored, as Vektonn ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shoal.errors import Problem, ValidationError
from shoal.log.records import DataSourceSpec, IndexSpec

# Vektonn's attribute value type names (any case) -> ours.
VALUE_TYPES = {"string": "string", "guid": "guid", "bool": "bool", "int64": "int64", "float64": "float64",
               "datetime": "datetime"}


def _load(path: Path) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(), Loader=yaml.BaseLoader)  # noqa: S506 - BaseLoader builds no objects
    except yaml.YAMLError as exc:
        raise ValidationError(Problem(f"{path}: not valid YAML: {exc}")) from None
    if not isinstance(data, dict):
        raise ValidationError(Problem(f"{path}: expected a mapping at the top"))
    return {str(k).lower(): v for k, v in data.items()}


def _int(path: Path, name: str, value: Any) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise ValidationError(Problem(f"{path}: {name} must be an integer, got {value!r}")) from None


def _bool(path: Path, name: str, value: Any) -> bool:
    text = str(value).strip().lower()
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0", ""):
        return False
    raise ValidationError(Problem(f"{path}: {name} must be true or false, got {value!r}"))


def _names(value: Any) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []


@dataclass
class Declared:
    """What a configuration folder declares."""

    sources: list[DataSourceSpec] = field(default_factory=list)
    indexes: list[IndexSpec] = field(default_factory=list)
    sharders: dict[tuple[str, str], list[str]] = field(default_factory=dict)


def read_folder(folder: Path) -> Declared:
    """Parse every data source and index file under `folder`; ValidationError names the file and field."""
    declared = Declared()
    for path in sorted((folder / "data-sources").glob("*/*.yaml")):
        data = _load(path)
        name, version = path.parent.name, path.stem
        types = data.get("attributevaluetypes") or {}
        if not isinstance(types, dict):
            raise ValidationError(Problem(f"{path}: attributeValueTypes must be a mapping"))
        unknown = {k: v for k, v in types.items() if str(v).lower() not in VALUE_TYPES}
        if unknown:
            raise ValidationError(Problem(f"{path}: unknown attribute value types {unknown}"))
        declared.sources.append(
            DataSourceSpec(
                name=name,
                version=version,
                vector_dimension=_int(path, "vectorDimension", data.get("vectordimension")),
                vectors_are_sparse=_bool(path, "vectorsAreSparse", data.get("vectorsaresparse", "false")),
                attribute_types={str(k): VALUE_TYPES[str(v).lower()] for k, v in types.items()},
                permanent_attributes=_names(data.get("permanentattributes")),
            )
        )
        sharders = data.get("shardersbyattributekey") or {}
        declared.sharders[(name, version)] = [str(k) for k in sharders] if isinstance(sharders, dict) else []
    for path in sorted((folder / "indices").glob("*/*.yaml")):
        data = _load(path)
        source_id = {str(k).lower(): v for k, v in (data.get("datasourceid") or {}).items()}
        algorithm = {str(k).lower(): v for k, v in (data.get("indexalgorithm") or {}).items()}
        if "name" not in source_id or "version" not in source_id or "type" not in algorithm:
            raise ValidationError(Problem(f"{path}: needs dataSourceId {{name, version}} and indexAlgorithm {{type}}"))
        source_key = (str(source_id["name"]), str(source_id["version"]))
        shards = data.get("shardsbyid") or {}
        declared.indexes.append(
            IndexSpec(
                name=path.parent.name,
                version=path.stem,
                source_name=source_key[0],
                source_version=source_key[1],
                algorithm=str(algorithm["type"]),
                params=dict(algorithm.get("params") or {}),
                id_attributes=_names(data.get("idattributes")),
                split_attributes=_names(data.get("splitattributes")),
                shard_attributes=declared.sharders.get(source_key, []),
                shard_count=max(1, len(shards)) if isinstance(shards, dict) else 1,
            )
        )
    return declared
