"""Start real kvps processes on 127.0.0.1 for tests, with a deadline on every wait.

    with Cluster(tmp_path, workers=2, servers=1) as c:
        results = c.run_workers(SCRIPT)          # W copies of a Python script
        assert c.wait_daemons() == [0, 0]

The scheduler binds port 0 and reports it on its READY line. The harness stops
only the processes it started (by pid, through kvps.supervisor) and puts their logs
in failure messages.
"""
import json
import os
import signal
import subprocess
import sys
import time

from kvps.errors import KVTimeoutError
from kvps.supervisor import READY_TIMEOUT, Supervisor

PY = sys.executable
FAST_ENV = {
    "KVPS_HEARTBEAT_INTERVAL": "0.2",
    "KVPS_HEARTBEAT_TIMEOUT": "2",
    "KVPS_TIMEOUT": "30",
    "KVPS_CONNECT_TIMEOUT": "30",
    "PYTHONUNBUFFERED": "1",
}


def run_command(argv, cwd, timeout):
    """Run a command to completion; a hang past `timeout` fails the test with its output so far.
    (Commands such as the benchmarks keep their own deadlines; this one is the last resort.)"""
    try:
        return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{' '.join(argv[:5])} hung past {timeout} s\n{exc.stdout}\n{exc.stderr}") from None


def program_or_skip(name, package, path=None, timeout=600):
    """The path of program `name` (or `path`), installing Debian's `package` first when it is missing
    and we are root with apt-get (as CI is); pytest.skip naming the reason where it cannot be had."""
    import shutil
    import pytest

    def found():
        return shutil.which(name) or (path if path and os.path.exists(path) else None)
    if found():
        return found()
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(f"{name} is not installed and cannot be (apt-get install -y {package} needs root and apt)")
    try:
        result = subprocess.run(["apt-get", "install", "-y", package], capture_output=True, text=True,
                                timeout=timeout, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    except subprocess.TimeoutExpired:
        pytest.skip(f"apt-get install -y {package} took over {timeout} s")
    if not found():
        pytest.skip(f"apt-get install -y {package} did not install {name}: {(result.stdout + result.stderr)[-500:]}")
    return found()


def wait_for(predicate, timeout, what):
    """Poll predicate() until it is true; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def read_ready(proc, timeout, what):
    """The HOST:PORT of a READY line on proc's stdout, within `timeout` seconds: for daemons a test
    starts by hand, as a user would (Cluster's children are kvps.supervisor's, which reads READY itself)."""
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    seen = b""
    while time.monotonic() < deadline:
        if not sel.select(max(0.0, deadline - time.monotonic())):
            break
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
        if line.startswith(b"READY "):
            return line.split()[1].decode()
    raise AssertionError(f"{what} printed no READY line within {timeout} s: {seen.decode(errors='replace')}")


class Cluster:
    """The scheduler and servers of one test job (started by start()), and its workers; each child's
    stdout goes to NAME.log in `tmp_path`, its stderr to NAME.err (kvps.supervisor keeps them)."""

    def __init__(self, tmp_path, workers, servers, env=None, server_args=(), start_servers=True, curve=False):
        self.dir = tmp_path
        self.workers, self.servers = workers, servers
        self.env = dict(os.environ, **FAST_ENV, KVPS_NUM_WORKERS=str(workers), KVPS_NUM_SERVERS=str(servers),
                        **(env or {}))
        self.env.pop("KVPS_SCHEDULER", None)
        # The children share the test's process group: Ctrl-C on pytest reaches them too.
        self.children = Supervisor(new_session=False)
        self.server_args = list(server_args)
        self.start_servers = start_servers
        # curve=True: the job's CURVE keys, one secret file per node (tmp_path/keys/NAME.json)
        self.curve = curve
        self.secrets = {}
        self.address = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def _spawn(self, name, argv, env=None, ready=False):
        log = self.dir / f"{name}.log"
        if name in self.secrets:
            env = dict(env or self.env, KVPS_SECRET_FILE=self.secrets[name])
        return self.children.spawn(name, argv, env=env or self.env, ready=ready, log=log,
                                   stderr=log.with_suffix(".err"), cwd=self.dir)

    def _ready(self, name):
        try:
            return self.children.ready(name, READY_TIMEOUT)
        except KVTimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None

    def start(self):
        if self.curve:
            from kvps.wire.keys import job_names, make_job_keys
            self.secrets = make_job_keys(str(self.dir / "keys"), job_names(self.workers, self.servers))
            self.env["KVPS_CURVE"] = "1"
        self._spawn("H", [PY, "-m", "kvps.cli", "scheduler", "--port", "0"], ready=True)
        self.address = self._ready("H")
        self.env["KVPS_SCHEDULER"] = self.address
        self.server_ports = []
        if self.start_servers:
            for i in range(self.servers):
                self._spawn(f"S{i}", [PY, "-m", "kvps.cli", "server", *self.server_args], ready=True)
                self.server_ports.append(int(self._ready(f"S{i}").rsplit(":", 1)[1]))
        return self

    def spawn_workers(self, script, env=None, count=None):
        path = self.dir / "worker.py"
        path.write_text(script)
        procs = []
        for rank in range(self.workers if count is None else count):
            wenv = dict(self.env, KVPS_RANK=str(rank), **(env or {}))
            procs.append(self._spawn(f"W{rank}", [PY, str(path)], env=wenv))
        return procs

    def run_workers(self, script, timeout=60, env=None, check=True):
        """Run W copies of `script`; returns each one's JSON lines (list of lists of objects)."""
        procs = self.spawn_workers(script, env)
        self.wait(procs, timeout)
        if check:
            bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
            assert not bad, f"workers failed {bad}\n{self.logs()}"
        return [self.output(f"W{i}") for i in range(len(procs))]

    def wait(self, procs, timeout):
        """Wait for these children (Popen objects spawn_workers or proc() gave) to exit; a deadline
        passed fails the test with every child's log."""
        names = {id(p): n for n, p in self.children.procs.items()}
        codes = self.children.wait(timeout, [names[id(p)] for p in procs])
        running = [n for n, code in codes.items() if code is None]
        if running:
            raise AssertionError(f"processes {', '.join(running)} still running after {timeout} s\n{self.logs()}")

    def output(self, name):
        path = self.dir / f"{name}.log"
        return [json.loads(line) for line in path.read_text().splitlines() if line.startswith(("{", "["))]

    def wait_daemons(self, timeout=30):
        daemons = [p for n, p in self.children.procs.items() if n[0] in "HS"]
        self.wait(daemons, timeout)
        return [p.returncode for p in daemons]

    def proc(self, name):
        return self.children.procs[name]

    def logs(self):
        parts = []
        for name in self.children.procs:
            log = self.dir / f"{name}.log"
            for path in (log, log.with_suffix(".err")):
                if path.exists():
                    text = path.read_text(errors="replace")[-3000:]
                    if text.strip():
                        parts.append(f"--- {path.name}\n{text}")
        return "\n".join(parts)

    def close(self):
        """Kill every child still running (only those this cluster started, by pid) and wait for them."""
        self.children.stop(grace=10, sig=signal.SIGKILL)
