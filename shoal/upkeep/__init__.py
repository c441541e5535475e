"""Cleaning up: the GC queue and collector, drops (row deletes that queue their files in the same transaction),
the trash purge, and pruning of index versions (in `shoal.index.history`)."""
