"""The `shoal` command line for indexes against a real Postgres: index create/get/list/drop and Vektonn's
rules, `status`, `search` at every consistency level, `worker` (a real Celery worker with beat) and the
whole-loop `demo` (in a child process, with its own worker and its own data directory).

The module runs on its own data directory (embedded Postgres and Valkey, stopped at the end) unless the
session names a catalog with SHOAL_DATABASE_URL (or SHOAL_TEST_DATABASE_URL); every test works in its own
tenant.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import typer
from conftest import alive, module_cli_env, wait_for
from typer.testing import CliRunner, Result

from shoal import DataPoint, Shoal, SparseVector
from shoal.cli import app
from shoal.cli.indexes import parse_param_value
from shoal.cli.search import parse_consistency
from shoal.cli.worker import worker_argv
from shoal.config.settings import Settings
from shoal.demo import DEMO_SPEC
from shoal.engines.metrics import Metric, exact_top_k
from shoal.index.builder import ShardBuilder
from shoal.searcher.consistency import Consistency

runner = CliRunner()
DIM = 8


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """SHOAL_* variables for this module: a fresh data dir and storage; servers stopped at teardown."""
    with module_cli_env(tmp_path_factory, "cli-index") as data_dir:
        yield data_dir


@pytest.fixture
def tenant(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh tenant, set as SHOAL_TENANT for in-process and child-process calls."""
    name = "ix" + uuid.uuid4().hex[:12]
    monkeypatch.setenv("SHOAL_TENANT", name)
    return name


def shoal_cli(*args: str, code: int = 0, input: str | None = None) -> Result:
    """Run `shoal ARGS` in process; assert the exit code and that no traceback was printed."""
    result = runner.invoke(app, list(args), input=input)
    assert result.exit_code == code, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    assert "Traceback" not in result.output
    if code == 1:
        assert isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def fails(*args: str) -> str:
    """Run a command that must fail with one red line and exit 1; return that line."""
    result = shoal_cli(*args, code=1)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == ""
    return lines[0]


def shoal_command() -> list[str]:
    """The `shoal` console script of this environment (or `python -m shoal.cli`)."""
    shoal_bin = Path(sys.executable).parent / "shoal"
    return [str(shoal_bin)] if shoal_bin.exists() else [sys.executable, "-m", "shoal.cli"]


def create_docs(name: str = "docs", *, sparse: bool = False) -> None:
    """A data source keyed by (id, lang), so `lang` may be a split attribute and `title` may not."""
    shoal_cli("source", "create", name, "1", "--dim", str(DIM), "--attr", "id:int64,lang:string,title:string",
              "--permanent", "id,lang", *(["--sparse"] if sparse else []))


def upload_docs(name: str, first: int, count: int, rng: np.random.Generator, *, notify: bool = True) -> tuple[
        np.ndarray, list[int], int]:
    """Upload `count` dense points with ids from `first`; return (vectors, ids, write token seq)."""
    vectors = rng.standard_normal((count, DIM)).astype(np.float32)
    ids = list(range(first, first + count))
    attrs = {"id": ids, "lang": ["en" if i % 2 else "de" for i in ids], "title": [f"doc {i}" for i in ids]}
    with Shoal(notify=notify) as client:
        token = client.producer(name, "1").upload_columns(vectors, attrs)
    return vectors, ids, token.seq


def materialize(name: str, version: str = "1") -> None:
    """Build every shard of the index in process (what a worker's task does)."""
    with Shoal(notify=False) as client:
        builder = ShardBuilder(client.engine, client.storage)
        for shard in client.get_index(name, version).shards:
            builder.materialize(shard.id)


def search_json(*args: str) -> list[dict]:
    return json.loads(shoal_cli("search", *args, "--json").stdout)


def query_text(vector: np.ndarray) -> str:
    return ",".join(repr(float(v)) for v in vector)


# -- parsing --------------------------------------------------------------------------------------------


def test_option_parsing() -> None:
    assert parse_param_value("16") == 16 and isinstance(parse_param_value("16"), int)
    assert parse_param_value("0.25") == 0.25 and parse_param_value("1e3") == 1000.0
    assert parse_param_value("auto") == "auto"
    assert parse_consistency("eventual") == Consistency.eventual()
    assert parse_consistency("strong") == Consistency.strong()
    assert parse_consistency("at_least:42") == Consistency.at_least(42)
    token = parse_consistency("at_least:docs/1@42")  # a whole write token: its data source is kept, to be checked
    assert token == Consistency.at_least(42) and (token.data_source, token.data_source_version) == ("docs", "1")
    # Digits of other scripts are no seq (before, Arabic-Indic digits were read as 12 and a superscript leaked
    # int()'s own message), as the whole-token form and the HTTP header refuse them.
    for bad in ("at_least:\u0661\u0662", "at_least:\u00b2"):
        with pytest.raises(typer.BadParameter, match="unknown consistency"):
            parse_consistency(bad)
    argv = worker_argv(beat=True, schedule=Path("/d/s"), concurrency=2, loglevel="info", pool="solo")
    assert argv == ["worker", "--loglevel", "INFO", "--pool", "solo", "--concurrency", "2", "--without-gossip",
                    "--without-mingle", "--beat", "--schedule", "/d/s"]
    assert "--beat" not in worker_argv(beat=False)
    assert "--without-gossip" in worker_argv(beat=False)  # every worker: gossip's restart fails on a broker restart


# -- index definitions ----------------------------------------------------------------------------------


def test_index_create_get_list_drop(tenant: str) -> None:
    create_docs()
    created = shoal_cli(
        "index", "create", "docs.hnsw", "1", "--source", "docs", "--source-version", "1", "--algorithm", "hnsw",
        "--metric", "euclidean", "--param", "M=12", "--param", "ef_construction=100,ef_search=40",
        "--split-attr", "lang", "--payload-attr", "title", "--shards", "2",
    )
    assert "Index docs.hnsw/1 created" in created.stdout and tenant in created.stdout
    assert "hnsw (M=12" in created.stdout and "split (lang)" in created.stdout and "shoal worker" in created.stdout

    got = json.loads(shoal_cli("index", "get", "docs.hnsw", "1", "--json").stdout)
    assert got["tenant"] == tenant and (got["source_name"], got["source_version"]) == ("docs", "1")
    assert (got["algorithm"], got["metric"]) == ("hnsw", "euclidean")
    assert got["params"] == {"M": 12, "ef_construction": 100, "ef_search": 40}
    assert got["id_attributes"] == ["id"]  # the permanent attributes minus the split ones
    assert got["split_attributes"] == ["lang"] and got["shard_attributes"] == ["id"]
    assert got["payload_attributes"] == ["title"] and got["shard_count"] == 2
    assert [s["shard"] for s in got["shards"]] == [0, 1]
    assert all(s["built_watermark"] == 0 and s["active_version_id"] is None for s in got["shards"])
    table = shoal_cli("index", "get", "docs.hnsw", "1").stdout
    assert "Index docs.hnsw/1" in table and "docs/1" in table and "ef_search=40" in table and "Shards" in table

    # Defaults: flat, cosine, every attribute as payload, one shard.
    shoal_cli("index", "create", "docs.flat", "1", "--source", "docs", "--source-version", "1")
    listed = json.loads(shoal_cli("index", "list", "--json").stdout)
    assert [(r["name"], r["algorithm"], r["metric"], r["shard_count"]) for r in listed] == [
        ("docs.flat", "flat", "cosine", 1),
        ("docs.hnsw", "hnsw", "euclidean", 2),
    ]
    assert listed[0]["payload_attributes"] == ["id", "lang", "title"]
    table = shoal_cli("index", "list").stdout
    assert "docs.flat" in table and "docs.hnsw" in table and "M=12" in table
    assert "not found" in shoal_cli("index", "list", "--tenant", tenant + "-b", code=1).stderr  # not created
    shoal_cli("tenant", "create", tenant + "-b")
    assert "No indexes" in shoal_cli("index", "list", "--tenant", tenant + "-b").stdout

    same = shoal_cli("index", "create", "docs.flat", "1", "--source", "docs", "--source-version", "1", "--exist-ok")
    assert "exists already" in same.stdout
    assert "already exists" in fails("index", "create", "docs.flat", "1", "--source", "docs", "--source-version", "1")
    other = fails("index", "create", "docs.flat", "1", "--source", "docs", "--source-version", "1", "--metric",
                  "euclidean", "--exist-ok")
    assert "another definition" in other

    refused = shoal_cli("index", "drop", "docs.hnsw", "1", input="n\n", code=1)
    assert "Drop index docs.hnsw/1" in refused.output
    dropped = shoal_cli("index", "drop", "docs.hnsw", "1", "--yes")
    assert "Dropped index docs.hnsw/1" in dropped.stdout
    assert "not found" in fails("index", "get", "docs.hnsw", "1")
    assert [r["name"] for r in json.loads(shoal_cli("index", "list", "--json").stdout)] == ["docs.flat"]
    # The data source stays.
    assert json.loads(shoal_cli("source", "get", "docs", "1", "--json").stdout)["name"] == "docs"


def test_index_rules_are_one_line_and_exit_1(tenant: str) -> None:
    create_docs()
    base = ["index", "create", "bad", "1", "--source", "docs", "--source-version", "1"]
    line = fails(*base, "--split-attr", "title", "--metric", "hamming")  # every broken rule is named
    assert line == (
        "error: invalid index definition: attribute 'title': split attribute must be a permanent attribute of the "
        "source; unknown metric 'hamming'; known: cosine, euclidean, manhattan, dot_product, l2_squared"
    )
    line = fails(*base, "--algorithm", "hnsw", "--param", "M=16")
    assert "HNSW parameters must be given all or none: missing ef_construction, ef_search" in line
    line = fails(*base, "--algorithm", "hnsw", "--metric", "manhattan")
    assert "algorithm 'hnsw' does not support metric 'manhattan'" in line
    assert "unknown metric 'hamming'" in fails(*base, "--metric", "hamming")
    assert "is for sparse vectors" in fails(*base, "--algorithm", "flat_sparse")
    assert "does not take parameter(s) 'nlist'" in fails(*base, "--param", "nlist=4")
    assert "parameter 'nlist' must be an integer" in fails(*base, "--algorithm", "ivf", "--param", "nlist=2.5")
    assert "id attributes minus split attributes must not be empty" in fails(*base, "--id-attr", "lang",
                                                                             "--split-attr", "lang")
    assert "shard count must be an integer in 1..1024" in fails(*base, "--shards", "0")
    assert "payload attribute is not an attribute of the source" in fails(*base, "--payload-attr", "nope")
    assert "not found" in fails("index", "create", "x", "1", "--source", "nope", "--source-version", "1")
    assert "invalid index name '../x'" in fails("index", "create", "../x", "1", "--source", "docs",
                                                "--source-version", "1")
    # Vektonn's names and rules.
    assert "all or none" in fails(*base, "--algorithm", "FaissIndex.L2", "--param", "M=16")
    line = fails(*base, "--algorithm", "FaissIndex.IP", "--param", "EfSearch=4")
    assert line == (
        "error: invalid index definition: HNSW parameters must be given all or none: missing M, EfConstruction"
    )
    assert "unknown algorithm 'nope' (known: flat, flat_sparse, hnsw, ivf)" in fails(*base, "--algorithm", "nope")
    # Malformed options are usage errors (exit 2).
    shoal_cli(*base, "--param", "M", code=2)
    shoal_cli(*base, "--param", "M=1", "--param", "M=2", code=2)
    shoal_cli(*base, "--algorithm", "FaissIndex.L2", "--metric", "cosine", code=2)
    assert json.loads(shoal_cli("index", "list", "--json").stdout) == []

    ok = shoal_cli("index", "create", "vk", "1", "--source", "docs", "--source-version", "1", "--algorithm",
                   "FaissIndex.IP", "--param", "M=8,EfConstruction=40,EfSearch=20")
    assert "hnsw (M=8" in ok.stdout and "metric dot_product" in ok.stdout


# -- status and search ----------------------------------------------------------------------------------


def test_status_and_search_through_materialization(tenant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    create_docs()
    vectors, ids, head = upload_docs("docs", 0, 300, rng)
    shoal_cli("index", "create", "docs.flat", "1", "--source", "docs", "--source-version", "1", "--metric",
              "euclidean", "--split-attr", "lang", "--shards", "2")

    before = json.loads(shoal_cli("status", "docs.flat", "1", "--json").stdout)
    assert [(s["index"], s["shard"], s["head"], s["built_watermark"], s["lag_seqs"]) for s in before] == [
        ("docs.flat/1", 0, head, 0, head),
        ("docs.flat/1", 1, head, 0, head),
    ]
    table = shoal_cli("status").stdout
    for expected in ("docs.flat/1", "built watermark", "served watermark", "lag seqs", "300"):
        assert expected in table

    queries = rng.standard_normal((3, DIM)).astype(np.float32)
    exact_d, exact_rows = exact_top_k(Metric.EUCLIDEAN, queries, vectors, 5)
    q = query_text(queries[0])
    # Nothing is built yet: eventual finds nothing, strong scans the whole log and is exact.
    assert search_json("docs.flat", "1", "--query", q, "-k", "5") == [{"query": 0, "hits": []}]
    assert "no hits" in shoal_cli("search", "docs.flat", "1", "--query", q).stdout
    strong = search_json("docs.flat", "1", "--query", q, "-k", "5", "--consistency", "strong")
    assert [h["attributes"]["id"] for h in strong[0]["hits"]] == [ids[r] for r in exact_rows[0]]

    materialize("docs.flat")
    np.save(Path.cwd() / "queries.npy", queries[1:])
    got = search_json("docs.flat", "1", "--query", q, "--query-file", str(Path.cwd() / "queries.npy"), "-k", "5")
    assert [r["query"] for r in got] == [0, 1, 2]
    for qi, result in enumerate(got):
        assert [h["rank"] for h in result["hits"]] == [1, 2, 3, 4, 5]
        assert [h["attributes"]["id"] for h in result["hits"]] == [ids[r] for r in exact_rows[qi]]
        np.testing.assert_allclose([h["distance"] for h in result["hits"]], exact_d[qi], rtol=1e-5)
        assert set(result["hits"][0]["attributes"]) == {"id", "lang", "title"}
    # A float64 query file keeps its values to the searcher, which names one past float32's range (a cast here
    # made it an infinity, refused as "NaN or infinity" after an overflow warning).
    np.save(Path.cwd() / "wide.npy", np.array([[1.0] * (DIM - 1) + [2e39]]))
    wide = fails("search", "docs.flat", "1", "--query-file", str(Path.cwd() / "wide.npy"))
    assert "2e+39 at index 7 is past float32's range" in wide, wide
    # A split filter keeps one split; vectors come back on request.
    en = search_json("docs.flat", "1", "--query", q, "-k", "4", "--split", "lang=en", "--vectors")[0]["hits"]
    assert len(en) == 4 and all(h["attributes"]["lang"] == "en" for h in en)
    for h in en:
        np.testing.assert_allclose(h["vector"], vectors[ids.index(h["attributes"]["id"])], rtol=1e-6)
    text = shoal_cli("search", "docs.flat", "1", "--query", q, "-k", "3", "--vectors").stdout
    assert "Query 1 of 1: 3 nearest" in text and "served watermark 300" in text and "(8-d)" in text
    assert "lower is nearer" in text and f"doc {ids[exact_rows[0][0]]}" in text

    # The searches above served the built version: lag 0. Five new points are not built yet...
    status = json.loads(shoal_cli("status", "docs.flat", "1", "--json").stdout)
    assert all(s["served_watermark"] == head and s["lag_seqs"] == 0 and s["segments"] == 1 for s in status)
    new_vectors, new_ids, token = upload_docs("docs", 1000, 5, rng)
    fresh_q = query_text(new_vectors[2])
    eventual = search_json("docs.flat", "1", "--query", fresh_q, "-k", "1")[0]["hits"]
    assert eventual[0]["attributes"]["id"] != new_ids[2]
    # ...but at_least(token) and strong find them by scanning the log tail.
    for level in (f"at_least:{token}", f"at_least:docs/1@{token}", "strong"):
        hit = search_json("docs.flat", "1", "--query", fresh_q, "-k", "1", "--consistency", level)[0]["hits"][0]
        assert hit["attributes"]["id"] == new_ids[2] and hit["distance"] == pytest.approx(0.0, abs=1e-5)
    lagging = json.loads(shoal_cli("status", "--json").stdout)
    assert all(s["head"] == token and s["built_watermark"] == head and s["lag_seqs"] == 5 for s in lagging)

    # Bad searches: rules exit 1 with one line, malformed options exit 2.
    assert "not a split attribute" in fails("search", "docs.flat", "1", "--query", q, "--split", "title=x")
    assert "wrong query dimension: expected 8, got 3" in fails("search", "docs.flat", "1", "--query", "1,2,3")
    assert "not found" in fails("search", "nope", "1", "--query", q)
    assert "takes no search parameter(s) 'ef_search'" in fails(
        "search", "docs.flat", "1", "--query", q, "--param", "ef_search=100"
    )
    shoal_cli("search", "docs.flat", "1", "--query", q, "--param", "ef_search", code=2)
    shoal_cli("search", "docs.flat", "1", "--query", q, "--param", "ef_search=many", code=2)
    shoal_cli("search", "docs.flat", "1", "--query", q, "--consistency", "soon", code=2)
    shoal_cli("search", "docs.flat", "1", "--query", "a,b", code=2)
    shoal_cli("search", "docs.flat", "1", code=2)
    shoal_cli("status", "docs.flat", code=2)

    # --watch refreshes until Ctrl-C (here: the first pause raises it).
    def interrupt(_: float) -> None:
        raise KeyboardInterrupt

    # The module, not the `status` command that shadows it on the package.
    status_module = importlib.import_module("shoal.cli.status")
    monkeypatch.setattr(status_module, "time", SimpleNamespace(sleep=interrupt, strftime=time.strftime))
    watched = shoal_cli("status", "--watch", "1")
    assert "docs.flat/1" in watched.stdout and "Freshness of indexes" in watched.stdout


def test_search_sparse_index(tenant: str) -> None:
    create_docs("sp", sparse=True)
    shoal_cli("index", "create", "sp.flat", "1", "--source", "sp", "--source-version", "1", "--algorithm",
              "flat_sparse", "--metric", "dot_product")
    with Shoal(notify=False) as client:
        client.producer("sp", "1").upload([
            DataPoint({"id": 1, "lang": "en", "title": "a"}, SparseVector([0, 3], [1.0, 2.0])),
            DataPoint({"id": 2, "lang": "en", "title": "b"}, SparseVector([3, 7], [5.0, 1.0])),
        ])
    hits = search_json("sp.flat", "1", "--query", "3:1.0", "--consistency", "strong", "--vectors")[0]["hits"]
    assert [h["attributes"]["id"] for h in hits] == [2, 1]
    assert [h["distance"] for h in hits] == [5.0, 2.0]  # dot product: higher is nearer
    assert hits[0]["vector"] == {"indices": [3, 7], "values": [5.0, 1.0]}
    shoal_cli("search", "sp.flat", "1", "--query", "0.5,0.5", code=2)  # sparse queries are INDEX:VALUE


# -- worker and demo --------------------------------------------------------------------------------------


def _stop(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
def test_worker_command_builds_indexes_with_beat(tenant: str, cli_env: Path) -> None:
    rng = np.random.default_rng(9)
    create_docs()
    shoal_cli("index", "create", "docs.hnsw", "1", "--source", "docs", "--source-version", "1", "--algorithm",
              "hnsw")
    # No trigger after this commit (notify=False): only beat's sweep can queue the build.
    _, _, head = upload_docs("docs", 0, 200, rng, notify=False)
    env = dict(os.environ, SHOAL_SWEEP_INTERVAL_S="0.5")
    log = cli_env / f"worker-{tenant}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*shoal_command(), "worker", "--pool", "solo", "--loglevel", "info"], env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        def built() -> bool:
            status = json.loads(shoal_cli("status", "docs.hnsw", "1", "--json").stdout)
            return all(s["built_watermark"] == head for s in status)

        wait_for(built, 60, "the worker's beat sweep to get the index built")
    finally:
        _stop(proc)
    text = log.read_text()
    assert "beat:    a sweep every 0.5 s" in text and "celery -A shoal.workers.app flower --address=127.0.0.1" in text
    assert "shoal.workers.tasks.sweep" in text and "materialize_shard" in text
    assert (cli_env / "celerybeat-schedule").exists() or list(cli_env.glob("celerybeat-schedule*"))
    assert proc.returncode == 0, text[-2000:]


def test_demo_runs_the_whole_loop_and_reruns(demo_dir: Path) -> None:
    # An explicit environment: the demo's own data dir only (no catalog, broker or tenant of other tests).
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_") and k != "COLUMNS"}
    env |= {"SHOAL_DATA_DIR": str(demo_dir)}
    first = subprocess.run([*shoal_command(), "demo"], capture_output=True, text=True, timeout=120, check=False,
                           env=env, cwd=demo_dir.parent)
    assert first.returncode == 0, first.stdout + first.stderr
    out = first.stdout
    assert "2,000 new" in out and "deleted ids 0, 400, 800, 1200, 1600" in out and "head seq" in out
    assert "index debian.packages.hnsw/1.0 created: hnsw" in out and "metric cosine" in out
    assert "the worker built the index up to seq 2,005" in out
    # Held-out queries find their neighbours: a deleted fcitx table finds the other fcitx tables.
    assert "nearest to the embedding of fcitx-table-cangjie3" in out and "fcitx-table-latex" in out
    assert "nearest to the embedding of fonts-noto-color-emoji" in out
    eventual = next(line for line in out.splitlines() if line.strip().startswith("eventual"))
    fresh = next(line for line in out.splitlines() if line.strip().startswith("at_least:2006"))
    assert "shoal-demo-point" not in eventual and "seq 2,005" in eventual
    assert "shoal-demo-point (distance 0.0000)" in fresh
    assert "Freshness" in out and re.search(r"debian\.packages\.hnsw/1\.0 .* 2,007 .* 2,007 .* 2,007 .* 0 ", out)
    assert "worker stopped" in out or "worker killed" in out
    assert not list((demo_dir / "demo").glob("beat-schedule-*"))  # removed with the worker

    second = subprocess.run([*shoal_command(), "demo", "--keep-worker"], capture_output=True, text=True,
                            timeout=120, check=False, env=env, cwd=demo_dir.parent)
    assert second.returncode == 0, second.stdout + second.stderr
    out = second.stdout
    assert "(0 new)" in out and "already deleted" in out and "exists already" in out
    assert "built up to seq 2,007 already" in out and "at_least:2008" in out
    pid = int(re.search(r"worker left running: pid (\d+)", out).group(1))  # type: ignore[union-attr]
    try:
        assert alive(pid)
    finally:
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not alive(pid), 20, "the kept worker to stop")
    settings = Settings(data_dir=demo_dir, database_url=None, redis_url=None, storage_uri=None, tenant="default")
    with Shoal(settings) as client:
        assert client.get_data_source(DEMO_SPEC.name, DEMO_SPEC.version).head_seq == 2009
        assert client.fold(DEMO_SPEC.name, DEMO_SPEC.version).num_rows == 1995
