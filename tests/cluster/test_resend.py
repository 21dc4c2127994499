"""Lost and duplicated messages on a real job (KVPS_FAULTS): requests are resent and each is applied
once, so a dist_sync job under faults ends with the same weights as a clean run, bit for bit."""
TRAIN = r'''
import hashlib, json, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.set_optimizer(kvps.optimizer.SGD(learning_rate=0.05, momentum=0.9))
shapes = {"w": (3000,), "b": (7,)}          # "w" is split over both servers (KVPS_BIGARRAY_BOUND)
kv.init(list(shapes), [np.ones(s, np.float32) for s in shapes.values()])
outs = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
for step in range(STEPS):
    rng = np.random.default_rng(1000 * step + kv.rank)
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes.values()]
    kv.pushpull(list(shapes), grads, out=list(outs.values()))
kv.pull(list(shapes), out=list(outs.values()))
digest = hashlib.sha256(b"".join(outs[k].tobytes() for k in shapes)).hexdigest()
node = kv._node
print(json.dumps({"digest": digest, "head": outs["w"][:3].tolist(), "resent": node.requests.resent,
                  "faults": node.faults.counts if node.faults else None,
                  "duplicates": sum(m.get("duplicates", 0) for m in kv.server_stats().values())}), flush=True)
'''

STEPS = 80


def _run(cluster, env):
    c = cluster(2, 2, env={"KVPS_BIGARRAY_BOUND": "1000", **env})
    results = c.run_workers(TRAIN.replace("STEPS", str(STEPS)), timeout=120)
    assert c.wait_daemons() == [0, 0, 0], c.logs()
    return [lines[-1] for lines in results], c


def test_drop_and_dup_give_the_weights_of_a_clean_run(cluster):
    clean, _ = _run(cluster, {})
    assert clean[0]["digest"] == clean[1]["digest"]
    assert clean[0]["resent"] == 0 and clean[0]["faults"] is None      # a normal job sends nothing extra
    faulty, c = _run(cluster, {"KVPS_FAULTS": "drop:0.01,dup:0.01,delay:1ms", "KVPS_FAULTS_SEED": "5",
                               "KVPS_RESEND_TIMEOUT": "0.3"})
    for r in faulty:
        assert r["digest"] == clean[0]["digest"], (r, clean[0]["head"], c.logs())
    # the faults really happened: messages were lost (so resent) and repeated (so answered once)
    assert sum(r["faults"]["dropped"] + r["faults"]["duplicated"] for r in faulty) > 0, faulty
    assert sum(r["resent"] for r in faulty) > 0, faulty
    assert faulty[0]["duplicates"] > 0, faulty


def test_heavy_faults_still_apply_each_push_once(cluster):
    """20% loss and 20% duplication: slow, but exact."""
    c = cluster(2, 1, env={"KVPS_FAULTS": "drop:0.2,dup:0.2", "KVPS_RESEND_TIMEOUT": "0.1"})
    script = r'''
import json, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init("k", np.zeros(5, np.float32))
out = np.zeros(5, np.float32)
total = 0.0
for step in range(15):
    kv.push("k", np.full(5, step + 1, np.float32))     # the round's value: W0's + W1's push
    kv.pull("k", out=out)
    total += float(out[0])
print(json.dumps({"total": total, "resent": kv._node.requests.resent}), flush=True)
'''
    results = c.run_workers(script, timeout=120)
    for lines in results:
        assert lines[-1]["total"] == sum(2.0 * (s + 1) for s in range(15)), (lines, c.logs())
    assert sum(lines[-1]["resent"] for lines in results) > 0
