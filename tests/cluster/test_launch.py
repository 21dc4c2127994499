"""`kvps launch`, MXNet-style DMLC_* start-up, and server plugins, on real processes."""
import json
import os
import shlex
import subprocess
import time

import pytest

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
    proc, elapsed = _launch(tmp_path, ["-np", "2", "-s", "1", ["7"]])     # horovodrun's spelling of -n
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert "worker W1 exited with code 7" in proc.stdout
    assert elapsed < 30


def test_ssh_dry_run_prints_commands(tmp_path):
    """The scheduler binds --host and is told the job's size; each remote node's command and
    variables go on its tether's stdin, never on its command line."""
    from kvps.launch import tether
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA\n# comment\nnodeB\n")
    proc = subprocess.run([PY, "-m", "kvps.cli", "launch", "-n", "3", "-s", "2", "--launcher", "ssh", "-H",
                           str(hostfile), "--dry-run", "--host", "10.0.0.5", "--python", "/opt/py/bin/python3",
                           "--env", "FOO=bar", "--", "python", "train.py", "--lr", "0.1"],
                          capture_output=True, text=True, timeout=30, env=dict(os.environ, KVPS_LOG_LEVEL="INFO"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["[H]", "[S0]", "[S1]", "[W0]", "[W1]", "[W2]"]
    assert lines[0].endswith("scheduler --port 9091 -n 3 -s 2 --host 10.0.0.5")
    hosts = [shlex.split(line.split(" <<< ")[0])[-2] for line in lines[1:]]
    assert hosts == ["nodeA", "nodeB", "nodeA", "nodeB", "nodeA"]     # servers in turn, workers carry on
    specs = [tether.decode(shlex.split(line.split(" <<< ")[1])[0].encode()) for line in lines[1:]]
    assert specs[0][0] == ["/opt/py/bin/python3", "-m", "kvps.cli", "server"]
    assert specs[2][0] == ["python", "train.py", "--lr", "0.1"]
    for (argv, env), name in zip(specs, ["S0", "S1", "W0", "W1", "W2"]):
        assert env["KVPS_ROLE"] == {"S": "server", "W": "worker"}[name[0]] and env["KVPS_RANK"] == name[1]
        assert env["KVPS_SCHEDULER"] == "10.0.0.5:9091" and env["FOO"] == "bar"
        assert (env["KVPS_NUM_WORKERS"], env["KVPS_NUM_SERVERS"], env["KVPS_LOG_LEVEL"]) == ("3", "2", "INFO")
    assert all("KVPS_" not in line.split(" <<< ")[0] for line in lines[1:])


def test_ssh_scheduler_address_from_the_interface_or_a_clear_error():
    import pytest
    from kvps.config import Config
    from kvps.errors import ConfigError
    from kvps.launch.ssh import scheduler_host
    hosts = ["unresolvable.invalid"]
    assert scheduler_host(hosts, interface=Config.from_env({"DMLC_INTERFACE": "lo"}).interface) == "127.0.0.1"
    assert scheduler_host(hosts, host="10.1.2.3", interface="lo") == "10.1.2.3"            # --host wins
    assert scheduler_host(["localhost"]) == "127.0.0.1"
    with pytest.raises(ConfigError, match="KVPS_INTERFACE='nope9': that interface does not exist here"):
        scheduler_host(hosts, interface="nope9")
    with pytest.raises(ConfigError, match="pass --host ADDR or set KVPS_INTERFACE"):
        scheduler_host(hosts)


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


LOOP = r'''
import sys, time, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init("x", np.zeros(3, np.float32))
print("training", flush=True)
out = np.zeros(3, np.float32)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    kv.pushpull("x", np.ones(3, np.float32), out=out)
    time.sleep(0.05)
'''


def _node_pid(parent, role, rank):
    """The pid of the child of `parent` that runs as node role/rank (read from /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(item.partition(b"=")[::2] for item in f.read().split(b"\0") if item)
        except (OSError, ValueError):
            continue
        if env.get(b"KVPS_ROLE") == role.encode() and env.get(b"KVPS_RANK") == str(rank).encode():
            return int(entry)
    return None


def test_launch_reports_a_daemon_killed_by_a_signal_at_once(tmp_path):
    """kill -9 of a server: `kvps launch` names it and exits 137 well before the heartbeat timeout."""
    import signal as sig
    from harness import wait_for
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    env = dict(os.environ, **dict(FAST_ENV, KVPS_HEARTBEAT_TIMEOUT="60"))   # only the launcher can notice
    proc = subprocess.Popen([PY, "-m", "kvps.cli", "launch", "-n", "2", "-s", "2", "--", PY, str(script)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    lines = []
    try:
        for line in proc.stdout:                     # bounded: the workers stop by themselves after 60 s
            lines.append(line)
            if line.startswith("[W1] training"):
                break
        wait_for(lambda: _node_pid(proc.pid, "server", 1), 10, "S1's pid")
        os.kill(_node_pid(proc.pid, "server", 1), sig.SIGKILL)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=30)
        elapsed = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = "".join(lines) + out
    assert proc.returncode == 137, text
    assert "[launch] S1 was killed by SIGKILL while workers were running; stopping the job" in text
    assert elapsed < 15, f"{elapsed:.1f} s from the kill to the launcher's exit\n{text}"


def test_a_job_runs_from_the_rendered_kubernetes_specs(tmp_path):
    """The rendered containers' commands and env (downward API and $(VAR) filled in as a kubelet
    would, the Secret's files where it mounts them, the scheduler Service's name pointed at
    127.0.0.1) are enough to run a real job, with CurveZMQ on since the nodes are given keys."""
    import base64
    from kvps.launch import k8s
    from kvps.supervisor import Supervisor
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    docs = k8s.render(2, 2, "img:1", ["python", str(script)], name="t", keys=k8s.secret_data(2, 2))
    pods = {d["kind"]: d for d in docs}
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    for file, data in pods["Secret"]["data"].items():
        (keys / file).write_bytes(base64.b64decode(data))
        (keys / file).chmod(pods["Pod"]["spec"]["volumes"][0]["secret"]["defaultMode"])
    specs = [("H", 0, pods["Pod"]["spec"])] + \
        [(f"S{i}", i, pods["StatefulSet"]["spec"]["template"]["spec"]) for i in range(2)] + \
        [(f"W{i}", i, pods["Job"]["spec"]["template"]["spec"]) for i in range(2)]
    sup = Supervisor(new_session=False)
    address = None
    try:
        for name, index, spec in specs:
            c = spec["containers"][0]
            argv = [PY if a == "python" else a for a in c["command"]]
            if name == "H":       # one machine: any free port instead of the Service's fixed one
                argv[argv.index("--port") + 1] = "0"
                argv[argv.index("--host") + 1] = "127.0.0.1"
            env = dict(os.environ, **FAST_ENV)
            for e in c["env"]:
                if "value" in e:
                    value = e["value"].replace("$(KVPS_RANK)", env.get("KVPS_RANK", "$(KVPS_RANK)"))
                    env[e["name"]] = value.replace(k8s.KEYS_DIR, str(keys))
                else:
                    path = e["valueFrom"]["fieldRef"]["fieldPath"]
                    env[e["name"]] = "127.0.0.1" if path == "status.podIP" else str(index)
            if address:
                env.update(KVPS_SCHEDULER=address, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=address.split(":")[1])
            if name.startswith("S"):
                env["KVPS_PORT"] = "0"                 # two "pods" share this machine's ports
            sup.spawn(name, argv, env=env, ready=name == "H")
            if name == "H":
                address = sup.ready("H", 30)
        codes = sup.wait(60)
        assert codes == {"H": 0, "S0": 0, "S1": 0, "W0": 0, "W1": 0}, {n: sup.tail(n) for n in codes}
        results = [json.loads(sup.tail(f"W{i}")[-1]) for i in range(2)]
        assert [r["rank"] for r in results] == [0, 1] and all(r["x"] == [3.0] * 3 for r in results)
    finally:
        sup.stop()


def test_tether_stops_its_command_when_stdin_closes_and_names_a_signal(tmp_path):
    """The far end of an ssh or Ray launch: end of file on stdin stops the command's process group;
    a command killed by a signal gives 128+N and a line naming it."""
    from kvps.launch import tether
    pidfile = tmp_path / "pid"
    sleeper = [PY, "-c", f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"]
    proc = subprocess.Popen([PY, "-m", "kvps.launch.tether"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        proc.stdin.write(tether.encode(sleeper, {"X": "1"}))
        proc.stdin.flush()
        from harness import wait_for
        wait_for(lambda: pidfile.exists() and pidfile.read_text(), 20, "the command to start")
        child = int(pidfile.read_text())
        proc.stdin.close()                               # the launcher is gone
        proc.wait(20)
        out = proc.stdout.read()
        assert proc.returncode == 128 + 15 and b"was killed by SIGTERM" in out, out
        assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    bad = subprocess.run([PY, "-m", "kvps.launch.tether"], input=b'{"argv": "python"}\n', capture_output=True,
                         timeout=30)
    assert bad.returncode == 2 and b"'argv' must be a non-empty list of strings" in bad.stderr


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_sigterm_to_the_launcher_stops_the_whole_job(tmp_path):
    """`kill` of the launcher (a job manager stopping it) stops every node it started and gives 143;
    its children run in sessions of their own, so nothing else would."""
    import signal as sig
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    env = dict(os.environ, **FAST_ENV)
    proc = subprocess.Popen([PY, "-m", "kvps.cli", "launch", "-n", "2", "-s", "1", "--", PY, str(script)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    children = []
    try:
        for line in proc.stdout:                     # bounded: the workers stop by themselves after 60 s
            if line.startswith(("[W0] training", "[W1] training")) and (children := _children(proc.pid)) and \
                    len(children) == 4:
                break
        assert len(children) == 4, children          # H, S0, W0, W1
        proc.send_signal(sig.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 128 + sig.SIGTERM
    from harness import wait_for
    wait_for(lambda: not any(os.path.exists(f"/proc/{c}") and open(f"/proc/{c}/stat").read().split()[2] != "Z"
                             for c in children), 15, "the launcher's children to exit")


STEPS = r'''
import json, time, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init("x", np.zeros(3, np.float32))
out = np.zeros(3, np.float32)
for step in range(80):
    kv.pushpull("x", np.full(3, step, np.float32), out=out)
    if step == 5:
        print("training", flush=True)
    time.sleep(0.05)
print(json.dumps({"rank": kv.rank, "x": out.tolist()}), flush=True)
'''


def test_launch_with_replicas_survives_a_killed_server(tmp_path):
    """kvps launch --replicas 1: kill -9 of a server is named, the job goes on at its replicas and
    ends with 0, and the workers' results are those of a job without the failure."""
    import signal as sig
    from harness import wait_for
    script = tmp_path / "steps.py"
    script.write_text(STEPS)
    proc = subprocess.Popen([PY, "-m", "kvps.cli", "launch", "-n", "2", "-s", "2", "--replicas", "1", "--",
                             PY, str(script)], env=dict(os.environ, **FAST_ENV), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    lines = []
    try:
        for line in proc.stdout:                     # bounded: the workers stop after 80 steps
            lines.append(line)
            if line.startswith("[W1] training"):
                break
        wait_for(lambda: _node_pid(proc.pid, "server", 1), 10, "S1's pid")
        os.kill(_node_pid(proc.pid, "server", 1), sig.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = "".join(lines) + out
    assert proc.returncode == 0, text
    assert "[launch] S1 was killed by SIGKILL" in text and "go on at their replicas (KVPS_REPLICAS=1)" in text, text
    results = [json.loads(line.split("] ", 1)[1]) for line in text.splitlines() if line.startswith("[W") and "{" in line]
    assert [r["x"] for r in results] == [[2.0 * 79] * 3] * 2, text    # a round's value: the sum of its pushes


# SGD with learning rate 1 on the servers: every key holds minus the sum of every push ever applied,
# so a push lost (or applied twice) across the two failovers and the handover shows in the result.
# Gradients are small integers: every sum is exact. "stop" ends both workers after the same round.
REPLACED = r'''
import json, os, pathlib, time, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.set_optimizer(kvps.optimizer.SGD(learning_rate=1.0, rescale_grad=1.0))
shapes = {"w": (5,), "big": (600, 5), "stop": (1,)}       # big: over all 3 servers (KVPS_BIGARRAY_BOUND)
for k, s in shapes.items():
    kv.init(k, np.zeros(s, np.float32))
out = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
go, deadline, step = pathlib.Path(os.environ["GO"]), time.monotonic() + 90, 0
while out["stop"][0] == 0:
    for k, s in shapes.items():
        last = kv.rank == 0 and (go.exists() or time.monotonic() > deadline)
        g = float(last) if k == "stop" else step % 7 + kv.rank + 1
        kv.push(k, np.full(s, g, np.float32))
    for k in shapes:
        kv.pull(k, out=out[k])
    print(json.dumps({"step": step}), flush=True)
    step += 1
    time.sleep(0.05)
print(json.dumps({"rank": kv.rank, "steps": step, "w": sorted(set(out["w"].tolist())),
                  "big": sorted(set(out["big"].reshape(-1).tolist()))}), flush=True)
'''


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_launch_replaces_a_killed_server_and_the_job_survives_a_second_kill(tmp_path, curve):
    """-s 3 --replicas 1: kill -9 of S1; the launcher starts a new S1 once the scheduler has declared
    the old one dead, and it takes over S1's ranges. Then kill -9 of S2: S1's ranges were held by S1
    and S2 only, so without the replacement this death would lose them and end the job. The job
    ends with 0 and every push of every step applied once. --restart-servers 1: S2 is not replaced.
    With --curve the replacement is admitted by S1's key, which the launcher gives it."""
    import signal as sig
    script, go = tmp_path / "replaced.py", tmp_path / "go"
    script.write_text(REPLACED)
    env = dict(os.environ, **FAST_ENV, KVPS_BIGARRAY_BOUND="1000", GO=str(go))
    proc = subprocess.Popen([PY, "-m", "kvps.cli", "launch", "-n", "2", "-s", "3", "--replicas", "1",
                             "--restart-servers", "1", *(["--curve"] if curve else []), "--", PY, str(script)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    lines = []

    def read_until(done, what):           # bounded: the workers stop by themselves after 90 s
        for line in proc.stdout:
            lines.append(line)
            if done(line):
                return
        raise AssertionError(f"the job's output ended before {what}:\n{''.join(lines)}")

    def steps():
        return sum(line.startswith('[W0] {"step"') for line in lines)

    try:
        read_until(lambda line: line.startswith('[W0] {"step": 3}'), "W0's step 3")
        first = _node_pid(proc.pid, "server", 1)
        os.kill(first, sig.SIGKILL)
        read_until(lambda line: line.startswith("[launch] starting a replacement S1"), "the replacement")
        # the new S1 joins the tail of the chains of S1 (S2, S1) and of S0 (S0, S1)
        read_until(lambda line: sum(n.startswith("[S1]") and "took over the ranges" in n for n in lines) == 2,
                   "the new S1 to take over the ranges of S1 and S0")
        second = _node_pid(proc.pid, "server", 2)
        os.kill(second, sig.SIGKILL)
        read_until(lambda line: line.startswith("[launch] S2 was killed by SIGKILL"), "S2's death")
        at = steps()
        read_until(lambda line: steps() >= at + 5, "five steps after the second kill")
        go.write_text("")
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = "".join(lines) + out
    assert proc.returncode == 0, text
    assert ("[launch] S1 was killed by SIGKILL; its key ranges go on at their replicas (KVPS_REPLICAS=1); "
            "starting a replacement S1 in 2.2 s") in text, text
    assert "[launch] S2 was killed by SIGKILL; its key ranges go on at their replicas (KVPS_REPLICAS=1); " \
           "not replacing it: no restarts left (--restart-servers 1)" in text, text
    assert "no live replica left" not in text, text
    results = [json.loads(line.split("] ", 1)[1]) for line in text.splitlines()
               if line.startswith("[W") and '"rank"' in line]
    assert len(results) == 2 and results[0]["steps"] == results[1]["steps"], text
    steps_run = results[0]["steps"]
    applied = -float(sum(2 * (s % 7) + 3 for s in range(steps_run)))     # both workers' pushes, every step
    assert [(r["w"], r["big"]) for r in results] == [([applied], [applied])] * 2, (steps_run, text)


def test_a_worker_command_that_cannot_start_is_a_clear_error(tmp_path):
    """`kvps launch -n 2 train.py` (no python before the script): a one-line error that says how to run
    it, exit code 2, and no daemon left behind (the launcher stops what it started)."""
    (tmp_path / "train.py").write_text("print('never')\n")
    proc = subprocess.run([PY, "-m", "kvps.cli", "launch", "-n", "2", "-s", "1", "train.py"],
                          env=dict(os.environ, **FAST_ENV), capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "kvps launch: error: cannot start the worker command 'train.py'" in proc.stderr, proc.stderr
    assert "kvps launch ... -- python train.py" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
