"""The byte layout of a serialized engine: a JSON header and the engine's binary sections.

Layout: MAGIC, a little-endian uint32 header length, the UTF-8 JSON header, then the sections back to back.
The header names the algorithm and metric (checked on load, so an artifact is never read as something it is
not) and lists the section lengths; the rest of it belongs to the engine.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from shoal.errors import ValidationError

MAGIC = b"SHOALENG1"
_LEN = struct.Struct("<I")


def array_section(array: np.ndarray, dtype: str) -> memoryview:
    """A zero-copy byte view of an array, as `dtype` (e.g. "<f4": explicit byte order keeps files portable)."""
    flat = np.ascontiguousarray(array, dtype=dtype).reshape(-1)
    return memoryview(flat.view(np.uint8))


def _byte_view(section: bytes | memoryview) -> memoryview:
    view = memoryview(section)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def pack(header: dict[str, Any], sections: list[bytes | memoryview]) -> bytes:
    """One bytes object holding the header (plus section lengths) and the sections."""
    views = [_byte_view(s) for s in sections]
    head = json.dumps({**header, "sections": [len(v) for v in views]}).encode()
    return b"".join([MAGIC, _LEN.pack(len(head)), head, *views])


def unpack(data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], list[memoryview]]:
    """The header and zero-copy views of the sections; malformed data raises ValidationError."""
    view = memoryview(data).cast("B")
    fixed = len(MAGIC) + _LEN.size
    if len(view) < fixed or bytes(view[: len(MAGIC)]) != MAGIC:
        raise ValidationError("not a serialized Shoal engine (bad magic)")
    (head_len,) = _LEN.unpack(view[len(MAGIC) : fixed])
    try:
        header = json.loads(bytes(view[fixed : fixed + head_len]))
        lengths = [int(n) for n in header.pop("sections")]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValidationError(f"serialized engine has a malformed header: {exc}") from None
    pos = fixed + head_len
    if pos + sum(lengths) != len(view):
        raise ValidationError("serialized engine is truncated or has trailing bytes")
    sections = []
    for n in lengths:
        sections.append(view[pos : pos + n])
        pos += n
    return header, sections
