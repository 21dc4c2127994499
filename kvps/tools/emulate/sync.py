"""`kvps emulate sync`: one synchronous gradient step of kvps's parameter server and ring beside
gloo all-reduce and MXNet 1.9.1 dist_sync, on the same emulated hosts, each beside its bandwidth bound.

    kvps emulate sync -n 4 -s 1,4 --placement dedicated --workload resnet50 --steps 3 --mxnet ~/mxvenv/bin/python
    kvps emulate sync -n 2 --systems ring,gloo --workload 64MB
    kvps emulate sync -n 2 -s 2 --systems ps --replicas 1        # chain replication's cost beside R=0
    kvps emulate sync -n 2 --systems ps,geo --k-steps 1,4,16     # GEO-SGD's step beside the PS's

Systems (--systems, default ps,ring,gloo and mxnet when --mxnet PYTHON is given):

    ps      kvps dist_sync, both ways a step can go: push+pull (every push, then every pull, as MXNet
            does) and pushpull (one call); every W, S and placement asked for. With --replicas R,
            each also with KVPS_REPLICAS=R (chain replication) right after it, divided by it
    geo     kvps dist_geo:K (GEO-SGD, kvps/kvstore/geo.py) for each K of --k-steps (default 4), not
            by default: pushpull on each of K steps in a row, one of which syncs (the other K - 1
            travel nothing), reported per step; its baseline is the PS's pushpull, and a second
            table gives the bytes the servers moved per step, measured against the PS's
    mxnet   MXNet dist_sync push+pull, the same W, S and placement (baselines.py)
    ring    kvps's 'allreduce' kvstore (no servers), both ways; every W
    gloo    torch.distributed gloo all-reduce in DDP-style 25 MB buckets; every W

Every job runs on a network of its own, built for it and removed after it by a `with Network()`
block (on failure and Ctrl-C too), under --timeout. Each kvps setup runs right after its baseline
(MXNet before the PS at the same W, S and placement; gloo before the ring at the same W), so a
slow spell of a shared machine tends to hit both sides of a ratio. A job that fails is reported
(its output on stderr), its row reads "failed", and the others still run. The table comes last:
one row per system and mode with the median step, the bound (theory.py: the PS's for ps and
mxnet, with the chains' copies for R > 0; the ring's for ring and gloo), their ratio and the ratio
to the baseline measured in the same run (for a replicated PS row: the same mode without replicas).
"""
import collections
import json
import math
import os
import sys
import tempfile
import time

from kvps.errors import ConfigError, KVTimeoutError, NodeFailure

from kvps.tools.capture import Lines
from kvps.tools.emulate.baselines import EmulatedGlooJob, EmulatedMXNetJob
from kvps.tools.emulate.job import EmulatedJob
from kvps.tools.emulate.network import Network, show_rate
from kvps.tools.emulate.theory import theory
from kvps.tools.progress import Progress

SYSTEMS = ("ps", "geo", "mxnet", "ring", "gloo")   # also the run order within one W (see setups())
LABELS = {"ps": "kvps PS", "geo": "kvps GEO", "mxnet": "MXNet dist_sync", "ring": "kvps ring",
          "gloo": "gloo all-reduce"}
MODES = {"ps": ("push+pull", "pushpull"), "geo": ("pushpull",), "mxnet": ("push+pull",),
         "ring": ("pushpull", "push+pull"), "gloo": ("allreduce",)}
BASELINE = {"ps": "mxnet", "geo": "ps", "ring": "gloo"}    # what each kvps system's rows are divided by
KVTYPE = {"ps": "dist_sync", "mxnet": "dist_sync", "ring": "allreduce", "gloo": "allreduce"}
MXNET_WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "mxnet_worker.py")

Setup = collections.namedtuple("Setup", "system workers servers colocated replicas k_steps", defaults=(0, 0))
Setup.__doc__ = ("One job: a system on W workers with S servers (0 for ring and gloo), dedicated or co-located; "
                 "replicas: KVPS_REPLICAS of a kvps PS job (0: none); k_steps: K of a GEO job.")


def kvtype(setup):
    """The kvstore a setup's workers create."""
    return f"dist_geo:{setup.k_steps}" if setup.system == "geo" else KVTYPE[setup.system]


def parse_systems(text):
    """['ps', 'gloo'] from 'ps,gloo'; raises ConfigError naming an unknown system."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown or not names:
        what = f"unknown system {unknown[0]!r}" if unknown else f"no system in {text!r}"
        raise ConfigError(f"{what}; choose from {', '.join(SYSTEMS)}")
    return names


def choose_systems(asked, mxnet, gloo_why=None):
    """(systems to run in SYSTEMS order, notes on what was left out). asked: the --systems list, or
    None for the default (ps, ring, gloo, and mxnet when an MXNet Python is given). Raises ConfigError
    when mxnet is asked for without a Python, or gloo (`gloo_why`: why it cannot run) explicitly."""
    notes = []
    if asked is None:
        asked = ["ps", "ring", "gloo"] + (["mxnet"] if mxnet else [])
        if gloo_why:
            asked.remove("gloo")
            notes.append(f"(left out: gloo: {gloo_why})")
    elif "gloo" in asked and gloo_why:
        raise ConfigError(f"--systems gloo: {gloo_why}")
    if "mxnet" in asked and not mxnet:
        raise ConfigError("--systems mxnet needs --mxnet PYTHON (a Python with mxnet 1.9.1)")
    return [s for s in SYSTEMS if s in asked], notes


def shapes(workers, servers, placements):
    """(the (W, S, colocated) combinations that can run, notes on those left out). Raises ConfigError
    when none can."""
    out, notes = [], []
    for W in workers:
        for S in servers:
            for place in placements:
                if place == "colocated" and S > W:
                    notes.append(f"(left out: {S} co-located servers need at least {S} workers, not {W})")
                    continue
                out.append((W, S, place == "colocated"))
    if not out:
        raise ConfigError("no worker/server/placement combination can run")
    return out, notes


def setups(systems, combos, replicas=0, k_steps=(4,)):
    """Every job, in run order: per W, each (S, placement) with MXNet before kvps's PS, and kvps's
    PS with `replicas` right after the PS without (where S > replicas), then GEO for each K, then
    gloo before kvps's ring (each baseline next to what is divided by it)."""
    out = []
    for W in sorted({W for W, _, _ in combos}):
        for _, S, colocated in (c for c in combos if c[0] == W):
            out += [Setup(s, W, S, colocated) for s in ("mxnet", "ps") if s in systems]
            if replicas and "ps" in systems and S > replicas:
                out.append(Setup("ps", W, S, colocated, replicas))
            if "geo" in systems:
                out += [Setup("geo", W, S, colocated, 0, K) for K in k_steps]
        out += [Setup(s, W, 0, False) for s in ("gloo", "ring") if s in systems]
    return out


def check_replicas(replicas, systems, combos):
    """Notes on the (W, S, placement) combinations whose PS cannot have `replicas` (S must exceed R).
    Raises ConfigError when R is negative, when there are no kvps PS rows to replicate, or when no
    combination has servers enough."""
    if replicas < 0:
        raise ConfigError(f"--replicas {replicas} must not be negative")
    if not replicas:
        return []
    if "ps" not in systems:
        raise ConfigError(f"--replicas {replicas} replicates kvps's PS: --systems must include ps")
    short = sorted({S for _, S, _ in combos if S <= replicas})
    if len(short) == len({S for _, S, _ in combos}):
        raise ConfigError(f"--replicas {replicas} needs more than {replicas} servers: give -s {replicas + 1} or more")
    return [f"(left out: kvps PS R={replicas} with {S} server{'s' if S != 1 else ''}: a chain needs "
            f"{replicas + 1})" for S in short]


def check_k_steps(k_steps, systems):
    """Raises ConfigError for a K below 1, or --k-steps without geo rows."""
    if any(K < 1 for K in k_steps):
        raise ConfigError(f"--k-steps {','.join(map(str, k_steps))}: every K must be at least 1")
    if "geo" not in systems and tuple(k_steps) != (4,):
        raise ConfigError("--k-steps sets the GEO rows' K: --systems must include geo")


def make_plan(workload, steps):
    """(the workers' plan, a phrase for the header, bytes per step). The plan always times one
    gradient set (workloads.py's "resnet" entry): ResNet-50's 161 tensors or one float32 array, so
    every system's worker (kvps_worker, mxnet_worker, gloo_worker) runs the same step. Raises ConfigError."""
    from kvps.tools.bench import workloads

    if steps < 1:
        raise ConfigError(f"--steps {steps} must be at least 1")
    plan = workloads.make_plan(sizes=(), resnet_steps=steps, quick=True)
    if workload == "resnet50":
        what = "ResNet-50 (161 tensors)"
    else:
        try:
            size = workloads.parse_size(workload)
        except ValueError as exc:
            raise ConfigError(f"--workload: {exc}") from None
        plan["resnet"]["shapes"] = [[size // 4]]
        what = f"one {workloads.show_size(size)} array"
    nbytes = 4 * sum(math.prod(s) for s in plan["resnet"]["shapes"])
    return plan, what, nbytes


# ---- the table ----
def _placement(setup):
    if not setup.servers:
        return "-", "-"
    return str(setup.servers), "co-located" if setup.colocated else "dedicated"


def bound(setup, M, rate):
    """Seconds per step at the bandwidth bound for this setup (theory.py; with its replicas' copies)."""
    t = theory(M, rate, setup.workers, max(setup.servers, 1), setup.colocated, setup.replicas)
    if setup.system == "geo":
        return t.ps / setup.k_steps         # one PS step's bytes every K steps
    return t.ps if setup.servers else t.ring


def baseline_of(setup):
    """The Setup a kvps setup's rows are divided by, or None for a baseline: a replicated PS's is
    the same PS without replicas."""
    if setup.replicas:
        return setup._replace(replicas=0)
    other = BASELINE.get(setup.system)
    return other and setup._replace(system=other, k_steps=0)


def label(setup):
    """The setup's name in the table: "kvps PS", "kvps PS R=1", "kvps GEO K=4", "gloo all-reduce"."""
    return LABELS[setup.system] + (f" R={setup.replicas}" if setup.replicas else "") + \
        (f" K={setup.k_steps}" if setup.k_steps else "")


def table(results, M, rate):
    """The markdown table (a list of lines) for {Setup: {"rows": {mode: result}, "error": str|None}},
    in the dict's order: one row per system and mode."""
    def ms(setup, mode):
        row = results.get(setup, {}).get("rows", {}).get(mode)
        return row["ms"] if row else None

    lines = ["| setup | W | S | servers | measured ms | bound ms | measured/bound | / baseline |",
             "|---|--:|--:|---|--:|--:|--:|--:|"]
    for setup, result in results.items():
        S, servers = _placement(setup)
        b = bound(setup, M, rate) * 1e3
        base = baseline_of(setup)
        for mode in MODES[setup.system]:
            # the baseline's same mode where it has it (a replicated PS's), else its one mode
            base_ms = ms(base, mode if mode in MODES[base.system] else MODES[base.system][0]) if base else None
            name = label(setup) + ("" if setup.system == "gloo" else f" {mode}")
            t = ms(setup, mode)
            measured = f"{t:.0f}" if t is not None else "failed"
            ratio = f"{t / b:.2f}" if t is not None and b else "-"
            vs = f"{t / base_ms:.2f}" if t is not None and base_ms else "-"
            lines.append(f"| {name} | {setup.workers} | {S} | {servers} | {measured} | {b:.0f} | {ratio} | {vs} |")
    return lines


def traffic_table(results):
    """Lines of a table of the bytes the servers moved per step (in and out, every worker's), for
    the GEO rows and the PS pushpull rows they are divided by; [] without GEO rows."""
    def per_step(setup, mode):
        row = results.get(setup, {}).get("rows", {}).get(mode)
        return row.get("server_bytes") if row else None

    geo = [s for s in results if s.system == "geo"]
    if not geo:
        return []
    lines = ["| setup | W | S | servers | server MB per step | / kvps PS pushpull |", "|---|--:|--:|---|--:|--:|"]
    for setup in [s for s in results if s.system == "ps" and not s.replicas] + geo:
        S, servers = _placement(setup)
        mine = per_step(setup, "pushpull")
        base = per_step(baseline_of(setup), "pushpull") if setup.system == "geo" else mine
        shown = f"{mine / 1e6:.1f}" if mine is not None else "-"
        ratio = f"{mine / base:.3f}" if mine is not None and base else "-"
        lines.append(f"| {label(setup)} pushpull | {setup.workers} | {S} | {servers} | {shown} | {ratio} |")
    return lines


# ---- running ----
class OtherLoad:
    """How much CPU other processes take while this one runs: the machine's busy time (/proc/stat:
    user, nice, system, irq, softirq) less this process's and its reaped children's (os.times()).
    With tick accounting the softirq ticks of our own packets are charged to our processes too."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as f:
                ticks = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        t = os.times()
        busy = sum(ticks[i] for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")
        return busy, t.user + t.system + t.children_user + t.children_system, t.elapsed

    def share(self):
        """The fraction of all CPUs that other processes used since this object was made, or None
        where /proc/stat cannot be read."""
        end = self._sample()
        if not (self.start and end) or end[2] <= self.start[2]:
            return None
        others = (end[0] - self.start[0]) - (end[1] - self.start[1])
        return max(0.0, others) / ((end[2] - self.start[2]) * (os.cpu_count() or 1))


def _job(setup, net, args, plan_path, out):
    W, S, colocated = setup.workers, setup.servers, setup.colocated
    call_timeout = max(30.0, args.timeout / 2)      # a call that hangs fails inside the job, before its deadline
    if setup.system in ("ps", "geo", "ring"):
        env = {"KVPS_TIMEOUT": f"{call_timeout:g}"}
        if setup.replicas:
            env["KVPS_REPLICAS"] = str(setup.replicas)
        return EmulatedJob(net, W, S, [sys.executable, "-m", "kvps.tools.bench.kvps_worker", plan_path], colocated,
                           env, out)
    if setup.system == "gloo":
        return EmulatedGlooJob(net, W, plan_path, out=out, collective_timeout=call_timeout)
    return EmulatedMXNetJob(net, args.mxnet, W, S, [MXNET_WORKER, plan_path], colocated, out=out)


def run_setup(setup, args, plan_path):
    """Run one job on a network of its own; {mode: result}. Raises NodeFailure (with the job's output)
    when it fails or reports less than it should, KVTimeoutError when it passes --timeout."""
    from kvps.tools.bench.pushpull import results

    lines = Lines(sys.stderr if args.verbose else None)
    with Network() as net:
        job = _job(setup, net, args, plan_path, lines)
        net.up(job.hosts, rate=args.rate, delay_ms=args.delay_ms, mtu=args.mtu)
        try:
            codes = job.run(args.timeout)
        except (NodeFailure, KVTimeoutError) as exc:
            raise type(exc)(f"{exc}; its output:\n{lines.text()[-6000:]}") from None
    rows = {r["mode"]: r for r in results(lines.text())}
    if any(codes) or any(m not in rows for m in MODES[setup.system]):
        raise NodeFailure(f"worker exit codes {codes}, results for {sorted(rows) or 'no mode'}; its output:\n"
                          + lines.text()[-6000:])
    for row in rows.values():
        calls = row.get("calls", 1)         # a GEO job times K steps at a time: per step
        row["ms"] /= calls
        if row.get("server_bytes") is not None:
            row["server_bytes"] /= calls
    return rows


def _name(setup):
    S, servers = _placement(setup)
    return f"{label(setup)} W={setup.workers}" + (f" S={S} {servers}" if setup.servers else "")


class Benchmark:
    """The jobs of one `kvps emulate sync`: checked when made, run by run()."""

    def __init__(self, args, combos):
        """args: the parsed command line (workload, steps, systems, mxnet, rate, delay_ms, mtu, timeout,
        verbose, replicas); combos: shapes()'s list. Raises ConfigError for a bad workload, choice of
        systems or replicas, or an MXNet Python that cannot import mxnet, before anything runs."""
        self.args = args
        self.plan, self.what, self.M = make_plan(args.workload, args.steps)
        self.compression = getattr(args, "compression", None)       # the kvps PS jobs' (kvps_worker)
        if self.compression:
            self.what += f", kvps PS compression {json.dumps(self.compression)}"
        gloo_why = _gloo_why() if args.systems is None or "gloo" in args.systems else None
        self.systems, self.notes = choose_systems(args.systems, args.mxnet, gloo_why)
        self.replicas = getattr(args, "replicas", 0)
        self.notes += check_replicas(self.replicas, self.systems, combos)
        self.k_steps = tuple(getattr(args, "k_steps", None) or (4,))
        check_k_steps(self.k_steps, self.systems)
        if "mxnet" in self.systems:
            from kvps.tools.bench.mxnet_job import check_python
            problem = check_python(args.mxnet)
            if problem:
                raise ConfigError(f"--mxnet {args.mxnet} cannot import mxnet: {problem.strip()[-300:]}")
        self.todo = setups(self.systems, combos, self.replicas, self.k_steps)

    def run(self, rate):
        """Run every setup and print the table; returns the exit status: 0, 1 when a job failed, 124
        when one passed --timeout."""
        args = self.args
        for note in self.notes:
            print(note, file=sys.stderr)
        load, others = os.getloadavg()[0], OtherLoad()
        print(f"kvps emulate sync: {self.what}, M = {self.M / 1e6:.1f} MB per step; "
              f"{', '.join(self._shown(s) for s in self.systems)}; each host link {show_rate(rate)} both ways"
              f"{f', {args.delay_ms:g} ms one way' if args.delay_ms else ''}; {os.cpu_count()} CPUs shared by every "
              f"process; median of {args.steps} timed steps. Load average {load:.2f} at the start.", flush=True)
        results, timed_out = {}, False
        with tempfile.TemporaryDirectory(prefix="kvps-emulate-") as tmp:
            plans = {}
            for setup in self.todo:
                kind = kvtype(setup)
                if kind in plans:
                    continue
                plans[kind] = os.path.join(tmp, f"plan-{kind.replace(':', '-')}.json")
                extra = {"compression": self.compression} if self.compression and kind == "dist_sync" else {}
                if "geo" in self.systems and kind.startswith("dist_"):
                    # the servers' bytes per step, GEO against the PS (a plan MXNet's job shares: it
                    # has no servers of ours to ask, and skips it)
                    extra["traffic"] = True
                if setup.system == "geo":           # K steps at a time, one of which syncs
                    extra.update(modes=["pushpull"], calls=setup.k_steps)
                with open(plans[kind], "w") as f:
                    json.dump(dict(self.plan, kvtype=kind, **extra), f)
            with Progress(len(self.todo), "jobs") as progress:     # a bar with an ETA on a terminal
                for setup in self.todo:
                    start = time.monotonic()
                    try:
                        rows = run_setup(setup, args, plans[kvtype(setup)])
                    except (NodeFailure, KVTimeoutError) as exc:
                        timed_out |= isinstance(exc, KVTimeoutError)
                        results[setup] = {"rows": {}, "error": str(exc)}
                        print(f"kvps emulate: {_name(setup)} failed: {exc}", file=sys.stderr, flush=True)
                        progress.advance(f"{_name(setup)}: failed")
                        continue
                    results[setup] = {"rows": rows, "error": None}
                    took = " / ".join(f"{rows[m]['ms']:.0f}" for m in MODES[setup.system])
                    print(f"[emulate] {_name(setup)}: {took} ms ({' / '.join(MODES[setup.system])}) "
                          f"in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
                    progress.advance(f"{_name(setup)}: ok")
        share = others.share()
        replicated = ("; kvps PS R=N rows: kvps PS without replicas, same W, S, placement and mode"
                      if self.replicas else "")
        print("\n" + "\n".join(table(results, self.M, rate)))
        traffic = traffic_table(results)
        if traffic:
            print("\n" + "\n".join(traffic))
        print(f"\nmeasured: median step; bound: the busiest link direction at full rate (docs/emulate.md); "
              f"/ baseline: measured / the baseline's, measured in the same run (kvps PS rows: MXNet dist_sync at the "
              f"same W, S and placement; kvps ring rows: gloo at the same W{replicated}"
              f"{'; kvps GEO rows: kvps PS pushpull, their bound the PS bound / K' if 'geo' in self.systems else ''}), "
              f"below 1 is faster. "
              f"Load average {load:.2f} at the start; other processes used "
              f"{'an unknown share' if share is None else f'{share:.0%}'} of the CPUs while it ran.", flush=True)
        if any(r["error"] for r in results.values()):
            return 124 if timed_out else 1
        return 0


    def _shown(self, system):
        replicated = f" (and with KVPS_REPLICAS={self.replicas})" if system == "ps" and self.replicas else ""
        return LABELS[system] + replicated


def _gloo_why():
    """None when torch.distributed has gloo, else why it cannot run."""
    try:
        import torch.distributed as dist
    except ImportError as exc:
        return f"torch does not import ({exc})"
    if not (dist.is_available() and dist.is_gloo_available()):
        return "this torch has no gloo backend"
    return None
