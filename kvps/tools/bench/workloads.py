"""The push/pull benchmark's workloads and how a worker times them, whatever system it drives.

    plan = make_plan(sizes=[1024, 1 << 20], resnet_steps=10)
    run(plan, peer)          # in every worker; rank 0 prints one JSON line per result

A `peer` adapts one system (kvps in kvps_worker.py, MXNet in mxnet_worker.py) to
the few calls a step needs, so both systems run exactly the same loop:

    peer.name, peer.rank, peer.modes      # modes: the step kinds it can time
    peer.zeros(shape), peer.ones(shape)   # float32 arrays of the system's own type
    peer.init(keys, arrays); peer.barrier()
    peer.step(mode, keys, grads, outs)    # a callable: one complete round, waited for

Modes: "push+pull" pushes every key, then pulls every key (MXNet's pattern:
push is asynchronous, pull is queued after it); "pushpull" is one call that
pushes and pulls the whole list; "pushpull-each" calls pushpull once per key
(Gluon's Trainer since MXNet 1.6), blocking in kvps, and "pushpull-each-async"
the same with async_op=True, then waits for them all (kvps only: MXNet's calls
are asynchronous anyway, and its "pushpull-each" is the baseline of both).

This module uses the standard library only: mxnet_worker.py imports it as a
plain module from its own folder under MXNet's Python, where kvps is not installed.
"""
import json
import math
import statistics
import sys
import time

KB, MB = 1 << 10, 1 << 20
DEFAULT_SIZES = (KB, 64 * KB, MB, 4 * MB, 16 * MB, 64 * MB)
QUICK_SIZES = (KB, 64 * KB, MB)
SWEEP_KEY0 = 0            # sweep sizes use keys 0, 1, ...
RESNET_KEY0 = 1000        # ResNet-50 tensors use keys 1000..1160
SMALL_KEY0 = 100000       # the small-keys workload uses keys 100000, 100001, ...
SMALL_FLOATS = 64         # floats in each of its keys
TAG = "kvps-bench"        # every result line is a JSON object with "bench": TAG


def resnet50_shapes():
    """The 161 parameter shapes of ResNet-50 (torchvision's layout): 25,557,032 float32 values.

    conv1 and its batch norm, four stages of bottleneck blocks (1x1, 3x3, 1x1 convolutions,
    each followed by a batch norm's weight and bias; the first block of a stage adds a 1x1
    projection and its batch norm), then the 1000-way classifier.
    """
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    channels = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        out = 4 * width
        for block in range(blocks):
            shapes += [(width, channels, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (out, width, 1, 1), (out,), (out,)]
            if block == 0:
                shapes += [(out, channels, 1, 1), (out,), (out,)]
            channels = out
    shapes += [(1000, 2048), (1000,)]
    return shapes


def parse_size(text):
    """Bytes from '1KB', '64K', '4MB', '16MiB' or '4096'; a multiple of 4 (float32)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": KB, "M": MB, "G": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if scale != 1 else t
    try:
        value = int(float(digits) * scale)
    except ValueError:
        raise ValueError(f"size {text!r} is not a size like 1KB, 64KB, 4MB or 4096") from None
    if value <= 0 or value % 4:
        raise ValueError(f"size {text!r} is {value} bytes; sizes must be positive multiples of 4 (float32)")
    return value


def show_size(nbytes):
    for unit, scale in (("MB", MB), ("KB", KB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def reps_for(nbytes, quick=False):
    """Timed rounds for one size: about 0.4 GB moved per worker, within [5, 300] ([3, 30] quick)."""
    low, high, volume = (3, 30, 2e7) if quick else (5, 300, 4e8)
    return max(low, min(high, int(volume / nbytes)))


# --pattern NAME -> the mode kvps's workers time (MXNet's workers time "push+pull": for each key
# push(key, priority=-i), then for each key pull(key, priority=-i); and "pushpull-each" where
# kvps times a per-key pushpull)
PATTERNS = {"mxnet": "push+pull", "list": "list", "pushpull": "pushpull", "gluon": "pushpull-each",
            "gluon-async": "pushpull-each-async"}
DEFAULT_PATTERNS = ("mxnet", "list", "pushpull")
KVPS_MODES = ("push+pull", "pushpull")      # what plans without "modes" time (kvps emulate, compare)
MXNET_BASELINE = {"pushpull-each": "pushpull-each", "pushpull-each-async": "pushpull-each"}  # else push+pull


def mxnet_modes(modes):
    """The modes MXNet's workers time for a plan whose kvps modes are `modes`: their baselines."""
    return tuple(dict.fromkeys(["push+pull"] + [MXNET_BASELINE[m] for m in modes or () if m in MXNET_BASELINE]))


def make_plan(sizes=DEFAULT_SIZES, resnet_steps=10, quick=False, kvtype="dist_sync", modes=None, small_keys=0,
              small_steps=5):
    """What every worker of both systems runs, as a JSON-able dict. `small_keys`: also time a step
    over that many keys of SMALL_FLOATS floats each (the per-key calls of a model with many small
    tensors), `small_steps` times."""
    return {
        "kvtype": kvtype,
        "modes": list(modes or KVPS_MODES),
        "warmup": 2 if quick else 3,
        "sweep": [{"bytes": n, "key": SWEEP_KEY0 + i, "reps": reps_for(n, quick)} for i, n in enumerate(sizes)],
        "resnet": {"steps": resnet_steps, "warmup": 1 if quick else 2, "key0": RESNET_KEY0,
                   "shapes": [list(s) for s in resnet50_shapes()]} if resnet_steps > 0 else None,
        "small": {"steps": small_steps, "warmup": 1 if quick else 2, "key0": SMALL_KEY0,
                  "shapes": [[SMALL_FLOATS]] * small_keys} if small_keys > 0 else None,
    }


def load_plan(path):
    with open(path) as f:
        return json.load(f)


def timed(step, warmup, reps, barrier, traffic=None):
    """Seconds of each of `reps` calls of step(), after `warmup` untimed calls and a barrier
    (so every worker starts the timed rounds together). With `traffic` (a function giving a byte
    count so far): (times, the bytes it counted over the timed calls of every worker)."""
    for _ in range(warmup):
        step()
    barrier()
    if traffic is not None:
        before = traffic()
        barrier()                   # nobody's timed calls start before every worker has counted
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    if traffic is None:
        return times
    barrier()                       # every worker's timed calls are in
    return times, traffic() - before


def summary(times, nbytes):
    """Median (the reported time), mean, min and max in ms, and the median's bandwidth."""
    median = statistics.median(times)
    return {"ms": median * 1e3, "mean_ms": statistics.fmean(times) * 1e3, "min_ms": min(times) * 1e3,
            "max_ms": max(times) * 1e3, "reps": len(times), "GBps": nbytes / median / 1e9}


def run(plan, peer, out=None):
    """Time the plan's sweep and ResNet-50 steps; rank 0 writes one JSON line per result."""
    out = out or sys.stdout

    def emit(**row):
        if peer.rank == 0:
            out.write(json.dumps(dict(row, bench=TAG, system=peer.name)) + "\n")
            out.flush()

    for item in plan["sweep"]:
        n, key = item["bytes"], item["key"]
        peer.init([key], [peer.zeros((n // 4,))])
        grads, outs = [peer.ones((n // 4,))], [peer.zeros((n // 4,))]
        for mode in peer.modes:
            times = timed(peer.step(mode, [key], grads, outs), plan["warmup"], item["reps"], peer.barrier)
            emit(workload="round", mode=mode, bytes=n, **summary(times, n))

    for workload, step_set in (("resnet50", plan.get("resnet")), ("keys", plan.get("small"))):
        if not step_set:
            continue
        shapes = [tuple(s) for s in step_set["shapes"]]
        keys = [step_set["key0"] + i for i in range(len(shapes))]
        nbytes = 4 * sum(math.prod(s) for s in shapes)
        peer.init(keys, [peer.zeros(s) for s in shapes])
        grads, outs = [peer.ones(s) for s in shapes], [peer.zeros(s) for s in shapes]
        traffic = getattr(peer, "traffic", None) if plan.get("traffic") else None
        for mode in peer.modes:
            extra = {"calls": plan["calls"]} if plan.get("calls") else {}
            times = timed(peer.step(mode, keys, grads, outs), step_set["warmup"], step_set["steps"], peer.barrier,
                          traffic)
            if traffic is not None:     # the servers' bytes in and out per timed step, every worker's
                times, moved = times
                extra["server_bytes"] = moved / step_set["steps"]
            emit(workload=workload, mode=mode, bytes=nbytes, tensors=len(shapes), **summary(times, nbytes), **extra)
    peer.barrier()
