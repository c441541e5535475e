"""Child process of the crash test: uploads batches from 4 threads and prints each acknowledgement.

An ack line is printed only after `upload` returned, i.e. after the batch was durably committed.
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np
from workload import CRASH_SPEC, crash_batch_size

from shoal import DataPoint, Shoal

run = sys.argv[1]
shoal = Shoal()
producer = shoal.producer(CRASH_SPEC.name, CRASH_SPEC.version)
out = threading.Lock()


def work(thread: int) -> None:
    rng = np.random.default_rng(hash((run, thread)) % 2**32)
    for i in range(10**6):
        batch_id = f"{run}-{thread}-{i}"
        n = crash_batch_size(batch_id)
        vectors = rng.random((n, 8), dtype=np.float32)
        if i % 3 == 0:  # exercise the row path too
            points = [DataPoint({"batch": batch_id, "i": j}, vectors[j]) for j in range(n)]
            token = producer.upload(points, batch_id=batch_id)
        else:
            token = producer.upload_columns(vectors, {"batch": [batch_id] * n, "i": np.arange(n)}, batch_id=batch_id)
        with out:
            print(json.dumps({"batch": batch_id, "seq": token.seq}), flush=True)


threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
