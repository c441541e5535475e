"""Cleaning up: the GC queue and collector, the trash purge, and pruning of index versions."""
