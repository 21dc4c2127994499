"""One worker of `kvps bench compare`'s MXNet 1.9.1 baseline: dist_sync, under MXNet's own Python.

    DMLC_ROLE=worker DMLC_PS_ROOT_URI=... ~/mxvenv/bin/python kvps/tools/bench/mxnet_compare_worker.py plan.json

Times the plan's gradient set as the anchor (shared/anchors/mx_resnet_comm.py) and
mxnet_worker.py do: push every key, then pull every key, then waitall. Then one training step
of the same MLP as train_step.py, built in Gluon, whose Trainer syncs gradients through the same
kvstore with update_on_kvstore=False (the servers sum, every worker runs SGD: kvps's sync mode).
kvps is not installed in MXNet's Python, so this imports only standard-library modules from its
own folder. Rank 0 prints JSON lines in workloads.py's format.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mxnet as mx                      # noqa: E402  (needs the path above first)
from mxnet import autograd, gluon       # noqa: E402

import workloads                        # noqa: E402
from mxnet_worker import MXNetPeer      # noqa: E402


def build(spec):
    """(net, x, y): the MLP of train_step.py in Gluon, seeded, and a fixed batch."""
    mx.random.seed(spec["seed"])
    net = gluon.nn.Sequential()
    layers = spec["layers"]
    for i, (a, b) in enumerate(zip(layers, layers[1:])):
        net.add(gluon.nn.Dense(b, in_units=a, activation="relu" if i < len(layers) - 2 else None))
    net.initialize(mx.init.Xavier())
    x = mx.nd.random.normal(shape=(spec["batch"], layers[0]))
    y = mx.nd.random.randint(0, layers[-1], shape=(spec["batch"],)).astype("float32")
    return net, x, y


def step_fn(net, trainer, x, y):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    def step():
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
        mx.nd.waitall()
    return step


def train(spec, peer):
    nbytes = 4 * sum(a * b + b for a, b in zip(spec["layers"], spec["layers"][1:]))
    sgd = {"learning_rate": spec["lr"], "momentum": spec["momentum"]}
    for workload, kv in (("train_local", None), ("train", peer.kv)):
        net, x, y = build(spec)
        trainer = gluon.Trainer(net.collect_params(), "sgd", sgd, kvstore=kv,
                                update_on_kvstore=False if kv is not None else None)
        times = workloads.timed(step_fn(net, trainer, x, y), spec["warmup"], spec["steps"], peer.barrier)
        if peer.rank == 0:
            row = dict(workload=workload, mode="gluon", bytes=nbytes, **workloads.summary(times, nbytes))
            print(json.dumps(dict(row, bench=workloads.TAG, system="mxnet")), flush=True)


def main(argv):
    if len(argv) != 2:
        print(f"usage: {argv[0]} PLAN.json", file=sys.stderr)
        return 2
    plan = workloads.load_plan(argv[1])
    peer = MXNetPeer("dist_sync")
    workloads.run(plan, peer)
    if plan.get("train"):
        train(plan["train"], peer)
    peer.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
