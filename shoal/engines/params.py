"""Checking engine parameters: integers in a range, no unknown keys. Every rule names its parameter."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from shoal.errors import ValidationError


def reject_unknown(algorithm: str, params: Mapping[str, Any], known: Iterable[str]) -> None:
    """Raise ValidationError naming every key of `params` that is not in `known`."""
    allowed = sorted(known)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        accepted = ", ".join(allowed) if allowed else "none"
        raise ValidationError(
            f"algorithm {algorithm!r} does not take parameter(s) {', '.join(map(repr, unknown))} (accepted: {accepted})"
        )


def int_param(name: str, value: Any, low: int, high: int) -> int:
    """`value` as an int in [low, high]; anything else (bools, floats, strings) raises ValidationError."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise ValidationError(f"parameter {name!r} must be an integer in {low}..{high} (got {value!r})")
    if not low <= value <= high:
        raise ValidationError(f"parameter {name!r} must be an integer in {low}..{high} (got {value})")
    return int(value)
