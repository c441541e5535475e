"""The name of every Celery task Shoal runs, and its queues: the one place they are spelled.

Names are namespaced by the module that defines the task (`shoal.workers.tasks`), as Flower, the docs and
the beat schedule show them; they are part of the interface (queued messages carry them), so they never
change. This module imports nothing, so the Celery app, the triggers and any producer can use it.
"""

from __future__ import annotations

QUEUE = "shoal"  # index work and every task not routed elsewhere (the app's default queue)
# Beat's scheduled runs (UPKEEP below) go to a queue of their own that every worker consumes besides QUEUE: each
# run expires after its interval, so behind a backlog of builds in one FIFO queue every run expired before a
# worker reached it, and the upkeep stopped. The broker alternates between a worker's queues: neither starves.
UPKEEP_QUEUE = "shoal.upkeep"
QUEUES = (QUEUE, UPKEEP_QUEUE)  # what every worker consumes

_TASKS = "shoal.workers.tasks."

# Index work, one shard id per task.
MATERIALIZE_SHARD = _TASKS + "materialize_shard"
MERGE_SHARD = _TASKS + "merge_shard"
# Looks, a while after ingest, whether a shard's quick segments are due for their full-quality rebuild.
CHECK_REBUILD = _TASKS + "check_rebuild"
# Beat's sweeps that queue the index work above.
SWEEP = _TASKS + "sweep"
SWEEP_MERGES = _TASKS + "sweep_merges"
# The trash and the log's upkeep.
PURGE_TRASH = _TASKS + "purge_trash"
COMPACT_LOG = _TASKS + "compact_log"  # one data source id
SWEEP_COMPACTION = _TASKS + "sweep_compaction"
APPLY_RETENTION = _TASKS + "apply_retention"
COLLECT_GARBAGE = _TASKS + "collect_garbage"
# Reindex jobs and the generations they leave.
REINDEX = _TASKS + "reindex"  # one reindex job id
SWEEP_GENERATIONS = _TASKS + "sweep_generations"

ALL = (
    MATERIALIZE_SHARD, MERGE_SHARD, CHECK_REBUILD, SWEEP, SWEEP_MERGES, PURGE_TRASH, COMPACT_LOG, SWEEP_COMPACTION,
    APPLY_RETENTION, COLLECT_GARBAGE, REINDEX, SWEEP_GENERATIONS,
)

# The tasks beat schedules (shoal.workers.app.beat_schedule): routed to UPKEEP_QUEUE.
UPKEEP = (
    SWEEP, SWEEP_MERGES, SWEEP_GENERATIONS, PURGE_TRASH, SWEEP_COMPACTION, APPLY_RETENTION, COLLECT_GARBAGE,
)
