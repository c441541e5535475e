"""The freshness a search asks for (DESIGN.md: eventual, at_least(token), strong)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shoal.log.records import WriteToken


@dataclass(frozen=True)
class Consistency:
    """`eventual`: what the searcher serves now; `at_least`: every write up to `seq`; `strong`: every write
    committed before the search started."""

    level: Literal["eventual", "at_least", "strong"] = "eventual"
    seq: int = 0

    @classmethod
    def eventual(cls) -> Consistency:
        """Serve the loaded versions as they are (the default)."""
        return cls("eventual")

    @classmethod
    def at_least(cls, token: WriteToken | int) -> Consistency:
        """Reflect every write up to the token (read-your-writes across processes)."""
        return cls("at_least", token.seq if isinstance(token, WriteToken) else int(token))

    @classmethod
    def strong(cls) -> Consistency:
        """Reflect every write committed before the search started."""
        return cls("strong")

    @classmethod
    def parse(cls, text: str) -> Consistency:
        """From `eventual`, `strong` or `at_least:<seq>` (as the CLI and HTTP headers write it)."""
        if text in ("eventual", "strong"):
            return cls(text)  # type: ignore[arg-type]
        if text.startswith("at_least:") and text.split(":", 1)[1].isdigit():
            return cls("at_least", int(text.split(":", 1)[1]))
        raise ValueError(f"unknown consistency {text!r}: use eventual, strong or at_least:<seq>")
