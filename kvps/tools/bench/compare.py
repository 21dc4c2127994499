"""`kvps bench compare`: kvps's parameter server and ring against gloo all-reduce and MXNet, in one run.

    kvps bench compare --mxnet ~/mxvenv/bin/python --repeat 3      # W in 2,4, S in 1,2,W: 11 min on 2 cores
    kvps bench compare --mxnet ~/mxvenv/bin/python                 # one run of each setup: 4-5 min
    kvps bench compare --quick                                     # tiny workload, W=2, S=1: 30 s

For each W in --workers and each S in --servers, it runs one job per system and times, in every
worker, two things (median step after warm-up):

* **sync**: every worker syncs ResNet-50's 161 gradients (25.6M float32, 102 MB) once;
* **train**: one real training step of a small torch model (an MLP of 3.7M parameters, fixed
  seed and batch: forward, backward, gradient sync, optimizer step), and the same step with no
  sync at all (the compute share, with all W workers busy).

Systems (setups): PS sync and PS async (kvps dist_sync / dist_async with S servers, one pushpull
of the whole list; training through kvps.torch.DistributedOptimizer), kvps ring (the
'allreduce' kvstore, no servers), torch.distributed gloo (DDP-style 25 MB buckets; DDP for the
training step), and with --mxnet PYTHON MXNet 1.9.1 dist_sync (push all, then pull all; Gluon's
Trainer for the training step). It prints a markdown table with ratios against the baselines
measured in the same run (ring / gloo, PS sync / MXNet) and the issue's targets, and draws a
bar plot (--plot). Each setup runs next to its baseline (run_order), --repeat times, and each
row reports its median run. A setup that fails is reported as failed and the others still run (the exit
code is then 1); one that cannot run here (kvps.torch, gloo, MXNet missing) says so.

Every job runs under a deadline (--timeout) and only processes this command started are stopped.
"""
import argparse
import dataclasses
import json
import os
import shlex
import sys
import tempfile
import time

from kvps.errors import KVPSError

from kvps.tools.bench import compare_report, workloads
from kvps.tools.bench.pushpull import JobFailed, kvps_job, median_run, results, run_logged

SYSTEMS = ("sync", "async", "ring", "gloo", "mxnet")
LABELS = {"sync": "PS sync", "async": "PS async", "ring": "kvps ring", "gloo": "gloo all-reduce",
          "mxnet": "MXNet dist_sync"}
KVTYPES = {"sync": "dist_sync", "async": "dist_async", "ring": "allreduce"}
QUICK_TENSORS = 16           # --quick syncs ResNet-50's first 16 tensors (0.1M floats) instead of all 161
MODEL = {"layers": [784, 2048, 1024, 10], "batch": 64}     # 3.7M parameters: train_step.py's MLP
QUICK_MODEL = {"layers": [32, 64, 10], "batch": 8}
FAILED, USAGE = 1, 2


@dataclasses.dataclass(frozen=True)
class Setup:
    system: str
    workers: int
    servers: int             # 0 for the ring and gloo

    @property
    def label(self):
        return LABELS[self.system] + (f" S={self.servers}" if self.servers else "")


def parser():
    p = argparse.ArgumentParser(prog="kvps bench compare",
                                description="time to sync ResNet-50's gradients and to run one training step, "
                                            "for kvps PS sync/async, kvps ring, gloo all-reduce and MXNet")
    p.add_argument("-n", "--workers", default=None, help="comma-separated worker counts (default 2,4; --quick 2)")
    p.add_argument("-s", "--servers", default=None,
                   help="comma-separated server counts for the PS setups; W means as many as workers "
                        "(default 1,2,W; --quick 1)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"which setups to run (default {','.join(SYSTEMS)}; mxnet needs --mxnet)")
    p.add_argument("--steps", type=int, default=None, help="timed steps of each kind (default 10, --quick 2)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: ResNet-50's first 16 tensors, an MLP 32-64-10, W=2, S=1, 2 steps")
    p.add_argument("--mxnet", metavar="PYTHON", default=None,
                   help="a Python with mxnet 1.9.1: also run MXNet's dist_sync on the same workloads")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every setup N times, round-robin, and report each row's median run (default 1)")
    p.add_argument("--plot", metavar="FILE", default=os.path.join("reports", "compare.png"),
                   help="write the bar plot here (default reports/compare.png; '' for none)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write every result to FILE")
    p.add_argument("--threads", default="auto",
                   help="torch/OpenMP threads per worker, the same for every system: auto (cores // W, the "
                        "default), a number, or default (each library's own, as the anchor scripts run)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each job may take (default 300)")
    p.add_argument("-v", "--verbose", action="store_true", help="echo every child's output to stderr")
    return p


def _ints(text, what, allow_w=False):
    values = []
    for token in text.split(","):
        token = token.strip()
        if allow_w and token.upper() == "W":
            values.append("W")
        elif token.isdigit() and int(token) >= 1:
            values.append(int(token))
        else:
            raise ValueError(f"{what} {text!r}: {token!r} is not a positive integer" + (" or W" if allow_w else ""))
    return values


def _args(argv):
    p = parser()
    args = p.parse_args(argv)
    try:
        args.workers = _ints(args.workers or ("2" if args.quick else "2,4"), "--workers")
        args.servers = _ints(args.servers or ("1" if args.quick else "1,2,W"), "--servers", allow_w=True)
    except ValueError as exc:
        p.error(str(exc))
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        p.error(f"--systems: {', '.join(unknown)} not among {', '.join(SYSTEMS)}")
    if args.threads not in ("auto", "default") and not (args.threads.isdigit() and int(args.threads) >= 1):
        p.error(f"--threads {args.threads!r} is not auto, default or a positive number")
    if args.timeout <= 0:
        p.error(f"--timeout {args.timeout:g} must be positive")
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat} must be at least 1")
    if args.steps is None:
        args.steps = 2 if args.quick else 10
    if args.steps < 1:
        p.error(f"--steps {args.steps} must be at least 1")
    return args


def setups(args):
    """Every setup of the run, in table order: per W, PS sync (each S), PS async, ring, gloo, MXNet."""
    out = []
    for W in args.workers:
        servers = sorted({W if s == "W" else s for s in args.servers})
        for system in SYSTEMS:
            if system not in args.systems:
                continue
            for S in (servers if system in ("sync", "async", "mxnet") else [0]):
                out.append(Setup(system, W, S))
    return out


def run_order(todo, repeat_index):
    """The order to run the setups in: each one next to its baseline (ring then gloo, PS sync then MXNet at
    the same S), so a slow spell of a shared machine tends to hit both sides of a ratio; every other
    repeat runs the list backwards, so no setup always goes first."""
    rank = {"ring": 0, "gloo": 1, "sync": 2, "mxnet": 3, "async": 4}
    order = sorted(todo, key=lambda s: (s.workers, rank[s.system] >= 2, s.servers if rank[s.system] < 4 else 99,
                                        rank[s.system], s.servers))
    return order[::-1] if repeat_index % 2 else order


def make_plan(args, train):
    plan = workloads.make_plan(sizes=(), resnet_steps=args.steps, quick=args.quick)
    if args.quick:
        plan["resnet"]["shapes"] = plan["resnet"]["shapes"][:QUICK_TENSORS]
    plan["threads"] = args.threads
    plan["train"] = dict(QUICK_MODEL if args.quick else MODEL, seed=0, lr=0.01, momentum=0.9, steps=args.steps,
                         warmup=1 if args.quick else 3) if train else None
    return plan


# ---- what can run here ----
def availability(args):
    """{system: why it cannot run (str), or None}, and why kvps.torch training rows cannot (or None)."""
    why = {s: None for s in SYSTEMS}
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_gloo_available()):
            why["gloo"] = "not available: this torch has no gloo backend"
    except ImportError as exc:
        why["gloo"] = f"not available: torch does not import ({exc})"
    try:
        import kvps.torch as kt
        train_why = None if hasattr(kt, "DistributedOptimizer") else \
            "not available: kvps.torch has no DistributedOptimizer"
    except ImportError as exc:
        train_why = f"not available: kvps.torch does not import ({exc})"
    if not args.mxnet:
        why["mxnet"] = "not run: no --mxnet PYTHON"
    else:
        from kvps.tools.bench.mxnet_job import check_python
        problem = check_python(args.mxnet)
        if problem:
            why["mxnet"] = f"not available: {args.mxnet} cannot import mxnet ({problem.strip()[-200:]})"
    return why, train_why


# ---- running the jobs ----
def run_kvps(setup, plan_path, args):
    """One kvps job (Job(W, S) with compare_worker.py); its result rows. Raises JobFailed."""
    cmd = [sys.executable, "-m", "kvps.tools.bench.compare_worker", plan_path, KVTYPES[setup.system]]
    return results(kvps_job(setup.workers, setup.servers, cmd, _threads_env(args, setup.workers), args.timeout,
                            args.verbose, setup.label))


def run_gloo(setup, plan_path, args, logdir):
    from kvps.tools.bench.gloo_job import GlooJob
    job = GlooJob(setup.workers, plan_path, logdir, collective_timeout=max(10.0, args.timeout / 2),
                  env=_threads_env(args, setup.workers))
    return run_logged(job, setup.label, args.timeout, args.verbose)


def run_mxnet(setup, plan_path, args, logdir):
    from kvps.tools.bench.mxnet_job import MXNetJob
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mxnet_compare_worker.py")
    job = MXNetJob(args.mxnet, setup.workers, setup.servers, [script, plan_path], logdir,
                   env=_threads_env(args, setup.workers))
    return run_logged(job, setup.label, args.timeout, args.verbose)


def _threads_env(args, workers):
    """The same threads for every system's workers (--threads; see train_step.threads)."""
    from kvps.tools.bench.train_step import threads
    n = threads(args.threads, workers)
    return {} if n is None else {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}


def measure(args, plan, todo, tmp, why, train_why):
    """{setup: result}, running every available setup --repeat times, round-robin."""
    plans = {}
    for name, train in (("plan.json", True), ("plan-notrain.json", False)):
        plans[name] = os.path.join(tmp, name)
        with open(plans[name], "w") as f:
            json.dump(plan if train else dict(plan, train=None), f)
    out = {s: {"runs": [], "error": None, "why": why[s.system],
               "train_why": train_why if s.system in KVTYPES else None} for s in todo}
    for i in range(args.repeat):
        run = f" (run {i + 1} of {args.repeat})" if args.repeat > 1 else ""
        for setup in run_order(todo, i):
            result = out[setup]
            if result["why"] or result["error"]:
                continue
            logdir = tempfile.mkdtemp(prefix=f"{setup.system}-W{setup.workers}-S{setup.servers}-", dir=tmp)
            plan = plans["plan-notrain.json" if result["train_why"] else "plan.json"]
            t = time.monotonic()
            _say(f"{setup.label}, W={setup.workers}{run} ...")
            try:
                if setup.system in KVTYPES:
                    rows = run_kvps(setup, plan, args)
                elif setup.system == "gloo":
                    rows = run_gloo(setup, plan, args, logdir)
                else:
                    rows = run_mxnet(setup, plan, args, logdir)
                lost = _missing(rows, train=not result["train_why"])
                if lost:
                    raise JobFailed(f"the {setup.label} job exited cleanly but reported no {', '.join(lost)} result")
            except JobFailed as exc:
                result["error"] = str(exc).splitlines()[0]
                print(f"kvps bench compare: {exc}", file=sys.stderr, flush=True)
                continue
            _say(f"{setup.label}, W={setup.workers}: done in {time.monotonic() - t:.1f} s")
            result["runs"].append(rows)
    for result in out.values():
        result["rows"] = {r["workload"]: r for r in median_run(result.pop("runs"))}
    return out


def _missing(rows, train):
    seen = {r["workload"] for r in rows}
    return [w for w in ("resnet50",) + (("train_local", "train") if train else ()) if w not in seen]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _args(argv)
    except SystemExit as exc:           # argparse's --help and usage errors
        return exc.code if isinstance(exc.code, int) else USAGE
    why, train_why = availability(args)
    todo, plan = setups(args), make_plan(args, train=True)
    load = [os.getloadavg()[0]]
    try:
        with tempfile.TemporaryDirectory(prefix="kvps-compare-") as tmp:
            measured = measure(args, plan, todo, tmp, why, train_why)
    except KVPSError as exc:            # a bad KVPS_* variable in this environment
        print(f"kvps bench compare: {exc}", file=sys.stderr)
        return USAGE
    load.append(os.getloadavg()[0])
    command = "kvps bench compare " + shlex.join(argv)
    report = compare_report.Report(args, plan, todo, measured, command, load)
    print(report.markdown(), flush=True)
    if args.plot:
        problem = report.plot(args.plot)
        _say(f"plot: {problem}" if problem else f"plot written to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.as_json(), f, indent=1)
    return FAILED if any(r["error"] for r in measured.values()) else 0


def _say(text):
    print(f"[bench] {text}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
