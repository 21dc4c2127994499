"""Shared memory between co-located workers and servers (kvps/wire/shm.py), with real processes:
the same results as TCP in every call pattern (split keys over 2 servers included), pushes that
return early still send what was pushed, pulls read straight out of the server's memory in every
mode and never see a value change under them, KVPS_SHM=0 and another host address keep to TCP, a killed
job leaves nothing behind, and a server refuses segments it must not map and keeps serving.

`KVPS_SHM=0 ./run test -m cluster` runs the whole cluster tier over TCP; on loopback it runs over
shared memory by default."""
import json
import os
import signal

import pytest

from harness import Cluster

# These tests are about shared memory itself: on, even where the tier runs over TCP (KVPS_SHM=0).
SHM_ON = {"KVPS_SHM": "1"}

# Big enough to travel through shared memory (kvps/wire/shm.py MIN_BYTES), split over the servers
# (KVPS_BIGARRAY_BOUND), with small keys beside them that travel inline.
CALLS = r'''
import json, os, numpy as np, kvps
kv = kvps.create("dist_sync")
r, n = kv.rank, kv.num_workers
shapes = {"big": (300, 1000), "mid": (20000,), "small": (7,), "half": (5000,)}
kv.init(list(shapes), [np.zeros(s, np.float32) for s in shapes.values()])
got = {}
for step in range(3):
    grads = {k: np.full(s, (r + 1) * (step + 1), np.float32) for k, s in shapes.items()}
    for i, k in enumerate(shapes):                       # MXNet's pattern: per-key push, then pull
        kv.push(k, grads[k], priority=-i)
        grads[k][...] = -1000.0                          # overwritten at once: must change nothing
    outs = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    for i, k in enumerate(shapes):
        kv.pull(k, out=outs[k], priority=-i)
    got[f"loop{step}"] = {k: float(o.mean()) for k, o in outs.items()}
    g = [np.full(s, 10.0 * (r + 1), np.float32) for s in shapes.values()]
    o = [np.zeros(s, np.float32) for s in shapes.values()]
    kv.pushpull(list(shapes), g, out=o)                  # one call for every key
    got[f"pushpull{step}"] = {k: [float(x.min()), float(x.max())] for k, x in zip(shapes, o)}
    h = kv.push(list(shapes), [np.full(s, 1.0, np.float32) for s in shapes.values()], async_op=True)
    h.wait()
    o = [np.zeros(s, np.float32) for s in shapes.values()]
    kv.pull(list(shapes), out=o, async_op=True).wait()
    got[f"async{step}"] = {k: float(x.mean()) for k, x in zip(shapes, o)}
stats = kv.server_stats()
print(json.dumps({"rank": r, "got": got, "shared": sum(s.get("shared", 0) for s in stats.values()),
                  "placed": sum(s.get("placed", 0) for s in stats.values())}), flush=True)
kv.close()
'''


def _expected(workers):
    total = sum(range(1, workers + 1))
    exp = {}
    for step in range(3):
        exp[f"loop{step}"] = total * (step + 1)
        exp[f"pushpull{step}"] = 10.0 * total
        exp[f"async{step}"] = workers * 1.0
    return exp


def _check(results, workers):
    exp = _expected(workers)
    for (res,) in results:
        for name, value in exp.items():
            for key, got in res["got"][name].items():
                lo, hi = (got, got) if not isinstance(got, list) else got
                assert lo == hi == value, (res["rank"], name, key, got, value)
    return results[0][0]["shared"], results[0][0]["placed"]


@pytest.mark.parametrize("servers", [1, 2])
def test_shared_memory_gives_the_same_results_as_tcp(tmp_path, servers):
    shared = {}
    for shm in ("1", "0"):
        (tmp_path / f"shm{shm}").mkdir()
        with Cluster(tmp_path / f"shm{shm}", workers=2, servers=servers, env={"KVPS_SHM": shm}) as c:
            shared[shm] = _check(c.run_workers(CALLS, timeout=120), 2)
            assert c.wait_daemons() == [0] * (servers + 1)
    assert shared["1"][0] > 0, "nothing went through shared memory on one host"
    assert shared["1"][1] > 0, "no pull was read straight out of the server's memory"
    assert shared["0"] == (0, 0), "KVPS_SHM=0 still used shared memory"


def test_a_worker_on_another_address_keeps_to_tcp(tmp_path):
    # 127.0.0.2 is this machine too, but for kvps another host: its worker must not share memory
    # (emulated hosts have their own addresses and the same pid namespace).
    with Cluster(tmp_path, workers=1, servers=1, env=SHM_ON) as c:
        (res,), = c.run_workers(CALLS, timeout=120, env={"KVPS_HOST": "127.0.0.2"})
        assert res["shared"] == res["placed"] == 0
        assert res["got"]["loop0"]["big"] == 1.0


# Pulls read straight out of the server's value segments: in dist_sync with a server optimizer
# (each round updates the value in place), with calls that return at once and a next push issued
# before the last pull is in (kvps/kvstore/order.py makes it wait for that pull's copy); in
# dist_async too, where a value changes on any worker's push (server/reads.py).
PIPELINED = r'''
import json, os, numpy as np, kvps
kv = kvps.create(os.environ["MODE"])
r, n, steps = kv.rank, kv.num_workers, 6
shape = (400, 1000)                            # 1.6 MB, split over the servers
kv.init("w", np.zeros(shape, np.float32))
if kv.type == "dist_sync":
    kv.set_optimizer(kvps.optimizer.SGD(learning_rate=0.5))
warm = np.zeros(shape, np.float32)
kv.pushpull("w", warm, out=warm)               # zeros change nothing; the worker maps the server's segments
outs = [np.full(shape, np.nan, np.float32) for _ in range(steps)]
grad = np.empty(shape, np.float32)
for step in range(steps):
    grad[...] = r + 1
    kv.push("w", grad, async_op=True)
    kv.pull("w", out=outs[step], async_op=True)    # the next push goes before this is waited for
kv.wait_all()
kv.barrier()
final = np.zeros(shape, np.float32)
kv.pull("w", out=final)
stats = kv.server_stats()
print(json.dumps({"rank": r, "outs": [[float(o.min()), float(o.max())] for o in outs],
                  "final": [float(final.min()), float(final.max())],
                  "placed": sum(s.get("placed", 0) for s in stats.values())}), flush=True)
kv.close()
'''


@pytest.mark.parametrize("mode,shm", [("dist_sync", "1"), ("dist_sync", "0"), ("dist_async", "1")])
def test_pulls_read_out_of_server_memory_over_shared_memory_only(tmp_path, mode, shm):
    with Cluster(tmp_path, workers=2, servers=2, env={"MODE": mode, "KVPS_SHM": shm}) as c:
        results = [res for (res,) in c.run_workers(PIPELINED, timeout=120)]
        assert c.wait_daemons() == [0, 0, 0]
    total = 1 + 2                                  # both workers' gradients, every step
    for res in results:
        final = -0.5 * total * 6 if mode == "dist_sync" else total * 6
        assert res["final"] == [final, final], res
        if mode == "dist_sync":
            # Pull t returns round t's value, as MXNet's engine orders it between pushes t and t + 1,
            # whichever way it travels: read out of the server's memory (push t + 1 waited until
            # it was copied, so no round closed under it) or over TCP (the server answers it as
            # round t closes, though push t + 1 is in already). Never a mix of two rounds.
            assert res["outs"] == [[-0.5 * total * (t + 1)] * 2 for t in range(6)], res
    placed = results[0]["placed"]
    assert (placed > 0) if shm == "1" else (placed == 0), results


# Where a value changes while workers read it (async, ssp, backup workers; a server optimizer or
# plain sums), each worker pushes and pulls one key (one part, on one server) as fast as it can. A
# pull read while the server changed its memory would mix two values: every pulled array must hold
# one value, and no update may be lost.
RACE = r'''
import json, os, numpy as np, kvps
kv = kvps.create(os.environ["MODE"])
r, n, steps = kv.rank, kv.num_workers, int(os.environ["STEPS"])
shape = (1 << 18,)                              # 1 MB: kept in the server's value segments
kv.init("w", np.zeros(shape, np.float32))
if os.environ.get("LR"):
    kv.set_optimizer(kvps.optimizer.SGD(learning_rate=float(os.environ["LR"])))
grad, out = np.ones(shape, np.float32), np.empty(shape, np.float32)
mixed = []
for step in range(steps):
    kv.push("w", grad)
    kv.pull("w", out=out)
    if out.min() != out.max():
        mixed.append([step, float(out.min()), float(out.max())])
if kv.type.startswith("dist_sync"):
    kv.join()                   # the others' last rounds close without the workers that are done
else:
    kv.barrier()
kv.pull("w", out=out)
stats = kv.server_stats()
print(json.dumps({"rank": r, "mixed": mixed[:5], "final": [float(out.min()), float(out.max())],
                  "placed": sum(s.get("placed", 0) for s in stats.values()),
                  "moved": sum(s.get("moved", 0) for s in stats.values())}), flush=True)
kv.close()
'''


@pytest.mark.parametrize("mode,lr", [("dist_async", ""), ("dist_async", "0.5"), ("dist_ssp:1", ""),
                                     ("dist_sync:backup=1", "")])
def test_no_pull_sees_a_value_change_under_it(tmp_path, mode, lr):
    steps = 150
    with Cluster(tmp_path, workers=3, servers=1, env={"MODE": mode, "LR": lr, "STEPS": str(steps), **SHM_ON}) as c:
        results = [res for (res,) in c.run_workers(RACE, timeout=180)]
        assert c.wait_daemons() == [0, 0]
    for res in results:
        assert res["mixed"] == [], res
        lo, hi = res["final"]
        assert lo == hi, res
        if mode != "dist_sync:backup=1":            # backup workers drop stale pushes
            assert lo == (-0.5 if lr else 1.0) * 3 * steps, res
    assert results[0]["placed"] > 0, results        # the pulls were read in the server's memory


HOLD = r'''
import json, os, sys, time, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init("w", np.zeros(1 << 20, np.float32))
kv.pushpull("w", np.ones(1 << 20, np.float32), out=np.zeros(1 << 20, np.float32))
def target(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:          # the descriptor listdir itself used
        return ""
fds = sorted(t for t in map(target, os.listdir("/proc/self/fd")) if t.startswith("/memfd:kvps-"))
print(json.dumps({"memfds": fds}), flush=True)
time.sleep(60)
'''


def test_a_killed_job_leaves_no_segments(tmp_path):
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    with Cluster(tmp_path, workers=1, servers=1, env=SHM_ON) as c:
        (proc,) = c.spawn_workers(HOLD)
        log = tmp_path / "W0.log"
        from harness import wait_for
        wait_for(lambda: log.exists() and "memfds" in log.read_text(), 60, "the worker's segment list")
        memfds = json.loads(log.read_text().splitlines()[0])["memfds"]
        assert memfds, "the worker made no memfd segment"
        for name in ("W0", "S0", "H"):
            c.proc(name).send_signal(signal.SIGKILL)
        c.wait([c.proc(n) for n in ("W0", "S0", "H")], 30)
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {f for f in after - before if "kvps" in f}, after - before


HOSTILE = r'''
import json, os, numpy as np, kvps
from kvps.wire.protocol import Header, Op
kv = kvps.create("dist_sync")
kv.init("w", np.zeros(1 << 16, np.float32))
node = kv._node
def attach(**meta):
    base = {"pid": os.getpid(), "fd": 0, "segment": 99, "nonce": b"\0" * 16}
    base.update(meta)
    try:
        node.request("S0", Header(Op.ATTACH, meta=base), "hostile attach").wait(10)
        return "accepted"
    except Exception as exc:
        return type(exc).__name__ + ": " + str(exc)
r = {"other_pid": attach(pid=1), "not_memfd": attach(fd=0), "bad_nonce": None, "unattached": None}
# a real memfd of ours, with the wrong nonce
fd = os.memfd_create("kvps-hostile", 0); os.ftruncate(fd, 4096)
r["bad_nonce"] = attach(fd=fd, nonce=b"\1" * 16)
try:   # a push that names a segment never attached
    h = node.request("S0", Header(Op.PUSH, keys=[["w", 0, 0, [1 << 16], 0]], meta={"shm": [[0, 7, 64]]}), "bad push")
    h.wait(10); r["unattached"] = "accepted"
except Exception as exc:
    r["unattached"] = type(exc).__name__ + ": " + str(exc)
out = np.zeros(1 << 16, np.float32)
kv.pushpull("w", np.full(1 << 16, 2.0, np.float32), out=out)   # the server still serves, over shm
r["after"] = float(out.mean())
try:   # segment 0 is attached now: a region past its end
    h = node.request("S0", Header(Op.PUSH, keys=[["w", 0, 0, [1 << 16], 0]], meta={"shm": [[0, 0, 1 << 40]]}),
                     "out-of-bounds push")
    h.wait(10); r["outside"] = "accepted"
except Exception as exc:
    r["outside"] = type(exc).__name__ + ": " + str(exc)
try:   # a pull that says it has mapped a negative number of the server's value segments
    h = node.request("S0", Header(Op.PULL, keys=[["w", 0, 0, [1 << 16], 0]],
                                  meta={"into": [[0, 0, 64]], "mapped": -1}), "negative claim")
    h.wait(10); r["negative"] = "accepted"
except Exception as exc:
    r["negative"] = type(exc).__name__ + ": " + str(exc)
try:   # a pull that says it has read a reply it was never given
    h = node.request("S0", Header(Op.PULL, keys=[["w", 0, 0, [1 << 16], 0]], meta={"done": [10 ** 6]}),
                     "claims a read")
    h.wait(10); r["never_given"] = "accepted"
except Exception as exc:
    r["never_given"] = type(exc).__name__ + ": " + str(exc)
kv.pushpull("w", np.full(1 << 16, 3.0, np.float32), out=out)
r["again"] = float(out.mean())
r["shared"] = sum(s.get("shared", 0) for s in kv.server_stats().values())
print(json.dumps(r), flush=True)
kv.close()
'''


def test_a_server_refuses_segments_it_must_not_map(tmp_path):
    with Cluster(tmp_path, workers=1, servers=1, env=SHM_ON) as c:
        (res,), = c.run_workers(HOSTILE, timeout=60)
        assert c.wait_daemons() == [0, 0]
    assert "registered as pid" in res["other_pid"], res
    assert "not a kvps memfd" in res["not_memfd"], res
    assert "nonce" in res["bad_nonce"], res
    assert "attached" in res["unattached"], res
    assert "outside segment 0" in res["outside"], res
    assert "mapped=-1 is negative" in res["negative"], res
    assert "says it has read reply 1000000" in res["never_given"], res
    assert res["after"] == 2.0 and res["again"] == 3.0 and res["shared"] > 0, res
