"""A Vektonn upload body read in two parts: the dense coordinates by simdjson straight into one float64 matrix,
everything else by orjson.

Why: a 1,000-point 384-d body is about 7.5 MB, nearly all of it coordinates. orjson makes a Python float per
coordinate (about 80 ns each, 30 ms a batch, more than the whole in-process write). simdjson parses numbers without
making Python objects, but walking its document from Python costs a proxy object per item, key and value (about
13 us a point, more than its parse). So the body is cut instead: each `"coordinates": [...]` array is found with
`bytes.find` (memchr speed), parsed by simdjson on its own and copied out as one row of doubles; the rest of the
body (a few percent of it), with each array replaced by a placeholder holding its ordinal, is read by orjson,
which reads every other body, so its rules (duplicate keys, strings, big integers) are the usual ones.

This reader only ever speeds up the common case. It answers None whenever it cannot prove that its result is
orjson's reading of the body (apart from the coordinates, which come as doubles): the caller then parses the body
the usual way, which decides (and words) everything. How the proof goes:

* a match of `"coordinates"` ends a JSON string (inside a string that quote would be escaped, preceded by a
  backslash, not by `s`), so when `:` and `[` follow, that `[` opens the array value of a key ending in
  `coordinates`;
* an array holding no `"` and no `[` before its first `]` is flat and holds no string, so that `]` closes it; any
  other is left to the usual way;
* the n-th array (in body order) is replaced by the placeholder `[n]`, an array of one integer. An array the
  body itself holds under the key `coordinates` would be cut out too, unless the key is spelled with escapes
  (`"coordinat\\u0065s"`, which `bytes.find` does not see and orjson reads as `coordinates`): a body with an
  array under a key written with a `\\u` escape of letters is left to the usual way, so no value of the body can
  be taken for a placeholder (a number cannot: the placeholder is an array);
* the caller checks that the n-th dense upsert's `coordinates` is the placeholder `[n]` and that there are as
  many arrays as upserts: an array under another key or a key given twice breaks that count, and the usual way
  reads the body instead.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import numpy as np
import orjson
import simdjson

_KEY = b'"coordinates"'
# JSON's own whitespace around the colon, then the array's bracket.
_OPENS = re.compile(rb"[ \t\r\n]*:[ \t\r\n]*\[")
# The end of a key written with a \u escape (then letters or escapes: `coordinates` spelled otherwise) whose
# value is an array: the one way the body could hold an array where a placeholder stands.
_SPELLED_KEY_ARRAY = re.compile(rb'\\u[0-9A-Fa-f]{4}(?:[A-Za-z]|\\u[0-9A-Fa-f]{4})*"[ \t\r\n]*:[ \t\r\n]*\[')
# Parsers kept for reuse (making one costs its buffers); a parser holds one document at a time and is not thread
# safe, so each is lent to one thread. Each reads one vector at a time, so its buffers stay small.
_KEEP = 4
_idle: list[simdjson.Parser] = []
_idle_lock = threading.Lock()


def load_dense(body: bytes) -> tuple[Any, np.ndarray] | None:
    """orjson's reading of the body with the n-th `coordinates` array (in body order) replaced by the placeholder
    `[n]` (a list of one int, see `is_placeholder`), and those arrays as one float64 matrix, row n the n-th; None
    when the body has no such array, when they are not all flat arrays of numbers of one length, when the rest of
    the body holds an array under a key spelled with a `\\u` escape (it could stand where a placeholder does), or
    when either part cannot be read (the caller then parses the body the usual way). The caller must check that
    each placeholder stands where a vector's coordinates do."""
    spans = _coordinate_spans(body)
    if not spans:
        return None
    # Slices of bytes, not memoryviews: bytes.join took memoryviews at a third of the speed.
    parts: list[bytes] = []
    prev = 0
    for n, (start, end) in enumerate(spans):
        parts.append(body[prev:start])
        parts.append(b"[%d]" % n)
        prev = end
    parts.append(body[prev:])
    # The body's own parts (the even ones) only: a cut never splits a key from its value, as each ends before an
    # array's `[` and starts after its `]`.
    search = _SPELLED_KEY_ARRAY.search
    if any(b"\\u" in part and search(part) for part in parts[::2]):
        return None
    try:
        rest = orjson.loads(b"".join(parts))
    except orjson.JSONDecodeError:
        return None
    matrix = _parse_rows(body, spans)
    return None if matrix is None else (rest, matrix)


def is_placeholder(value: Any, n: int) -> bool:
    """Whether `value`, read from `load_dense`'s rest of the body, is the placeholder of its n-th array."""
    return type(value) is list and len(value) == 1 and type(value[0]) is int and value[0] == n


def _coordinate_spans(body: bytes) -> list[tuple[int, int]]:
    """(start, end) of every flat `coordinates` array: from its `[` to just past its `]`. Empty when an array
    of that key is not flat (the usual way then reads the body)."""
    find, opens = body.find, _OPENS.match
    spans: list[tuple[int, int]] = []
    at = find(_KEY)
    while at != -1:
        after = at + len(_KEY)
        opened = opens(body, after)
        if opened is None:  # a string value, or a key with a value of another kind: orjson reads it
            at = find(_KEY, after)
            continue
        start = opened.end() - 1
        end = find(b"]", start)
        if end == -1 or find(b'"', start, end) != -1 or find(b"[", start + 1, end) != -1:
            return []
        spans.append((start, end + 1))
        at = find(_KEY, end)
    return spans


def _parse_rows(body: bytes, spans: list[tuple[int, int]]) -> np.ndarray | None:
    """The arrays at `spans` as a float64 [len(spans), width] matrix, or None unless each is a JSON array of
    `width` numbers (the same width for all).

    Each array is parsed on its own: a parse of a few kilobytes stays in the cache, and joining them into one
    document first cost 1-4 ms of copying (a fresh 7 MB buffer) for the same parse time."""
    with _idle_lock:
        parser = _idle.pop() if _idle else None
    parser = parser or simdjson.Parser()
    try:
        matrix = _rows(parser, body, spans)
    except (ValueError, RuntimeError, TypeError):  # invalid JSON, a value that is not a number, a big integer
        return None  # the parser is dropped: it may be in any state
    with _idle_lock:
        if len(_idle) < _KEEP:
            _idle.append(parser)
    return matrix


def _rows(parser: simdjson.Parser, body: bytes, spans: list[tuple[int, int]]) -> np.ndarray | None:
    """_parse_rows's matrix, read with `parser`; None at the first array of no numbers or of another width."""
    parse, frombuffer, double = parser.parse, np.frombuffer, np.float64
    matrix: np.ndarray | None = None
    for n, (start, end) in enumerate(spans):
        document = parse(body[start:end])
        # as_buffer would flatten a nested array: the spans hold none (simd_upload._coordinate_spans).
        row = frombuffer(document.as_buffer(of_type="d"), dtype=double)
        del document  # no proxy of a document outlives its parse, so the parser can read the next one
        if matrix is None:
            if not len(row):
                return None
            matrix = np.empty((len(spans), len(row)), dtype=double)
        elif len(row) != matrix.shape[1]:
            return None
        matrix[n] = row
    return matrix
