"""Deterministic workloads shared by the child processes and the tests that check their results."""

from __future__ import annotations

import hashlib
import random

from shoal import DataPoint, DataSourceSpec, Tombstone

CRASH_SPEC = DataSourceSpec("Crash.Log", "1", 8, {"batch": "string", "i": "int64"}, ["batch", "i"])
MIX_SPEC = DataSourceSpec("Mix.Source", "1", 4, {"owner": "string", "k": "int64", "text": "string"}, ["owner", "k"])


def crash_batch_size(batch_id: str) -> int:
    """The size of a crash-test batch, derived from its id so a checker knows it without an ack."""
    return 1 + int(hashlib.sha1(batch_id.encode()).hexdigest()[:6], 16) % 150


def mix_batches(producer: int, rounds: int) -> list[list[DataPoint | Tombstone]]:
    """Producer `producer`'s batches: upserts, updates and deletes of its own keys and of shared keys."""
    rng = random.Random(producer)
    owner = f"p{producer}"
    out: list[list[DataPoint | Tombstone]] = []
    for r in range(rounds):
        batch: list[DataPoint | Tombstone] = []
        for _ in range(rng.randint(1, 12)):
            k = rng.randrange(40)
            if rng.random() < 0.25:
                batch.append(Tombstone({"owner": owner, "k": k}))
            else:
                batch.append(DataPoint({"owner": owner, "k": k, "text": f"{owner}-{k}-{r}"}, [producer, k, r, 1.0]))
        k = rng.randrange(10)
        batch.append(DataPoint({"owner": "shared", "k": k, "text": f"{owner}-shared-{r}"}, [producer, k, r, 0.0]))
        out.append(batch)
    return out


def expected_own_state(producer: int, rounds: int) -> dict[tuple[str, int], str]:
    """What producer `producer`'s own keys must hold once all its batches committed in order."""
    state: dict[tuple[str, int], str] = {}
    for batch in mix_batches(producer, rounds):
        for item in batch:
            if isinstance(item, Tombstone):
                state.pop((str(item.key["owner"]), int(item.key["k"])), None)  # type: ignore[call-overload]
            elif item.attributes["owner"] != "shared":
                state[(str(item.attributes["owner"]), int(item.attributes["k"]))] = str(item.attributes["text"])  # type: ignore[call-overload]
    return state
