"""The kvstore API on a real job: torch tensors of every dtype, handles, row-sparse pulls and deadlines,
and one kvstore called from several threads of a worker."""

import numpy as np

import kvps

TORCH = r'''
import json, torch, kvps
kv = kvps.create("dist_sync")
r = kv.rank
kv.init(["f32", "bf16", "f16", "i64"], [torch.ones(4, 3), torch.ones(700, 3, dtype=torch.bfloat16),
                                        torch.ones(5, dtype=torch.float16), torch.ones(6, dtype=torch.int64)])
vals = [torch.full((4, 3), r + 1.0), torch.full((700, 3), r + 1.0, dtype=torch.bfloat16),
        torch.full((5,), r + 1.0, dtype=torch.float16), torch.full((6,), r + 1, dtype=torch.int64)]
kv.pushpull(["f32", "bf16", "f16", "i64"], vals)        # out=None: results land in vals
outs = [torch.zeros(3, 4).t(), torch.zeros(700, 3, dtype=torch.bfloat16)]   # a non-contiguous out
kv.pull("bf16", out=outs[1])
nc = torch.zeros(3, 4).t()
try:
    kv.pull("f32", out=nc)
    nc_ok = "ok"
except ValueError as e:
    nc_ok = str(e)
print(json.dumps({"vals": [[float(v.min()), float(v.max())] for v in vals],
                  "bf16": [float(outs[1].min()), float(outs[1].max())], "nc": nc_ok,
                  "nc_value": [float(nc.min()), float(nc.max())]}), flush=True)
'''


def test_torch_tensors_every_dtype(cluster):
    c = cluster(2, 2, env={"KVPS_BIGARRAY_BOUND": "1000"})
    results = c.run_workers(TORCH, timeout=90)
    for (line,) in results:
        assert line["vals"] == [[3.0, 3.0]] * 4
        assert line["bf16"] == [3.0, 3.0]
        # a transposed view has the key's shape (4, 3): filled through a copy
        assert line["nc"] == "ok" and line["nc_value"] == [3.0, 3.0]


HANDLES = r'''
import json, time, numpy as np, kvps
kv = kvps.create("dist_sync")
r = kv.rank
keys = list(range(20))
kv.init(keys, [np.zeros(1000, np.float32) for _ in keys])
hs = [kv.push(k, np.full(1000, r + 1, np.float32), async_op=True) for k in keys]
outs = [np.zeros(1000, np.float32) for _ in keys]
hp = kv.pull(keys, out=outs, async_op=True)    # queued behind this worker's pushes on each key
hp.wait(30)
kv.wait_all()
ok = all(h.done() for h in hs) and all(float(o.min()) == 3.0 for o in outs)
# the emb table is split over both servers; rows from both parts, repeated and unsorted
table = np.arange(3000, dtype=np.float32).reshape(1000, 3)
kv.init("emb", table)
out = np.full((1000, 3), -1, np.float32)
kv.row_sparse_pull("emb", out=out, row_ids=np.array([999, 3, 500, 3, 0]))
rows = sorted(int(i) for i in np.flatnonzero(out.any(axis=1) | (np.arange(1000) == 0)))
rs_ok = rows == [0, 3, 500, 999] and bool((out[[3, 500, 999]] == table[[3, 500, 999]]).all())
# a barrier that the other worker never reaches times out, naming what it waited for
timeout = None
if r == 0:
    try:
        kv._node.barrier("workers", timeout=1.0)
    except kvps.KVTimeoutError as e:
        timeout = str(e)
print(json.dumps({"ok": ok, "rs": rs_ok, "timeout": timeout}), flush=True)
if r == 1:
    time.sleep(2)
'''


def test_async_handles_row_sparse_and_deadlines(cluster):
    c = cluster(2, 2, env={"KVPS_BIGARRAY_BOUND": "1000"})
    results = c.run_workers(HANDLES, timeout=90)
    for rank, (line,) in enumerate(results):
        assert line["ok"] and line["rs"], line
    assert "waiting at a barrier of workers: no reply from H within 1 s" in results[0][0]["timeout"]


THREADS = r'''
import json, threading, numpy as np, kvps
kv = kvps.create("dist_sync")
shapes = [(1000,), (5,), (300, 300), (64,), (2000,), (7,), (100, 100), (3,)]
keys = list(range(len(shapes)))
kv.init(keys, [np.zeros(s, np.float32) for s in shapes])
errors, seen = [], []
def work(mine):                 # each thread its own keys, as a pipeline stage's thread would have
    try:
        for step in range(40):
            for k in mine:
                kv.push(k, np.ones(shapes[k], np.float32))          # returns early
            for k in mine:
                out = np.zeros(shapes[k], np.float32)
                kv.pull(k, out=out)
                seen.append(float(out.min()) == float(out.max()) == 2.0)
            kv.pushpull(mine[0], np.ones(shapes[mine[0]], np.float32), async_op=True).wait(30)
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=work, args=(keys[i::4],)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join(60)
print(json.dumps({"errors": errors, "right": sum(seen), "pulls": len(seen)}), flush=True)
'''


def test_threads_of_one_worker_share_its_kvstore(cluster):
    """Calls from several threads: a push's handle that one thread took from the early-returned list
    was also taken by another, which then waited 0 s on a handle not done and reported a failure
    (no reply within 0 s) that never happened."""
    for (line,) in cluster(2, 2).run_workers(THREADS, timeout=90):
        assert line == {"errors": [], "right": 40 * 8, "pulls": 40 * 8}, line
