"""Duration and limit settings are refused at startup, naming the setting, when they would break an operation
later: inf or NaN, a duration past 100 years, a lock timeout PostgreSQL cannot take, a Redis expiry that rounds
to 0 ms. The largest accepted values still let every operation run."""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from shoal import DataSourceSpec, Shoal
from shoal.cli.common import load_settings
from shoal.config.settings import Settings
from shoal.errors import ConfigurationError
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec
from shoal.workers.triggers import QUEUE, enqueue, pending_key, producer_app

# The documented bounds (README, Settings): 100 years, and Redis's smallest expiry.
MAX_DURATION_S = 3_155_760_000
MAX_DURATION_DAYS = 36_525
MIN_PENDING_TTL_S = 0.001

# Every duration setting in seconds (README, Settings).
DURATIONS_S = [
    "AUTH_FAILURE_WINDOW_S", "AUTH_FAILURE_CACHE_S", "FANOUT_TIMEOUT_S", "SEARCHER_POLL_S", "SWEEP_INTERVAL_S",
    "LEASE_SECONDS", "LEASE_HEARTBEAT_S", "TASK_VISIBILITY_TIMEOUT_S", "PENDING_TTL_S", "QUICK_WINDOW_S",
    "MERGE_INTERVAL_S", "PURGE_INTERVAL_S", "COMPACTION_INTERVAL_S", "TOMBSTONE_RETENTION_S",
    "RETENTION_INTERVAL_S", "GC_INTERVAL_S", "GC_GRACE_S", "INTAKE_VISIBILITY_TIMEOUT_S", "REINDEX_KEEP_S",
    "VERSION_KEEP_S", "GENERATIONS_INTERVAL_S", "BACKPRESSURE_RETRY_AFTER_S",
]
FLOAT_SETTINGS = sorted(
    name.upper() for name, field in Settings.model_fields.items() if float in typing.get_args(field.annotation)
    or field.annotation is float
)
NON_FINITE = ["inf", "-inf", "nan", "1e400"]

BAD: list[tuple[str, str, str]] = [
    *((name, value, "finite") for name in FLOAT_SETTINGS for value in NON_FINITE),
    *((name, "1e20" if name != "BACKPRESSURE_RETRY_AFTER_S" else str(10**20), "at most 3155760000 s (100 years)")
      for name in DURATIONS_S),
    *((name, str(MAX_DURATION_S + 1), "at most 3155760000 s (100 years)")
      for name in ("GC_GRACE_S", "SEARCHER_POLL_S")),
    ("TRASH_RETENTION_DAYS", "1e6", "at most 36525 days (100 years)"),
    ("TRASH_RETENTION_DAYS", "inf", "finite"),
    ("INTAKE_MAX_WAIT_MS", str(10**20), "at most 3155760000000 ms (100 years)"),
    ("LOCK_TIMEOUT_MS", str(10**11), "less than or equal to 2147483647"),
    ("PENDING_TTL_S", "0.0001", "greater than or equal to 0.001"),
    ("QUICK_EF_CONSTRUCTION", str(10**20), "less than or equal to 65536"),
    *((name, str(10**20), "at most 9223372036854775807") for name in (
        "MAX_BATCH_POINTS", "MAX_BODY_BYTES", "YOUNG_TIER_MAX_SEQS", "MAX_INDEX_LAG_SEQS", "COMPACTION_MIN_SEQS",
        "SEARCHER_CACHE_BYTES", "COMMIT_RETRIES", "INTAKE_PREFETCH",
    )),
]


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No SHOAL_* variable and no ./shoal.toml but the test's own."""
    for name in list(os.environ):
        if name.startswith("SHOAL_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SHOAL_DATA_DIR", str(tmp_path / "data"))
    yield


def test_the_float_settings_are_found() -> None:
    # The non-finite cases below cover every float setting: make sure the list is not empty by accident.
    assert {"GC_GRACE_S", "SEARCHER_POLL_S", "TRASH_RETENTION_DAYS", "MAX_DELETED_RATIO"} <= set(FLOAT_SETTINGS)


@pytest.mark.parametrize(("name", "value", "says"), BAD, ids=[f"{n}={v}" for n, v, _ in BAD])
def test_a_bad_value_is_refused_naming_the_setting(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, name: str, value: str, says: str
) -> None:
    monkeypatch.setenv(f"SHOAL_{name}", value)
    with pytest.raises(ConfigurationError) as caught:
        load_settings()
    message = str(caught.value)
    assert f"invalid settings: {name.lower()}: " in message, message
    assert says in message, message
    assert "\n" not in message


@pytest.mark.parametrize(("name", "value"), [
    ("GC_GRACE_S", str(MAX_DURATION_S)),
    ("SEARCHER_POLL_S", str(MAX_DURATION_S)),
    ("TRASH_RETENTION_DAYS", str(MAX_DURATION_DAYS)),
    ("INTAKE_MAX_WAIT_MS", str(MAX_DURATION_S * 1000)),
    ("LOCK_TIMEOUT_MS", str(2**31 - 1)),
    ("PENDING_TTL_S", str(MIN_PENDING_TTL_S)),
    ("GC_GRACE_S", "0"),
])
def test_the_bounds_themselves_are_accepted(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(f"SHOAL_{name}", value)
    assert getattr(load_settings(), name.lower()) == float(value)


def test_the_cli_refuses_an_infinite_poll_in_one_line(clean_env: None) -> None:
    # SHOAL_SEARCHER_POLL_S=inf was accepted, and a following searcher's threads then died in Event.wait.
    env = os.environ | {"SHOAL_SEARCHER_POLL_S": "inf"}
    result = subprocess.run([sys.executable, "-m", "shoal.cli", "settings"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert lines == ["error: invalid settings: searcher_poll_s: Input should be a finite number"], lines


@pytest.fixture
def make_shoal(make_settings: Callable[..., Settings]) -> Iterator[Callable[..., Shoal]]:
    """Shoals that queue no Celery work (the test builds its index itself), closed after the test."""
    made: list[Shoal] = []

    def make(**overrides: object) -> Shoal:
        client = Shoal(make_settings("local", **overrides), notify=False)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def test_the_longest_durations_still_let_drop_and_compact_run(make_shoal: Callable[..., Shoal]) -> None:
    # gc_grace_s and tombstone_retention_s of 1e20 (or inf) made drop_data_source, drop_index and compact raise
    # OverflowError; at their bound they must work.
    shoal = make_shoal(gc_grace_s=MAX_DURATION_S, tombstone_retention_s=MAX_DURATION_S,
                       version_keep_s=MAX_DURATION_S, reindex_keep_s=MAX_DURATION_S)
    shoal.create_data_source(DataSourceSpec("Src", "1", 4, {"id": "int64"}, ["id"]))
    producer = shoal.producer("Src", "1")
    producer.upload_columns(np.ones((3, 4), np.float32), {"id": np.arange(3)})
    producer.upload_columns(np.full((3, 4), 2, np.float32), {"id": np.arange(3)})
    producer.delete({"id": [0]})
    index = shoal.create_index(IndexSpec("Src.Index", "1", "Src", "1", algorithm="FaissIndex.L2"))
    for shard in index.shards:
        ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
    result = shoal.compact("Src", "1")
    # The first upload and id 0's second upsert are superseded; its tombstone stays for 100 years.
    assert (result.changed, result.entries_dropped, result.tombstones_dropped) == (True, 4, 0)
    assert sorted(shoal.fold("Src", "1").column("id").to_pylist()) == [1, 2]
    assert shoal.drop_index("Src.Index", "1") >= 0
    assert shoal.drop_data_source("Src", "1") >= 1
    assert "Src" not in [s.spec.name for s in shoal.list_data_sources()]


@pytest.mark.parametrize("ttl_s", [MIN_PENDING_TTL_S, float(MAX_DURATION_S)])
def test_the_pending_ttl_bounds_are_valid_redis_expiries(redis_url: str, ttl_s: float) -> None:
    # 0.0001 s (SET PX 0) and 1e20 s made every enqueue fail with a Redis ResponseError. A database of the
    # session's server no worker reads: the queued task must reach no other test's worker.
    url = redis_url.rsplit("/", 1)[0] + "/13"
    client = redis.Redis.from_url(url)
    app = producer_app(url)
    try:
        assert enqueue(client, app, "shoal.test_bounds", 1, ttl_s, countdown=float(MAX_DURATION_S))
        assert client.pttl(pending_key("shoal.test_bounds", 1)) > 0
        assert client.llen(QUEUE) == 1
    finally:
        client.flushdb()
        client.close()
