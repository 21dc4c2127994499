"""Start real kvps processes on 127.0.0.1 for tests, with a deadline on every wait.

    with Cluster(tmp_path, workers=2, servers=1) as c:
        results = c.run_workers(SCRIPT)          # W copies of a Python script
        assert c.wait_daemons() == [0, 0]

The scheduler binds port 0 and reports it on its READY line. The harness stops
only the processes it started (by pid) and puts their logs in failure messages.
"""
import json
import os
import subprocess
import sys
import time

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


def read_ready(proc, timeout, what):
    """The HOST:PORT of a READY line on proc's stdout, within `timeout` seconds."""
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
    def __init__(self, tmp_path, workers, servers, env=None, server_args=(), start_servers=True):
        self.dir = tmp_path
        self.workers, self.servers = workers, servers
        self.env = dict(os.environ, **FAST_ENV, KVPS_NUM_WORKERS=str(workers), KVPS_NUM_SERVERS=str(servers),
                        **(env or {}))
        self.env.pop("KVPS_SCHEDULER", None)
        self.procs = []              # (name, Popen, log path)
        self.server_args = list(server_args)
        self.start_servers = start_servers
        self.address = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def _spawn(self, name, argv, env=None, stdout=None):
        log = self.dir / f"{name}.log"
        out = open(log, "wb") if stdout is None else stdout
        proc = subprocess.Popen(argv, env=env or self.env, stdout=out, stderr=open(log.with_suffix(".err"), "wb"),
                                cwd=self.dir)
        self.procs.append((name, proc, log))
        return proc

    def start(self):
        sched = self._spawn("H", [PY, "-m", "kvps.cli", "scheduler", "--port", "0"], stdout=subprocess.PIPE)
        self.address = read_ready(sched, 30, "the scheduler")
        self.env["KVPS_SCHEDULER"] = self.address
        self.server_ports = []
        if self.start_servers:
            for i in range(self.servers):
                proc = self._spawn(f"S{i}", [PY, "-m", "kvps.cli", "server", *self.server_args], stdout=subprocess.PIPE)
                self.server_ports.append(int(read_ready(proc, 30, f"server {i}").rsplit(":", 1)[1]))
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
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"processes still running after {timeout} s\n{self.logs()}") from None

    def output(self, name):
        path = self.dir / f"{name}.log"
        return [json.loads(line) for line in path.read_text().splitlines() if line.startswith(("{", "["))]

    def wait_daemons(self, timeout=30):
        daemons = [p for n, p, _ in self.procs if n[0] in "HS"]
        self.wait(daemons, timeout)
        return [p.returncode for p in daemons]

    def proc(self, name):
        return next(p for n, p, _ in self.procs if n == name)

    def logs(self):
        parts = []
        for name, _, log in self.procs:
            for path in (log, log.with_suffix(".err")):
                if path.exists():
                    text = path.read_text(errors="replace")[-3000:]
                    if text.strip():
                        parts.append(f"--- {path.name}\n{text}")
        return "\n".join(parts)

    def close(self):
        for _, p, _ in self.procs:
            if p.poll() is None:
                p.kill()
        for _, p, _ in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
