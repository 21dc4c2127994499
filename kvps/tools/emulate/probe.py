"""Raw TCP transfers between emulated hosts, for `kvps emulate check`: how fast bytes cross the links.

    transfer(net, [("h0", "h2"), ("h1", "h2")], 4_000_000)   # {"h2": {"bytes": 8000000, "seconds": ...}}

transfer() runs the two ends below inside the hosts' namespaces:

    python -m kvps.tools.emulate.probe recv --bind 198.18.0.3 --conns 2     # prints READY PORT, then a JSON result
    python -m kvps.tools.emulate.probe send --to 198.18.0.3:PORT --bytes 4000000

A sender connects, sends an 8-byte count then that many bytes, and waits for a 1-byte
acknowledgement. The receiver takes `--conns` connections at once and prints
{"bytes": total, "seconds": first byte to last byte over all of them, "per_conn": [...]}:
time on the wire, without process start-up or the TCP handshake. Every socket has a deadline.
"""
import argparse
import json
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time

from kvps.errors import KVTimeoutError, NodeFailure

CHUNK = 1 << 20
COUNT = struct.Struct("!Q")


def _recv_exactly(sock, n):
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError(f"the peer closed the connection after {len(data)} of {n} bytes")
        data += part
    return data


def take(conn, result):
    """Receive one sender's transfer on `conn` and acknowledge it; fills result with bytes and the
    perf_counter times of the first and last byte."""
    expected = COUNT.unpack(_recv_exactly(conn, COUNT.size))[0]
    buf = bytearray(CHUNK)
    got, first = 0, None
    while got < expected:
        n = conn.recv_into(buf, min(CHUNK, expected - got))
        if not n:
            raise ConnectionError(f"the sender closed the connection after {got} of {expected} bytes")
        if first is None:
            first = time.perf_counter()
        got += n
    result.update(bytes=got, first=first, last=time.perf_counter())
    conn.sendall(b"!")


def receive(bind, conns, timeout):
    """Accept `conns` transfers at once; returns the JSON-able result. Prints READY PORT first."""
    server = socket.create_server((bind, 0), backlog=conns)
    server.settimeout(timeout)
    print(f"READY {server.getsockname()[1]}", flush=True)
    results, threads, errors = [], [], []

    def serve(conn, result):
        try:
            with conn:
                take(conn, result)
        except OSError as exc:
            errors.append(str(exc))

    deadline = time.monotonic() + timeout
    for _ in range(conns):
        conn, _ = server.accept()
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        results.append({})
        threads.append(threading.Thread(target=serve, args=(conn, results[-1]), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    server.close()
    if errors or not all(r.get("last") for r in results):
        raise TimeoutError(f"transfers did not complete within {timeout:g} s: {errors or 'still running'}")
    first, last = min(r["first"] for r in results), max(r["last"] for r in results)
    return {"bytes": sum(r["bytes"] for r in results), "seconds": last - first,
            "per_conn": [{"bytes": r["bytes"], "seconds": r["last"] - r["first"]} for r in results]}


def send(host, port, nbytes, timeout):
    """Send nbytes to a receiver and wait for its acknowledgement; returns the JSON-able result."""
    block = memoryview(bytes(CHUNK))
    with socket.create_connection((host, port), timeout=timeout) as sock:
        start = time.perf_counter()
        sock.sendall(COUNT.pack(nbytes))
        left = nbytes
        while left:
            n = min(left, CHUNK)
            sock.sendall(block[:n])
            left -= n
        _recv_exactly(sock, 1)
        return {"bytes": nbytes, "seconds": time.perf_counter() - start}


def transfer(net, pairs, nbytes, timeout=120.0):
    """Send nbytes over each (source host, destination host) pair at once, on an up Network.
    Returns {destination: receiver result} (see the module docstring). Raises KVTimeoutError past
    the deadline and NodeFailure if an end fails; either way, stops the ends it started."""
    deadline = time.monotonic() + timeout
    module = [sys.executable, "-m", "kvps.tools.emulate.probe"]
    fanin = {}
    for _, dst in pairs:
        fanin[dst] = fanin.get(dst, 0) + 1
    procs = []
    try:
        ports, receivers = {}, {}
        for dst, conns in fanin.items():
            # unbuffered, so the select() in _ready_port sees every line
            proc = net.popen(dst, [*module, "recv", "--bind", net.address(dst), "--conns", str(conns),
                                   "--timeout", f"{timeout:g}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
            procs.append(proc)
            receivers[dst] = proc
            ports[dst] = _ready_port(proc, deadline, dst)
        senders = []
        for src, dst in pairs:
            proc = net.popen(src, [*module, "send", "--to", f"{net.address(dst)}:{ports[dst]}",
                                   "--bytes", str(nbytes), "--timeout", f"{timeout:g}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            procs.append(proc)
            senders.append((f"sender {src} -> {dst}", proc))
        out = {}
        for name, proc in senders + [(f"receiver {dst}", p) for dst, p in receivers.items()]:
            try:
                stdout, stderr = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise KVTimeoutError(f"the {name} did not finish within {timeout:g} s") from None
            if proc.returncode:
                raise NodeFailure(f"the {name} failed (exit code {proc.returncode}): {stderr.decode().strip()}")
            if name.startswith("receiver"):
                out[name.split()[1]] = json.loads(stdout.decode().splitlines()[-1])
        return out
    finally:
        net.stop(procs)


def _ready_port(proc, deadline, host):
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if sel.select(max(0.0, deadline - time.monotonic())):
            line = proc.stdout.readline().decode()
            if line.startswith("READY "):
                return int(line.split()[1])
    finally:
        sel.close()
    raise NodeFailure(f"the receiver on {host} did not start (exit code {proc.poll()})")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m kvps.tools.emulate.probe", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="end", required=True)
    r = sub.add_parser("recv")
    r.add_argument("--bind", required=True)
    r.add_argument("--conns", type=int, default=1)
    r.add_argument("--timeout", type=float, default=120.0)
    s = sub.add_parser("send")
    s.add_argument("--to", required=True, help="HOST:PORT")
    s.add_argument("--bytes", type=int, required=True)
    s.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    try:
        if args.end == "recv":
            result = receive(args.bind, args.conns, args.timeout)
        else:
            host, _, port = args.to.rpartition(":")
            result = send(host, int(port), args.bytes, args.timeout)
    except (OSError, ValueError) as exc:
        print(f"probe {args.end}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
