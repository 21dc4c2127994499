"""Local sockets (kvps/wire/local.py): the framing of a message in datagrams, both ends, and what a
bad peer gets, with real Unix sockets in this process."""
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from kvps.errors import KVTimeoutError, ProtocolError
from kvps.wire import local

pytestmark = pytest.mark.unit


def _pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return local.Conn(a, 1 << 30), local.Conn(b, 1 << 30)


def _receive(conn, tries=1000):
    for _ in range(tries):
        frames = conn.receive()
        if frames is not None:
            return [bytes(f) for f in frames]
    raise AssertionError("no message")


@pytest.mark.parametrize("sizes", [[12], [40, 1024], [40, 0, 7], [100, local.CHUNK], [64, 3 * local.CHUNK + 5],
                                   [local.CHUNK - 13]])
def test_a_message_comes_out_as_its_frames(sizes):
    a, b = _pair()
    frames = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    a.send(frames, timeout=5)
    assert _receive(b) == frames
    assert b.receive() is None


def test_frames_may_be_any_buffer_and_are_copied_as_they_are_sent():
    a, b = _pair()
    values = np.arange(300, dtype=np.float32)
    a.send([b"head", values, memoryview(values)[:10]], timeout=5)
    values[:] = -1
    head, got, part = _receive(b)
    assert head == b"head"
    assert np.array_equal(np.frombuffer(got, np.float32), np.arange(300, dtype=np.float32))
    assert np.array_equal(np.frombuffer(part, np.float32), np.arange(10, dtype=np.float32))


def test_posted_messages_wait_for_room_in_order_and_go_on_flush():
    a, b = _pair()
    sent = [[b"h", bytes([i % 256]) * 30_000] for i in range(400)]      # 12 MB: more than the socket holds
    queued = False
    for frames in sent:
        queued = a.post(frames) or queued
    assert queued and a.waiting() > 0
    got = []
    while len(got) < len(sent):
        a.flush()
        while (frames := b.receive()) is not None:
            got.append([bytes(f) for f in frames])
    assert got == sent and not a.flush() and a.waiting() == 0


def test_a_blocked_send_times_out_and_a_failure_ends_it_sooner():
    a, b = _pair()
    with pytest.raises(KVTimeoutError, match="0.2 s"):
        for _ in range(10_000):
            a.send([b"h", b"x" * 60_000], timeout=0.2)

    class Broken(Exception):
        pass

    def check():
        raise Broken()
    with pytest.raises(Broken):
        a.send([b"h", b"x" * 60_000], timeout=5, check=check)
    b.close()
    with pytest.raises(EOFError):
        a.send([b"h"], timeout=5)


def _raw(conn):
    return conn._sock


@pytest.mark.parametrize("datagram, why", [
    (b"\x00", "no frame count"),
    (b"\x00" + struct.pack("<I", 0), "declares 0 frames"),
    (b"\x00" + struct.pack("<I", 1 << 31), "declares"),
    (b"\x00" + struct.pack("<II", 1, 100) + b"x" * 10, "declares 108"),
    (b"\x07" + struct.pack("<II", 1, 1) + b"x", "flagged 7"),
])
def test_a_bad_datagram_is_a_protocol_error(datagram, why):
    a, b = _pair()
    _raw(a).send(datagram)
    with pytest.raises(ProtocolError, match=why):
        b.receive()


def test_a_datagram_over_the_chunk_and_a_message_over_the_limit_are_refused():
    a, b = _pair()
    _raw(a).setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    _raw(a).send(b"\x00" + b"x" * (local.CHUNK + 10))
    with pytest.raises(ProtocolError, match="over"):
        b.receive()
    x, y = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    small = local.Conn(y, 100_000)
    local.Conn(x, 1 << 30).send([b"h", b"x" * 200_000], timeout=5)
    with pytest.raises(ProtocolError, match="after"):
        _receive(small)


def test_a_closed_peer_is_an_eof():
    a, b = _pair()
    a.send([b"last"], timeout=5)
    a.close()
    assert _receive(b) == [b"last"]
    with pytest.raises(EOFError):
        b.receive()


def _accepting(listener, room=True):
    """Accept one connection on a thread (a client's connect waits for the welcome); returns
    a function that gives the accepted Conn, or the exception accept raised."""
    got = []

    def run():
        for _ in range(2000):
            try:
                conn = listener.accept(room)
            except Exception as exc:
                got.append(exc)
                return
            if conn is not None:
                got.append(conn)
                return
            time.sleep(0.001)
    thread = threading.Thread(target=run)
    thread.start()

    def result():
        thread.join(5)
        return got[0]
    return result


def test_a_listener_welcomes_its_own_user_and_a_client_checks_the_pid():
    listener = local.Listener(1, 1 << 20)
    try:
        accepted = _accepting(listener)
        conn = local.connect(1, os.getpid(), 1 << 20)
        server_side = accepted()
        assert conn is not None and listener.accepted == 1 and server_side.ident == 1
        conn.send([b"ping"], timeout=5)
        assert _receive(server_side) == [b"ping"]
        server_side.post([b"pong"])
        assert _receive(conn) == [b"pong"]
        assert local.connect(2, os.getpid(), 1 << 20) is None         # nobody listens there
        # a server with no room closes the connection unwelcomed: the client goes on without it (TCP)
        refused = _accepting(listener, room=False)
        assert local.connect(1, os.getpid(), 1 << 20) is None
        assert isinstance(refused(), PermissionError) and listener.accepted == 1
    finally:
        listener.close()
    # a process that took the name of pid 1's server: the client finds pid 1 is not listening, and uses TCP
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        squatter.bind(local.address(4, 1))
        squatter.listen(1)
        assert local.connect(4, 1, 1 << 20) is None
    finally:
        squatter.close()


def test_a_server_that_does_not_welcome_in_time_is_not_used(monkeypatch):
    monkeypatch.setattr(local, "WELCOME_TIMEOUT", 0.2)
    listener = local.Listener(5, 1 << 20)         # never accepts
    try:
        start = time.monotonic()
        assert local.connect(5, os.getpid(), 1 << 20) is None
        assert time.monotonic() - start < 2
    finally:
        listener.close()


def test_a_name_in_use_cannot_be_taken_twice():
    first = local.Listener(3, 1 << 20)
    try:
        with pytest.raises(OSError):
            local.Listener(3, 1 << 20)
    finally:
        first.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_a_process_of_another_user_is_refused():
    import subprocess
    import sys
    listener = local.Listener(6, 1 << 20)
    try:
        accepted = _accepting(listener)
        code = ("import os, sys; from kvps.wire import local; os.setgid(65534); os.setuid(65534); "
                f"sys.exit(0 if local.connect(6, {os.getpid()}, 1 << 20) is None else 1)")
        child = subprocess.run([sys.executable, "-c", code], timeout=30, capture_output=True, text=True)
        assert child.returncode == 0, child.stderr
        refused = accepted()
        assert isinstance(refused, PermissionError) and "uid 65534" in str(refused)
        assert listener.accepted == 0
    finally:
        listener.close()


def test_a_lane_whose_server_closes_its_socket_fails_the_call_after_the_heartbeat_timeout():
    """A server that closes a lane's local connection without the job reporting it dead (it closed
    it for a reason of its own): the lane's waiting requests fail, naming it, after the heartbeat
    timeout and a second, not after KVPS_TIMEOUT."""
    import itertools
    import types
    from kvps.errors import KVPSError
    from kvps.wire.lane import Lanes
    from kvps.wire.protocol import Header, Op
    listener = local.Listener(8, 1 << 20)
    ids = itertools.count(1)
    node = types.SimpleNamespace(
        name="W0", servers_changed=0, telemetry=None, add_failure_listener=lambda fn: None,
        add_servers_listener=lambda fn: None,
        requests=types.SimpleNamespace(failure=None, next_id=lambda: next(ids)),
        cfg=types.SimpleNamespace(replicas=0, timeout=30.0, max_message_bytes=1 << 20, heartbeat_timeout=0.2),
        van=types.SimpleNamespace(adopt=lambda owner: None))
    try:
        accepted = _accepting(listener)
        lanes = Lanes(node, lambda peer: ("127.0.0.1", 8), lambda peer: (8, os.getpid()))
        handle = lanes.mine().request_many([("S0", Header(Op.PULL), (), None)], "pull of key 'k'", 30.0)
        server_side = accepted()
        assert _receive(server_side)        # the request came; the server closes without answering
        server_side.close()
        start = time.monotonic()
        with pytest.raises(KVPSError, match="S0 closed its local connection to W0"):
            handle.wait()
        assert 1.0 < time.monotonic() - start < 5
    finally:
        listener.close()
