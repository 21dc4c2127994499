"""Coalescing (kvps/kvstore/coalesce.py): small pushes called one key at a time, as MXNet scripts
call them, go as one request; the results are those of pushes sent one by one
(KVPS_COALESCE_US=0), and a push that waits is sent however the script goes on: by its next call,
by the I/O thread when the script calls nothing, or as the process exits without close()."""
import time

import pytest

pytestmark = pytest.mark.cluster

# MXNet's per-key loop over many small keys (and one big key, which goes through the I/O thread
# while the small ones wait), with a server-side optimizer: each worker's gradients differ.
PER_KEY = r'''
import json, numpy as np, kvps
kv = kvps.create("dist_sync")
r = kv.rank
K = 60
shapes = [(7,)] * K + [(300, 400)]
kv.init(list(range(K + 1)), [np.full(s, 0.5, np.float32) for s in shapes])
kv.set_optimizer(kvps.optimizer.create("sgd", learning_rate=0.1, momentum=0.9))
outs = [np.zeros(s, np.float32) for s in shapes]
lanes = lambda: kv._lanes.sent() if kv._lanes is not None else 0
for step in range(4):
    if step == 1:               # from the second step on, the pulls take their pushes' replies
        before = lanes()
    for k in range(K + 1):
        g = np.full(shapes[k], (r + 1) * (k + 1) * (step + 1) / 100.0, np.float32)
        kv.push(k, g, priority=-k)
        g[:] = 1e6                                  # the caller may change its array once push returns
    for k in range(K + 1):
        kv.pull(k, out=outs[k], priority=-k)
sent = lanes() - before
print(json.dumps({"sums": [float(o.astype(np.float64).sum()) for o in outs], "first": outs[0].tolist(),
                  "lane_requests": sent}), flush=True)
'''


def test_per_key_pushes_give_what_pushes_sent_one_by_one_give(cluster):
    runs = {}
    for coalesce in ("1000", "0"):
        c = cluster(2, 2, env={"KVPS_COALESCE_US": coalesce})
        runs[coalesce] = c.run_workers(PER_KEY, timeout=120)
        assert c.wait_daemons() == [0, 0, 0], c.logs()
    merged, alone = runs["1000"], runs["0"]
    for (m,), (a,) in zip(merged, alone):
        assert m["sums"] == a["sums"] and m["first"] == a["first"], (m, a)
    # 3 steps of 60 small pushes: one by one they are 180 requests (pulled ahead: no pull requests);
    # merged, a few per step (the first push of each step goes alone, then one request per server;
    # the big key goes through the I/O thread)
    assert alone[0][0]["lane_requests"] >= 180, alone
    assert merged[0][0]["lane_requests"] <= 15, merged


# W0 pushes two small keys (the second waits to go with a next one), then calls nothing: it waits
# for W1's file. W1 pulls the second key, whose round needs W0's push: the I/O thread sends it.
SILENT = r'''
import json, os, pathlib, time, numpy as np, kvps
kv = kvps.create("dist_sync")
r = kv.rank
kv.init([0, 1], [np.zeros(4, np.float32), np.zeros(4, np.float32)])
kv.push(0, np.ones(4, np.float32))
kv.push(1, np.full(4, r + 1.0, np.float32))
done = pathlib.Path(os.environ["DONE_FILE"])
if r == 0:
    deadline = time.monotonic() + 60
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)                        # no kvstore call at all meanwhile
    print(json.dumps({"waited": done.exists()}), flush=True)
else:
    start = time.monotonic()
    out = np.zeros(4, np.float32)
    kv.pull(1, out=out)
    print(json.dumps({"pull_s": time.monotonic() - start, "value": out.tolist()}), flush=True)
    done.write_text("ok")
kv.close()
'''


def test_a_waiting_push_goes_while_its_script_calls_nothing(cluster, tmp_path):
    c = cluster(2, 1, env={"DONE_FILE": str(tmp_path / "done")})
    (w0,), (w1,) = c.run_workers(SILENT, timeout=90)
    assert w0 == {"waited": True}, c.logs()
    assert w1["value"] == [3.0] * 4, w1
    assert w1["pull_s"] < 5.0, w1            # the heartbeat timeout is 10 s; the coalescing delay 1 ms


# Never closed (MXNet scripts): the last pushes wait in a batch as main() returns, or as the
# interpreter exits with the kvstore in a global. The other worker's pulls need them.
UNCLOSED = r'''
import json, os, numpy as np, kvps

def main():
    kv = kvps.create("dist_sync")
    kv.init(list(range(8)), [np.zeros(3, np.float32) for _ in range(8)])
    for k in range(8):
        kv.push(k, np.full(3, kv.rank + 1.0, np.float32))
    if kv.rank == 1:
        outs = [np.zeros(3, np.float32) for _ in range(8)]
        for k in range(8):
            kv.pull(k, out=outs[k])
        print(json.dumps({"sums": [float(o.sum()) for o in outs]}), flush=True)
    return kv

if os.environ["HOLD"] == "global":
    KV = main()
else:
    main()
'''


@pytest.mark.parametrize("hold", ["main", "global"])
@pytest.mark.parametrize("delay", ["1000", "30000000"])
def test_pushes_waiting_as_an_unclosed_kvstore_goes_are_sent(cluster, hold, delay):
    """With a delay of 30 s the I/O thread has not sent them yet: the kvstore's farewell does."""
    c = cluster(2, 1, env={"HOLD": hold, "KVPS_COALESCE_US": delay})
    start = time.monotonic()
    results = c.run_workers(UNCLOSED, timeout=60)
    assert results[1] == [{"sums": [9.0] * 8}], c.logs()
    assert time.monotonic() - start < 30, c.logs()
    assert c.wait_daemons() == [0, 0], c.logs()


# A push refused by its checks leaves the waiting ones as they are; an earlier failure of a batch
# is raised by the next call.
REFUSED = r'''
import json, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init([0, 1, 2], [np.zeros(5, np.float32)] * 3)
kv.push(0, np.ones(5, np.float32))
kv.push(1, np.ones(5, np.float32))
errors = []
for bad in (np.ones(6, np.float32), np.ones(5, np.float64)):
    try:
        kv.push(2, bad)
    except ValueError as exc:
        errors.append(str(exc))
try:
    kv.push(2, np.ones(5, np.float32), priority="high")
except TypeError as exc:
    errors.append(str(exc))
kv.push(2, np.ones(5, np.float32))
outs = [np.zeros(5, np.float32) for _ in range(3)]
kv.pull([0, 1, 2], out=outs)
print(json.dumps({"errors": errors, "sums": [float(o.sum()) for o in outs]}), flush=True)
kv.close()
'''


def test_a_refused_push_leaves_the_waiting_ones_alone(cluster):
    c = cluster(2, 1)
    for (out,) in c.run_workers(REFUSED, timeout=60):
        assert out["sums"] == [10.0, 10.0, 10.0], out
        assert len(out["errors"]) == 3, out
        assert "key 2 was initialised as float32 (5,)" in out["errors"][0], out
        assert "priority must be an int" in out["errors"][2], out
