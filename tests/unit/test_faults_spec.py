"""The fault injector's spec, its seeded draws, the resend table and the server's request window:
pure units, no sockets (the cluster tests in tests/cluster/test_resend.py run them on real jobs)."""
import pytest

from kvps.config import Config
from kvps.errors import ConfigError
from kvps.wire.faults import Faults
from kvps.wire.protocol import Header, Op
from kvps.wire.requests import MAX_RESEND_INTERVAL, Handle, Requests
from kvps.wire.window import BUSY, NEW, OLD, RECOMPUTE, Window


def test_spec_parses_every_kind():
    f = Faults.parse("drop:0.01,dup:0.02,delay:5ms", seed=3)
    assert (f.drop, f.dup, f.delay) == (0.01, 0.02, 0.005)
    assert Faults.parse(" delay:200us ").delay == pytest.approx(2e-4)
    assert Faults.parse("delay:0.1s").delay == pytest.approx(0.1)
    assert str(f) == "drop:0.01,dup:0.02,delay:5ms"


@pytest.mark.parametrize("spec, says", [
    ("drop", "'drop' is not drop:P, dup:P or delay:T"),
    ("lose:0.1", "'lose:0.1' is not drop:P"),
    ("drop:1", "drop:1 needs a probability in [0, 1)"),
    ("drop:-0.1", "needs a probability"),
    ("dup:x", "dup:x needs a probability"),
    ("delay:5", "delay:5 needs a time such as 5ms"),
    ("delay:11s", "over 10 s"),
    ("drop:0.1,drop:0.2", "gives drop twice"),
])
def test_bad_specs_name_the_item(spec, says):
    with pytest.raises(ConfigError, match="KVPS_FAULTS=") as info:
        Faults.parse(spec)
    assert says in str(info.value)


def test_draws_are_seeded_per_node_and_spare_the_control_plane():
    def run(seed, rank):
        f = Faults.parse("drop:0.2,dup:0.2,delay:1ms", seed=seed, node="worker", rank=rank)
        return [f.decide(Op.PUSH) for _ in range(200)], f.counts
    assert run(1, 0) == run(1, 0)
    assert run(1, 0) != run(2, 0) and run(1, 0) != run(1, 1)
    draws, counts = run(1, 0)
    assert {c for c, _ in draws} == {0, 1, 2} and all(0 <= d <= 1e-3 for _, d in draws)
    assert counts["dropped"] == sum(c == 0 for c, _ in draws)
    f = Faults.parse("drop:0.99")
    assert all(f.decide(op) == (1, 0.0) for op in (Op.HEARTBEAT, Op.REGISTER, Op.BARRIER, Op.RING, Op.WORKERS))


def test_resend_is_off_unless_asked_for():
    assert Config().resend_after == 0
    assert Config(faults="drop:0.1").resend_after == 0.5
    assert Config(resend_timeout=2.0).resend_after == 2.0
    with pytest.raises(ConfigError, match="KVPS_ELASTIC=2"):
        Config.from_env({"KVPS_ELASTIC": "2"})


def test_requests_offer_overdue_messages_with_backoff():
    requests = Requests(resend_after=1.0)
    handle = Handle("push", 10)
    header = Header(Op.PUSH)
    rid = requests.add(handle, "S0", message=(header, ["payload"]))
    control = requests.add(handle, "H")                     # no message: never resent
    handle._arm()
    now = __import__("time").monotonic()
    assert requests.overdue(now) == []
    assert requests.overdue(now + 1.1) == [("S0", header, ["payload"])]
    assert requests.overdue(now + 2.0) == []                # the next wait is 2 s
    assert requests.overdue(now + 3.2) == [("S0", header, ["payload"])]
    assert requests.overdue(now + 1000) and requests.resent == 3
    header.id = rid
    assert requests.answer(Header(Op.ACK, rid), [])
    assert not requests.answer(Header(Op.ACK, rid), [])     # a duplicated reply is ignored
    assert requests.overdue(now + 10_000) == [] and MAX_RESEND_INTERVAL == 10.0
    requests.answer(Header(Op.ACK, control), [])
    assert handle.wait(0).succeeded()
    assert Requests().add(Handle("x", 1), "S0", message=(header, [])) and not Requests().overdue(1e18)


def test_window_answers_each_id_once():
    w = Window(size=4)
    client = ("W0", b"\x00a")
    assert w.admit(client, 1) is NEW
    assert w.admit(client, 1) is BUSY                       # in progress: the reply is coming
    ack = Header(Op.ACK, 1)
    w.answered(client, 1, ack)
    assert w.admit(client, 1) is ack                        # a push: its reply again, never re-applied
    assert w.admit(client, 2) is NEW
    w.answered(client, 2, RECOMPUTE)
    assert w.admit(client, 2) is RECOMPUTE                  # a pull: computed again ...
    assert w.admit(client, 2) is BUSY                       # ... once
    for i in range(3, 9):
        assert w.admit(client, i) is NEW
    assert w.admit(client, 1) is OLD and w.admit(client, 4) is OLD     # evicted: below the floor
    assert w.admit(("W0", b"\x00b"), 1) is NEW              # another connection (a replacement) is new
    assert w.admit(client, 0) is NEW and w.admit(client, 0) is NEW     # id 0 is never remembered
    w.forget("W0")
    assert w.admit(client, 1) is NEW
    assert w.duplicates == 6


def test_window_bounds_its_clients():
    w = Window(size=2, max_clients=3)
    for i in range(10):
        w.admit((f"W{i}", b""), 1)
    assert len(w._clients) == 3


def test_the_transport_drops_repeats_and_delays_only_data_messages():
    """Two Vans over 127.0.0.1: a client whose faults drop, repeat and delay its PULLs (in order);
    its heartbeats pass untouched, and a server's faulted replies too."""
    import threading
    import time

    from kvps.wire.transport import Van

    got, replies, lock = [], [], threading.Lock()

    def on_server(source, header, payloads):
        with lock:
            got.append((header.op, header.id))
        if header.op == Op.PULL:
            server.reply(source[1], Header(Op.ACK, header.id, "S0"))

    def on_client(source, header, payloads):
        with lock:
            replies.append(header.id)
    server = Van("S0", on_server)
    port = server.bind("127.0.0.1")
    server.inject(Faults.parse("dup:0.5", seed=2, node="server"))
    client = Van("W0", on_client)
    client.inject(Faults.parse("drop:0.3,dup:0.3,delay:2ms", seed=1, node="worker"))
    server.start()
    client.start()
    try:
        client.connect("S0", "127.0.0.1", port)
        for i in range(1, 201):
            client.send("S0", Header(Op.PULL, i, "W0"))
            client.send("S0", Header(Op.HEARTBEAT, 0, "W0"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with lock:
                if sum(op == Op.HEARTBEAT for op, _ in got) == 200 and len(replies) >= \
                        sum(op == Op.PULL for op, _ in got):
                    break
            time.sleep(0.02)
    finally:
        client.stop()
        server.stop()
    counts = client.faults.counts
    pulls = [i for op, i in got if op == Op.PULL]
    assert sum(op == Op.HEARTBEAT for op, _ in got) == 200             # the control plane is never faulted
    assert len(pulls) == 200 - counts["dropped"] + counts["duplicated"]
    assert counts["dropped"] and counts["duplicated"] and counts["delayed"]
    assert len(set(pulls)) == 200 - counts["dropped"]
    assert pulls == sorted(pulls)           # delayed, never reordered: a repeat goes just before its original
    assert len(replies) == len(pulls) + server.faults.counts["duplicated"] and server.faults.counts["duplicated"]
