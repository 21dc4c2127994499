"""Chain replication without sockets: which servers hold a range (kvps/wire/chains.py), and a
slot handed over in the middle of a sync round (Store.handover, Store.adopt) going on exactly as
the original."""
import numpy as np
import pytest

from kvps.optimizer import SGD
from kvps.ps.rules import Registry
from kvps.ps.store import Rows, Store
from kvps.wire import chains

pytestmark = pytest.mark.unit


def test_chains_close_up_and_a_newcomer_joins_the_tail():
    assert chains.chain(1, 3, 1) == [1, 2]
    assert chains.chain(2, 3, 1) == [2, 0]                     # the ring of servers wraps
    assert chains.chain(1, 3, 1, dead={1}) == [2] and chains.head(1, 3, 1, {1}) == 2
    assert chains.chain(1, 3, 1, joined=[1]) == [2, 1]         # S1 came back: behind the one that kept it
    assert chains.chain(0, 3, 1, joined=[1]) == [0, 1]
    assert chains.head(1, 3, 1, joined=[1]) == 2
    assert chains.successor(1, 2, 3, 1, joined=[1]) == 1 and chains.successor(1, 1, 3, 1, joined=[1]) is None
    assert chains.chain(1, 4, 2, joined=[2, 1]) == [3, 2, 1]   # in the order they joined
    assert chains.lost(3, 1, {1, 2}) == [1] and chains.lost(3, 1, {1}) == []
    assert chains.head(1, 3, 1, {1, 2}) is None
    assert chains.homes_of(1, 3, 1) == [1, 0]


def _store(registry):
    store = Store(3, "sync")
    store.init(0, "w", 0, np.dtype(np.float32), (4,), np.full(4, 1.0, np.float32), lambda e: None)
    store.init(0, "e", 0, np.dtype(np.float32), (6, 2), np.zeros((6, 2), np.float32), lambda e: None)
    store.set_rule(registry.create(SGD(learning_rate=0.1, momentum=0.9, rescale_grad=1.0).spec()))
    return store


def test_a_slot_handed_over_mid_round_goes_on_bit_for_bit():
    registry = Registry()
    a = _store(registry)
    for step in range(3):
        for worker in range(3):
            a.push(worker, "w", 0, np.full(4, (worker + 1) * 0.37 + step, np.float32), lambda e: None)
    a.push(0, "w", 0, np.full(4, 0.11, np.float32), lambda e: None)        # the open round
    a.push(2, "e", 0, np.full((2, 2), 0.5, np.float32), lambda e: None, rows=np.array([1, 4], np.int64))

    b = Store(3, "sync")
    b.set_rule(registry.create(SGD(learning_rate=0.1, momentum=0.9, rescale_grad=1.0).spec()))
    handed = a.handover([("w", 0), ("e", 0)])
    states = {(r["key"], r["part"]): r["opt"] for r, _ in handed if r["opt"] is not None}
    b.restore_optimizer(states, ("a handover", "sgd"))
    for record, waiting in handed:
        assert [w for w, _ in waiting] == ([0] if record["key"] == "w" else [2])
        assert isinstance(waiting[0][1], Rows) == (record["key"] == "e")
        b.adopt(record["key"], record["part"], record["value"], record, waiting)

    acks = []
    for store in (a, b):
        for worker in (1, 2):
            store.push(worker, "w", 0, np.full(4, 0.2 * worker, np.float32), acks.append)
        for worker in (0, 1):
            store.push(worker, "e", 0, np.full((1, 2), 0.25, np.float32), acks.append, rows=np.array([4], np.int64))
    assert acks == [None] * 8
    for key in ("w", "e"):
        slot_a, slot_b = a.slot(key, 0), b.slot(key, 0)
        assert slot_a.value.tobytes() == slot_b.value.tobytes() and slot_a.version == slot_b.version
        assert slot_a.pushes == slot_b.pushes and not slot_b.pending
    assert a.rule.export(("w", 0))[2][0].tobytes() == b.rule.export(("w", 0))[2][0].tobytes()   # momentum
