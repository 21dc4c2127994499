"""`kvps bench priority`: what honouring `priority=` buys a training step.

    kvps bench priority                      # ResNet-50 set, 2 workers, 1 server, 3 runs of each
    kvps bench priority --repeat 5 --steps 10

Each worker pushes ResNet-50's gradients in the order backward makes them (last layer first,
`priority=-i`) and then pulls them in the order the next forward needs them (first layer first):
see priority_worker.py. The figure that matters is when the first layer's weights are back, since
the next forward can start then (ByteScheduler's argument). The same job runs with the worker's
send schedule on (KVPS_SEND_CREDIT, the default) and off (KVPS_SEND_CREDIT=0: messages leave in
call order), alternating, and the table gives the medians and the ratio on/off.
"""
import argparse
import statistics
import sys
import time

from kvps.config import Config
from kvps.errors import KVPSError
from kvps.tools.bench.pushpull import JobFailed, kvps_job, results

FAILED, USAGE = 1, 2
TAG = "kvps-bench-priority"


def parser():
    p = argparse.ArgumentParser(prog="kvps bench priority",
                                description="time to the first layer's weights and step time, ResNet-50 set pushed "
                                            "in backward order, with the priority schedule on and off")
    p.add_argument("-n", "--workers", type=int, default=2, help="workers (default 2)")
    p.add_argument("-s", "--servers", type=int, default=1, help="servers (default 1)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per job, after warm-up (default 8)")
    p.add_argument("--repeat", type=int, default=3, help="jobs of each setting, alternating (default 3)")
    p.add_argument("--credit", type=int, default=Config().send_credit,
                   help=f"KVPS_SEND_CREDIT for the 'on' jobs (default {Config().send_credit})")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each job may take (default 300)")
    p.add_argument("-v", "--verbose", action="store_true", help="echo every child's output to stderr")
    return p


def _args(argv):
    p = parser()
    args = p.parse_args(argv)
    if args.workers < 1 or args.servers < 1 or args.steps < 1 or args.repeat < 1 or args.credit < 1:
        p.error("-n, -s, --steps, --repeat and --credit must be at least 1")
    return args


def run_job(args, credit):
    """(first-layer ms, step ms) of each timed step of one job."""
    command = [sys.executable, "-m", "kvps.tools.bench.priority_worker", str(args.steps), "2"]
    text = kvps_job(args.workers, args.servers, command, {"KVPS_SEND_CREDIT": str(credit)}, args.timeout,
                    args.verbose, f"kvps (KVPS_SEND_CREDIT={credit})")
    rows = results(text, TAG)
    if not rows:
        raise JobFailed(f"the job with KVPS_SEND_CREDIT={credit} printed no result; its output:\n{text[-4000:]}")
    return list(zip(rows[0]["first_ms"], rows[0]["step_ms"]))


def measure(args):
    """{"on": [per-job (median first ms, median step ms)], "off": [...]}."""
    runs = {"on": [], "off": []}
    for i in range(args.repeat):
        for setting, credit in (("on", args.credit), ("off", 0)):
            t = time.monotonic()
            steps = run_job(args, credit)
            runs[setting].append((statistics.median(f for f, _ in steps), statistics.median(s for _, s in steps)))
            print(f"[bench] run {i + 1}/{args.repeat}, schedule {setting}: first layer "
                  f"{runs[setting][-1][0]:.1f} ms, step {runs[setting][-1][1]:.1f} ms "
                  f"({time.monotonic() - t:.1f} s)", file=sys.stderr, flush=True)
    return runs


def report(runs, args):
    med = {k: (statistics.median(f for f, _ in v), statistics.median(s for _, s in v)) for k, v in runs.items()}
    lines = [f"kvps bench priority: ResNet-50 set (161 tensors, 102 MB), {args.workers} workers, {args.servers} "
             f"server{'s' * (args.servers != 1)}, dist_sync; pushes in backward order (priority=-i), then pulls "
             f"first layer first. Medians over {args.repeat} jobs of each (each job: the median of {args.steps} "
             f"steps); on = KVPS_SEND_CREDIT={args.credit}, off = KVPS_SEND_CREDIT=0 (call order).",
             "",
             "| figure | schedule on ms | schedule off ms | on/off |",
             "|---|--:|--:|--:|"]
    for i, name in enumerate(("first layer's weights back", "whole step")):
        on, off = med["on"][i], med["off"][i]
        lines.append(f"| {name} | {on:.1f} | {off:.1f} | {on / off:.2f} |")
    lines += ["", "Per job (first ms / step ms): on " + ", ".join(f"{f:.0f}/{s:.0f}" for f, s in runs["on"])
              + "; off " + ", ".join(f"{f:.0f}/{s:.0f}" for f, s in runs["off"])]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else USAGE
    try:
        runs = measure(args)
    except JobFailed as exc:
        print(f"kvps bench priority: {exc}", file=sys.stderr)
        return FAILED
    except KVPSError as exc:
        print(f"kvps bench priority: {exc}", file=sys.stderr)
        return USAGE
    print(report(runs, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
