"""Elastic workers (KVPS_ELASTIC=1) on a real job: kill -9 one worker of three in a dist_sync job;
the others go on, their rounds summing the workers that remain, and see num_workers drop to 2; a
replacement started with the same command joins, gets the current weights, and the count is 3 again
(over CurveZMQ too, the replacement holding its rank's key), while kvps.torch refuses to broadcast it
the job's first weights in sync mode. `kvps launch --elastic` goes on when a worker is killed."""
import json
import os
import subprocess
import sys
import time

import pytest

from harness import FAST_ENV, PY, wait_for

# Every worker pushes rank + 1 into "k" each step, so a round's value names who was in it:
# 6 = W0 + W1 + W2, 4 = W0 + W2. The survivors stop after FULL rounds with the replacement in them;
# the replacement (which starts late) after FULL rounds; so all three stop at the same round.
SCRIPT = r'''
import json, os, sys, time, numpy as np, kvps
FULL = 5
kv = kvps.create("dist_sync")
w = np.full(4, -1.0, np.float32)
kv.init("k", w)           # a replacement's init sets nothing: it reads the current value into w
print(json.dumps({"start": True, "n": kv.num_workers, "w": w.tolist()}), flush=True)
out = np.zeros(4, np.float32)
late = kv._node.membership.get("late", False)
if late:        # kvps.torch's broadcast would give it the job's first weights in sync mode: refused
    import torch, kvps.torch as kt
    kt.init(kvstore=kv)
    try:
        kt.broadcast_parameters({"p": torch.zeros(2)}, root_rank=0)
        refused = None
    except kvps.KVPSError as exc:
        refused = str(exc)
    print(json.dumps({"refused": refused}), flush=True)
seen_four, full = False, 0
for step in range(400):
    if os.environ.get("DIE_AT") == str(step):
        print(json.dumps({"dying": step}), flush=True)
        time.sleep(600)
    kv.pushpull("k", np.full(4, kv.rank + 1, np.float32), out=out)
    value = float(out[0])
    print(json.dumps({"step": step, "value": value, "n": kv.num_workers}), flush=True)
    seen_four = seen_four or value == 4
    full += value == 6 and (seen_four or late)
    if full == FULL:
        break
    time.sleep(0.02)
print(json.dumps({"done": step, "n": kv.num_workers}), flush=True)
'''

DIE_AT = 5


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_dead_worker_is_removed_and_replaced(cluster, curve):
    """With CurveZMQ too: the replacement holds the dead worker's key (its rank's secret file)."""
    c = cluster(3, 2, env={"KVPS_ELASTIC": "1", "KVPS_BIGARRAY_BOUND": "2"}, curve=curve)
    path = c.dir / "worker.py"
    path.write_text(SCRIPT)
    # the same command for every worker; only W1's environment says when it stops to be killed
    procs = [c._spawn(f"W{rank}", [sys.executable, str(path)],
                      env=dict(c.env, KVPS_RANK=str(rank), **({"DIE_AT": str(DIE_AT)} if rank == 1 else {})))
             for rank in range(3)]
    wait_for(lambda: any("dying" in line for line in c.output("W1")), 60, "W1 to reach its step of death")
    procs[1].kill()
    killed = time.monotonic()
    wait_for(lambda: any(line.get("n") == 2 for line in c.output("W0")), 20, "W0 to see 2 workers")
    removed_after = time.monotonic() - killed
    new = c._spawn("W1new", [sys.executable, str(path)],
                   env=dict(c.env, KVPS_RANK="1", **({"KVPS_SECRET_FILE": c.secrets["W1"]} if curve else {})))
    c.wait([procs[0], procs[2], new], 60)
    for name, p in (("W0", procs[0]), ("W2", procs[2]), ("W1new", new)):
        assert p.returncode == 0, (name, c.logs())
    for name in ("W0", "W2"):
        lines = [line for line in c.output(name) if "step" in line]
        values = "".join({6.0: "6", 4.0: "4"}.get(line["value"], "?") for line in lines)
        # W1 pushed into rounds 0 .. DIE_AT - 1; after that the rounds sum W0 and W2 until the
        # replacement joins; then every round has all three again
        assert values.startswith("6" * DIE_AT + "4") and values.endswith("6" * 5), (name, values)
        assert set(values) == {"6", "4"} and "64" not in values[DIE_AT:] and "46" in values, (name, values)
        assert c.output(name)[-1] == {"done": lines[-1]["step"], "n": 3}
    new_lines = c.output("W1new")
    assert c.output("W0")[0]["w"] == [-1.0] * 4
    # the replacement's init got the current value: the last round W0 and W2 closed without it
    assert new_lines[0]["n"] == 3 and new_lines[0]["w"] == [4.0] * 4, new_lines[0]
    assert [line["value"] for line in new_lines if "step" in line] == [6.0] * 5
    refused = [line["refused"] for line in new_lines if "refused" in line]
    assert refused and "joined a running elastic job" in refused[0] and "mode='async'" in refused[0], new_lines
    assert removed_after < 2.0 + 3.0, removed_after      # harness: KVPS_HEARTBEAT_TIMEOUT=2
    assert c.wait_daemons() == [0, 0, 0], c.logs()


def test_without_elastic_a_dead_worker_ends_the_job(cluster):
    """The default stays: the survivors get a NodeFailure naming W1; every daemon exits non-zero."""
    c = cluster(2, 1)
    procs = c.spawn_workers(SCRIPT.replace("FULL = 5", "FULL = 10**6"), env={"DIE_AT": "100000"})
    wait_for(lambda: any("step" in line for line in c.output("W1")), 30, "W1 to start its steps")
    procs[1].kill()
    killed = time.monotonic()
    c.wait([procs[0]], 20)
    assert procs[0].returncode != 0
    assert "NodeFailure" in c.logs() and "W1" in c.logs()
    codes = c.wait_daemons(timeout=10)
    took = time.monotonic() - killed
    assert codes == [1, 1], (codes, c.logs())       # scheduler and the surviving server
    scheduler_log = (c.dir / "H.err").read_text()
    assert "no heartbeat from W1" in scheduler_log and "W0" not in scheduler_log, scheduler_log   # one culprit
    assert took < 2.0 + 3.0, took     # within about one heartbeat timeout (harness: 2 s), not two


LAUNCHED = r'''
import json, os, signal, time, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init("k", np.zeros(2, np.float32))
out = np.zeros(2, np.float32)
late = kv._node.membership.get("late", False)
again = os.environ.get("AGAIN") == "1"       # the launcher starts W1 again: stop once it has rejoined
seen_four, full = False, 0
for step in range(3000):
    if kv.rank == 1 and step == 3 and not os.path.exists("killed"):
        open("killed", "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    kv.pushpull("k", np.full(2, kv.rank + 1, np.float32), out=out)
    seen_four = seen_four or out[0] == 4
    full += out[0] == 6 and (seen_four or late)
    if (again and full == 5) or (not again and step == 29):
        break
    time.sleep(0.02)
print(json.dumps({"rank": kv.rank, "last": float(out[0]), "n": kv.num_workers, "late": late}), flush=True)
'''


@pytest.mark.parametrize("again", [False, True], ids=["goes-on", "restarts"])
def test_launch_elastic_goes_on_when_a_worker_is_killed(tmp_path, again):
    """kvps launch --elastic: a worker killed by SIGKILL is said, and the job goes on with the others
    (their rounds sum W0 and W2 once the scheduler has taken W1 out); the job's code is theirs. With
    --restart-workers the launcher starts W1 again, which joins, and the rounds hold all three again."""
    script = tmp_path / "train.py"
    script.write_text(LAUNCHED)
    restart = ["--restart-workers", "1"] if again else []
    proc = subprocess.run([PY, "-m", "kvps.cli", "launch", "-n", "3", "-s", "1", "--elastic", *restart, "--", PY,
                           str(script)], env=dict(os.environ, **FAST_ENV, AGAIN="1" if again else "0"),
                          capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "worker W1 was killed by SIGKILL; the job goes on with the other workers" in proc.stdout, proc.stdout
    results = {line.split("]", 1)[0][1:]: json.loads(line.split("] ", 1)[1]) for line in proc.stdout.splitlines()
               if line.startswith("[W") and "] {" in line}
    if not again:
        assert sorted(results) == ["W0", "W2"] and all(r["last"] == 4.0 and r["n"] == 2 for r in results.values()), \
            results
        return
    assert "starting a replacement W1 (W1#2, restart 1 of 1)" in proc.stdout, proc.stdout
    # the replacement prints under its node's name, W1
    assert sorted(results) == ["W0", "W1", "W2"] and results["W1"]["late"], results
    assert all(r["last"] == 6.0 and r["n"] == 3 for r in results.values()), results
