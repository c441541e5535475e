"""Child process of the concurrency test: producer N uploads its deterministic batches in order."""

from __future__ import annotations

import json
import sys

from workload import MIX_SPEC, mix_batches

from shoal import Shoal

producer_no, rounds = int(sys.argv[1]), int(sys.argv[2])
shoal = Shoal()
producer = shoal.producer(MIX_SPEC.name, MIX_SPEC.version)
tokens = [producer.upload(batch).seq for batch in mix_batches(producer_no, rounds)]
print(json.dumps(tokens), flush=True)
