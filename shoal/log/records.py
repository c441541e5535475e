"""The records every layer shares: data source definitions, data points, tombstones, write tokens.

Plain data with the naming and consistency rules of Vektonn's data model; no I/O here.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from shoal.errors import InvalidNameError, Problem, ValidationError

MAX_VECTOR_DIMENSION = 10_000
MAX_SHARDS = 1024
MAX_SEQ = 2**63 - 1  # seqs (and so write tokens) are Postgres bigints
# A data source's custom metadata, as JSON: bounded so every JSON encoder on the way out (orjson stops at 255
# levels, FastAPI's encoder at Python's recursion limit) can answer with it, and so a list of definitions stays
# small. A dataset's definition (its metadata nested two levels down) fits within both.
MAX_CUSTOM_METADATA_DEPTH = 64
MAX_CUSTOM_METADATA_BYTES = 256 * 1024
# A data source's description, in characters: the dataset API's bound (shoal.datasets.rules.MAX_DESCRIPTION), so
# one description cannot make every listing of the tenant's data sources megabytes long.
MAX_DESCRIPTION = 10_000

# Data source names and versions as Vektonn writes them ("QuickStart.Source", "1.0"). The first character
# must be a letter or digit, so "." and ".." (or a hidden file) can never be formed and no name can leave
# its folder in the storage layout.
SOURCE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
GENERATION_MARK = "~g"  # see IndexSpec.__post_init__
# The custom-metadata key under which the dataset API keeps a dataset's definition (shoal.datasets.catalog): set
# only by that API, refused in data sources made any other way (a dataset listing would read it as a dataset).
DATASET_KEY = "shoal.dataset"
DATASET_VERSION = "1"  # the version of a dataset's data source and of its own index


def is_datasets_index(spec: IndexSpec) -> bool:
    """True when the index would be a dataset's own, should its data source be a dataset's: the dataset API names
    it as the dataset, over the dataset's source, both at DATASET_VERSION. Other indexes over a dataset's source
    are no part of the dataset."""
    return spec.name == spec.source_name and spec.version == spec.source_version == DATASET_VERSION


def refuse_dataset_key(custom_metadata: Mapping[str, Any]) -> None:
    """Raise ValidationError when custom metadata holds DATASET_KEY (a data source made outside the dataset API)."""
    if DATASET_KEY in custom_metadata:
        raise ValidationError(Problem(
            f"customMetadata key {DATASET_KEY!r} is reserved: the dataset API keeps a dataset's definition there "
            "(create a dataset through POST /api/v1/datasets instead)", attribute=DATASET_KEY))
TENANT_NAME_RE = re.compile(r"^[a-z0-9_-]{1,100}$")
# Attribute keys become Parquet column names; the "__" prefix is reserved for the log's own columns.
ATTRIBUTE_NAME_RE = re.compile(r"^(?!__)[A-Za-z0-9_.-]{1,100}$")


class AttributeType(StrEnum):
    """The value types an attribute may hold (Vektonn's AttributeValue kinds)."""

    BOOL = "bool"
    INT64 = "int64"
    FLOAT64 = "float64"
    STRING = "string"
    GUID = "guid"
    DATETIME = "datetime"


AttributeValue = bool | int | float | str | uuid.UUID | dt.datetime


def check_name(kind: str, value: str, pattern: re.Pattern[str] = SOURCE_NAME_RE) -> str:
    """Return `value` unchanged if it is a legal `kind` name, else raise InvalidNameError naming the rule."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise InvalidNameError(
            Problem(f"invalid {kind} {value!r}: must match {pattern.pattern}", attribute=None)
        )
    return value


def check_tenant_name(value: str) -> str:
    """Return `value` if it is a legal tenant name (lower-case letters, digits, `_`, `-`)."""
    return check_name("tenant name", value, TENANT_NAME_RE)


@dataclass(frozen=True)
class SparseVector:
    """A sparse vector: `values[i]` is the coordinate at dimension `indices[i]`; indices are unique."""

    indices: Sequence[int]
    values: Sequence[float]


@dataclass(frozen=True)
class DataPoint:
    """An upsert: a vector (dense array or SparseVector) and a value for every attribute of the source."""

    attributes: Mapping[str, AttributeValue]
    vector: Sequence[float] | np.ndarray | SparseVector


@dataclass(frozen=True)
class Tombstone:
    """A deletion of the data point with this key: the values of the data source's permanent attributes, or
    of every attribute (Vektonn's form; the other values are checked for their type and not stored)."""

    key: Mapping[str, AttributeValue]


@dataclass(frozen=True, order=True)
class WriteToken:
    """Proof of a durable write: the seq of the batch's last entry in its data source's log.

    A search may require a token to see every write up to it (read-your-writes).
    """

    seq: int
    data_source: str = field(compare=False, default="")
    version: str = field(compare=False, default="")

    def __str__(self) -> str:
        return f"{self.data_source}/{self.version}@{self.seq}"


@dataclass(frozen=True)
class DataSourceSpec:
    """The definition of a data source (Vektonn's DataSourceMeta plus description and custom metadata)."""

    name: str
    version: str
    vector_dimension: int
    attribute_types: Mapping[str, AttributeType]
    permanent_attributes: Sequence[str]
    vectors_are_sparse: bool = False
    description: str = ""
    custom_metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Types first: a None or a list where a mapping belongs must be named, not fail in a conversion below (or
        # in the catalog's insert, for a vectors_are_sparse that is no bool).
        problems = _collection_problems(
            mappings={"attribute_types": self.attribute_types, "custom_metadata": self.custom_metadata},
            names={"permanent_attributes": self.permanent_attributes},
        )
        for name in self.attribute_types if isinstance(self.attribute_types, Mapping) else ():
            if not isinstance(name, str):
                problems.append(Problem(f"attribute names must be strings, got {type(name).__name__} {name!r}"))
        if not isinstance(self.vectors_are_sparse, bool | np.bool_):
            problems.append(Problem(f"vectors_are_sparse must be a bool, got {type(self.vectors_are_sparse).__name__}"))
        if problems:
            raise ValidationError(problems)
        object.__setattr__(self, "vectors_are_sparse", bool(self.vectors_are_sparse))
        # Normalise collections so specs compare by value and attribute types are enums.
        try:
            types = {k: AttributeType(v) for k, v in dict(self.attribute_types).items()}
        except (ValueError, TypeError) as exc:
            allowed = ", ".join(t.value for t in AttributeType)
            raise ValidationError(Problem(f"unknown attribute type ({exc}); allowed: {allowed}")) from None
        object.__setattr__(self, "attribute_types", types)
        object.__setattr__(self, "permanent_attributes", tuple(self.permanent_attributes))
        object.__setattr__(self, "custom_metadata", dict(self.custom_metadata))
        self.validate()

    def validate(self) -> None:
        """Raise ValidationError listing every rule this definition breaks (Vektonn's consistency rules)."""
        check_name("data source name", self.name)
        check_name("data source version", self.version)
        problems: list[Problem] = []
        dim = self.vector_dimension
        if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= MAX_VECTOR_DIMENSION:
            problems.append(Problem(f"vector dimension must be an integer in 1..{MAX_VECTOR_DIMENSION}, got {dim!r}"))
        for name in self.attribute_types:
            if not ATTRIBUTE_NAME_RE.fullmatch(name):
                problems.append(
                    Problem(f"attribute name must match {ATTRIBUTE_NAME_RE.pattern}", attribute=name)
                )
        if not self.permanent_attributes:
            problems.append(Problem("permanent attributes must not be empty"))
        if len(set(self.permanent_attributes)) != len(self.permanent_attributes):
            problems.append(Problem("permanent attributes must not repeat"))
        for name in self.permanent_attributes:
            if name not in self.attribute_types:
                problems.append(Problem("permanent attribute has no attribute value type", attribute=name))
        if not isinstance(self.description, str):
            problems.append(Problem("description must be a string"))
        elif not storable_text(self.description):
            problems.append(Problem("description must be valid Unicode without NUL characters (Postgres stores "
                                    "neither a lone surrogate nor NUL)"))
        if problems:
            raise ValidationError(problems)

    def check_storable(self) -> None:
        """Raise ValidationError listing what keeps this definition from being stored and answered: custom
        metadata that is not JSON within its bounds (too deep, too large, not valid Unicode), a description of more
        than MAX_DESCRIPTION characters. Checked before a definition is written, not when one is read: a
        definition stored before these bounds must still load, so it can be listed and dropped."""
        problems = []
        rule = json_problem(self.custom_metadata, MAX_CUSTOM_METADATA_DEPTH, MAX_CUSTOM_METADATA_BYTES)
        if rule is not None:
            problems.append(Problem(f"customMetadata {rule}"))
        if len(self.description) > MAX_DESCRIPTION:  # a str: validate() refused anything else
            problems.append(Problem(f"description must be at most {MAX_DESCRIPTION} characters, got "
                                    f"{len(self.description)}"))
        if problems:
            raise ValidationError(problems)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of this definition (the catalog stores it this way)."""
        return {
            "name": self.name,
            "version": self.version,
            "vector_dimension": self.vector_dimension,
            "vectors_are_sparse": self.vectors_are_sparse,
            "attribute_types": {k: v.value for k, v in self.attribute_types.items()},
            "permanent_attributes": list(self.permanent_attributes),
            "description": self.description,
            "custom_metadata": dict(self.custom_metadata),
        }

    def same_definition(self, other: DataSourceSpec) -> bool:
        """True when both define the same log schema (description and metadata aside)."""
        return (
            self.vector_dimension == other.vector_dimension
            and self.vectors_are_sparse == other.vectors_are_sparse
            and dict(self.attribute_types) == dict(other.attribute_types)
            and tuple(self.permanent_attributes) == tuple(other.permanent_attributes)
        )


@dataclass(frozen=True)
class IndexSpec:
    """An index over one data source: algorithm, metric, and which attributes identify, split, shard and
    travel with each result."""

    name: str
    version: str
    source_name: str
    source_version: str
    algorithm: str = "flat"
    metric: str = "cosine"
    params: Mapping[str, Any] = field(default_factory=dict)
    id_attributes: Sequence[str] = ()
    split_attributes: Sequence[str] = ()
    shard_attributes: Sequence[str] = ()
    payload_attributes: Sequence[str] | None = None  # None: every attribute of the data source
    shard_count: int = 1

    def __post_init__(self) -> None:
        check_name("index name", self.name)
        if not isinstance(self.version, str):
            check_name("index version", self.version)  # refuses it, naming the rule
        problems = _collection_problems(
            mappings={"params": self.params},
            names={"id_attributes": self.id_attributes, "split_attributes": self.split_attributes,
                   "shard_attributes": self.shard_attributes,
                   **({} if self.payload_attributes is None else {"payload_attributes": self.payload_attributes})},
        )
        for name in ("source_name", "source_version", "algorithm", "metric"):
            if not isinstance(getattr(self, name), str):
                problems.append(Problem(f"{name} must be a string, got {type(getattr(self, name)).__name__}"))
        if problems:
            raise ValidationError(problems)
        # A generation built aside or kept for rollback is stored as `{version}~g{n}` (shoal.catalog.
        # generations); `~` is no name character, so no index a user names can take such a version.
        base, hidden, generation = self.version.partition(GENERATION_MARK)
        check_name("index version", base)
        if hidden and not generation.isdigit():
            raise InvalidNameError(f"index version {self.version!r}: '~' is reserved for generations")
        for name in ("id_attributes", "split_attributes", "shard_attributes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.payload_attributes is not None:
            object.__setattr__(self, "payload_attributes", tuple(self.payload_attributes))
        object.__setattr__(self, "params", dict(self.params))

    @property
    def key_attributes(self) -> tuple[str, ...]:
        """Attributes every result carries besides the payload: id and split attributes."""
        return tuple(dict.fromkeys([*self.id_attributes, *self.split_attributes]))

    def stored_attributes(self) -> tuple[str, ...]:
        """Attributes an index segment stores per row: id, split and payload attributes, in that order."""
        return tuple(dict.fromkeys([*self.key_attributes, *(self.payload_attributes or ())]))


def _collection_problems(mappings: Mapping[str, Any], names: Mapping[str, Any]) -> list[Problem]:
    """What is wrong with a definition's collections (empty when nothing): each of `mappings` must be a mapping,
    each of `names` a list of strings (a lone string is refused: as a sequence it would be its characters)."""
    problems = []
    for field_name, value in mappings.items():
        if not isinstance(value, Mapping):
            problems.append(Problem(f"{field_name} must be a mapping, got {type(value).__name__}"))
    for field_name, value in names.items():
        if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence | np.ndarray):
            problems.append(Problem(f"{field_name} must be a list of attribute names, got {type(value).__name__}"))
        elif not all(isinstance(item, str) for item in value):
            bad = next(item for item in value if not isinstance(item, str))
            problems.append(Problem(f"{field_name} must hold attribute names (strings), got {type(bad).__name__}"))
    return problems


def unicode_text(value: Any) -> bool:
    """False for a string that UTF-8 cannot encode (one with a lone surrogate, which a JSON body can escape):
    Arrow, Parquet and Postgres hold UTF-8 only. True for anything else."""
    if not isinstance(value, str) or value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def storable_text(text: str) -> bool:
    """True when Postgres can store `text`: valid Unicode (no lone surrogate) without NUL characters."""
    return "\x00" not in text and unicode_text(text)


def json_depth(value: Any, limit: int) -> int:
    """How deeply `value` nests JSON arrays and objects (a scalar: 0; `{}`: 1), counted no further than
    `limit + 1`: enough to tell a value over the limit, whatever its real depth (no recursion either)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest


def json_problem(value: Any, max_depth: int, max_bytes: int) -> str | None:
    """What keeps `value` from being stored and answered as JSON (None when nothing does): nesting deeper than
    `max_depth`, more than `max_bytes` as compact UTF-8 JSON, a value JSON cannot hold (NaN, infinity, a
    non-JSON type), a lone surrogate, or a NUL character (Postgres's JSONB refuses both)."""
    if json_depth(value, max_depth) > max_depth:
        return f"must nest at most {max_depth} levels deep"
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return "must be valid Unicode (a lone surrogate cannot be stored)"
    except (TypeError, ValueError, RecursionError) as exc:
        return f"must be JSON (finite numbers, strings, booleans, null, arrays, objects): {exc}"
    if "\\u0000" in text:
        return "must not contain NUL characters"
    if size > max_bytes:
        return f"must be at most {max_bytes} bytes as JSON, got {size}"
    return None
