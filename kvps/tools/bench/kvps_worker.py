"""One worker of the push/pull benchmark on kvps (started by `kvps bench pushpull`, one per rank).

    kvps launch -n 2 -s 1 -- python -m kvps.tools.bench.kvps_worker plan.json

Times the plan's workloads (workloads.py) with kvps's dist kvstore; rank 0
prints the results as JSON lines.
"""
import sys

import numpy as np

import kvps

from kvps.tools.bench import workloads


class KVPSPeer:
    """The benchmark's view of a kvps kvstore."""
    name = "kvps"
    modes = ("push+pull", "pushpull")

    def __init__(self, kvtype):
        self.kv = kvps.create(kvtype)
        self.rank = self.kv.rank

    @staticmethod
    def zeros(shape):
        return np.zeros(shape, np.float32)

    @staticmethod
    def ones(shape):
        return np.ones(shape, np.float32)

    def init(self, keys, arrays):
        self.kv.init(keys, arrays)

    def barrier(self):
        self.kv.barrier()

    def step(self, mode, keys, grads, outs):
        kv = self.kv
        if mode == "pushpull":
            return lambda: kv.pushpull(keys, grads, out=outs)

        def push_then_pull():
            # As MXNet's engine does: the push goes out without waiting, the pull follows it
            # (the server answers the pull once the push's round has closed).
            kv.push(keys, grads, async_op=True)
            kv.pull(keys, out=outs)
            kv.wait_all()
        return push_then_pull

    def close(self):
        self.kv.close()


def main(argv):
    if len(argv) != 2:
        print(f"usage: {argv[0]} PLAN.json", file=sys.stderr)
        return 2
    plan = workloads.load_plan(argv[1])
    peer = KVPSPeer(plan["kvtype"])
    workloads.run(plan, peer)
    peer.close()        # after a failure, kvps's exit handler closes it (and only logs what goes wrong)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
