"""One worker of `kvps bench priority` (one per rank, started by kvps launch):

    python -m kvps.tools.bench.priority_worker STEPS WARMUP

Syncs ResNet-50's 161 gradients as a training step produces and needs them: backward makes the
last layer's gradient first, so the pushes go last key first (`priority=-i`, Gluon's Trainer's
priorities), and the next forward needs the first layer first, so the pulls go first key first.
Rank 0 prints, per timed step, when the first layer's weights were back and when the whole step
was done, as one JSON line.
"""
import json
import sys
import time

import numpy as np

import kvps

from kvps.tools.bench import workloads


def step(kv, keys, grads, outs):
    """(seconds until keys[0] is pulled, seconds for the whole step)."""
    start = time.perf_counter()
    for i in reversed(range(len(keys))):
        kv.push(keys[i], grads[i], priority=-i)
    first = None
    for i, (key, out) in enumerate(zip(keys, outs)):
        kv.pull(key, out=out, priority=-i)
        if first is None:
            first = time.perf_counter() - start
    return first, time.perf_counter() - start


def main(argv):
    if len(argv) != 3:
        print(f"usage: {argv[0]} STEPS WARMUP", file=sys.stderr)
        return 2
    steps, warmup = int(argv[1]), int(argv[2])
    shapes = workloads.resnet50_shapes()
    keys = [workloads.RESNET_KEY0 + i for i in range(len(shapes))]
    kv = kvps.create("dist_sync")
    kv.init(keys, [np.zeros(s, np.float32) for s in shapes])
    grads = [np.ones(s, np.float32) for s in shapes]
    outs = [np.zeros(s, np.float32) for s in shapes]
    for _ in range(warmup):
        step(kv, keys, grads, outs)
    kv.barrier()
    times = [step(kv, keys, grads, outs) for _ in range(steps)]
    expected = float(kv.num_workers)    # every step's round sums each worker's ones
    if any(not np.all(out == expected) for out in outs):
        print("pulled values are wrong", file=sys.stderr)
        return 1
    if kv.rank == 0:
        print(json.dumps({"bench": "kvps-bench-priority", "first_ms": [1e3 * f for f, _ in times],
                          "step_ms": [1e3 * s for _, s in times]}), flush=True)
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
