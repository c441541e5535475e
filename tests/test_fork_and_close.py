"""The Python API across os.fork() and after close().

A Shoal (its catalog pool, log writers, searchers) made before a fork works in the forked child on connections of
the child's own, named after its pid, while the parent keeps working on its own: even a child forked while a
parent thread was committing uploads at once. A closed Shoal, its producers and its searchers refuse every later
call (ConfigurationError), rather than silently reopening what close released; closing twice is fine. Also: a
numpy integer k, a None spec and a misspelt search keyword are answered clearly."""

from __future__ import annotations

import inspect
import logging
import os
import pickle
import select
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from sqlalchemy import text

from shoal import DataPoint, DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.errors import ConfigurationError, ValidationError
from shoal.log.records import IndexSpec
from shoal.runtime import Runtime
from shoal.searcher.consistency import Consistency

SOURCE = DataSourceSpec(name="ds", version="1", vector_dimension=2, attribute_types={"id": "int64"},
                        permanent_attributes=["id"])
INDEX = IndexSpec(name="ix", version="1", source_name="ds", source_version="1", id_attributes=["id"],
                  metric="euclidean")
CHILD_TIMEOUT_S = 60.0


def point(i: int) -> DataPoint:
    return DataPoint({"id": i}, [float(i), 1.0])


def ids(hits: Any) -> list[int]:
    return [h.attributes["id"] for h in hits]


def in_child(work: Callable[[], Any], timeout: float = CHILD_TIMEOUT_S) -> Any:
    """Run `work` in a forked child and return what it returned (or raise what it raised, as a RuntimeError);
    a child that does not answer within `timeout` is killed and the test fails (a hang, not a wait)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave at once (no pytest teardown, no atexit here)
        os.close(read_end)
        try:
            try:
                outcome: tuple[str, Any] = ("ok", work())
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                outcome = ("error", f"{type(exc).__name__}: {exc}")
            os.write(write_end, pickle.dumps(outcome))
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        data = b""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([read_end], [], [], max(left, 0))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"the forked child did not answer within {timeout} s (it hangs)")
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    if not data:
        pytest.fail("the forked child died without answering")
    kind, value = pickle.loads(data)
    if kind == "error":
        raise RuntimeError(f"in the forked child: {value}")
    return value


def own_application_name(s: Shoal) -> str:
    with s.engine.connect() as conn:
        return str(conn.execute(text("SELECT application_name FROM pg_stat_activity WHERE pid = pg_backend_pid()"))
                   .scalar())


@pytest.fixture
def settings(make_settings: Callable[..., Settings], redis_url: str) -> Settings:
    """Settings with the test broker (searchers follow heads on it) and a short poll."""
    return make_settings("local", redis_url=redis_url, searcher_poll_s=0.5)


@pytest.fixture
def api(settings: Settings) -> Iterator[Shoal]:
    """A tenant with a data source holding point 0, and a flat index over it (searched from the log's young tier:
    no worker builds it)."""
    s = Shoal(settings, notify=False)
    s.create_data_source(SOURCE)
    s.create_index(INDEX)
    s.producer("ds", "1").upload([point(0)])
    yield s
    s.close()


# -- 1. a child forked while a parent thread commits ------------------------------------------------------------

def test_a_child_forked_mid_commit_uploads_without_hanging(api: Shoal) -> None:
    producer = api.producer("ds", "1")
    writer = producer._writer
    stop = threading.Event()
    uploaded: list[int] = []

    def upload_in_the_background() -> None:
        i = 1
        while not stop.is_set():
            producer.upload([point(i)])
            uploaded.append(i)
            i += 1

    thread = threading.Thread(target=upload_in_the_background, daemon=True)
    thread.start()
    try:
        tokens = []
        for attempt in range(3):
            deadline = time.monotonic() + 10
            while not writer._busy and time.monotonic() < deadline:  # fork while a commit is in flight
                time.sleep(0.0005)

            def child(attempt: int = attempt) -> tuple[int, list[int]]:
                token = producer.upload([point(1_000_000 + attempt)])
                hits = api.searcher(follow=False).search("ix", "1", [[1_000_000.0 + attempt, 1.0]], 1,
                                                         consistency=Consistency.at_least(token))
                return token.seq, ids(hits[0])

            seq, found = in_child(child)
            assert found == [1_000_000 + attempt]
            tokens.append(seq)
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()
    # The parent's uploads went on, each committed once (the child did not commit the parent's queued batches).
    counts = Counter(int(i) for batch in api.read_log("ds", "1") for i in batch.column("id").to_pylist())
    assert {i for i, n in counts.items() if n > 1} == set()
    assert all(counts[i] == 1 for i in uploaded)
    assert all(counts[1_000_000 + a] == 1 for a in range(3))


# -- 2. the catalog pool across fork ----------------------------------------------------------------------------

def test_children_use_connections_of_their_own_and_the_parent_keeps_working(
    api: Shoal, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    producer = api.producer("ds", "1")
    searcher = api.searcher()
    token = producer.upload([point(1)])
    assert ids(searcher.search("ix", "1", [[1.0, 1.0]], 1, consistency=Consistency.at_least(token))[0]) == [1]
    assert own_application_name(api) == f"shoal/{os.getpid()}"  # the parent's pool holds connections now

    def child() -> tuple[int, str, list[int], int]:
        found = []
        for i in range(5):
            n = 100 * os.getpid() + i
            t = producer.upload([point(n)])
            found += ids(searcher.search("ix", "1", [[float(n), 1.0]], 1, consistency=Consistency.at_least(t))[0])
        head = api.get_data_source("ds", "1").head_seq
        return os.getpid(), own_application_name(api), found, head

    for _ in range(2):
        pid, name, found, head = in_child(child)
        assert name == f"shoal/{pid}"
        assert found == [100 * pid + i for i in range(5)]
        assert head >= 7
    # The parent's own connections still answer: its next commit, catalog read and search, and its searcher's poll.
    token = producer.upload([point(2)])
    assert ids(searcher.search("ix", "1", [[2.0, 1.0]], 1, consistency=Consistency.at_least(token))[0]) == [2]
    assert ids(searcher.search("ix", "1", [[2.0, 1.0]], 1, consistency=Consistency.strong())[0]) == [2]
    assert api.get_data_source("ds", "1").head_seq == token.seq
    assert own_application_name(api) == f"shoal/{os.getpid()}"
    searcher.refresh()
    time.sleep(1.5)  # a few polls of the parent's searcher
    troubles = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in troubles if "poll" in m or "catalog" in m], troubles


# -- 3. close() is final -----------------------------------------------------------------------------------

def test_a_closed_shoal_its_producers_and_searchers_refuse_every_call(settings: Settings) -> None:
    s = Shoal(settings, notify=False)
    s.create_data_source(SOURCE)
    s.create_index(INDEX)
    producer = s.producer("ds", "1")
    searcher = s.searcher()
    token = producer.upload([point(1)])
    assert ids(searcher.search("ix", "1", [[1.0, 1.0]], 1, consistency=Consistency.at_least(token))[0]) == [1]
    s.close()
    closed = "this Shoal is closed"
    with pytest.raises(ConfigurationError, match=closed):
        producer.upload([point(2)])
    with pytest.raises(ConfigurationError, match=closed):
        s.get_data_source("ds", "1")
    with pytest.raises(ConfigurationError, match=closed):
        s.producer("ds", "1")
    with pytest.raises(ConfigurationError, match=closed):
        s.searcher()
    with pytest.raises(ConfigurationError, match="this Searcher is closed"):
        searcher.search("ix", "1", [[1.0, 1.0]], 1)
    with pytest.raises(ConfigurationError, match=closed):
        with s.engine.connect():  # nor does its catalog pool open again behind the API's back
            pass
    s.close()  # twice: nothing
    assert s.runtime._redis is None
    assert searcher.service.closed and not [t for t in searcher.service._threads if t.is_alive()]


def test_a_context_manager_closes_and_a_closed_searcher_refuses(settings: Settings) -> None:
    with Shoal(settings, notify=False) as s:
        s.create_data_source(SOURCE)
        s.create_index(INDEX)
        searcher = s.searcher(follow=False)
        searcher.search("ix", "1", [[0.0, 1.0]], 1)
        searcher.close()
        with pytest.raises(ConfigurationError, match="this Searcher is closed"):
            searcher.search("ix", "1", [[0.0, 1.0]], 1)
        searcher.close()
    with pytest.raises(ConfigurationError, match="this Shoal is closed"):
        s.list_data_sources()


def test_closing_a_shoal_over_a_shared_runtime_leaves_the_runtime_open(settings: Settings) -> None:
    with Runtime(settings, notify=False) as runtime:
        first = Shoal(runtime=runtime)
        first.create_data_source(SOURCE)
        first.close()
        with pytest.raises(ConfigurationError, match="this Shoal is closed"):
            first.list_data_sources()
        assert [r.spec.name for r in Shoal(runtime=runtime).list_data_sources()] == ["ds"]
    with pytest.raises(ConfigurationError, match="this Shoal is closed"):
        Shoal(runtime=runtime)


# -- 4. a searcher inherited by a forked child -------------------------------------------------------------

def test_a_searcher_made_before_a_fork_follows_new_writes_in_the_child(api: Shoal, settings: Settings) -> None:
    searcher = api.searcher()
    assert ids(searcher.search("ix", "1", [[0.0, 1.0]], 5)[0]) == [0]  # warmed in the parent
    go_read, go_write = os.pipe()

    def child() -> list[int]:
        os.close(go_write)
        os.read(go_read, 1)  # the parent wrote the new points
        deadline = time.monotonic() + 30
        while True:
            found = ids(searcher.search("ix", "1", [[0.0, 1.0]], 5)[0])
            if len(found) == 5 or time.monotonic() > deadline:
                return sorted(found)
            time.sleep(0.2)

    def write_then_signal() -> None:
        time.sleep(0.5)
        with Shoal(settings, notify=False) as other:  # as another process would
            other.producer("ds", "1").upload([point(i) for i in range(1, 5)])
        os.write(go_write, b"x")

    writer = threading.Thread(target=write_then_signal)
    writer.start()
    try:
        assert in_child(child) == [0, 1, 2, 3, 4]
    finally:
        writer.join(30)
        os.close(go_read)
        os.close(go_write)


# -- 5. small things -------------------------------------------------------------------------------------

def test_k_may_be_any_integer_but_a_bool(api: Shoal) -> None:
    searcher = api.searcher(follow=False)
    assert ids(searcher.search("ix", "1", [[0.0, 1.0]], np.int64(3), consistency="strong")[0]) == [0]
    with pytest.raises(ValidationError, match="k must be a positive integer"):
        searcher.search("ix", "1", [[0.0, 1.0]], True)
    with pytest.raises(ValidationError, match="k must be a positive integer"):
        searcher.search("ix", "1", [[0.0, 1.0]], np.int64(0))


def test_a_none_spec_is_a_validation_error_naming_it(local_shoal: Shoal) -> None:
    with pytest.raises(ValidationError, match="spec must be a shoal.log.records.DataSourceSpec, got NoneType"):
        local_shoal.create_data_source(None)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="spec must be a shoal.log.records.IndexSpec, got NoneType"):
        local_shoal.create_index(None)  # type: ignore[arg-type]


def test_search_spells_out_its_keywords(api: Shoal) -> None:
    searcher = api.searcher(follow=False)
    with pytest.raises(TypeError, match=r"Searcher\.search\(\) got an unexpected keyword argument 'consistancy'"):
        searcher.search("ix", "1", [[0.0, 1.0]], 1, consistancy="strong")  # type: ignore[call-arg]
    params = inspect.signature(searcher.search).parameters
    assert {"split_filter", "filters", "retrieve_vectors", "consistency", "tag", "as_of", "search_params"} <= {
        name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
