"""kvps on a Ray cluster: the scheduler, servers and workers as Ray actors, spread by a placement group.

    kvps launch --launcher ray -n 2 -s 2 [--address ADDR] -- python train.py    # a whole job

    import kvps.ray
    def train():                           # runs in each worker, with KVPS_RANK etc. set
        kv = kvps.create("dist_sync")
        ...
        return result
    results = kvps.ray.run(train, num_workers=2, num_servers=2)     # [W0's result, W1's result]

Every process of the job is one actor in one bundle of a placement group with the SPREAD strategy,
so the servers and workers go to different nodes where the cluster has them. The scheduler and
each server (and, for `kvps launch`, each worker command) run under kvps.launch.tether in their
actor: a process whose actor dies (the driver stopped, Ctrl-C, a node lost) is stopped with it.
The driver polls each actor for its output lines, prints them with the usual prefixes ([H], [S0],
[W1]), and applies the launcher's rules (kvps/launch/job.py): a failed worker's exit code becomes
the launcher's, and a daemon that dies while workers run stops the job at once.

With no --address (and no RAY_ADDRESS), a local Ray instance is started for the job and shut down
after it. Needs `pip install 'kvps[ray]'`. Ray's own driver-to-actor calls carry the function and
its results (Ray serialises them with cloudpickle); kvps's network traffic never does.
"""
import os
import queue
import subprocess
import sys
import threading
import time

from kvps.errors import ConfigError, KVPSError, KVTimeoutError
from kvps.launch import tether
from kvps.launch.job import forwarded_env, judge, make_keys, signal_name
from kvps.supervisor import DRAIN_TIMEOUT, READY_TIMEOUT, exit_code

PLACEMENT_TIMEOUT = 60.0   # seconds for the cluster to grant the placement group
POLL_SECONDS = 0.5         # how long one read() call waits for output before it returns
STOP_TIMEOUT = 15.0        # seconds for the actors to stop their processes
SCHEDULER_CPUS = 0.1       # the scheduler's bundle: it only routes control messages


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("the Ray launcher needs Ray: pip install 'kvps[ray]'") from None
    return ray


class Process:
    """Actor body: one process of the job, under a tether, and its output lines (kept in a queue
    until the driver reads them). Made a Ray actor class by _actor_class()."""

    def __init__(self, name):
        self.name = name
        self.proc = None
        self.lines = queue.Queue()
        self.done = threading.Event()

    def node(self):
        import ray
        return ray.util.get_node_ip_address()

    def start(self, argv, env, cwd, python=None):
        """Start argv ("{node}" in it: this node's address; "{python}": `python`, else this actor's
        interpreter); returns this node's IP address. Raises OSError if it cannot start."""
        python = python or sys.executable
        argv = [self.node() if a == "{node}" else python if a == "{python}" else a for a in argv]
        self.proc = subprocess.Popen([python, "-m", "kvps.launch.tether"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     cwd=cwd if cwd and os.path.isdir(cwd) else None, start_new_session=True)
        self.proc.stdin.write(tether.encode(argv, env))
        self.proc.stdin.flush()        # held open: its end of file (this actor gone) stops the process
        threading.Thread(target=self._pump, daemon=True).start()
        return self.node()

    def _pump(self):
        for raw in iter(self.proc.stdout.readline, b""):
            self.lines.put(raw.decode(errors="replace").rstrip("\r\n"))
        self.proc.wait()
        self.done.set()

    def read(self, timeout=POLL_SECONDS):
        """(new output lines, the exit code once it has exited and all its output is read, else None)."""
        out = []
        try:
            out.append(self.lines.get(timeout=timeout))
            while len(out) < 1000:
                out.append(self.lines.get_nowait())
        except queue.Empty:
            pass
        finished = self.done.is_set() and self.lines.empty()
        return out, (self.proc.returncode if finished else None)

    def stop(self, grace=STOP_TIMEOUT / 2):
        """Close the tether's stdin (it stops its command: SIGTERM, then SIGKILL); kill it if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def call(self, fn, env):
        """Run fn() in this actor's process with the job's variables set (kvps.ray.run's workers)."""
        import gc
        os.environ.update(env)
        try:
            return fn()
        finally:
            gc.collect()               # a kvstore fn dropped leaves the job now (weakref.finalize)


def _describe(nodes):
    def describe(name, code):
        where = f" on node {nodes[name]}" if nodes.get(name) else ""
        if 128 < code < 128 + 65:
            return f"{name} was killed by {signal_name(code - 128)}{where}"
        return f"{name}{where} exited with code {code}"
    return describe


class RayJob:
    """One job's actors on a Ray cluster; start() makes the placement group, the scheduler and the
    servers, start_workers() the workers; stop() takes everything down."""

    def __init__(self, num_workers, num_servers, env=None, address=None, cpus=1.0, python=None, out=None):
        if num_workers < 1 or num_servers < 0:
            raise ConfigError(f"a job needs at least one worker and no negative number of servers "
                              f"(got -n {num_workers} -s {num_servers})")
        if cpus <= 0:
            raise ConfigError(f"--cpus-per-process {cpus:g} must be positive")
        self.ray = _ray()
        self.num_workers, self.num_servers, self.cpus = num_workers, num_servers, float(cpus)
        self.python, self.out = python, out
        self.address = address
        self.env = forwarded_env(os.environ, dict(env or {}))
        self.job_env = {"KVPS_NUM_WORKERS": str(num_workers), "KVPS_NUM_SERVERS": str(num_servers),
                        "PYTHONUNBUFFERED": "1"}
        self.actors = {}           # name -> actor handle, in start order
        self.streams = []          # the names whose actor runs a process (and has output to read)
        self.nodes = {}            # name -> node IP
        self.tails = {}            # name -> its last lines (for error messages)
        self.started_ray = False
        self.group = None
        self.failure = None        # (worker name, the exception its fn raised), for kvps.ray.run
        self.secrets = {}          # name -> {"KVPS_SECRET": its secret file's text}
        self.finished = {}

    # ---- starting ----
    def start(self):
        ray = self.ray
        if not ray.is_initialized():
            if self.address is None and not os.environ.get("RAY_ADDRESS"):
                needed = SCHEDULER_CPUS + self.cpus * (self.num_workers + self.num_servers)
                # "local": a new instance, even where `ray start` left an address file behind
                ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)),
                         include_dashboard=False, log_to_driver=False, configure_logging=False)
            else:
                ray.init(address=self.address, log_to_driver=False, configure_logging=False)
            self.started_ray = True
        from ray.util.placement_group import placement_group
        bundles = [{"CPU": SCHEDULER_CPUS}] + [{"CPU": self.cpus}] * (self.num_servers + self.num_workers)
        self.group = placement_group(bundles, strategy="SPREAD")
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            raise KVTimeoutError(f"the Ray cluster did not grant {len(bundles)} bundles ({bundles[0]}, then "
                                 f"{self.cpus:g} CPU each) within {PLACEMENT_TIMEOUT:g} s; it has "
                                 f"{ray.cluster_resources()}; lower --cpus-per-process or add nodes") from None
        # Every actor is created now, so their processes boot side by side while the scheduler starts.
        for i, name in enumerate(["H"] + [f"S{r}" for r in range(self.num_servers)] +
                                 [f"W{r}" for r in range(self.num_workers)]):
            self._actor(name, i)
        self.secrets = {}
        for name, path in make_keys(dict(os.environ, **self.env), self.num_workers, self.num_servers, True).items():
            with open(path) as f:       # to each actor in its start() call, never on a command line
                self.secrets[name] = {"KVPS_SECRET": f.read()}
        self._spawn([("H", ["{python}", "-m", "kvps.cli", "scheduler", "--host", "{node}", "--port", "0",
                            "-n", str(self.num_workers), "-s", str(self.num_servers)],
                      dict(self.job_env, KVPS_ROLE="scheduler"))])
        address = self._wait_ready("H")
        self.job_env["KVPS_SCHEDULER"] = address
        self._say(f"scheduler ready at {address}")
        self._spawn([(f"S{rank}", ["{python}", "-m", "kvps.cli", "server"],
                      dict(self.job_env, KVPS_ROLE="server", KVPS_RANK=str(rank))) for rank in range(self.num_servers)])
        return self

    def _actor(self, name, bundle):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        cls = self.ray.remote(Process)
        cpus = SCHEDULER_CPUS if bundle == 0 else self.cpus
        actor = cls.options(num_cpus=cpus, max_concurrency=4, name=None, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=bundle)).remote(name)
        self.actors[name] = actor
        self.tails[name] = []
        return actor

    def _spawn(self, specs):
        """Start [(name, argv, env)] in their actors, side by side; waits until all have started."""
        refs = [self.actors[name].start.remote(argv, self.node_env(name, env), os.getcwd(), self.python)
                for name, argv, env in specs]
        for (name, _, _), node in zip(specs, self.ray.get(refs, timeout=READY_TIMEOUT)):
            self.nodes[name] = node
            self.streams.append(name)

    def node_env(self, name, env):
        """What node `name`'s process gets: the forwarded variables, `env`, and its secret keys."""
        return dict(self.env, **env, **self.secrets.get(name, {}))

    def _wait_ready(self, name):
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            lines, code = self.ray.get(self.actors[name].read.remote(), timeout=READY_TIMEOUT)
            for line in lines:
                if line.startswith("READY "):
                    return line.split()[1]
                self._record(name, line)
            if code is not None:
                raise KVTimeoutError(f"{name} exited with code {code} before it printed READY; "
                                     f"its last output:\n" + "\n".join(self.tails[name]))
        raise KVTimeoutError(f"{name} did not print READY within {READY_TIMEOUT:g} s")

    def start_workers(self, command, worker_env=None):
        """Run the worker command W times (kvps launch); worker_env: {rank: extra variables}."""
        self._spawn([(f"W{rank}", list(command), dict(self.job_env, KVPS_ROLE="worker", KVPS_RANK=str(rank),
                                                      **(worker_env or {}).get(rank, {})))
                     for rank in range(self.num_workers)])
        self._say("placed " + ", ".join(f"{name} on {node}" for name, node in self.nodes.items()))

    # ---- watching ----
    def _record(self, name, line):
        tail = self.tails[name]
        tail.append(line)
        del tail[:-40]
        if self.out is not None:
            self.out.write(f"[{name}] {line}\n")
            self.out.flush()

    def _say(self, text):
        if self.out is not None:
            self.out.write(f"[launch] {text}\n")
            self.out.flush()

    def watch(self, results=None):
        """Stream every actor's output until the workers finish; returns the job's exit code.
        results: {ref: name} of kvps.ray.run's worker calls, watched with the daemons."""
        ray = self.ray
        pending = {self.actors[name].read.remote(): name for name in self.streams}
        pending.update(results or {})
        finished = {}
        workers = [f"W{r}" for r in range(self.num_workers)]
        running = set(workers)
        code = 0
        while running:
            ready, _ = ray.wait(list(pending), num_returns=1)
            ref = ready[0]
            name = pending.pop(ref)
            try:
                value = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._say(f"{name}: its Ray actor died ({str(exc).splitlines()[0]}); stopping the job")
                return 1
            except ray.exceptions.RayTaskError as exc:      # kvps.ray.run: fn raised
                cause = getattr(exc, "cause", None) or exc
                self.failure = (name, cause)
                self._say(f"worker {name} raised {type(cause).__name__}: {cause}; stopping the job")
                return 1
            if results and ref in results:
                finished[name] = value
                running.discard(name)
                continue
            lines, returncode = value
            for line in lines:
                self._record(name, line)
            if returncode is None:
                pending[self.actors[name].read.remote()] = name
                continue
            finished[name] = returncode
            running.discard(name)
            elastic = self.env.get("KVPS_ELASTIC", "0") not in ("", "0") and self.num_servers > 0
            verdict = judge(name, returncode, bool(running), _describe(self.nodes), elastic=elastic)
            if returncode and verdict is None and name.startswith("W"):
                self._say(f"worker {_describe(self.nodes)(name, returncode)}; the job goes on with the other "
                          f"workers (KVPS_ELASTIC)")
            if verdict:
                self._say(verdict)
                code = exit_code(returncode)
                break
        self.finished = finished
        if code == 0:
            code = self._drain(pending)
        return code

    def _drain(self, pending):
        """Once the workers are done: the daemons' exits (they leave by themselves), within DRAIN_TIMEOUT."""
        ray = self.ray
        deadline = time.monotonic() + DRAIN_TIMEOUT
        daemons = {}
        while pending and time.monotonic() < deadline:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            name = pending.pop(ready[0])
            try:
                lines, returncode = ray.get(ready[0])
            except ray.exceptions.RayError:
                daemons[name] = 1
                continue
            for line in lines:
                self._record(name, line)
            if returncode is None:
                pending[self.actors[name].read.remote()] = name
            elif not name.startswith("W"):
                daemons[name] = returncode
        bad = [(n, c) for n, c in daemons.items() if c]
        if bad:
            self._say("daemons exited with errors: " + ", ".join(_describe(self.nodes)(n, c) for n, c in bad))
            return exit_code(bad[0][1]) or 1
        return 0

    # ---- stopping ----
    def stop(self):
        """Stop every process and actor, remove the placement group, and shut down a Ray we started."""
        ray = self.ray
        if not ray.is_initialized():
            return
        refs = [a.stop.remote() for a in self.actors.values()]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT)
        except Exception:
            pass
        for actor in self.actors.values():
            try:
                ray.kill(actor)
            except Exception:
                pass
        self.actors.clear()
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group
            try:
                remove_placement_group(self.group)
            except Exception:
                pass
            self.group = None
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False


def launch_ray(num_workers, num_servers, command, env=None, address=None, worker_env=None, python=None, cpus=1.0,
               out=None):
    """`kvps launch --launcher ray`: run a job on a Ray cluster; returns its exit code (130 on Ctrl-C)."""
    if not command:
        raise ConfigError("no worker command given: kvps launch --launcher ray -n W -s S -- python train.py")
    job = RayJob(num_workers, num_servers, env, address, cpus, python, out or sys.stdout)
    try:
        job.start()
        job.start_workers(command, worker_env)
        return job.watch()
    except KeyboardInterrupt:
        return 130
    finally:
        job.stop()


def run(fn, num_workers, num_servers=1, address=None, env=None, cpus_per_worker=1.0, out=None):
    """Run fn() in `num_workers` Ray actors that form a kvps job with `num_servers` servers (the
    scheduler and servers are actors too); returns [fn's result on W0, W1, ...]. fn calls
    kvps.create(...) itself; KVPS_RANK, KVPS_SCHEDULER and the job's size are set in its process.
    Raises KVPSError naming the worker whose fn raised or the daemon that died, after stopping
    the whole job. out: a stream for the daemons' output (default: none)."""
    if not callable(fn):
        raise ConfigError(f"kvps.ray.run needs a function to run on each worker, not {type(fn).__name__}")
    job = RayJob(num_workers, num_servers, env, address, cpus_per_worker, None, out)
    try:
        job.start()
        refs = {}
        for rank in range(num_workers):
            name = f"W{rank}"
            job.nodes[name] = job.ray.get(job.actors[name].node.remote(), timeout=READY_TIMEOUT)
            variables = job.node_env(name, dict(job.job_env, KVPS_ROLE="worker", KVPS_RANK=str(rank)))
            refs[job.actors[name].call.remote(fn, variables)] = name
        code = job.watch(results=refs)
        if job.failure:
            name, cause = job.failure
            raise KVPSError(f"worker {name} failed: {type(cause).__name__}: {cause}") from cause
        if code:
            tails = "\n".join(f"[{n}] {line}" for n, t in job.tails.items() for line in t[-5:])
            raise KVPSError(f"the kvps job on Ray failed (exit code {code}); the daemons' last output:\n{tails}")
        return [job.finished[f"W{r}"] for r in range(num_workers)]
    finally:
        job.stop()
