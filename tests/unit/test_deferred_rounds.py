"""Deferred copies without sockets (KVPS_REPLICAS=1 in sync mode; kvps/ps/store.py, server/replication.py):
the head sends each round's sum once, and a replica's round whose pushes came without values waits for
that sum, or, when the head died first, for the workers' values; either way it ends with the head's
bits, and the next round keeps its order behind it."""
import numpy as np
import pytest

import kvps
from kvps.errors import ProtocolError
from kvps.ps.rules import Registry
from kvps.ps.store import Deferred, Store

pytestmark = pytest.mark.unit

N = 5000


class Sums:
    """A head's on_round: the round sums it would send, copied, and trackers it holds the buffers by."""

    def __init__(self, store):
        self.sent, self.trackers, self.store = [], [], store
        self.at_once = False

    def __call__(self, slot, total):
        self.sent.append((slot.version, total.copy()))
        tracker = Tracker()
        tracker.done = self.at_once
        self.store.forwarding(slot, tracker)
        self.trackers.append(tracker)


class Tracker:
    def __init__(self):
        self.done = False


def _store(rule=None, deferring=False):
    store = Store(2, "sync")
    store.deferring = deferring
    if rule:
        params = {"momentum": 0.9} if rule == "sgd" else {}
        store.set_rule(Registry().create(kvps.optimizer.create(rule, learning_rate=0.1, **params).spec()))
    store.init(0, "w", 0, np.float32, (N,), np.linspace(-1, 1, N, dtype=np.float32), lambda r: None)
    return store


def _pull(store, worker):
    got = []
    store.pull(worker, "w", 0, lambda v: got.append(v if isinstance(v, Exception) else v.copy()))
    return got


def _grads(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(N).astype(np.float32) for _ in range(2)] for _ in range(steps)]


@pytest.mark.parametrize("rule", [None, "sgd", "adam"])
def test_a_replica_applies_the_heads_sums_bit_for_bit(rule):
    head, replica = _store(rule), _store(rule, deferring=True)
    head.on_round = sums = Sums(head)
    for step in _grads(4):
        acks = []
        for w in (0, 1):
            head.push(w, "w", 0, step[w], lambda r: None)
            replica.push(w, "w", 0, Deferred(), acks.append)
        slot = replica.slots[("w", 0)]
        assert acks == [] and slot.busy and slot.awaiting is not None      # complete, waiting for its sum
        got = _pull(replica, 0)
        assert got == []                                                     # its pulls wait too
        version, total = sums.sent[-1]
        replica.round_sum("w", 0, version, total)
        assert acks == [None, None] and not slot.busy
        assert np.array_equal(got[0], _pull(head, 0)[0])
    assert [v for v, _ in sums.sent] == [1, 2, 3, 4]
    assert replica.stats["rounds"] == head.stats["rounds"] == 4
    assert replica.slots[("w", 0)].pushes == head.slots[("w", 0)].pushes == {0: 4, 1: 4}


def test_the_workers_values_sent_again_close_a_round_as_the_head_did():
    """The head died before its sum came: the workers ask the replica again, and their values fill
    the places their copies hold, in the head's order."""
    head, replica = _store("sgd"), _store("sgd", deferring=True)
    for step in _grads(3, seed=1):
        places, acks = [], []
        for w in (0, 1):
            head.push(w, "w", 0, step[w], lambda r: None)
            places.append(Deferred())
            replica.push(w, "w", 0, places[-1], acks.append)
        replica.fill("w", 0, places[1], step[1])
        assert acks == []                                   # one value still missing
        replica.fill("w", 0, places[0], step[0])
        assert acks == [None, None]
        assert np.array_equal(_pull(replica, 0)[0], _pull(head, 0)[0])


def test_a_sum_that_comes_after_the_round_closed_from_the_values_changes_nothing():
    replica = _store(deferring=True)
    places = [Deferred(), Deferred()]
    for w in (0, 1):
        replica.push(w, "w", 0, places[w], lambda r: None)
    ones = np.ones(N, np.float32)
    for place in places:
        replica.fill("w", 0, place, ones)
    replica.round_sum("w", 0, 1, np.full(N, 7.0, np.float32))      # late: round 1 is closed here
    assert np.array_equal(_pull(replica, 0)[0], 2 * ones)
    with pytest.raises(ProtocolError, match="round 2 of key 'w' came, but no round waits"):
        replica.round_sum("w", 0, 2, ones)
    with pytest.raises(ValueError, match="initialised as float32"):
        replica.round_sum("w", 0, 2, np.ones(N, np.float64))


def test_a_sum_for_another_round_is_refused_and_changes_nothing():
    replica = _store(deferring=True)
    for w in (0, 1):
        replica.push(w, "w", 0, Deferred(), lambda r: None)
    with pytest.raises(ProtocolError, match="round 3 of key 'w' came, but round 1 waits"):
        replica.round_sum("w", 0, 3, np.ones(N, np.float32))
    assert replica.slots[("w", 0)].awaiting is not None and replica.slots[("w", 0)].version == 0


def test_the_next_round_waits_behind_one_that_waits_for_its_sum():
    replica = _store(deferring=True)
    acks = []
    for w in (0, 1):
        replica.push(w, "w", 0, Deferred(), lambda r, w=w: acks.append((1, w)))
    twos = np.full(N, 2.0, np.float32)
    for w in (0, 1):                            # round 2, complete before round 1 has its sum
        replica.push(w, "w", 0, twos, lambda r, w=w: acks.append((2, w)))
    slot = replica.slots[("w", 0)]
    assert acks == [] and slot.version == 0 and len(slot.pending) == 2
    replica.round_sum("w", 0, 1, np.ones(N, np.float32))
    assert acks == [(1, 0), (1, 1), (2, 0), (2, 1)] and slot.version == 2
    assert np.array_equal(_pull(replica, 0)[0], 2 * twos)


def test_a_checkpoint_or_handover_of_a_waiting_round_counts_its_pushes_out():
    replica = _store(deferring=True)
    for w in (0, 1):
        replica.push(w, "w", 0, Deferred(), lambda r: None)
    [record] = replica.export()
    assert record["version"] == 0 and record["pushes"] == [(0, 0), (1, 0)]
    [(record, waiting)] = replica.handover([("w", 0)])
    assert [(w, type(a)) for w, a in waiting] == [(0, Deferred), (1, Deferred)]


@pytest.mark.parametrize("rule", [None, "sgd"])
def test_a_head_keeps_a_sum_being_sent_until_zmq_let_go(rule):
    """The sum goes out without a copy: no later round may write into its buffer until the send's
    tracker is done; after that the buffer is reused again."""
    head = _store(rule)
    head.on_round = sums = Sums(head)
    buffers = []
    head.on_round = lambda slot, total: (buffers.append((total, total.copy())), sums(slot, total))
    for step in _grads(4, seed=2):
        for w in (0, 1):
            head.push(w, "w", 0, step[w], lambda r: None)
    assert len(buffers) == 4 and all(not t.done for t in sums.trackers)
    assert len({id(b) for b, _ in buffers}) == 4                # each round summed into fresh memory
    assert all(np.array_equal(b, copy) for b, copy in buffers)  # none was overwritten
    for t in sums.trackers:
        t.done = True
    sums.at_once = True                                         # later sends let go at once
    for step in _grads(2, seed=3):
        for w in (0, 1):
            head.push(w, "w", 0, step[w], lambda r: None)
    assert any(buffers[5][0] is b for b, _ in buffers[:5])     # a buffer let go is summed into again


def _lent(array):
    """A read-only view, as a replica maps a head's value segments."""
    view = array.view()
    view.flags.writeable = False
    return view


def test_without_a_rule_a_replica_adopts_the_heads_sum_and_never_writes_it():
    """The sum becomes the replica's value as it is (no copy); the next sum replaces it, and when
    the replica has to compute a round itself (its head died) or update in place (a rule set
    later), it does so in memory of its own."""
    replica = _store(deferring=True)
    sums = [np.full(N, float(v), np.float32) for v in (1, 2)]
    for version, total in enumerate(sums, 1):
        for w in (0, 1):
            replica.push(w, "w", 0, Deferred(), lambda r: None)
        assert replica.round_sum("w", 0, version, _lent(total), adopt=True)
        slot = replica.slots[("w", 0)]
        assert np.shares_memory(slot.value, total)
        # the value it replaced is the next sum buffer if it was its own, never if it was lent
        assert (slot.merge is None) == (version > 1)
    # the head died: the workers' values close round 3 here, in memory of its own
    places = [Deferred(), Deferred()]
    for w in (0, 1):
        replica.push(w, "w", 0, places[w], lambda r: None)
    for place in places:
        replica.fill("w", 0, place, np.ones(N, np.float32))
    assert slot.value.flags.writeable and not any(np.shares_memory(slot.value, s) for s in sums)
    assert np.array_equal(_pull(replica, 0)[0], np.full(N, 2.0, np.float32))
    assert np.array_equal(sums[1], np.full(N, 2.0, np.float32))       # the lent memory is untouched


def test_a_rule_set_after_an_adopted_sum_updates_a_copy():
    replica = _store(deferring=True)
    total = np.full(N, 3.0, np.float32)
    for w in (0, 1):
        replica.push(w, "w", 0, Deferred(), lambda r: None)
    replica.round_sum("w", 0, 1, _lent(total), adopt=True)
    replica.set_rule(Registry().create(kvps.optimizer.create("sgd", learning_rate=0.5).spec()))
    replica.deferring = False
    for w in (0, 1):
        replica.push(w, "w", 0, np.ones(N, np.float32), lambda r: None)
    assert np.array_equal(_pull(replica, 0)[0], np.full(N, 2.0, np.float32))   # 3 - 0.5 * (1 + 1)
    assert np.array_equal(total, np.full(N, 3.0, np.float32))


def test_with_a_rule_a_replica_applies_the_sum_and_adopts_nothing():
    replica = _store("sgd", deferring=True)
    for w in (0, 1):
        replica.push(w, "w", 0, Deferred(), lambda r: None)
    total = np.ones(N, np.float32)
    assert not replica.round_sum("w", 0, 1, _lent(total), adopt=True)
    assert not np.shares_memory(replica.slots[("w", 0)].value, total)
