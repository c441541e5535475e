"""Eight producer processes on one data source: the folded state is the expected one."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from conftest import run_helper
from helpers.workload import MIX_SPEC, expected_own_state

from shoal import Shoal

pytestmark = pytest.mark.slow  # eight producer processes

PRODUCERS, ROUNDS = 8, 40


def test_eight_producer_processes(shoal: Shoal) -> None:
    shoal.create_data_source(MIX_SPEC)
    procs = [run_helper("mix_producer.py", [str(p), str(ROUNDS)], shoal.settings) for p in range(PRODUCERS)]
    tokens: dict[int, list[int]] = {}
    for p, proc in enumerate(procs):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        tokens[p] = json.loads(out)

    # Each producer's batches landed in the order it sent them, and no two batches share a seq.
    all_tokens = [t for ts in tokens.values() for t in ts]
    assert len(set(all_tokens)) == PRODUCERS * ROUNDS
    for ts in tokens.values():
        assert ts == sorted(ts)
    head = shoal.get_data_source(MIX_SPEC.name, MIX_SPEC.version).head_seq
    assert max(all_tokens) == head

    state = {
        (r["owner"], r["k"]): r["text"]
        for r in shoal.fold(MIX_SPEC.name, MIX_SPEC.version).select(["owner", "k", "text"]).to_pylist()
    }
    expected: dict[tuple[str, int], str] = {}
    for p in range(PRODUCERS):
        expected |= expected_own_state(p, ROUNDS)
    # Keys written by many producers: the last write in log (seq) order wins. Compute it by replaying
    # the raw log entry by entry, independently of fold().
    log = pa.Table.from_batches(list(shoal.read_log(MIX_SPEC.name, MIX_SPEC.version)))
    replay: dict[tuple[str, int], str] = {}
    for row in log.select(["owner", "k", "text", "__op"]).to_pylist():
        if row["owner"] == "shared":
            replay[("shared", row["k"])] = row["text"]
    assert {k: v for k, v in state.items() if k[0] != "shared"} == expected
    assert {k: v for k, v in state.items() if k[0] == "shared"} == replay
    assert log.num_rows == head
