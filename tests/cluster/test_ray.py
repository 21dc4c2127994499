"""`kvps launch --launcher ray` and `kvps.ray.run` on a real local Ray cluster (one node, started
by the job: ray.init). One short job per test, since each Ray start costs several seconds;
`-m "not ray"` deselects them. Skips without Ray (pip install 'kvps[ray]').

The last test runs a two-node Ray cluster on emulated hosts (root, network namespaces)."""
import json
import os
import signal
import subprocess
import textwrap
import time

import pytest

from harness import FAST_ENV, PY, wait_for

pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvps[ray]')")
pytestmark = pytest.mark.ray

WORKER = r'''
import json, sys, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init("x", np.zeros(3, np.float32))
kv.push("x", np.full(3, kv.rank + 1, np.float32))
out = np.zeros(3, np.float32); kv.pull("x", out=out)
print(json.dumps({"rank": kv.rank, "x": out.tolist()}), flush=True)
sys.exit(3 if kv.rank == 1 else 0)
'''
HANG = r'''
import os, time, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init("x", np.zeros(3, np.float32))
print("training", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    kv.pushpull("x", np.ones(3, np.float32), out=np.zeros(3, np.float32))
    time.sleep(0.05)
'''
LAUNCH = [PY, "-m", "kvps.cli", "launch", "--launcher", "ray", "-n", "2", "-s", "2", "--cpus-per-process", "0.25"]


def _env(**extra):
    # RAY_ADDRESS unset: the job starts (and stops) a Ray instance of its own
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return dict(env, **FAST_ENV, RAY_DISABLE_USAGE_STATS="1", **extra)


def test_launch_streams_prefixed_output_and_returns_the_failing_workers_code(tmp_path):
    (tmp_path / "train.py").write_text(WORKER)
    proc = subprocess.run(LAUNCH + ["--", PY, "train.py"], env=_env(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=150)
    out = proc.stdout
    assert proc.returncode == 3, out + proc.stderr
    lines = out.splitlines()
    results = sorted((json.loads(line.split("] ", 1)[1]) for line in lines if line.startswith("[W") and "] {" in line),
                     key=lambda r: r["rank"])
    assert results == [{"rank": 0, "x": [3.0] * 3}, {"rank": 1, "x": [3.0] * 3}], out
    assert any(line.startswith("[S0] READY ") for line in lines) and any(line.startswith("[S1] READY ") for line in lines)
    assert any(line.startswith("[launch] scheduler ready at ") for line in lines)
    assert any(line.startswith("[launch] worker W1 ") and line.endswith("exited with code 3; stopping the job")
               for line in lines), out


def test_ctrl_c_stops_every_process_of_the_job(tmp_path):
    (tmp_path / "train.py").write_text(HANG)
    mark = f"KVPS_TEST_MARK={os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen(LAUNCH + ["--env", mark, "--", PY, "train.py"], env=_env(), cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    seen = []
    try:
        for line in proc.stdout:                   # bounded: the workers stop by themselves after 60 s
            seen.append(line)
            if sum(s.startswith(("[W0] training", "[W1] training")) for s in seen) == 2:
                break
        nodes = _processes_with(mark.encode())
        assert len(nodes) == 5, "".join(seen)           # H, S0, S1, W0, W1
        os.kill(proc.pid, signal.SIGINT)                # what Ctrl-C sends
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, "".join(seen) + rest
        wait_for(lambda: not _processes_with(mark.encode()), 15, "the job's processes to stop")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _processes_with(mark):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if mark in env and any(e.startswith(b"KVPS_ROLE=") for e in env):
                found.append(int(entry))
    return found


def test_kvps_ray_run_trains_in_ray_actors(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent('''
        import json, numpy as np, kvps, kvps.ray

        def train():
            kv = kvps.create("dist_sync")
            kv.init("w", np.zeros(4, np.float32))
            kv.set_optimizer(kvps.optimizer.SGD(learning_rate=0.5))
            out = np.zeros(4, np.float32)
            for _ in range(3):
                kv.pushpull("w", np.full(4, kv.rank + 1, np.float32), out=out)
            return {"rank": kv.rank, "workers": kv.num_workers, "w": out.tolist()}

        print(json.dumps(kvps.ray.run(train, num_workers=2, num_servers=1, cpus_per_worker=0.25)), flush=True)
    '''))
    proc = subprocess.run([PY, str(script)], env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    # three rounds of SGD on the summed push (1 + 2): w = -3 * 0.5 * 3
    assert results == [{"rank": r, "workers": 2, "w": [-4.5] * 4} for r in (0, 1)]


def _namespace_pids(net):
    out = []
    for host in net.hosts:
        proc = subprocess.run(["ip", "netns", "pids", net.namespace(host)], capture_output=True, text=True, timeout=20)
        out += [int(p) for p in proc.stdout.split()]
    return out


def test_a_job_spans_ray_nodes_on_emulated_hosts(tmp_path):
    """A Ray head on h0 (1 CPU) and a worker node on h1 (2 CPUs), each with its own 198.18 address:
    the job's 2.1 CPUs of bundles cannot fit on one node, so the SPREAD placement group puts its
    processes on both, and the job still gets the right results."""
    from kvps.tools.emulate.network import Network, permitted
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    ok, why = permitted()
    if not ok:
        pytest.skip(why)
    import shutil
    import tempfile
    ray_cli = os.path.join(os.path.dirname(PY), "ray")
    env = _env(RAY_AUTH_MODE="token")      # the head, the node and the driver: one token (~/.ray/auth_token)
    # Ray's files (and the address file `ray start` leaves for ray.init) in a directory of ours, not
    # /tmp/ray; short, since Ray's unix socket paths live under it.
    temp = tempfile.mkdtemp(prefix="kvray", dir="/tmp")
    (tmp_path / "train.py").write_text(WORKER.replace("sys.exit(3 if kv.rank == 1 else 0)", ""))
    with Network().up(2) as net:
        head, node = net.address("h0"), net.address("h1")
        try:
            for host, argv in (("h0", ["--head", "--port", "6379", "--num-cpus", "1", "--include-dashboard=false"]),
                               ("h1", ["--address", f"{head}:6379", "--num-cpus", "2"])):
                log = tmp_path / f"ray-{host}.log"
                net.popen(host, [ray_cli, "start", "--block", "--disable-usage-stats", "--temp-dir", temp,
                                 "--node-ip-address", net.address(host), *argv], env=env, stdout=open(log, "w"),
                          stderr=subprocess.STDOUT)
                wait_for(lambda: "will now block" in log.read_text(), 60, f"the Ray node on {host}")
            proc = net.popen("h0", LAUNCH[:-1] + ["0.5", "--address", f"{head}:6379", "--", PY, "train.py"], env=env,
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            out, _ = proc.communicate(timeout=150)
            assert proc.returncode == 0, out
            placed = next(line for line in out.splitlines() if line.startswith("[launch] placed "))
            where = dict(item.split(" on ") for item in placed[len("[launch] placed "):].split(", "))
            assert sorted(where) == ["H", "S0", "S1", "W0", "W1"] and set(where.values()) == {head, node}, out
            results = [json.loads(line.split("] ", 1)[1]) for line in out.splitlines() if "] {" in line]
            assert sorted(r["rank"] for r in results) == [0, 1] and all(r["x"] == [3.0] * 3 for r in results), out
        finally:
            net.stop()
            for pid in _namespace_pids(net):           # what Ray left running on our hosts
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            shutil.rmtree(temp, ignore_errors=True)
