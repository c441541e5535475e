"""The search headers that ask for an older state (time travel), read one way for every search route: the Vektonn
search (and its alias and fanned-out forms) and the dataset API's search.

`X-Shoal-Tag` names a tag (the versions it pinned); `X-Shoal-As-Of` a seq (a write token), plain digits 0-9.
A seq belongs to one data source's log and a tag to one index, so a search over several (multi-dataset search)
takes neither: `sent` says which of them a request carries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shoal.errors import ValidationError
from shoal.log.records import MAX_SEQ

TAG_HEADER = "X-Shoal-Tag"
AS_OF_HEADER = "X-Shoal-As-Of"
HEADERS = (TAG_HEADER, AS_OF_HEADER)


def int_header(headers: Mapping[str, str], name: str) -> int | None:
    """The header's seq (None when absent); ValidationError naming the header unless it is plain ASCII digits
    (around spaces) within 0..MAX_SEQ. int() alone would take `1_0` as 10, `+5`, or digits of other scripts.
    `headers` may be Starlette's (any case) or a mapping of lower-case names (the fast path's)."""
    raw = headers.get(name.lower())
    if raw is None:
        return None
    digits = raw.strip()
    if not (digits.isascii() and digits.isdigit()):
        raise ValidationError(f"header {name}: must be a non-negative integer of digits 0-9, got {raw!r}")
    value = int(digits)
    if not 0 <= value <= MAX_SEQ:
        raise ValidationError(f"header {name}: must be a seq between 0 and {MAX_SEQ}, got {raw!r}")
    return value


@dataclass(frozen=True)
class TimeTravel:
    """The older state a search asks for: a tag, a seq, or neither (the present)."""

    tag: str | None = None
    as_of: int | None = None


def sent(headers: Mapping[str, str]) -> list[str]:
    """The time-travel headers the request carries (their canonical names), in HEADERS' order."""
    return [h for h in HEADERS if h.lower() in headers]


def time_travel(headers: Mapping[str, str]) -> TimeTravel:
    """The tag and seq the headers ask for (each None when absent). The tag is passed on as sent: the searcher
    checks it is a legal name and exists. ValidationError naming the headers when both are sent (one state at a
    time), or naming X-Shoal-As-Of when its seq is malformed (`int_header`)."""
    if len(sent(headers)) == len(HEADERS):
        raise ValidationError(f"give header {TAG_HEADER} or {AS_OF_HEADER}, not both")
    return TimeTravel(headers.get(TAG_HEADER.lower()), int_header(headers, AS_OF_HEADER))
