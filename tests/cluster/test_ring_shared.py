"""The ring's two ways around ZeroMQ, with real processes: between workers on one host, shared
memory (kvps/collective/shared.py: chunks go by place once the right neighbour has mapped the
buffer); with KVPS_SHM=0 (as between hosts), the TCP link (kvps/collective/link.py: chunks read
straight into place from the second collective on). Either way the results are bit for bit those
of the ZeroMQ path. test_ring.py kills a neighbour mid-collective on each path."""
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
ring = kv._ring
shared = ring.shared
out, inn = (ring.links.out, ring.links.inn) if ring.links else (None, None)
print(json.dumps({"hash": digest.hexdigest(), "placed": shared and shared.placed, "read": shared and shared.read,
                  "linked": out and out.chunks, "link read": inn and inn.chunks}), flush=True)
kv.close()
'''


def _runs(cluster, workers, env, name):
    """SCRIPT's lines from a job with the variable `name` at 1 and from one with it at 0, each
    with several chunks per segment; every worker of both got the same bytes."""
    runs = {}
    for value in ("1", "0"):
        c = cluster(workers, 0, env=dict(env, KVPS_RING_CHUNK_BYTES="16384", **{name: value}))
        runs[value] = [line for (line,) in c.run_workers(SCRIPT, timeout=120)]
        assert c.wait_daemons() == [0]
    assert len({line["hash"] for lines in runs.values() for line in lines}) == 1, runs
    return runs


@pytest.mark.parametrize("workers", [2, 3])
def test_chunks_go_by_place_and_sum_bit_for_bit_as_over_tcp(cluster, workers):
    runs = _runs(cluster, workers, {}, "KVPS_SHM")
    for line in runs["1"]:
        assert line["placed"] > 0 and line["read"] > 0, runs["1"]
    assert all(line["placed"] is None for line in runs["0"]), runs["0"]


@pytest.mark.parametrize("workers", [2, 3])
def test_without_shared_memory_chunks_go_on_the_tcp_link_and_sum_bit_for_bit_as_over_zeromq(cluster, workers):
    runs = _runs(cluster, workers, {"KVPS_SHM": "0"}, "KVPS_RING_LINK")
    for line in runs["1"]:      # the first collective goes through ZeroMQ while the link is offered
        assert line["linked"] > 0 and line["link read"] > 0 and line["placed"] is None, runs["1"]
    assert all(line["linked"] is None and line["link read"] is None for line in runs["0"]), runs["0"]
