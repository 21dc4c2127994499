"""Checkpoints with real processes (docs/checkpoint.md): a dist_sync job with Adam (and a learning
rate schedule, which goes on from the saved update counts) saves, is killed
whole, and resumes with another number of servers, ending bit for bit where a job that never
stopped ends; so does one resumed from its periodic checkpoint; MXNet's save_optimizer_states /
load_optimizer_states work in dist mode; in dist_sync kv.save works called by worker 0 alone (as
MXNet and Horovod scripts save) or by every worker (one write per server), and kv.load made by one
worker alone says what it waits for and fails naming it; a truncated, corrupt, incomplete or mismatched checkpoint
is refused, naming the file and what is wrong, and the job goes on."""
import json

from harness import wait_for

TRAIN = r'''
import hashlib, json, os, time, numpy as np, ml_dtypes, kvps
kv = kvps.create("dist_sync")
r = kv.rank
SHAPES = {"big": ((3000, 4), np.float32), "small": ((7,), np.float32), "half": ((500, 3), ml_dtypes.bfloat16)}
keys = list(SHAPES)
kv.init(keys, [np.full(s, 0.5, d) for s, d in SHAPES.values()])       # KVPS_RESUME: replaced by the saved state
# the rate halves every 2 updates: a server that resumed with the wrong update count steps wrongly
kv.set_optimizer(kvps.optimizer.Adam(learning_rate=0.01, rescale_grad=1.0 / kv.num_workers,
                                     lr_scheduler=kvps.lr_scheduler.FactorScheduler(step=2, factor=0.5)))
start, stop, save_at = int(os.environ["START"]), int(os.environ["STOP"]), int(os.environ.get("SAVE_AT", "-1"))
outs = [np.zeros(s, d) for s, d in SHAPES.values()]

def train(start):
    for step in range(start, stop):
        if step == save_at:
            kv.save(os.environ["CKPT"])
            print(json.dumps({"saved": step}), flush=True)
            time.sleep(120)             # the test kills the whole job here
        rng = np.random.default_rng([step, r])
        kv.push(keys, [rng.standard_normal(s).astype(d) for s, d in SHAPES.values()])
        kv.pull(keys, out=outs)
    print(json.dumps({"digest": {k: hashlib.sha256(o.tobytes()).hexdigest() for k, o in zip(keys, outs)}}),
          flush=True)
train(start)
if os.environ.get("AGAIN"):             # then back to another checkpoint, by kv.load, and on from there
    kv.load(os.environ["AGAIN"])
    train(int(os.environ["AGAIN_AT"]))
'''

ENV = {"KVPS_BIGARRAY_BOUND": "1000"}      # big and half are split over every server


def _digests(results, runs=1):
    lines = [line for out in results for line in out if "digest" in line]
    assert len(lines) == runs * len(results), results
    return lines


def test_resume_with_another_server_count_is_bit_exact(cluster, tmp_path):
    periodic = tmp_path / "periodic"
    # the job that never stops (its periodic checkpoints, every 2 steps, must not change a bit)
    ref = cluster(2, 2, env=dict(ENV, KVPS_CHECKPOINT_DIR=str(periodic), KVPS_CHECKPOINT_EVERY="2"))
    want = _digests(ref.run_workers(TRAIN, timeout=90, env={"START": "0", "STOP": "6"}))
    assert want[0] == want[1]
    manifest = json.loads((periodic / "manifest.json").read_text())
    # due every 2 steps, taken at a later step when the last one is still being written
    assert manifest["step"] in (2, 3, 4, 5) and manifest["num_servers"] == 2, manifest
    assert sorted(p.name for p in periodic.iterdir()) == sorted(["manifest.json"] +
                                                               [f["file"] for f in manifest["files"]])

    # the job that saves after 3 steps and is killed, every process, with kill -9
    ckpt = tmp_path / "ckpt"
    job = cluster(2, 2, env=ENV)
    job.spawn_workers(TRAIN, env={"START": "0", "STOP": "6", "SAVE_AT": "3", "CKPT": str(ckpt)})
    wait_for(lambda: all(any("saved" in line for line in job.output(f"W{r}")) for r in range(2)), 60,
             f"both workers to save\n{job.logs()}")
    job.close()
    # resumed on 3 servers (the keys are re-sharded on load), then, in the same job, kv.load of the
    # periodic checkpoint (saved by 2 servers) and on from its step
    again = cluster(2, 3, env=dict(ENV, KVPS_RESUME=str(ckpt)))
    got = _digests(again.run_workers(TRAIN, timeout=90, env={"START": "3", "STOP": "6", "AGAIN": str(periodic),
                                                            "AGAIN_AT": str(manifest["step"])}), runs=2)
    assert [g["digest"] for g in got] == [want[0]["digest"]] * 4, (got, want)


CORRUPT = r'''
import json, os, shutil, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init(["w", "v"], [np.ones((3000, 4), np.float32), np.ones(5, np.float32)])
kv.set_optimizer(kvps.optimizer.Adam(learning_rate=0.1))
kv.push(["w", "v"], [np.ones((3000, 4), np.float32), np.ones(5, np.float32)])
saved = np.zeros((3000, 4), np.float32)
kv.pull("w", out=saved)
base = os.environ["CKPT"]
kv.save(base)
manifest = json.load(open(os.path.join(base, "manifest.json")))
shard = manifest["files"][0]["file"]

def truncate(p):
    with open(os.path.join(p, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(p, shard)) - 10)

def flip(p):
    with open(os.path.join(p, shard), "r+b") as f:
        f.seek(-7, 2); b = f.read(1); f.seek(-7, 2); f.write(bytes([b[0] ^ 0xFF]))

def edit(field, value):
    def change(p):
        m = json.load(open(os.path.join(p, "manifest.json")))
        [k for k in m["keys"] if k["key"] == "w"][0][field] = value
        json.dump(m, open(os.path.join(p, "manifest.json"), "w"))
    return change

results = {}
for name, mutate in [("truncated", truncate), ("checksum", flip),
                     ("no_manifest", lambda p: os.unlink(os.path.join(p, "manifest.json"))),
                     ("shape", edit("shape", [3000, 5])), ("dtype", edit("dtype", "float16"))]:
    path = base + "-" + name
    shutil.copytree(base, path)
    mutate(path)
    try:
        kv.load(path)
        results[name] = "loaded"
    except Exception as e:
        results[name] = f"{type(e).__name__}: {e}"
kv.push(["w", "v"], [np.ones((3000, 4), np.float32), np.ones(5, np.float32)])    # the job goes on
kv.load(base)                                                                     # and loads a whole one
now = np.zeros((3000, 4), np.float32)
kv.pull("w", out=now)
print(json.dumps({"results": results, "shard": shard, "restored": bool((now == saved).all())}), flush=True)
'''


def test_corrupt_or_mismatched_checkpoint_refused(cluster, tmp_path):
    c = cluster(1, 2, env=ENV)
    ((line,),) = c.run_workers(CORRUPT, timeout=90, env={"CKPT": str(tmp_path / "ck")})
    r, shard = line["results"], line["shard"]
    assert line["restored"], line
    assert f"ck-truncated/{shard} has" in r["truncated"] and "the manifest says" in r["truncated"], r
    assert f"ck-checksum/{shard}: tensor" in r["checksum"] and "fails its CRC-32" in r["checksum"], r
    assert r["no_manifest"].startswith("CheckpointError") and "ck-no_manifest/manifest.json is missing" in \
        r["no_manifest"], r
    assert "holds key 'w' as float32 (3000, 5); the job initialised it as float32 (3000, 4)" in r["shape"], r
    assert "holds key 'w' as float16 (3000, 4); the job initialised it as float32 (3000, 4)" in r["dtype"], r


OPT_SAVE = r'''
import hashlib, json, os, numpy as np, kvps
kv = kvps.create("dist_sync")
grads = [np.random.default_rng(i).standard_normal((3000, 4)).astype(np.float32) for i in range(3)]
w = np.zeros((3000, 4), np.float32)
if os.environ.get("PHASE") == "save":
    kv.init("w", np.ones((3000, 4), np.float32))
    kv.set_optimizer(kvps.optimizer.Adam(learning_rate=0.05))
    for g in grads[:2]:
        kv.push("w", g); kv.pull("w", out=w)
    if os.environ.get("EVERY"):     # every worker saves, to a path of its own and to one they share
        kv.save_optimizer_states(os.environ["STATES"] + str(kv.rank))
    kv.save_optimizer_states(os.environ["STATES"])
    np.save(os.environ["WEIGHTS"], w, allow_pickle=False)
else:
    kv.init("w", np.load(os.environ["WEIGHTS"], allow_pickle=False))   # a model checkpoint's weights
    kv.set_optimizer(kvps.optimizer.Adam(learning_rate=0.05))
    kv.load_optimizer_states(os.environ.get("FROM", os.environ["STATES"]))
kv.push("w", grads[2]); kv.pull("w", out=w)
print(json.dumps({"digest": hashlib.sha256(w.tobytes()).hexdigest()}), flush=True)
'''


def test_mxnet_optimizer_states_in_dist_mode(cluster, tmp_path):
    env = {"STATES": str(tmp_path / "states"), "WEIGHTS": str(tmp_path / "w.npy")}
    ((want,),) = cluster(1, 1, env=ENV).run_workers(OPT_SAVE, timeout=60, env=dict(env, PHASE="save"))
    ((got,),) = cluster(1, 2, env=ENV).run_workers(OPT_SAVE, timeout=60, env=dict(env, PHASE="load"))
    assert got == want


def test_every_worker_saving_optimizer_states_at_once(cluster, tmp_path):
    """Gluon's trainer.save_states and unguarded scripts call save_optimizer_states on every worker:
    the servers write the saves one after another and each is a complete checkpoint."""
    states = tmp_path / "states"
    env = {"STATES": str(states), "WEIGHTS": str(tmp_path / "w.npy")}
    want = cluster(2, 2, env=ENV).run_workers(OPT_SAVE, timeout=60, env=dict(env, PHASE="save", EVERY="1"))
    assert want[0] == want[1], want
    for source in (states, tmp_path / "states1"):
        got = cluster(2, 1, env=ENV).run_workers(OPT_SAVE, timeout=60, env=dict(env, PHASE="load", FROM=str(source)))
        assert got == want, source


SLOW_SAVE = r'''
import hashlib, json, os, time, numpy as np, kvps
from kvps.wire import protocol
kv = kvps.create("dist_sync")
r = kv.rank
if r == 0:
    # The I/O thread is slow to send SAVE (as on a loaded machine), while this thread's small pushes
    # go on its own connections (kvps/wire/lane.py): the push after a periodic SAVE must still
    # reach the servers after it.
    van = kv._node.van
    send_now = van._send_now
    def slow(peer, frames, done):
        header = protocol.decode(frames[0])
        if header.op == protocol.Op.SAVE and not header.meta.get("taken"):
            time.sleep(0.3)
        send_now(peer, frames, done)
    van._send_now = slow
kv.init(["a", "b"], [np.zeros(64, np.float32), np.zeros(32, np.float32)])
outs = [np.zeros(64, np.float32), np.zeros(32, np.float32)]
seen = {}
for step in range(int(os.environ["STEPS"])):
    seen[str(step)] = hashlib.sha256(b"".join(o.tobytes() for o in outs)).hexdigest()   # the state at this boundary
    kv.push(["a", "b"], [np.full(64, step + 1.0 + r, np.float32), np.full(32, 2.0 * step - r, np.float32)])
    kv.pull(["a", "b"], out=outs)
print(json.dumps({"seen": seen}), flush=True)
'''

RESUMED = r'''
import hashlib, json, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init(["a", "b"], [np.zeros(64, np.float32), np.zeros(32, np.float32)])
outs = [np.zeros(64, np.float32), np.zeros(32, np.float32)]
kv.pull(["a", "b"], out=outs)
print(json.dumps({"resumed": hashlib.sha256(b"".join(o.tobytes() for o in outs)).hexdigest()}), flush=True)
'''


def test_periodic_checkpoint_is_taken_at_its_step_boundary(cluster, tmp_path):
    """Worker 0's push after a periodic SAVE goes on its own connection (a lane) and could reach a
    server before SAVE: the checkpoint would then hold the next round under this step's number."""
    periodic = tmp_path / "periodic"
    env = dict(ENV, KVPS_CHECKPOINT_DIR=str(periodic), KVPS_CHECKPOINT_EVERY="2")
    job = cluster(2, 2, env=env)
    out = job.run_workers(SLOW_SAVE, timeout=90, env={"STEPS": "5"})
    seen = [line["seen"] for line in out[0] if "seen" in line][0]
    step = json.loads((periodic / "manifest.json").read_text())["step"]
    assert step in (2, 4), step
    ((line,), _) = cluster(2, 2, env=dict(ENV, KVPS_RESUME=str(periodic))).run_workers(RESUMED, timeout=60)
    assert line["resumed"] == seen[str(step)], (step, seen)


ONE_OR_EVERY = r"""
import hashlib, json, os, numpy as np, kvps

def digest(outs):
    return hashlib.sha256(b"".join(o.tobytes() for o in outs)).hexdigest()

def main():
    kv = kvps.create("dist_sync")           # made in main() and never closed, as MXNet scripts do
    keys = list(range(6))
    kv.init(keys, [np.zeros(50 * (k + 1), np.float32) for k in keys])
    kv.set_optimizer(kvps.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    outs = [np.zeros(50 * (k + 1), np.float32) for k in keys]
    start = int(os.environ.get("START", "0"))
    if start:                               # resumed (KVPS_RESUME): the saved weights first
        kv.pull(keys, out=outs)
        print(json.dumps({"resumed": digest(outs)}), flush=True)
    seen = {}
    for step in range(start, 6):
        seen[step] = digest(outs)
        if step == 2 and kv.rank == 0 and not start:
            kv.save(os.environ["ONE"])      # worker 0 alone, while the other pushes on
        if step == 4 and not start:
            kv.save(os.environ["EVERY"])    # every worker
        for k in keys:                      # MXNet's per-key loops
            kv.push(k, np.full(50 * (k + 1), step + 1.0 + kv.rank, np.float32), priority=-k)
        for k in keys:
            kv.pull(k, out=outs[k], priority=-k)
    print(json.dumps({"seen": seen, "final": digest(outs)}), flush=True)

main()
"""


def test_dist_sync_save_by_worker_0_alone_or_by_every_worker(cluster, tmp_path):
    """MXNet and Horovod scripts save under `if rank == 0`: in dist_sync kv.save needs no other worker
    (their rounds wait for the saver), and is the state after the saver's step; every worker saving
    at one step boundary writes each shard once."""
    one, every = tmp_path / "one", tmp_path / "every"
    job = cluster(2, 2, env=dict(ENV, KVPS_LOG_LEVEL="INFO"))
    out = job.run_workers(ONE_OR_EVERY, timeout=90, env={"ONE": str(one), "EVERY": str(every)})
    (line0,), (line1,) = out
    assert line0["final"] == line1["final"] and line0["seen"] == line1["seen"], out
    for s in range(2):
        wrote = [line for line in (job.dir / f"S{s}.err").read_text().splitlines() if ": wrote save-" in line]
        assert len(wrote) == 2, wrote           # one shard for each checkpoint, though two workers saved
    for path, step in ((one, 2), (every, 4)):
        resumed = cluster(2, 1, env=dict(ENV, KVPS_RESUME=str(path))).run_workers(
            ONE_OR_EVERY, timeout=90, env={"START": str(step)})
        for lines in resumed:
            assert lines[0]["resumed"] == line0["seen"][str(step)], (path, lines)
            assert lines[1]["final"] == line0["final"], (path, lines)    # the momentum was saved too


LOAD_ALONE = r"""
import os, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init(0, np.ones(10, np.float32))
kv.save(os.environ["CKPT"])
a = np.zeros(10, np.float32)
for step in range(3):
    kv.push(0, a)
    kv.pull(0, out=a)
    if step == 1 and kv.rank == 0:
        kv.load(os.environ["CKPT"])         # a collective, made by worker 0 alone
"""


def test_a_collective_made_by_one_worker_says_so_and_fails_naming_it(cluster, tmp_path):
    job = cluster(2, 1)
    procs = job.spawn_workers(LOAD_ALONE, env={"CKPT": str(tmp_path / "ck"), "KVPS_TIMEOUT": "4"})
    job.wait(procs, 60)
    assert [p.returncode for p in procs] == [1, 1], job.logs()
    w0 = (job.dir / "W0.err").read_text()
    assert "W0: kv.load has waited 2 s for the other workers: in a sync job it is a collective" in w0, w0
    assert "KVTimeoutError: W0: kv.load waited 4 s (KVPS_TIMEOUT) for the other workers to call it too" in w0, w0
