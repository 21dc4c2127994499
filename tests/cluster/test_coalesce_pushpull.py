"""Coalesced async pushpulls (kvps/kvstore/coalesce.py): small `pushpull(..., async_op=True)` calls
made one key at a time (Horovod's per-tensor allreduce_async_, a Gluon-style per-key loop made
asynchronous) go as one request, with the results of calls sent one by one (KVPS_COALESCE_US=0);
a call that waits in a batch completes however the script waits for it; and a blocking per-key
pushpull loop is told, once, how to overlap its calls."""
import time

import pytest

pytestmark = pytest.mark.cluster

# 40 small keys and a big one, with a server-side optimizer (pushpull returns the new weights); each
# worker's gradients differ. The script waits for the handles in several ways: the last one first
# (it sends the batch), then wait_all; a step whose handles it only polls; a step followed by a
# blocking pull of a key still waiting in the batch.
PER_KEY = r'''
import json, time, numpy as np, kvps
kv = kvps.create("dist_sync")
r = kv.rank
K = 40
shapes = [(5,)] * K + [(300, 400)]
kv.init(list(range(K + 1)), [np.full(s, 0.5, np.float32) for s in shapes])
kv.set_optimizer(kvps.optimizer.create("sgd", learning_rate=0.1, momentum=0.9))
outs = [np.zeros(s, np.float32) for s in shapes]
requests = []
send = kv._node.request_many
def counted(items, *args, **kwargs):
    requests.append(len(items))
    return send(items, *args, **kwargs)
kv._node.request_many = counted
grads = lambda step: [np.full(shapes[k], (r + 1) * (k + 1) * (step + 1) / 100.0, np.float32) for k in range(K + 1)]
polled = None
for step in range(4):
    g = grads(step)
    handles = [kv.pushpull(k, g[k], out=outs[k], priority=-k, async_op=True) for k in range(K + 1)]
    if step == 0:
        handles[-1].wait()
        handles[3].wait()
        kv.wait_all()
    elif step == 1:
        deadline = time.monotonic() + 30
        while not all(h.done() for h in handles) and time.monotonic() < deadline:
            time.sleep(0.001)               # only polls: the I/O thread sends what waits
        polled = all(h.done() for h in handles)
        kv.wait_all()
    elif step == 2:
        check = np.zeros(5, np.float32)
        kv.pull(K - 1, out=check)           # its pushpull waits in the batch: the pull sends it first
        kv.wait_all()
        assert np.array_equal(check, outs[K - 1]), (check, outs[K - 1])
    else:
        for h in reversed(handles):
            h.wait()
print(json.dumps({"sums": [float(o.astype(np.float64).sum()) for o in outs], "first": outs[0].tolist(),
                  "requests": len(requests), "polled": polled}), flush=True)
kv.close()
'''


def test_async_per_key_pushpulls_give_what_calls_sent_one_by_one_give(cluster):
    runs = {}
    for coalesce in ("1000", "0"):
        c = cluster(2, 2, env={"KVPS_COALESCE_US": coalesce})
        runs[coalesce] = c.run_workers(PER_KEY, timeout=120)
        assert c.wait_daemons() == [0, 0, 0], c.logs()
    merged, alone = runs["1000"], runs["0"]
    for (m,), (a,) in zip(merged, alone):
        assert m["sums"] == a["sums"] and m["first"] == a["first"], (m, a)
        assert m["polled"] is True and a["polled"] is True, (m, a)
    # 4 steps of 41 calls: one by one, 164 calls through the I/O thread; merged, the first call of a
    # step alone, then one call for the small keys (with 2 servers, a request to each), the big key
    # alone (over KVPS_LANE_BYTES: it sends the batch before it)
    assert alone[0][0]["requests"] >= 160, alone
    assert merged[0][0]["requests"] <= 4 * 4, merged


# Horovod's per-tensor form: allreduce_async_ for every gradient, then synchronize each handle.
HOROVOD = r'''
import json, torch, kvps.torch as hvd
hvd.init()
tensors = [torch.full((3,), float(hvd.rank() + i), dtype=torch.float32) for i in range(30)]
for step in range(2):
    handles = [hvd.allreduce_async_(t, name=f"g{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
    for h in handles:
        hvd.synchronize(h)
print(json.dumps({"firsts": [float(t[0]) for t in tensors]}), flush=True)
hvd.shutdown()
'''


def test_horovod_per_tensor_allreduce_async_sums(cluster):
    c = cluster(2, 1)
    for (out,) in c.run_workers(HOROVOD, timeout=120):
        # step 0: r + i summed over ranks 0 and 1 = 2i + 1; step 1 sums that again: 4i + 2
        assert out["firsts"] == [4.0 * i + 2.0 for i in range(30)], out


# Refused calls leave the batch alone; each handle still completes with its own out.
REFUSED = r'''
import json, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init([0, 1, 2], [np.zeros(5, np.float32)] * 3)
outs = [np.zeros(5, np.float32) for _ in range(3)]
h0 = kv.pushpull(0, np.ones(5, np.float32), out=outs[0], async_op=True)
h1 = kv.pushpull(1, np.ones(5, np.float32), out=outs[1], async_op=True)
errors = []
for bad in (np.ones(6, np.float32), np.ones(5, np.float64)):
    try:
        kv.pushpull(2, bad, out=outs[2], async_op=True)
    except ValueError as exc:
        errors.append(str(exc))
try:
    kv.pushpull(2, np.ones(5, np.float32), out=outs[2], priority="high", async_op=True)
except TypeError as exc:
    errors.append(str(exc))
h2 = kv.pushpull(2, np.full(5, 2.0, np.float32), out=outs[2], async_op=True)
h2.wait()
h0.wait()
h1.wait()
print(json.dumps({"errors": errors, "sums": [float(o.sum()) for o in outs]}), flush=True)
kv.close()
'''


def test_a_refused_async_pushpull_leaves_the_waiting_ones_alone(cluster):
    c = cluster(2, 1)
    for (out,) in c.run_workers(REFUSED, timeout=60):
        assert out["sums"] == [10.0, 10.0, 20.0], out
        assert len(out["errors"]) == 3, out
        assert "priority must be an int" in out["errors"][2], out


# Gluon's Trainer calls pushpull once per parameter; with numpy each call blocks for its round trip.
BLOCKING = r'''
import json, warnings, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init(list(range(80)), [np.zeros(4, np.float32)] * 80)
out = np.zeros(4, np.float32)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for step in range(2):
        kv.pushpull(list(range(80)), [np.ones(4, np.float32)] * 80)     # a list call: no hint
    listed = len(seen)
    for step in range(2):
        for k in range(80):
            kv.pushpull(k, np.ones(4, np.float32), out=out)              # the user's line
hints = [w for w in seen if issubclass(w.category, kvps.PerformanceWarning)]
print(json.dumps({"listed": listed, "hints": len(hints), "line": hints[0].lineno if hints else None,
                  "text": str(hints[0].message) if hints else ""}), flush=True)
kv.close()
'''


def test_a_blocking_per_key_pushpull_loop_is_told_once_how_to_overlap(cluster):
    c = cluster(2, 1)
    (w0,), (w1,) = c.run_workers(BLOCKING, timeout=90)
    assert w0["listed"] == 0 and w0["hints"] == 1, w0
    assert w0["line"] == 13, w0           # the pushpull line of the script
    assert "async_op=True" in w0["text"] and "wait_all()" in w0["text"], w0
    assert w1["hints"] == 0, w1           # worker 0 says it for the job


# Never closed, never waited for: W0's last pushpulls wait in a batch as main() returns; W1 waits for
# its own, whose rounds need W0's. With a delay of 30 s only the kvstore's farewell sends them.
UNCLOSED = r'''
import json, numpy as np, kvps

def main():
    kv = kvps.create("dist_sync")
    kv.init(list(range(8)), [np.zeros(3, np.float32) for _ in range(8)])
    outs = [np.zeros(3, np.float32) for _ in range(8)]
    handles = [kv.pushpull(k, np.full(3, kv.rank + 1.0, np.float32), out=outs[k], async_op=True) for k in range(8)]
    if kv.rank == 1:
        for h in handles:
            h.wait()
        print(json.dumps({"sums": [float(o.sum()) for o in outs]}), flush=True)

main()
'''


def test_async_pushpulls_waiting_as_an_unclosed_kvstore_goes_are_sent(cluster):
    c = cluster(2, 1, env={"KVPS_COALESCE_US": "30000000"})
    start = time.monotonic()
    results = c.run_workers(UNCLOSED, timeout=60)
    assert results[1] == [{"sums": [9.0] * 8}], c.logs()
    assert time.monotonic() - start < 30, c.logs()
    assert c.wait_daemons() == [0, 0], c.logs()
