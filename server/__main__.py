"""A key-value server's command line: `kvps server ...` or `python -m server ...`."""
import argparse
import sys

from kvps.config import for_role
from kvps.errors import KVPSError
from kvps.wire import connections
from server.server import Server
from kvps.ps.rules import Registry


def parser():
    p = argparse.ArgumentParser(prog="kvps server", description="run a key-value server (prints READY HOST:PORT)")
    p.add_argument("--scheduler", default=None, help="the scheduler's HOST:PORT (KVPS_SCHEDULER)")
    p.add_argument("--host", default=None, help="address to bind and advertise (KVPS_HOST)")
    p.add_argument("--port", type=int, default=None, help="port to bind (KVPS_PORT; 0: any)")
    p.add_argument("--plugin", action="append", default=[],
                   help="a Python module with kvps_register(registry) that adds update rules")
    return p


def main(argv=None):
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    connections.raise_fd_limit()     # a daemon holds a connection per peer (kvps/wire/connections.py)
    try:
        scheduler = None
        if args.scheduler:
            host, _, port = args.scheduler.rpartition(":")
            if not host or not port.isdigit():
                raise KVPSError(f"--scheduler {args.scheduler!r} is not HOST:PORT")
            scheduler = (host, int(port))
        cfg = for_role("server", scheduler=scheduler, port=args.port, host=args.host)
        cfg.require_scheduler()
        registry = Registry()
        for module in args.plugin:
            registry.load_plugin(module)
        server = Server(cfg, registry)
    except KVPSError as exc:
        print(f"kvps server: error: {exc}", file=sys.stderr)
        return 2
    metrics = f" metrics={server.host}:{server.telemetry.port}" if server.telemetry and server.telemetry.port else ""
    print(f"READY {server.host}:{server.van.port}{metrics}", flush=True)
    return server.serve()


if __name__ == "__main__":
    sys.exit(main())
