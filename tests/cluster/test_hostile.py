"""A peer that lies, on real daemons: deep nesting, huge headers, bad names, repeated rows, frames
over the message limit, replies nobody reads, and an I/O thread that dies anyway. Each is refused
with a clear ERROR (or, past the message limit, by zmq), nothing blocks the daemon, and the job
beside it still gets exact results."""
import os
import subprocess
import sys
import time

import msgpack
import numpy as np
import zmq

from harness import wait_for

from kvps.wire import protocol
from kvps.wire.protocol import Entry, Header, Op

PY = sys.executable
HOLD = r'''
import json, sys, time, numpy as np, kvps
kv = kvps.create(sys.argv[1])
kv.init("w", np.arange(8, dtype=np.float32))
kv.init("big", np.zeros(1 << 22, np.float32))
kv.init("emb", np.arange(40, dtype=np.float32).reshape(10, 4))
kv.init("mid", np.zeros(15000, np.float32))      # a 60 KB reply: still copied, not tracked (TRACK_BYTES)
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()                    # the test is done with the daemons (its deadline bounds this)
start = time.monotonic()
kv.push("big", np.ones(1 << 22, np.float32))
big = np.zeros(1 << 22, np.float32)
kv.pull("big", out=big)
took = time.monotonic() - start
out = np.zeros(8, np.float32)
kv.pushpull("w", np.ones(8, np.float32), out=out)
rows = np.full((10, 4), -1, np.float32)
kv.row_sparse_pull("emb", out=rows, row_ids=np.array([3, 3, 1, 3]))
two = [np.full((10, 4), -1, np.float32), np.full((10, 4), -1, np.float32)]
kv.row_sparse_pull(["emb", "emb"], out=two, row_ids=[np.array([0, 2, 2]), np.array([2, 5])])
print(json.dumps({"w": out.tolist(), "big": sorted(set(big.tolist())), "took": took, "rows": rows.tolist(),
                  "two": [t.tolist() for t in two]}), flush=True)
sys.stdin.readline()                    # and leaves the job once the test has read what it needs
'''


def _rows(ids):
    return [[float(4 * r + i) for i in range(4)] if r in ids else [0.0] * 4 for r in range(10)]


class Peer:
    def __init__(self, port, **opts):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for name, value in opts.items():
            self.sock.setsockopt(getattr(zmq, name), value)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def ask(self, frames, timeout=5.0):
        self.sock.send_multipart(frames)
        assert self.sock.poll(int(timeout * 1000)), f"no answer within {timeout} s to {bytes(frames[0][:60])!r}"
        return protocol.unpack(self.sock.recv_multipart())[0]

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def _hold(c, mode="dist_sync"):
    """Start the one worker, which inits its keys and waits for a line on stdin."""
    path = c.dir / "hold.py"
    path.write_text(HOLD)
    env = dict(c.env, KVPS_RANK="0")
    proc = c.children.spawn("W0", [PY, str(path), mode], env=env, log=c.dir / "W0.log",
                            stderr=c.dir / "W0.err", cwd=c.dir, stdin=subprocess.PIPE)
    wait_for(lambda: c.output("W0"), 30, f"the worker to init its keys\n{c.logs()}")
    return proc


def _release(c, proc):
    """Let the worker run its calls; returns what it printed (it waits for _finish to leave)."""
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    wait_for(lambda: len(c.output("W0")) > 1 or proc.poll() is not None, 60, f"the worker's calls\n{c.logs()}")
    assert len(c.output("W0")) > 1, c.logs()
    return c.output("W0")[-1]


def _finish(c, proc):
    proc.stdin.write(b"done\n")
    proc.stdin.close()
    c.wait([proc], 30)
    assert proc.returncode == 0, c.logs()


def _deep(levels=1000):
    return b"\x91" * levels + b"\x01"


def _with(header, field, raw):
    return b"\x86" + b"".join(msgpack.packb(k) + (raw if k == field else msgpack.packb(v)) for k, v in header.items())


ENV = {"KVPS_BIGARRAY_BOUND": str(1 << 30)}      # "big" stays one part (the unread-replies test)


def test_lies_get_clear_errors_and_the_job_is_exact(cluster):
    c = cluster(1, 1, env=ENV)
    worker = _hold(c)
    sched, server = int(c.address.rsplit(":", 1)[1]), c.server_ports[0]
    h, s = Peer(sched), Peer(server)
    try:
        pull = {"v": 1, "op": int(Op.PULL), "id": 31, "src": "W0", "keys": [["w", 0, 0, [8], 0]], "meta": {}}
        for peer in (h, s):
            for field in pull:              # nesting 1,000 deep in every header field
                reply = peer.ask([_with(pull, field, _deep())])
                assert reply.op == Op.ERROR and reply.meta["kind"] == "protocol", reply.meta
                assert reply.id == (0 if field == "id" else 31), (field, reply.id)
            start = time.monotonic()        # 42 MB, 6 million entries: refused unread
            huge = _with(pull, "keys", b"\xdd" + (6_000_000).to_bytes(4, "big") + b"\x95\x01\x00\x00\x91\x04\x00" * 6_000_000)
            reply = peer.ask([huge])
            assert "a header holds at most" in reply.meta["message"] and time.monotonic() - start < 2.0
        # REGISTER with a role of the wrong type, or an address no node could connect to
        register = {"role": "worker", "host": "127.0.0.1", "port": 1, "pid": 1}
        for meta, says in (({**register, "role": ["worker"]}, "REGISTER meta field 'role'"),
                           ({**register, "role": "wizard"}, "expected server or worker"),
                           ({**register, "host": "a\nb"}, "is not a host name"),
                           ({**register, "port": 70000}, "is not a port number")):
            raw = msgpack.packb({"v": 1, "op": int(Op.REGISTER), "id": 5, "src": "?", "keys": [], "meta": meta})
            reply = h.ask([raw])
            assert reply.op == Op.ERROR and reply.id == 5 and says in reply.meta["message"], reply.meta
        # names that only look like W0
        for src in ("W00", "W\u0660", "W0\nFORGED kvps-server ERROR everything is fine", "W+0"):
            reply = s.ask([Header(Op.PULL, 6, src, [Entry.bare("w", 0, 0, (8,))]).encode()])
            assert reply.op == Op.ERROR and "not one of this job's 1 workers" in reply.meta["message"], reply.meta
        # amplification: a row asked for 5,000 times, or a part named twice
        ids = np.zeros(5000, np.int64)
        reply = s.ask([Header(Op.ROW_SPARSE_PULL, 7, "W0", [Entry.of("emb", 0, ids)]).encode(), ids.tobytes()])
        assert reply.op == Op.ERROR and "sorted and unique" in reply.meta["message"], reply.meta
        ids = np.array([1, 2], np.int64)
        reply = s.ask([Header(Op.ROW_SPARSE_PULL, 8, "W0", [Entry.of("emb", 0, ids)] * 2).encode(), ids.tobytes(),
                       ids.tobytes()])
        assert reply.op == Op.ERROR and "twice" in reply.meta["message"], reply.meta
        # what only a replica of a sync job with one replica takes: a round's sum, a copy without values
        total = np.ones(8, np.float32)
        reply = s.ask([Header(Op.ROUND, 10, "S0", [Entry.of("w", 0, total)], {"home": 0, "rounds": [1]}).encode(),
                       total.tobytes()])
        assert reply.op == Op.ERROR and "only a server of a sync job with one replica" in reply.meta["message"]
        reply = s.ask([Header(Op.PUSH, 11, "W0", [Entry.bare("w", 0, 0, (8,))],
                              {"deferred": True, "chain": True, "home": 0}).encode()])
        assert reply.op == Op.ERROR and "defers its values" in reply.meta["message"], reply.meta
        # a flood of bad messages writes a bounded log
        for i in range(500):
            s.ask([b"\xc1not msgpack"])
        reply = s.ask([Header(Op.PULL, 9, "W0", [Entry.bare("w", 0, 0, (8,))]).encode()])
        assert reply.op == Op.VALUE       # the daemon still serves, and nothing was lost
    finally:
        h.close()
        s.close()
    result = _release(c, worker)
    _finish(c, worker)
    assert result["w"] == [1.0] * 8
    assert result["rows"] == _rows({1, 3})
    assert result["two"] == [_rows({0, 2}), _rows({2, 5})]
    log = (c.dir / "S0.err").read_text() + (c.dir / "S0.log").read_text()
    assert not any(line.startswith("FORGED") for line in log.splitlines()), log[-2000:]
    assert log.count("dropped a bad message") <= 25, log.count("dropped a bad message")
    assert c.wait_daemons() == [0, 0]


def test_replies_nobody_reads_never_block_the_server(cluster):
    """A peer pulls a 16 MB key 30 times and reads nothing: the server must not wait for zmq to
    send those replies (it once waited up to KVPS_TIMEOUT, so the job died of missed heartbeats);
    the replies still carry the value as it was when pulled, bit for bit."""
    c = cluster(1, 1, env=ENV)
    worker = _hold(c, "dist_async")
    lazy = Peer(c.server_ports[0], RCVHWM=1, RCVBUF=4096)
    stats = Peer(c.server_ports[0])
    try:
        pull = Header(Op.PULL, 1, "W0", [Entry.bare("big", 0, 0, (1 << 22,))]).encode()
        for _ in range(30):
            lazy.sock.send(pull)

        def sent_all():
            reply = stats.ask([Header(Op.STATS, 2, "W0").encode()])
            return reply.meta["bytes_out"] >= 30 * (16 << 20)
        wait_for(sent_all, 20, "the server to answer the 30 pulls")
        result = _release(c, worker)
        assert result["big"] == [1.0] and result["took"] < 5.0, result["took"]
        assert result["w"] == [1.0 + i for i in range(8)]          # async: the push is added
        got = 0
        while got < 30:
            assert lazy.sock.poll(20_000), f"only {got} of the 30 unread replies arrived"
            frames = lazy.sock.recv_multipart()
            header, payloads = protocol.unpack(frames)
            assert header.op == Op.VALUE
            assert not protocol.as_array(payloads[0], header.keys[0]).any()    # zeros: the value when pulled
            got += 1
    finally:
        lazy.close()
        stats.close()
    _finish(c, worker)
    assert c.wait_daemons() == [0, 0]


def test_a_peer_that_reads_no_replies_pins_bounded_memory(cluster):
    """Per-client bounds (KVPS_PEER_QUEUE, KVPS_PEER_REPLY_BYTES): a peer that floods pulls and
    reads nothing gets its replies dropped past the bounds, logged a few times, and the server
    goes on serving the job beside it, exactly."""
    c = cluster(1, 1, env=dict(ENV, KVPS_PEER_QUEUE="64", KVPS_PEER_REPLY_BYTES=str(40 << 20)))
    worker = _hold(c, "dist_async")
    small = Peer(c.server_ports[0], RCVHWM=1, RCVBUF=4096)
    big = Peer(c.server_ports[0], RCVHWM=1, RCVBUF=4096)
    stats = Peer(c.server_ports[0])
    try:
        # 5,000 small (copied) replies nobody reads: 300 MB, far more than the sockets' buffers hold
        pull_mid = Header(Op.PULL, 1, "W0", [Entry.bare("mid", 0, 0, (15000,))]).encode()
        for _ in range(5000):
            small.sock.send(pull_mid)
        pull_big = Header(Op.PULL, 2, "W0", [Entry.bare("big", 0, 0, (1 << 22,))]).encode()
        for _ in range(20):                         # 20 x 16 MB against a 40 MB bound
            big.sock.send(pull_big)

        def answered():
            reply = stats.ask([Header(Op.STATS, 3, "W0").encode()])
            return reply.meta["pulls"] >= 5020
        wait_for(answered, 30, "the server to take the 5,020 pulls")
        result = _release(c, worker)
        assert result["w"] == [1.0 + i for i in range(8)] and result["took"] < 5.0, result
        got = 0
        while big.sock.poll(2000):
            big.sock.recv_multipart()
            got += 1
        assert 1 <= got <= 4, got                   # 40 MB of 16 MB replies, the rest dropped
        got = 0
        while small.sock.poll(1000):
            small.sock.recv_multipart()
            got += 1
        assert 64 <= got < 5000, got                # the queue bound, plus what the sockets buffer
    finally:
        small.close()
        big.close()
        stats.close()
    _finish(c, worker)
    log = (c.dir / "S0.err").read_text() + (c.dir / "S0.log").read_text()
    assert "(KVPS_PEER_QUEUE)" in log and "(KVPS_PEER_REPLY_BYTES)" in log, log[-2000:]
    assert log.count("reply dropped") <= 20, log.count("reply dropped")           # throttled
    assert c.wait_daemons() == [0, 0]


def test_frames_over_the_message_limit_are_refused_by_zmq(cluster):
    c = cluster(1, 1, env=dict(ENV, KVPS_MAX_MESSAGE_BYTES=str(17 << 20)))      # the 16 MB key fits
    worker = _hold(c)
    for port in (int(c.address.rsplit(":", 1)[1]), c.server_ports[0]):
        flood = Peer(port)
        try:
            tracker = flood.sock.send(os.urandom(1 << 20) * 24, copy=False, track=True)
            try:
                tracker.wait(10)
            except zmq.NotDone:
                pass
            assert not flood.sock.poll(500)          # no reply: zmq dropped the connection unread
        finally:
            flood.close()
        probe = Peer(port)
        try:
            assert probe.ask([Header(Op.HEARTBEAT, 3, "Z9").encode()]).op in (Op.ACK, Op.ERROR)
        finally:
            probe.close()
    result = _release(c, worker)
    _finish(c, worker)
    assert result["w"] == [1.0] * 8
    assert c.wait_daemons() == [0, 0]


DEADLY = '''
from kvps.ps.rules import UpdateRule

class Fatal(BaseException):
    """What no handler catches: the server's I/O thread dies of it."""

class Deadly(UpdateRule):
    name = "deadly"
    def __init__(self, params):
        raise Fatal("the I/O thread dies here")

def kvps_register(registry):
    registry.add(Deadly)
'''


def test_a_server_whose_io_thread_dies_exits_non_zero_at_once(cluster, tmp_path):
    (tmp_path / "deadly_rules.py").write_text(DEADLY)
    c = cluster(1, 1, env={"PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")},
                server_args=["--plugin", "deadly_rules"])
    script = ('import json, numpy as np, kvps\n'
              'kv = kvps.create("dist_sync")\n'
              'kv.init("w", np.ones(4, np.float32))\n'
              'try:\n'
              '    kv.set_optimizer(kvps.optimizer.Optimizer("deadly"))\n'
              'except kvps.KVPSError as e:\n'
              '    print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)\n')
    start = time.monotonic()
    procs = c.spawn_workers(script)
    server = c.proc("S0")
    c.wait([server], 15)
    assert server.returncode == 1, c.logs()
    err = (c.dir / "S0.err").read_text() + (c.dir / "S0.log").read_text()
    assert "I/O thread died" in err, err[-2000:]
    c.wait(procs, 30)
    (line,) = c.output("W0")
    assert line["error"] == "NodeFailure" and "S0" in line["message"], line
    assert time.monotonic() - start < 30


def test_a_connection_flood_at_the_fd_limit_is_refused_without_spinning(tmp_path):
    """400 idle TCP connections to a scheduler whose fd limit is 256: past the cap they are shut
    down and logged, and the scheduler does not spin (libzmq retries a failed accept for good)."""
    import shutil
    import socket
    if shutil.which("prlimit") is None:
        import pytest
        pytest.skip("prlimit (util-linux) is not installed")
    err = tmp_path / "H.err"
    proc = subprocess.Popen(["prlimit", "--nofile=256:256", PY, "-m", "kvps.cli", "scheduler", "--port", "0",
                             "-n", "1", "-s", "1"], stdout=subprocess.PIPE, stderr=open(err, "w"), text=True)
    flood = []
    try:
        port = int(proc.stdout.readline().split()[-1].rsplit(":", 1)[1])
        for _ in range(400):
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        wait_for(lambda: "refused a connection from 127.0.0.1" in err.read_text(), 10, "the refusals")

        def cpu():
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        before = cpu()
        time.sleep(2.0)
        assert cpu() - before < 0.5, "the scheduler spins at the fd limit"
        assert proc.poll() is None
    finally:
        for s in flood:
            s.close()
        proc.kill()
        proc.wait(10)
