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
from shoal.log.json_text import MAX_JSON_DEPTH
from shoal.log.records import DATASET_VERSION, MAX_VECTOR_DIMENSION, AttributeType, json_depth, unicode_text

NAME_RE = re.compile(r"^[a-z0-9_-]{1,100}$")  # DESIGN.md invariant 7
# Data source names must start with a letter or digit (no name may form a hidden file or `..`), so the
# first character of a dataset name must too.
FIRST_CHAR_RE = re.compile(r"^[a-z0-9]")

# Names refused because they collide with routes, well-known words of the API or of operators, or values
# clients commonly send by mistake. Compared after the format check, so all are lower case.
RESERVED_NAMES: frozenset[str] = frozenset(
    {
        "admin", "api", "auth", "config", "datasets", "default", "health", "healthz", "internal", "metrics",
        "multi-dataset", "new", "none", "null", "root", "search", "shared", "shoal", "stats", "status", "system",
        "tenant", "tenants", "trash", "undefined", "v1",
    }
)

MIN_DIMENSIONS = 1
MAX_DIMENSIONS = MAX_VECTOR_DIMENSION  # the engines and the catalog cap dimensions at 10000

METRIC_TYPES = ("cosine", "euclidean", "manhattan", "dot_product")
INDEX_TYPES = ("flat", "hnsw", "ivf")
DEFAULT_METRIC = "cosine"
DEFAULT_INDEX = "hnsw"
# `index_type: "default"` (or none given) is hnsw, or flat for a metric hnsw cannot serve: of the engines
# (shoal/engines/) only flat computes manhattan distances.
DEFAULT_INDEX_VALUE = "default"
FLAT_ONLY_METRICS = frozenset({"manhattan"})

# The dataset API's index parameters (the engines accept wider ranges; these are the API's rules). Parameters
# left out take these defaults, so `{M, ef_construction}` alone is a complete HNSW configuration.
INDEX_DEFAULTS: dict[str, dict[str, int]] = {
    "hnsw": {"M": 16, "ef_construction": 200, "ef_search": 50},
    "ivf": {"nlist": 100, "nprobe": 10},
    "flat": {},
}
# Inclusive ranges; nprobe's upper bound is the nlist in effect.
PARAM_RANGES: dict[str, tuple[int, int]] = {
    "M": (8, 64), "ef_construction": (100, 500), "ef_search": (10, 500), "nlist": (1, 1 << 20), "nprobe": (1, 1 << 20),
}

VERSION = DATASET_VERSION  # the version of a dataset's data source and index
ATTRIBUTES: dict[str, AttributeType] = {
    "id": AttributeType.STRING,  # the vector's id, permanent: an upsert with a known id replaces it
    "document_id": AttributeType.STRING,  # "" when none
    "content": AttributeType.STRING,  # "" when none
    "metadata": AttributeType.STRING,  # JSON text; "null" when none
}
PERMANENT = ("id",)

MAX_DESCRIPTION = 10_000  # characters
MAX_METADATA_BYTES = 64 * 1024  # of the dataset's metadata as compact JSON
MAX_METADATA_DEPTH = MAX_JSON_DEPTH  # of a dataset's (or a vector's) metadata: see shoal.log.json_text
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


def allowed_range(low: int, high: int) -> dict[str, int]:
    """An inclusive range as error details show it."""
    return {"min": low, "max": high}


def out_of_range(field: str, value: Any, low: int, high: int) -> DatasetError:
    """INVALID_DATASET_CONFIG for a number outside its range: `{field, value, allowed_range}` in the details."""
    return DatasetError(
        ErrorCode.INVALID_DATASET_CONFIG,
        f"{field} must be an integer in {low}..{high}, got {value!r}",
        {"field": field, "value": value, "allowed_range": allowed_range(low, high)},
    )


def check_dimensions(dimensions: Any) -> int:
    """The dimension count if it is an integer in 1..10000: not an integer is INVALID_DIMENSIONS, an integer out
    of range INVALID_DATASET_CONFIG with `{field, value, allowed_range}` (as specified)."""
    if isinstance(dimensions, bool) or not isinstance(dimensions, int):
        raise DatasetError(
            ErrorCode.INVALID_DIMENSIONS,
            f"dimensions must be an integer in {MIN_DIMENSIONS}..{MAX_DIMENSIONS}, got {dimensions!r}",
            {"field": "dimensions", "value": dimensions,
             "allowed_range": allowed_range(MIN_DIMENSIONS, MAX_DIMENSIONS)},
        )
    if not MIN_DIMENSIONS <= dimensions <= MAX_DIMENSIONS:
        raise out_of_range("dimensions", dimensions, MIN_DIMENSIONS, MAX_DIMENSIONS)
    return dimensions


def default_index_type(metric_type: str) -> str:
    """The index type `"default"` stands for with this metric: hnsw, or flat where hnsw lacks the metric."""
    return "flat" if metric_type in FLAT_ONLY_METRICS else DEFAULT_INDEX


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def index_params_of(index_type: str, given: Any, field: str) -> dict[str, Any]:
    """The parameters of an index of `index_type` from those given (a JSON object or None): the ones left out
    take `INDEX_DEFAULTS` (a left-out nprobe at most the nlist given), and integers must lie in `PARAM_RANGES`
    (nprobe at most the nlist in effect), else INVALID_DATASET_CONFIG with `{field, value, allowed_range}`.
    Unknown names and values of the wrong type are left for the engine to refuse (`resolve_index`), which
    names them."""
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise DatasetError(ErrorCode.INVALID_DATASET_CONFIG, f"{field} must be null or a JSON object",
                           {"field": field})
    params = {**INDEX_DEFAULTS.get(index_type, {}), **given}
    nlist = params.get("nlist")
    if "nprobe" in params and "nprobe" not in given and _is_int(nlist) and nlist >= PARAM_RANGES["nlist"][0]:
        # The default nprobe (10) is no choice of the caller's: with fewer lists it probes them all, so that
        # `{nlist: 8}` alone is a complete configuration rather than a refusal naming an nprobe never sent.
        params["nprobe"] = min(params["nprobe"], nlist)
    for name, value in params.items():
        if name in PARAM_RANGES and name in INDEX_DEFAULTS.get(index_type, {}) and _is_int(value):
            low, high = PARAM_RANGES[name]
            if name == "nprobe" and _is_int(params.get("nlist")):
                high = params["nlist"]
            if not low <= value <= high:
                raise out_of_range(f"{field}.{name}", value, low, high)
    return params


def check_index_choice(
    metric_type: str, index_type: Any, index_params: Any, index_config: Any
) -> tuple[str, dict[str, Any]]:
    """The index type and complete parameters of a new dataset from its request: `index_config` (the
    specified form: the parameters, optionally with `index_type`) or `index_params` (the older one), not
    both; `index_type` None or `"default"` is `default_index_type(metric_type)`."""
    field = "index_params"
    given = index_params
    if index_config is not None:
        if index_params is not None:
            raise DatasetError(ErrorCode.INVALID_DATASET_CONFIG,
                               "give the parameters in index_config or in index_params, not both",
                               {"field": "index_params"})
        config_type, given = check_index_config(index_config)
        field = "index_config"
        if config_type not in (None, DEFAULT_INDEX_VALUE):
            if index_type not in (None, DEFAULT_INDEX_VALUE) and index_type != config_type:
                raise DatasetError(
                    ErrorCode.INVALID_DATASET_CONFIG,
                    f"index_type {index_type!r} and index_config.index_type {config_type!r} disagree",
                    {"field": "index_config.index_type"},
                )
            index_type = config_type
    if index_type is None or index_type == DEFAULT_INDEX_VALUE:
        index_type = default_index_type(metric_type)
    index_type = check_choice("index_type", index_type, (*INDEX_TYPES, DEFAULT_INDEX_VALUE))
    return index_type, index_params_of(index_type, given, field)


def check_custom_metadata(metadata: dict[str, Any] | None, field: str = "metadata") -> dict[str, Any] | None:
    """The custom fields a dataset's metadata may hold are typed: `quota_limit` a positive integer (the most
    vectors the dataset may hold), `tags` a list of strings, `retention_days` a non-negative integer;
    INVALID_DATASET_CONFIG naming the field otherwise."""
    if metadata is None:
        return None
    checks = (
        ("quota_limit", lambda v: _is_int(v) and v > 0, "a positive integer"),
        ("tags", lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v), "a list of strings"),
        ("retention_days", lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    )
    for key, ok, what in checks:
        if key in metadata and not ok(metadata[key]):
            raise DatasetError(ErrorCode.INVALID_DATASET_CONFIG, f"{field}.{key} must be {what}, got {metadata[key]!r}",
                               {"field": f"{field}.{key}", "value": metadata[key], "expected": what})
    return metadata


def quota_limit(metadata: dict[str, Any] | None) -> int | None:
    """The dataset's `metadata.quota_limit` (checked on create and update), None when it has none."""
    value = (metadata or {}).get("quota_limit")
    return value if _is_int(value) and value > 0 else None


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
        index_type = check_choice("index_config.index_type", index_type, (*INDEX_TYPES, DEFAULT_INDEX_VALUE))
    return index_type, params or None


def is_text(value: Any, *, nul: bool = True) -> bool:
    """True for a string that UTF-8 can encode (no lone surrogates) and, unless `nul`, holds no NUL
    character (Postgres text and JSONB cannot store one)."""
    return isinstance(value, str) and (nul or "\x00" not in value) and unicode_text(value)


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
