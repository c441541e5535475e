"""Child process of the compaction crash test: in a loop, commits a batch of updates and deletes (printing
its acknowledgement once `upload` returned), builds the index, compacts the log and collects garbage, until
it is killed. Each step announces itself on stdout first, so the test knows where the kill landed."""

from __future__ import annotations

import itertools
import json
import sys

from compaction_checks import COMPACT_SPEC, mix_batch

from shoal import Shoal
from shoal.index.builder import LeaseBusyError, ShardBuilder

run, index = sys.argv[1], sys.argv[2]
shoal = Shoal(notify=False)
producer = shoal.producer(COMPACT_SPEC.name, COMPACT_SPEC.version)
builder = ShardBuilder(shoal.engine, shoal.storage, lease_seconds=shoal.settings.lease_seconds)
shards = [s.id for s in shoal.get_index(index, "1").shards]


def stage(name: str) -> None:
    print(json.dumps({"stage": name}), flush=True)


for i in itertools.count():
    batch_id = f"{run}-{i}"
    stage("upload")
    token = producer.upload(mix_batch(batch_id), batch_id=batch_id)
    print(json.dumps({"batch": batch_id, "seq": token.seq}), flush=True)
    if i % 2 == 0:  # moves the lowest watermark, so compaction has new garbage below it
        stage("build")
        for shard in shards:
            try:
                builder.materialize(shard)
            except LeaseBusyError:  # a killed predecessor's lease, until it expires
                pass
    stage("compact")
    shoal.compact(COMPACT_SPEC.name, COMPACT_SPEC.version)
    stage("gc")
    shoal.collect_garbage()
