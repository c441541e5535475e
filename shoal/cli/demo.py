"""`shoal demo`: ingest the bundled Debian packages sample, delete a few, and show the log."""

from __future__ import annotations

import time
from typing import Annotated

import pyarrow.parquet as pq
import typer

from shoal.cli.common import Tenant, load_settings, open_shoal, out
from shoal.cli.formatting import count
from shoal.cli.logview import print_log
from shoal.config.settings import mask_url
from shoal.demo import DEMO_SPEC, demo_files
from shoal.ingest.bulk import plan_import, run_import

DEMO_BATCH = 500
DEMO_DELETE_EVERY = 400  # the demo deletes the packages whose id is a multiple of this
DEMO_BATCH_PREFIX = "demo"  # fixed, not derived from the files: a re-run must find the same batch ids


def demo(
    points: Annotated[int, typer.Option("--points", min=1, max=2000, help="How many sample points to ingest.")] = 2000,
    tenant: Tenant = None,
) -> None:
    """Ingest the bundled sample of Debian packages (384-d embeddings) into debian.packages/1.0 and show the log.

    Runs on the embedded servers (or the configured ones). Uploads go in batches of 500 with batch ids and
    the deletions in one tombstone batch with its own id, so running the demo again writes nothing new.
    """
    started = time.perf_counter()
    settings = load_settings()
    name, version = DEMO_SPEC.name, DEMO_SPEC.version
    with open_shoal(tenant, settings) as shoal:
        catalog = (
            mask_url(settings.database_url) if settings.database_url else f"embedded Postgres in {settings.data_dir}"
        )
        out.print(f"catalog: {catalog}")
        out.print(f"broker:  {mask_url(shoal.broker_url())}")
        out.print(f"storage: {settings.resolved_storage_uri}")
        record = shoal.create_data_source(DEMO_SPEC, exist_ok=True)
        out.print(f"data source {name}/{version} in tenant {record.tenant!r}: {DEMO_SPEC.vector_dimension}-d dense, "
                  f"key (id), head seq {record.head_seq}")

        producer = shoal.producer(name, version)
        with demo_files() as (vectors, attributes):
            plan = plan_import(DEMO_SPEC, vectors, attributes=attributes, limit=points, batch_prefix=DEMO_BATCH_PREFIX)
            result = run_import(producer, plan, DEMO_BATCH)
            uploaded = pq.read_table(attributes, columns=["id"])["id"].to_pylist()[: plan.rows]
        ids = [i for i in uploaded if i % DEMO_DELETE_EVERY == 0]
        token = producer.delete({"id": ids}, batch_id="demo:delete:" + ",".join(map(str, ids)))
        deleted = "deleted" if token.seq > record.head_seq else "already deleted"
        out.print(
            f"uploaded {count(result.points)} points in batches of {DEMO_BATCH} ({count(result.new_points)} new); "
            f"{deleted} ids {', '.join(map(str, ids))}; write token {token}"
        )
        out.print()
        print_log(shoal, name, version, segments=True, show=5)
    out.print(f"demo finished in {time.perf_counter() - started:.1f} s; run it again: it writes nothing new.")
