"""`kvps bench pushpull`: push+pull latency and bandwidth of kvps, side by side with MXNet's KVStore.

    kvps bench pushpull -n 2 -s 1 --mxnet ~/mxvenv/bin/python      # the full run (half a minute)
    kvps bench pushpull --quick --sizes 1KB,64KB                   # kvps alone, seconds

Starts a kvps job (kvps.launch.Job) whose W workers run kvps_worker.py, then,
with --mxnet, an MXNet 1.9.1 job of the same shape (mxnet_job.py) whose workers
run mxnet_worker.py; both time the same plan (workloads.py): one push+pull
round per size, and one step of syncing ResNet-50's 161 gradients. Rank 0 of
each job prints JSON lines; this process collects them and prints a markdown
table with the ratio kvps/MXNet per row and the project's targets.

Every job runs under a deadline (--timeout); a child that fails or hangs makes
the benchmark exit non-zero with the children's logs. Only processes this
command started are ever stopped.
"""
import argparse
import json
import math
import os
import re
import shlex
import sys
import tempfile
import time

from kvps.config import Config
from kvps.errors import KVPSError, KVTimeoutError

from kvps.tools.bench import workloads
from kvps.tools.capture import Lines
from kvps.tools.progress import Progress
from kvps.tools.bench.workloads import KB, show_size

TARGET_SETUP = (2, 1, "dist_sync")      # workers, servers, kvtype the targets are set for
TARGETS = (
    # workload, bytes (None: any), kvps mode (None: each), highest kvps/MXNet ratio, what is asked,
    # whether it is asked of shared memory (the default on one host; not judged with KVPS_SHM=0)
    ("round", KB, None, 0.7, "1 KB round at most 0.7x MXNet's", False),
    ("resnet50", None, "push+pull", 0.6, "ResNet-50 step, MXNet's call pattern, at most 0.6x MXNet's", False),
    ("resnet50", None, "pushpull", 0.5, "ResNet-50 step, whole-list pushpull, at most 0.5x MXNet's", False),
    ("resnet50", None, "pushpull", 0.25, "ResNet-50 step, whole-list pushpull through shared memory, at most "
                                         "0.25x MXNet's", True),
)
STALL_MS, STALL_FACTOR = 100.0, 20.0  # a round over both 100 ms and 20x its median is reported as a stall
FAILED, USAGE = 1, 2
_RESULT_LINE = re.compile(r"^\[(W\d+)\] (\{.*\})\s*$")


def parser():
    p = argparse.ArgumentParser(prog="kvps bench pushpull",
                                description="push+pull round time and bandwidth over sizes, and the time to sync "
                                            "ResNet-50's gradients, for kvps and (with --mxnet) MXNet's dist KVStore")
    p.add_argument("-n", "--workers", type=int, default=2, help="workers (default 2)")
    p.add_argument("-s", "--servers", type=int, default=1, help="servers (default 1)")
    p.add_argument("--kvtype", choices=("dist_sync", "dist_async"), default="dist_sync")
    p.add_argument("--sizes", default=None,
                   help="comma-separated float32 array sizes, e.g. 1KB,64KB,1MB "
                        "(default 1KB,64KB,1MB,4MB,16MB,64MB; with --quick 1KB,64KB,1MB)")
    p.add_argument("--resnet-steps", type=int, default=None,
                   help="timed ResNet-50 steps, after warm-up (default 10, with --quick 3; 0 skips them)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions: a smoke run")
    p.add_argument("--mxnet", metavar="PYTHON", default=None,
                   help="a Python with mxnet 1.9.1 installed: run MXNet's dist KVStore on the same workload")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each system's job N times, alternating kvps and MXNet, and report the median run "
                        "of each row (damps the noise of a shared machine; default 1)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results to FILE")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds each job (kvps, MXNet) may take before it is stopped (default 300)")
    p.add_argument("--pattern", default=",".join(workloads.DEFAULT_PATTERNS),
                   help="kvps's call patterns, comma-separated: mxnet (per-key push loop then per-key pull loop, "
                        "blocking, priority=-i, as MXNet scripts call it; the mode 'push+pull'), list (push(all "
                        "keys) then pull(all keys)), pushpull (pushpull(all keys)), gluon (one blocking "
                        "pushpull per key, priority=-i, as Gluon's Trainer calls it since MXNet 1.6; the mode "
                        "'pushpull-each'), gluon-async (the same with async_op=True, then wait_all()); default: "
                        "mxnet,list,pushpull. MXNet runs the mxnet pattern, and with gluon or gluon-async its "
                        "per-key pushpull too, the baseline of both")
    p.add_argument("--small-keys", type=int, default=0, metavar="N",
                   help="also time a step over N keys of 64 floats each (a model with many small tensors, "
                        "where each call's own cost decides); default 0: none")
    p.add_argument("--tcp", action="store_true",
                   help="also run kvps with KVPS_SHM=0 (everything over TCP) in the same run, and report "
                        "shared memory against TCP")
    p.add_argument("--curve", action="store_true",
                   help="also run kvps with KVPS_CURVE=1 (CurveZMQ on every link; with --tcp, over TCP too) in "
                        "the same run, and report its cost (docs/security.md)")
    p.add_argument("--metrics", action="store_true",
                   help="also run kvps with KVPS_METRICS_PORT=0 (every node serves Prometheus metrics) in the same "
                        "run, and report their cost (docs/observability.md)")
    p.add_argument("--replicas", type=int, default=0, metavar="R",
                   help="also run kvps with KVPS_REPLICAS=R (chain replication) in "
                        "the same run, and report its cost against kvps and, with --tcp, kvps over TCP "
                        "(docs/replication.md)")
    p.add_argument("--server-threads", type=int, default=0, metavar="N",
                   help="also run kvps with KVPS_SERVER_THREADS=N (big sync rounds merged on a pool of N threads "
                        "beside the server's I/O thread) in the same run, and report it against the "
                        "single-threaded server")
    p.add_argument("-v", "--verbose", action="store_true", help="echo every child's output to stderr")
    return p


def _args(argv):
    p = parser()
    args = p.parse_args(argv)
    if args.workers < 1 or args.servers < 1:
        p.error(f"-n {args.workers} -s {args.servers}: a job needs at least one worker and one server")
    if args.timeout <= 0:
        p.error(f"--timeout {args.timeout:g} must be positive")
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat} must be at least 1")
    if args.server_threads < 0 or args.server_threads == 1:
        p.error(f"--server-threads {args.server_threads}: give N > 1 (1 is the plain run it is compared with)")
    if args.replicas and not 0 < args.replicas < args.servers:
        p.error(f"--replicas {args.replicas} needs more servers than replicas (-s {args.servers})")
    if args.small_keys < 0:
        p.error(f"--small-keys {args.small_keys} must not be negative")
    if args.resnet_steps is not None and args.resnet_steps < 0:
        p.error(f"--resnet-steps {args.resnet_steps} must not be negative")
    try:
        sizes = [workloads.parse_size(s) for s in args.sizes.split(",")] if args.sizes else \
            list(workloads.QUICK_SIZES if args.quick else workloads.DEFAULT_SIZES)
    except ValueError as exc:
        p.error(str(exc))
    if len(set(sizes)) != len(sizes):
        p.error(f"--sizes {args.sizes} lists a size twice")
    args.sizes = sizes
    patterns = [t.strip() for t in args.pattern.split(",") if t.strip()]
    bad = [t for t in patterns if t not in workloads.PATTERNS]
    if bad or not patterns:
        p.error(f"--pattern {args.pattern}: choose from {', '.join(workloads.PATTERNS)}")
    args.modes = [workloads.PATTERNS[t] for t in dict.fromkeys(patterns)]
    if args.resnet_steps is None:
        args.resnet_steps = 3 if args.quick else 10
    return args


# ---- running the jobs ----
class JobFailed(Exception):
    """A job failed or passed its deadline; the message carries the children's logs."""


def results(text, tag=workloads.TAG):
    """The result objects (JSON with "bench": tag) in a job's prefixed output ('[W0] {...}' lines)."""
    rows = []
    for line in text.splitlines():
        m = _RESULT_LINE.match(line)
        if m:
            try:
                obj = json.loads(m.group(2))
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("bench") == tag:
                rows.append(obj)
    return rows


def kvps_job(workers, servers, command, env, timeout, verbose, label):
    """Run a kvps job (kvps.launch.Job) under a deadline; returns its prefixed output.
    Raises JobFailed with the output when it fails or passes the deadline."""
    from kvps.config import Config
    from kvps.launch import Job

    # A call that hangs inside a worker raises there (naming what it waits for), before the job's deadline.
    env = dict(env, KVPS_TIMEOUT=f"{min(Config.from_env().timeout, max(10.0, timeout / 2)):g}")
    lines = Lines(sys.stderr if verbose else None)
    job = Job(workers, servers, command, env=env, out=lines)
    start = time.monotonic()
    try:
        job.start()
        code = job.wait(timeout=max(0.0, timeout - (time.monotonic() - start)))
        problem = f"failed (exit code {code})" if code else None
    except KVTimeoutError:
        problem = f"did not finish within --timeout {timeout:g} s"
    except (KVPSError, OSError) as exc:
        job.stop()
        problem = f"did not start: {exc}"
    except BaseException:       # Ctrl-C: the children run in their own sessions, so stop them here
        job.stop()
        raise
    if problem:
        raise JobFailed(f"the {label} job {problem}; its output:\n{lines.text()[-6000:]}")
    return lines.text()


def run_kvps(args, plan_path, env=None):
    text = kvps_job(args.workers, args.servers, [sys.executable, "-m", "kvps.tools.bench.kvps_worker", plan_path],
                    env or {}, args.timeout, args.verbose, "kvps")
    return results(text)


def run_mxnet(args, plan_path, logdir):
    from kvps.tools.bench.mxnet_job import MXNetJob
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mxnet_worker.py")
    job = MXNetJob(args.mxnet, args.workers, args.servers, [script, plan_path], logdir)
    return run_logged(job, "MXNet", args.timeout, args.verbose)


def run_logged(job, label, timeout, verbose=False):
    """Start a LoggedJob (gloo's or MXNet's), wait with the deadline (wait() stops every child,
    whatever happens), and return the result rows its workers printed; JobFailed otherwise."""
    from kvps.tools.bench.logged_job import TIMED_OUT
    try:
        job.start()
    except OSError as exc:
        raise JobFailed(f"the {label} job did not start: {exc}") from None
    code = job.wait(timeout)
    if code == TIMED_OUT:
        raise JobFailed(f"the {label} job did not finish within --timeout {timeout:g} s\n{job.logs()}")
    if code:
        raise JobFailed(f"the {label} job failed (exit code {code})\n{job.logs()}")
    if verbose:
        sys.stderr.write(job.logs(tail=100_000) + "\n")
    return results("".join(f"[{name}] {line}\n" for name, _ in job.procs if name.startswith("W")
                           for line in job.output(name).splitlines()))


def missing(plan, rows):
    """The planned workloads a job printed no result for."""
    seen = {(r["workload"], r["bytes"]) for r in rows}
    planned = [("round", item["bytes"]) for item in plan["sweep"]]
    for workload, step_set in (("resnet50", plan.get("resnet")), ("keys", plan.get("small"))):
        if step_set:
            planned.append((workload, 4 * sum(math.prod(s) for s in step_set["shapes"])))
    return [f"{w} {show_size(n)}" for w, n in planned if (w, n) not in seen]


def median_run(runs):
    """Per (workload, bytes, mode), the row of the run with the median time (the lower middle one for
    an even count), with every run's time added as runs_ms."""
    groups = {}
    for rows in runs:
        for r in rows:
            groups.setdefault((r["workload"], r["bytes"], r["mode"]), []).append(r)
    out = []
    for group in groups.values():
        ranked = sorted(group, key=lambda r: r["ms"])
        out.append(dict(ranked[(len(ranked) - 1) // 2], runs_ms=[r["ms"] for r in group]))
    return out


# ---- the report ----
def _label(row):
    if row["workload"] == "round":
        return f"{show_size(row['bytes'])} round"
    if row["workload"] == "keys":
        return f"{row['tensors']} keys of {workloads.SMALL_FLOATS} floats"
    return f"ResNet-50 step ({row.get('tensors', 161)} tensors, {row['bytes'] / 4e6:.1f}M floats)"


def _ms(ms):
    return f"{ms:.3f}" if ms < 10 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def compare(kvps_rows, mxnet_rows):
    """One row per kvps result, with MXNet's time for the same workload (its per-key pushpull for
    kvps's, else its push+pull) and the ratio."""
    baseline = {(r["workload"], r["bytes"], r["mode"]): r for r in mxnet_rows}
    rows = []
    for r in kvps_rows:
        mx = baseline.get((r["workload"], r["bytes"], workloads.MXNET_BASELINE.get(r["mode"], "push+pull")))
        rows.append({"workload": r["workload"], "label": _label(r), "bytes": r["bytes"], "mode": r["mode"],
                     "kvps": r, "mxnet": mx, "ratio": r["ms"] / mx["ms"] if mx else None})
    return rows


def judge(rows, args):
    """The targets, one per kvps call mode: [{target, mode, ratio, limit, met}] (met: True, False or None)."""
    applies = (args.workers, args.servers, args.kvtype) == TARGET_SETUP
    shm = Config.from_env().shm
    out = []
    for workload, nbytes, mode, limit, text, of_shm in TARGETS:
        matching = [r for r in rows if r["workload"] == workload and (nbytes is None or r["bytes"] == nbytes)
                    and (mode is None or r["mode"] == mode)]
        off = of_shm and not shm        # asked of shared memory, which is off here
        for r in matching:
            ratio = r["ratio"]
            met = None if ratio is None or not applies or off else ratio <= limit
            out.append({"target": text, "mode": r["mode"], "limit": limit, "ratio": ratio, "met": met,
                        **({"why": "KVPS_SHM=0"} if off else {})})
        if not matching:
            why = f"{show_size(nbytes)} is not in --sizes" if nbytes else \
                f"--pattern leaves out {mode}" if mode and args.resnet_steps else "--resnet-steps 0"
            out.append({"target": text, "mode": None, "limit": limit, "ratio": None, "met": None, "why": why})
    return out


def report(rows, targets, args, mxnet_ran):
    """The markdown tables (as one string)."""
    W, S = args.workers, args.servers
    lines = [f"kvps bench pushpull: {W} worker{'s' * (W != 1)}, {S} server{'s' * (S != 1)}, {args.kvtype}, "
             f"{os.cpu_count()} CPUs, kvps kernels: {_kernels()}",
             "Times are medians of the timed rounds (steps) after warm-up"
             + (f", from the median of {args.repeat} alternating runs of each system" if args.repeat > 1 else "")
             + "; ratio = kvps / MXNet (below 1: kvps is faster). Calls: push+pull = MXNet's pattern (for each "
               "key push(key, priority=-i), then for each key pull(key, priority=-i), blocking), list = "
               "push(all keys) then pull(all keys), pushpull = pushpull(all keys), pushpull-each = pushpull(key, "
               "priority=-i) for each key (Gluon's Trainer), blocking, and -async with async_op=True then "
               "wait_all(). MXNet runs push+pull, and pushpull-each, the baseline of both pushpull-each rows.",
             "",
             "| workload | kvps call | kvps ms | kvps GB/s | MXNet ms | MXNet GB/s | kvps/MXNet |",
             "|---|---|--:|--:|--:|--:|--:|"]
    for r in rows:
        k, mx = r["kvps"], r["mxnet"]
        mx_ms, mx_bw = (_ms(mx["ms"]), f"{mx['GBps']:.3f}") if mx else ("-", "-")
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        lines.append(f"| {r['label']} | {r['mode']} | {_ms(k['ms'])} | {k['GBps']:.3f} | {mx_ms} | {mx_bw} | "
                     f"{ratio} |")
    stalls = [f"{r['label']} {r['mode']} ({system}): max {_ms(row['max_ms'])} ms, median {_ms(row['ms'])} ms"
              for r in rows for system, row in (("kvps", r["kvps"]), ("MXNet", r["mxnet"]))
              if row and row.get("max_ms", 0) > max(STALL_MS, STALL_FACTOR * row["ms"])]
    if stalls:
        # A median hides a few very slow rounds; they usually mean a lost wake-up or a peer stuck somewhere.
        lines += ["", "Stalls: single rounds far slower than the median: " + "; ".join(stalls) + "."]
    applies = (W, S, args.kvtype) == TARGET_SETUP
    lines += ["", "| target | kvps call | kvps/MXNet | limit | met |", "|---|---|--:|--:|---|"]
    for t in targets:
        if t["ratio"] is None:
            met = f"not measured ({t.get('why') or 'no --mxnet'})"
        elif t["met"] is None:
            met = "n/a: set for shared memory (KVPS_SHM=0 here)" if t.get("why") else \
                "n/a: set for -n 2 -s 1 dist_sync"
        else:
            met = "yes" if t["met"] else "**no**"
        ratio = f"{t['ratio']:.3f}" if t["ratio"] is not None else "-"
        lines.append(f"| {t['target']} | {t['mode'] or '-'} | {ratio} | {t['limit']:g} | {met} |")
    if not applies:
        lines.append("")
        lines.append("The targets are set for 2 workers, 1 server, dist_sync; other setups show the ratios only.")
    return "\n".join(lines)


def transport_report(shm_rows, tcp_rows):
    """kvps over shared memory (KVPS_SHM=1, the default) against kvps over TCP, row by row."""
    tcp = {(r["workload"], r["bytes"], r["mode"]): r for r in tcp_rows}
    lines = ["Shared memory (the default on one host) against TCP (KVPS_SHM=0), in the same run; "
             "ratio = shared memory / TCP.", "",
             "| workload | kvps call | shared memory ms | TCP ms | ratio |", "|---|---|--:|--:|--:|"]
    for r in shm_rows:
        t = tcp.get((r["workload"], r["bytes"], r["mode"]))
        if t is not None:
            lines.append(f"| {_label(r)} | {r['mode']} | {_ms(r['ms'])} | {_ms(t['ms'])} | {r['ms'] / t['ms']:.2f} |")
    return "\n".join(lines)


def curve_report(label, plain_rows, curve_rows):
    """kvps with CurveZMQ (KVPS_CURVE=1) against the same kvps without, row by row."""
    return cost_report(f"CurveZMQ cost ({label}): the same job with KVPS_CURVE=1, in the same run; ratio = CURVE / "
                       f"plain (the target for a ResNet-50 step: at most 1.15).", "CURVE", plain_rows, curve_rows)


def metrics_report(plain_rows, metrics_rows):
    """kvps serving Prometheus metrics (KVPS_METRICS_PORT=0) against the same kvps without."""
    return cost_report("Metrics cost: the same job with KVPS_METRICS_PORT=0 (every node serves /metrics), in the "
                       "same run; ratio = metrics / plain (target: at most 1.03).", "metrics", plain_rows, metrics_rows)


def cost_report(title, column, plain_rows, other_rows):
    """A table of `other_rows` (the same jobs with one feature on) against `plain_rows`, row by row."""
    other = {(r["workload"], r["bytes"], r["mode"]): r for r in other_rows}
    lines = [title, "Paired: the median over runs of each run's ratio to the plain run just before it (the jobs "
             "alternate, so this cancels the machine's drift between runs), and its 95% bootstrap interval: "
             "a target inside the interval is neither met nor missed by this run.", "",
             f"| workload | kvps call | plain ms | {column} ms | ratio | paired ratio | 95% interval |",
             "|---|---|--:|--:|--:|--:|---|"]
    for r in plain_rows:
        c = other.get((r["workload"], r["bytes"], r["mode"]))
        if c is not None:
            iv = paired_interval(r.get("runs_ms"), c.get("runs_ms"))
            lines.append(f"| {_label(r)} | {r['mode']} | {_ms(r['ms'])} | {_ms(c['ms'])} | {c['ms'] / r['ms']:.2f} | "
                         + ("- | - |" if iv is None else
                            f"{iv.median:.3f} | {iv.low:.3f} to {iv.high:.3f} ({iv.n} runs) |"))
    return "\n".join(lines)


def paired_interval(plain_ms, other_ms):
    """The paired ratio, the median of other_ms[i] / plain_ms[i] over the runs both have (in run
    order), with its 95% bootstrap interval (kvps/tools/experiment/intervals.py: Interval(median,
    low, high, n)); or None."""
    from kvps.tools.experiment.intervals import interval
    ratios = [o / p for p, o in zip(plain_ms or (), other_ms or ()) if p > 0]
    return interval(ratios) if ratios else None


def replicas_report(replicas, plain_rows, tcp_rows, replicated_rows):
    """kvps with chain replication (KVPS_REPLICAS) against the same kvps without, and without over TCP."""
    text = cost_report(f"Replication cost: the same job with KVPS_REPLICAS={replicas}, in the same run; "
                       f"ratio = replicated / plain.", "replicated", plain_rows, replicated_rows)
    if tcp_rows:
        text += "\n\n" + cost_report(f"The same against kvps over TCP (KVPS_SHM=0); ratio = replicated / TCP.",
                                      "replicated", tcp_rows, replicated_rows)
    return text


def _kernels():
    try:
        from kvps import kernels
        return kernels.backend()
    except Exception:          # the kernels package may be absent or half-built; the bench still runs
        return "unknown"


def measure(args, plan, tmp):
    """{system: [each run's rows]}, running every job of the benchmark; raises JobFailed."""
    plan_path = os.path.join(tmp, "plan.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    runs = {"kvps": [], "MXNet": [], "kvps TCP": [], "kvps CURVE": [], "kvps TCP CURVE": [], "kvps metrics": [],
            "kvps replicated": [], "kvps threads": []}
    kvps = ("kvps",) + (("kvps TCP",) if args.tcp else ())
    systems = kvps + (tuple(f"{k} CURVE" for k in kvps) if args.curve else ()) + \
        (("kvps metrics",) if args.metrics else ()) + (("kvps replicated",) if args.replicas else ()) + \
        (("kvps threads",) if args.server_threads > 1 else ()) + \
        (("MXNet",) if args.mxnet else ())
    progress = Progress(args.repeat * len(systems), "benchmark jobs")     # a bar with an ETA on a terminal
    for i in range(args.repeat):
        # Alternating the systems spreads a shared machine's slow spells over both.
        run = f" (run {i + 1} of {args.repeat})" if args.repeat > 1 else ""
        for system in systems:
            t = time.monotonic()
            _say(f"{system} job{run}: -n {args.workers} -s {args.servers} {args.kvtype} ...")
            if system == "MXNet":
                rows = run_mxnet(args, plan_path, tmp)
            else:
                rows = run_kvps(args, plan_path, dict({"KVPS_SHM": "0"} if "TCP" in system else {},
                                                      **({"KVPS_CURVE": "1"} if "CURVE" in system else {}),
                                                      **({"KVPS_METRICS_PORT": "0"} if "metrics" in system else {}),
                                                      **({"KVPS_REPLICAS": str(args.replicas)}
                                                         if "replicated" in system else {}),
                                                      **({"KVPS_SERVER_THREADS": str(args.server_threads)}
                                                         if "threads" in system else {})))
            _say(f"{system} job done in {time.monotonic() - t:.1f} s")
            lost = missing(plan, rows)
            if lost:
                raise JobFailed(f"the {system} job exited cleanly but reported no result for {', '.join(lost)}")
            runs[system].append(rows)
            progress.advance(f"{system} job{run}")
    return runs


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _args(argv)
    except SystemExit as exc:           # argparse's --help and usage errors
        return exc.code if isinstance(exc.code, int) else USAGE
    if args.mxnet:
        from kvps.tools.bench.mxnet_job import check_python
        problem = check_python(args.mxnet)
        if problem:
            print(f"kvps bench pushpull: --mxnet {args.mxnet}: cannot import mxnet:\n{problem}", file=sys.stderr)
            return USAGE
    plan = workloads.make_plan(args.sizes, args.resnet_steps, args.quick, args.kvtype, args.modes, args.small_keys)
    try:
        with tempfile.TemporaryDirectory(prefix="kvps-bench-") as tmp:
            runs = measure(args, plan, tmp)
    except JobFailed as exc:
        print(f"kvps bench pushpull: {exc}", file=sys.stderr)
        return FAILED
    except KVPSError as exc:            # a bad KVPS_* variable in this environment
        print(f"kvps bench pushpull: {exc}", file=sys.stderr)
        return USAGE
    kvps_rows, mxnet_rows = median_run(runs["kvps"]), median_run(runs["MXNet"])
    rows = compare(kvps_rows, mxnet_rows)
    targets = judge(rows, args)
    print(report(rows, targets, args, bool(args.mxnet)), flush=True)
    if args.tcp:
        print("\n" + transport_report(kvps_rows, median_run(runs["kvps TCP"])), flush=True)
    for plain in ("kvps", "kvps TCP") if args.curve else ():
        if runs[plain]:
            print("\n" + curve_report(plain, median_run(runs[plain]), median_run(runs[f"{plain} CURVE"])), flush=True)
    if args.metrics:
        print("\n" + metrics_report(kvps_rows, median_run(runs["kvps metrics"])), flush=True)
    if args.replicas:
        print("\n" + replicas_report(args.replicas, kvps_rows, median_run(runs["kvps TCP"]),
                                     median_run(runs["kvps replicated"])), flush=True)
    if args.server_threads > 1:
        print("\n" + cost_report(f"Server threads: the same job with KVPS_SERVER_THREADS={args.server_threads} (big "
                                 f"sync rounds merged beside the I/O thread), in the same run; ratio = threads / one "
                                 f"thread.", "threads", kvps_rows, median_run(runs["kvps threads"])), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "kvps bench pushpull " + shlex.join(argv), "workers": args.workers,
                       "servers": args.servers, "kvtype": args.kvtype, "repeat": args.repeat,
                       "cpus": os.cpu_count(), "kernels": _kernels(),
                       "kvps": kvps_rows, "mxnet": mxnet_rows, "targets": targets}, f, indent=1)
    return 0


def _say(text):
    print(f"[bench] {text}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
