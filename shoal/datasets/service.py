"""The dataset service: create, list, read, update, delete, stats, upsert and search datasets of one tenant.

HTTP-free: takes plain values, answers with the frozen values of `shoal.datasets.results` and raises
`shoal.errors.DatasetError` (with a `shoal.datasets.errors.ErrorCode`) or another core error; `shoal.api`
turns those into responses. The operations live by idea:

- `lifecycle`: create (or overwrite), list, read, update, reindex;
- `deletion`: delete (soft into the trash, or hard), list the trash, restore, purge;
- `stats`: exact figures read through the checked log reader;
- `uploads`: upsert vectors;
- `search`: one dataset, or several merged.

`scope.DatasetScope` holds what they share (handles, lookups, cache, dropping a dataset), and
`files` the mirror and the one place the service deletes files itself (`files.forget_files`).
"""

from __future__ import annotations

from shoal.datasets.deletion import Deletions
from shoal.datasets.lifecycle import Lifecycle
from shoal.datasets.search import Search, consistency_of, match_of
from shoal.datasets.stats import Stats
from shoal.datasets.uploads import Uploads

__all__ = ["DatasetService", "consistency_of", "match_of"]


class DatasetService(Lifecycle, Deletions, Stats, Uploads, Search):
    """Every dataset operation for the tenant `shoal` is scoped to. One instance per request is cheap (it holds
    references only); the cache is shared by the process."""
