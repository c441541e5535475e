"""JSON text stored in a string attribute (the dataset API's per-vector `metadata`) read back as one value.

The dataset API checks what it writes, but the Vektonn routes can write any text into the same attribute. Both
the answers (which carry the value) and the filters (which read its fields) read such text through
`stored_json`, so a filter never matches a field that the answer shows as plain text.
"""

from __future__ import annotations

import json
import math
from typing import Any

from shoal.log.records import json_depth

__all__ = ["MAX_JSON_DEPTH", "stored_json"]

# Of a dataset's (or a vector's) metadata: deeper values broke every answer carrying them (JSON encoders stop
# at 255 levels or at the recursion limit) and so every list holding the dataset; 32 leaves room for the two
# levels the dataset's definition adds within its data source's custom metadata (MAX_CUSTOM_METADATA_DEPTH).
MAX_JSON_DEPTH = 32


def _finite_float(text: str) -> float:
    """A JSON number as a float; ValueError when it overflows (`1e400`): no JSON value, nor answerable as JSON."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text}")
    return value


def _no_constant(name: str) -> Any:
    """Refuse `NaN`, `Infinity` and `-Infinity`, which Python's decoder takes but JSON (RFC 8259) has not."""
    raise ValueError(f"not JSON: {name}")


# One decoder for every call (json.loads with options builds one per call).
_DECODER = json.JSONDecoder(parse_float=_finite_float, parse_constant=_no_constant)


def stored_json(text: Any) -> Any:
    """Stored text as its JSON value; other text as it is (a str); anything else None.
    Text that is JSON only to Python's decoder (`NaN`, `Infinity`, numbers beyond a float's range), JSON
    nesting deeper than MAX_JSON_DEPTH (which the dataset API's uploads enforce) and JSON whose strings or keys
    escape lone surrogates (`"\\ud800"`: no UTF-8 encodes them) stay the text they are stored as: such a value
    breaks the encoders every answer goes through (or the decoder itself), or would be answered as something
    else."""
    if not isinstance(text, str):
        return None
    try:
        value = _DECODER.decode(text)
    except (ValueError, RecursionError):  # RecursionError: nested past the decoder's own limit
        return text
    return value if within_depth(text, value) and _encodable(text, value) else text


def within_depth(text: str, value: Any) -> bool:
    """Whether `value`, decoded from `text`, nests at most MAX_JSON_DEPTH levels. Counting brackets is a C-speed
    bound on the depth (brackets inside strings count too): most values are never walked."""
    limit = MAX_JSON_DEPTH
    return text.count("[") + text.count("{") <= limit or json_depth(value, limit) <= limit


def _encodable(text: str, value: Any) -> bool:
    # Stored text is valid UTF-8, so only a `\u` escape can decode to a lone surrogate: most values are never
    # encoded again here. The text itself holds the escape as ASCII, so it is answerable.
    if "\\u" not in text:
        return True
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
