"""One job's processes (scheduler, S servers, W workers), started and watched by one object.

    job = Job(2, 1, ["python", "train.py"]).start()     # every process on this machine
    code = job.wait()                                   # the job's exit code; every process stopped

Where the servers and workers run is a placement: `Local` here (this module), `Remote` over ssh
(kvps/launch/ssh.py). A placement has spawn(children, name, argv, env, job_env) (start one node:
`env` is the launcher's environment, `job_env` the node's own variables), describe(name, code)
(the words for an exit), secret_env(path) (how a node gets its key file), `remote` (its nodes are
on other machines: the job runs CurveZMQ) and `announce` (print the scheduler's address). The
scheduler always runs on the launcher's machine, at `scheduler_host`.

Every child is watched, daemons included. The first worker that fails, or a daemon that exits
non-zero (or is killed by a signal) while workers still run, stops the job at once, with a line
that names it ("S1 was killed by SIGKILL"), and its exit code becomes the job's (128+N for a
signal). Nothing waits for the heartbeat timeout: the launcher sees the exit itself.

Started from a shell, each child gets a session of its own, so Ctrl-C reaches only the launcher,
which stops them. Started in a session of its own (as `kvps experiment` starts it, through
kvps.supervisor), the launcher keeps its children in its process group instead, so that whoever
started it can stop the whole job, whatever state the launcher is in, by signalling that group.
"""
import os
import signal
import sys
import threading
import time

from kvps.errors import ConfigError, KVTimeoutError
from kvps.supervisor import DRAIN_TIMEOUT, READY_TIMEOUT, Supervisor, exit_code, leads_own_session


def signal_name(number):
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def forwarded_env(environ, extra):
    """What a node on another machine gets of the launcher's environment: its KVPS_* variables (not
    the per-node ones) and `extra` (--env's); nothing else, since that machine has its own."""
    own = {"KVPS_ROLE", "KVPS_RANK", "KVPS_SCHEDULER", "KVPS_HOST", "KVPS_INTERFACE", "KVPS_SECRET", "KVPS_SECRET_FILE"}
    env = {k: v for k, v in environ.items() if k.startswith("KVPS_") and k not in own}
    env.update(extra)
    return env


def judge(name, returncode, workers_running, describe, replicated=False):
    """The line that stops a job when child `name` exits with `returncode`, or None when the job goes
    on: a failed worker stops it, and so does a daemon that fails while workers still run (its
    death would reach the workers only after the heartbeat timeout), except a server of a
    `replicated` job (KVPS_REPLICAS: the scheduler moves its ranges to their replicas, or fails the
    job when none is left). describe(name, code) words it."""
    if not returncode:
        return None
    if name.startswith("W"):
        return f"worker {describe(name, returncode)}; stopping the job"
    if replicated and name.startswith("S"):
        return None
    if workers_running:
        return f"{describe(name, returncode)} while workers were running; stopping the job"
    return None


class Local:
    """Runs servers and workers on this machine, with the launcher's whole environment."""

    name = "local"
    announce = False           # no line for the scheduler's address: it is on this machine
    remote = False             # a loopback-only job: CURVE only when asked for (KVPS_CURVE=1)

    def spawn(self, children, name, argv, env, job_env):
        return children.spawn(name, argv, env=dict(env, **job_env))

    def secret_env(self, path):
        return {"KVPS_SECRET_FILE": path}

    def describe(self, name, returncode):
        if returncode < 0:
            return f"{name} was killed by {signal_name(-returncode)}"
        return f"{name} exited with code {returncode}"


class Job:
    """The processes of one job, each started and stopped by this object only."""

    def __init__(self, num_workers, num_servers, command, env=None, out=None, python=None, worker_env=None,
                 placement=None, scheduler_host=None, scheduler_port=0):
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
        self.placement = placement or Local()
        self.scheduler_host, self.scheduler_port = scheduler_host, scheduler_port
        self.children = Supervisor(self.out, new_session=not leads_own_session())
        self.scheduler_address = None
        self.secrets = {}                       # name -> its secret file, for a CURVE job
        self.replicas = int(self.env.get("KVPS_REPLICAS") or 0)
        self.failed_over = set()                # servers that died while their replicas took over

    def scheduler_argv(self):
        argv = [sys.executable, "-m", "kvps.cli", "scheduler", "--port", str(self.scheduler_port),
                "-n", str(self.num_workers), "-s", str(self.num_servers)]
        return argv + (["--host", self.scheduler_host] if self.scheduler_host else [])

    def job_env(self):
        """The variables every node of the job gets (the scheduler's address once it is known)."""
        env = {"KVPS_NUM_WORKERS": str(self.num_workers), "KVPS_NUM_SERVERS": str(self.num_servers),
               "PYTHONUNBUFFERED": "1"}
        if self.scheduler_address:
            env["KVPS_SCHEDULER"] = self.scheduler_address
        return env

    def start(self):
        """Start the scheduler here, wait for its READY line, then the servers and workers where the
        placement puts them. Returns self. Raises KVTimeoutError (after stopping what it started)
        if the scheduler does not get ready; OSError if a program cannot be started."""
        self.secrets = make_keys(self.env, self.num_workers, self.num_servers, self.placement.remote)
        scheduler_env = dict(self.env, **self.job_env(), KVPS_ROLE="scheduler")
        if self.secrets:
            scheduler_env["KVPS_SECRET_FILE"] = self.secrets["H"]
        self.children.spawn("H", self.scheduler_argv(), env=scheduler_env, ready=True)
        try:
            self.scheduler_address = self.children.ready("H", READY_TIMEOUT)
            if self.placement.announce:
                self._say(f"scheduler ready at {self.scheduler_address}")
            for rank in range(self.num_servers):
                self._spawn(f"S{rank}", [self.python, "-m", "kvps.cli", "server"],
                            {"KVPS_ROLE": "server", "KVPS_RANK": str(rank)})
            for rank in range(self.num_workers):
                self._spawn(f"W{rank}", self.command,
                            dict({"KVPS_ROLE": "worker", "KVPS_RANK": str(rank)}, **self.worker_env.get(rank, {})))
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name, argv, node_env):
        env = dict(self.job_env(), **node_env)
        if self.secrets:
            env.update(self.placement.secret_env(self.secrets[name]))
        self.placement.spawn(self.children, name, argv, self.env, env)

    def wait(self, timeout=None):
        """Supervise until the workers finish; returns the job's exit code. A failed worker, or a
        daemon that fails while workers run, stops the job at once. With a timeout (seconds), a job
        still running then is stopped and KVTimeoutError raised."""
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
            verdict = judge(name, returncode, bool(self.children.running(workers)), self.placement.describe,
                            replicated=self.replicas > 0)
            if returncode and verdict is None and name.startswith("S") and self.replicas:
                self._say(f"{self.placement.describe(name, returncode)}; its key ranges go on at their "
                          f"replicas (KVPS_REPLICAS={self.replicas})")
                self.failed_over.add(name)
            if verdict:
                self._say(verdict)
                code = exit_code(returncode)
                break
        if code == 0:
            self.children.wait(DRAIN_TIMEOUT)
        self.stop()
        if code == 0:
            daemons = [(n, c) for n, c in self.children.poll().items()
                       if not n.startswith("W") and c and n not in self.failed_over]
            if daemons:
                self._say("daemons exited with errors: " +
                          ", ".join(self.placement.describe(n, c) for n, c in daemons))
                code = exit_code(daemons[0][1]) or 1
        return code

    def stop(self):
        """Stop every child still running (SIGTERM, then SIGKILL), by pid."""
        self.children.stop()

    def _say(self, text):
        self.children.emit("launch", text)


def make_keys(environ, num_workers, num_servers, remote):
    """{node name: its secret file} when the job runs CurveZMQ, else {}: always for a job whose nodes
    are on other machines (unless KVPS_CURVE=0), for a local one only with KVPS_CURVE=1. The files
    live in a private temporary directory removed when the launcher exits (kvps/wire/keys.py)."""
    from kvps.config import Config
    curve = Config.from_env(environ).curve
    if curve == "0" or not (remote or curve == "1"):
        return {}
    from kvps.wire.keys import job_names, make_job_keys
    return make_job_keys(None, job_names(num_workers, num_servers))


class _Stopped(BaseException):
    """SIGTERM or SIGHUP reached the launcher (a job manager, `kill`, a closed terminal)."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def _stop_on(signum, frame):
    raise _Stopped(signum)


def run(job):
    """Start and supervise a job; Ctrl-C stops it and gives 130, SIGTERM or SIGHUP stop it and give
    128 + the signal (the children run in sessions of their own, so only the launcher can stop them).
    Returns the exit code."""
    previous = {}
    if threading.current_thread() is threading.main_thread():    # (signals reach only that thread)
        previous = {sig: signal.signal(sig, _stop_on) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        job.start()          # inside the try: Ctrl-C while starting must stop what has started
        return job.wait()
    except KeyboardInterrupt:
        job.stop()
        return 130
    except _Stopped as stopped:
        job.stop()
        return 128 + stopped.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
