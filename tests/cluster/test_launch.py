"""`kvps launch`, MXNet-style DMLC_* start-up, and server plugins, on real processes."""
import json
import os
import subprocess
import time

from harness import FAST_ENV, PY, read_ready

WORKER = r'''
import json, sys, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init("x", np.zeros(3, np.float32))
kv.push("x", np.full(3, kv.rank + 1, np.float32))
out = np.zeros(3, np.float32); kv.pull("x", out=out)
print(json.dumps({"rank": kv.rank, "x": out.tolist()}), flush=True)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 and kv.rank == 1 else 0)
'''


def _launch(tmp_path, args, timeout=60):
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    env = dict(os.environ, **FAST_ENV)
    start = time.monotonic()
    proc = subprocess.run([PY, "-m", "kvps.cli", "launch", *args[:-1], "--", PY, str(script), *args[-1]],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    return proc, time.monotonic() - start


def test_launch_runs_a_job_and_prefixes_output(tmp_path):
    proc, _ = _launch(tmp_path, ["-n", "2", "-s", "2", []])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    results = [json.loads(line.split("] ", 1)[1]) for line in lines if line.startswith("[W")]
    assert [r["x"] for r in sorted(results, key=lambda r: r["rank"])] == [[3.0] * 3, [3.0] * 3]
    assert any(line.startswith("[W0] {") for line in lines) and any(line.startswith("[W1] {") for line in lines)


def test_launch_returns_first_failing_worker_code(tmp_path):
    proc, elapsed = _launch(tmp_path, ["-n", "2", "-s", "1", ["7"]])
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert "worker W1 exited with code 7" in proc.stdout
    assert elapsed < 30


def test_ssh_dry_run_prints_commands(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA\n# comment\nnodeB\n")
    proc = subprocess.run([PY, "-m", "kvps.cli", "launch", "-n", "3", "-s", "2", "--launcher", "ssh", "-H",
                           str(hostfile), "--dry-run", "--env", "FOO=bar", "--", "python", "train.py", "--lr", "0.1"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("[H] ") and "scheduler" in lines[0] and "--port 9091" in lines[0]
    assert [line.split()[0] for line in lines] == ["[H]", "[S0]", "[S1]", "[W0]", "[W1]", "[W2]"]
    assert "nodeA" in lines[1] and "nodeB" in lines[2] and "nodeA" in lines[5]
    assert "KVPS_ROLE=worker" in lines[3] and "KVPS_RANK=2" in lines[5] and "FOO=bar" in lines[4]
    assert "train.py --lr 0.1" in lines[3]


def test_mxnet_style_dmlc_environment(tmp_path):
    """Servers and workers started only with MXNet's DMLC_* variables, servers by `import kvps`."""
    env = dict(os.environ, **FAST_ENV)
    for k in [k for k in env if k.startswith("KVPS_") and k not in FAST_ENV]:
        env.pop(k)
    procs = []
    try:
        sched = subprocess.Popen([PY, "-m", "kvps.cli", "scheduler", "--port", "0", "-n", "2", "-s", "1"], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        procs.append(sched)
        host, port = read_ready(sched, 30, "the scheduler").split(":")
        dmlc = dict(env, DMLC_PS_ROOT_URI=host, DMLC_PS_ROOT_PORT=port, DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="1")
        procs.append(subprocess.Popen([PY, "-c", "import kvps"], env=dict(dmlc, DMLC_ROLE="server"),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        script = tmp_path / "w.py"
        script.write_text(WORKER)
        workers = [subprocess.Popen([PY, str(script)], env=dict(dmlc, DMLC_ROLE="worker"), stdout=subprocess.PIPE,
                                    text=True) for _ in range(2)]
        procs += workers
        outs = [w.communicate(timeout=60)[0] for w in workers]
        assert [w.returncode for w in workers] == [0, 0]
        assert all(json.loads(o.splitlines()[-1])["x"] == [3.0] * 3 for o in outs)
        assert sched.wait(30) == 0 and procs[1].wait(30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


PLUGIN = '''
from kvps.ps.rules import UpdateRule

class Scaled(UpdateRule):
    name = "scaled"
    defaults = {"factor": 1.0}
    def apply(self, weight, grad, state, count):
        weight += self.params["factor"] * grad

def kvps_register(registry):
    registry.add(Scaled)
'''


def test_server_plugin_adds_an_update_rule(cluster, tmp_path):
    (tmp_path / "my_rules.py").write_text(PLUGIN)
    c = cluster(2, 1, env={"PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")},
                server_args=["--plugin", "my_rules"])
    script = ('import json, numpy as np, kvps\n'
              'kv = kvps.create("dist_sync")\n'
              'kv.init("w", np.ones(4, np.float32))\n'
              'kv.set_optimizer(kvps.optimizer.Optimizer("scaled", factor=10.0))\n'
              'out = np.zeros(4, np.float32)\n'
              'kv.pushpull("w", np.full(4, kv.rank + 1, np.float32), out=out)\n'
              'print(json.dumps(out.tolist()), flush=True)\n')
    results = c.run_workers(script)
    assert results == [[[31.0] * 4], [[31.0] * 4]]     # 1 + 10 * (1 + 2)
