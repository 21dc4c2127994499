"""The `kvps` command: run the daemons, launch jobs, benchmark, and describe the install.

    kvps scheduler --port 0 --num-workers 2 --num-servers 1
    kvps server --scheduler 127.0.0.1:9091 [--plugin my_rules]
    kvps launch -n 2 -s 1 [--launcher local|ssh] [-H hostfile] [--env K=V] [--straggler 1=fixed:0.05] -- python train.py
    kvps bench pushpull|priority|kernels|compare [options]
    kvps emulate -n 4 -s 1 -- python train.py                   # on emulated hosts (root)
    kvps experiment --quick                                     # train real models in every mode; report
    kvps fuzz --frames 100000 [--seed S]                        # hostile frames at a job's daemons; report
    kvps info
"""
import argparse
import importlib
import logging
import sys

from kvps.errors import KVPSError


def cmd_launch(args):
    from kvps import launcher
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    env = launcher.parse_env(args.env)
    worker_env = launcher.straggler_env(args.straggler, args.num_workers, args.straggler_seed)
    if args.launcher == "ssh":
        if not args.hostfile:
            raise KVPSError("--launcher ssh needs -H HOSTFILE")
        return launcher.launch_ssh(args.num_workers, args.num_servers, command, args.hostfile, args.port, env,
                                   dry_run=args.dry_run, worker_env=worker_env)
    return launcher.launch_local(args.num_workers, args.num_servers, command, env, worker_env)


def cmd_bench(args):
    module = importlib.import_module(f"kvps.tools.bench.{args.what}")
    return module.main(args.rest)


def cmd_info(args):
    """The version and kernels.describe(), whose first line says whether the C kernels are built
    (or why not, with the reason setup.py recorded); when they cannot run, that line goes to
    stderr too as a WARNING, since everything then runs on slower kernels."""
    import kvps
    from kvps import kernels
    print(f"kvps {kvps.__version__}")
    text = kernels.describe()
    print(text)
    if not kernels.available_backends()["c"][0]:
        print(f"WARNING: {text.splitlines()[0]}", file=sys.stderr)
    return 0


def parser():
    p = argparse.ArgumentParser(prog="kvps", description="kvps: a parameter server for distributed training")
    sub = p.add_subparsers(dest="cmd", required=True)

    sub.add_parser("scheduler", add_help=False, help="run the scheduler (prints READY HOST:PORT)")
    sub.add_parser("server", add_help=False, help="run a key-value server (prints READY HOST:PORT)")

    s = sub.add_parser("launch", help="start a whole job: scheduler, servers and workers")
    s.add_argument("-n", "--num-workers", type=int, required=True)
    s.add_argument("-s", "--num-servers", type=int, default=1)
    s.add_argument("--launcher", choices=("local", "ssh"), default="local")
    s.add_argument("-H", "--hostfile", default=None, help="hosts for --launcher ssh, one per line")
    s.add_argument("--port", type=int, default=9091, help="scheduler port for --launcher ssh")
    s.add_argument("--dry-run", action="store_true", help="with ssh: print the commands, start nothing")
    s.add_argument("--env", action="append", default=[], help="KEY=VALUE for every process (repeatable)")
    s.add_argument("--straggler", action="append", default=[], metavar="RANK=SPEC",
                   help="slow worker RANK by an extra delay per step: fixed:S, exp:MEAN or uniform:LO:HI "
                        "seconds (repeatable; see kvps/straggler.py)")
    s.add_argument("--straggler-seed", type=int, default=0, help="seed of random straggler delays")
    s.add_argument("command", nargs=argparse.REMAINDER, help="-- then the worker command")
    s.set_defaults(fn=cmd_launch)

    s = sub.add_parser("bench", help="benchmarks: pushpull, priority, kernels, compare")
    s.add_argument("what", choices=("pushpull", "priority", "kernels", "compare"))
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_bench)

    sub.add_parser("emulate", add_help=False,
                   help="run a job on an emulated multi-host cluster: network namespaces, tc links (root)")

    sub.add_parser("experiment", add_help=False,
                   help="train real models under every consistency mode, with and without a straggler; "
                        "write a report (docs/experiment.md)")

    sub.add_parser("fuzz", add_help=False,
                   help="send hostile frames to a job's daemons; report crashes and memory (kvps/tools/fuzz)")

    s = sub.add_parser("info", help="print the kernel backend, CPU features and CUDA status")
    s.set_defaults(fn=cmd_info)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["server"], ["scheduler"]):     # the daemons' own parsers (server/, scheduler/)
        from kvps import roles
        try:
            return roles.run(argv[0], argv[1:])
        except KVPSError as exc:
            print(f"kvps {argv[0]}: error: {exc}", file=sys.stderr)
            return 2
    if argv[:1] == ["emulate"]:          # its own parser: options before and after "--"
        from kvps.tools.emulate import main as emulate_main
        return emulate_main(argv[1:])
    if argv[:1] == ["experiment"]:       # its own parser too (kvps/tools/experiment/cli.py)
        from kvps.tools.experiment import main as experiment_main
        return experiment_main(argv[1:])
    if argv[:1] == ["fuzz"]:             # and kvps/tools/fuzz
        from kvps.tools.fuzz import main as fuzz_main
        return fuzz_main(argv[1:])
    args = parser().parse_args(argv)
    try:
        return args.fn(args) or 0
    except KVPSError as exc:
        print(f"kvps {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
