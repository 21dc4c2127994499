"""The scheduler's command line: `kvps scheduler ...` or `python -m scheduler ...`."""
import argparse
import sys

from kvps.config import for_role
from kvps.errors import KVPSError
from kvps.wire import connections
from scheduler.scheduler import Scheduler


def parser():
    p = argparse.ArgumentParser(prog="kvps scheduler", description="run the scheduler (prints READY HOST:PORT)")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=None, help="port to bind (0: any free port, the default)")
    p.add_argument("-n", "--num-workers", type=int, default=None, help="workers in the job (KVPS_NUM_WORKERS)")
    p.add_argument("-s", "--num-servers", type=int, default=None, help="servers in the job (KVPS_NUM_SERVERS)")
    p.add_argument("--recover", action="store_true",
                   help="take over a running job whose scheduler died, on its address: its nodes register "
                        "again with their ranks (they wait KVPS_SCHEDULER_GRACE s for this)")
    return p


def main(argv=None):
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    connections.raise_fd_limit()     # a daemon holds a connection per peer (kvps/wire/connections.py)
    try:
        cfg = for_role("scheduler", num_workers=args.num_workers, num_servers=args.num_servers)
        host, port = args.host, args.port
        if cfg.scheduler is not None:            # started MXNet-style: DMLC_PS_ROOT_URI / _PORT
            host = host or cfg.scheduler[0]
            port = cfg.scheduler[1] if port is None else port
        scheduler = Scheduler(cfg, host or "127.0.0.1", port or 0, recover=args.recover)
    except KVPSError as exc:
        print(f"kvps scheduler: error: {exc}", file=sys.stderr)
        return 2
    shown = scheduler.host if scheduler.host != "0.0.0.0" else "127.0.0.1"
    metrics = f" metrics={scheduler.metrics_address}" if scheduler.metrics_address else ""
    print(f"READY {shown}:{scheduler.port}{metrics}", flush=True)
    if scheduler.metrics_address:       # on a line of its own too: launchers show it, and READY they keep
        print(f"METRICS {scheduler.metrics_address} (Prometheus HTTP service discovery: "
              f"http://{scheduler.metrics_address}/targets)", flush=True)
    return scheduler.serve()


if __name__ == "__main__":
    sys.exit(main())
