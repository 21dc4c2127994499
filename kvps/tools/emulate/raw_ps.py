"""Plain TCP moving a PS step's bytes between emulated hosts: what any parameter server can reach.

    python -m kvps.tools.emulate.raw_ps -n 4 -s 4 [--mb 102.2] [--rate 1gbit] [--tries 3] [--one-way]

W worker hosts and S server hosts, one process each (as in a kvps job); from one start time every
worker sends M/S bytes to every server and, unless --one-way, every server sends M/S bytes to
every worker, all flows at once (a thread each, with the ends of kvps.tools.emulate.probe:
`sendall` and `recv_into` of 1 MB). Each try
prints the time from the start to the last byte the slowest host takes, beside the bandwidth bound
of a PS step (kvps/tools/emulate/theory.py): no summing, no framing, no waiting for a round, so no
PS step on these hosts can be faster. Needs root (network namespaces); docs/emulate.md.

`host` is one end, run inside a host's namespace:

    python -m kvps.tools.emulate.raw_ps host ADDRESS PORT PEER,PEER NBYTES START EXPECT
"""
import argparse
import json
import socket
import subprocess
import sys
import threading
import time

from kvps.tools.emulate import probe
from kvps.tools.emulate.network import Network, parse_rate
from kvps.tools.emulate.theory import theory

PORT = 7700
START_IN = 4.0          # seconds from launching the hosts to the common start (Python starts on 2 cores)


def host(address, port, peers, nbytes, start, expect, timeout=120.0):
    """Listen on address:port for `expect` senders of nbytes each; at `start` (time.perf_counter, which
    every process on the machine reads from one clock) send nbytes to each of `peers`, as
    kvps.tools.emulate.probe's ends do. Returns the seconds from `start` to the last byte taken (0
    when none)."""
    server = socket.create_server((address, port), backlog=max(1, expect))
    server.settimeout(timeout)
    results, errors, threads = [], [], []

    def take(conn, result):
        try:
            with conn:
                conn.settimeout(timeout)
                probe.take(conn, result)
        except OSError as exc:
            errors.append(f"take: {exc}")

    def accept():
        try:
            for _ in range(expect):
                conn, _ = server.accept()
                results.append({})
                threads.append(threading.Thread(target=take, args=(conn, results[-1]), daemon=True))
                threads[-1].start()
        except OSError as exc:
            errors.append(f"accept: {exc}")

    def give(peer):
        refused_until = time.monotonic() + timeout
        while True:
            try:
                probe.send(peer, port, nbytes, timeout)
                return
            except ConnectionRefusedError as exc:
                if time.monotonic() >= refused_until:
                    errors.append(f"send to {peer}: {exc} for {timeout:g} s")
                    return
                time.sleep(0.05)        # the peer's process started late and has not bound its port yet
            except OSError as exc:
                errors.append(f"send to {peer}: {exc}")
                return

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    time.sleep(max(0.0, start - time.perf_counter()))
    senders = [threading.Thread(target=give, args=(peer,), daemon=True) for peer in peers]
    for t in senders:
        t.start()
    deadline = time.monotonic() + timeout
    for t in [*senders, acceptor]:
        t.join(max(0.0, deadline - time.monotonic()))
    for t in list(threads):
        t.join(max(0.0, deadline - time.monotonic()))
    server.close()
    done = [r["last"] for r in results if "last" in r]
    if errors or len(done) != expect:
        raise TimeoutError(f"{address}: {errors or f'{len(done)} of {expect} transfers done in {timeout:g} s'}")
    return max(done) - start if done else 0.0


def run(workers, servers, nbytes_model, rate="1gbit", tries=3, one_way=False, timeout=120.0, start_in=START_IN):
    """Yield (try, seconds of the slowest host, the PS bound in seconds) on a fresh emulated network;
    the hosts start `start_in` seconds after they are launched."""
    names = [f"h{i}" for i in range(workers + servers)]
    server_hosts, worker_hosts = names[:servers], names[servers:]
    part = nbytes_model // servers
    bound = theory(nbytes_model, parse_rate(rate), workers, servers, False).ps
    with Network() as net:
        net.up(names, rate=rate)
        for attempt in range(tries):
            start = time.perf_counter() + start_in
            procs = []
            for name in names:
                if name in worker_hosts:
                    peers, expect = server_hosts, 0 if one_way else servers
                else:
                    peers, expect = ([] if one_way else worker_hosts), workers
                argv = [sys.executable, "-m", "kvps.tools.emulate.raw_ps", "host", net.address(name), str(PORT),
                        ",".join(net.address(p) for p in peers), str(part), repr(start), str(expect)]
                procs.append(net.popen(name, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            try:
                spans = []
                for proc in procs:
                    out, err = proc.communicate(timeout=timeout + start_in)
                    if proc.returncode:
                        raise RuntimeError(f"a host failed (exit code {proc.returncode}): {err.decode().strip()}")
                    spans.append(json.loads(out.decode().splitlines()[-1])["seconds"])
            finally:
                net.stop(procs)
            yield attempt, max(spans), bound


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["host"]:
        address, port, peers, nbytes, start, expect = argv[1:7]
        seconds = host(address, int(port), [p for p in peers.split(",") if p], int(nbytes), float(start), int(expect))
        print(json.dumps({"seconds": seconds}), flush=True)
        return 0
    p = argparse.ArgumentParser(prog="python -m kvps.tools.emulate.raw_ps", description=__doc__.splitlines()[0])
    p.add_argument("-n", "--workers", type=int, default=4)
    p.add_argument("-s", "--servers", type=int, default=4)
    p.add_argument("--mb", type=float, default=102.2, help="the model's megabytes (ResNet-50: 102.2)")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--tries", type=int, default=3)
    p.add_argument("--one-way", action="store_true", help="pushes only (workers to servers)")
    args = p.parse_args(argv)
    print("| try | slowest host ms | PS bound ms | / bound |")
    print("|--:|--:|--:|--:|")
    for attempt, seconds, bound in run(args.workers, args.servers, int(args.mb * 1e6), args.rate, args.tries,
                                       args.one_way):
        print(f"| {attempt + 1} | {seconds * 1e3:.0f} | {bound * 1e3:.0f} | {seconds / bound:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
