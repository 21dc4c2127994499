"""`kvps launch --launcher ssh` for real: four emulated hosts (network namespaces, each with its own
198.18 address) each run Debian's sshd with keys this test makes; the launcher runs on h0 and
starts a 2-server, 2-worker job over ssh, one process per host. Skips without root, namespaces,
sshd or ssh (apt-get install -y openssh-server)."""
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from harness import FAST_ENV, PY, program_or_skip, wait_for

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
HOSTS = 4
TRAIN = r'''
import json, os, numpy as np, kvps
from kvps.config import Config
from kvps.wire.membership import advertised_host
kv = kvps.create("dist_sync")
rng = np.random.default_rng(0)                    # the same data on every worker; each takes its half
X = rng.standard_normal((64, 300)).astype(np.float32)
y = X @ np.linspace(-1, 1, 300).astype(np.float32)
part = slice(kv.rank * 32, (kv.rank + 1) * 32)
w = np.zeros(300, np.float32)
kv.init("w", w)                                   # 300 elements >= KVPS_BIGARRAY_BOUND: split over both servers
kv.set_optimizer(kvps.optimizer.SGD(learning_rate=0.1, rescale_grad=1.0 / kv.num_workers))
for step in range(10):
    kv.pull("w", out=w)
    kv.push("w", X[part].T @ (X[part] @ w - y[part]) / np.float32(32))
kv.pull("w", out=w)
print(json.dumps({"rank": kv.rank, "host": advertised_host(Config.from_env()), "cwd": os.getcwd(),
                  "w": w.tolist()}), flush=True)
'''
HANG = r'''
import os, time, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init("x", np.zeros(3, np.float32))
print("training", os.getpid(), flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    kv.pushpull("x", np.ones(3, np.float32), out=np.zeros(3, np.float32))
    time.sleep(0.05)
'''


def _reference():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 300)).astype(np.float32)
    y = X @ np.linspace(-1, 1, 300).astype(np.float32)
    w = np.zeros(300, np.float32)
    for _ in range(10):
        grads = [X[p].T @ (X[p] @ w - y[p]) / np.float32(32) for p in (slice(0, 32), slice(32, 64))]
        w = w - np.float32(0.1) * (grads[0] + grads[1]) * np.float32(0.5)
    return w


def _skip_reason():
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd)"
    program_or_skip("sshd", "openssh-server", path="/usr/sbin/sshd")    # Debian's: ssh and ssh-keygen too
    for tool in (SSHD, "ssh", "ssh-keygen", "tar"):
        if not shutil.which(tool) and not os.path.exists(tool):
            return f"{tool} is not installed (apt-get install -y openssh-server)"
    from kvps.tools.emulate.network import permitted
    ok, why = permitted()
    return None if ok else why


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """(network, ssh_config, hostfile, dir): HOSTS emulated hosts, each running sshd."""
    why = _skip_reason()
    if why:
        pytest.skip(why)
    from kvps.tools.emulate.network import Network
    d = tmp_path_factory.mktemp("ssh")
    for key in ("client", "host"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True, timeout=30)
    shutil.copy(d / "client.pub", d / "authorized_keys")
    (d / "sshd_config").write_text(
        f"HostKey {d / 'host'}\nAuthorizedKeysFile {d / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPidFile none\n"
        "LogLevel ERROR\n")
    (d / "ssh_config").write_text(
        f"Host *\n  User root\n  IdentityFile {d / 'client'}\n  IdentitiesOnly yes\n  UserKnownHostsFile /dev/null\n"
        "  StrictHostKeyChecking no\n  ConnectTimeout 5\n  LogLevel ERROR\n")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)    # sshd's privilege-separation directory
    net = Network().up(HOSTS)
    try:
        for name in net.hosts:
            with open(d / f"sshd-{name}.log", "wb") as log:
                net.popen(name, [SSHD, "-D", "-e", "-f", str(d / "sshd_config"), "-o",
                                 f"ListenAddress={net.address(name)}"], stdout=log, stderr=log)
        addresses = [net.address(n) for n in net.hosts]

        def all_answer():
            probes = [net.popen("h0", ["ssh", "-F", str(d / "ssh_config"), a, "true"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for a in addresses]
            return all(p.wait(20) == 0 for p in probes)
        wait_for(all_answer, 30, "sshd on every emulated host")
        (d / "hostfile").write_text("".join(a + "\n" for a in addresses))
        yield net, d / "ssh_config", d / "hostfile", d
    finally:
        net.down()


def _launch(hosts, tmp_path, script, extra=(), env=None):
    net, config, hostfile, _ = hosts
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text(script)
    argv = [PY, "-m", "kvps.cli", "launch", "--launcher", "ssh", "-H", str(hostfile), "--ssh-config", str(config),
            "-n", "2", "-s", "2", "--port", "0", *extra, "--", PY, "train.py"]
    full_env = dict(os.environ, **FAST_ENV, KVPS_INTERFACE="eth0", **(env or {}))
    return net.popen("h0", argv, env=full_env, cwd=src, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_training_job_across_four_hosts_over_ssh(hosts, tmp_path):
    net = hosts[0]
    dst = tmp_path / "run"
    proc = _launch(hosts, tmp_path, TRAIN, ["--sync-dst-dir", str(dst), "--env", "KVPS_BIGARRAY_BOUND=100"])
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        net.stop([proc])
    assert proc.returncode == 0, out
    lines = out.splitlines()
    a = [net.address(f"h{i}") for i in range(HOSTS)]
    assert any(line.startswith(f"[launch] scheduler ready at {a[0]}:") for line in lines), out
    assert any(line.startswith(f"[S0] READY {a[0]}:") for line in lines), out       # servers in turn,
    assert any(line.startswith(f"[S1] READY {a[1]}:") for line in lines), out       # then the workers
    results = sorted((json.loads(line.split("] ", 1)[1]) for line in lines if line.startswith("[W") and "] {" in line),
                     key=lambda r: r["rank"])
    assert [(r["rank"], r["host"]) for r in results] == [(0, a[2]), (1, a[3])], out
    assert all(r["cwd"] == str(dst) for r in results) and (dst / "train.py").exists()
    expected = _reference()
    for r in results:
        np.testing.assert_allclose(np.array(r["w"], np.float32), expected, rtol=1e-5, atol=1e-6)
    assert np.abs(expected).sum() > 1.0          # it did train


def _processes_with(mark):
    """pids of processes of this job's remote nodes (their environment carries `mark`)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if mark in env and (b"KVPS_ROLE=server" in env or b"KVPS_ROLE=worker" in env):
                found.append(int(entry))
    return found


def test_remote_processes_stop_when_the_launcher_is_killed(hosts, tmp_path):
    """SIGKILL of the launcher (it can clean nothing up): every remote server and worker is gone
    soon after, because each one's tether sees its ssh connection's stdin close."""
    net = hosts[0]
    mark = f"KVPS_TEST_MARK={os.getpid()}-{time.monotonic_ns()}"
    proc = _launch(hosts, tmp_path, HANG, ["--env", mark])
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if sum(s.startswith(("[W0] training", "[W1] training")) for s in seen) == 2:
                break
        remote = _processes_with(mark.encode())
        assert len(remote) == 4, "".join(seen)                # S0, S1, W0, W1 on their hosts
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: not _processes_with(mark.encode()), 20, "the remote processes to stop")
        assert time.monotonic() - killed < 15
    finally:
        net.stop([proc])          # the launcher's group: its local scheduler
