"""Train a small MLP on a fixed synthetic classification task through a kvps kvstore.

    kvps launch -n 2 -s 1 -- python examples/train_mlp.py --kvstore dist_sync
    python examples/train_mlp.py --kvstore local            # one process, the reference

Each worker trains on its own shard; gradients go to the servers, where SGD with
momentum runs (rescale_grad = 1/W averages the workers' gradients), and the
fresh weights come back in the same call (pushpull). Rank 0 prints JSON lines:
loss and test accuracy against steps and wall-clock time.
"""
import argparse
import json
import os
import time

import torch

import kvps


def dataset(seed=0, n_train=8192, n_test=2048, dim=20, classes=8):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=g) * 0.45
    def draw(n):
        y = torch.randint(0, classes, (n,), generator=g)
        x = centers[y] + torch.randn(n, dim, generator=g)
        return x, y
    return draw(n_train), draw(n_test)


def model(dim=20, classes=8):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, classes))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kvstore", default="dist_sync")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=25)
    args = p.parse_args()

    kv = kvps.create(args.kvstore)
    rank, workers = kv.rank, kv.num_workers
    # Several processes share this machine's cores: one torch thread each avoids oversubscription
    # (torch's idle threads spin and starve the servers).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // (workers + kv.num_servers)))
    (x, y), (x_test, y_test) = dataset()
    x, y = x[rank::workers], y[rank::workers]
    net = model()
    names = [name for name, _ in net.named_parameters()]
    params = [param for _, param in net.named_parameters()]
    kv.init(names, [param.detach() for param in params])
    kv.pull(names, out=[param.data for param in params])        # every worker starts from rank 0's weights
    kv.set_optimizer(kvps.optimizer.SGD(learning_rate=args.lr, momentum=0.9, rescale_grad=1.0 / workers))
    kv.barrier()

    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(100 + rank)
    loss_fn(net(x[:args.batch]), y[:args.batch]).backward()     # warm torch up outside the timing
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(x), (args.batch,), generator=g)
        net.zero_grad()
        loss = loss_fn(net(x[idx]), y[idx])
        loss.backward()
        kv.pushpull(names, [param.grad for param in params], out=[param.data for param in params])
        if rank == 0 and (step % args.eval_every == 0 or step == args.steps):
            with torch.no_grad():
                logits = net(x_test)
                test_loss = loss_fn(logits, y_test).item()
                acc = (logits.argmax(1) == y_test).float().mean().item()
            print(json.dumps({"kvstore": args.kvstore, "workers": workers, "step": step,
                              "time": round(time.perf_counter() - start, 4), "loss": round(test_loss, 5),
                              "accuracy": round(acc, 5)}), flush=True)
    kv.close()


if __name__ == "__main__":
    main()
