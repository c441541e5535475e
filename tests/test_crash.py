"""Acknowledged means durable: SIGKILL the writer at random moments, many times, then check the log."""

from __future__ import annotations

import json
import os
import random
import select
import signal
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from conftest import run_helper
from helpers.workload import CRASH_SPEC, crash_batch_size

from shoal import Shoal

pytestmark = pytest.mark.slow  # SIGKILLs child processes many times

KILLS = {"local": 14, "s3": 7}


def _read_first_line(proc, timeout: float) -> str | None:  # type: ignore[no-untyped-def]
    """Wait (bounded) until the child acknowledges its first batch; None if it never does."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else None


def test_sigkill_at_random_moments_loses_no_acknowledged_batch(shoal: Shoal, storage_kind: str) -> None:
    shoal.create_data_source(CRASH_SPEC)
    rng = random.Random(20261122)
    acked: dict[str, int] = {}
    for run in range(KILLS[storage_kind]):
        proc = run_helper("crash_writer.py", [f"r{run}"], shoal.settings)
        first = _read_first_line(proc, timeout=60)
        assert first, f"writer run {run} acknowledged nothing: {proc.stderr.read() if proc.poll() is not None else ''}"
        lines = [first]
        # Kill at a random moment of the stream: anywhere from right after the first ack to ~0.6 s later,
        # which lands in validation, mid file write, mid transaction or between commit and ack.
        deadline_lines = rng.randint(0, 40)
        while len(lines) <= deadline_lines:
            ready, _, _ = select.select([proc.stdout], [], [], 5)
            if not ready:
                break
            lines.append(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        for line in lines + rest.splitlines():
            if line.strip():
                ack = json.loads(line)
                acked[ack["batch"]] = ack["seq"]

    record = shoal.get_data_source(CRASH_SPEC.name, CRASH_SPEC.version)
    head = record.head_seq
    assert len(acked) > KILLS[storage_kind]

    # Seqs are dense and strictly increasing: segments tile 1..head with no gap and no overlap.
    segments = shoal.log_segments(CRASH_SPEC.name, CRASH_SPEC.version)
    expected_first = 1
    for seg in segments:
        assert seg.first_seq == expected_first
        expected_first = seg.last_seq + 1
    assert expected_first - 1 == head

    # Every referenced file exists and matches its checksum (read_log verifies before yielding).
    log = pa.Table.from_batches(list(shoal.read_log(CRASH_SPEC.name, CRASH_SPEC.version)))
    seqs = log["__seq"].to_numpy()
    np.testing.assert_array_equal(seqs, np.arange(1, head + 1))

    rows = Counter(log["batch"].to_pylist())
    last_seq: dict[str, int] = {}
    for batch, seq in zip(log["batch"].to_pylist(), seqs.tolist(), strict=True):
        last_seq[batch] = max(seq, last_seq.get(batch, 0))
    # No batch is partly visible, and none was written twice.
    for batch, count in rows.items():
        assert count == crash_batch_size(batch), f"batch {batch} has {count} of {crash_batch_size(batch)} rows"
    # Every acknowledged batch is readable in full, at the seqs its token names.
    for batch, token in acked.items():
        assert batch in rows, f"acknowledged batch {batch} (token {token}) is missing"
        assert last_seq[batch] == token
    # Keys are unique per batch row, so the folded state holds every row of the log.
    assert shoal.fold(CRASH_SPEC.name, CRASH_SPEC.version).num_rows == head


    files = set(shoal.storage.list_files(shoal.log_dir(CRASH_SPEC.name, CRASH_SPEC.version)))
    print(f"{len(acked)} acked batches, {head} seqs, {len(segments)} segments, "
          f"{len(files - {s.path for s in segments})} unreferenced files left by crashes")
