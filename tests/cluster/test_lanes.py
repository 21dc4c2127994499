"""Lanes (kvps/wire/lane.py): small calls (up to 256 KB, in the message or in shared memory) go on
the calling thread's own connections, big ones through the I/O thread, and a key's calls keep their order whichever way each goes. Results are the
same with lanes off (KVPS_LANE_BYTES=0); a wait on a lane ends with the job's failure, or a timeout
naming the server, like any other wait; each thread has its own lane."""
import socket
import time

import msgpack
import pytest

from kvps.wire import local
from kvps.wire.protocol import Op

# Keys: "s" small (always a lane call on its own), "b" big (split over both servers, never a lane
# call), "m" small but also named together with "b" (then the call is big and goes through the I/O
# thread), so its calls switch ways from one to the next.
MIXED = r'''
import json, numpy as np, kvps
kv = kvps.create("dist_sync")
r, W = kv.rank, kv.num_workers
kv.init(["s", "m", "b"], [np.zeros(16, np.float32), np.zeros(40, np.float32), np.zeros((600, 500), np.float32)])
got = []
for step in range(1, 5):
    g = float((r + 1) * step)
    tot = sum((w + 1) * step for w in range(W))
    s, m, b = np.full(16, g, np.float32), np.full(40, g, np.float32), np.full((600, 500), g, np.float32)
    kv.push(["m", "b"], [m, b])                 # big: the I/O thread; returns early
    m[:] = -1; b[:] = -1
    out_m = np.zeros(40, np.float32)
    kv.pull("m", out=out_m)                     # small, but "m" waits on the I/O path: follows it there
    kv.pushpull("m", np.full(40, g, np.float32), out=out_m)    # "m" is free again: a lane
    kv.push("s", s)                             # a lane push that returns early
    s[:] = -1
    h = kv.pushpull("s", np.full(16, g, np.float32), async_op=True)   # async_op=True: the I/O thread
    h.wait()
    out_s = np.zeros(16, np.float32)
    kv.pull("s", out=out_s, priority=3)         # a lane again
    out_b = np.zeros((600, 500), np.float32)
    kv.pull("b", out=out_b)
    both = [np.zeros(40, np.float32), np.zeros((600, 500), np.float32)]
    kv.pull(["m", "b"], out=both)
    got.append({"m": [float(out_m.min()), float(out_m.max())], "s": [float(out_s.min()), float(out_s.max())],
                "b": [float(out_b.min()), float(out_b.max())], "both": [float(both[0].min()), float(both[1].max())],
                "want": tot})
lanes = kv._lanes.sent() if kv._lanes is not None else 0
print(json.dumps({"got": got, "lanes": lanes}), flush=True)
'''


@pytest.mark.parametrize("lane_bytes", ["65536", "0"])
def test_a_keys_calls_keep_their_order_whichever_way_they_go(cluster, lane_bytes):
    c = cluster(2, 2, env={"KVPS_LANE_BYTES": lane_bytes})
    results = c.run_workers(MIXED)
    for (line,) in results:
        for step in line["got"]:
            want = step["want"]
            assert step["m"] == [want, want] and step["s"] == [want, want], step
            assert step["b"] == [want, want] and step["both"] == [want, want], step
        if lane_bytes == "0":
            assert line["lanes"] == 0, line
        else:
            # per step: the pushpull of "m", the push of "s" and the pull of "s" (one server each)
            assert line["lanes"] >= 4 * 3, line
    assert c.wait_daemons() == [0, 0, 0]


# A 100 KB key: on a lane (at most KVPS_LANE_BYTES, 256 KB), its values in shared memory with the
# co-located servers or, with KVPS_SHM=0, in the message (copied as it is sent: over 64 KB zmq would
# otherwise send from the caller's array, which it overwrites as soon as push returns).
MID = r'''
import json, numpy as np, kvps
kv = kvps.create("dist_sync")
r, W, n = kv.rank, kv.num_workers, 25600
kv.init("mid", np.zeros(n, np.float32))
wrong = []
for step in range(1, 21):
    tot = sum((w + 1) * step for w in range(W))
    g = np.full(n, (r + 1) * step, np.float32)
    kv.push("mid", g)
    g[:] = -1000                                # the pushed values must not change
    out = np.zeros(n, np.float32)
    kv.pull("mid", out=out)
    if out.min() != tot or out.max() != tot:
        wrong.append([step, float(out.min()), float(out.max()), tot])
    kv.pushpull("mid", np.full(n, (r + 1) * step, np.float32), out=out)
    if out.min() != tot or out.max() != tot:
        wrong.append([step, float(out.min()), float(out.max()), tot])
print(json.dumps({"wrong": wrong, "lanes": kv._lanes.sent()}), flush=True)
'''


@pytest.mark.parametrize("shm", ["1", "0"])
def test_a_mid_sized_key_goes_on_a_lane_with_or_without_shared_memory(cluster, shm):
    c = cluster(2, 2, env={"KVPS_SHM": shm})
    for (line,) in c.run_workers(MID):
        assert line["wrong"] == [], line
        # every step: the push (which brings the pull its reply: pull-ahead) and the pushpull
        assert line["lanes"] >= 2 * 20, line
    assert c.wait_daemons() == [0, 0, 0]


THREADS = r'''
import json, threading, numpy as np, kvps
kv = kvps.create("dist_sync")
r = kv.rank
kv.init(["t0", "t1"], [np.zeros(8, np.float32), np.zeros(8, np.float32)])
seen, errors = {}, []
def train(key):
    try:
        out = np.zeros(8, np.float32)
        for step in range(1, 51):
            kv.pushpull(key, np.full(8, (r + 1) * step, np.float32), out=out)
            if out.min() != out.max() or out[0] != 3 * step:
                errors.append((key, step, out.tolist()))
        seen[key] = out.tolist()
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=train, args=(k,)) for k in ("t0", "t1")]
for t in threads: t.start()
for t in threads: t.join(60)
print(json.dumps({"seen": seen, "errors": errors, "lanes": len(kv._lanes._all)}), flush=True)
'''


def test_each_thread_has_its_own_lane(cluster):
    c = cluster(2, 1)
    for (line,) in c.run_workers(THREADS):
        assert not line["errors"], line
        assert line["seen"] == {"t0": [150.0] * 8, "t1": [150.0] * 8}, line
        assert line["lanes"] == 2, line
    assert c.wait_daemons() == [0, 0]


WAITING = r'''
import json, sys, time, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init("k", np.zeros(4, np.float32))
if kv.rank == 1:
    print(json.dumps({"ready": True}), flush=True)
    time.sleep(60)                          # never pushes: W0's round cannot close
    sys.exit(0)
out = np.zeros(4, np.float32)
start = time.time()
print(json.dumps({"waiting": start}), flush=True)
try:
    kv.pushpull("k", np.ones(4, np.float32), out=out)
    print(json.dumps({"error": None}), flush=True)
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc), "t": time.time() - start}), flush=True)
'''


def test_a_server_killed_while_a_lane_waits_fails_the_wait(cluster):
    c = cluster(2, 1)
    procs = c.spawn_workers(WAITING)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any("waiting" in x for x in c.output("W0")):
        time.sleep(0.05)
    time.sleep(0.3)
    c.proc("S0").kill()
    killed = time.time()
    c.wait(procs[:1], 30)
    (line,) = [x for x in c.output("W0") if "error" in x]
    assert line["error"] == "NodeFailure" and "S0" in line["message"], line
    assert time.time() - killed < 2 + 5, line      # the heartbeat timeout (2 s) and some slack
    procs[1].kill()


def test_a_lane_wait_times_out_naming_the_server(cluster):
    c = cluster(2, 1)
    procs = c.spawn_workers(WAITING, env={"KVPS_TIMEOUT": "1.5"})
    c.wait(procs[:1], 30)
    (line,) = [x for x in c.output("W0") if "error" in x]
    assert line["error"] == "KVTimeoutError" and "S0" in line["message"] and "1.5 s" in line["message"], line
    assert 1.4 < line["t"] < 5, line
    procs[1].kill()


LOCAL = r'''
import json, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init("k", np.zeros(256, np.float32))
out = np.zeros(256, np.float32)
for step in range(1, 21):
    kv.push("k", np.full(256, step, np.float32))
    kv.pull("k", out=out)
    assert out.min() == out.max() == step * kv.num_workers, (step, out[:4])
socks = {peer: type(sock).__name__ for peer, sock in kv._lanes.mine()._socks.items()}
stats = kv.server_stats()
print(json.dumps({"socks": socks, "local_clients": {s: v["local_clients"] for s, v in stats.items()}}), flush=True)
'''


@pytest.mark.parametrize("shm", ["1", "0"])
def test_a_lane_to_a_server_on_its_host_uses_its_local_socket(cluster, shm):
    """With KVPS_SHM on, a lane reaches a co-located server through the server's Unix socket
    (kvps/wire/local.py), not ZeroMQ; with KVPS_SHM=0 everything goes over TCP."""
    c = cluster(2, 1, env={"KVPS_SHM": shm})
    for (line,) in c.run_workers(LOCAL):
        if shm == "1":
            assert line["socks"] == {"S0": "Conn"} and line["local_clients"]["S0"] >= 2, line
        else:
            assert line["socks"] == {"S0": "Socket"} and line["local_clients"]["S0"] == 0, line
    assert c.wait_daemons() == [0, 0]


def _local_client(c, server="S0"):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(local.address(c.server_ports[int(server[1:])], c.proc(server).pid))
    assert sock.recv(64) == local.WELCOME
    return sock


def test_a_local_client_that_sends_garbage_is_closed_and_the_job_goes_on(cluster):
    # about the local socket itself: on (KVPS_SHM=1), even where the tier runs over TCP (KVPS_SHM=0)
    c = cluster(2, 1, env={"KVPS_MAX_MESSAGE_BYTES": str(4 << 20), "KVPS_SHM": "1"})
    # a datagram that is no message: the server closes that connection, and only that one
    bad = _local_client(c)
    bad.send(b"\x00\xff\xff\xff\xff garbage")
    assert bad.recv(100) == b""
    # a message whose header does not decode: answered with an ERROR, and the connection stays open
    odd = _local_client(c)
    for datagram in local.encode([b"\x92\x01\x02"]):
        odd.sendmsg(datagram)
    frames = local.decode(odd.recv(1 << 16)[1:])
    reply = msgpack.unpackb(bytes(frames[0]), raw=False)
    assert reply["op"] == Op.ERROR and "refused the message" in reply["meta"]["message"], reply
    # a message in datagrams that goes on past the biggest one a node takes (KVPS_MAX_MESSAGE_BYTES): closed
    big = _local_client(c)
    try:
        for _ in range(100):
            big.send(b"\x01" + b"x" * local.CHUNK)
        closed = big.recv(100) == b""
    except (BrokenPipeError, ConnectionResetError):
        closed = True
    assert closed
    odd.close()
    for (line,) in c.run_workers(LOCAL):
        assert line["socks"] == {"S0": "Conn"}, line
    assert c.wait_daemons() == [0, 0]
