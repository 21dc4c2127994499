"""Gradient compression on a real job: what the servers end with is what the workers pushed,
less what each worker still holds in its error-feedback residual."""

import numpy as np
import pytest

from kvps.ps import compression

SCRIPT = r'''
import json, os, numpy as np, kvps
kv = kvps.create("dist_async")
spec = json.loads(os.environ["SPEC"])
kv.set_gradient_compression(spec)
n = 3000                                   # >= KVPS_BIGARRAY_BOUND: split over both servers
kv.init(["w", "i"], [np.zeros(n, np.float32), np.zeros(4, np.int32)])
kv.barrier()
rng = np.random.default_rng(kv.rank)
total = np.zeros(n, np.float64)
for _ in range(6):
    # fp16/bf16: values they hold exactly, so the sum is exact
    g = (rng.integers(-8, 8, n) / 8).astype(np.float32) if spec["type"] in ("fp16", "bf16") \
        else rng.standard_normal(n).astype(np.float32)
    total += g
    kv.push(["w", "i"], [g, np.ones(4, np.int32)])      # the int32 key travels uncompressed
kv.barrier()
out, iout = np.zeros(n, np.float32), np.zeros(4, np.int32)
kv.pull(["w", "i"], out=[out, iout])
residual = np.zeros(n, np.float64)
for (key, part), r in kv._residuals.items():
    start = kv._keys[key].parts[part].start
    residual[start:start + r.size] = r
print(json.dumps({"sent": (total - residual).tolist(), "value": out.tolist(), "ints": iout.tolist(),
                  "stats": {k: v["decoded"] for k, v in kv.server_stats().items()}}), flush=True)
'''


@pytest.mark.parametrize("spec", [{"type": "2bit", "threshold": 0.5}, {"type": "1bit", "threshold": 0.0},
                                  {"type": "fp16"}, {"type": "bf16"}, {"type": "topk", "ratio": 0.1}],
                         ids=lambda s: s["type"])
def test_servers_hold_what_workers_sent(cluster, spec):
    import json
    c = cluster(2, 2, env={"KVPS_BIGARRAY_BOUND": "1000"})
    results = c.run_workers(SCRIPT, env={"SPEC": json.dumps(spec)})
    sent = sum(np.array(r[0]["sent"]) for r in results)
    value = np.array(results[0][0]["value"])
    np.testing.assert_allclose(value, sent, atol=1e-3)
    assert results[0][0]["ints"] == [12] * 4
    # both servers decoded compressed pushes (a counter shows the codec ran there)
    assert all(n >= 6 for n in results[0][0]["stats"].values())
