"""`kvps fuzz`: hostile frames at a running job's daemons; reports frames, crashes and memory.

    kvps fuzz --frames 100000 [--seed S] [--garbage-mb 256]

Starts a one-worker, one-server job on 127.0.0.1 (daemons with KVPS_MAX_MESSAGE_BYTES of
--max-message-mb), lets the worker push and pull once, then sends N frames from
kvps.tools.fuzz.frames.Hostile to the scheduler's port and to the server's, interleaved, reading and
dropping their replies. Every --probe-every frames each daemon must answer a probe within
PROBE_TIMEOUT seconds; one that does not, or that exits, counts as a crash, and its port is left
alone from then on. Once, a frame of --garbage-mb MB (over the message limit) goes to each port.
Then the worker runs more rounds and a row-sparse pull, and the values must be exact.

Prints, per port: frames sent, crashes, frames per second, and the daemon's RSS before and after.
Exit status: 0 with no crash and exact values, 1 otherwise.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

import zmq

from kvps.supervisor import READY_TIMEOUT, Supervisor
from kvps.tools.capture import rss_mb
from kvps.tools.fuzz.frames import KINDS, Hostile
from kvps.wire.protocol import Header, Op

PROBE_TIMEOUT = 10.0        # seconds a daemon has to answer a probe
WINDOW = 256                # messages a target may leave unanswered before the fuzzer waits
JOB_TIMEOUT = 120.0         # seconds for the worker's part after the fuzz

WORKER = r'''
import json, sys, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init("w", np.zeros(1000, np.float32))
kv.init("emb", np.arange(40, dtype=np.float32).reshape(10, 4))
out = np.zeros(1000, np.float32)
kv.pushpull("w", np.ones(1000, np.float32), out=out)
print(json.dumps({"ready": float(out[0])}), flush=True)
sys.stdin.readline()                     # the fuzzer is done (the parent's deadline bounds this)
for step in range(1, 6):
    kv.pushpull("w", np.full(1000, step, np.float32), out=out)
rows = np.full((10, 4), -1, np.float32)
kv.row_sparse_pull("emb", out=rows, row_ids=np.array([3, 3, 1, 3]))
print(json.dumps({"w": sorted(set(out.tolist())), "rows": rows.tolist()}), flush=True)
kv.close()
'''


def expected_result():
    rows = [[0.0] * 4 for _ in range(10)]
    for r in (1, 3):
        rows[r] = [float(4 * r + i) for i in range(4)]
    return {"w": [5.0], "rows": rows}


class Target:
    """One daemon port under fire: a DEALER for the hostile frames, whose replies are read and
    dropped, and a probe DEALER whose request must be answered."""

    def __init__(self, ctx, name, port, pid):
        self.name, self.port, self.pid = name, port, pid
        self.ctx = ctx
        self.sock = self._socket()
        self.prober = self._socket()
        self.sent = self.crashes = self.replies = self.unanswered = 0
        self.seconds = 0.0
        self.crash_reason = None
        self.rss_before = rss_mb(pid)
        self.rss_after = None

    def _socket(self):
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{self.port}")
        return sock

    def send(self, frames):
        """Send one message; with WINDOW of them unanswered, first wait for a reply (so the daemon's
        memory shows what it keeps, not a backlog of unread input)."""
        if self.sent - self.replies - self.unanswered >= WINDOW and not self._reply(PROBE_TIMEOUT):
            self.unanswered = self.sent - self.replies
        self.sock.send_multipart(frames, copy=True)
        self.sent += 1
        while self._reply(0):
            pass

    def settle(self, quiet=2.0):
        """Read the replies still coming (until `quiet` seconds pass without one); count the rest."""
        while self.sent - self.replies - self.unanswered > 0 and self._reply(quiet):
            pass
        self.unanswered = self.sent - self.replies

    def _reply(self, timeout):
        if not self.sock.poll(int(timeout * 1000)):
            return False
        self.sock.recv_multipart()
        self.replies += 1
        return True

    def probe(self, proc):
        """True if the daemon answers a HEARTBEAT within PROBE_TIMEOUT (the scheduler with ACK, a
        server with an ERROR saying it does not handle it: either is an answer)."""
        if proc.poll() is not None:
            return self._crash(f"exited with {proc.returncode}")
        self.prober.send(Header(Op.HEARTBEAT, 1, "Z9").encode())
        if not self.prober.poll(int(PROBE_TIMEOUT * 1000)):
            return self._crash(f"did not answer a probe within {PROBE_TIMEOUT:g} s")
        self.prober.recv_multipart()
        while self.prober.poll(0):
            self.prober.recv_multipart()
        return True

    def garbage(self, nbytes, proc):
        """One frame of `nbytes` random-looking bytes on a connection of its own, then a probe."""
        sock = self._socket()
        try:
            tracker = sock.send(os.urandom(1 << 20) * max(1, nbytes >> 20), copy=False, track=True)
            tracker.wait(PROBE_TIMEOUT)     # written out, or dropped with the connection zmq closed
        except zmq.NotDone:
            pass
        finally:
            sock.close(0)
        return self.probe(proc)

    def _crash(self, reason):
        self.crashes += 1
        self.crash_reason = reason
        return False

    def close(self):
        self.sock.close(0)
        self.prober.close(0)


def run(frames, seed=0, probe_every=500, garbage_mb=256, max_message_mb=64, out=sys.stdout):
    """Run the fuzz (see the module docstring); returns (targets, job result or error text)."""
    lines, said = {}, threading.Event()

    def collect(name, line):
        lines.setdefault(name, []).append(line)
        if name == "W0" and line.startswith("{"):
            said.set()
    env = dict(os.environ, KVPS_NUM_WORKERS="1", KVPS_NUM_SERVERS="1", KVPS_TIMEOUT="60",
               KVPS_MAX_MESSAGE_BYTES=str(max_message_mb << 20), PYTHONUNBUFFERED="1")
    env.pop("KVPS_SCHEDULER", None)
    py = sys.executable
    ctx = zmq.Context()
    targets = []
    with tempfile.TemporaryDirectory(prefix="kvps-fuzz-") as tmp, Supervisor(out=collect) as sup:
        sup.spawn("H", [py, "-m", "kvps.cli", "scheduler", "--port", "0"], env=env, ready=True, cwd=tmp)
        env["KVPS_SCHEDULER"] = address = sup.ready("H", READY_TIMEOUT)
        sup.spawn("S0", [py, "-m", "kvps.cli", "server"], env=env, ready=True, cwd=tmp)
        server = sup.ready("S0", READY_TIMEOUT)
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        worker = sup.spawn("W0", [py, script], env=dict(env, KVPS_RANK="0"), stdin=subprocess.PIPE, cwd=tmp)
        if not said.wait(READY_TIMEOUT):
            raise RuntimeError(f"the worker did not start: {sup.tail('W0')}")
        procs = sup.procs
        for name, addr in (("H", address), ("S0", server)):
            targets.append(Target(ctx, name, int(addr.rsplit(":", 1)[1]), procs[name].pid))
        hostile = {t.name: Hostile(random.Random(f"{seed}-{t.name}"), "scheduler" if t.name == "H" else "server")
                   for t in targets}
        started = time.monotonic()
        for i in range(frames):
            for t in targets:
                if t.crashes:
                    continue
                t.send(hostile[t.name].next()[1])
                if (i + 1) % probe_every == 0:
                    t.probe(procs[t.name])
        for t in targets:
            t.settle()
            t.seconds = time.monotonic() - started      # the rate is of the whole run, both ports at once
        for t in targets:
            if not t.crashes and garbage_mb:
                t.garbage(garbage_mb << 20, procs[t.name])
            if not t.crashes:
                t.probe(procs[t.name])
            t.rss_after = rss_mb(t.pid)
            t.close()
        ctx.term()
        try:
            worker.stdin.write(b"go\n")
            worker.stdin.close()
        except OSError:
            pass
        codes = sup.wait(JOB_TIMEOUT, ["W0"])
        results = [json.loads(line) for line in lines.get("W0", []) if line.startswith("{")]
        if codes.get("W0") != 0 or len(results) < 2:
            job = f"the worker failed ({codes.get('W0')}): {sup.tail('W0')}"
        else:
            job = results[1]
        sup.wait(JOB_TIMEOUT, ["H", "S0"])
    return targets, job


def report(targets, job, frames, seed, out=sys.stdout):
    """Print the table; returns the exit status."""
    print(f"kvps fuzz: {frames} frames per port (kinds: {', '.join(KINDS)}, huge_header), seed {seed}", file=out)
    print(f"{'daemon':<8}{'port':>7}{'frames':>9}{'replies':>9}{'no reply':>9}{'crashes':>9}{'frames/s':>10}"
          f"{'RSS before':>12}{'RSS after':>11}", file=out)
    for t in targets:
        rate = t.sent / t.seconds if t.seconds else 0
        before = f"{t.rss_before:.1f} MB" if t.rss_before else "-"
        after = f"{t.rss_after:.1f} MB" if t.rss_after else "gone"
        print(f"{t.name:<8}{t.port:>7}{t.sent:>9}{t.replies:>9}{t.unanswered:>9}{t.crashes:>9}{rate:>10.0f}"
              f"{before:>12}{after:>11}", file=out)
        if t.crash_reason:
            print(f"  {t.name} crashed: {t.crash_reason}", file=out)
    good = job == expected_result()
    print(f"job after the fuzz: {'exact' if good else 'WRONG: ' + str(job)[:500]}", file=out)
    return 0 if good and not any(t.crashes for t in targets) else 1


def main(argv=None):
    p = argparse.ArgumentParser(prog="kvps fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=10_000, help="frames per daemon port")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe-every", type=int, default=500, help="frames between liveness probes")
    p.add_argument("--garbage-mb", type=int, default=256, help="one frame this big per port at the end (0: none)")
    p.add_argument("--max-message-mb", type=int, default=64, help="the daemons' KVPS_MAX_MESSAGE_BYTES, in MB")
    args = p.parse_args(argv)
    targets, job = run(args.frames, args.seed, args.probe_every, args.garbage_mb, args.max_message_mb)
    return report(targets, job, args.frames, args.seed)
