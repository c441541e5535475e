"""`shoal demo`: the whole loop on the bundled Debian packages sample.

Ingest the sample (idempotently), index it with HNSW, start a real worker with beat, wait until it has built
the index, search it with held-out queries, show read-your-writes, print the freshness table, stop the worker.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import numpy as np
import pyarrow.parquet as pq
import typer
from rich.table import Table

from shoal.cli.common import Tenant, err, fail, load_settings, open_shoal, out
from shoal.cli.demo_http import http_search
from shoal.cli.formatting import count, params_text
from shoal.cli.logview import print_log
from shoal.cli.probes import check_broker
from shoal.cli.status import freshness_table
from shoal.cli.worker import describe_servers, start_worker_process, stop_worker_process, worker_argv
from shoal.client import Shoal
from shoal.config.settings import Settings
from shoal.demo import DEMO_SPEC, demo_files, load_demo
from shoal.intake.bulk import plan_import, run_import
from shoal.log.records import IndexSpec, Tombstone, WriteToken
from shoal.searcher.consistency import Consistency
from shoal.searcher.execute import Hit

DEMO_BATCH = 500
DEMO_DELETE_EVERY = 400  # the demo deletes the packages whose id is a multiple of this
DEMO_BATCH_PREFIX = "demo"  # fixed, not derived from the files: a re-run must find the same batch ids
DEMO_INDEX = IndexSpec(
    name="debian.packages.hnsw",
    version="1.0",
    source_name=DEMO_SPEC.name,
    source_version=DEMO_SPEC.version,
    algorithm="hnsw",
    metric="cosine",
    params={"M": 16, "ef_construction": 200, "ef_search": 64},
    id_attributes=("id",),
    payload_attributes=("package", "section"),
)
DEMO_K = 5
# Held-out queries: the embeddings of packages the demo deleted (so the index does not hold them). These two
# have clear neighbours in the sample; with --points below 1601 the last deleted ones serve instead.
DEMO_QUERY_IDS = (400, 1600)
DEMO_WAIT_S = 90.0  # at most this long for the worker to build the index (it takes seconds)
RYW_ID = 1_000_000  # the read-your-writes point: an id outside the sample
RYW_PACKAGE = "shoal-demo-point"


def _wait(what: str, done: Callable[[], bool], worker: subprocess.Popen[bytes], log_path: Path) -> float:
    """Poll `done` with a spinner until true; fail naming `what` if the worker dies or DEMO_WAIT_S pass."""
    started = time.monotonic()
    with err.status(f"waiting for the worker to {what}…"):
        while not done():
            if worker.poll() is not None:
                fail(f"the worker exited (status {worker.returncode}) before it could {what}; see its log {log_path}")
            if time.monotonic() - started > DEMO_WAIT_S:
                fail(f"the worker did not {what} within {DEMO_WAIT_S:.0f} s; see its log {log_path}")
            time.sleep(0.1)
    return time.monotonic() - started


def _built_up_to(shoal: Shoal, seq: int) -> Callable[[], bool]:
    def check() -> bool:
        return all(s.built_watermark >= seq for s in shoal.index_status(DEMO_INDEX.name, DEMO_INDEX.version))

    return check


def _hits_table(hits: Sequence[Hit]) -> Table:
    table = Table()
    table.add_column("rank", justify="right")
    table.add_column("package")
    table.add_column("section")
    table.add_column("distance", justify="right")
    for rank, hit in enumerate(hits, 1):
        table.add_row(str(rank), str(hit.attributes["package"]), str(hit.attributes["section"]), f"{hit.distance:.4f}")
    return table


def demo(
    points: Annotated[int, typer.Option("--points", min=1, max=2000, help="How many sample points to ingest.")] = 2000,
    keep_worker: Annotated[
        bool, typer.Option("--keep-worker", help="Leave the demo's worker running at the end and print its pid.")
    ] = False,
    tenant: Tenant = None,
) -> None:
    """The whole loop on the bundled sample of Debian packages (384-d embeddings of their descriptions).

    1. Ingest the sample into the data source debian.packages/1.0 and delete every 400th package: the
    deletions are published as a message and appended by a real consumer (`shoal consume`, a child process).
    Uploads carry batch ids and the message an id keyed on the same rows, so running the demo again with the same
    --points writes nothing new of the sample (and a run with other --points deletes those packages again).
    2. Create the HNSW index debian.packages.hnsw/1.0 (cosine) and start a real Celery worker with beat (a
    child process, logging to SHOAL_DATA_DIR/demo/worker.log); wait until it has built the index.
    3. Search with held-out queries: the embeddings of deleted packages.
    4. Read-your-writes: upload one more point and find it with at_least(its write token) before the index
    the searcher serves holds it; then delete it again (these two log entries are the only ones a re-run adds).
    5. Serve the HTTP API in a child process and search it as a Vektonn client (no key: the anonymous tenant).
    6. Print the freshness table and stop the worker (unless --keep-worker).

    Runs on the embedded servers (or the configured ones).
    """
    started = time.perf_counter()
    settings = load_settings()
    name, version = DEMO_SPEC.name, DEMO_SPEC.version
    with open_shoal(tenant, settings) as shoal:
        broker = shoal.broker_url()
        # Checked before anything is written: the demo publishes to the broker and its worker consumes from it.
        check_broker(broker)
        for line in describe_servers(settings, broker):
            out.print(line)

        # 1. the data source and the sample
        record = shoal.create_data_source(DEMO_SPEC, exist_ok=True)
        out.print(f"data source {name}/{version} in tenant {record.tenant!r}: {DEMO_SPEC.vector_dimension}-d dense, "
                  f"key (id), head seq {record.head_seq}")
        producer = shoal.producer(name, version)
        with demo_files() as (vectors, attributes):
            plan = plan_import(DEMO_SPEC, vectors, attributes=attributes, limit=points, batch_prefix=DEMO_BATCH_PREFIX)
            result = run_import(producer, plan, DEMO_BATCH)
            uploaded = pq.read_table(attributes, columns=["id"])["id"].to_pylist()[: plan.rows]
        ids = [i for i in uploaded if i % DEMO_DELETE_EVERY == 0]
        out.print(f"uploaded {count(result.points)} points in batches of {DEMO_BATCH} ({count(result.new_points)} new)")
        token = _delete_through_the_broker(shoal, settings, ids, delete_message_id(plan.rows, ids))
        deleted = "deleted" if token.seq > record.head_seq else "already deleted"
        out.print(f"  ... and {deleted} ids {', '.join(map(str, ids))} (write token {token})")
        print_log(shoal, name, version, segments=False, show=0)

        # 2. the index and a worker
        existed = any(
            (r.spec.name, r.spec.version) == (DEMO_INDEX.name, DEMO_INDEX.version) for r in shoal.list_indexes()
        )
        index = shoal.create_index(DEMO_INDEX, exist_ok=True)
        spec = index.spec
        out.print(
            f"index {spec.name}/{spec.version} {'exists already' if existed else 'created'}: {spec.algorithm} "
            f"({params_text(spec.params)}), metric {spec.metric}, id (id), {spec.shard_count} shard"
        )
        run_dir = settings.data_dir / "demo"
        log_path = run_dir / "worker.log"
        run_id = time.time_ns()
        schedule = run_dir / f"beat-schedule-{run_id}"  # its own: beat's schedule file takes one writer only
        argv = worker_argv(
            beat=True, schedule=schedule, pool="solo", loglevel="warning", hostname=f"shoal-demo-{run_id}@%h",
        )
        head = shoal.get_data_source(name, version).head_seq
        built_before = _built_up_to(shoal, head)()
        worker = start_worker_process(argv, log_path)
        out.print(f"worker started: pid {worker.pid}, pool solo, beat on, log {log_path}")
        try:
            if built_before:
                out.print(f"the index is built up to seq {count(head)} already (by an earlier run)")
            else:
                took = _wait(f"build the index up to seq {head}", _built_up_to(shoal, head), worker, log_path)
                out.print(f"the worker built the index up to seq {count(head)} ({took:.1f} s after it started)")
            query = _search_and_read_your_writes(shoal, uploaded, ids, worker, log_path)
            http_search(settings, shoal.tenant, spec.name, spec.version, query, DEMO_K)
            out.print(freshness_table(shoal.index_status(spec.name, spec.version), "Freshness"))
        finally:
            if keep_worker and worker.poll() is None:
                out.print(f"worker left running: pid {worker.pid} (stop it with: kill {worker.pid}); log {log_path}")
            else:
                how = stop_worker_process(worker)
                for path in run_dir.glob(f"{schedule.name}*"):  # dbm may add .dat, .dir, .bak
                    path.unlink(missing_ok=True)
                out.print(f"worker {how}")
    out.print(f"demo finished in {time.perf_counter() - started:.1f} s; run it again: the sample writes nothing new.")
    out.print(f"next: shoal index get {DEMO_INDEX.name} {DEMO_INDEX.version} | shoal status | shoal worker | "
              f"shoal search {DEMO_INDEX.name} {DEMO_INDEX.version} --query-file QUERIES.npy")


def delete_message_id(rows: int, ids: list[int]) -> str:
    """The id of the message deleting `ids` after the first `rows` sample points were uploaded: keyed on what the
    upload batch ids are keyed on (the fixed prefix, the batch size and the rows), as well as the ids. A run that
    writes a new upload batch (another --points: its last batch is another) writes deleted ids again, so it must
    publish a new message too; a message id keyed on the deleted ids alone was found committed by the earlier run
    and the deletions were not appended again. A re-run with the same --points finds both committed."""
    return "demo-delete-" + "-".join(map(str, ids)) + f"@{DEMO_BATCH_PREFIX}:{rows}/{DEMO_BATCH}"


def _delete_through_the_broker(shoal: Shoal, settings: Settings, ids: list[int], message_id: str) -> WriteToken:
    """Step 1b: publish the deletions as the message `message_id`, as an upstream processor would, and let a real
    consumer (`shoal consume`, a child process) append them; the message id makes a re-run write nothing."""
    from shoal.intake.publisher import Publisher

    log_path = settings.data_dir / "demo" / "consumer.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        consumer = subprocess.Popen([sys.executable, "-m", "shoal.cli", "consume"], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with Publisher(settings, tenant=shoal.tenant) as publisher:
            publisher.publish(DEMO_SPEC.name, DEMO_SPEC.version, [Tombstone({"id": i}) for i in ids],
                              message_id=message_id)
        out.print(f"published {len(ids)} tombstones as message {message_id}; consumer pid {consumer.pid}, "
                  f"log {log_path}")
        deadline = time.monotonic() + 120
        while (token := shoal.message_token(DEMO_SPEC.name, DEMO_SPEC.version, message_id)) is None:
            if consumer.poll() is not None:
                fail(f"the consumer exited with code {consumer.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                fail(f"the consumer did not commit the message within 120 s; see {log_path}")
            time.sleep(0.05)
        return token
    finally:
        stop_worker_process(consumer)  # type: ignore[arg-type]


def _search_and_read_your_writes(
    shoal: Shoal, uploaded: list[int], deleted_ids: list[int], worker: subprocess.Popen[bytes], log_path: Path
) -> np.ndarray:
    """Steps 3 and 4; returns the first held-out query (the HTTP step searches it again)."""
    spec = DEMO_INDEX
    vectors, table = load_demo(max(uploaded) + 1)
    row_of = {pid: row for row, pid in enumerate(table["id"].to_pylist())}
    held_out = [i for i in DEMO_QUERY_IDS if i in deleted_ids] or deleted_ids[-len(DEMO_QUERY_IDS):]
    queries = np.stack([vectors[row_of[i]] for i in held_out])
    # Not following new versions: the view loaded by the first search stays served, which makes step 4 visible.
    searcher = shoal.searcher(follow=False)
    try:
        # 3. held-out queries
        results = searcher.search(spec.name, spec.version, queries, DEMO_K)
        served = min(searcher.served_watermarks(spec.name, spec.version).values())
        for pid, hits in zip(held_out, results, strict=True):
            row = row_of[pid]
            out.print(f"search: the {DEMO_K} nearest to the embedding of {table['package'][row]} "
                      f"(\"{table['description'][row]}\"), a package deleted above, so held out of the index")
            out.print(_hits_table(hits))

        # 4. read-your-writes
        producer = shoal.producer(DEMO_SPEC.name, DEMO_SPEC.version)
        point = {"id": [RYW_ID], "package": [RYW_PACKAGE], "section": ["demo"], "priority": ["optional"],
                 "installed_size_kb": [0], "version": ["1.0"], "architecture": ["all"]}
        token = producer.upload_columns(queries[:1], point)
        try:
            eventual = searcher.search(spec.name, spec.version, queries[:1], 1)[0]
            fresh = searcher.search(spec.name, spec.version, queries[:1], 1,
                                    consistency=Consistency.at_least(token))[0]
            built = min(s.built_watermark for s in shoal.index_status(spec.name, spec.version))
            first = table["package"][row_of[held_out[0]]]
            out.print(f"read-your-writes: uploaded {RYW_PACKAGE} with the embedding of {first}, write token {token}")
            out.print(f"  eventual            -> {_top(eventual)}  (the searcher serves the index at seq "
                      f"{count(served)})")
            out.print(f"  at_least:{token.seq:<10} -> {_top(fresh)}  (found by an exact scan of the log above seq "
                      f"{count(served)}; the worker had built up to seq {count(built)})")
            if not fresh or fresh[0].attributes["package"] != RYW_PACKAGE:
                fail("read-your-writes failed: the point just written was not found")
        finally:
            # Whatever happened above: a failed or interrupted run must not leave a point outside the sample live.
            gone = producer.delete({"id": [RYW_ID]})
        out.print(f"  deleted {RYW_PACKAGE} again (write token {gone}): the next run shows this again")
        _wait(f"build the index up to seq {gone.seq}", _built_up_to(shoal, gone.seq), worker, log_path)
        searcher.refresh()  # serve the newest version, so the freshness table shows no lag
    finally:
        searcher.close()
    return queries[0]


def _top(hits: Sequence[Hit]) -> str:
    if not hits:
        return "no hit"
    return f"{hits[0].attributes['package']} (distance {hits[0].distance:.4f})"
