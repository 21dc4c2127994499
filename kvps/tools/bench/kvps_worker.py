"""One worker of the push/pull benchmark on kvps (started by `kvps bench pushpull`, one per rank).

    kvps launch -n 2 -s 1 -- python -m kvps.tools.bench.kvps_worker plan.json

Times the plan's workloads (workloads.py) with kvps's dist kvstore; rank 0
prints the results as JSON lines.
"""
import sys
import warnings

import numpy as np

import kvps

from kvps.tools.bench import workloads


class KVPSPeer:
    """The benchmark's view of a kvps kvstore. Its modes are the call patterns (PATTERNS) the plan
    asks for: "push+pull" as MXNet scripts write it, "pushpull-each" (-async) as Gluon's Trainer
    does, "list" and "pushpull" with whole lists."""
    name = "kvps"

    def __init__(self, kvtype, modes=None, calls=1):
        self.kv = kvps.create(kvtype)
        self.rank = self.kv.rank
        self.modes = tuple(modes or workloads.KVPS_MODES)
        self.calls = calls               # pushpull calls per timed step (a GEO job's K: one of them syncs)

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
            if self.calls > 1:
                def calls():
                    for _ in range(self.calls):
                        kv.pushpull(keys, grads, out=outs)
                return calls
            return lambda: kv.pushpull(keys, grads, out=outs)
        if mode == "list":
            def push_list_then_pull_list():
                kv.push(keys, grads)
                kv.pull(keys, out=outs)
            return push_list_then_pull_list
        if mode == "pushpull-each":
            # Gluon's Trainer's calls (MXNet 1.6 on): one blocking pushpull per key, which kvps warns
            # about (it is timed here on purpose)
            warnings.filterwarnings("ignore", category=kvps.PerformanceWarning)

            def pushpull_each():
                for i, (key, grad, out) in enumerate(zip(keys, grads, outs)):
                    kv.pushpull(key, grad, out=out, priority=-i)
            return pushpull_each
        if mode == "pushpull-each-async":
            def pushpull_each_async():
                for i, (key, grad, out) in enumerate(zip(keys, grads, outs)):
                    kv.pushpull(key, grad, out=out, priority=-i, async_op=True)
                kv.wait_all()
            return pushpull_each_async
        if mode != "push+pull":
            raise ValueError(f"unknown mode {mode!r}")

        def mxnet_loops():
            # As MXNet scripts and Gluon's Trainer call it: blocking defaults, one key per call.
            for i, (key, grad) in enumerate(zip(keys, grads)):
                kv.push(key, grad, priority=-i)
            for i, (key, out) in enumerate(zip(keys, outs)):
                kv.pull(key, out=out, priority=-i)
        return mxnet_loops

    def traffic(self):
        """Payload bytes every server has received and sent so far (plan "traffic")."""
        return sum(s.get("bytes_in", 0) + s.get("bytes_out", 0) for s in self.kv.server_stats().values())

    def close(self):
        self.kv.close()


def main(argv):
    if len(argv) != 2:
        print(f"usage: {argv[0]} PLAN.json", file=sys.stderr)
        return 2
    plan = workloads.load_plan(argv[1])
    peer = KVPSPeer(plan["kvtype"], plan.get("modes"), plan.get("calls", 1))
    if plan.get("compression"):         # kvps emulate sync --compression
        peer.kv.set_gradient_compression(plan["compression"])
    workloads.run(plan, peer)
    peer.close()        # after a failure, kvps's exit handler closes it (and only logs what goes wrong)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
