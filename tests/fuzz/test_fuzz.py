"""Fuzz smoke: a few thousand hostile frames (hypothesis, and kvps.tools.fuzz.frames) at a running
job's scheduler and server (its ROUTER and its local socket). Every message must be answered (an ERROR, or an ACK to a probe), no
daemon may die, and the job's worker must then get exact results. `kvps fuzz --frames N` is the
long run."""
import random
import select
import socket
import subprocess
import sys
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import Cluster
from kvps.tools.fuzz.frames import FIELDS, KINDS, Hostile
from kvps.wire import local, protocol
from kvps.wire.protocol import Header, Op

PY = sys.executable
ANSWER_TIMEOUT = 5.0        # seconds a daemon has to answer one message
FUZZ = settings(max_examples=400, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

WORKER = r'''
import json, sys, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init("w", np.arange(8, dtype=np.float32))
kv.init("emb", np.arange(40, dtype=np.float32).reshape(10, 4))
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()                    # the fuzz is over (the test's deadline bounds this)
out = np.zeros(8, np.float32)
for step in range(1, 4):
    kv.pushpull("w", np.full(8, step, np.float32), out=out)
rows = np.full((10, 4), -1, np.float32)
kv.row_sparse_pull("emb", out=rows, row_ids=np.array([3, 3, 1]))
print(json.dumps({"w": out.tolist(), "rows": rows.tolist()}), flush=True)
kv.close()
'''

# msgpack values of every type, nested a little (what a peer that lies about types sends)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


class Target:
    def __init__(self, name, port):
        self.name, self.port = name, port
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.sent = 0

    def ask(self, frames):
        """Send one message; the daemon must answer it within ANSWER_TIMEOUT."""
        self.sock.send_multipart(frames)
        self.sent += 1
        assert self.sock.poll(int(ANSWER_TIMEOUT * 1000)), \
            f"{self.name} did not answer message {self.sent} within {ANSWER_TIMEOUT} s: {bytes(frames[0][:80])!r}"
        return self.sock.recv_multipart()

    def close(self):
        self.sock.close(0)
        self.ctx.term()


class LocalTarget(Target):
    """The server's local socket (kvps/wire/local.py), where its co-located workers' lanes connect:
    the same messages, framed for it."""

    def __init__(self, name, port, pid):
        self.name, self.port, self.sent = name, port, 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(local.address(port, pid))
        self.sock.settimeout(ANSWER_TIMEOUT)
        assert self.sock.recv(64) == local.WELCOME
        self.conn = local.Conn(self.sock, 1 << 30)

    def ask(self, frames):
        self.conn.send(frames, ANSWER_TIMEOUT)
        self.sent += 1
        deadline = time.monotonic() + ANSWER_TIMEOUT
        while time.monotonic() < deadline:
            reply = self.conn.receive()
            if reply is not None:
                return [bytes(f) for f in reply]
            select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))
        raise AssertionError(f"{self.name} did not answer message {self.sent} within {ANSWER_TIMEOUT} s: "
                             f"{bytes(frames[0][:80])!r}")

    def close(self):
        self.conn.close()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("fuzz"), 1, 1)
    try:
        c.start()
        path = c.dir / "worker.py"
        path.write_text(WORKER)
        worker = c.children.spawn("W0", [PY, str(path)], env=dict(c.env, KVPS_RANK="0"), log=c.dir / "W0.log",
                                  stderr=c.dir / "W0.err", cwd=c.dir, stdin=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not c.output("W0"):
            assert time.monotonic() < deadline and worker.poll() is None, f"the worker did not start\n{c.logs()}"
            time.sleep(0.05)
        targets = [Target("H", int(c.address.rsplit(":", 1)[1])), Target("S0", c.server_ports[0]),
                   LocalTarget("S0 (local socket)", c.server_ports[0], c.proc("S0").pid)]
        yield c, worker, targets
        for t in targets:
            t.close()
    finally:
        c.close()


def _both(job, frames):
    c, _, targets = job
    for t in targets:
        try:
            t.ask(frames)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{c.logs()}") from None


@FUZZ
@given(st.lists(st.binary(max_size=2048), min_size=1, max_size=4))
def test_random_bytes(job, frames):
    _both(job, frames)


@FUZZ
@given(st.dictionaries(st.sampled_from(FIELDS + ("extra",)), VALUES, max_size=7),
       st.sampled_from([op for op in Op if op not in (Op.REGISTER, Op.INIT, Op.PUSH, Op.PUSHPULL,
                                                      Op.ROW_SPARSE_PUSH, Op.SET_OPTIMIZER, Op.JOIN)]))
def test_valid_msgpack_with_wrong_field_types(job, fields, op):
    header = {"v": 1, "op": int(op), "id": 3, "src": "Z9", "keys": [], "meta": {}}
    header.update(fields)
    _both(job, [msgpack.packb(header, use_bin_type=True)])


@settings(FUZZ, max_examples=600)
@given(st.sampled_from(KINDS), st.integers(0, 2 ** 32))
def test_hostile_kinds(job, kind, seed):
    """Huge shapes, wrong frame counts, unknown ops, truncated and mutated messages, deep nesting,
    huge entry counts, bad sender names, repeated rows (kvps.tools.fuzz.frames)."""
    c, _, targets = job
    for t in targets:
        _, frames = Hostile(random.Random(seed), "scheduler" if t.name == "H" else "server").next(kind)
        try:
            t.ask(frames)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{c.logs()}") from None


@pytest.mark.parametrize("levels", [1000, 1023, 1024, 4000])
def test_deep_nesting_in_every_header_field(job, levels):
    hostile = Hostile(random.Random(levels))
    for field in FIELDS:
        raw = b"\x86" + b"".join(msgpack.packb(k) + (b"\x91" * levels + b"\x01" if k == field else msgpack.packb(v))
                                 for k, v in {"v": 1, "op": 22, "id": 9, "src": "Z9", "keys": [], "meta": {}}.items())
        _both(job, [raw])
    for _ in range(40):         # and in entry and meta fields
        _both(job, hostile.next("deep")[1])


def test_the_job_is_exact_after_the_fuzz(job):
    c, worker, targets = job
    for t in targets:           # both still answer a plain probe
        reply = protocol.unpack(t.ask([Header(Op.HEARTBEAT, 5, "Z9").encode()]))[0]
        assert reply.op in (Op.ACK, Op.ERROR), reply
        assert t.sent >= 1000, f"{t.name} got only {t.sent} frames"
    worker.stdin.write(b"go\n")
    worker.stdin.close()
    c.wait([worker], 60)
    assert worker.returncode == 0, c.logs()
    result = c.output("W0")[-1]
    assert result["w"] == [3.0] * 8
    assert result["rows"] == [[float(4 * r + i) for i in range(4)] if r in (1, 3) else [0.0] * 4 for r in range(10)]
    assert c.wait_daemons() == [0, 0], c.logs()
