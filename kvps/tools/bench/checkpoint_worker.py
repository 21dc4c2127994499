"""The worker of `kvps bench checkpoint` (kvps/tools/bench/checkpoint.py starts it under kvps.launch.Job).

    python -m kvps.tools.bench.checkpoint_worker DIR MB KEYS OPTIMIZER REPEAT

Every worker inits KEYS float32 keys of MB megabytes in all, sets the optimizer (adam keeps two
moments per weight, so the state is three times the weights), pushes once so the state exists,
then REPEAT times: kv.save(DIR/ckpt), a plain copy of the very same files (read, write, fsync:
what the save promises too), and kv.load(DIR/ckpt). Rank 0 prints one JSON line per repetition.
"""
import json
import os
import shutil
import sys
import time

import numpy as np

import kvps
from kvps.tools.bench.workloads import TAG


def copy_files(src, dst, names):
    """The baseline: the same bytes copied file by file, each fsynced, then the directory."""
    os.makedirs(dst, exist_ok=True)
    for name in names:
        target = os.path.join(dst, name)
        shutil.copyfile(os.path.join(src, name), target)
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main(argv):
    directory, mb, nkeys, optimizer, repeat = argv[0], float(argv[1]), int(argv[2]), argv[3], int(argv[4])
    kv = kvps.create("dist_sync")
    rows = max(1, int(mb * (1 << 20) / 4 / nkeys / 256))
    keys = [f"k{i}" for i in range(nkeys)]
    kv.init(keys, [np.full((rows, 256), 0.5, np.float32) for _ in keys])
    if optimizer != "none":
        kv.set_optimizer(kvps.optimizer.create(optimizer, learning_rate=0.01))
    grads = [np.full((rows, 256), 0.1, np.float32) for _ in keys]
    kv.push(keys, grads)
    kv.pull(keys, out=grads)
    ckpt, copy = os.path.join(directory, "ckpt"), os.path.join(directory, "copy")
    for r in range(repeat):
        t0 = time.perf_counter()
        kv.save(ckpt)
        save_s = time.perf_counter() - t0
        manifest = json.load(open(os.path.join(ckpt, "manifest.json")))
        names = [f["file"] for f in manifest["files"]] + ["manifest.json"]
        nbytes = sum(os.path.getsize(os.path.join(ckpt, n)) for n in names)
        copy_s = None
        if kv.rank == 0:
            shutil.rmtree(copy, ignore_errors=True)
            t0 = time.perf_counter()
            copy_files(ckpt, copy, names)
            copy_s = time.perf_counter() - t0
        kv.barrier()
        t0 = time.perf_counter()
        kv.load(ckpt)
        load_s = time.perf_counter() - t0
        if kv.rank == 0:
            print(json.dumps({"bench": TAG, "rep": r, "bytes": nbytes, "save_s": save_s, "load_s": load_s,
                              "copy_s": copy_s, "servers": kv.num_servers, "workers": kv.num_workers}),
                  flush=True)
    kv.close()


if __name__ == "__main__":
    main(sys.argv[1:])
