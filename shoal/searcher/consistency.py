"""The freshness a search asks for (DESIGN.md: eventual, at_least(token), strong)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Literal

from shoal.errors import ValidationError
from shoal.log.records import WriteToken

LEVELS = ("eventual", "at_least", "strong")
MAX_SEQ = 2**63 - 1  # seqs are bigint in the catalog


def check_seq(value: Any, what: str) -> int:
    """`value` as a seq: an integer (not a bool) in 0..2**63-1, else ValidationError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= MAX_SEQ:
        raise ValidationError(f"{what} must be a whole number in 0..{MAX_SEQ}, got {value!r:.100}")
    return int(value)


@dataclass(frozen=True)
class Consistency:
    """`eventual`: what the searcher serves now; `at_least`: every write up to `seq`; `strong`: every write
    committed before the search started. An unknown level, or a seq that is not a whole non-negative integer (or
    one given with another level than at_least), raises ValidationError.

    `data_source` and `data_source_version` name the data source whose log `seq` counts, when the seq came from a
    WriteToken that names it (empty for a bare seq): a search of an index over another data source is refused,
    since seqs of different logs are unrelated. They do not take part in equality, as in WriteToken."""

    level: Literal["eventual", "at_least", "strong"] = "eventual"
    seq: int = 0
    data_source: str = field(default="", compare=False)
    data_source_version: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        # Checked here, not at search time: an unknown level would otherwise run as strong (the search's
        # last branch), and a float seq be compared as given.
        if not isinstance(self.level, str) or self.level not in LEVELS:
            raise ValidationError(f"consistency level must be one of {', '.join(LEVELS)}, got {self.level!r:.100}")
        seq = check_seq(self.seq, "consistency seq")
        if seq and self.level != "at_least":
            raise ValidationError(f"consistency {self.level} takes no seq (got {seq}): use Consistency.at_least")
        object.__setattr__(self, "seq", seq)
        if not isinstance(self.data_source, str) or not isinstance(self.data_source_version, str):
            raise ValidationError(f"consistency data source must be a name and a version, got "
                                  f"{self.data_source!r:.100} {self.data_source_version!r:.100}")
        if self.data_source and self.level != "at_least":
            raise ValidationError(f"consistency {self.level} takes no write token: use Consistency.at_least")

    @classmethod
    def eventual(cls) -> Consistency:
        """Serve the loaded versions as they are (the default)."""
        return cls("eventual")

    @classmethod
    def at_least(cls, token: WriteToken | int) -> Consistency:
        """Reflect every write up to the token (read-your-writes across processes); a token that is neither a
        WriteToken nor a whole seq (1.9, None, "5", True) raises ValidationError rather than being rounded. A
        WriteToken naming its data source (as uploads return them) is good only for indexes over that data
        source: a search of another raises QueryError (a bare seq is taken as the searched data source's)."""
        if isinstance(token, WriteToken):
            return cls("at_least", check_seq(token.seq, "consistency at_least token"),
                       token.data_source or "", token.version or "")
        return cls("at_least", check_seq(token, "consistency at_least token"))

    @classmethod
    def strong(cls) -> Consistency:
        """Reflect every write committed before the search started."""
        return cls("strong")

    @classmethod
    def parse(cls, text: str) -> Consistency:
        """From `eventual`, `strong` or `at_least:<seq>` (as the CLI and HTTP headers write it); ValueError
        otherwise."""
        if text in ("eventual", "strong"):
            return cls(text)  # type: ignore[arg-type]
        seq = text.split(":", 1)[1] if text.startswith("at_least:") else ""
        # ASCII digits only: str.isdigit takes other scripts' digits and superscripts, which int() then reads
        # as a seq or refuses with its own message.
        if seq.isascii() and seq.isdigit():
            try:
                return cls("at_least", int(seq))
            except ValidationError as exc:  # a seq past the bigint range: the callers catch ValueError
                raise ValueError("; ".join(map(str, exc.problems))) from None
        raise ValueError(f"unknown consistency {text!r}: use eventual, strong or at_least:<seq>")
