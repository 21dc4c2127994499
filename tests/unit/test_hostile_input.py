"""Hostile input, in one process: decoding is bounded before it starts, names are canonical, logs are
escaped and throttled, the store never waits for zmq, and a Van's I/O thread survives whatever its
handler raises (and, if it dies anyway, says so to its owner)."""
import logging
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from kvps.errors import KVValueError, ProtocolError
from kvps.ps.store import Store
from kvps.wire import protocol
from kvps.wire.membership import parse_name
from kvps.wire.protocol import MAX_ENTRIES, MAX_HEADER_BYTES, Entry, Header, Op
from kvps.wire.throttle import LogThrottle, escape
from kvps.wire.transport import Van, _request_id

BASE = {"v": 1, "op": 1, "id": 7, "src": "?", "keys": [["k", 0, 0, [2], 8]],
        "meta": {"role": "worker", "host": "h", "port": 1, "pid": 2}}


def _deep(levels, as_map):
    return (b"\x81\xa1a" if as_map else b"\x91") * levels + b"\x01"


def _with(field, raw, entry_at=None, meta_at=None):
    """BASE packed by hand, with `raw` bytes in place of one header field, entry field or meta field."""
    out = b"\x86"
    for name, value in BASE.items():
        out += msgpack.packb(name)
        if name == field and entry_at is not None:
            out += b"\x91\x95" + b"".join(raw if i == entry_at else msgpack.packb(x) for i, x in enumerate(value[0]))
        elif name == field and meta_at is not None:
            out += bytes([0x80 | len(value)]) + b"".join(
                msgpack.packb(k) + (raw if k == meta_at else msgpack.packb(v)) for k, v in value.items())
        elif name == field:
            out += raw
        else:
            out += msgpack.packb(value)
    return out


PLACES = ([(f, {}) for f in BASE] + [("keys", {"entry_at": i}) for i in range(5)] +
          [("meta", {"meta_at": k}) for k in BASE["meta"]])


@pytest.mark.parametrize("levels", [900, 1000, 1023, 1024, 5000])
@pytest.mark.parametrize("as_map", [False, True])
def test_deep_nesting_anywhere_is_a_protocol_error(levels, as_map):
    for field, where in PLACES:
        with pytest.raises(ProtocolError) as info:
            protocol.decode(_with(field, _deep(levels, as_map), **where))
        assert len(str(info.value)) < 300, (field, where, str(info.value)[:100])


def test_a_six_million_entry_header_is_refused_before_it_is_parsed():
    keys = b"\xdd" + (6_000_000).to_bytes(4, "big") + b"\x95\x01\x00\x00\x91\x04\x00" * 6_000_000
    frame = _with("keys", keys)
    assert len(frame) > 40 << 20
    start = time.perf_counter()
    with pytest.raises(ProtocolError, match=f"at most {MAX_HEADER_BYTES}"):
        protocol.decode(frame)
    assert time.perf_counter() - start < 0.05
    # within the byte cap, the entry count is refused by msgpack as it reads the list's length
    small = _with("keys", b"\xdd" + (6_000_000).to_bytes(4, "big") + b"\x95\x01\x00\x00\x91\x04\x00" * 1000)
    start = time.perf_counter()
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        protocol.decode(small)
    assert time.perf_counter() - start < 0.05


def test_the_biggest_legal_header_decodes_and_one_more_entry_is_refused_by_either_side():
    keys = [Entry.bare(f"layer{i}.weight", 0, 0, (3, 3)) for i in range(MAX_ENTRIES)]
    frame = Header(Op.PULL, 1, "W0", keys).encode()
    assert len(protocol.decode(frame).keys) == MAX_ENTRIES
    with pytest.raises(ProtocolError, match="MAX_ENTRIES"):
        Header(Op.PULL, 1, "W0", keys + keys[:1]).encode()
    raw = msgpack.packb(dict(BASE, keys=[[i, 0, 0, [1], 0] for i in range(MAX_ENTRIES + 1)]))
    with pytest.raises(ProtocolError):
        protocol.decode(raw)
    with pytest.raises(ProtocolError, match="at most 64"):
        protocol.decode(msgpack.packb(dict(BASE, op=22, keys=[["k", 0, 0, [1] * 65, 0]], meta={})))


def test_request_id_of_a_bad_header_is_read_from_its_first_bytes_only():
    assert _request_id(_with("src", _deep(5000, False))) == 7
    assert _request_id(msgpack.packb({"v": 1, "op": 1, "id": 42}) + b"\xff" * (50 << 20)) == 42
    assert _request_id(b"\x81\xa2id\x91\x01") == 0           # an id that is not an int
    assert _request_id(b"\xc1") == 0


@pytest.mark.parametrize("name, parsed", [
    ("H", ("scheduler", None)), ("W0", ("worker", 0)), ("S12", ("server", 12)), ("W00", (None, None)),
    ("W01", (None, None)), ("W\u0660", (None, None)), ("W\u0661", (None, None)), ("W0\n", (None, None)),
    ("W-1", (None, None)), ("W+1", (None, None)), (" W1", (None, None)), ("w1", (None, None)),
    ("W", (None, None)), ("", (None, None)), ("W" + "9" * 30, (None, None)), (["W0"], (None, None))])
def test_only_canonical_node_names_parse(name, parsed):
    assert parse_name(name) == parsed


def test_escape_and_quote_keep_network_text_on_one_bounded_line():
    forged = "W0\n2099-01-01 kvps-server ERROR forged\r\x1b[31m\u2028"
    for text in (escape(forged), protocol.quote(forged), repr(Header(Op.PULL, 1, forged))):
        assert text.isprintable() and "\n" not in text, text
    assert len(escape("x" * 10_000)) <= 403
    assert escape("plain W0") == "plain W0"


def test_log_throttle_bounds_lines_and_reports_what_it_suppressed(caplog):
    now = [0.0]
    throttle = LogThrottle(lines=5, interval=10.0, clock=lambda: now[0])
    log = logging.getLogger("kvps.test.throttle")
    with caplog.at_level(logging.WARNING, logger="kvps.test.throttle"):
        written = sum(throttle(log, logging.WARNING, "bad %d", i) for i in range(1000))
        assert written == 5 and len(caplog.records) == 5
        now[0] = 10.5
        throttle(log, logging.WARNING, "bad again")
    assert "995 similar lines suppressed" in caplog.records[-1].getMessage()


class Unfinished:
    """A MessageTracker whose message zmq never lets go of (a peer that does not read)."""
    done = False

    def wait(self, timeout=None):
        raise AssertionError("the store waited for zmq on the I/O thread")


@pytest.mark.parametrize("mode, rule", [("async", False), ("async", True), ("sync", True)])
def test_store_never_waits_for_a_reply_in_flight_and_results_are_the_same(mode, rule):
    from kvps.ps.rules import Registry
    results = []
    for in_flight in (False, True):
        store = Store(1, mode)
        if rule:
            store.set_rule(Registry().create({"name": "sgd", "params": {"learning_rate": 0.1, "momentum": 0.9}}))
        store.init(0, "w", 0, np.float32, (1000,), np.linspace(-1, 1, 1000, dtype=np.float32), _ok)
        sent, at_send = [], []
        for step in range(3):
            store.pull(0, "w", 0, sent.append)
            at_send.append(sent[-1].copy())
            if in_flight:
                store.sent("w", 0, Unfinished())
            store.push(0, "w", 0, np.full(1000, step + 0.5, np.float32), _ok)
        final = []
        store.pull(0, "w", 0, final.append)
        results.append(final[0].copy())
        if in_flight:   # what zmq was sending was never changed under it
            assert all(np.array_equal(a, b) for a, b in zip(sent, at_send))
    assert np.array_equal(results[0], results[1])


def _ok(result):
    assert not isinstance(result, Exception), result


def test_row_ids_must_be_unique_for_a_pull():
    store = Store(1, "async")
    store.init(0, "e", 0, np.float32, (10, 2), np.zeros((10, 2), np.float32), _ok)
    slot = store.slot("e", 0)
    store.check_rows(slot, np.array([3, 3], np.int64))           # the local kvstore's own use
    with pytest.raises(KVValueError, match="sorted and unique"):
        store.check_rows(slot, np.array([3, 3], np.int64), unique=True)
    with pytest.raises(KVValueError, match="sorted and unique"):
        store.check_sparse(slot, np.array([2, 1], np.int64), np.zeros((2, 2), np.float32))


def _client(port):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


@pytest.mark.parametrize("error", [TypeError("unhashable type: 'list'"), RecursionError("maximum depth"),
                                   KeyError("k\nforged"), MemoryError()])
def test_a_handler_that_raises_gets_the_client_an_error_and_the_van_serves_on(error):
    calls = []

    def handler(source, header, payloads):
        calls.append(header.id)
        if header.id == 1:
            raise error
        van.reply(source[1], Header(Op.ACK, header.id, "T"))
    van = Van("T", handler)
    port = van.bind("127.0.0.1")
    van.start()
    sock = _client(port)
    try:
        sock.send(Header(Op.HEARTBEAT, 1, "W0").encode())
        reply = protocol.decode(sock.recv())
        assert reply.op == Op.ERROR and reply.id == 1 and "could not handle HEARTBEAT" in reply.meta["message"]
        assert "\n" not in reply.meta["message"]
        sock.send(Header(Op.HEARTBEAT, 2, "W0").encode())
        assert protocol.decode(sock.recv()).op == Op.ACK
    finally:
        sock.close(0)
        van.stop()
    assert calls == [1, 2]


class Fatal(BaseException):
    """What no handler catches: the I/O thread dies of it."""


def test_a_van_whose_thread_dies_tells_its_owner(escaped_io):
    died = threading.Event()
    seen = []
    van = Van("T", lambda source, header, payloads: (_ for _ in ()).throw(Fatal("boom")))
    van.when_dead(lambda exc: (seen.append(exc), died.set()))
    port = van.bind("127.0.0.1")
    van.start()
    sock = _client(port)
    try:
        sock.send(Header(Op.HEARTBEAT, 1, "W0").encode())
        assert died.wait(5), "the death hook was not called"
        assert isinstance(seen[0], Fatal)
    finally:
        sock.close(0)
        van.stop()


@pytest.fixture
def escaped_io():
    caught, old = [], threading.excepthook
    threading.excepthook = lambda args: caught.append(args.exc_value)
    yield caught
    threading.excepthook = old


def test_limit_messages_sets_maxmsgsize_on_the_vans_sockets():
    van = Van("T", lambda *a: None)
    van.limit_messages(1 << 20)
    van.bind("127.0.0.1")
    try:
        assert van._router.getsockopt(zmq.MAXMSGSIZE) == 1 << 20
    finally:
        van.stop()


def test_a_bundle_that_lies_about_its_frames_or_nests_gets_errors_and_the_van_serves_on():
    handled = []

    def handler(source, header, payloads):
        handled.append(header.id)
        van.reply(source[1], Header(Op.ACK, header.id, "T"))
    van = Van("T", handler)
    port = van.bind("127.0.0.1")
    van.start()
    sock = _client(port)
    ping = [Header(Op.HEARTBEAT, 7, "W0").encode()]
    try:
        lying = Header(Op.BUNDLE, 3, "W0", meta={"counts": [1, 2]}).encode()
        sock.send_multipart([lying, *ping])                 # counts say 3 frames; it carries 1
        reply = protocol.decode(sock.recv())
        assert reply.op == Op.ERROR and reply.id == 3 and "do not cut its 1 frames" in reply.meta["message"]
        nested = protocol.bundle("W0", [ping, protocol.bundle("W0", [ping])])
        sock.send_multipart(nested)                         # the good one is handled, the nested refused
        replies = [protocol.decode(sock.recv()) for _ in range(2)]
        assert [r.op for r in replies] == [Op.ACK, Op.ERROR] and "inside a BUNDLE" in replies[1].meta["message"]
        sock.send_multipart(ping)
        assert protocol.decode(sock.recv()).op == Op.ACK
    finally:
        sock.close(0)
        van.stop()
    assert handled == [7, 7]
