"""Experiment workload: a small MLP on scikit-learn's handwritten digits, trained through a kvstore
(--model cnn: a small CNN; --model wide: a 64-128-128-10 MLP whose gradients are big enough for
a 100 Mbit/s link to matter, the `wide` workload of `kvps experiment --emulate`).

    kvps launch -n 3 -s 1 -- python -m kvps.tools.experiment.workloads.digits --kvstore dist_sync --steps 1500
    kvps launch -n 3 -s 0 -- python -m kvps.tools.experiment.workloads.digits --kvstore allreduce

The data ships with scikit-learn (1,797 8x8 images, no download). A fixed stratified split
(--seed) keeps 450 images for the test set; worker r trains on every W-th remaining image from
r. Each step a worker computes the gradient of one minibatch and sends it with pushpull, which
brings back the fresh weights. The update is plain SGD with rescale_grad = 1/W (1/(W - B) with
B backup workers), so a round's gradients average; kv.set_optimizer puts it on the servers for
parameter-server kvstores and on every worker alike for the ring ('allreduce' sums the
gradients, then each worker applies the same step). Rank 0 evaluates on the test set every
--eval-every ("0.1s" or "50" steps) and prints JSON lines; every worker prints a final line
(kvps/tools/experiment/logbook.py has the format).

    kvps launch -n 2 -s 1 -- python -m kvps.tools.experiment.workloads.digits --kvstore dist_geo:4
    kvps launch -n 2 -s 1 -- python -m kvps.tools.experiment.workloads.digits --compression '{"type":"2bit"}'

Under GEO-SGD (dist_geo:K, docs/consistency.md) the servers run no optimizer: each worker steps
its own torch SGD (the same lr and momentum) every step and hands its weights to
kv.pushpull(names, weights, out=weights), which every K steps sends their change since the last
sync and brings back the merged weights; at the end kv.sync() merges every worker's last change.
Rank 0 evaluates the merged weights, right after a sync. --compression JSON calls
kv.set_gradient_compression with it before init (docs/compression.md; "pull": true compresses
the pulls too).
`kvps experiment` runs this script under every mode (docs/experiment.md).
"""
import argparse
import json

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import kvps
from kvps.tools.experiment.logbook import Logbook, gradient_scale

TEST_SIZE = 450


def dataset(seed):
    """(x_train, y_train), (x_test, y_test) as torch tensors, pixels scaled to [0, 1]."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=TEST_SIZE,
                                                        random_state=seed, stratify=digits.target)
    return ((torch.from_numpy(x_train), torch.from_numpy(y_train).long()),
            (torch.from_numpy(x_test), torch.from_numpy(y_test).long()))


def model(kind, seed, hidden=128):
    torch.manual_seed(seed)
    if kind == "wide":
        # Two hidden layers of `hidden` units: 26,122 parameters (104 KB of gradients) at 128, so
        # that on a 100 Mbit/s link a push takes about as long as a step's compute at batch 512.
        return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                   torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    if kind == "cnn":
        return torch.nn.Sequential(
            torch.nn.Unflatten(1, (1, 8, 8)), torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2), torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(128, 10))
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kvstore", default="dist_sync", help="kvstore type: dist_sync, dist_async, dist_ssp:4, "
                                                          "dist_sync:backup=1, dist_geo:4, allreduce, local")
    p.add_argument("--compression", type=json.loads, default=None, metavar="JSON",
                   help='kv.set_gradient_compression(JSON), e.g. \'{"type": "2bit", "pull": true}\'')
    p.add_argument("--model", choices=("mlp", "cnn", "wide"), default="mlp")
    p.add_argument("--hidden", type=int, default=128, help="units of each hidden layer of --model wide")
    p.add_argument("--steps", type=int, default=1500, help="training steps of each worker (at most)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this much training time")
    p.add_argument("--batch", type=int, default=32, help="minibatch of each worker")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--eval-every", default="0.1s", help="seconds of training ('0.1s') or steps ('50')")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    # Many processes share the cores: one torch thread each (torch's idle threads spin).
    torch.set_num_threads(1)
    kv = kvps.create(args.kvstore)
    if args.compression is not None:
        kv.set_gradient_compression(args.compression)             # before init: the first pull starts exact
    rank, workers = kv.rank, kv.num_workers
    (x, y), (x_test, y_test) = dataset(args.seed)
    x, y = x[rank::workers], y[rank::workers]
    net = model(args.model, args.seed, args.hidden)
    names = [name for name, _ in net.named_parameters()]
    params = [param for _, param in net.named_parameters()]
    weights = [param.data for param in params]
    kv.init(names, [param.detach() for param in params])
    kv.pull(names, out=weights)                                    # every worker starts from rank 0's weights
    geo = getattr(kv, "mode", None) == "geo"
    if geo:              # GEO: each worker's own optimizer; the servers add the changes (no optimizer)
        local = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)
    else:
        kv.set_optimizer(kvps.optimizer.SGD(learning_rate=args.lr, momentum=args.momentum,
                                            rescale_grad=gradient_scale(kv)))
    loss_fn = torch.nn.CrossEntropyLoss()
    loss_fn(net(x[:args.batch]), y[:args.batch]).backward()        # warm torch up before the clock starts
    g = torch.Generator().manual_seed(1000 * args.seed + rank)
    book = Logbook(kv, nkeys=len(names), eval_every=args.eval_every)

    def evaluate():
        with book.evaluating(), torch.no_grad():
            logits = net(x_test)
            loss = loss_fn(logits, y_test).item()
            accuracy = (logits.argmax(1) == y_test).float().mean().item()
        book.point(loss=loss, accuracy=accuracy)

    kv.barrier()
    book.start()
    while book.training(args.steps, args.seconds):
        idx = torch.randint(0, len(x), (args.batch,), generator=g)
        net.zero_grad()
        loss_fn(net(x[idx]), y[idx]).backward()
        if geo:
            local.step()                                     # a local step, then the GEO step:
            kv.pushpull(names, weights, out=weights)         # a sync every K of them
        else:
            kv.pushpull(names, [param.grad for param in params], out=weights)
        book.after_step(evaluate)

    def merge():                       # GEO: every worker's last change in, every worker the merged weights
        kv.sync()
        kv.pull(names, out=weights)

    book.finish(evaluate, merge=merge if geo else None)    # rank 0 evaluates the final weights; all join
    kv.close()


if __name__ == "__main__":
    main()
