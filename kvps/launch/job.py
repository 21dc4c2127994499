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
signal). Nothing waits for the heartbeat timeout: the launcher sees the exit itself. In an elastic
job (KVPS_ELASTIC, `kvps launch --elastic`) a worker that dies while others run is said and the
job goes on: the scheduler takes it out of the rounds, and the job's code is the other workers'.

A replicated job (KVPS_REPLICAS=R) goes on when a server dies, and the launcher starts a new server
as that node (same command, variables and key) once the scheduler has declared the old one dead, so
the job gets its R replicas back; at most `restart_servers` of them over the job
(kvps/launch/restarts.py keeps the count). A replacement's output keeps its node's prefix ("[S1]");
the launcher's lines call it by its child name ("S1#2", the second process to run as S1).

Started from a shell, each child gets a session of its own, so Ctrl-C reaches only the launcher,
which stops them. Started in a session of its own (as `kvps experiment` starts it, through
kvps.supervisor), the launcher keeps its children in its process group instead, so that whoever
started it can stop the whole job, whatever state the launcher is in, by signalling that group.
"""
import os
import shlex
import signal
import sys
import threading
import time

from kvps.errors import ConfigError, KVTimeoutError
from kvps.launch.restarts import Restarts, node_of
from kvps.supervisor import DRAIN_TIMEOUT, READY_TIMEOUT, STOP_GRACE, Supervisor, exit_code, leads_own_session

SERVER_ARGV = ["-m", "kvps.cli", "server"]      # after the placement's Python


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


def judge(name, returncode, workers_running, describe, replicated=False, elastic=False):
    """The line that stops a job when child `name` exits with `returncode`, or None when the job goes
    on: a failed worker stops it, unless other workers still run in an `elastic` job (KVPS_ELASTIC:
    the scheduler takes it out of the rounds), and so does a daemon that fails while workers still
    run (its death would reach the workers only after the heartbeat timeout), except a server of a
    `replicated` job (KVPS_REPLICAS: the scheduler moves its ranges to their replicas, or fails the
    job when none is left). describe(name, code) words it."""
    if not returncode:
        return None
    if name.startswith("W"):
        if elastic and workers_running:
            return None
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
                 placement=None, scheduler_host=None, scheduler_port=0, restart_servers=None, restart_workers=0):
        """restart_servers: the most servers started to replace dead ones in a replicated job
        (default: the number of servers; 0: none); restart_workers: the most workers started again,
        with the same command, in place of dead ones in an elastic job (default 0). Raises
        ConfigError for a bad job size, no command, or a restart budget that is negative or given for
        a job that cannot use it."""
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
        self.children = Supervisor(_under_node_names(self.out), new_session=not leads_own_session())
        self.scheduler_address = None
        self.secrets = {}                       # node name -> its secret file, for a CURVE job
        self.replicas = int(self.env.get("KVPS_REPLICAS") or 0)
        # (elastic membership is the parameter server's: a ring job still ends with its first dead worker)
        self.elastic = self.env.get("KVPS_ELASTIC", "0") not in ("", "0") and num_servers > 0
        if restart_workers < 0:
            raise ConfigError(f"--restart-workers {restart_workers}: the number of replacements cannot be negative")
        if restart_workers and not self.elastic:
            raise ConfigError(f"--restart-workers {restart_workers} replaces the dead workers of an elastic "
                              f"parameter-server job: it needs --elastic (KVPS_ELASTIC) and -s 1 or more")
        self.restart_workers = restart_workers
        self.worker_restarts = None             # Restarts of workers, from start() on, with restart_workers
        if restart_servers is not None and restart_servers < 0:
            raise ConfigError(f"--restart-servers {restart_servers}: the number of replacements cannot be negative")
        if restart_servers and not self.replicas:
            raise ConfigError(f"--restart-servers {restart_servers} replaces the dead servers of a replicated "
                              f"job: it needs --replicas R (KVPS_REPLICAS)")
        self.restart_servers = num_servers if restart_servers is None else restart_servers
        self.restarts = None                    # Restarts, from start() on, in a replicated job
        self.failed_over = set()                # servers that died while their replicas took over
        self.replacements = []                  # the child names of the servers started as replacements
        self.left_joining = set()               # replacements stopped at the end, still joining the job

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
        if self.replicas or self.restart_workers:
            from kvps.config import Config
            cfg = Config.from_env(self.env)
            # The scheduler checks every half interval for a node silent past the timeout.
            delay = cfg.heartbeat_timeout + cfg.heartbeat_interval
            if self.replicas:
                self.restarts = Restarts(self.restart_servers, delay)
            if self.restart_workers:
                self.worker_restarts = Restarts(self.restart_workers, delay, "--restart-workers")
        scheduler_env = dict(self.env, **self.job_env(), KVPS_ROLE="scheduler")
        if self.secrets:
            scheduler_env["KVPS_SECRET_FILE"] = self.secrets["H"]
        self.children.spawn("H", self.scheduler_argv(), env=scheduler_env, ready=True)
        try:
            self.scheduler_address = self.children.ready("H", READY_TIMEOUT)
            if self.placement.announce:
                self._say(f"scheduler ready at {self.scheduler_address}")
            for rank in range(self.num_servers):
                self._spawn(f"S{rank}", *self._node_command(f"S{rank}"))
            for rank in range(self.num_workers):
                try:
                    self._spawn(f"W{rank}", *self._node_command(f"W{rank}"))
                except OSError as exc:
                    hint = (f" (a Python script runs with its Python: kvps launch ... -- python "
                            f"{shlex.join(self.command)})" if self.command[0].endswith(".py") else "")
                    raise ConfigError(f"cannot start the worker command {shlex.join(self.command)!r}: "
                                      f"{exc.strerror or exc}{hint}") from None
        except BaseException:
            self.stop()
            raise
        return self

    def _node_command(self, node):
        """(argv, the node's own variables) that start node `node` ("S1", "W0"), or a replacement of it."""
        rank = int(node[1:])
        if node[0] == "S":
            return [self.python, *SERVER_ARGV], {"KVPS_ROLE": "server", "KVPS_RANK": str(rank)}
        return self.command, dict({"KVPS_ROLE": "worker", "KVPS_RANK": str(rank)}, **self.worker_env.get(rank, {}))

    def _spawn(self, name, argv, node_env):
        """Start child `name` (a node's name, or a replacement's "S1#2") with the node's key."""
        env = dict(self.job_env(), **node_env)
        if self.secrets:
            env.update(self.placement.secret_env(self.secrets[node_of(name)]))
        self.placement.spawn(self.children, name, argv, self.env, env)

    def wait(self, timeout=None):
        """Supervise until the workers finish; returns the job's exit code. A failed worker, or a
        daemon that fails while workers run, stops the job at once; a server of a replicated job
        is replaced instead (see the module docstring). With a timeout (seconds), a job still
        running then is stopped and KVTimeoutError raised."""
        workers = [n for n in self.children.procs if n.startswith("W")]
        code = 0
        give_up = None if timeout is None else time.monotonic() + timeout
        while self.children.running(workers) or (self.worker_restarts and self.worker_restarts.pending):
            wake = min((t for t in (give_up, self.restarts and self.restarts.next_due(),
                                    self.worker_restarts and self.worker_restarts.next_due()) if t), default=None)
            exited = self.children.wait_any(None if wake is None else wake - time.monotonic())
            if exited is None:
                if give_up is not None and time.monotonic() >= give_up:
                    running = ", ".join(self.children.running(workers))
                    self.stop()
                    raise KVTimeoutError(f"the job did not finish within {timeout:g} s (workers still running: "
                                         f"{running or 'none'}); stopped it")
                self._replace_due()
                workers = [n for n in self.children.procs if n.startswith("W")]      # and the replacements
                continue
            name, returncode = exited
            running = bool(self.children.running(workers))
            verdict = judge(name, returncode, running, self.placement.describe, replicated=self.replicas > 0,
                            elastic=self.elastic)
            if returncode and verdict is None and name.startswith("W"):
                self._say(f"worker {self.placement.describe(name, returncode)}; the job goes on with the other "
                          f"workers (KVPS_ELASTIC: the scheduler takes it out of the rounds once its heartbeats "
                          f"stop){self._replace_worker_later(name)}")
            if returncode and verdict is None and name.startswith("S") and self.replicas:
                self._say(f"{self.placement.describe(name, returncode)}; its key ranges go on at their "
                          f"replicas (KVPS_REPLICAS={self.replicas})"
                          f"{self._replace_later(name, bool(self.children.running(workers)))}")
                self.failed_over.add(name)
            if verdict:
                self._say(verdict)
                code = exit_code(returncode)
                break
        else:
            code = self._unreported_failure()
        for restarts in (self.restarts, self.worker_restarts):
            if restarts:
                restarts.cancel()                # the workers are done, or the job is stopping
        if code == 0:
            self.children.wait(DRAIN_TIMEOUT, [n for n in self.children.procs if n not in self.replacements])
            self._end_replacements()
        self.stop()
        if code == 0:
            daemons = [(n, c) for n, c in self.children.poll().items()
                       if not n.startswith("W") and c and n not in self.failed_over | self.left_joining]
            if daemons:
                self._say("daemons exited with errors: " +
                          ", ".join(self.placement.describe(n, c) for n, c in daemons))
                code = exit_code(daemons[0][1]) or 1
        return code

    def _unreported_failure(self):
        """The last workers can end at once: the loop stops when none runs, and exits it has not
        handled yet wait in the Supervisor's queue. The first failed worker among them gives the job
        its code (said as any other), or 0."""
        while True:
            exited = self.children.wait_any(0)
            if exited is None:
                return 0
            name, returncode = exited
            verdict = judge(name, returncode, False, self.placement.describe)
            if verdict and name.startswith("W"):
                self._say(verdict)
                return exit_code(returncode)

    def _replace_later(self, name, workers_running):
        """Plan the replacement of the dead server child `name`; the words that say what was decided."""
        node = node_of(name)
        if not workers_running:
            return ""                            # the job is ending: nothing to replace it for
        if not self.children.running(["H"]):
            return "; not replacing it: the scheduler has exited"
        decision = self.restarts.died(node, time.monotonic())
        if decision.start_at is None:
            return f"; not replacing it: {decision.why}"
        return (f"; starting a replacement {node} in {self.restarts.delay:.1f} s, once the scheduler has "
                f"declared it dead (restart {decision.number} of {self.restarts.budget}, --restart-servers)")

    def _replace_worker_later(self, name):
        """Plan the start of a new worker in place of the dead child `name` (--restart-workers); the
        words that say what was decided."""
        if not self.worker_restarts:
            return "; a worker started again with the same command joins the job (or: --restart-workers N)"
        node = node_of(name)
        decision = self.worker_restarts.died(node, time.monotonic())
        if decision.start_at is None:
            return f"; not starting it again: {decision.why}"
        return (f"; starting it again in {self.worker_restarts.delay:.1f} s, once the scheduler has taken it out "
                f"(restart {decision.number} of {self.worker_restarts.budget}, --restart-workers)")

    def _replace_due(self):
        """Start the replacements that are due (dead workers of an elastic job, --restart-workers; dead
        servers of a replicated one), unless the scheduler is gone (the job is ending)."""
        now = time.monotonic()
        for restarts in (self.worker_restarts, self.restarts):
            for node, decision in (restarts.due(now) if restarts else ()):
                if not self.children.running(["H"]):
                    self._say(f"not replacing {node}: the scheduler has exited")
                    continue
                server = node.startswith("S")
                child = restarts.child(node)
                self._say(f"starting a replacement {node} ({child}, restart {decision.number} of {restarts.budget}): "
                          + (f"it takes the rank of {node} and gets its state from the replicas" if server
                             else "it joins the job at its next rounds"))
                try:
                    self._spawn(child, *self._node_command(node))
                except OSError as exc:
                    self._say(f"could not start {child}: {exc}; the job goes on "
                              + ("at the replicas" if server else "without it"))
                    continue
                if server:
                    self.replacements.append(child)

    def _end_replacements(self):
        """The workers are done and the other daemons have had their time to end. A replacement that
        joined was told to shut down like the others; one started near the end may have been still
        joining when the scheduler left, and then waits out its heartbeat timeout and exits non-zero.
        Either is said, not counted against the job: the workers had finished. One still running
        after a grace is stopped."""
        ended = [c for c in self.replacements if c not in self.failed_over]
        self.children.wait(STOP_GRACE, ended)
        for child, returncode in self.children.poll().items():
            if child not in ended or returncode == 0:
                continue
            what = f"{child} was still running" if returncode is None else self.placement.describe(child, returncode)
            self._say(f"{what} after the workers had finished: a replacement of {node_of(child)} still joining "
                      f"as the job ended{'; stopping it' if returncode is None else ''}; not counted as a failure")
            self.left_joining.add(child)

    def stop(self):
        """Stop every child still running (SIGTERM, then SIGKILL), by pid."""
        self.children.stop()

    def _say(self, text):
        self.children.emit("launch", text)


def _under_node_names(out):
    """The Supervisor's output sink for a job: a replacement's lines come out under its node's prefix
    ("[S1]" for child S1#2), to a text stream or a callable(prefix, line) as `out` is."""
    if hasattr(out, "write"):
        def write(prefix, text):
            out.write(f"[{node_of(prefix)}] {text}\n")
            out.flush()
        return write
    return lambda prefix, text: out(node_of(prefix), text)


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
