"""Compressed pull on real jobs (2 workers; 1 server, or 2 with the key split between them): a sync
round's merged gradient comes back error-fed by the server, and weights updated by a server
optimizer come back as compressed changes that track them (kvps/ps/compression.py)."""

import json

import pytest

SCRIPT = r'''
import json, os, numpy as np, kvps
kv = kvps.create("dist_sync")
spec = dict(json.loads(os.environ["SPEC"]), pull=True)
n, rounds, lr = 3000, 12, 0.1                    # 3000 >= KVPS_BIGARRAY_BOUND: split over 2 servers
optimizer = os.environ["OPT"] == "1"
kv.set_gradient_compression(spec)
w0 = np.linspace(-1, 1, n).astype(np.float32)
kv.init(["w", "i"], [w0, np.arange(4, dtype=np.int32)])
if optimizer:
    kv.set_optimizer(kvps.optimizer.SGD(learning_rate=lr))
out, iout = np.zeros(n, np.float32), np.zeros(4, np.int32)
kv.pull(["w", "i"], out=[out, iout])             # the init value travels as it is
first = bool(np.array_equal(out, w0))
grads = [np.random.default_rng(100 * r + 7) for r in range(2)]     # both workers' gradients, known to each
truth, got, worst = np.zeros(n), np.zeros(n), 0.0
weights = w0.astype(np.float64)
for step in range(rounds):
    g = [(rng.standard_normal(n) * 0.2).astype(np.float32) for rng in grads]
    merged = g[0].astype(np.float64) + g[1]
    kv.pushpull("w", g[kv.rank], out=out)
    if optimizer:       # weights: SGD on the round's sum
        weights -= lr * merged
        worst = max(worst, float(np.abs(out - weights).max()))
    else:               # the round's sum itself, error-fed
        truth += merged
        got += out
        worst = max(worst, float(np.abs(got - truth).max()))
kv.pull("i", out=iout)                           # int keys never compress
print(json.dumps({"first": first, "worst": worst, "ints": iout.tolist(),
                  "stats": {s: m["pulls"] for s, m in kv.server_stats().items()}}), flush=True)
'''

CASES = [  # (codec, servers, server optimizer, bound on |received - truth| over every round)
    ({"type": "2bit", "threshold": 0.5}, 1, False, 0.5 + 1.5),   # the residual: t plus one round's overshoot
    ({"type": "topk", "ratio": 0.3}, 2, False, 1.5),
    ({"type": "bf16"}, 2, True, 2e-2),                          # weights: one compression's error
]


@pytest.mark.parametrize("spec,servers,optimizer,bound", CASES,
                         ids=[f"{c[0]['type']}-S{c[1]}-{'weights' if c[2] else 'merged'}" for c in CASES])
def test_compressed_pull(cluster, spec, servers, optimizer, bound):
    c = cluster(2, servers, env={"KVPS_BIGARRAY_BOUND": "1000"})
    results = c.run_workers(SCRIPT, env={"SPEC": json.dumps(spec), "OPT": "1" if optimizer else "0"})
    for (line,) in results:
        assert line["first"] and line["ints"] == [0, 1, 2, 3]
        assert 0 < line["worst"] <= bound, line       # > 0: the pulls did travel compressed
        assert len(line["stats"]) == servers
