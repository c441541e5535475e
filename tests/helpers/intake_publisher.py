"""Child process of the intake tests: publisher W sends its messages (10 points each) at a steady pace,
with poison messages mixed in at fixed positions; prints the message ids it published as JSON."""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from shoal.intake.codec import JSON
from shoal.intake.publisher import Publisher
from shoal.log.records import DataPoint

worker, messages, per_message, rate = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
poison_every = int(sys.argv[5])
DIM = 8


def vector(i: int) -> list[float]:
    return (np.arange(DIM, dtype=np.float64) + i % 1000).tolist()


published = []
poisoned = []
with Publisher() as p:
    t0 = time.monotonic()
    for m in range(messages):
        first = (worker * messages + m) * per_message
        points = [DataPoint({"id": i, "tag": f"w{worker}"}, vector(i)) for i in range(first, first + per_message)]
        published.append(p.publish("events", "1", points))
        if poison_every and m % poison_every == poison_every // 2:
            # Refused by validation: one point with a vector of the wrong dimension, and a body that is no JSON.
            if (m // poison_every) % 2:
                poisoned.append(p.publish("events", "1", [DataPoint({"id": -1, "tag": "bad"}, [1.0, 2.0])]))
            else:
                poisoned.append(p.publish_raw("events", "1", b'{"not": "a list"', JSON))
        ahead = t0 + (m + 1) / rate - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)  # pacing the publisher, not waiting for a result
print(json.dumps({"published": published, "poisoned": poisoned}), flush=True)
