"""GEO-SGD (dist_geo:K) on real jobs: closed forms of K local SGD steps on a quadratic with two
workers (dyadic numbers, so every sum is exact in float32), and a short training run."""

import json

import pytest

# Worker w minimises 0.5 * |x - c_w|^2 with lr 1/2: a local step halves the distance to c_w, so
# after K steps from x_r, x = c_w + (x_r - c_w) / 2^K. c_0 = 16, c_1 = -16 (mean 0): the GEO delta
# over W = 2 is (c_w - x_r) (1 - 2^-K) / 2, and with both in, the merged value is x_r / 2^K.
QUADRATIC = r'''
import json, os, numpy as np, kvps
k = int(os.environ["K"])
kv = kvps.create(f"dist_geo:{k}")
if os.environ.get("SPEC"):                            # every number here is a float16 too: still exact
    kv.set_gradient_compression(json.loads(os.environ["SPEC"]))
n = int(os.environ["N"])
kv.init("x", np.full(n, 8.0, np.float32) if kv.rank == 0 else np.zeros(n, np.float32))
x = np.zeros(n, np.float32)
kv.pull("x", out=x)                                   # every worker starts from rank 0's value ...
kv.barrier()                                          # ... before anyone's first sync changes it
c = np.float32(16.0 if kv.rank == 0 else -16.0)
for r in range(2):
    start = float(x[0])
    local = []
    for step in range(k):
        x -= np.float32(0.5) * (x - c)
        local.append(float(x[0]))
        kv.pushpull("x", x, out=x)                    # a local step; the k-th also syncs
    after_sync = x.copy()
    kv.sync()                                         # both deltas in: the merged value ...
    kv.pull("x", out=x)                               # ... which pull() now gives
    print(json.dumps({"round": r, "start": start, "local": local, "after": after_sync.tolist()[:3],
                      "merged": x.tolist(), "uniform": bool(np.all(x == x[0]))}), flush=True)
kv.barrier()
if kv.rank == 0:
    print(json.dumps({"stats": {s: m["pushes"] for s, m in kv.server_stats().items()}}), flush=True)
'''


@pytest.mark.parametrize("servers,k,spec", [(1, 1, None), (2, 4, {"type": "fp16", "pull": True})],
                         ids=["S1-K1", "S2-K4-split-fp16-push-and-pull"])
def test_geo_closed_form(cluster, servers, k, spec):
    n = 3000 if servers == 2 else 8          # 3000 >= the bound below: split over both servers
    c = cluster(2, servers, env={"KVPS_BIGARRAY_BOUND": "1000"})
    results = c.run_workers(QUADRATIC, env={"K": str(k), "N": str(n), "SPEC": json.dumps(spec) if spec else ""})
    stats = results[0].pop()["stats"]
    x = 8.0
    for r in range(2):
        for w, lines in enumerate(results):
            line = lines[r]
            target = 16.0 if w == 0 else -16.0
            assert line["start"] == x
            # the local steps between syncs are plain SGD on this worker's own copy
            assert line["local"] == [target + (x - target) / 2 ** s for s in range(1, k + 1)]
            # the sync's pull has this worker's delta, and the other's if it arrived first
            mine = x + (target - x) * (1 - 2.0 ** -k) / 2
            both = x / 2 ** k
            assert line["after"][0] in (mine, both), (r, w, line)
            assert line["merged"] == [both] * n, (r, w, line["merged"][:4])
        x = x / 2 ** k
    # each worker pushed once per K steps (2 syncs), to every part of the key
    parts = servers
    assert sum(stats.values()) == 2 * 2 * parts, stats


TRAIN = r'''
import json, numpy as np, kvps
kv = kvps.create("dist_geo", k_steps=4)
rng = np.random.default_rng(0)                        # the same data set on every worker ...
true_w = rng.standard_normal(20).astype(np.float32)
X = rng.standard_normal((2000, 20)).astype(np.float32)
y = (X @ true_w > 0).astype(np.float32)
mine = slice(kv.rank, None, kv.num_workers)           # ... and each worker trains on its own half
Xs, ys = X[mine], y[mine]
w = np.zeros(20, np.float32)
kv.init("w", w)
kv.pull("w", out=w)
kv.barrier()
local = np.random.default_rng(kv.rank + 1)
for step in range(200):
    i = local.integers(0, len(ys), 32)
    p = 1 / (1 + np.exp(-(Xs[i] @ w)))
    w -= np.float32(0.5) * (Xs[i].T @ (p - ys[i]) / 32).astype(np.float32)
    kv.pushpull("w", w, out=w)
kv.sync()
kv.pull("w", out=w)
acc = float(np.mean(((X @ w) > 0) == (y > 0.5)))
refused = {}                                          # what GEO cannot mean is refused, naming why
kv.init("i", np.zeros(2, np.int32))
for name, call in [("optimizer", lambda: kv.set_optimizer(kvps.optimizer.SGD(learning_rate=0.1))),
                   ("int push", lambda: kv.pushpull("i", np.ones(2, np.int32))),
                   ("row push", lambda: kv.push("w", np.ones((1, 20), np.float32), row_ids=[0]))]:
    try:
        call()
        refused[name] = "no error"
    except ValueError as exc:
        refused[name] = str(exc)
print(json.dumps({"acc": acc, "w": w.tolist(), "refused": refused}), flush=True)
'''


def test_geo_trains_logistic_regression(cluster):
    c = cluster(2, 2)
    results = c.run_workers(TRAIN)
    accs = [r[0]["acc"] for r in results]
    assert all(a > 0.9 for a in accs), accs
    # after sync() every worker holds the same merged weights
    assert results[0][0]["w"] == results[1][0]["w"]
    refused = results[0][0]["refused"]
    assert "no server optimizer" in refused["optimizer"]
    assert "'i'" in refused["int push"] and "int32" in refused["int push"]
    assert "row-sparse" in refused["row push"]


TORCH = r'''
import json, torch, kvps.torch as kt
kv = kt.init("geo", k_steps=2)
x = torch.nn.Parameter(torch.zeros(5) if kv.rank == 0 else torch.full((5,), 99.0))
opt = kt.DistributedOptimizer(torch.optim.SGD([x], lr=0.5), [("x", x)], mode="geo", k_steps=2)
c = 16.0 if kv.rank == 0 else 0.0
merged = []
for r in range(2):
    for step in range(2):
        opt.zero_grad()
        (0.5 * ((x - c) ** 2).sum()).backward()
        opt.step()                                   # local SGD; the 2nd step syncs
    opt.synchronize()                                # both workers' changes in
    merged.append(x.detach().tolist())
print(json.dumps({"merged": merged}), flush=True)
'''


def test_torch_geo_mode(cluster):
    pytest.importorskip("torch")
    c = cluster(2, 1)
    results = c.run_workers(TORCH)
    # a round of 2 local steps at lr 1/2 moves each copy 3/4 of the way to its target (16 or 0),
    # and the merged value is the mean of the two: x -> x / 4 + 6, so 0 -> 6 -> 7.5, exactly
    for (line,) in results:
        assert line["merged"] == [[6.0] * 5, [7.5] * 5], line
