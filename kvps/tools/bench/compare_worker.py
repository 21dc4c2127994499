"""One worker of `kvps bench compare` on kvps: PS sync, PS async or the ring (one per rank).

    kvps launch -n 2 -s 1 -- python -m kvps.tools.bench.compare_worker plan.json dist_sync
    kvps launch -n 2 -s 0 -- python -m kvps.tools.bench.compare_worker plan.json allreduce

Times the plan's gradient set (ResNet-50's 161 tensors) synced with one pushpull call of the
whole list (workloads.py's loop), then, when the plan has a "train" entry, one training step of
the small torch model under kvps.torch.DistributedOptimizer in the matching mode
(train_step.py). Rank 0 prints the results as JSON lines.
"""
import sys

from kvps.tools.bench import workloads
from kvps.tools.bench.kvps_worker import KVPSPeer

MODES = {"dist_sync": "sync", "dist_async": "async", "allreduce": "allreduce"}   # kvstore -> kvps.torch mode


def main(argv):
    if len(argv) != 3 or argv[2] not in MODES:
        print(f"usage: {argv[0]} PLAN.json {{{','.join(MODES)}}}", file=sys.stderr)
        return 2
    plan, kvtype = workloads.load_plan(argv[1]), argv[2]
    peer = KVPSPeer(kvtype)
    peer.modes = ("pushpull",)          # one call for the whole list: kvps's fastest way
    workloads.run(plan, peer)
    if plan.get("train"):               # only then is torch needed (it is an extra of kvps)
        import kvps.torch as kt

        from kvps.tools.bench import train_step
        train_step.set_threads(plan.get("threads", "auto"), peer.kv.num_workers)

        def distribute(model):
            opt = kt.DistributedOptimizer(train_step.sgd(model, plan["train"]), model.named_parameters(),
                                          mode=MODES[kvtype], kvstore=peer.kv)
            return model, opt
        train_step.run_steps(plan["train"], peer.rank, peer.barrier, distribute, system="kvps", mode=MODES[kvtype])
    peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
