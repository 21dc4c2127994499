"""The ring's TCP link (kvps/collective/link.py) in one process: the nonce handshake, chunks read
straight into place with their heads checked, and every way a link ends (a stranger, NO, a
refusal over ZeroMQ, a closed peer, a deadline)."""
import socket
import threading
import time

import numpy as np
import pytest

from kvps.collective import link
from kvps.errors import KVTimeoutError, ProtocolError

pytestmark = pytest.mark.unit


@pytest.fixture
def pair():
    """(Outbound W0 -> W1, its Inbound, what the Outbound reported broken), linked; both closed
    after the test (closing twice is allowed)."""
    broken = []
    out = link.Outbound("W0", "W1", "127.0.0.1", broken.append)
    offer = out.offer(1)
    inn = link.Inbound.connect("W1", "W0", "127.0.0.1", offer, timeout=5)
    try:
        assert out.accept(time.monotonic() + 5, lambda: None)
        yield out, inn, broken
    finally:
        out.close()
        inn.close()


def test_chunks_arrive_in_place_in_order(pair):
    out, inn, broken = pair
    assert out.linked and inn.from_seq == 1
    a = np.arange(100_000, dtype=np.float32)
    b = np.arange(7, dtype=np.int64)
    done = threading.Event()
    out.send(link.head(1, "rs", 0, 0, 1, a.nbytes), a, lambda: None)
    out.send(link.head(1, "ag", 2, 3, 9, b.nbytes), b, done.set)
    got_a, got_b = np.empty_like(a), np.zeros(10, np.int64)
    inn.read(link.head(1, "rs", 0, 0, 1, a.nbytes), got_a, time.monotonic() + 5)
    inn.read(link.head(1, "ag", 2, 3, 9, b.nbytes), got_b[2:9], time.monotonic() + 5)
    assert (got_a == a).all() and (got_b[2:9] == b).all() and not got_b[:2].any() and not got_b[9:].any()
    assert done.wait(5) and out.chunks == 2 and inn.chunks == 2 and not broken


def test_a_head_other_than_the_one_expected_is_a_protocol_error(pair):
    out, inn, _ = pair
    a = np.ones(4, np.float32)
    out.send(link.head(3, "rs", 1, 0, 1, a.nbytes), a, lambda: None)
    with pytest.raises(ProtocolError, match=r"W0 sent ring chunk .*\(3, 0, 1, 0, 1, 16\).*expected "
                                            r"\(3, 0, 2, 0, 1, 16\)"):
        inn.read(link.head(3, "rs", 2, 0, 1, a.nbytes), np.empty(4, np.float32), time.monotonic() + 5)


def test_a_closed_peer_is_a_broken_link_and_a_silent_one_a_timeout(pair):
    out, inn, _ = pair
    started = time.monotonic()
    with pytest.raises(KVTimeoutError, match="no ring data from W0"):
        inn.read(link.head(1, "rs", 0, 0, 1, 8), np.empty(2, np.float32), time.monotonic() + 0.3)
    assert time.monotonic() - started < 2
    out.close()
    with pytest.raises(link.LinkBroken, match="W0 closed the ring's link"):
        inn.read(link.head(1, "rs", 0, 0, 1, 8), np.empty(2, np.float32), time.monotonic() + 5)


def test_a_read_blocked_on_another_thread_wakes_when_the_ring_ends(pair):
    out, inn, _ = pair
    errors = []

    def read():
        try:
            inn.read(link.head(1, "rs", 0, 0, 1, 8), np.empty(2, np.float32), time.monotonic() + 30)
        except Exception as exc:        # noqa: BLE001 - the test looks at what it was
            errors.append(exc)
    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.2)
    inn.wake()
    reader.join(5)
    assert not reader.is_alive() and isinstance(errors[0], link.LinkBroken)


def test_a_sender_whose_peer_went_away_reports_the_link_broken_and_frees_the_memory(pair):
    out, inn, broken = pair
    inn.close()
    big = np.zeros(8 << 20, np.uint8)        # more than the socket buffers take
    done = threading.Event()
    out.send(link.head(1, "rs", 0, 0, 1, big.nbytes), big, done.set)
    assert done.wait(10) and broken and isinstance(broken[0], link.LinkBroken)
    assert "the ring's link to W1 failed" in str(broken[0])


def test_only_a_connection_with_the_nonce_links():
    out = link.Outbound("W0", "W1", "127.0.0.1", lambda exc: None)
    offer = out.offer(1)
    strangers = [socket.create_connection(("127.0.0.1", offer["port"])) for _ in range(2)]
    strangers[0].sendall(b"\0" * (link.NONCE_BYTES + 1))     # a wrong nonce
    strangers[1].close()                                      # nothing at all
    inn = link.Inbound.connect("W1", "W0", "127.0.0.1", offer, timeout=5)
    try:
        assert out.accept(time.monotonic() + 10, lambda: None)
        a = np.arange(5, dtype=np.float64)
        out.send(link.head(1, "ag", 0, 0, 2, a.nbytes), a, lambda: None)
        got = np.empty(5)
        inn.read(link.head(1, "ag", 0, 0, 2, a.nbytes), got, time.monotonic() + 5)
        assert (got == a).all()
    finally:
        strangers[0].close()
        out.close()
        inn.close()


def test_no_or_a_refusal_leaves_the_link_unused_and_a_silent_peer_times_out():
    out = link.Outbound("W0", "W1", "127.0.0.1", lambda exc: None)
    assert link.refuse("W1", "W0", "127.0.0.1", out.offer(1), timeout=5)
    assert out.accept(time.monotonic() + 5, lambda: None) is False and not out.linked
    out.close()
    out = link.Outbound("W0", "W1", "127.0.0.1", lambda exc: None)
    out.offer(1)
    assert out.accept(time.monotonic() + 5, lambda: "could not connect") is False
    out.close()
    out = link.Outbound("W0", "W1", "127.0.0.1", lambda exc: None)
    out.offer(1)
    with pytest.raises(KVTimeoutError, match="W1 did not connect to its ring link"):
        out.accept(time.monotonic() + 0.3, lambda: None)
    out.close()


@pytest.mark.parametrize("meta", [{}, {"port": 0, "nonce": b"x" * 16, "from": 1},
                                  {"port": 5, "nonce": b"short", "from": 1},
                                  {"port": 5, "nonce": b"x" * 16, "from": -1},
                                  {"port": "many", "nonce": b"x" * 16, "from": 1}])
def test_an_offer_kvps_would_not_send_is_refused(meta):
    with pytest.raises(ProtocolError, match="malformed ring link offer from W0"):
        link.Inbound.connect("W1", "W0", "127.0.0.1", meta, timeout=1)


def test_accept_ends_with_the_ring():
    out = link.Outbound("W0", "W1", "127.0.0.1", lambda exc: None)
    out.offer(1)
    ended = []

    def check():
        if ended:
            raise ended[0]
    threading.Timer(0.3, lambda: ended.append(KVTimeoutError("the job failed"))).start()
    started = time.monotonic()
    with pytest.raises(KVTimeoutError, match="the job failed"):
        out.accept(time.monotonic() + 30, check)
    assert time.monotonic() - started < 2
    out.close()


class _Node:
    """What Links uses of a Worker node: its name, the job's addresses, and ZeroMQ to the neighbours
    (here a list of what was sent)."""

    def __init__(self, rank, size):
        self.name = f"W{rank}"
        self.membership = {"workers": [("127.0.0.1", 0, 1000 + r) for r in range(size)]}
        self.sent = []

    def send_to_peer(self, name, header):
        self.sent.append((name, header))

    def connect_worker(self, rank):
        return True


def test_links_offer_connect_and_announce_between_two_workers():
    from types import SimpleNamespace
    cfg = SimpleNamespace(ring_link=1, elastic=0, connect_timeout=5)
    nodes = [_Node(r, 2) for r in range(2)]
    for node in nodes:
        node.keys = None
    # W0's neighbours share memory with it, W1's do not: only W1 offers, and W0 still takes it up
    links = [link.Links.of(nodes[r], cfg, r, 2, lambda exc: None, offer=(r == 1)) for r in range(2)]
    assert links[1].start(0, time.monotonic() + 5, 8, 1, 0, lambda: None) == (None, None)
    (to, offer), = nodes[1].sent
    assert to == "W0" and offer.meta["phase"] == "link" and offer.meta["from"] == 1
    assert links[0].message("W1", offer.meta) and not links[0].message("W1", offer.meta)   # one offer
    assert not links[0].message("W7", {"refused": "x"})
    out0, inn0 = links[0].start(1, time.monotonic() + 5, 8, 1, 0, lambda: None)      # connects
    assert out0 is None and inn0 is not None and not nodes[0].sent
    out1, inn1 = links[1].start(1, time.monotonic() + 5, 8, 1, 0, lambda: None)      # accepts
    assert out1 is not None and inn1 is None
    start = nodes[1].sent[-1][1]            # collective 1 announced over ZeroMQ, before its chunks
    assert start.meta == {"seq": 1, "n": 8, "phase": "start", "epoch": 0} and start.keys[0].shape == (8,)
    a = np.arange(8, dtype=np.float32)
    out1.send(link.head(1, "rs", 0, 0, 1, a.nbytes), a, lambda: None)
    got = np.empty(8, np.float32)
    inn0.read(link.head(1, "rs", 0, 0, 1, a.nbytes), got, time.monotonic() + 5)
    assert (got == a).all()
    for one in links:
        one.close()
    assert link.Links.of(nodes[0], cfg, 0, 1, lambda exc: None, offer=True) is None     # one worker: no ring
