"""Where the ranks of an emulated gloo job meet: a torch.distributed TCPStore on one host.

    python -m kvps.tools.emulate.rendezvous --host 198.18.0.1 [--timeout 660]

Binds port 0 and prints `READY HOST:PORT`, so no port is guessed (the job passes the address to
every rank's `--store`, as kvps.tools.bench.gloo_job does with the store it holds on 127.0.0.1). It
then serves until it is stopped (SIGTERM, by the job once the ranks are done) or, should the job
that started it be gone, until --timeout seconds pass. Exit codes: 0, or 1 when the store cannot
be opened.
"""
import argparse
import datetime
import sys
import time


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m kvps.tools.emulate.rendezvous")
    p.add_argument("--host", required=True, help="the address the ranks connect to (this host's)")
    p.add_argument("--timeout", type=float, default=660.0, help="seconds to serve at most (default 660)")
    args = p.parse_args(argv)
    import torch.distributed as dist

    try:
        store = dist.TCPStore(args.host, 0, None, True, timeout=datetime.timedelta(seconds=args.timeout),
                              wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        print(f"rendezvous: cannot open a TCPStore on {args.host}: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"READY {args.host}:{store.port}", flush=True)
    time.sleep(args.timeout)           # serving happens in the store's own thread; SIGTERM ends it early
    return 0


if __name__ == "__main__":
    sys.exit(main())
