"""What a dataset is made of and the rules its definition must follow (no I/O here).

A dataset named N is the data source `N` version `1` with the fixed schema `ATTRIBUTES` (permanent
attribute `id`), plus its default index `N` version `1` (id attribute `id`, one shard, every attribute as
payload) with the dataset's metric and index type.
"""

from __future__ import annotations

import json
import re
from typing import Any

from shoal.datasets.errors import DatasetError, ErrorCode
from shoal.log.records import MAX_VECTOR_DIMENSION, AttributeType, json_depth

NAME_RE = re.compile(r"^[a-z0-9_-]{1,100}$")  # DESIGN.md invariant 7
# Data source names must start with a letter or digit (no name may form a hidden file or `..`), so the
# first character of a dataset name must too.
FIRST_CHAR_RE = re.compile(r"^[a-z0-9]")

# Names refused because they collide with routes, well-known words of the API or of operators, or values
# clients commonly send by mistake. Compared after the format check, so all are lower case.
RESERVED_NAMES: frozenset[str] = frozenset(
    {
        "admin", "api", "auth", "config", "datasets", "default", "health", "healthz", "internal", "metrics",
        "multi-dataset", "new", "none", "null", "root", "search", "shoal", "stats", "status", "system", "tenant",
        "tenants", "trash", "undefined", "v1",
    }
)

MIN_DIMENSIONS = 1
MAX_DIMENSIONS = MAX_VECTOR_DIMENSION  # the engines and the catalog cap dimensions at 10000

METRIC_TYPES = ("cosine", "euclidean", "manhattan", "dot_product")
INDEX_TYPES = ("flat", "hnsw", "ivf")
DEFAULT_METRIC = "cosine"
DEFAULT_INDEX = "hnsw"

VERSION = "1"  # the version of a dataset's data source and index
ATTRIBUTES: dict[str, AttributeType] = {
    "id": AttributeType.STRING,  # the vector's id, permanent: an upsert with a known id replaces it
    "document_id": AttributeType.STRING,  # "" when none
    "content": AttributeType.STRING,  # "" when none
    "metadata": AttributeType.STRING,  # JSON text; "null" when none
}
PERMANENT = ("id",)

MAX_DESCRIPTION = 10_000  # characters
MAX_METADATA_BYTES = 64 * 1024  # of the dataset's metadata as compact JSON
# Of a dataset's (or a vector's) metadata: deeper values broke every answer carrying them (JSON encoders stop
# at 255 levels or at the recursion limit) and so every list holding the dataset; 32 leaves room for the two
# levels the dataset's definition adds within its data source's custom metadata (MAX_CUSTOM_METADATA_DEPTH).
MAX_METADATA_DEPTH = 32
MAX_VECTOR_ID = 512  # characters of a vector id
MAX_VECTOR_METADATA_BYTES = 64 * 1024
MAX_TOP_K = 1000
MAX_MULTI_DATASETS = 32


def check_name(name: Any) -> str:
    """The name if it is a legal dataset name; INVALID_DATASET_NAME or RESERVED_DATASET_NAME otherwise."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise DatasetError(
            ErrorCode.INVALID_DATASET_NAME,
            f"invalid dataset name {name!r}: must match {NAME_RE.pattern}",
            {"name": name if isinstance(name, str) else repr(name), "pattern": NAME_RE.pattern},
        )
    if not FIRST_CHAR_RE.match(name):
        raise DatasetError(
            ErrorCode.INVALID_DATASET_NAME,
            f"invalid dataset name {name!r}: must start with a lower-case letter or a digit",
            {"name": name, "pattern": NAME_RE.pattern},
        )
    if name in RESERVED_NAMES:
        raise DatasetError(
            ErrorCode.RESERVED_DATASET_NAME,
            f"dataset name {name!r} is reserved",
            {"name": name, "reserved_names": sorted(RESERVED_NAMES)},
        )
    return name


def check_dimensions(dimensions: Any) -> int:
    """The dimension count if it is an integer in 1..10000; INVALID_DIMENSIONS otherwise."""
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not (
        MIN_DIMENSIONS <= dimensions <= MAX_DIMENSIONS
    ):
        raise DatasetError(
            ErrorCode.INVALID_DIMENSIONS,
            f"dimensions must be an integer in {MIN_DIMENSIONS}..{MAX_DIMENSIONS}, got {dimensions!r}",
            {"dimensions": dimensions, "min": MIN_DIMENSIONS, "max": MAX_DIMENSIONS},
        )
    return dimensions


def check_choice(field: str, value: Any, allowed: tuple[str, ...]) -> str:
    """`value` if it is one of `allowed`; INVALID_DATASET_CONFIG naming the field otherwise."""
    if not isinstance(value, str) or value not in allowed:
        raise DatasetError(
            ErrorCode.INVALID_DATASET_CONFIG,
            f"{field} must be one of {', '.join(allowed)}, got {value!r}",
            {"field": field, "allowed": list(allowed)},
        )
    return value


def check_index_config(config: Any) -> tuple[str | None, dict[str, Any] | None]:
    """A reindex's `index_config`: a JSON object of index parameters, optionally with the `index_type` to
    switch to. Returns (the index type or None, the parameters or None when it gives none);
    INVALID_DATASET_CONFIG naming the field when it is no object or names an unknown index type. The
    parameters' names and values are the engine's to check."""
    if not isinstance(config, dict):
        raise DatasetError(ErrorCode.INVALID_DATASET_CONFIG, "index_config must be a JSON object",
                           {"field": "index_config"})
    params = dict(config)
    index_type = params.pop("index_type", None)
    if index_type is not None:
        index_type = check_choice("index_config.index_type", index_type, INDEX_TYPES)
    return index_type, params or None


def is_text(value: Any, *, nul: bool = True) -> bool:
    """True for a string that UTF-8 can encode (no lone surrogates) and, unless `nul`, holds no NUL
    character (Postgres text and JSONB cannot store one)."""
    if not isinstance(value, str) or (not nul and "\x00" in value):
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_description(description: Any) -> str | None:
    """A description: null or a string of at most 10000 characters (no NUL, valid Unicode)."""
    if description is not None and (
        not is_text(description, nul=False) or len(description) > MAX_DESCRIPTION
    ):
        raise DatasetError(
            ErrorCode.INVALID_DATASET_CONFIG,
            f"description must be null or a string of at most {MAX_DESCRIPTION} characters (no NUL)",
            {"field": "description"},
        )
    return description


def check_metadata(
    metadata: Any, field: str = "metadata", limit: int = MAX_METADATA_BYTES, *, nul: bool = False
) -> dict[str, Any] | None:
    """Metadata: null or a JSON object nested at most MAX_METADATA_DEPTH levels deep, of at most `limit` bytes
    as compact JSON, finite numbers, valid Unicode and (unless `nul`) no NUL character. Checked before anything
    is written."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise DatasetError(ErrorCode.INVALID_DATASET_CONFIG, f"{field} must be null or a JSON object", {"field": field})
    if json_depth(metadata, MAX_METADATA_DEPTH) > MAX_METADATA_DEPTH:
        raise DatasetError(
            ErrorCode.INVALID_DATASET_CONFIG,
            f"{field} must nest at most {MAX_METADATA_DEPTH} levels deep",
            {"field": field, "max_depth": MAX_METADATA_DEPTH},
        )
    try:
        text = json_text(metadata)
        size = len(text.encode())
    except (TypeError, ValueError, RecursionError) as exc:
        raise DatasetError(
            ErrorCode.INVALID_DATASET_CONFIG, f"{field} is not JSON-serializable: {exc}", {"field": field}
        ) from None
    if not nul and "\\u0000" in text:
        raise DatasetError(ErrorCode.INVALID_DATASET_CONFIG, f"{field} must not contain NUL characters",
                           {"field": field})
    if size > limit:
        raise DatasetError(
            ErrorCode.INVALID_DATASET_CONFIG,
            f"{field} must be at most {limit} bytes as JSON, got {size}",
            {"field": field, "max_bytes": limit},
        )
    return metadata


def json_text(value: Any) -> str:
    """Compact JSON text (finite numbers only, so every JSON parser reads it back)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
