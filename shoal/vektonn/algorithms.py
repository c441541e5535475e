"""Vektonn's index algorithm names mapped onto Shoal's (algorithm, metric, params).

FaissIndex.L2 is flat + l2_squared and FaissIndex.IP flat + dot_product; given Vektonn's HNSW parameters
(Hnsw_M, Hnsw_EfConstruction, Hnsw_EfSearch, as Vektonn.Index's IndexParamsKeys names them; M, EfConstruction,
EfSearch are taken too: all or none) they become hnsw with the same metric. SparnnIndex.Cosine is flat_sparse +
cosine and takes no parameters. Vektonn passes parameter values as strings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shoal.engines.base import get_engine
from shoal.engines.metrics import Metric
from shoal.engines.params import reject_unknown
from shoal.errors import ValidationError

# Vektonn type name -> (Shoal algorithm without HNSW params, metric, accepts HNSW params)
VEKTONN_TYPES: dict[str, tuple[str, Metric, bool]] = {
    "FaissIndex.L2": ("flat", Metric.L2_SQUARED, True),
    "FaissIndex.IP": ("flat", Metric.DOT_PRODUCT, True),
    "SparnnIndex.Cosine": ("flat_sparse", Metric.COSINE, False),
}
HNSW_PARAM_NAMES = {"M": "M", "EfConstruction": "ef_construction", "EfSearch": "ef_search"}
# Vektonn.Index reads its HNSW parameters under these keys (IndexParamsKeys.Hnsw); the short names above, which
# Shoal took first, stay accepted as aliases.
VEKTONN_PREFIX = "Hnsw_"
HNSW_ALIASES = {**{VEKTONN_PREFIX + name: name for name in HNSW_PARAM_NAMES},
                **{name: name for name in HNSW_PARAM_NAMES}}


def _parse_int(value: Any) -> Any:
    # Strings of digits become ints; anything else is left for the engine's rules to reject by name.
    # ASCII digits only: str.isdigit() also takes superscripts ("²"), which int() refuses (a 500).
    digits = value.strip().lstrip("+") if isinstance(value, str) else ""
    if digits.isascii() and digits.isdigit():
        return int(value)
    return value


def from_vektonn(type_name: str, params: Mapping[str, str] | None) -> tuple[str, Metric, dict[str, Any]]:
    """The (algorithm, metric, normalized params) of a Vektonn index type; unknown names or params raise
    ValidationError."""
    try:
        algorithm, metric, hnsw_capable = VEKTONN_TYPES[type_name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(VEKTONN_TYPES))
        raise ValidationError(f"unknown Vektonn index type {type_name!r} (known: {known})") from None
    params = dict(params or {})
    reject_unknown(type_name, params, HNSW_ALIASES if hnsw_capable else ())
    # Each parameter under its short name, once: `Hnsw_M` and `M` together name one parameter twice.
    short: dict[str, Any] = {}
    for key, value in params.items():
        name = HNSW_ALIASES[key]
        if name in short:
            raise ValidationError(f"HNSW parameter {VEKTONN_PREFIX + name} is given twice (as {VEKTONN_PREFIX + name} "
                                  f"and {name})")
        short[name] = value
    given = [name for name in HNSW_PARAM_NAMES if name in short]
    if given and len(given) < len(HNSW_PARAM_NAMES):
        # Named as the caller wrote the others: Vektonn's keys unless every one given was a short name.
        prefix = "" if all(key in HNSW_PARAM_NAMES for key in params) else VEKTONN_PREFIX
        missing = ", ".join(prefix + n for n in HNSW_PARAM_NAMES if n not in short)
        raise ValidationError(f"HNSW parameters must be given all or none: missing {missing}")
    if given:
        algorithm = "hnsw"
    engine = get_engine(algorithm)
    shoal_params = {HNSW_PARAM_NAMES[n]: _parse_int(v) for n, v in short.items()}
    return algorithm, engine.check_metric(metric), engine.normalize_params(shoal_params)
