"""Values that replies still read (server/reads.py, kvps/ps/store.py), in one process: an update of
a value that a reply holds goes to other memory, the held memory keeps the value the reply was given
until the hold ends and is reused only then, results are the bits of the update in place, a key
whose every block is held moves to private memory and back, and a worker's list of read replies is
checked. The real thing, with workers racing pushes against pulls: tests/cluster/test_shm.py."""
import numpy as np
import pytest

import kvps
from kvps.errors import ProtocolError
from kvps.kvstore.pull_ahead import PullAhead, Stash
from kvps.ps.rules import Registry
from kvps.ps.store import Store
from kvps.wire.shm import MIN_BYTES, Values
from server.reads import Hold, Reads

N = MIN_BYTES // 4 * 2                      # float32 elements: big enough for a value segment


class Sent:
    """A zmq tracker stand-in."""
    def __init__(self, done=False):
        self.done = done


def _store(mode, blocks=3, rule=None, dtype=np.float32):
    store = Store(2, mode)
    values = Values(segment_bytes=1 << 20, blocks=blocks)
    store.alloc = lambda slot: values.alloc(slot.id, slot.dtype, slot.shape)
    store.shared = lambda array: values.locate(array) is not None
    if rule:
        store.set_rule(Registry().create(kvps.optimizer.create(rule, learning_rate=0.1, momentum=0.9).spec()))
    store.init(0, "w", 0, dtype, (N,), np.linspace(-1, 1, N).astype(dtype), _ok)
    return store, values


def _ok(result):
    assert not isinstance(result, Exception), result


def _pull(store, worker, hold=None):
    """The array a pull is given (not a copy), held by `hold` as a reply would hold it."""
    got = []
    store.pull(worker, "w", 0, got.append)
    (array,) = got
    if hold is not None:
        store.reading("w", 0, array, hold)
    return array


def _grads(count, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(N).astype(dtype) for _ in range(count)]


@pytest.mark.parametrize("rule", [None, "sgd"])
def test_an_async_update_of_a_held_value_goes_elsewhere_and_the_held_memory_waits(rule):
    store, values = _store("async", rule=rule)
    hold = Hold()
    held = _pull(store, 1, hold)
    before = held.copy()
    store.push(0, "w", 0, np.ones(N, np.float32), _ok)
    value = store.slot("w", 0).value
    assert value is not held and np.array_equal(held, before)        # the reader's value did not change
    assert values.locate(value) is not None and store.stats["moved"] == 1
    hold.done = True                        # the worker copied it: the block may be reused
    hold2 = Hold()
    _pull(store, 1, hold2)
    store.push(0, "w", 0, np.ones(N, np.float32), _ok)
    assert store.slot("w", 0).value is held                           # the freed block took the update
    assert store.stats["moved"] == 2


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("rule", [None, "sgd"])
def test_updates_that_moved_give_the_bits_of_updates_in_place(dtype, rule):
    grads = _grads(12, dtype)
    plain, _ = _store("async", rule=rule, dtype=dtype)
    held, _ = _store("async", rule=rule, dtype=dtype)
    holds = []
    for i, g in enumerate(grads):
        plain.push(i % 2, "w", 0, g, _ok)
        if i % 3 != 2:                           # most updates find the value held by a reply
            holds.append(Hold())
            _pull(held, 1, holds[-1])
        if i % 4 == 3:                           # and some readers finish
            for h in holds[:-1]:
                h.done = True
        held.push(i % 2, "w", 0, g, _ok)
    assert held.stats["moved"] > 0
    assert plain.slot("w", 0).value.tobytes() == held.slot("w", 0).value.tobytes()


def test_a_key_whose_blocks_are_all_held_goes_to_private_memory_and_comes_back():
    store, values = _store("async", blocks=2)
    holds = []
    for _ in range(3):                           # two blocks, both held, then private memory
        holds.append(Hold())
        _pull(store, 1, holds[-1])
        store.push(0, "w", 0, np.ones(N, np.float32), _ok)
    assert values.locate(store.slot("w", 0).value) is None
    for h in holds:
        h.done = True
    store.push(0, "w", 0, np.ones(N, np.float32), _ok)
    assert values.locate(store.slot("w", 0).value) is not None        # back where workers can read it
    expected = np.linspace(-1, 1, N).astype(np.float32)
    for _ in range(4):
        expected += np.float32(1)
    assert np.array_equal(store.slot("w", 0).value, expected)


def test_a_sync_round_never_sums_into_a_held_value():
    store, values = _store("sync", blocks=2)
    for step in range(3):
        hold = Hold()
        store.push(0, "w", 0, np.full(N, 1.0, np.float32), _ok)
        store.push(1, "w", 0, np.full(N, 2.0, np.float32), _ok)
        held = _pull(store, 0, hold)
        before = held.copy()
        store.push(0, "w", 0, np.full(N, 10.0, np.float32), _ok)     # the next round closes
        store.push(1, "w", 0, np.full(N, 20.0, np.float32), _ok)
        assert np.array_equal(held, before) and np.all(store.slot("w", 0).value == 30.0)
        hold.done = True
    assert store.stats["moved"] == 3


def test_a_zmq_send_from_a_retired_block_keeps_it_from_reuse():
    store, _ = _store("async")
    hold = Hold()
    held = _pull(store, 1, hold)
    store.push(0, "w", 0, np.ones(N, np.float32), _ok)                # held: the value moved
    tracker = Sent()
    store.reading("w", 0, held, tracker)         # the reply went over TCP, zmq sends from the old block
    hold.done = True
    for _ in range(3):
        h = Hold()
        _pull(store, 1, h)
        store.push(0, "w", 0, np.ones(N, np.float32), _ok)
        assert store.slot("w", 0).value is not held                   # zmq still reads it
    tracker.done = True
    h = Hold()
    _pull(store, 1, h)
    store.push(0, "w", 0, np.ones(N, np.float32), _ok)
    assert any(block is held for block, _ in store.slot("w", 0).retired) or store.slot("w", 0).value is held


def test_a_worker_says_which_replies_it_has_read():
    reads = Reads("W1")
    holds = [Hold() for _ in range(3)]
    numbers = [reads.issue(h) for h in holds]
    assert numbers == [1, 2, 3] and not any(h.done for h in holds)
    reads.done([2])
    assert [h.done for h in holds] == [False, True, False]
    reads.done([2])                              # a request sent again: nothing changes
    with pytest.raises(ProtocolError, match="W1 says it has read reply 7; it was given replies 1 .. 3"):
        reads.done([7])
    with pytest.raises(ProtocolError, match="W1 says it has read reply 0"):
        reads.done([0])
    with pytest.raises(ProtocolError, match="at most 4096"):
        reads.done(list(range(1, 5000)))
    reads.release_all()                          # it left
    assert all(h.done for h in holds)
    hold = Hold()
    assert not hold.done                         # a new hold keeps its values until released
    reads.done([reads.issue(hold)])
    assert hold.done


def test_a_stash_releases_its_replies_once_every_key_has_left():
    released = []
    stash = Stash(["a", "b"], released.append)
    stash.keep("reply 1", [])
    stash.left(["a"])
    assert released == []
    stash.left(["b", "c"])
    assert released == ["reply 1"]
    stash.keep("reply 2", [])                    # came after: released at once
    stash.left(["a"])
    assert released == ["reply 1", "reply 2"]


def test_pull_ahead_releases_the_stashes_it_drops():
    released = []
    ahead = PullAhead()
    first = Stash(["k"], released.append)
    first.keep("r1", [])
    ahead.pushed(["k"], first)
    second = Stash(["k"], released.append)
    ahead.pushed(["k"], second)                  # pushed again without a pull: the first is dropped
    assert released == ["r1"]
    second.keep("r2", [])
    ahead.reset()
    assert released == ["r1", "r2"]
