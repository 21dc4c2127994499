"""One rank of `kvps bench compare`'s torch.distributed gloo baseline (started by gloo_job.py).

    python -m kvps.tools.bench.gloo_worker plan.json --rank 0 --world 2 --store 127.0.0.1:40123 --timeout 60

Joins the process group through the TCPStore the parent holds (it bound port 0, so no port is
guessed), then times, as the anchor shared/anchors/gloo_resnet_comm.py does, the plan's gradient
set all-reduced in DDP-style 25 MB buckets (flattened, reduced asynchronously, copied back), and
one training step of the small model under DistributedDataParallel (train_step.py). Rank 0
prints JSON lines in workloads.py's format.
"""
import argparse
import datetime
import math
import os
import sys

import torch
import torch.distributed as dist

from kvps.tools.bench import train_step, workloads

BUCKET_BYTES = 25 << 20          # DDP's default bucket_cap_mb


def buckets(grads, cap_bytes=BUCKET_BYTES):
    """The gradients in DDP's order (last layer first), cut into buckets of about cap_bytes."""
    out, current, nbytes = [], [], 0
    for g in reversed(grads):
        current.append(g)
        nbytes += g.numel() * g.element_size()
        if nbytes >= cap_bytes:
            out.append(current)
            current, nbytes = [], 0
    if current:
        out.append(current)
    return out


def sync_step(grads):
    """One step of the anchor: flatten each bucket, all-reduce them all asynchronously, copy back."""
    groups = buckets(grads)
    flats = [torch.zeros(sum(g.numel() for g in b)) for b in groups]

    def step():
        works = []
        for b, f in zip(groups, flats):
            torch.cat([g.view(-1) for g in b], out=f)
            works.append(dist.all_reduce(f, async_op=True))
        for w in works:
            w.wait()
        for b, f in zip(groups, flats):
            offset = 0
            for g in b:
                g.view(-1).copy_(f[offset:offset + g.numel()])
                offset += g.numel()
    return step


def main(argv):
    p = argparse.ArgumentParser(prog="gloo_worker")
    p.add_argument("plan")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store", required=True, help="HOST:PORT of the parent's TCPStore")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may wait")
    args = p.parse_args(argv[1:])
    plan = workloads.load_plan(args.plan)
    host, _, port = args.store.rpartition(":")
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore(host, int(port), None, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world, timeout=timeout)
    train_step.set_threads(plan.get("threads", "auto"), args.world)
    rank = args.rank

    resnet = plan.get("resnet")
    if resnet:
        shapes = [tuple(s) for s in resnet["shapes"]]
        nbytes = 4 * sum(math.prod(s) for s in shapes)
        step = sync_step([torch.ones(s) for s in shapes])
        times = workloads.timed(step, resnet["warmup"], resnet["steps"], dist.barrier)
        train_step.emit(rank, system="gloo", workload="resnet50", mode="allreduce", bytes=nbytes,
                        tensors=len(shapes), **workloads.summary(times, nbytes))
    if plan.get("train"):
        def distribute(model):
            model = torch.nn.parallel.DistributedDataParallel(model)      # gloo, 25 MB buckets
            return model, train_step.sgd(model, plan["train"])
        train_step.run_steps(plan["train"], rank, dist.barrier, distribute, system="gloo", mode="ddp")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: torch's gloo threads sometimes abort in static destructors
    # ("terminate called without an active exception", SIGABRT) after all results are out.
    os._exit(code)
