"""Chain replication (KVPS_REPLICAS) on real jobs: kill -9 a server at a random point of a training
loop written as MXNet scripts are (per-key push, then pull; a server-side optimizer with momentum),
and the job goes on at the replicas; the final weights equal those of a run without the failure, bit
for bit, in dist_sync; in dist_async nothing acknowledged is lost; one death more than the replicas
cover ends the job with a clear error, within the heartbeat timeout."""
import json
import random
import time

import pytest

from harness import PY, wait_for

pytestmark = pytest.mark.cluster

# Gradients are multiples of 1/64 with small sums, so every sum is exact whatever the order the
# pushes of a round arrive in (which differs from run to run with or without a failure).
SCRIPT = r'''
import json, os, sys, time, numpy as np, kvps
STEPS = int(os.environ["STEPS"])
kv = kvps.create(os.environ.get("MODE", "dist_sync"))
# "wide": one part of 120 KB per server, which co-located workers push and pull through shared memory;
# "mid": two parts of 100 KB, a call small enough for a lane (kvps/wire/lane.py)
shapes = {"w0": (3,), "w1": (40, 5), "big": (600, 10), 7: (9,), "wide": (3, 30000), "mid": (2, 25000)}
if os.environ.get("OPTIMIZER", "sgd") == "sgd":
    # its rate falls every 7 updates: a replica that takes over goes on with the schedule
    kv.set_optimizer(kvps.optimizer.SGD(learning_rate=0.5, momentum=0.5, rescale_grad=1.0,
                                        lr_scheduler=kvps.lr_scheduler.FactorScheduler(step=7, factor=0.75)))
weights = {k: np.full(s, 1.0, np.float32) for k, s in shapes.items()}
for k, w in weights.items():
    kv.init(k, w)
for step in range(STEPS):
    for i, (k, w) in enumerate(weights.items()):
        g = np.full(w.shape, ((kv.rank + 1) * (step % 5 + 1) + i) / 64.0, np.float32)
        kv.push(k, g, priority=-i)
    for i, (k, w) in enumerate(weights.items()):
        kv.pull(k, out=w, priority=-i)
    print(json.dumps({"step": step, "t": time.time()}), flush=True)
    time.sleep(float(os.environ.get("PAUSE", "0")))
print(json.dumps({"final": {str(k): w.reshape(-1)[:64].tolist() for k, w in weights.items()},
                  "sums": {str(k): float(w.astype(np.float64).sum()) for k, w in weights.items()},
                  "n": kv.num_workers}), flush=True)
'''

ENV = {"KVPS_REPLICAS": "1", "KVPS_BIGARRAY_BOUND": "1000", "KVPS_PARTITION_BYTES": "8000"}


def _final(c):
    out = [c.output(f"W{r}")[-1] for r in range(c.workers)]
    assert all("final" in o for o in out), c.logs()
    return out


@pytest.mark.parametrize("optimizer,shm", [("sgd", "1"), ("none", "1"), ("sgd", "0")])
def test_kill_a_server_in_sync_the_weights_are_exact(cluster, optimizer, shm):
    """With an optimizer a replica applies each round's sum with it; without, the sums that lie in
    its head's shared memory become its values as they are (server/replication.py), and stay
    readable there when the head is killed. Over TCP (KVPS_SHM=0) a head sends the values of a
    big pushpull before its replica has the round, and acknowledges the push after."""
    steps = 40
    env = dict(ENV, KVPS_SHM=shm)
    clean = cluster(2, 3, env=env)
    clean.run_workers(SCRIPT, timeout=90, env={"STEPS": str(steps), "OPTIMIZER": optimizer})
    expected = _final(clean)
    assert clean.wait_daemons() == [0, 0, 0, 0], clean.logs()

    c = cluster(2, 3, env=env)
    procs = c.spawn_workers(SCRIPT, env={"STEPS": str(steps), "PAUSE": "0.05", "OPTIMIZER": optimizer})
    at = random.Random().randint(3, 12)
    wait_for(lambda: sum("step" in line for line in c.output("W0")) >= at, 60, f"W0 to reach step {at}")
    c.proc("S1").kill()
    killed = time.time()
    c.wait(procs, 90)
    assert [p.returncode for p in procs] == [0, 0], c.logs()
    got = _final(c)
    assert got == expected, (at, got, expected)
    assert got[0]["final"] == got[1]["final"]
    codes = c.wait_daemons()
    assert codes == [0, 0, -9, 0], (codes, c.logs())     # H, S0 and S2 end cleanly; S1 was killed
    assert "its key ranges go on at their replicas" in (c.dir / "H.err").read_text()
    # the first step after the kill ends within the heartbeat timeout (harness: 2 s) and a little
    resumed = min(line["t"] for line in c.output("W0") if "t" in line and line["t"] > killed) - killed
    print(f"\nkill -9 of S1 at step {at}: W0's next step ended {resumed:.2f} s later (KVPS_HEARTBEAT_TIMEOUT=2)")
    assert resumed < 2.0 + 3.0, resumed


@pytest.mark.parametrize("coalesce", ["1000", "1"])
def test_a_head_that_dies_before_sending_a_rounds_sum_loses_nothing(cluster, coalesce):
    """One replica, sync: the replicas get copies of the pushes without their values, and each
    round's sum from the head. S1 here never sends a sum (KVPS_TEST_HOLD_ROUNDS, test only), so its
    replica's rounds wait with the pushes' places only; when S1 is killed, the workers send their
    unanswered requests again, whose values fill those places, and the weights end as a clean run's,
    bit for bit. With KVPS_COALESCE_US=1 the I/O thread sends the waiting pushes at once, so a
    worker often waits on a request of the I/O path while its lane still holds step 0's push,
    unacknowledged: the lane must send that one to S2 too although nobody waits on the lane (it
    did not, and the workers timed out, in 1 to 2 runs of 5)."""
    steps = 6
    env = dict(ENV, KVPS_COALESCE_US=coalesce)
    clean = cluster(2, 3, env=env)
    clean.run_workers(SCRIPT, timeout=90, env={"STEPS": str(steps)})
    expected = _final(clean)

    c = cluster(2, 3, env=dict(env, KVPS_TEST_HOLD_ROUNDS="S1", KVPS_LOG_LEVEL="INFO"))
    procs = c.spawn_workers(SCRIPT, env={"STEPS": str(steps)})
    wait_for(lambda: all(any("step" in line for line in c.output(f"W{r}")) for r in range(2)), 60,
             "both workers to end step 0")
    # Their pulls read S1's values, but their pushes to S1 stay unanswered: S1's replica, S2, waits
    # for sums that never come, and S1 answers a push only once S2 has applied it.
    time.sleep(1.0)
    assert not any("final" in line for line in c.output("W0")), c.logs()
    c.proc("S1").kill()
    c.wait(procs, 60)
    assert [p.returncode for p in procs] == [0, 0], c.logs()
    assert _final(c) == expected
    assert "whose copy came without values" in (c.dir / "S2.err").read_text(), c.logs()


SUMS_SCRIPT = r'''
import json, numpy as np, kvps
kv = kvps.create("dist_sync")
big, small = np.zeros(50_000, np.float32), np.zeros(10, np.float32)    # 200 KB: a value segment; 40 B: not
kv.init("big", big)
kv.init("small", small)
for step in range(5):
    kv.push("big", np.full(big.shape, kv.rank + 1.0, np.float32))
    kv.pull("big", out=big)
    kv.pushpull("small", np.full(small.shape, kv.rank + 1.0, np.float32), out=small)
kv.barrier()
print(json.dumps({"big": sorted(set(big.tolist())), "small": sorted(set(small.tolist())),
                  "stats": kv.server_stats() if kv.rank == 0 else {}}), flush=True)
'''


@pytest.mark.parametrize("shm", ["1", "0"])
def test_one_replica_gets_each_rounds_sum_once_not_every_workers_values(cluster, shm):
    """The chain carries one sum a round, not each worker's push: the servers took in the workers'
    bytes once (at the heads), every round closed at head and replica, and, on one host, the big
    key's sums were read in the head's memory instead of crossing the socket."""
    c = cluster(2, 2, env={"KVPS_REPLICAS": "1", "KVPS_SHM": shm})
    out = c.run_workers(SUMS_SCRIPT, timeout=60)
    results = [lines[-1] for lines in out]
    assert all(r["big"] == [3.0] and r["small"] == [3.0] for r in results), results
    stats = results[0]["stats"]
    assert sorted(stats) == ["S0", "S1"], stats
    assert sum(s["round_sums"] for s in stats.values()) == 2 * 5          # one per round of each key
    assert sum(s["round_sums_shared"] for s in stats.values()) == (5 if shm == "1" else 0)
    assert sum(s["rounds"] for s in stats.values()) == 2 * 2 * 5         # closed at head and replica
    assert sum(s["bytes_in"] for s in stats.values()) == 5 * 2 * (200_000 + 40)
    # with shared memory each push and pull of the big key named shared memory (its push's values,
    # its pull's reply region), and pulls were read straight out of the head's memory
    assert sum(s["shared"] for s in stats.values()) == (5 * 2 * 2 if shm == "1" else 0), stats
    assert (sum(s["placed"] for s in stats.values()) > 0) == (shm == "1"), stats
    assert c.wait_daemons() == [0, 0, 0], c.logs()


def test_kill_a_server_in_async_nothing_acknowledged_is_lost(cluster):
    """Without an optimizer every acknowledged push adds into the value; after the death each key
    holds exactly the sum of every push (all of them were acknowledged: the workers finished)."""
    script = r'''
import json, os, numpy as np, kvps
kv = kvps.create("dist_async")
keys = ["a", "b", "big", "wide"]
# "wide": parts of 120 KB, pushed through shared memory and copied along the chain inline
shapes = {"a": (5,), "b": (7, 3), "big": (500, 4), "wide": (3, 30000)}
for k in keys:
    kv.init(k, np.zeros(shapes[k], np.float32))
STEPS = int(os.environ["STEPS"])
for step in range(STEPS):
    for k in keys:
        kv.push(k, np.full(shapes[k], kv.rank + 1, np.float32))
    print(json.dumps({"step": step}), flush=True)
    import time; time.sleep(0.02)
kv.barrier()
out = {k: np.zeros(shapes[k], np.float32) for k in keys}
for k in keys:
    kv.pull(k, out=out[k])
print(json.dumps({"final": {k: sorted(set(v.reshape(-1).tolist())) for k, v in out.items()}}), flush=True)
'''
    steps = 60
    c = cluster(2, 3, env=ENV)
    procs = c.spawn_workers(script, env={"STEPS": str(steps)})
    wait_for(lambda: sum("step" in line for line in c.output("W1")) >= 10, 60, "W1 to reach step 10")
    c.proc("S2").kill()
    c.wait(procs, 90)
    assert [p.returncode for p in procs] == [0, 0], c.logs()
    total = float(steps * (1 + 2))
    for out in _final(c):
        assert out["final"] == {"a": [total], "b": [total], "big": [total], "wide": [total]}, out


def test_two_replicas_survive_two_deaths_and_the_weights_are_exact(cluster):
    """KVPS_REPLICAS=2 on 3 servers: every copy carries its values (those a worker put in shared
    memory go inline), and after S1 and then S2 are killed S0 holds every range; the weights equal
    a clean run's bit for bit."""
    steps = 30
    env = dict(ENV, KVPS_REPLICAS="2")
    clean = cluster(2, 3, env=env)
    clean.run_workers(SCRIPT, timeout=90, env={"STEPS": str(steps)})
    expected = _final(clean)

    c = cluster(2, 3, env=env)
    procs = c.spawn_workers(SCRIPT, env={"STEPS": str(steps), "PAUSE": "0.05"})
    wait_for(lambda: sum("step" in line for line in c.output("W0")) >= 5, 60, "W0 to reach step 5")
    c.proc("S1").kill()
    wait_for(lambda: "S1 died" in (c.dir / "H.err").read_text() or "go on at their replicas" in
             (c.dir / "H.err").read_text(), 10, "S1's failover")
    wait_for(lambda: sum("step" in line for line in c.output("W0")) >= 12, 60, "W0 to reach step 12")
    c.proc("S2").kill()
    c.wait(procs, 90)
    assert [p.returncode for p in procs] == [0, 0], c.logs()
    assert _final(c) == expected


def test_more_deaths_than_replicas_end_the_job_clearly(cluster):
    c = cluster(2, 3, env=ENV)
    procs = c.spawn_workers(SCRIPT, env={"STEPS": "100000", "PAUSE": "0.05"})
    wait_for(lambda: sum("step" in line for line in c.output("W0")) >= 3, 60, "W0 to reach step 3")
    c.proc("S0").kill()
    wait_for(lambda: "go on at their replicas" in (c.dir / "H.err").read_text(), 10, "S0's failover")
    c.proc("S1").kill()      # S0's ranges were on S0 and S1: now nobody holds them
    killed = time.monotonic()
    c.wait(procs, 20)
    took = time.monotonic() - killed
    assert all(p.returncode != 0 for p in procs), c.logs()
    logs = c.logs()
    assert "NodeFailure" in logs and "no live replica left" in (c.dir / "H.err").read_text(), logs
    assert took < 2.0 + 4.0, took        # about one heartbeat timeout (harness: 2 s)


def test_replicas_need_more_servers():
    from kvps.config import Config
    from kvps.errors import ConfigError
    from scheduler.scheduler import Scheduler
    cfg = Config.from_env({"KVPS_REPLICAS": "2", "KVPS_NUM_SERVERS": "2", "KVPS_NUM_WORKERS": "1"})
    with pytest.raises(ConfigError, match="KVPS_REPLICAS=2 needs more servers"):
        Scheduler(cfg)


CKPT_SCRIPT = r'''
import hashlib, json, os, pathlib, time, numpy as np, kvps
kv = kvps.create("dist_sync")
SHAPES = {"big": (3000, 4), "small": (7,), 3: (40, 5)}
keys = list(SHAPES)
kv.init(keys, [np.full(s, 0.5, np.float32) for s in SHAPES.values()])   # KVPS_RESUME: the saved state
kv.set_optimizer(kvps.optimizer.Adam(learning_rate=0.01, rescale_grad=0.5))
start, stop = int(os.environ["START"]), int(os.environ["STOP"])
outs = [np.zeros(s, np.float32) for s in SHAPES.values()]
for step in range(start, stop):
    if step == int(os.environ.get("KILL_AT", "-1")):        # the test kills S1 here and waits for failover
        print(json.dumps({"ready": step}), flush=True)
        go = pathlib.Path(os.environ["GO"])
        deadline = time.monotonic() + 30
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    if step == int(os.environ.get("SAVE_AT", "-1")):
        kv.save(os.environ["CKPT"])
    rng = np.random.default_rng([step, kv.rank])
    kv.push(keys, [rng.standard_normal(s).astype(np.float32) for s in SHAPES.values()])
    kv.pull(keys, out=outs)
print(json.dumps({"digest": {str(k): hashlib.sha256(o.tobytes()).hexdigest() for k, o in zip(keys, outs)}}),
      flush=True)
'''


def test_a_checkpoint_saved_after_a_failover_resumes_exactly(cluster, tmp_path):
    """After S1 dies its ranges (values and Adam's moments) are saved from their replica on S2;
    a job without replicas, on two servers, resumes from that checkpoint and ends bit for bit where
    the replicated job that lost a server ended."""
    ckpt, go = tmp_path / "ckpt", tmp_path / "go"
    c = cluster(2, 3, env=dict(ENV, KVPS_PARTITION_BYTES="4000"))
    procs = c.spawn_workers(CKPT_SCRIPT, env={"START": "0", "STOP": "10", "KILL_AT": "3", "SAVE_AT": "6",
                                              "CKPT": str(ckpt), "GO": str(go)})
    wait_for(lambda: all(any("ready" in line for line in c.output(f"W{r}")) for r in range(2)), 60,
             "both workers at step 3")
    c.proc("S1").kill()
    wait_for(lambda: "go on at their replicas" in (c.dir / "H.err").read_text(), 10, "S1's failover")
    go.write_text("")
    c.wait(procs, 60)
    assert [p.returncode for p in procs] == [0, 0], c.logs()
    want = [line["digest"] for r in range(2) for line in c.output(f"W{r}") if "digest" in line]
    assert len(want) == 2 and want[0] == want[1], c.logs()
    assert json.loads((ckpt / "manifest.json").read_text())["num_servers"] == 3

    resumed = cluster(2, 2, env={"KVPS_BIGARRAY_BOUND": "1000", "KVPS_RESUME": str(ckpt)})
    out = resumed.run_workers(CKPT_SCRIPT, timeout=60, env={"START": "6", "STOP": "10"})
    got = [line["digest"] for lines in out for line in lines if "digest" in line]
    assert got == want, (got, want)


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_a_new_server_takes_over_and_the_job_survives_another_death(cluster, curve):
    """R=1: S1 is killed; a new `kvps server` joins, takes S1's rank and gets the state of its
    chains (values, momentum, open rounds) from their old tails; then S2 is killed too, which
    without the newcomer would lose S1's ranges. The final weights equal a clean run's, bit for bit.
    With CurveZMQ the newcomer holds S1's key, and servers relay the workers' requests."""
    steps = 60
    clean = cluster(2, 3, env=ENV)
    clean.run_workers(SCRIPT, timeout=90, env={"STEPS": str(steps)})
    expected = _final(clean)

    c = cluster(2, 3, env=ENV, curve=curve)
    procs = c.spawn_workers(SCRIPT, env={"STEPS": str(steps), "PAUSE": "0.05"})
    wait_for(lambda: sum("step" in line for line in c.output("W0")) >= 4, 60, "W0 to reach step 4")
    c.proc("S1").kill()
    wait_for(lambda: "go on at their replicas" in (c.dir / "H.err").read_text(), 10, "S1's failover")
    if curve:
        c.secrets["S1new"] = c.secrets["S1"]
    c._spawn("S1new", [PY, "-m", "kvps.cli", "server"], ready=True)
    c._ready("S1new")
    took = lambda: (c.dir / "S1new.err").read_text().count("took over the ranges")   # noqa: E731
    wait_for(lambda: took() == 2, 20, "the new S1 to take over the ranges of S1 and S0")
    at = sum("step" in line for line in c.output("W0"))
    wait_for(lambda: sum("step" in line for line in c.output("W0")) >= at + 3, 30, "three more steps")
    c.proc("S2").kill()      # S1's ranges were on S1 and S2: now only on the newcomer
    c.wait(procs, 90)
    assert [p.returncode for p in procs] == [0, 0], c.logs()
    assert _final(c) == expected
    assert "no live replica left" not in (c.dir / "H.err").read_text()
    codes = c.wait_daemons()
    assert codes == [0, 0, -9, -9, 0], (codes, c.logs())     # H, S0, S1 and S2 killed, the new S1
