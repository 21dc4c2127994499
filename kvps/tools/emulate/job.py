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
stopped, by pid (through Network.stop).

HostJob is what every job on the hosts shares (spawning a node inside its host, the READY line,
output, deadlines, stopping); EmulatedJob is kvps's, baselines.py has gloo's and MXNet's.
"""
import os
import queue
import selectors
import subprocess
import sys
import threading
import time

from kvps.errors import ConfigError, KVTimeoutError, NodeFailure

from kvps.tools.emulate.network import Network

READY_TIMEOUT = 30.0      # seconds for the scheduler to print READY
DRAIN_TIMEOUT = 30.0      # seconds for the servers and scheduler to exit once the workers are done
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
        self.procs = {}                 # node name -> Popen
        self._exited = queue.Queue()    # node names, as their processes exit
        self._lock = threading.Lock()
        self._threads = []

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
        """Start node `name` inside its host's namespace. Returns its Popen, or with ready=True the
        word after the `READY` line it prints (waiting READY_TIMEOUT for it)."""
        # A pipe that must be read line by line before the pump starts is unbuffered, so the select()
        # in _await_ready sees every line.
        proc = self.net.popen(self.places[name], argv, env=dict(self.env, **extra_env), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0 if ready else -1)
        self.procs[name] = proc
        word = self._await_ready(name, proc) if ready else None
        self._watch(name, proc)
        return word if ready else proc

    def _await_ready(self, name, proc):
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + READY_TIMEOUT
        said = []
        try:
            while sel.select(max(0.0, deadline - time.monotonic())):
                line = proc.stdout.readline().decode(errors="replace")
                if not line:
                    break
                if line.startswith("READY "):
                    return line.split()[1]
                said.append(line)
        finally:
            sel.close()
        self.stop()
        raise KVTimeoutError(f"{name} on {self.places[name]} did not print READY within {READY_TIMEOUT:g} s"
                             f" (exit code {proc.poll()}); it said:\n" + "".join(said))

    def _watch(self, name, proc):
        """Two threads per child: one prints its output with a prefix, one reports its exit."""
        def pump():
            for line in iter(proc.stdout.readline, b""):
                self._write(f"[{name}] {line.decode(errors='replace')}")
            proc.stdout.close()

        def reap():
            proc.wait()
            self._exited.put(name)

        for target in (pump, reap):
            t = threading.Thread(target=target, name=f"emulate-{name}-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)

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
                try:
                    name = self._exited.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    running = [w for w in workers if self.procs[w].poll() is None]
                    raise KVTimeoutError(f"workers {', '.join(running)} still running after {timeout:g} s") from None
                pending.discard(name)
                code = self.procs[name].returncode
                if code and name.startswith("W"):
                    self.say(f"worker {name} exited with code {code}; stopping the job")
                    break
                if code and not name.startswith("W") and any(self.procs[w].poll() is None for w in pending):
                    raise NodeFailure(f"{name} on {self.places[name]} exited with code {code} while workers ran")
            failed = any(self.procs[w].returncode for w in workers)
            self._drain(DRAIN_TIMEOUT if self.daemons_exit and not failed else 0)
        finally:
            self.stop()
        return [self.procs[w].returncode for w in workers]

    def _drain(self, seconds):
        deadline = time.monotonic() + seconds
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:      # stop() ends it
                break

    def run(self, timeout=JOB_TIMEOUT):
        """start(), then wait(timeout); stops the job however it ends (Ctrl-C included)."""
        try:
            self.start()
            return self.wait(timeout)
        finally:
            self.stop()

    def stop(self):
        """Stop every child of this job still running (by pid, through the network)."""
        self.net.stop(list(self.procs.values()))
        for t in self._threads:
            t.join(2)

    def say(self, text):
        self._write(f"[emulate] {text}\n")

    def _write(self, text):
        with self._lock:
            self.out.write(text)
            self.out.flush()


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
        return dict(base, **extra, KVPS_HOST=self.address(name))


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
