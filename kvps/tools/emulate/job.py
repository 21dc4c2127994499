"""A kvps job on an emulated network: the scheduler, S servers and W workers, each in a host namespace.

    with Network() as net:
        job = EmulatedJob(net, workers=2, servers=1, command=["python", "train.py"])
        net.up(job.hosts, rate="1gbit")
        codes = job.run(timeout=600)            # the workers' exit codes, in rank order

    run_job(2, 1, ["python", "train.py"], rate="100mbit")   # the same, network included

Placement: the scheduler alone on h0 (its traffic is a few small messages). Dedicated servers
(the default) get hosts h1..hS and the workers h(S+1)..h(S+W); co-located servers share the
first S workers' hosts (server j with worker j), so a job of W workers uses W+1 hosts.
Every node advertises its host's 198.18 address (KVPS_HOST); servers bind it.

Each child's output is printed with its role and rank ([H], [S0], [W1]), as `kvps launch` does.
A failing worker stops the job; every wait has a deadline; only processes this job started are
stopped, by pid (kvps.supervisor does the spawning, the READY line, the output and the stopping).

HostJob is what every job on the hosts shares (each node's argv wrapped to run inside its host, the
job's deadlines and exit rules); EmulatedJob is kvps's, baselines.py has gloo's and MXNet's.
"""
import os
import subprocess
import sys
import time

from kvps.errors import ConfigError, KVTimeoutError, NodeFailure
from kvps.supervisor import DRAIN_TIMEOUT, READY_TIMEOUT, Supervisor

from kvps.tools.emulate.network import STOP_TIMEOUT, Network

JOB_TIMEOUT = 600.0       # default deadline for a whole job


def placement(workers, servers, colocated=False):
    """{node name: host name} for a job: H, S0.., W0.. (see the module docstring).
    Raises ConfigError for a shape that cannot be placed."""
    if workers < 1 or servers < 0:
        raise ConfigError(f"a job needs at least one worker and no negative number of servers "
                          f"(got {workers} workers, {servers} servers; 0 servers: a ring all-reduce job)")
    if colocated and servers > workers:
        raise ConfigError(f"{servers} co-located servers need at least {servers} worker hosts (got {workers} workers)")
    places = {"H": "h0"}
    first_worker = 1 if colocated else 1 + servers
    for j in range(servers):
        places[f"S{j}"] = f"h{first_worker + j}" if colocated else f"h{1 + j}"
    for i in range(workers):
        places[f"W{i}"] = f"h{first_worker + i}"
    return places


class HostJob:
    """Processes placed on the hosts of an up Network, started and stopped by this object only.

    Nodes are named H (the rendezvous: a scheduler or a store), S<j> (servers) and W<i> (workers);
    `places` maps each to its host, `environ` is every process's base environment. A subclass's
    start() spawns the nodes; the job is done when every worker has exited."""

    daemons_exit = True     # H and the servers exit by themselves once the workers are done (else: stopped)

    def __init__(self, net, places, environ, out=None):
        self.net = net
        self.places = dict(places)
        self.hosts = sorted(set(self.places.values()), key=lambda h: int(h[1:]))
        self.workers = sum(1 for n in self.places if n.startswith("W"))
        self.env = dict(environ)
        self.out = out or sys.stdout
        self.children = Supervisor(self.out)

    @property
    def procs(self):
        """{node name: Popen} of the nodes started so far."""
        return self.children.procs

    def describe(self):
        """One line per host: its address and the nodes on it."""
        lines = []
        for host in self.hosts:
            nodes = [n for n, h in self.places.items() if h == host]
            lines.append(f"{host} {self.net.address(host)}: {' '.join(nodes)}")
        return lines

    def address(self, name):
        """The 198.18 address of the host node `name` runs on."""
        return self.net.address(self.places[name])

    # ---- starting ----
    def start(self):
        """Start every node; returns self. Raises KVTimeoutError (after stopping what it started)
        if a node that should print READY does not."""
        raise NotImplementedError

    def _spawn(self, name, argv, extra_env, ready=False):
        """Start node `name` inside its host's namespace (`ip netns exec` execs argv: the child's pid is
        the node's). Returns its Popen, or with ready=True the word after the `READY` line it prints
        (waiting READY_TIMEOUT for it). Raises ConfigError for a host the network does not have."""
        host = self.places[name]
        proc = self.children.spawn(name, self.net.command(host, argv), env=dict(self.env, **extra_env),
                                   ready=ready, stdin=subprocess.DEVNULL)
        if not ready:
            return proc
        try:
            return self.children.ready(name, READY_TIMEOUT)
        except KVTimeoutError as exc:
            self.stop()
            raise KVTimeoutError(f"on {host}: {exc}") from None

    # ---- waiting ----
    def wait(self, timeout=JOB_TIMEOUT):
        """The workers' exit codes in rank order, once they have all exited or one has failed (the
        others are then stopped: their codes are negative signal numbers). Then gives the daemons
        DRAIN_TIMEOUT to exit (if daemons_exit) and stops the rest. Raises KVTimeoutError, after
        stopping the job, naming the workers still running when `timeout` seconds pass, and
        NodeFailure if the rendezvous or a server exits with an error while workers run."""
        deadline = time.monotonic() + timeout
        workers = [f"W{i}" for i in range(self.workers)]
        pending = set(workers)          # workers whose exit has not been seen yet (each is reported once)
        try:
            while pending:
                exited = self.children.wait_any(deadline - time.monotonic())
                if exited is None:
                    running = self.children.running(workers)
                    raise KVTimeoutError(f"workers {', '.join(running)} still running after {timeout:g} s")
                name, code = exited
                pending.discard(name)
                if code and name.startswith("W"):
                    self.say(f"worker {name} exited with code {code}; stopping the job")
                    break
                if code and not name.startswith("W") and self.children.running(pending):
                    raise NodeFailure(f"{name} on {self.places[name]} exited with code {code} while workers ran")
            failed = any(self.children.poll()[w] for w in workers)
            self.children.wait(DRAIN_TIMEOUT if self.daemons_exit and not failed else 0)
        finally:
            self.stop()
        codes = self.children.poll()
        return [codes[w] for w in workers]

    def run(self, timeout=JOB_TIMEOUT):
        """start(), then wait(timeout); stops the job however it ends (Ctrl-C included)."""
        try:
            self.start()
            return self.wait(timeout)
        finally:
            self.stop()

    def stop(self):
        """Stop every child of this job still running, by pid (SIGTERM, SIGKILL after STOP_TIMEOUT)."""
        self.children.stop(STOP_TIMEOUT)

    def say(self, text):
        self.children.emit("emulate", text)


class EmulatedJob(HostJob):
    """The processes of one kvps job: scheduler, servers and workers (see the module docstring)."""

    def __init__(self, net, workers, servers, command, colocated=False, env=None, out=None, python=None):
        if not command:
            raise ConfigError("no worker command given: kvps emulate -n W -s S -- python train.py")
        super().__init__(net, placement(workers, servers, colocated), dict(os.environ, **(env or {})), out)
        self.servers, self.colocated = servers, colocated
        self.command = list(command)
        self.python = python or sys.executable
        self.scheduler_address = None
        self.secrets = None                 # node name -> its secret file, made as the job starts
        # Emulated jobs are benchmarks beside MXNet and gloo, which encrypt nothing: plain links
        # unless the caller sets KVPS_CURVE (KVPS_CURVE=1 measures the cost of CurveZMQ on a link).
        self.env.setdefault("KVPS_CURVE", "0")

    def start(self):
        """Start the scheduler, wait for its READY line, then the servers and workers. Returns self.
        Raises KVTimeoutError (after stopping what it started) if the scheduler does not get ready."""
        base = {"KVPS_NUM_WORKERS": str(self.workers), "KVPS_NUM_SERVERS": str(self.servers),
                "PYTHONUNBUFFERED": "1"}
        self.scheduler_address = self._spawn(
            "H", [self.python, "-m", "kvps.cli", "scheduler", "--host", self.address("H"), "--port", "0"],
            self._node_env("H", base, KVPS_ROLE="scheduler"), ready=True)
        base["KVPS_SCHEDULER"] = self.scheduler_address
        for j in range(self.servers):
            self._spawn(f"S{j}", [self.python, "-m", "kvps.cli", "server"],
                        self._node_env(f"S{j}", base, KVPS_ROLE="server", KVPS_RANK=str(j)))
        for i in range(self.workers):
            self._spawn(f"W{i}", self.command, self._node_env(f"W{i}", base, KVPS_ROLE="worker", KVPS_RANK=str(i)))
        return self

    def _node_env(self, name, base, **extra):
        env = dict(base, **extra, KVPS_HOST=self.address(name))
        if self.secrets is None:    # its nodes talk across hosts: CURVE unless KVPS_CURVE=0 (docs/security.md)
            from kvps.launch.job import make_keys
            self.secrets = make_keys(self.env, self.workers, self.servers, remote=True)
        if self.secrets:
            env["KVPS_SECRET_FILE"] = self.secrets[name]
        return env


def run_job(workers, servers, command, colocated=False, rate="1gbit", delay_ms=0.0, mtu=1500,
            timeout=JOB_TIMEOUT, env=None, out=None):
    """Build a network for the job, run it, tear everything down; returns the workers' exit codes.
    Raises ConfigError, EmulationError (NotPermitted where namespaces are not allowed),
    KVTimeoutError and NodeFailure."""
    with Network() as net:
        job = EmulatedJob(net, workers, servers, command, colocated, env, out)
        net.up(job.hosts, rate=rate, delay_ms=delay_ms, mtu=mtu)
        for line in job.describe():
            job.say(line)
        return job.run(timeout)
