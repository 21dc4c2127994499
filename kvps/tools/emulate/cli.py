"""`kvps emulate`: run a kvps job, a link check or a sync benchmark on an emulated cluster.

    kvps emulate -n 4 -s 1 [--colocated] [--rate 1gbit] [--delay-ms 0] -- python train.py
    kvps emulate check [--rate 1gbit] [--mb 125]
    kvps emulate sync -n 4 -s 1,4 --placement dedicated,colocated [--workload resnet50] [--steps 3]
                      [--systems ps,geo,ring,gloo,mxnet] [--mxnet ~/mxvenv/bin/python] [--replicas R]
                      [--k-steps 1,4,16]
    kvps emulate theory -n 2,4,8 -s 1,4 --placement dedicated,colocated [--mb 102.2] [--rate 1gbit] [--replicas R]

Exit codes: 0 success; a worker's own non-zero code; 1 a failed job, check or benchmark;
2 a usage error; 77 skipped: network namespaces are not permitted here (the reason is printed);
124 a deadline passed; 130 interrupted (Ctrl-C). Everything it creates is removed on the way out.
"""
import argparse
import sys

from kvps.errors import ConfigError, KVPSError, KVTimeoutError
from kvps.launch import parse_env

from kvps.tools.emulate import sync
from kvps.tools.emulate.job import JOB_TIMEOUT, run_job
from kvps.tools.emulate.network import Network, NotPermitted, parse_rate, permitted, show_rate
from kvps.tools.emulate.probe import transfer
from kvps.tools.emulate.theory import theory

OK, FAILED, USAGE, SKIPPED, TIMED_OUT, INTERRUPTED = 0, 1, 2, 77, 124, 130
SUBCOMMANDS = ("check", "sync", "theory")
RESNET50_BYTES = 4 * 25_557_032


def _network_options(p):
    p.add_argument("--rate", default="1gbit", help="each host link's rate, both ways (default 1gbit)")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="one-way delay between any two hosts, in ms (needs the netem qdisc; default 0)")
    p.add_argument("--mtu", type=int, default=1500, help="MTU of the host links (default 1500)")


def _ints(text):
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least 1")
    return values


def _placements(text):
    values = text.split(",")
    bad = [v for v in values if v not in ("dedicated", "colocated")]
    if bad:
        raise argparse.ArgumentTypeError(f"placement {bad[0]!r} is not dedicated or colocated")
    return values


def _systems(text):
    try:
        return sync.parse_systems(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_parser():
    p = argparse.ArgumentParser(
        prog="kvps emulate",
        description="Run a kvps job with every node in its own network namespace, each host link limited to "
                    "--rate both ways. Also: 'kvps emulate check' (measure the links), 'kvps emulate sync' "
                    "(time gradient sync against the bandwidth bound), 'kvps emulate theory' (the bound alone).",
        epilog="Exit codes: 0 ok, a worker's code, 1 failed, 2 usage, 77 skipped (no namespaces), 124 deadline, "
               "130 interrupted.")
    p.add_argument("-n", "--workers", type=int, default=2, help="workers, each on its own host (default 2)")
    p.add_argument("-s", "--servers", type=int, default=1, help="servers (default 1)")
    p.add_argument("--colocated", action="store_true",
                   help="put server j on worker j's host (default: servers get hosts of their own)")
    _network_options(p)
    p.add_argument("--timeout", type=float, default=JOB_TIMEOUT, help="seconds the job may run (default 600)")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for every process (repeatable)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the worker command")
    return p


def check_parser():
    p = argparse.ArgumentParser(prog="kvps emulate check",
                                description="Send bytes between emulated hosts over TCP and compare the time "
                                            "with the configured link rate: one way, both ways at once, two into one.")
    _network_options(p)
    p.add_argument("--mb", type=float, default=None,
                   help="megabytes per transfer (default: one second's worth at --rate, within 1..250)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds each transfer may take (default 120)")
    return p


def _compression(text):
    """A checked compression spec from JSON text; argparse reports the ValueError's text."""
    import json

    from kvps.ps import compression
    try:
        spec = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON (e.g. '{{\"type\": \"fp16\"}}')") from None
    try:
        return compression.check(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def sync_parser(prog="kvps emulate sync"):
    p = argparse.ArgumentParser(prog=prog, description="Time a synchronous gradient step of kvps's parameter server "
                                "(dist_sync push+pull and pushpull) and ring beside torch.distributed gloo all-reduce "
                                "and (with --mxnet) MXNet dist_sync on the emulated cluster, each beside the bandwidth "
                                "bound of a parameter server or a ring all-reduce.")
    p.add_argument("-n", "--workers", type=_ints, default=[2], help="worker counts, e.g. 2,4 (default 2)")
    p.add_argument("-s", "--servers", type=_ints, default=[1], help="server counts, e.g. 1,4 (default 1)")
    p.add_argument("--placement", type=_placements, default=["dedicated"],
                   help="dedicated, colocated or both, comma-separated (default dedicated)")
    _network_options(p)
    p.add_argument("--replicas", type=int, default=0, metavar="R",
                   help="kvps PS rows: also run (sync) or bound (theory) each PS with chain replication, "
                        "KVPS_REPLICAS=R, beside R=0; the bound counts the chains' copies (default 0)")
    if prog.endswith("theory"):
        p.add_argument("--mb", type=float, default=RESNET50_BYTES / 1e6,
                       help="megabytes of gradients per step (default ResNet-50's 102.2)")
        return p
    p.add_argument("--workload", default="resnet50",
                   help="resnet50 (161 tensors, 102 MB) or one float32 array of a size like 64MB")
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode, after warm-up (default 3)")
    p.add_argument("--compression", type=_compression, default=None,
                   help='kvps PS rows: gradient compression as kv.set_gradient_compression takes it, in JSON, '
                        'e.g. \'{"type": "fp16", "pull": true}\' (pull: compress what comes back too)')
    p.add_argument("--systems", type=_systems, default=None,
                   help="comma-separated, from ps (kvps dist_sync), geo (kvps dist_geo:K, for each K of --k-steps), "
                        "ring (kvps all-reduce), gloo (torch.distributed all-reduce), mxnet (MXNet dist_sync; needs "
                        "--mxnet) (default ps,ring,gloo and mxnet when --mxnet is given)")
    p.add_argument("--k-steps", type=_ints, default=None, metavar="K",
                   help="geo rows: GEO-SGD's K, e.g. 1,4,16: a sync every K steps (default 4)")
    p.add_argument("--mxnet", metavar="PYTHON", default=None,
                   help="a Python with mxnet 1.9.1 (e.g. ~/mxvenv/bin/python): also run MXNet dist_sync")
    p.add_argument("--timeout", type=float, default=JOB_TIMEOUT, help="seconds each job may run (default 600)")
    p.add_argument("-v", "--verbose", action="store_true", help="echo the jobs' output to stderr")
    return p


def main(argv=None):
    """`kvps emulate ...`; returns the exit code (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    sub = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    try:
        if sub == "check":
            return cmd_check(check_parser().parse_args(argv[1:]))
        if sub == "sync":
            return cmd_sync(sync_parser().parse_args(argv[1:]))
        if sub == "theory":
            return cmd_theory(sync_parser("kvps emulate theory").parse_args(argv[1:]))
        return cmd_run(run_parser().parse_args(argv))
    except SystemExit as exc:              # argparse: --help, or a usage error
        if isinstance(exc.code, int):
            return exc.code
        return USAGE
    except NotPermitted as exc:
        return _skip(str(exc))
    except ConfigError as exc:
        return _fail(exc, USAGE)
    except KVTimeoutError as exc:
        return _fail(exc, TIMED_OUT)
    except (KVPSError, OSError) as exc:
        return _fail(exc, FAILED)
    except KeyboardInterrupt:
        print("kvps emulate: interrupted; everything it started was stopped and removed", file=sys.stderr)
        return INTERRUPTED


def _skip(reason):
    print(f"kvps emulate: skipped: {reason}", file=sys.stderr)
    return SKIPPED


def _fail(exc, code):
    print(f"kvps emulate: error: {exc}", file=sys.stderr)
    return code


def _require(delay_ms):
    ok, why = permitted(delay=delay_ms > 0)
    if not ok:
        raise NotPermitted(why)


# ---- kvps emulate -- COMMAND ----
def cmd_run(args):
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ConfigError("no worker command given: kvps emulate -n W -s S -- python train.py")
    env = parse_env(args.env)
    parse_rate(args.rate)                  # a bad rate is a usage error, reported before any probing
    _require(args.delay_ms)
    codes = run_job(args.workers, args.servers, command, args.colocated, args.rate, args.delay_ms, args.mtu,
                    args.timeout, env)
    # A worker's own exit code comes before those of the workers the job then stopped (negative signals).
    failed = [c for c in codes if c and c > 0] or [128 - c for c in codes if c]
    return failed[0] if failed else OK


# ---- kvps emulate check ----
def cmd_check(args):
    rate = parse_rate(args.rate)
    nbytes = int(args.mb * 1e6) if args.mb else int(min(250e6, max(1e6, rate / 8)))
    if nbytes < 1:
        raise ConfigError(f"--mb {args.mb} must be positive")
    _require(args.delay_ms)
    T = 8 * nbytes / rate
    scenarios = [("h1 -> h2", [("h1", "h2")]),
                 ("h1 -> h2 and h2 -> h1 at once", [("h1", "h2"), ("h2", "h1")]),
                 ("h0 and h1 -> h2 at once", [("h0", "h2"), ("h1", "h2")])]
    print(f"kvps emulate check: 3 hosts on one bridge, each link {show_rate(rate)} both ways (tbf)"
          f"{f', {args.delay_ms:g} ms one way' if args.delay_ms else ''}, MTU {args.mtu}; "
          f"{nbytes / 1e6:g} MB per sender. Times are first to last byte at the receiver; theory = bytes / rate "
          f"through the busiest link direction.", flush=True)
    print("\n| transfer | receiver | MB | theory s | measured s | measured Mbit/s | measured/theory |\n"
          "|---|---|--:|--:|--:|--:|--:|", flush=True)
    worst = 0.0
    with Network() as net:
        net.up(3, rate=args.rate, delay_ms=args.delay_ms, mtu=args.mtu)
        for label, pairs in scenarios:
            for dst, result in transfer(net, pairs, nbytes, args.timeout).items():
                senders = sum(1 for _, d in pairs if d == dst)
                theory_s = senders * T
                ratio = result["seconds"] / theory_s
                worst = max(worst, abs(ratio - 1))
                print(f"| {label} | {dst} | {result['bytes'] / 1e6:g} | {theory_s:.3f} | {result['seconds']:.3f} | "
                      f"{8 * result['bytes'] / result['seconds'] / 1e6:.1f} | {ratio:.3f} |", flush=True)
    headers = (args.mtu + 14) / (args.mtu - 52)     # frame (Ethernet header) over TCP payload (IPv4, timestamps)
    print(f"\nLargest deviation from theory: {worst:.1%}. Headers alone make a transfer {headers - 1:.1%} slower "
          f"than bytes / rate (each {args.mtu + 14}-byte frame carries {args.mtu - 52} bytes of payload); a "
          f"half-duplex link would double the both-ways rows, a link shared by all hosts the two-into-one row.")
    return OK


# ---- kvps emulate sync / theory ----
def _shapes(args):
    combos, notes = sync.shapes(args.workers, args.servers, args.placement)
    for note in notes:
        print(note, file=sys.stderr)
    return combos


def cmd_theory(args):
    rate = parse_rate(args.rate)
    M = args.mb * 1e6
    R = args.replicas
    combos = _shapes(args)
    for note in sync.check_replicas(R, ["ps"], combos):
        print(note, file=sys.stderr)
    print(f"Bandwidth bound per step, M = {args.mb:g} MB, B = {show_rate(rate)} per host link, full duplex\n")
    extra = (f" PS R={R} bound ms |", "--:|") if R else ("", "")
    print(f"| W | S | servers | PS bound ms |{extra[0]} ring bound ms |\n|--:|--:|---|--:|{extra[1]}--:|")
    for W, S, colocated in combos:
        t = theory(M, rate, W, S, colocated)
        replicated = ""
        if R:
            replicated = f" {theory(M, rate, W, S, colocated, R).ps * 1e3:.0f} |" if S > R else " - |"
        print(f"| {W} | {S} | {'co-located' if colocated else 'dedicated'} | {t.ps * 1e3:.0f} |{replicated} "
              f"{t.ring * 1e3:.0f} |")
    return OK


def cmd_sync(args):
    rate = parse_rate(args.rate)
    combos = _shapes(args)
    bench = sync.Benchmark(args, combos)       # usage errors are reported before probing for namespaces
    _require(args.delay_ms)
    return bench.run(rate)
