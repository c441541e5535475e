"""Runs of upserts and of tombstones in an upload, in message order: each run becomes one columnar batch, and
later entries win over earlier ones for a key because the runs keep their order."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def runs(deleted: Sequence[bool] | np.ndarray) -> list[tuple[int, int]]:
    """The (start, end) slices that cover `deleted` in order, each holding only upserts or only tombstones."""
    flags = np.asarray(deleted, dtype=bool)
    edges = [0, *(np.flatnonzero(flags[1:] != flags[:-1]) + 1).tolist(), len(flags)]
    return list(zip(edges, edges[1:], strict=False))
