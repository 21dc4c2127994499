"""One real training step of a small torch model, timed the same way under every torch system.

    run_steps(plan["train"], rank, barrier, distribute, system="kvps", mode="sync")   # in every worker

`kvps bench compare` times, in each worker of each job: the step with no synchronisation at all
(`train_local`: the compute cost, with all W workers busy on the same cores), then the step with
the system's gradient sync (`train`): forward, backward, gradient sync, optimizer step. The
model is built from a fixed seed and trained on one fixed batch, so every system runs exactly the
same arithmetic; `distribute(model)` returns the (model, optimizer) pair the system trains with:
kvps.torch.DistributedOptimizer (compare_worker.py) or DistributedDataParallel (gloo_worker.py).
The MXNet worker builds the same network in Gluon (mxnet_compare_worker.py); compare.py writes
the spec (layers, batch, seed, lr, momentum, warm-up and timed steps) into the plan.

Rank 0 prints one JSON line per result, in workloads.py's format (tag, workload, mode, bytes, ms).
"""
import json
import os
import sys

try:
    import torch
except ImportError:        # the parent uses threads() only; every worker that trains has torch
    torch = None

from kvps.tools.bench import workloads


def num_params(layers):
    return sum(a * b + b for a, b in zip(layers, layers[1:]))


def build(spec):
    """(model, x, y): the MLP with its seeded initial weights and the fixed batch."""
    torch.manual_seed(spec["seed"])
    layers = []
    for a, b in zip(spec["layers"], spec["layers"][1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    x = torch.randn(spec["batch"], spec["layers"][0], generator=g)
    y = torch.randint(0, spec["layers"][-1], (spec["batch"],), generator=g)
    return model, x, y


def sgd(model, spec):
    return torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=spec["momentum"])


def step_fn(model, opt, x, y):
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return step


def emit(rank, out=None, **row):
    """Rank 0 writes one result line (workloads.py's format)."""
    if rank == 0:
        out = out or sys.stdout
        out.write(json.dumps(dict(row, bench=workloads.TAG)) + "\n")
        out.flush()


def run_steps(spec, rank, barrier, distribute, system, mode):
    """Time the local step, then the distributed one; rank 0 prints both."""
    nbytes = 4 * num_params(spec["layers"])
    model, x, y = build(spec)
    times = workloads.timed(step_fn(model, sgd(model, spec), x, y), spec["warmup"], spec["steps"], barrier)
    emit(rank, system=system, workload="train_local", mode=mode, bytes=nbytes, **workloads.summary(times, nbytes))
    model, x, y = build(spec)
    model, opt = distribute(model)
    times = workloads.timed(step_fn(model, opt, x, y), spec["warmup"], spec["steps"], barrier)
    emit(rank, system=system, workload="train", mode=mode, bytes=nbytes, **workloads.summary(times, nbytes))
    barrier()


def threads(setting, workers):
    """Torch (and OpenMP) threads per worker for --threads: "auto" gives every worker an equal share
    of the cores (torch's idle threads spin and starve the other processes), "default" None (leave
    each library's own default, as the anchor scripts do), a number that number."""
    if setting == "default":
        return None
    if setting == "auto":
        return max(1, (os.cpu_count() or 1) // workers)
    return int(setting)


def set_threads(setting, workers):
    n = threads(setting, workers)
    if n is not None:
        torch.set_num_threads(n)
