"""The `kvps` command: run the daemons, launch jobs, benchmark, and describe the install.

    kvps scheduler --port 0 --num-workers 2 --num-servers 1
    kvps server --scheduler 127.0.0.1:9091 [--plugin my_rules]
    kvps launch -n 2 -s 1 [--launcher local|ssh] [-H hostfile] [--env K=V] [--straggler 1=fixed:0.05] -- python train.py
    kvps bench pushpull|kernels|compare [options]
    kvps emulate -n 4 -s 1 -- python train.py                   # on emulated hosts (root)
    kvps experiment --quick                                     # train real models in every mode; report
    kvps info
"""
import argparse
import importlib
import logging
import sys

from .config import Config
from .errors import KVPSError


def _logging(cfg, role):
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s kvps-{role} %(levelname)s %(message)s")


def _config(role, args=None, **changes):
    cfg = Config.from_env()
    changes = {k: v for k, v in changes.items() if v is not None}
    cfg = cfg.replace(role=role, **changes)
    _logging(cfg, role)
    return cfg


def cmd_scheduler(args):
    from .scheduler import Scheduler
    cfg = _config("scheduler", num_workers=args.num_workers, num_servers=args.num_servers)
    host, port = args.host, args.port
    if cfg.scheduler is not None:            # started MXNet-style: DMLC_PS_ROOT_URI / _PORT
        host = host or cfg.scheduler[0]
        port = cfg.scheduler[1] if port is None else port
    scheduler = Scheduler(cfg, host or "127.0.0.1", port or 0)
    shown = scheduler.host if scheduler.host != "0.0.0.0" else "127.0.0.1"
    print(f"READY {shown}:{scheduler.port}", flush=True)
    return scheduler.serve()


def cmd_server(args):
    from .server.server import Server
    from .server.updaters import Registry
    scheduler = None
    if args.scheduler:
        host, _, port = args.scheduler.rpartition(":")
        if not host or not port.isdigit():
            raise KVPSError(f"--scheduler {args.scheduler!r} is not HOST:PORT")
        scheduler = (host, int(port))
    cfg = _config("server", scheduler=scheduler, port=args.port, host=args.host)
    cfg.require_scheduler()
    registry = Registry()
    for module in args.plugin:
        registry.load_plugin(module)
    server = Server(cfg, registry)
    print(f"READY {server.host}:{server.van.port}", flush=True)
    return server.serve()


def cmd_launch(args):
    from . import launcher
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
    module = importlib.import_module(f"kvps.bench.{args.what}")
    return module.main(args.rest)


def cmd_info(args):
    import kvps
    from . import kernels
    print(f"kvps {kvps.__version__}")
    print(kernels.describe())
    return 0


def parser():
    p = argparse.ArgumentParser(prog="kvps", description="kvps: a parameter server for distributed training")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("scheduler", help="run the scheduler (prints READY HOST:PORT)")
    s.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    s.add_argument("--port", type=int, default=None, help="port to bind (0: any free port, the default)")
    s.add_argument("-n", "--num-workers", type=int, default=None, help="workers in the job (KVPS_NUM_WORKERS)")
    s.add_argument("-s", "--num-servers", type=int, default=None, help="servers in the job (KVPS_NUM_SERVERS)")
    s.set_defaults(fn=cmd_scheduler)

    s = sub.add_parser("server", help="run a key-value server")
    s.add_argument("--scheduler", default=None, help="the scheduler's HOST:PORT (KVPS_SCHEDULER)")
    s.add_argument("--host", default=None, help="address to bind and advertise (KVPS_HOST)")
    s.add_argument("--port", type=int, default=None, help="port to bind (KVPS_PORT; 0: any)")
    s.add_argument("--plugin", action="append", default=[],
                   help="a Python module with kvps_register(registry) that adds update rules")
    s.set_defaults(fn=cmd_server)

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

    s = sub.add_parser("bench", help="benchmarks: pushpull, kernels, compare")
    s.add_argument("what", choices=("pushpull", "kernels", "compare"))
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_bench)

    sub.add_parser("emulate", add_help=False,
                   help="run a job on an emulated multi-host cluster: network namespaces, tc links (root)")

    sub.add_parser("experiment", add_help=False,
                   help="train real models under every consistency mode, with and without a straggler; "
                        "write a report (docs/experiment.md)")

    s = sub.add_parser("info", help="print the kernel backend, CPU features and CUDA status")
    s.set_defaults(fn=cmd_info)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["emulate"]:          # its own parser: options before and after "--"
        from .emulate import main as emulate_main
        return emulate_main(argv[1:])
    if argv[:1] == ["experiment"]:       # its own parser too (kvps/experiment/cli.py)
        from .experiment import main as experiment_main
        return experiment_main(argv[1:])
    args = parser().parse_args(argv)
    try:
        return args.fn(args) or 0
    except KVPSError as exc:
        print(f"kvps {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
