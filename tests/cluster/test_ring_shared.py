"""The ring between workers on one host through shared memory (kvps/collective/shared.py), with
real processes: chunks go by place once the right neighbour has mapped the buffer, the results are
bit for bit those of the TCP path (KVPS_SHM=0), and a neighbour that dies mid-collective still
fails the others loudly."""
import time

import pytest

# Random float32 (whose sums depend on their order), float16 and int64 keys, several chunks per
# segment, the same buffers call after call (kvstore keys: shared after the handshake).
SCRIPT = r'''
import hashlib, json, numpy as np, kvps
kv = kvps.create("allreduce")
r = kv.rank
rng = np.random.default_rng(r)
keys = [f"k{i}" for i in range(9)]
vals = [rng.standard_normal(10_001 + 777 * i).astype((np.float32, np.float16, np.int64)[i % 3]) for i in range(9)]
kv.init(keys, vals)
outs = [np.empty_like(v) for v in vals]
digest = hashlib.sha256()
for step in range(6):
    kv.pushpull(keys, [v * (step + 1) for v in vals], out=outs)
    for o in outs:
        digest.update(o.tobytes())
shared = kv._ring.shared
print(json.dumps({"hash": digest.hexdigest(), "placed": shared and shared.placed, "read": shared and shared.read}),
      flush=True)
kv.close()
'''


@pytest.mark.parametrize("workers", [2, 3])
def test_chunks_go_by_place_and_sum_bit_for_bit_as_over_tcp(cluster, workers):
    env = {"KVPS_RING_CHUNK_BYTES": "16384"}
    runs = {}
    for shm in ("1", "0"):
        c = cluster(workers, 0, env=dict(env, KVPS_SHM=shm))
        runs[shm] = [line for (line,) in c.run_workers(SCRIPT, timeout=120)]
        assert c.wait_daemons() == [0]
    assert len({line["hash"] for lines in runs.values() for line in lines}) == 1, runs
    for line in runs["1"]:
        assert line["placed"] > 0 and line["read"] > 0, runs["1"]
    assert all(line["placed"] is None for line in runs["0"]), runs["0"]


DEAD = r'''
import json, sys, numpy as np, kvps
kv = kvps.create("allreduce")
x = [np.ones(300_000, np.float32), np.ones(5, np.float32)]
kv.init(["a", "b"], x)
try:
    while True:
        kv.pushpull(["a", "b"], x)
        if kv._ring.shared.placed:
            print(json.dumps({"placed": kv._ring.shared.placed}), flush=True)
except kvps.KVPSError as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
    sys.exit(3)
'''


def test_a_neighbour_that_dies_mid_collective_fails_the_ring_loudly(cluster):
    c = cluster(3, 0, env={"KVPS_RING_CHUNK_BYTES": "65536"})
    procs = c.spawn_workers(DEAD)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(c.output(f"W{i}") for i in range(3)):
        time.sleep(0.05)
    assert all("placed" in (c.output(f"W{i}") or [{}])[0] for i in range(3)), c.logs()   # all send by place
    c.proc("W2").kill()
    c.wait(procs[:2], 20)
    for i in range(2):
        assert procs[i].returncode == 3, c.logs()
        last = c.output(f"W{i}")[-1]
        assert last["error"] == "NodeFailure" and "W2" in last["message"], last   # not a timeout
