"""MXNet scripts run unchanged on real jobs: a kvstore never closed still leaves the job at once, a
push returns before its round closes yet overwriting the pushed array changes nothing, errors of
returned calls are raised by the next call, per-key push loops then pull loops give the right
values (pulled ahead), row-sparse pushes sum rows and update only them, MXNet's names work, what MXNet's own dist kvstore
tests check holds, and a round held up by a live worker is named by its server (the stall check)
while the job goes on."""
import json
import os
import subprocess
import time

import pytest

from harness import FAST_ENV, PY

# A heartbeat timeout far longer than a job takes: a job that ends by waiting for it fails the test.
SLOW_HEARTBEAT = {"KVPS_HEARTBEAT_INTERVAL": "0.5", "KVPS_HEARTBEAT_TIMEOUT": "60"}

EXITS = {
    # how an MXNet-style script ends, with its kvstore never closed
    "scope": "def main():\n    kv = train()\n    print(json.dumps(result(kv)), flush=True)\nmain()\n",
    "module": "kv = train()\nprint(json.dumps(result(kv)), flush=True)\n",
    "sys_exit": "def main():\n    kv = train()\n    print(json.dumps(result(kv)), flush=True)\n    sys.exit(0)\nmain()\n",
    "close": "kv = train()\nprint(json.dumps(result(kv)), flush=True)\nkv.close()\n",
    # (the barrier: every worker has printed before W1's exit makes the launcher stop the others)
    "exception": "kv = train()\nprint(json.dumps(result(kv)), flush=True)\nkv.barrier()\n"
                 "if kv.rank == 1:\n    raise RuntimeError('boom')\n",
}
TRAIN = r'''
import json, sys, numpy as np, kvps
def train():
    kv = kvps.create("dist_sync")
    kv.init(0, np.zeros(4, np.float32))
    for step in range(3):
        kv.push(0, np.full(4, kv.rank + 1, np.float32))
        out = np.zeros(4, np.float32)
        kv.pull(0, out=out)
    return kv
def result(kv):
    out = np.zeros(4, np.float32); kv.pull(0, out=out)
    return {"rank": kv.rank, "x": out.tolist()}
'''


def _launch(tmp_path, script, n=3, s=2, timeout=60):
    path = tmp_path / "train.py"
    path.write_text(script)
    env = dict(os.environ, **dict(FAST_ENV, **SLOW_HEARTBEAT))
    start = time.monotonic()
    proc = subprocess.run([PY, "-m", "kvps.cli", "launch", "-n", str(n), "-s", str(s), "--", PY, str(path)],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    return proc, time.monotonic() - start


def _results(stdout):
    return [json.loads(line.split("] ", 1)[1]) for line in stdout.splitlines()
            if line.startswith("[W") and "] {" in line]


PHASES = r'''
import json, numpy as np, kvps
def train(phase):
    kv = kvps.create("dist_sync")              # each phase makes its own, and drops it on return
    kv.init("w", np.zeros(3, np.float32))
    kv.push("w", np.ones(3, np.float32))
    out = np.zeros(3, np.float32)
    kv.pull("w", out=out)
    print(json.dumps({"phase": phase, "w": out.tolist()}), flush=True)
train("pretrain")
train("finetune")
'''


def test_a_second_kvstore_after_leaving_the_job_fails_at_once_naming_why(tmp_path):
    """A kvstore dropped or closed has left the job for good; a script that makes one per phase
    fails at its second kvps.create with the reason, not after waiting for a scheduler that has gone."""
    proc, took = _launch(tmp_path, PHASES, n=2, s=1)
    assert proc.returncode != 0, proc.stdout
    assert _results(proc.stdout) == [{"phase": "pretrain", "w": [2.0] * 3}] * 2, proc.stdout
    assert "left it when its 'dist_sync' kvstore was closed (or dropped), and that job has ended" in proc.stdout, \
        proc.stdout
    assert "Create one kvstore for the whole script" in proc.stdout, proc.stdout
    assert took < 20, took          # the scheduler's heartbeat timeout here is 60 s


FORKS = r'''
import json, os, sys, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init("w", np.zeros(3, np.float32))
kv.push("w", np.ones(3, np.float32))
pid = os.fork()
if pid == 0:                # a helper the script forks, which ends with sys.exit (atexit hooks run)
    try:
        kv.push("w", np.ones(3, np.float32))
        print(json.dumps({"child": "pushed"}), flush=True)
    except kvps.KVPSError as exc:
        print(json.dumps({"child": str(exc)}), flush=True)
    sys.exit(0)
os.waitpid(pid, 0)
for step in range(3):
    kv.push("w", np.ones(3, np.float32))
    out = np.zeros(3, np.float32)
    kv.pull("w", out=out)
print(json.dumps({"w": out.tolist()}), flush=True)
'''


def test_a_child_the_script_forks_neither_leaves_the_job_nor_uses_the_kvstore(tmp_path):
    """A forked child's exit ran the kvstore's farewell: it left the job for its parent through
    connections and threads it does not have, and hung 30 s at exit, then the job never ended. Now
    a child does nothing at exit, and a call in it says whose kvstore it is."""
    proc, took = _launch(tmp_path, FORKS, n=2, s=1)
    assert proc.returncode == 0, proc.stdout
    lines = _results(proc.stdout)
    children = [line["child"] for line in lines if "child" in line]
    assert len(children) == 2 and all("a forked child cannot use it" in c for c in children), lines
    assert [line["w"] for line in lines if "w" in line] == [[2.0] * 3] * 2, lines
    assert took < 20, took


@pytest.mark.parametrize("ending", sorted(EXITS))
def test_a_kvstore_never_closed_leaves_the_job_at_once(tmp_path, ending):
    proc, elapsed = _launch(tmp_path, TRAIN + EXITS[ending])
    out = proc.stdout + proc.stderr
    results = _results(proc.stdout)
    assert sorted(r["rank"] for r in results) == [0, 1, 2], out
    assert all(r["x"] == [6.0] * 4 for r in results), out
    if ending == "exception":
        assert proc.returncode == 1 and "worker W1 exited with code 1" in proc.stdout, out
    else:
        assert proc.returncode == 0, out
        assert "failed" not in out and "dead" not in out, out
    # nothing waited for the 60 s heartbeat timeout
    assert elapsed < 30, (elapsed, out)


DROPPED = TRAIN + r'''
import gc
from kvps.kvstore import process
def main():
    kv = train()
    rank = kv.rank
    kv.push(0, np.zeros(4, np.float32))     # returns at once: its handle waits, unchecked, in the kvstore
    del kv                                  # dropped while the process goes on (a Ray actor, a notebook)
    gc.collect()
    print(json.dumps({"rank": rank, "left": not process.LIVE}), flush=True)
main()
'''


def test_a_kvstore_dropped_while_its_process_goes_on_leaves_the_job(tmp_path):
    """kvps.ray.run's workers are such processes: their kvstore must leave when the function returns."""
    proc, elapsed = _launch(tmp_path, DROPPED)
    results = _results(proc.stdout)
    assert proc.returncode == 0 and sorted(r["rank"] for r in results) == [0, 1, 2], proc.stdout + proc.stderr
    assert all(r["left"] for r in results), results
    assert elapsed < 30, elapsed


MIDWAY = r'''
import numpy as np, kvps
def main():
    kv = kvps.create("dist_sync")
    kv.init(0, np.zeros(4, np.float32))
    out = np.zeros(4, np.float32)
    for step in range(50):
        if kv.rank == 1 and step == 3:
            raise ValueError("a bug in worker 1's loss\nsecond line")
        kv.push(0, np.ones(4, np.float32))
        kv.pull(0, out=out)
main()
'''


def test_a_script_that_raises_midway_is_named_by_the_others_errors(tmp_path):
    """W1's script raises while W0 waits on a round that W1 will never push to: W0's error (and the
    scheduler's log) names W1 and the exception it died of, at once; the job fails."""
    proc, elapsed = _launch(tmp_path, MIDWAY, n=2, s=1)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "H: W1 left the job: its script failed: ValueError: a bug in worker 1's loss\\nsecond line" in out, out
    w0 = [line for line in out.splitlines() if line.startswith("[W0]") and "NodeFailure" in line]
    assert w0 and "worker W1 has left the job (its script failed: ValueError: a bug in worker 1's loss" in w0[-1], out
    assert elapsed < 30, (elapsed, out)


PUSH_SEMANTICS = r'''
import json, time, numpy as np, torch, kvps
kv = kvps.create("dist_sync")
r = kv.rank
kv.init(["a", "t"], [np.zeros(1000, np.float32), np.zeros(8, np.float32)])
grad = np.full(1000, r + 1, np.float32)
tgrad = torch.full((8,), float(r + 1))
start = time.monotonic()
kv.push("a", grad)
kv.push("t", tgrad)
returned = time.monotonic() - start
grad[:] = 1000.0                      # MXNet's contract: the pushed values are already taken
tgrad.fill_(1000.0)
if r == 1:
    time.sleep(1.0)                   # W0's pushes return while this worker has not pushed yet
a, t = np.zeros(1000, np.float32), torch.zeros(8)
kv.pull("a", out=a); kv.pull("t", out=t)
print(json.dumps({"rank": r, "returned_s": returned, "a": [float(a.min()), float(a.max())],
                  "t": t.tolist()}), flush=True)
'''


def test_push_returns_before_the_round_and_overwriting_changes_nothing(cluster):
    c = cluster(2, 1)
    results = c.run_workers(PUSH_SEMANTICS)
    for (line,) in results:
        assert line["a"] == [3.0, 3.0] and line["t"] == [3.0] * 8, line
    assert results[0][0]["returned_s"] < 0.5, results      # did not wait for W1's push (1 s later)
    assert c.wait_daemons() == [0, 0]


LOOPS = r'''
import json, numpy as np, kvps
kv = kvps.create("dist_sync")
r = kv.rank
shapes = [(3,), (700, 3), (5, 2), (2500,)]     # (700, 3) and (2500,) are split over both servers
keys = list(range(len(shapes)))
kv.init(keys, [np.zeros(s, np.float32) for s in shapes])
seen = []
for step in range(4):
    grads = [np.full(s, (r + 1) * (step + 1), np.float32) for s in shapes]
    for i, k in enumerate(keys):
        kv.push(k, grads[i], priority=-i)
        grads[i][...] = -1                     # reused at once, as a training loop does
    outs = [np.zeros(s, np.float32) for s in shapes]
    for i, k in enumerate(keys):
        kv.pull(k, out=outs[i], priority=-i)
    seen.append([[float(o.min()), float(o.max())] for o in outs])
ahead = sorted(kv._ahead._on)
# a key pushed twice without a pull in between is no longer pulled ahead, and stays right
for step in range(3):
    kv.push(0, np.full(3, r + 1, np.float32))
    kv.push(0, np.full(3, 10 * (r + 1), np.float32))
still = sorted(kv._ahead._on)
out = np.zeros(3, np.float32); kv.pull(0, out=out)
print(json.dumps({"seen": seen, "ahead": ahead, "after": out.tolist(), "still": still}), flush=True)
'''


def test_per_key_push_loop_then_pull_loop_is_exact_and_pulled_ahead(cluster):
    c = cluster(2, 2, env={"KVPS_BIGARRAY_BOUND": "2000"})
    for (line,) in c.run_workers(LOOPS):
        assert line["seen"] == [[[3.0 * (s + 1)] * 2] * 4 for s in range(4)], line
        assert line["ahead"] == [0, 1, 2, 3], line      # pulled ahead from the second step on
        assert line["after"] == [30.0] * 3 and 0 not in line["still"], line
    assert c.wait_daemons() == [0, 0, 0]


ERRORS = r'''
import json, time, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init(["w", "v"], [np.zeros(4, np.float32), np.zeros(4, np.float32)])
kv.barrier()
if kv.rank == 1:
    kv.close()                         # leaves: W0's round of "w" can never close
else:
    kv.push("w", np.ones(4, np.float32))            # returns at once
    time.sleep(1.5)
    try:
        kv.pull("v", out=np.zeros(4, np.float32))
        print(json.dumps({"raised": None}), flush=True)
    except kvps.KVPSError as exc:
        print(json.dumps({"raised": str(exc)}), flush=True)
    try:
        kv.wait_all()
        print(json.dumps({"again": None}), flush=True)
    except kvps.KVPSError as exc:
        print(json.dumps({"again": str(exc)}), flush=True)
'''


def test_the_error_of_a_returned_push_is_raised_by_the_next_call(cluster):
    c = cluster(2, 1)
    results = c.run_workers(ERRORS)
    raised = results[0][0]["raised"]
    assert raised and "push of key 'w'" in raised and "W1" in raised, results
    assert "end with kv.join()" in raised, raised         # what to do, when a worker left cleanly
    assert results[0][1]["again"] is None, results        # raised once, not lost, not repeated


ROW_SPARSE = r'''
import json, numpy as np, kvps
kv = kvps.create("dist_sync")
r = kv.rank
kv.init(["e", "big"], [np.zeros((8, 3), np.float32), np.zeros((40, 2), np.float32)])
kv.push("e", np.full((2, 3), r + 1, np.float32), row_ids=[np.array([1, 3]), np.array([3, 5])][r])
e = np.full((8, 3), -1, np.float32); kv.pull("e", out=e)
# "big" is split over both servers (KVPS_BIGARRAY_BOUND=40); W1 pushes rows of one part only;
# W0 gives row 20 twice (summed) and float ids, as MXNet's tests do
ids = np.array([0.0, 39.0, 20.0, 20.0], np.float32) if r == 0 else np.array([39])
kv.push("big", np.ones((ids.size, 2), np.float32), row_ids=ids)
big = np.full((40, 2), -1, np.float32); kv.row_sparse_pull("big", out=big, row_ids=np.arange(40))
kv.set_optimizer(kvps.optimizer.SGD(learning_rate=0.5, momentum=0.9, wd=0.1))
kv.init("w", np.ones((6, 2), np.float32))
for step in range(2):
    kv.push("w", np.ones((2, 2), np.float32), row_ids=[[1, 2], [2, 3]][r])
w = np.zeros((6, 2), np.float32); kv.pull("w", out=w)
print(json.dumps({"e": e[:, 0].tolist(), "big": big[:, 0].tolist(), "w": w[:, 0].tolist()}), flush=True)
'''


def test_row_sparse_push_sums_rows_and_updates_only_them(cluster):
    c = cluster(2, 2, env={"KVPS_BIGARRAY_BOUND": "40"})
    # SGD with momentum 0.9, wd 0.1, lr 0.5 on the touched rows only (MXNet's lazy update), 2 steps
    def sgd(grad, steps=2, w=1.0, m=0.0):
        for _ in range(steps):
            m = 0.9 * m - 0.5 * (grad + 0.1 * w)
            w += m
        return w
    for (line,) in c.run_workers(ROW_SPARSE):
        assert line["e"] == [0, 1, 0, 3, 0, 2, 0, 0], line
        assert line["big"] == [1] + [0] * 19 + [2] + [0] * 18 + [2], line
        expect = [1.0, sgd(1.0), sgd(2.0), sgd(1.0), 1.0, 1.0]
        assert line["w"] == pytest.approx(expect, rel=1e-6), line
    assert c.wait_daemons() == [0, 0, 0]


SURFACE = r'''
import json, numpy as np, kvps as mx
kv = mx.kv.create("Dist_Device_Sync")          # import kvps as mx keeps mx.kv.create
kv._barrier()
try:
    kv._set_updater(lambda key, pushed, stored: None)
    updater = None
except mx.KVPSError as exc:
    updater = str(exc)
capable = kv.is_capable("optimizer")
try:
    mx.allreduce(np.ones(3, np.float32))
    second = None
except mx.KVPSError as exc:
    second = str(exc)
kv.init(0, np.zeros((4, 2), np.float32))
kv.push(0, np.ones((4, 2), np.float32))
out = np.zeros((4, 2), np.float32)
kv.row_sparse_pull(0, out=out, row_ids=np.array([1.0, 3.0], np.float32))
a, b = np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32)
kv.row_sparse_pull(0, out=[a, b], row_ids=[np.array([0, 1]), np.array([3.0])])    # ids per out, as MXNet
per_out = [a[:, 0].tolist(), b[:, 0].tolist()]
try:
    kv.row_sparse_pull(0, out=out, row_ids=np.array([1.5], np.float32))
    bad = None
except ValueError as exc:
    bad = str(exc)
print(json.dumps({"type": kv.type, "capable": capable, "second": second, "updater": updater, "per_out": per_out, "rows": out[:, 0].tolist(), "bad": bad}),
      flush=True)
'''


def test_mxnet_names_and_forms(cluster):
    c = cluster(2, 1)
    for (line,) in c.run_workers(SURFACE):
        assert line["type"] == "Dist_Device_Sync" and line["capable"] is True, line
        assert "already worker" in line["second"] and "one kvstore per process" in line["second"], line
        assert "cannot run the updater function '<lambda>'" in line["updater"] and "set_optimizer" in \
            line["updater"], line
        assert line["rows"] == [0.0, 2.0, 0.0, 2.0], line
        assert line["per_out"] == [[2.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]], line
        assert "whole numbers" in line["bad"] and "1.5" in line["bad"], line
    assert c.wait_daemons() == [0, 0]


CONTRACT = r'''
import json, numpy as np, kvps
kv = kvps.create("dist_sync")
r, W, rate = kv.rank, kv.num_workers, 2
kv.init(["a", "a2"], [np.ones((2, 3), np.float32)] * 2)     # one array object for every key of a list
# float16 keys, and keys split over both servers
kv.init(["big", "h", "hbig"], [np.ones((30, 4), np.float32), np.ones((2, 3), np.float16), np.ones((30, 4), np.float16)])
kv.init(["rs", "hrs"], [np.ones((30, 4), np.float32), np.ones((30, 4), np.float16)])
kv.set_optimizer(kvps.optimizer.create("test", rescale_grad=rate))
sums = []
for i in range(3):
    for k, shape, dtype in [("a", (2, 3), np.float32), ("big", (30, 4), np.float32),
                            ("h", (2, 3), np.float16), ("hbig", (30, 4), np.float16)]:
        kv.push(k, np.ones(shape, dtype) * (r + 1))
        val = np.zeros(shape, dtype)
        kv.pull(k, out=val)
        sums.append(sorted(set(val.ravel().tolist())))
# row-sparse: worker r pushes row r and row 20 + r; pulls with 2-D float16 row ids, repeats
# included, into float32 outs (MXNet casts into the out's dtype)
rows = []
for k, dtype in [("rs", np.float32), ("hrs", np.float16)]:
    ids = np.array([r, 20 + r])
    kv.push(k, np.full((2, 4), r + 1, dtype), row_ids=ids)
    out = np.full((30, 4), -1, np.float32)
    kv.row_sparse_pull(k, out=out, row_ids=np.array([[0, 1], [21, 21], [29, 0]], np.float16))
    empty = np.full((30, 4), -1, np.float32)
    kv.row_sparse_pull(k, out=empty, row_ids=np.array([]))
    rows.append([out[:, 0].tolist(), float(np.abs(empty).sum())])
# 2-bit compression: residuals carry what is under the threshold until it adds up
kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
kv.init(["c", "cbig"], [np.zeros((2, 3), np.float32), np.zeros((30, 4), np.float32)])
compressed = []
for push in (0.4, 0.1, 0.2, 0.3):
    for k, shape in [("c", (2, 3)), ("cbig", (30, 4))]:
        kv.push(k, np.full(shape, push, np.float32))
        val = np.zeros(shape, np.float32)
        kv.pull(k, out=val)
        compressed.append(sorted(set(val.ravel().tolist())))
a2 = np.zeros((2, 3), np.float32)
kv.pull("a2", out=a2)
print(json.dumps({"sums": sums, "rows": rows, "compressed": compressed, "a2": a2.tolist()}), flush=True)
'''


def test_mxnets_dist_kvstore_contract(cluster):
    """What MXNet's own dist_sync kvstore tests check, as an MXNet user's script calls it: the 'test'
    optimizer's sums on float32 and float16 keys, small and split over servers, row-sparse pushes
    pulled by 2-D float row ids into an out of another float dtype, an empty row-id pull, and 2-bit
    compression's residuals."""
    c = cluster(2, 2, env={"KVPS_BIGARRAY_BOUND": "100"})
    W, rate = 2, 2
    for (line,) in c.run_workers(CONTRACT):
        assert line["a2"] == [[1.0] * 3] * 2, line
        assert line["sums"] == [[(W + 1) * W * rate / 2 * (i + 1) + 1] for i in range(3) for _ in range(4)], line
        # rows 0, 1 pushed by W0, W1 (1 + rate * (r + 1)); 21 by W1; 29 by nobody; the rest not asked
        expect = [3.0, 5.0] + [0.0] * 19 + [5.0] + [0.0] * 7 + [1.0]
        assert line["rows"] == [[expect, 0.0], [expect, 0.0]], line
        # 0.4 stays in the residual; + 0.1 reaches 0.5: sent; 0.2 stays; + 0.3 reaches 0.5 again
        threshold_step = 0.5 * rate * W
        assert line["compressed"] == [[0.0]] * 2 + [[threshold_step]] * 4 + [[2 * threshold_step]] * 2, line
    assert c.wait_daemons() == [0, 0, 0]


UNEVEN = r'''
import time, numpy as np, kvps
def main():
    kv = kvps.create("dist_sync:backup=1")
    shapes = [(256, 1024), (1000,), (512, 512), (10,)]      # big ones on the I/O thread, small on lanes
    for i, s in enumerate(shapes):
        kv.init(i, np.zeros(s, np.float32))
    kv.set_optimizer(kvps.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    ws = [np.zeros(s, np.float32) for s in shapes]
    for step in range(50):                      # the same steps, but a round closes without the slowest
        if kv.rank == 2:
            time.sleep(0.01)                    # the slowest by construction (else all may end together)
        for i, s in enumerate(shapes):
            kv.push(i, np.ones(s, np.float32), priority=-i)
        for i in range(len(shapes)):
            kv.pull(i, out=ws[i], priority=-i)
main()                                          # never closed, no join: the last rounds cannot close
'''


def test_calls_of_a_kvstore_never_closed_fail_with_the_jobs_reason_at_exit(tmp_path):
    """With backup workers the fastest worker ends first, and without join() the others' last rounds
    can never close: their pending pushes fail naming that, also those still waiting on a lane
    when the script ends (its sockets stay open until the kvstore's farewell has read them: no 'Bad
    file descriptor', no bare 'S0')."""
    proc, elapsed = _launch(tmp_path, UNEVEN, n=3, s=1)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "can never close" in out, out
    assert "Bad file descriptor" not in out and "failed: 'S0'" not in out, out
    assert elapsed < 45, (elapsed, out)


SLOW_WORKER = r"""
import json, time, numpy as np, kvps
def main():
    kv = kvps.create("dist_sync")
    a = np.ones(8, np.float32)
    kv.init("w", a)
    for step in range(3):
        if step == 1 and kv.rank == 0:
            time.sleep(3)               # an evaluation on worker 0 only
        kv.push("w", a)
        kv.pull("w", out=a)
    print(json.dumps({"w": float(a[0])}), flush=True)
main()
"""


def test_a_round_held_up_by_a_live_worker_is_named_by_its_server(cluster):
    job = cluster(2, 1, env={"KVPS_STALL_WARNING": "1"})
    out = job.run_workers(SLOW_WORKER, timeout=60)
    assert [lines[0]["w"] for lines in out] == [8.0, 8.0], out      # doubled three times: the job went on
    err = (job.dir / "S0.err").read_text()
    assert "S0: the sync round of key 'w' (round 2) has waited over 1 s for W0 (W1 pushed)" in err, err
