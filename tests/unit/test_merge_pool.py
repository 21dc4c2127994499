"""KVPS_SERVER_THREADS: big sync rounds merged on a pool (kvps/ps/pool.py) give the inline store's
results bit for bit, keep each key's rounds in order, hold pulls until the merge is in, and report
a failed merge to the round's workers. The I/O thread is played by the test: it runs what the pool
posts."""
import queue

import numpy as np
import pytest

import kvps
from kvps.ps.pool import MergePool
from kvps.ps.rules import Registry
from kvps.ps.store import POOL_BYTES, Store

N = POOL_BYTES // 4 + 10            # a float32 key just over the pool's threshold


class Loop:
    """The I/O thread: the pool posts its finished merges here; run() runs them."""

    def __init__(self):
        self.posted = queue.SimpleQueue()

    def post(self, fn):
        self.posted.put(fn)

    def run(self, timeout=10.0):
        self.posted.get(timeout=timeout)()


def _store(pool=True, rule=None):
    store = Store(2, "sync")
    loop = Loop()
    if pool:
        store.pool = MergePool(2, loop.post, "test")
    if rule:
        store.set_rule(Registry().create(kvps.optimizer.create(rule, learning_rate=0.1, momentum=0.9).spec()))
    store.init(0, "w", 0, np.float32, (N,), np.ones(N, np.float32), lambda r: None)
    return store, loop


def _pull(store, worker):
    got = []
    store.pull(worker, "w", 0, lambda v: got.append(v if isinstance(v, Exception) else v.copy()))
    return got


@pytest.mark.parametrize("rule", [None, "sgd"])
def test_pool_rounds_are_the_inline_rounds_bit_for_bit(rule):
    rng = np.random.default_rng(0)
    grads = [[rng.standard_normal(N).astype(np.float32) for _ in range(2)] for _ in range(4)]
    inline, _ = _store(pool=False, rule=rule)
    pooled, loop = _store(rule=rule)
    for step in grads:
        acks = []
        for w in (0, 1):
            inline.push(w, "w", 0, step[w], lambda r: None)
            pooled.push(w, "w", 0, step[w], acks.append)
        assert acks == [] and pooled.slots[("w", 0)].busy        # closed, being merged on the pool
        got = _pull(pooled, 0)
        assert got == []                                          # the pull waits for the merge
        loop.run()
        assert acks == [None, None] and not pooled.slots[("w", 0)].busy
        assert np.array_equal(got[0], _pull(inline, 0)[0])
    assert pooled.stats["rounds"] == inline.stats["rounds"] == 4
    assert pooled.stats["updates"] == inline.stats["updates"]


def test_the_next_rounds_pushes_keep_their_order_while_one_is_merged():
    store, loop = _store()
    for w in (0, 1):
        store.push(w, "w", 0, np.full(N, 1, np.float32), lambda r: None)       # round 1: being merged
    store.push(0, "w", 0, np.full(N, 10, np.float32), lambda r: None)          # round 2
    store.push(0, "w", 0, np.full(N, 100, np.float32), lambda r: None)         # round 3, held
    store.push(1, "w", 0, np.full(N, 20, np.float32), lambda r: None)          # round 2 full: waits
    assert store.stats["rounds"] == 0
    loop.run()                                                                  # round 1 in; round 2 goes
    assert store.stats["rounds"] == 1 and store.slots[("w", 0)].busy
    loop.run()
    assert store.stats["rounds"] == 2
    assert _pull(store, 1)[0][0] == 30.0                                        # 10 + 20, not 100 + 20
    store.push(1, "w", 0, np.full(N, 200, np.float32), lambda r: None)
    loop.run()
    assert _pull(store, 0)[0][0] == 300.0


def test_a_failed_merge_reaches_the_rounds_workers():
    store, loop = _store()
    store.set_rule(Registry().create(kvps.optimizer.create("sgd", learning_rate=0.1).spec()))
    store.rule = _Broken()
    acks = []
    for w in (0, 1):
        store.push(w, "w", 0, np.ones(N, np.float32), acks.append)
    pulled = _pull(store, 0)
    loop.run()
    assert [type(a) for a in acks] == [RuntimeError, RuntimeError] and type(pulled[0]) is RuntimeError


class _Broken:
    def __call__(self, slot_id, weight, grad):
        raise RuntimeError("this rule always fails")


def test_export_waits_for_the_merge_under_way():
    store, loop = _store()
    for w in (0, 1):
        store.push(w, "w", 0, np.full(N, 2, np.float32), lambda r: None)
    (record,) = store.export()                   # drains the pool first
    assert record["value"][0] == 4.0 and record["version"] == 1
    assert not store.slots[("w", 0)].busy
    loop.run()                                   # the posted finish is a no-op now
    assert store.stats["rounds"] == 1


def test_small_keys_stay_inline():
    store, _ = _store()
    store.init(0, "b", 0, np.float32, (8,), np.zeros(8, np.float32), lambda r: None)
    for w in (0, 1):
        store.push(w, "b", 0, np.ones(8, np.float32), lambda r: None)
    assert store.stats["rounds"] == 1 and not store.slots[("b", 0)].busy
