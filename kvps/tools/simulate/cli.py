"""`kvps simulate`: a calibrated model of one synchronous step, PS and ring, from 1 to 1,024 workers.

    kvps simulate calibrate [--quick] [--no-emulate] [--out reports/simulate/costs.json]
    kvps simulate predict --system ps -n 4 -s 2 --rate 1gbit --model resnet50 [--mode push+pull] [--costs FILE]
    kvps simulate sweep --workers 2..1024 --rate 10gbit,25gbit,100gbit --model resnet50,bert-large [--servers 1,8]
    kvps simulate validate -n 2,4 -s 1,2,4 --rate 1gbit,100mbit --model resnet50,wide [--systems ps,ring]

Exit codes: 0 done; 1 a measurement failed (validate: some setup failed or missed 15%, with
--strict); 2 a usage error; 77 skipped (validate and calibrate's emulated part need network
namespaces; calibrate then measures loopback only). docs/simulate.md explains the model.
"""
import argparse
import json
import os
import sys

from kvps.errors import ConfigError, KVPSError

from kvps.tools.simulate import calibrate as calibrate_mod
from kvps.tools.simulate import sweep as sweep_mod
from kvps.tools.simulate import validate as validate_mod
from kvps.tools.simulate.costs import Costs
from kvps.tools.simulate.models import compute_s, tensors
from kvps.tools.simulate.step import Setup, predict

OK, FAILED, USAGE, SKIPPED = 0, 1, 2, 77
DEFAULT_DIR = os.path.join("reports", "simulate")
DEFAULT_COSTS = os.path.join(DEFAULT_DIR, "costs.json")


def _list(kind, convert=str):
    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"--{kind} {text!r} lists nothing")
        try:
            return [convert(t) for t in items]
        except (ValueError, ConfigError) as exc:
            raise argparse.ArgumentTypeError(f"--{kind} {text!r}: {exc}") from None
    return parse


def _rate(text):
    from kvps.tools.emulate.network import parse_rate
    return parse_rate(text)


def _costs(path):
    """Costs from --costs, else the default file if calibrate wrote one, else the defaults."""
    if path:
        return Costs.load(path)
    if os.path.exists(DEFAULT_COSTS):
        return Costs.load(DEFAULT_COSTS)
    return Costs()


def parser():
    p = argparse.ArgumentParser(prog="kvps simulate", description="A discrete-event model of a synchronous step "
                                "(parameter server and ring), calibrated on this machine.",
                                epilog="docs/simulate.md explains the model and its limits.")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("calibrate", help="measure the model's costs on this machine into a file")
    c.add_argument("--quick", action="store_true", help="fewer, smaller rounds (seconds; what the tests run)")
    c.add_argument("--no-emulate", action="store_true", help="loopback only: no emulated hosts")
    c.add_argument("--out", default=DEFAULT_COSTS, help=f"the costs file (default {DEFAULT_COSTS})")

    q = sub.add_parser("predict", help="the predicted step of one setup")
    q.add_argument("--system", choices=("ps", "ring"), default="ps")
    q.add_argument("-n", "--workers", type=int, required=True)
    q.add_argument("-s", "--servers", type=int, default=1, help="dedicated server hosts (ps)")
    q.add_argument("--rate", type=_rate, default=None, help="host link rate, e.g. 1gbit (default: no link limit)")
    q.add_argument("--model", default="resnet50", help="resnet50, bert-large, wide or a size such as 64MB")
    q.add_argument("--mode", choices=("pushpull", "push+pull"), default="pushpull")
    q.add_argument("--transport", default=None, help="loopback, veth or cluster (default: veth with --rate, "
                                                     "else loopback)")
    q.add_argument("--compression", type=float, default=1.0, help="wire bytes / gradient bytes (0.5: fp16)")
    q.add_argument("--no-priority", action="store_true", help="serve gradients in the order they are ready")
    q.add_argument("--compute-ms", type=float, default=0.0, help="forward + backward time of a step")
    q.add_argument("--host-cores", type=int, default=None, help="all processes share this many CPUs (default: each has its own)")
    q.add_argument("--costs", default=None, help=f"a calibrate file (default {DEFAULT_COSTS} if present)")

    s = sub.add_parser("sweep", help="step time and scaling efficiency, PS (best S) and ring, up to 1,024 workers")
    s.add_argument("--workers", default="2..1024", help="LOW..HIGH (doubling) or a list (default 2..1024)")
    s.add_argument("--servers", type=_list("servers", int), default=None,
                   help="server counts to try (default 1, W/4, W/2, W)")
    s.add_argument("--rate", type=_list("rate", _rate), default=[10e9, 25e9, 100e9],
                   help="link rates (default 10gbit,25gbit,100gbit)")
    s.add_argument("--model", type=_list("model"), default=["resnet50", "bert-large"])
    s.add_argument("--compute-ms", type=float, default=None, help="compute per step (default: the model's)")
    s.add_argument("--transport", default="loopback", help="the costs' transport each message pays (default "
                                                          "loopback: measured here; cluster: assumed figures)")
    s.add_argument("--costs", default=None)
    s.add_argument("--out", default=DEFAULT_DIR, help=f"where sweep.md, sweep.json, sweep.png go ({DEFAULT_DIR})")

    v = sub.add_parser("validate", help="predicted against measured on emulated hosts (kvps emulate sync)")
    v.add_argument("-n", "--workers", type=_list("workers", int), default=[2, 4])
    v.add_argument("-s", "--servers", type=_list("servers", int), default=[1, 2, 4])
    v.add_argument("--rate", type=_list("rate"), default=["1gbit", "100mbit"])
    v.add_argument("--model", type=_list("model"), default=["resnet50", "wide"])
    v.add_argument("--systems", type=_list("systems"), default=["ps", "ring"])
    v.add_argument("--steps", type=int, default=None, help="timed steps of each setup, whose median is compared "
                   "(default: enough to fill about 0.2 s by the model, 3 to 60)")
    v.add_argument("--repeats", type=int, default=None, help="jobs of each setup, whose medians' median is compared "
                   "(default: 3 where the model's step is under 50 ms, else 1)")
    v.add_argument("--timeout", type=float, default=300.0, help="deadline of each setup's job, seconds")
    v.add_argument("--strict", action="store_true", help="exit 1 unless every setup is within 15%%")
    v.add_argument("--costs", default=None)
    v.add_argument("--out", default=DEFAULT_DIR, help=f"where validation.md and .json go ({DEFAULT_DIR})")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    try:
        return {"calibrate": cmd_calibrate, "predict": cmd_predict, "sweep": cmd_sweep,
                "validate": cmd_validate}[args.cmd](args)
    except ConfigError as exc:
        print(f"kvps simulate {args.cmd}: error: {exc}", file=sys.stderr)
        return USAGE
    except KVPSError as exc:
        print(f"kvps simulate {args.cmd}: failed: {exc}", file=sys.stderr)
        return FAILED


def _mkdir_for(path):
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)


def cmd_calibrate(args):
    costs = calibrate_mod.calibrate(quick=args.quick, emulate=not args.no_emulate)
    _mkdir_for(args.out)
    costs.save(args.out)
    print(f"wrote {args.out}")
    return OK


def cmd_predict(args):
    # every process on CPUs of its own unless --host-cores says they share some (as the validation's do)
    costs = _costs(args.costs).replace(host_cores=args.host_cores)
    transport = args.transport or ("veth" if args.rate else "loopback")
    setup = Setup(args.system, args.workers, args.servers, rate=args.rate, transport=transport, mode=args.mode,
                  priority=not args.no_priority, compression=args.compression, compute_s=args.compute_ms / 1e3)
    grads = tensors(args.model)
    out = predict(setup, grads, costs)
    from kvps.tools.emulate.theory import theory
    bound = None
    if args.rate:
        t = theory(sum(grads) * args.compression, args.rate, args.workers, max(1, args.servers))
        bound = t.ps if args.system == "ps" else t.ring
    print(json.dumps(dict(out, model=args.model, bytes=sum(grads), bound_s=bound, costs=costs.source), indent=1))
    return OK


def cmd_sweep(args):
    try:
        workers = sweep_mod.parse_workers(args.workers)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    costs = _costs(args.costs)
    compute = None if args.compute_ms is None else args.compute_ms / 1e3
    costs.transport(args.transport)            # an unknown one is a usage error before the sweep
    rows = sweep_mod.sweep(costs, workers, args.rate, args.model, args.servers, compute,
                           say=lambda t: print(t, file=sys.stderr, flush=True), transport=args.transport)
    os.makedirs(args.out, exist_ok=True)
    lines = sweep_mod.table(rows)
    cross = sweep_mod.crossover(rows)
    notes = [f"* {m} at {r / 1e9:g} Gbit/s: the best PS is faster than the ring at W = {', '.join(map(str, w))}"
             if w else f"* {m} at {r / 1e9:g} Gbit/s: the ring is never slower than the best PS in this range"
             for (m, r), w in cross.items()]
    text = "\n".join([f"# kvps simulate sweep (predicted; costs: {costs.source})", "", *lines, "", *notes]) + "\n"
    with open(os.path.join(args.out, "sweep.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump({"costs": costs.source, "rows": [dict(r, ps_by_S={str(k): v for k, v in r["ps_by_S"].items()})
                                                   for r in rows]}, f, indent=1)
    png = sweep_mod.plot(rows, os.path.join(args.out, "sweep.png"))
    print(text + (f"\nplot: {png}" if png else "\n(no plot: matplotlib is not installed)"))
    return OK


def cmd_validate(args):
    from kvps.tools.emulate import permitted
    for name in ("steps", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name} {getattr(args, name)} must be at least 1")
    ok, why = permitted()
    if not ok:
        print(f"kvps simulate validate: skipped: {why}", file=sys.stderr)
        return SKIPPED
    costs = _costs(args.costs)
    rows = validate_mod.validate(costs, args.workers, args.servers, args.rate, args.model, args.systems,
                                 args.steps, args.timeout, say=lambda t: print(t, file=sys.stderr, flush=True),
                                 repeats=args.repeats)
    within, measured, mid = validate_mod.summary(rows)
    lines = validate_mod.table(rows)
    text = "\n".join([f"# kvps simulate validate (costs: {costs.source})", "", *lines, "",
                      f"{within} of {measured} measured rows within 15%; median |predicted/measured - 1| = "
                      f"{mid:.1%}."]) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "validation.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "validation.json"), "w") as f:
        json.dump({"costs": costs.source, "rows": rows}, f, indent=1)
    print(text)
    failed = any(r["measured_s"] is None for r in rows)
    return FAILED if failed or (args.strict and within < len(rows)) else OK
