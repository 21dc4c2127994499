"""Ring all-reduce among real worker processes: W in {1, 2, 3, 4}, every dtype, odd sizes and
sizes smaller than W, fusion on and off, against closed-form sums; and the 'allreduce' kvstore."""

import pytest

SCRIPT = r'''
import json, numpy as np, ml_dtypes, kvps
kv = kvps.create("allreduce")
r, W = kv.rank, kv.num_workers
ok = {}
dtypes = (np.float32, np.float16, ml_dtypes.bfloat16, np.float64, np.int32, np.int64)
sizes = (0, 1, max(W - 1, 1), 7, 1000, 70_001)
for dt in dtypes:
    for n in sizes:
        x = ((np.arange(n) % 7) * (r + 1)).astype(dt)       # small integers: exact in every dtype
        kvps.allreduce(x)
        ok[f"sum {np.dtype(dt).name} {n}"] = bool((x == ((np.arange(n) % 7) * (W * (W + 1) // 2)).astype(dt)).all())
    if dt not in (np.int32, np.int64):
        y = (np.full(10, 2 * (r + 1))).astype(dt)
        kvps.allreduce(y, op="average")
        ok[f"average {np.dtype(dt).name}"] = bool((y.astype(np.float64) == W + 1).all())
# the kvstore interface: a list of keys goes fused; init stores rank 0's values everywhere
keys = [f"p{i}" for i in range(12)]
shapes = [(i + 1, 3) for i in range(12)]
kv.init(keys, [np.full(s, 5 if r == 0 else 99, np.float32) for s in shapes])
outs = [np.zeros(s, np.float32) for s in shapes]
kv.pull(keys, out=outs)
ok["init"] = all(float(o.min()) == float(o.max()) == 5 for o in outs)
vals = [np.full(s, r + 1, np.float32) for s in shapes]
h = kv.pushpull(keys, vals, async_op=True)
h.wait(30)
ok["pushpull"] = all(float(v.min()) == float(v.max()) == W * (W + 1) / 2 for v in vals)
kv.set_optimizer(kvps.optimizer.SGD(learning_rate=1.0, rescale_grad=-2.0))
for i in range(3):
    kv.push(keys, [np.full(s, r + 1, np.float32) for s in shapes])
kv.pull(keys, out=outs)
ok["sgd"] = all(float(o.min()) == float(o.max()) == W * (W + 1) / 2 + 3 * W * (W + 1) for o in outs)
try:
    kvps.allreduce(np.ones(3, np.int32), op="average")
except ValueError as e:
    ok["int average refused"] = "cannot average int32" in str(e)
print(json.dumps(ok), flush=True)
'''


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
@pytest.mark.parametrize("fusion", ["on", "off"])
def test_ring_allreduce_closed_form(cluster, workers, fusion):
    env = {"KVPS_RING_CHUNK_BYTES": "16384"}         # several chunks per segment: the pipeline runs
    if fusion == "off":
        env["KVPS_FUSION_BYTES"] = "0"
    c = cluster(workers, 0, env=env)
    results = c.run_workers(SCRIPT, timeout=120)
    for (line,) in results:
        bad = [k for k, v in line.items() if not v]
        assert not bad, bad
    assert c.wait_daemons() == [0]


DEAD = r'''
import json, sys, time, numpy as np, kvps
kv = kvps.create("allreduce")
print(json.dumps({"ready": True}), flush=True)
try:
    while True:
        kvps.allreduce(np.ones(100_000, np.float32))
except kvps.KVPSError as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
    sys.exit(3)
'''


# The kvstore's kept buffers: on one host their chunks go through shared memory (kvps/collective/shared.py)
DEAD_PLACED = r'''
import json, sys, numpy as np, kvps
kv = kvps.create("allreduce")
x = [np.ones(300_000, np.float32), np.ones(5, np.float32)]
kv.init(["a", "b"], x)
try:
    while True:
        kv.pushpull(["a", "b"], x)
        if kv._ring.shared.placed:
            print(json.dumps({"ready": True, "placed": kv._ring.shared.placed}), flush=True)
except kvps.KVPSError as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
    sys.exit(3)
'''


@pytest.mark.parametrize("script", ["fresh buffers through ZeroMQ", "fresh buffers on the TCP link",
                                    "kept buffers by place"])
def test_dead_peer_fails_the_ring_loudly(cluster, script):
    import time
    env = {"KVPS_RING_CHUNK_BYTES": "65536"}
    # each case is about its own path, whatever the tier runs over
    if script.endswith("by place"):
        env["KVPS_SHM"] = "1"
    else:
        env.update(KVPS_SHM="0", KVPS_RING_LINK="1" if script.endswith("link") else "0")
    c = cluster(3, 0, env=env)
    procs = c.spawn_workers(DEAD if script.startswith("fresh") else DEAD_PLACED)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(c.output(f"W{i}") for i in range(3)):
        time.sleep(0.05)
    assert all(c.output(f"W{i}")[0].get("ready") for i in range(3)), c.logs()
    time.sleep(0.3)
    c.proc("W2").kill()
    c.wait(procs[:2], 20)
    for i in range(2):
        assert procs[i].returncode == 3, c.logs()
        last = c.output(f"W{i}")[-1]
        assert last["error"] == "NodeFailure" and "W2" in last["message"], last   # not a timeout


LATE = r'''
import json, time, numpy as np, kvps
kv = kvps.create("allreduce")
if kv.rank == 0:
    started = time.monotonic()
    try:
        kvps.allreduce(np.ones(1000, np.float32))
    except kvps.KVTimeoutError as e:
        print(json.dumps({"message": str(e), "waited": time.monotonic() - started}), flush=True)
else:
    time.sleep(4)                      # never takes part in collective 0 (mismatched calls)
kv.close()
'''


def test_a_missing_peer_times_out_naming_collective_phase_step_chunk_and_worker(cluster):
    c = cluster(2, 0)
    (a,), _ = c.run_workers(LATE, timeout=60, env={"KVPS_TIMEOUT": "1.5"})
    assert a["message"] == ("allreduce: collective 0: no data from W1 for reduce-scatter step 0 chunk 0 "
                            "within 1.5 s (KVPS_TIMEOUT)")
    assert 1.4 < a["waited"] < 5


JOIN_RACE = r'''
import json, time, numpy as np, kvps
kv = kvps.create("allreduce")
r = kv.rank
x = np.full(5, r + 1.0, np.float32)
if r == 0:
    kvps.allreduce(x)                  # rank 1 has no data: it serves this one with zeros
    time.sleep(0.2)                    # join last, then start the next collective at once
last = kv.join()
y = np.full(4, 10.0 * (r + 1), np.float32)
kvps.allreduce(y)                      # the joined worker must not serve this one as if still joined
print(json.dumps({"last": last, "x": x.tolist(), "y": y.tolist()}), flush=True)
'''


def test_join_ends_before_the_next_collective_however_late_it_is_seen(cluster):
    c = cluster(2, 0)
    (a,), (b,) = c.run_workers(JOIN_RACE, timeout=60)
    assert a["x"] == [1.0] * 5 and a["last"] == b["last"] == 0
    assert a["y"] == b["y"] == [30.0] * 4
    assert c.wait_daemons() == [0]


JOIN_LINKED = r'''
import json, numpy as np, kvps
kv = kvps.create("allreduce")
r, W = kv.rank, kv.num_workers
x = np.full(3, r + 1.0, np.float32)
kvps.allreduce(x)                      # collective 0 (ZeroMQ): every worker; the links are offered
sums = []
if r == 0:
    for i in range(4):                 # collectives 1-4: on the links; the others serve them with zeros
        y = np.full(70_001, i + 1.0, np.float32)
        kvps.allreduce(y)
        sums.append(float(y.sum()))
last = kv.join()
z = np.full(5, 1.0, np.float32)
kvps.allreduce(z)                      # everyone again, after the join
ring = kv._ring
print(json.dumps({"x": x.tolist(), "sums": sums, "last": last, "z": z.tolist(),
                  "linked": ring.links.out is not None and ring.links.out.chunks}), flush=True)
'''


def test_a_joined_worker_serves_collectives_whose_chunks_come_on_the_tcp_link(cluster):
    c = cluster(3, 0, env={"KVPS_SHM": "0", "KVPS_RING_LINK": "1", "KVPS_RING_CHUNK_BYTES": "65536"})
    lines = [line for (line,) in c.run_workers(JOIN_LINKED, timeout=90)]
    assert all(line["x"] == [6.0] * 3 and line["z"] == [3.0] * 5 for line in lines), lines
    assert lines[0]["sums"] == [70_001.0 * (i + 1) for i in range(4)] and lines[0]["last"] == 0, lines
    assert all(line["linked"] for line in lines), lines      # the served collectives went on the links
    assert c.wait_daemons() == [0]
