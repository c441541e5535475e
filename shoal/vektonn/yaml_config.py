"""Vektonn's YAML configuration: `data-sources/{name}/{version}.yaml` and `indices/{name}/{version}.yaml`.

Every scalar is read as text first (YAML's BaseLoader), so a version written `1.10` stays "1.10" instead of
becoming the number 1.1; numbers and booleans are converted only where a field needs one. Unknown keys are
ignored, as Vektonn ignores them. Keys are matched without regard to case; a key given twice (in any case) in one
mapping is refused.

Every value is checked for its shape (text, list or mapping) before it is used: a malformed file is refused with
a ValidationError naming the file and the field, never a Python error from deep inside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shoal.errors import AlreadyExistsError, NotFoundError, Problem, ValidationError
from shoal.log.records import DataSourceSpec, IndexSpec
from shoal.vektonn.algorithms import VEKTONN_TYPES

# Vektonn's attribute value type names (any case) -> ours.
VALUE_TYPES = {"string": "string", "guid": "guid", "bool": "bool", "int64": "int64", "float64": "float64",
               "datetime": "datetime"}
SOURCES_DIR = "data-sources"
INDICES_DIR = "indices"
# BaseLoader reads YAML's null spellings as text; they mean "not given", as in Vektonn's reader.
NULLS = ("", "~", "null", "Null", "NULL")


@contextlib.contextmanager
def naming_file(path: Path) -> Iterator[None]:
    """Put `path` in front of the message of a validation, not-found or already-exists error raised in the
    block (re-raised as the same type), so the one line the CLI prints says which file is at fault."""
    try:
        yield
    except ValidationError as exc:
        # One problem: "FILE: what; what" reads better than the file repeated before every problem.
        raise type(exc)(Problem(f"{path}: {'; '.join(str(p) for p in exc.problems)}")) from None
    except (NotFoundError, AlreadyExistsError) as exc:
        raise type(exc)(f"{path}: {exc}") from None


def _kind(value: Any) -> str:
    """What a YAML value is, for messages: BaseLoader builds only text, lists and mappings."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return "a string" if isinstance(value, str) else type(value).__name__


def _absent(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip() in NULLS)


def _keys_folded(name: str, data: dict[Any, Any]) -> dict[str, Any]:
    """`data` with lower-case keys; a key given twice in different case is refused rather than one dropped."""
    folded: dict[str, Any] = {}
    for key, value in data.items():
        low = str(key).lower()
        if low in folded:
            where = f"{name}: " if name else ""
            raise ValidationError(Problem(f"{where}key {key!r} is given twice (keys ignore case)"))
        folded[low] = value
    return folded


class _UniqueKeyLoader(yaml.BaseLoader):
    """YAML's BaseLoader (every scalar as text) refusing a key given twice in one mapping, at every level: PyYAML
    keeps the last of the two without a word, so `vectorDimension: 3` then `vectorDimension: 4` would define 4."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:  # type: ignore[override]
        seen: dict[str, yaml.Node] = {}
        for key_node, _ in node.value:
            # BaseLoader reads every scalar key as its text; a list or mapping key is left to PyYAML's own error.
            if isinstance(key_node, yaml.ScalarNode):
                first = seen.setdefault(key_node.value, key_node)
                if first is not key_node:
                    lines = (first.start_mark.line + 1, key_node.start_mark.line + 1)
                    where = f"line {lines[0]}" if lines[0] == lines[1] else f"lines {lines[0]} and {lines[1]}"
                    raise ValidationError(Problem(f"key {key_node.value!r} is given twice ({where})"))
        return super().construct_mapping(node, deep=deep)


def _load(path: Path) -> dict[str, Any]:
    """The file's top-level mapping, keys lower-cased; ValidationError (without the path) when it is none."""
    # The glob finds anything named like a YAML file; read_text cannot read a directory or a dangling link.
    if path.is_dir():
        raise ValidationError(Problem("is a directory, not a YAML file"))
    if not path.is_file():
        raise ValidationError(Problem("is not a regular file"))
    try:
        text = path.read_text(encoding="utf-8")  # YAML is UTF-8 whatever the locale says
    except UnicodeDecodeError as exc:
        raise ValidationError(Problem(f"is not UTF-8 text (byte {exc.start}: {exc.reason})")) from None
    except OSError as exc:
        raise ValidationError(Problem(f"cannot be read: {exc.strerror or exc}")) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a BaseLoader: it builds no objects
    except yaml.YAMLError as exc:
        raise ValidationError(Problem(f"not valid YAML: {exc}")) from None
    if not isinstance(data, dict):
        got = "an empty file" if data is None else _kind(data)
        raise ValidationError(Problem(f"expected a mapping at the top, got {got}"))
    return _keys_folded("", data)


def _text(name: str, value: Any) -> str:
    """A required scalar given as text (a name, a version, a type)."""
    if _absent(value):
        raise ValidationError(Problem(f"{name} is required"))
    if not isinstance(value, str):
        raise ValidationError(Problem(f"{name} must be text, got {_kind(value)}"))
    return value


def _int(name: str, value: Any) -> int:
    if _absent(value):
        raise ValidationError(Problem(f"{name} is required (an integer)"))
    if not isinstance(value, str):
        raise ValidationError(Problem(f"{name} must be an integer, got {_kind(value)}"))
    try:
        return int(value)
    except ValueError:
        raise ValidationError(Problem(f"{name} must be an integer, got {value!r}")) from None


def _bool(name: str, value: Any) -> bool:
    if _absent(value):
        return False
    if not isinstance(value, str):
        raise ValidationError(Problem(f"{name} must be true or false, got {_kind(value)}"))
    text = value.strip().lower()
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0"):
        return False
    raise ValidationError(Problem(f"{name} must be true or false, got {value!r}"))


def _names(name: str, value: Any) -> list[str]:
    """A list of attribute names; not given: none. A single name is refused, not read as an empty list."""
    if _absent(value):
        return []
    if not isinstance(value, list):
        # Refused rather than read as one name: YAML's `[id]` and `id` are easy to confuse, and silently taking
        # either reading could define another key than the author meant.
        raise ValidationError(Problem(f"{name} must be a list of attribute names, got {_kind(value)}"))
    for i, item in enumerate(value):
        if not isinstance(item, str) or _absent(item):
            got = "nothing" if _absent(item) else _kind(item)
            raise ValidationError(Problem(f"{name} must be a list of attribute names, item {i + 1} is {got}"))
    return list(value)


def _mapping(name: str, value: Any) -> dict[Any, Any]:
    """A mapping as given (keys untouched); not given: an empty one."""
    if _absent(value):
        return {}
    if not isinstance(value, dict):
        raise ValidationError(Problem(f"{name} must be a mapping, got {_kind(value)}"))
    return value


def _source(path: Path, data: dict[str, Any]) -> tuple[DataSourceSpec, list[str]]:
    """The data source a file declares, and the attribute keys of its sharders."""
    types = _mapping("attributeValueTypes", data.get("attributevaluetypes"))
    bad = {k: v for k, v in types.items() if not isinstance(v, str) or v.lower() not in VALUE_TYPES}
    if bad:
        shown = ", ".join(f"{k}: {v!r}" for k, v in bad.items())
        raise ValidationError(
            Problem(f"attributeValueTypes: unknown value types ({shown}); known: {', '.join(VALUE_TYPES.values())}")
        )
    spec = DataSourceSpec(
        name=path.parent.name,
        version=path.stem,
        vector_dimension=_int("vectorDimension", data.get("vectordimension")),
        vectors_are_sparse=_bool("vectorsAreSparse", data.get("vectorsaresparse")),
        attribute_types={str(k): VALUE_TYPES[v.lower()] for k, v in types.items()},
        permanent_attributes=_names("permanentAttributes", data.get("permanentattributes")),
    )
    sharders = _mapping("shardersByAttributeKey", data.get("shardersbyattributekey"))
    return spec, [str(k) for k in sharders]


def _shard_attributes(shards: dict[Any, Any]) -> list[str]:
    """The attribute keys the index's shards are sharded by (Vektonn's IndexMeta.ShardAttributes: every key of
    every `shardsById.<shard>.shardsByAttributeKey`), in the order first given; none: the default (resolve_index:
    the id attributes)."""
    keys: dict[str, None] = {}
    for shard_id, shard in shards.items():
        where = f"shardsById.{shard_id}"
        meta = _keys_folded(where, _mapping(where, shard))
        by_key = _mapping(f"{where}.shardsByAttributeKey", meta.get("shardsbyattributekey"))
        keys.update(dict.fromkeys(str(key) for key in by_key))
    return list(keys)


def _index(path: Path, data: dict[str, Any]) -> IndexSpec:
    """The index a file declares, as far as it can be checked without its data source. Its shard attributes are
    the index file's own (Vektonn's rule), whatever data source files the folder holds."""
    source_id = _keys_folded("dataSourceId", _mapping("dataSourceId", data.get("datasourceid")))
    if not source_id:
        raise ValidationError(Problem("dataSourceId is required: a mapping {name, version}"))
    source_name = _text("dataSourceId.name", source_id.get("name"))
    source_version = _text("dataSourceId.version", source_id.get("version"))
    algorithm = _keys_folded("indexAlgorithm", _mapping("indexAlgorithm", data.get("indexalgorithm")))
    if not algorithm:
        raise ValidationError(Problem("indexAlgorithm is required: a mapping {type, params}"))
    algorithm_type = _text("indexAlgorithm.type", algorithm.get("type"))
    if algorithm_type not in VEKTONN_TYPES:
        # Vektonn refuses any other type; Shoal's own names (flat, hnsw, ...) would have made a cosine index and
        # read its params as text, so `type: hnsw` with `M: 16` failed as "must be an integer".
        raise ValidationError(Problem(f"indexAlgorithm.type {algorithm_type!r} is not a Vektonn index type; "
                                      f"known: {', '.join(VEKTONN_TYPES)}"))
    params = _mapping("indexAlgorithm.params", algorithm.get("params"))
    for key, value in params.items():
        if not isinstance(value, str):
            raise ValidationError(Problem(f"indexAlgorithm.params.{key} must be a single value, got {_kind(value)}"))
    shards = _mapping("shardsById", data.get("shardsbyid"))
    return IndexSpec(
        name=path.parent.name,
        version=path.stem,
        source_name=source_name,
        source_version=source_version,
        algorithm=algorithm_type,
        params=params,
        id_attributes=_names("idAttributes", data.get("idattributes")),
        split_attributes=_names("splitAttributes", data.get("splitattributes")),
        shard_attributes=_shard_attributes(shards),
        shard_count=max(1, len(shards)),
    )


@dataclass
class Declared:
    """What a configuration folder declares, and the file each definition came from (by name and version)."""

    sources: list[DataSourceSpec] = field(default_factory=list)
    indexes: list[IndexSpec] = field(default_factory=list)
    sharders: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    source_files: dict[tuple[str, str], Path] = field(default_factory=dict)
    index_files: dict[tuple[str, str], Path] = field(default_factory=dict)
    # `*.yml` files where a definition file would be: not read (only `.yaml` is), worth a warning.
    ignored: list[Path] = field(default_factory=list)


def _hidden(path: Path, root: Path) -> bool:
    """Whether a part of `path` below `root` starts with '.': an editor's lock or backup (Emacs' `.#1.0.yaml`),
    macOS' `._1.0.yaml` resource fork, a `.git` folder; never a definition."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _definition_files(root: Path, suffix: str) -> list[Path]:
    """The `{name}/{version}{suffix}` files under `root`, hidden ones (see `_hidden`) left out, sorted."""
    return sorted(path for path in root.glob(f"*/*{suffix}") if not _hidden(path, root))


def read_folder(folder: Path) -> Declared:
    """Parse every data source and index file under `folder`; ValidationError names the file and field. A
    folder without any such file is refused: it is most likely the wrong folder (or one level too deep). Files
    and folders whose name starts with '.' are skipped; `*.yml` files are not read, and listed in `ignored`."""
    source_paths = _definition_files(folder / SOURCES_DIR, ".yaml")
    index_paths = _definition_files(folder / INDICES_DIR, ".yaml")
    ignored = [*_definition_files(folder / SOURCES_DIR, ".yml"), *_definition_files(folder / INDICES_DIR, ".yml")]
    if not source_paths and not index_paths:
        # Only .yml files: most likely the right folder with the wrong extension, so say so.
        more = f" and {len(ignored) - 3} more" if len(ignored) > 3 else ""
        shown = ", ".join(map(str, ignored[:3]))
        found = f" (it has .yml files, which are not read: {shown}{more})" if ignored else ""
        raise ValidationError(
            Problem(f"{folder} holds no Vektonn configuration: expected {SOURCES_DIR}/{{name}}/{{version}}.yaml "
                    f"or {INDICES_DIR}/{{name}}/{{version}}.yaml files in it{found}")
        )
    declared = Declared(ignored=ignored)
    for path in source_paths:
        with naming_file(path):
            spec, sharders = _source(path, _load(path))
        declared.sources.append(spec)
        declared.sharders[(spec.name, spec.version)] = sharders
        declared.source_files[(spec.name, spec.version)] = path
    for path in index_paths:
        with naming_file(path):
            index = _index(path, _load(path))
        declared.indexes.append(index)
        declared.index_files[(index.name, index.version)] = path
    return declared
