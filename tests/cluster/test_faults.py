"""Bad input and faults on a real job: errors are clear, name what is wrong, lose nothing,
and nothing hangs."""
import socket
import time

import msgpack
import numpy as np
import pytest
import zmq

from harness import wait_for

from kvps.wire import protocol
from kvps.wire.protocol import Entry, Header, Op

HEARTBEAT_TIMEOUT = 2.0     # harness.FAST_ENV


class RawPeer:
    """A hand-driven DEALER, to send what no kvps worker would."""

    def __init__(self, port):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def send(self, frames):
        self.sock.send_multipart(frames)

    def ask(self, frames):
        self.send(frames)
        return protocol.unpack(self.sock.recv_multipart())

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def _garbage(port):
    # raw TCP bytes that are not ZMTP at all
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"\x00\xffGET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 4)
    peer = RawPeer(port)
    try:
        replies = []
        for frames in ([b"\xc1\xc1garbage"],                        # not msgpack
                       [msgpack.packb([1, 2, 3])],                   # not a map
                       [msgpack.packb({"v": 1, "op": 9999, "id": 5, "src": "W0", "keys": [], "meta": {}})],
                       [Header(Op.PUSH, 6, "W0", [Entry("k", 0, 0, (4,), 16)]).encode()],   # truncated: no payload
                       [Header(Op.PUSH, 7, "W0", [Entry("k", 0, 0, (4,), 16)]).encode(), b"123"]):  # short payload
            _, _ = replies.append(peer.ask(frames)) or (None, None)
        return replies
    finally:
        peer.close()


GOOD = r'''
import json, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init("a", np.ones(8, np.float32))
out = np.zeros(8, np.float32)
kv.pushpull("a", np.full(8, kv.rank + 1, np.float32), out=out)
print(json.dumps({"value": out.tolist()}), flush=True)
'''


def test_garbage_to_server_and_scheduler_ports(cluster):
    c = cluster(2, 1)
    sched_port = int(c.address.rsplit(":", 1)[1])
    for port in (c.server_ports[0], sched_port):
        replies = _garbage(port)
        for header, _ in replies:
            assert header.op == Op.ERROR and header.meta["kind"] == "protocol", header.meta
        assert "not valid msgpack" in replies[0][0].meta["message"]
        assert "unknown op 9999" in replies[2][0].meta["message"]
        assert "declares 1 payload frames, carries 0" in replies[3][0].meta["message"]
        assert "has 3 bytes, header says 16" in replies[4][0].meta["message"]
    # the daemons survived and still serve a whole job
    results = c.run_workers(GOOD)
    assert all(r[0]["value"] == [3.0] * 8 for r in results)
    assert c.wait_daemons() == [0, 0]


def test_wrong_protocol_version_is_refused(cluster):
    c = cluster(1, 1)
    sched_port = int(c.address.rsplit(":", 1)[1])
    peer = RawPeer(sched_port)
    try:
        raw = msgpack.packb({"v": 999, "op": int(Op.REGISTER), "id": 3, "src": "?", "keys": [],
                             "meta": {"role": "worker"}})
        peer.send([raw])
        frames = peer.sock.recv_multipart()
        reply = msgpack.unpackb(frames[0])
        assert reply["op"] == Op.ERROR and reply["id"] == 3
        assert "protocol version 999" in reply["meta"]["message"] and "speaks 1" in reply["meta"]["message"]
    finally:
        peer.close()
    results = c.run_workers(GOOD)
    assert results[0][0]["value"] == [1.0] * 8


def test_server_checks_requests_itself(cluster):
    """A server refuses a bad request by itself (not only the worker library), naming key and shapes."""
    c = cluster(1, 1)
    procs = c.spawn_workers(GOOD.replace('print(json.dumps({"value": out.tolist()}), flush=True)',
                                         'print(json.dumps({"value": out.tolist()}), flush=True)\n'
                                         'import time; time.sleep(3)'))
    wait_for(lambda: c.output("W0"), 20, "the worker to initialise its key")
    peer = RawPeer(c.server_ports[0])
    try:
        bad = np.ones(5, np.float16)
        header, _ = peer.ask([Header(Op.PUSH, 1, "W0", [Entry.of("a", 0, bad)]).encode(), bad.tobytes()])
        assert header.op == Op.ERROR and header.meta["kind"] == "value"
        assert "key 'a' was initialised as float32 (8,); got float16 (5,)" in header.meta["message"]
        header, _ = peer.ask([Header(Op.PULL, 2, "W0", [Entry.bare("nope", 0, 0, (8,))]).encode()])
        assert header.meta["kind"] == "key" and "'nope' was never initialised" in header.meta["message"]
        header, _ = peer.ask([Header(Op.PULL, 3, "W7", [Entry.bare("a", 0, 0, (8,))]).encode()])
        assert "not one of this job's 1 workers" in header.meta["message"]
        good = Header(Op.PULL, 4, "W0", [Entry.bare("a", 0, 0, (8,))]).encode()
        header, payloads = peer.ask([good])
        assert header.op == Op.VALUE
        assert protocol.as_array(payloads[0], header.keys[0]).tolist() == [1.0] * 8   # nothing lost
    finally:
        peer.close()
    c.wait(procs, 30)


BAD_INPUT = r'''
import json, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init([3, "emb"], [np.ones(4, np.float32), np.zeros((10, 2), np.float32)])
errors = {}
def expect(name, fn):
    try:
        fn()
    except Exception as e:
        errors[name] = [type(e).__name__, str(e)]
    else:
        errors[name] = None
out = np.zeros(4, np.float32)
expect("uninit_push", lambda: kv.push("never", np.ones(4, np.float32)))
expect("uninit_pull", lambda: kv.pull(99, out=out))
expect("shape", lambda: kv.push(3, np.ones(5, np.float32)))
expect("dtype", lambda: kv.push(3, np.ones(4, np.float16)))
expect("lengths", lambda: kv.push([3, "emb"], [np.ones(4, np.float32)]))
expect("out_shape", lambda: kv.pull(3, out=np.zeros((2, 2), np.float32)))
expect("rows", lambda: kv.row_sparse_pull("emb", out=np.zeros((10, 2), np.float32), row_ids=np.array([3, 10])))
expect("twice", lambda: kv.init(3, np.ones(4, np.float32)))
expect("not_array", lambda: kv.push(3, [1.0, 2.0, 3.0, 4.0]))
expect("bad_key", lambda: kv.push(3.5, np.ones(4, np.float32)))
expect("optimizer", lambda: kv.set_optimizer(kvps.optimizer.Optimizer("no_such_rule")))
# a list push with one bad value sends nothing: the good key is untouched
expect("partial", lambda: kv.push([3, "emb"], [np.full(4, 5, np.float32), np.ones(3, np.float32)]))
kv.pull(3, out=out)
print(json.dumps({"errors": errors, "value": out.tolist()}), flush=True)
'''


def test_bad_input_gets_clear_errors_and_loses_nothing(cluster):
    c = cluster(1, 1)
    (lines,) = c.run_workers(BAD_INPUT)
    errors, value = lines[0]["errors"], lines[0]["value"]
    assert value == [1.0] * 4
    assert errors["uninit_push"][0] == "KVKeyError" and "'never'" in errors["uninit_push"][1]
    assert "never initialised" in errors["uninit_pull"][1] and "99" in errors["uninit_pull"][1]
    assert errors["shape"] == ["ValueError", "key 3 was initialised as float32 (4,); push got a value of float32 (5,)"]
    assert errors["dtype"] == ["ValueError", "key 3 was initialised as float32 (4,); push got a value of float16 (4,)"]
    assert errors["lengths"] == ["ValueError", "push got 2 keys and 1 values; give one value (or list) per key"]
    assert errors["out_shape"][0] == "ValueError" and "out float32 (2, 2)" in errors["out_shape"][1]
    assert "0..9" in errors["rows"][1] and "3..10" in errors["rows"][1]
    assert errors["twice"][0] == "KVKeyError" and "already initialised" in errors["twice"][1]
    assert errors["not_array"] == ["TypeError", "push value for key 3 is a float; kvps takes numpy arrays and torch tensors"]
    assert errors["bad_key"][0] == "TypeError" and "3.5" in errors["bad_key"][1]
    assert errors["optimizer"][0] == "KVValueError" and "no optimizer 'no_such_rule'" in errors["optimizer"][1]
    assert "sgd" in errors["optimizer"][1]
    assert errors["partial"][0] == "ValueError"


LOOP = r'''
import json, sys, time, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init(["k", "big"], [np.zeros(100, np.float32), np.zeros(3000, np.float32)])
print(json.dumps({"ready": True}), flush=True)
try:
    while True:
        kv.pushpull(["k", "big"], [np.ones(100, np.float32), np.ones(3000, np.float32)])
        time.sleep(0.005)
except kvps.KVPSError as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e), "t": time.time()}), flush=True)
    sys.exit(3)
'''


@pytest.mark.parametrize("victim", ["S0", "W1"])
def test_dead_node_is_named_within_the_heartbeat_timeout(cluster, victim):
    c = cluster(2, 2, env={"KVPS_BIGARRAY_BOUND": "1000"})
    procs = c.spawn_workers(LOOP)
    wait_for(lambda: c.output("W0") and c.output("W1"), 30, "both workers to start")
    time.sleep(0.3)
    c.proc(victim).kill()
    killed_at = time.time()
    survivors = [p for i, p in enumerate(procs) if f"W{i}" != victim]
    c.wait(survivors, 20)
    for i, p in enumerate(procs):
        if f"W{i}" == victim:
            continue
        assert p.returncode == 3, c.logs()
        error = c.output(f"W{i}")[-1]
        assert error["error"] == "NodeFailure" and victim in error["message"], error
        assert error["t"] - killed_at < HEARTBEAT_TIMEOUT + 3.0, error
    # the scheduler ends the job (exit 1: a node died) and no daemon hangs
    codes = c.wait_daemons(timeout=20)
    assert codes[0] == 1


def test_workers_disagreeing_on_type_fail_fast(cluster):
    c = cluster(2, 1)
    script = ('import os, kvps\n'
              'try:\n'
              '    kvps.create("dist_sync" if os.environ["KVPS_RANK"] == "0" else "dist_async")\n'
              'except kvps.KVPSError as e:\n'
              '    print(__import__("json").dumps({"message": str(e)}), flush=True)\n')
    results = c.run_workers(script, timeout=30)
    for lines in results:
        assert "different kvstore types" in lines[0]["message"], lines


RECOVER = r'''
import json, time, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.set_optimizer(kvps.optimizer.SGD(learning_rate=1.0))
w = np.zeros(6, np.float32)
kv.init("w", w)
for step in range(40):
    kv.pushpull("w", np.full(6, kv.rank + 1, np.float32), out=w)    # w -= 1 + 2 each round
    print(json.dumps({"step": step, "w": float(w[0])}), flush=True)
    if step % 10 == 9:
        kv.barrier()
    time.sleep(0.03)
print(json.dumps({"final": w.tolist()}), flush=True)
'''


def test_a_recovered_scheduler_takes_over_a_running_job(cluster):
    """kill -9 the scheduler mid-job and start `kvps scheduler --recover` on its address: the servers
    and workers register again with their ranks, barriers go on, and no parameter is lost."""
    from harness import PY
    c = cluster(2, 1, env={"KVPS_SCHEDULER_GRACE": "20"})
    procs = c.spawn_workers(RECOVER)
    wait_for(lambda: any(line.get("step", 0) >= 5 for line in c.output("W0")), 30, "W0 to reach step 5")
    c.proc("H").kill()
    c.proc("H").wait()
    port = c.address.rsplit(":", 1)[1]
    c._spawn("H2", [PY, "-m", "kvps.cli", "scheduler", "--recover", "--port", port], ready=True)
    assert c._ready("H2").endswith(f":{port}")
    c.wait(procs, 60)
    assert [p.returncode for p in procs] == [0, 0], c.logs()
    for name in ("W0", "W1"):
        assert c.output(name)[-1] == {"final": [-3.0 * 40] * 6}, (name, c.logs())
    c.wait([c.proc("S0"), c.proc("H2")], 20)
    codes = {name: c.proc(name).returncode for name in ("S0", "H2")}
    assert codes == {"S0": 0, "H2": 0}, (codes, c.logs())
