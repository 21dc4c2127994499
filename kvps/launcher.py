"""`kvps launch`: start a whole job (scheduler, S servers, W workers) and supervise it.

    kvps launch -n 2 -s 1 -- python train.py --epochs 3

Every child's output is printed with its role and rank ([H], [S0], [W1]). The
launcher returns the first non-zero worker exit code (0 when all succeed) and
stops every child it started, by pid, when a worker fails or on Ctrl-C.
`--launcher ssh -H hostfile` starts servers and workers on the listed hosts over
ssh (MXNet's tools/launch.py); `--dry-run` prints those commands instead.

Started from a shell, each child gets a session of its own, so Ctrl-C reaches only the launcher,
which stops them. Started in a session of its own (as `kvps experiment` starts it, through
kvps.supervisor), the launcher keeps its children in its process group instead, so that whoever
started it can stop the whole job, whatever state the launcher is in, by signalling that group.
"""
import os
import shlex
import socket
import sys
import time

from kvps.errors import ConfigError, KVTimeoutError
from kvps.supervisor import DRAIN_TIMEOUT, READY_TIMEOUT, Supervisor, exit_code, leads_own_session


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
        self.children = Supervisor(self.out, new_session=not leads_own_session())
        self.scheduler_address = None

    def _start(self, name, argv, extra_env, ready=False):
        return self.children.spawn(name, argv, env=dict(self.env, **extra_env), ready=ready)

    def start(self):
        """Start the scheduler, wait for its READY line, then the servers and workers. Returns self.
        Raises KVTimeoutError (after stopping what it started) if the scheduler does not get ready."""
        base = {"KVPS_NUM_WORKERS": str(self.num_workers), "KVPS_NUM_SERVERS": str(self.num_servers),
                "PYTHONUNBUFFERED": "1"}
        self._start("H", [self.python, "-m", "kvps.cli", "scheduler", "--port", "0"],
                    dict(base, KVPS_ROLE="scheduler"), ready=True)
        try:
            self.scheduler_address = self.children.ready("H", READY_TIMEOUT)
        except KVTimeoutError:
            self.stop()
            raise
        base["KVPS_SCHEDULER"] = self.scheduler_address
        for rank in range(self.num_servers):
            self._start(f"S{rank}", [self.python, "-m", "kvps.cli", "server"],
                        dict(base, KVPS_ROLE="server", KVPS_RANK=str(rank)))
        for rank in range(self.num_workers):
            self._start(f"W{rank}", self.command, dict(base, KVPS_ROLE="worker", KVPS_RANK=str(rank),
                                                      **self.worker_env.get(rank, {})))
        return self

    def wait(self, timeout=None):
        """Supervise until the workers finish; returns the job's exit code. With a timeout (seconds),
        a job still running then is stopped and KVTimeoutError raised."""
        workers = [n for n in self.children.procs if n.startswith("W")]
        code = 0
        give_up = None if timeout is None else time.monotonic() + timeout
        while self.children.running(workers):
            exited = self.children.wait_any(None if give_up is None else give_up - time.monotonic())
            if exited is None:
                running = ", ".join(self.children.running(workers))
                self.stop()
                raise KVTimeoutError(f"the job did not finish within {timeout:g} s (workers still running: "
                                     f"{running or 'none'}); stopped it")
            name, returncode = exited
            if name.startswith("W") and returncode:
                code = returncode
                self._say(f"worker {name} exited with code {code}; stopping the job")
                break
        if code == 0:
            self.children.wait(DRAIN_TIMEOUT)
        self.stop()
        if code == 0:
            daemons = [(n, c) for n, c in self.children.poll().items() if not n.startswith("W") and c]
            if daemons:
                self._say("daemons exited with errors: " + ", ".join(f"{n}={c}" for n, c in daemons))
                code = daemons[0][1] if daemons[0][1] > 0 else 1
        return exit_code(code)

    def stop(self):
        """Stop every child still running (SIGTERM, then SIGKILL), by pid."""
        self.children.stop()

    def _say(self, text):
        self.children.emit("launch", text)


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
