"""`kvps launch`: start a whole job (scheduler, S servers, W workers) and supervise it.

    kvps launch -n 2 -s 1 -- python train.py --epochs 3

Every child's output is printed with its role and rank ([H], [S0], [W1]). The
launcher returns the first non-zero worker exit code (0 when all succeed) and
stops every child it started, by pid, when a worker fails or on Ctrl-C.
`--launcher ssh -H hostfile` starts servers and workers on the listed hosts over
ssh (MXNet's tools/launch.py); `--dry-run` prints those commands instead.
"""
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from kvps.errors import ConfigError, KVTimeoutError

READY_TIMEOUT = 30.0      # seconds for the scheduler to print READY
DRAIN_TIMEOUT = 30.0      # seconds for servers and scheduler to exit once the workers are done


def _pump(proc, prefix, out, lock):
    for line in iter(proc.stdout.readline, b""):
        with lock:
            out.write(f"[{prefix}] {line.decode(errors='replace')}")
            out.flush()
    proc.stdout.close()


class Job:
    """The processes of one local job, each started and stopped by this object only."""

    def __init__(self, num_workers, num_servers, command, env=None, out=None, python=None, worker_env=None):
        if num_workers < 1 or num_servers < 0:
            raise ConfigError(f"a job needs at least one worker and no negative number of servers "
                              f"(got -n {num_workers} -s {num_servers})")
        if not command:
            raise ConfigError("no worker command given: kvps launch -n W -s S -- python train.py")
        self.num_workers, self.num_servers = num_workers, num_servers
        self.command = list(command)
        self.python = python or sys.executable
        self.env = dict(os.environ, **(env or {}))
        self.worker_env = worker_env or {}      # rank -> extra variables for that worker only
        self.out = out or sys.stdout
        self.procs = []            # (name, Popen)
        self._lock = threading.Lock()
        self._pumps = []
        self.scheduler_address = None

    def _start(self, name, argv, extra_env, pipe_ready=False):
        env = dict(self.env, **extra_env)
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append((name, proc))
        if pipe_ready:
            return proc
        self._pump(name, proc)
        return proc

    def _pump(self, name, proc):
        t = threading.Thread(target=_pump, args=(proc, name, self.out, self._lock), daemon=True)
        t.start()
        self._pumps.append(t)

    def start(self):
        base = {"KVPS_NUM_WORKERS": str(self.num_workers), "KVPS_NUM_SERVERS": str(self.num_servers),
                "PYTHONUNBUFFERED": "1"}
        sched = self._start("H", [self.python, "-m", "kvps.cli", "scheduler", "--port", "0"],
                            dict(base, KVPS_ROLE="scheduler"), pipe_ready=True)
        self.scheduler_address = self._await_ready(sched)
        self._pump("H", sched)
        base["KVPS_SCHEDULER"] = self.scheduler_address
        for rank in range(self.num_servers):
            self._start(f"S{rank}", [self.python, "-m", "kvps.cli", "server"],
                        dict(base, KVPS_ROLE="server", KVPS_RANK=str(rank)))
        for rank in range(self.num_workers):
            self._start(f"W{rank}", self.command, dict(base, KVPS_ROLE="worker", KVPS_RANK=str(rank),
                                                      **self.worker_env.get(rank, {})))
        return self

    def _await_ready(self, proc):
        deadline = time.monotonic() + READY_TIMEOUT
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline().decode(errors="replace")
            if not line:
                break
            if line.startswith("READY "):
                return line.split()[1]
            lines.append(line)
        self.stop()
        raise KVTimeoutError(f"the scheduler did not print READY within {READY_TIMEOUT:g} s; it said:\n"
                             + "".join(lines))

    def wait(self, timeout=None):
        """Supervise until the workers finish; returns the job's exit code. With a timeout (seconds),
        a job still running then is stopped and KVTimeoutError raised."""
        workers = [(n, p) for n, p in self.procs if n.startswith("W")]
        code = 0
        give_up = None if timeout is None else time.monotonic() + timeout
        while True:
            if give_up is not None and time.monotonic() > give_up:
                self.stop()
                running = ", ".join(n for n, p in workers if p.returncode is None or p.returncode < 0)
                raise KVTimeoutError(f"the job did not finish within {timeout:g} s (workers still running: "
                                     f"{running or 'none'}); stopped it")
            running = [p for _, p in workers if p.poll() is None]
            failed = [(n, p.returncode) for n, p in workers if p.returncode not in (None, 0)]
            if failed and code == 0:
                code = failed[0][1]
                self._say(f"worker {failed[0][0]} exited with code {code}; stopping the job")
                break
            if not running:
                break
            time.sleep(0.05)
        deadline = time.monotonic() + (0 if code else DRAIN_TIMEOUT)
        while time.monotonic() < deadline and any(p.poll() is None for _, p in self.procs):
            time.sleep(0.05)
        self.stop()
        if code == 0:
            daemons = [(n, p.returncode) for n, p in self.procs if not n.startswith("W") and p.returncode]
            if daemons:
                self._say("daemons exited with errors: " + ", ".join(f"{n}={c}" for n, c in daemons))
                code = daemons[0][1] if daemons[0][1] > 0 else 1
        for t in self._pumps:
            t.join(2)
        return exit_code(code)

    def stop(self):
        """Terminate every child still running (SIGTERM, then SIGKILL)."""
        stop_processes([p for _, p in self.procs])

    def _say(self, text):
        with self._lock:
            self.out.write(f"[launch] {text}\n")
            self.out.flush()


def stop_processes(procs, grace=5.0):
    """SIGTERM each process still running (with its session: it was started with
    start_new_session), then SIGKILL those still there after `grace` seconds."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                pass          # unkillable (stuck in the kernel); nothing more to do


def wait_children(procs, timeout, drain=0.0, poll=0.05):
    """Wait for [(name, Popen)] whose workers are named W*: until every worker has exited (then up
    to `drain` seconds more for the rest), a child fails, or `timeout` passes. Returns 0, the first
    failure's exit code, or None on timeout. Stops nothing: the caller stops its own children."""
    deadline = time.monotonic() + timeout
    workers = [p for n, p in procs if n.startswith("W")]

    def failure():
        failed = [p.returncode for _, p in procs if p.poll() not in (None, 0)]
        return exit_code(failed[0]) if failed else 0

    while any(p.poll() is None for p in workers):
        if failure():
            return failure()
        if time.monotonic() > deadline:
            return None
        time.sleep(poll)
    until = min(deadline, time.monotonic() + drain)
    while any(p.poll() is None for _, p in procs) and time.monotonic() < until:
        time.sleep(poll)
    return failure()


def exit_code(returncode):
    """A shell-style exit code: a process killed by signal N gives 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


def _signal(proc, sig):
    try:
        os.killpg(proc.pid, sig)      # the child's own session: it and what it started
    except ProcessLookupError:
        pass


def straggler_env(items, num_workers, seed=0):
    """{rank: variables} that make the workers named by --straggler RANK=SPEC options stragglers."""
    from kvps.straggler import parse_assignments
    return {rank: {"KVPS_STRAGGLER": str(spec), "KVPS_STRAGGLER_SEED": str(seed)}
            for rank, spec in parse_assignments(items, num_workers).items()}


def launch_local(num_workers, num_servers, command, env=None, worker_env=None):
    job = Job(num_workers, num_servers, command, env, worker_env=worker_env)
    try:
        job.start()          # inside the try: Ctrl-C while starting must stop what has started
        return job.wait()
    except KeyboardInterrupt:
        job.stop()
        return 130


def parse_env(items, option="--env"):
    """{KEY: VALUE} from ["KEY=VALUE", ...]; raises ConfigError naming a bad item."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{option} {item!r} is not KEY=VALUE")
        env[key] = value
    return env


def read_hostfile(path):
    try:
        with open(path) as f:
            hosts = [line.split()[0] for line in f if line.strip() and not line.lstrip().startswith("#")]
    except OSError as exc:
        raise ConfigError(f"hostfile {path}: {exc.strerror}") from None
    if not hosts:
        raise ConfigError(f"hostfile {path} lists no hosts")
    return hosts


def ssh_commands(num_workers, num_servers, command, hosts, scheduler_host, port, env=None, python="python3",
                 cwd=None, worker_env=None):
    """The commands that start a job over ssh: [(name, argv)], scheduler first (run locally)."""
    cwd = cwd or os.getcwd()
    base = dict(env or {}, KVPS_SCHEDULER=f"{scheduler_host}:{port}", KVPS_NUM_WORKERS=str(num_workers),
                KVPS_NUM_SERVERS=str(num_servers))
    cmds = [("H", [python, "-m", "kvps.cli", "scheduler", "--host", "0.0.0.0", "--port", str(port)])]

    def remote(host, role, rank, argv, extra=None):
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in
                               sorted(dict(base, KVPS_ROLE=role, KVPS_RANK=str(rank), **(extra or {})).items()))
        script = f"cd {shlex.quote(cwd)} && env {assignments} {' '.join(shlex.quote(a) for a in argv)}"
        return ["ssh", "-o", "StrictHostKeyChecking=no", "-o", "BatchMode=yes", host, script]

    for rank in range(num_servers):
        cmds.append((f"S{rank}", remote(hosts[rank % len(hosts)], "server", rank, [python, "-m", "kvps.cli", "server"])))
    for rank in range(num_workers):
        cmds.append((f"W{rank}", remote(hosts[rank % len(hosts)], "worker", rank, list(command),
                                        (worker_env or {}).get(rank))))
    return cmds


def launch_ssh(num_workers, num_servers, command, hostfile, port, env=None, dry_run=False, out=None,
               worker_env=None):
    out = out or sys.stdout
    hosts = read_hostfile(hostfile)
    scheduler_host = socket.gethostbyname(socket.gethostname())
    cmds = ssh_commands(num_workers, num_servers, command, hosts, scheduler_host, port, env,
                        worker_env=worker_env)
    if dry_run:
        for name, argv in cmds:
            out.write(f"[{name}] {shlex.join(argv)}\n")
        return 0
    job = Job(num_workers, num_servers, command, env, out)
    for name, argv in cmds:
        job._start(name, argv, {"KVPS_ROLE": "scheduler"} if name == "H" else {})
    try:
        return job.wait()
    except KeyboardInterrupt:
        job.stop()
        return 130
