"""The transport (kvps.wire.transport.Van) in one process, over 127.0.0.1: stop() is safe however
and whenever it is called (it once wrote to its closed wake pipe: EBADF in ./run demo), sends after
it fail clearly, and on_sent reports when zmq lets go of a payload, a dead peer's included."""

import itertools
import signal
import socket
import sys
import threading
import time

import numpy as np
import pytest

from kvps.errors import KVPSError
from kvps.wire.protocol import Entry, Header, Op
from kvps.wire.transport import Van


def ping():
    return Header(Op.HEARTBEAT, 0, "T")


def data(nbytes):
    """(header, [payload]) of a message carrying `nbytes` of uint8."""
    array = np.ones(nbytes, np.uint8)
    meta = {"seq": 0, "n": nbytes, "phase": "rs", "step": 0, "chunk": 0, "epoch": 0}
    return Header(Op.RING, 0, "T", [Entry.of(0, 0, array)], meta), [array]


@pytest.fixture
def escaped():
    """Exceptions that escape any thread during the test (the I/O thread's included)."""
    caught, old = [], threading.excepthook
    threading.excepthook = lambda args: caught.append(args.exc_value)
    yield caught
    threading.excepthook = old


@pytest.fixture
def sink():
    """A started Van that counts what it receives; yields (port, received list)."""
    got = []
    van = Van("sink", lambda source, header, payloads: got.append(header.op))
    port = van.bind("127.0.0.1")
    van.start()
    yield port, got
    van.stop()


def unused_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_start_stop_cycles_with_concurrent_submits_raise_nothing_unexpected(sink, escaped):
    port, _ = sink
    current, unexpected, done = [None], [], threading.Event()

    def submit():                        # sends, replies and connects at whatever van is current
        big, small = data(1 << 17), data(100)
        for i in itertools.count():
            van = current[0]
            if done.is_set():
                return
            if van is None:
                time.sleep(0)            # let the main thread make the next one
                continue
            try:
                van.send("P", *(big if i % 16 == 0 else small), on_sent=lambda: None)
                van.reply(b"\0gone", ping())
                if i % 64 == 0:
                    van.connect("Q", "127.0.0.1", port)
            except KVPSError as exc:
                if "stopped" not in str(exc):
                    unexpected.append(exc)
            except Exception as exc:     # an OSError here is the bug
                unexpected.append(exc)
    submitter = threading.Thread(target=submit)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)          # a thread that never blocks would hold the GIL 5 ms at a time
    submitter.start()
    started = time.monotonic()
    try:
        for i in range(200):
            van = Van(f"V{i}", lambda *a: None)
            van.bind("127.0.0.1")
            van.connect("P", "127.0.0.1", port)
            van.start()
            current[0] = van
            time.sleep(0.0005 * (i % 3))
            if i % 4 == 1:               # stop from another thread, racing this one
                other = threading.Thread(target=van.stop)
                other.start()
                van.stop()
                other.join(10)
            else:
                van.stop()
            van.stop()                   # twice is fine
            current[0] = None
    finally:
        done.set()
        submitter.join(10)
        sys.setswitchinterval(switch)
    assert not unexpected, unexpected[:3]
    assert not escaped, escaped[:3]
    assert time.monotonic() - started < 20


def test_stop_before_start_twice_and_start_after_stop():
    van = Van("V", lambda *a: None)
    van.bind("127.0.0.1")
    van.connect("P", "127.0.0.1", unused_port())      # queued, never flushed: dropped at stop
    van.stop()
    van.stop()
    with pytest.raises(KVPSError, match="V: the transport was already started or stopped"):
        van.start()


def test_after_stop_sends_raise_naming_the_node_and_replies_are_dropped(sink):
    van = Van("W3", lambda *a: None)
    van.connect("P", "127.0.0.1", sink[0])
    van.start()
    van.stop()
    with pytest.raises(KVPSError, match=r"W3: the transport is stopped .*HEARTBEAT to P not sent"):
        van.send("P", ping())
    with pytest.raises(KVPSError, match="W3: the transport is stopped .*connecting to Q"):
        van.connect("Q", "127.0.0.1", sink[0])
    sent = threading.Event()
    with pytest.raises(KVPSError):
        van.send("P", *data(1 << 20), on_sent=sent.set)
    assert sent.is_set()                                # refused: zmq never held it
    van.reply(b"\0client", ping())                      # dropped quietly
    van.disconnect("P")


def test_stop_with_frames_queued_hands_them_over(sink):
    port, got = sink
    van = Van("V", lambda *a: None)
    van.connect("P", "127.0.0.1", port)
    van.start()
    for _ in range(50):
        van.send("P", *data(100))
    deadline = time.monotonic() + 10
    while len(got) < 50 and time.monotonic() < deadline:   # before stop: LINGER 0 drops the rest
        time.sleep(0.01)
    van.send("P", *data(1 << 20))
    van.stop()
    assert len(got) >= 50


def test_stop_from_a_signal_handler_while_the_main_thread_submits(sink, escaped):
    van = Van("V", lambda *a: None)
    van.connect("P", "127.0.0.1", sink[0])
    van.start()
    old = signal.signal(signal.SIGALRM, lambda signum, frame: van.stop())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        started = time.monotonic()
        with pytest.raises(KVPSError, match="stopped"):
            while time.monotonic() < started + 10:
                van.send("P", ping())
        # the handler may have interrupted a send inside the van's lock: it must not wait on it
        assert time.monotonic() - started < 3
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    van.stop()
    assert not escaped


def test_on_sent_waits_for_zmq_and_a_dead_peer_is_let_go_by_disconnect_or_stop(sink):
    van = Van("V", lambda *a: None)
    van.connect("live", "127.0.0.1", sink[0])
    van.connect("dead", "127.0.0.1", unused_port())
    van.connect("dead2", "127.0.0.1", unused_port())
    van.start()
    try:
        small, big, stuck, stuck2 = (threading.Event() for _ in range(4))
        van.send("live", *data(5), on_sent=small.set)
        van.send("live", *data(1 << 22), on_sent=big.set)
        assert small.wait(10) and big.wait(10)
        van.send("dead", *data(1 << 20), on_sent=stuck.set)
        header, _ = data(1 << 20)
        van.send("dead2", header, [memoryview(bytearray(1 << 20))], on_sent=stuck2.set)
        assert not stuck.wait(0.3)        # zmq keeps it for a peer that never comes
        van.disconnect("dead")
        assert stuck.wait(10)
        assert not stuck2.is_set()
    finally:
        van.stop()
    assert stuck2.wait(10)                # stop closes the DEALER: zmq lets go of that one too



def keyed(key, nbytes):
    header, payloads = data(nbytes)
    header.keys = [Entry.of(key, 0, payloads[0])]
    return header, payloads


def arrival_order(credit, sends, settle_after=None, deadline=30.0):
    """The keys a slow receiver sees, in order, when a Van with `credit` sends [(key, nbytes,
    priority)], pausing before send number `settle_after`: the receiver reads nothing until every
    send is queued (its queue holds two messages), so the link stays busy and the window full."""
    import zmq
    from kvps.wire import protocol
    ctx = zmq.Context()
    sink = ctx.socket(zmq.ROUTER)
    sink.setsockopt(zmq.RCVHWM, 2)
    sink.setsockopt(zmq.RCVBUF, 1 << 16)
    sink.setsockopt(zmq.LINGER, 0)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    sender = Van("sender", lambda *a: None, credit=credit)
    sender.start()
    messages = [(keyed(key, nbytes), priority) for key, nbytes, priority in sends]
    got = []
    try:
        sender.connect("sink", "127.0.0.1", port)
        for i, ((header, payloads), priority) in enumerate(messages):
            if i == settle_after:       # let the I/O thread fill the window with what came before
                time.sleep(0.2)
            sender.send("sink", header, payloads, priority=priority)
        end = time.monotonic() + deadline
        while len(got) < len(sends):
            assert sink.poll(max(1, int(1000 * (end - time.monotonic())))), \
                f"only {len(got)} of {len(sends)} messages arrived in {deadline} s"
            header, _ = protocol.unpack(sink.recv_multipart(copy=False)[1:])
            got.append(header.keys[0].key)
        return got
    finally:
        sender.stop()
        sink.close(0)
        ctx.term()


def test_priority_overtakes_bulk_on_a_busy_link_and_same_key_order_holds():
    # 40 bulk messages of 2 MB (priority -1) through a window of 4 MB, then a hot one (priority 5),
    # then a priority-9 message of key "b0", which must still follow the bulk message of "b0".
    sends = [(f"b{i}", 2 << 20, -1) for i in range(40)] + [("hot", 1 << 16, 5), ("b0", 1 << 16, 9)]
    got = arrival_order(4 << 20, sends, settle_after=40)
    assert sorted(got) == sorted(k for k, _, _ in sends)
    assert got.index("hot") < 20, f"the priority-5 message came {got.index('hot') + 1}th of 42: {got}"
    assert got.index("b0") < got.index("b0", got.index("b0") + 1)
    plain = arrival_order(0, sends, settle_after=40)     # no schedule: call order, priority ignored
    assert plain == [k for k, _, _ in sends]


def test_ring_chunks_that_come_before_the_ring_wait_for_it():
    # A neighbour that formed the job first may send before this worker's ring subscribes: those
    # chunks are kept and handed over on subscription, in order, not dropped.
    from kvps.config import Config
    from kvps.wire.membership import Worker
    node = Worker(Config.from_env({"KVPS_SCHEDULER": "127.0.0.1:9", "KVPS_CURVE": "0"}))
    try:
        early = [Header(Op.RING, 0, "W1", meta={"seq": 0, "step": i}) for i in range(3)]
        for header in early:
            node.on_client(b"id", header, [b"x"])
        got = []
        node.on_peer_message(lambda header, payloads: got.append(header.meta["step"]))
        node.on_client(b"id", Header(Op.RING, 0, "W1", meta={"seq": 0, "step": 3}), [b"x"])
        assert got == [0, 1, 2, 3]
    finally:
        node.van.stop()


def test_messages_sent_in_one_turn_go_in_one_bundle_and_are_handled_in_order():
    """A server's copies and ROUNDs to the next server of a chain (bundle=True) that its I/O thread
    sends in one turn go as one BUNDLE; the receiver handles each as if it came alone, in order,
    the plain ones around them keeping their places."""
    got, wires = [], []
    sink = Van("sink", lambda source, header, payloads: got.append((header.id, [bytes(p) for p in payloads])))
    port = sink.bind("127.0.0.1")
    sink.start()
    van = Van("V", lambda *a: None)
    van.connect("S1", "127.0.0.1", port)
    van.start()
    sent = threading.Event()
    try:
        def turn():                       # on the I/O thread, as a server's handler sends
            for i in range(1, 4):
                header, payloads = data(10 * i)
                header.id = i
                van.send("S1", header, payloads, bundle=True, on_sent=sent.set if i == 3 else None)
            plain, _ = data(0)
            plain.id = 4
            van.send("S1", plain)         # the bundle so far goes before it
            header, payloads = data(7)
            header.id = 5
            van.send("S1", header, payloads, bundle=True)
        original = van._send_now
        van._send_now = lambda peer, frames, done: (wires.append(len(frames)), original(peer, frames, done))
        van.call_soon(turn)
        deadline = time.monotonic() + 10
        while len(got) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [i for i, _ in got] == [1, 2, 3, 4, 5]
        assert [len(p[0]) for _, p in got[:3]] == [10, 20, 30] and got[4][1] == [bytes(np.ones(7, np.uint8))]
        assert wires == [1 + 3 * 2, 1, 2]     # a BUNDLE of three (header, payload) pairs; then one each
        assert sent.wait(10)
    finally:
        van.stop()
        sink.stop()


def test_call_later_runs_once_on_the_io_thread_in_order_and_not_before_it_is_due(escaped):
    van = Van("later", lambda source, header, payloads: None)
    van.start()
    try:
        ran, done = [], threading.Event()

        def note(name):
            ran.append((name, time.monotonic(), threading.current_thread().name))
            if len(ran) == 3:
                done.set()
        asked = time.monotonic()
        van.call_later(0.2, lambda: note("late"))
        van.call_later(0.0, lambda: note("now"))
        van.call_later(0.05, lambda: note("soon"))
        assert done.wait(5), ran
        assert [name for name, _, _ in ran] == ["now", "soon", "late"]
        assert ran[2][1] - asked >= 0.2
        assert ran[0][1] - asked < 0.5            # the I/O thread was woken, not left to its 1 s poll
        assert {thread for _, _, thread in ran} == {"kvps-io-later"}
        time.sleep(0.1)
        assert len(ran) == 3                       # each once
    finally:
        van.stop()
    van.call_later(0.0, lambda: None)              # after stop: dropped, no error
    assert escaped == []


def test_a_port_in_use_is_a_config_error_naming_it():
    """MXNet launch scripts name a fixed port (DMLC_PS_ROOT_PORT): one still held by an earlier job
    is a one-line error with the port and what to do, not a zmq traceback."""
    from kvps.errors import ConfigError
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    van = Van("H", lambda *a: None)
    try:
        with pytest.raises(ConfigError, match=rf"H: cannot listen on 127.0.0.1:{port}: Address already in use "
                                              r"\(another job's scheduler or server"):
            van.bind("127.0.0.1", port)
    finally:
        van.stop()
        held.close()
