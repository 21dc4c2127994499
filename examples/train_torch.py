"""Train a small MLP with kvps.torch.DistributedOptimizer: a torch training loop, unchanged but for four lines.

    kvps launch -n 2 -s 1 -- python examples/train_torch.py --mode sync
    kvps launch -n 2 -s 1 -- python examples/train_torch.py --mode async
    kvps launch -n 2 -s 1 -- python examples/train_torch.py --mode sync --compression 2bit --uneven
    kvps launch -n 2 -s 0 -- python examples/train_torch.py --mode allreduce

Each worker trains on its own shard of a fixed synthetic classification task. With --uneven,
worker r gets fewer batches the higher its rank; join() lets the others finish, then every
worker takes the weights of the one that trained longest (sync and async; allreduce once the
ring kvstore has join()). Rank 0 prints JSON lines: test loss
and accuracy against epochs and wall-clock time.
"""
import argparse
import json
import time

import torch

import kvps.torch as kt


def dataset(seed=0, n_train=8192, n_test=2048, dim=20, classes=8):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=g) * 0.45

    def draw(n):
        y = torch.randint(0, classes, (n,), generator=g)
        return centers[y] + torch.randn(n, dim, generator=g), y
    return draw(n_train), draw(n_test)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="sync", choices=["sync", "async", "allreduce"])
    p.add_argument("--update-on", default=None, choices=["server", "worker"], help="async: where the optimizer runs")
    p.add_argument("--compression", default=None, help="fp16, bf16, 2bit, 1bit or topk")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=64, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--backward-passes", type=int, default=1, help="micro-batches per step (gradient accumulation)")
    p.add_argument("--uneven", action="store_true", help="give higher ranks fewer batches, to show join()")
    args = p.parse_args()

    kv = kt.init(args.mode)                                      # the job's kvstore for this mode
    rank, workers = kv.rank, kv.num_workers
    (x, y), (x_test, y_test) = dataset()
    x, y = x[rank::workers], y[rank::workers]
    if args.uneven:
        keep = len(x) * (workers - rank) // workers
        x, y = x[:keep], y[:keep]

    torch.manual_seed(1 + rank)                                  # different on purpose: broadcast fixes it
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=args.lr / 10)
    opt = kt.DistributedOptimizer(opt, model.named_parameters(), mode=args.mode, compression=args.compression,
                                  backward_passes_per_step=args.backward_passes, update_on=args.update_on)
    kt.broadcast_parameters(model.state_dict(), root_rank=0)
    kt.broadcast_optimizer_state(opt, root_rank=0)

    loss_fn = torch.nn.CrossEntropyLoss()
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch * 1000 + rank))
        for i in range(0, len(order) - args.batch + 1, args.batch):
            idx = order[i:i + args.batch]
            opt.zero_grad()
            for chunk in idx.chunk(args.backward_passes):
                (loss_fn(model(x[chunk]), y[chunk]) / args.backward_passes).backward()
            opt.step()
        if args.uneven:
            last = kt.join()                                     # let the others finish their rounds
            if args.mode != "async":                             # (async: everyone has the servers' weights)
                kt.broadcast_parameters(model.state_dict(), root_rank=last)
        if rank == 0:
            with torch.no_grad():
                logits = model(x_test)
                print(json.dumps({"mode": args.mode, "workers": workers, "epoch": epoch,
                                  "time": round(time.perf_counter() - start, 3),
                                  "loss": round(loss_fn(logits, y_test).item(), 5),
                                  "accuracy": round((logits.argmax(1) == y_test).float().mean().item(), 5)}),
                      flush=True)
    kv.close()


if __name__ == "__main__":
    main()
