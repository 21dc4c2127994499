"""One worker of the push/pull benchmark on MXNet 1.9.1's dist KVStore, the baseline.

    DMLC_ROLE=worker DMLC_PS_ROOT_URI=... ~/mxvenv/bin/python kvps/tools/bench/mxnet_worker.py plan.json

Runs under MXNet's own Python (kvps is not installed there), so it imports
only the standard-library module workloads.py, from its own folder, and runs
the same timing loop as kvps's workers. `kvps bench pushpull --mxnet PYTHON`
starts the scheduler, servers and workers (mxnet_job.py).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mxnet as mx            # noqa: E402  (needs the path above first)

import workloads              # noqa: E402


class MXNetPeer:
    """The benchmark's view of an MXNet dist kvstore: per-key pushes then pulls (as MXNet scripts
    call them), and per-key pushpulls (as Gluon's Trainer does since MXNet 1.6)."""
    name = "mxnet"

    def __init__(self, kvtype, modes=("push+pull",)):
        self.kv = mx.kv.create(kvtype)
        self.modes = tuple(modes)
        if "async" in kvtype:
            # MXNet's async servers abort without an updater; a zero learning rate keeps values fixed.
            self.kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.0))
        self.rank = self.kv.rank

    @staticmethod
    def zeros(shape):
        return mx.nd.zeros(shape)

    @staticmethod
    def ones(shape):
        return mx.nd.ones(shape)

    def init(self, keys, arrays):
        self.kv.init(keys, arrays)

    def barrier(self):
        self.kv._barrier()     # MXNet's worker barrier is private

    def step(self, mode, keys, grads, outs):
        kv = self.kv
        if mode == "pushpull-each":
            def pushpull_each():            # Gluon's Trainer (MXNet 1.6 on), for dense gradients
                for i, (key, grad, out) in enumerate(zip(keys, grads, outs)):
                    kv.pushpull(key, grad, out=out, priority=-i)
                mx.nd.waitall()
            return pushpull_each
        if mode != "push+pull":
            raise ValueError(f"the MXNet peer times push+pull and pushpull-each, not {mode!r}")

        def push_then_pull():
            for i, (key, grad) in enumerate(zip(keys, grads)):
                kv.push(key, grad, priority=-i)
            for i, (key, out) in enumerate(zip(keys, outs)):
                kv.pull(key, out=out, priority=-i)
            mx.nd.waitall()
        return push_then_pull


def main(argv):
    if len(argv) != 2:
        print(f"usage: {argv[0]} PLAN.json", file=sys.stderr)
        return 2
    plan = workloads.load_plan(argv[1])
    workloads.run(plan, MXNetPeer(plan["kvtype"], workloads.mxnet_modes(plan.get("modes"))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
