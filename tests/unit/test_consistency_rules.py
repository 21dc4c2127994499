"""Consistency modes without sockets: parsing and the wire form of dist_ssp and backup-worker
options, and the store's rules run on scripted schedules (staleness bounds, early round close,
the staleness histogram)."""

import math

import numpy as np
import pytest

import kvps
from kvps.ps.consistency import Consistency, total_staleness
from kvps.errors import NodeFailure, ProtocolError
from kvps.optimizer import SGD
from kvps.ps.store import Store
from kvps.ps.rules import Registry


class Log:
    """Callbacks that record (name, result) in call order."""

    def __init__(self):
        self.events = []

    def cb(self, name):
        return lambda result: self.events.append((name, result))

    def names(self):
        return [n for n, _ in self.events]

    def result(self, name):
        return next(r for n, r in self.events if n == name)


def _store(mode, workers, value, optimizer=None):
    store, log = Store(workers, mode), Log()
    store.init(0, "w", 0, value.dtype, value.shape, value, log.cb("init"))
    if optimizer is not None:
        store.set_rule(Registry().create(optimizer.spec()))
    return store, log


@pytest.mark.parametrize("mode,suffix,options,wire", [
    ("ssp", "4", {}, "ssp:4"),
    ("ssp", "0", {}, "ssp:0"),
    ("ssp", "inf", {}, "ssp:inf"),
    ("ssp", "", {"staleness": 4}, "ssp:4"),
    ("ssp", "", {"staleness": math.inf}, "ssp:inf"),
    ("ssp", "", {"staleness": "inf"}, "ssp:inf"),
    ("ssp", "3", {"staleness": np.int64(3)}, "ssp:3"),
    ("sync", "", {}, "sync"),
    ("sync", "backup=1", {}, "sync:backup=1"),
    ("sync", "", {"backup_workers": 2}, "sync:backup=2"),
    ("sync", "", {"backup_workers": 0}, "sync"),
    ("async", "", {}, "async"),
    ("geo", "4", {}, "geo:4"),
    ("geo", "", {"k_steps": 1}, "geo:1"),
])
def test_parse_and_wire_round_trip(mode, suffix, options, wire):
    c = Consistency.parse(mode, suffix, **options)
    assert c.wire() == wire and Consistency.from_wire(wire) == c


@pytest.mark.parametrize("name,options,message", [
    ("dist_ssp", {}, r"'dist_ssp' needs a staleness bound: kvps.create\('dist_ssp:4'\) or .*staleness=4"),
    ("dist_ssp:-1", {}, r"staleness '-1' in kvstore type 'dist_ssp:-1' must be an int >= 0"),
    ("dist_ssp:x", {}, r"staleness 'x'"),
    ("dist_ssp", {"staleness": -1}, r"staleness=-1 must be an int >= 0"),
    ("dist_ssp", {"staleness": 1.5}, r"staleness=1.5 must be an int"),
    ("dist_ssp", {"staleness": True}, r"staleness=True"),
    ("dist_ssp:4", {"staleness": 3}, r"says staleness 4, but staleness=3"),
    ("dist_ssp:4", {"backup_workers": 1}, r"backup_workers=1 applies to dist_sync"),
    ("dist_sync:backup=-1", {}, r"'backup=-1' is not 'backup=B'"),
    ("dist_sync", {"backup_workers": -1}, r"backup_workers=-1 must be an int >= 0"),
    ("dist_sync:backup=1", {"backup_workers": 2}, r"says backup=1, but backup_workers=2"),
    ("dist_sync", {"staleness": 2}, r"staleness=2 applies to dist_ssp, not 'dist_sync'"),
    ("dist_async", {"backup_workers": 1}, r"backup_workers=1 applies to dist_sync, not 'dist_async'"),
    ("dist_async:3", {}, r"async takes no ':' options"),
    ("local", {"staleness": 1}, r"staleness=1 applies to dist_ssp, dist_sync and dist_geo kvstores, not 'local'"),
    ("local:3", {}, r"unknown kvstore type 'local:3'"),
    ("dist_geo", {}, r"'dist_geo' needs the steps between syncs: kvps.create\('dist_geo:4'\)"),
    ("dist_geo:0", {}, r"k_steps=0 must be an int >= 1"),
    ("dist_geo:x", {}, r"k_steps 'x' in kvstore type 'dist_geo:x' must be an int >= 1"),
    ("dist_geo:4", {"k_steps": 2}, r"says k_steps 4, but k_steps=2"),
    ("dist_sync", {"k_steps": 2}, r"k_steps=2 applies to dist_geo, not 'dist_sync'"),
    ("dist_magic", {}, r"unknown kvstore type 'dist_magic'; valid types: local, .*dist_ssp:S"),
])
def test_create_refuses_bad_consistency(name, options, message):
    # every one fails before any connection is tried
    with pytest.raises(ValueError, match=message):
        kvps.create(name, **options)


@pytest.mark.parametrize("wire", ["ssp", "ssp:-1", "ssp:04", "ssp:inf ", "sync:backup=0", "sync:backup=x",
                                  "async:1", "bogus", "", 5, None, "allreduce"])
def test_bad_wire_strings_are_protocol_errors(wire):
    with pytest.raises(ProtocolError, match=repr(wire).replace("(", r"\(")):
        Consistency.from_wire(wire)


def test_backups_must_be_fewer_than_workers():
    with pytest.raises(ValueError, match="sync:backup=3 asks for 3 backup workers, but the job has 3 workers"):
        Store(3, "sync:backup=3")
    Store(3, "sync:backup=2")


def test_local_kvstore_still_works():
    kv = kvps.create("local")
    kv.init("a", np.ones(3, np.float32))
    out = np.zeros(3, np.float32)
    kv.pushpull("a", np.full(3, 2, np.float32), out=out)
    assert out.tolist() == [2, 2, 2]


def test_total_staleness_sums_servers():
    stats = {"S0": {"staleness": [3, 1]}, "S1": {"staleness": [2, 0, 5]}, "S2": {}}
    assert total_staleness(stats) == [5, 1, 5]


def _lockstep(mode, grads, init, lr=0.25):
    """Each step, workers 0..W-1 push then pull in turn; [(step, worker, pulled bytes)] in reply order."""
    store, log = _store(mode, grads.shape[1], init, SGD(learning_rate=lr))
    for t, step in enumerate(grads):
        for w, g in enumerate(step):
            store.push(w, "w", 0, g, log.cb(("push", t, w)))
            store.pull(w, "w", 0, lambda v, t=t, w=w: log.events.append((("pull", t, w), v.tobytes())))
    pulls = [(n, v) for n, v in log.events if n[0] == "pull"]
    return pulls, store


def test_a_sync_pull_between_two_pushes_gets_the_round_of_the_first():
    # MXNet's engine orders a pull between a worker's two pushes of a key: it reads the first one's
    # round, even when the second push is already queued at the server for the next round
    store, log = _store("sync", 2, np.zeros(4, np.float32))
    seen = []
    store.push(0, "w", 0, np.full(4, 1.0, np.float32), log.cb("push0 t1"))
    store.pull(0, "w", 0, lambda v: seen.append(float(v[0])))     # waits for round 1
    store.push(0, "w", 0, np.full(4, 10.0, np.float32), log.cb("push0 t2"))     # queued for round 2
    store.push(1, "w", 0, np.full(4, 2.0, np.float32), log.cb("push1 t1"))      # round 1 closes
    assert seen == [3.0]
    store.push(1, "w", 0, np.full(4, 20.0, np.float32), log.cb("push1 t2"))     # round 2 closes
    store.pull(0, "w", 0, lambda v: seen.append(float(v[0])))
    assert seen == [3.0, 30.0] and log.names() == ["init", "push0 t1", "push1 t1", "push0 t2", "push1 t2"]


def test_ssp_zero_equals_sync_bit_for_bit():
    rng = np.random.default_rng(7)
    W, steps = 3, 5
    grads = rng.integers(-8, 9, size=(steps, W, 6)).astype(np.float32)
    init = (rng.integers(-40, 41, size=6) / 4).astype(np.float32)
    sync, sync_store = _lockstep("sync", grads, init)
    ssp, store = _lockstep("ssp:0", grads, init)
    assert len(sync) == len(ssp) == steps * W
    assert sync == ssp                      # same pulls, in the same order, with the same bytes
    # and the values are the closed form (every number here is exact in float32)
    last = np.frombuffer(ssp[-1][1], np.float32)
    assert np.array_equal(last, init - 0.25 * grads.sum(axis=(0, 1)))
    # workers 0 and 1 waited at every step, for the last worker's push
    assert store.stats["ssp_waits"] == steps * (W - 1)
    # staleness: a sync round is one update; under ssp each push is one, so the workers after
    # the first in a step push 1 and 2 updates late
    assert sync_store.stats["staleness"] == [steps * W] and store.stats["staleness"] == [steps] * W


def test_ssp_pull_blocks_exactly_when_too_far_ahead():
    store, log = _store("ssp:2", 3, np.zeros(2, np.float32))
    one = np.ones(2, np.float32)
    for c in (1, 2):                         # clocks 1 and 2: at most 2 ahead of W1, W2 at 0
        store.push(0, "w", 0, one, log.cb(f"push{c}"))
        store.pull(0, "w", 0, log.cb(f"pull{c}"))
        assert log.names()[-1] == f"pull{c}"
    store.push(0, "w", 0, one, log.cb("push3"))
    store.pull(0, "w", 0, log.cb("pull3"))   # clock 3 needs every clock >= 1
    assert log.names()[-1] == "push3" and store.stats["ssp_waits"] == 1
    store.push(1, "w", 0, one, log.cb("w1"))
    assert log.names()[-1] == "w1"           # W2 is still at clock 0
    store.push(2, "w", 0, one, log.cb("w2"))
    assert log.names()[-2:] == ["w2", "pull3"]
    assert log.result("pull3").tolist() == [5, 5]     # pushes are applied as they arrive
    # W1 and W2, behind, never wait
    store.pull(1, "w", 0, log.cb("pull.w1"))
    assert log.names()[-1] == "pull.w1" and store.stats["ssp_waits"] == 1


def test_ssp_inf_never_waits():
    store, log = _store("ssp:inf", 3, np.zeros(1, np.float32))
    for i in range(50):
        store.push(0, "w", 0, np.ones(1, np.float32), log.cb("push"))
        store.pull(0, "w", 0, log.cb(f"pull{i}"))
        assert log.names()[-1] == f"pull{i}"
    assert store.stats["ssp_waits"] == 0 and log.result("pull49").tolist() == [50]


def test_ssp_joined_workers_hold_nobody_back():
    store, log = _store("ssp:0", 2, np.zeros(1, np.float32))
    store.push(0, "w", 0, np.ones(1, np.float32), log.cb("push"))
    store.pull(0, "w", 0, log.cb("pull"))
    assert log.names()[-1] == "push"
    store.worker_joined(1)
    assert log.names()[-1] == "pull"


def test_gone_worker_fails_ssp_waiters():
    store, log = _store("ssp:1", 3, np.zeros(1, np.float32))
    one = np.ones(1, np.float32)
    for w in (0, 2):
        for _ in range(3):
            store.push(w, "w", 0, one, log.cb("push"))
    store.pull(0, "w", 0, log.cb("waiting"))              # clock 3 needs W1 at clock 2
    assert log.names()[-1] == "push"
    store.worker_gone(1, "worker W1 has left the job")
    error = log.result("waiting")
    assert isinstance(error, NodeFailure)
    assert "waits for W1 to reach clock 2" in str(error) and "worker W1 has left the job" in str(error)
    store.pull(2, "w", 0, log.cb("later"))                # a later pull that would wait fails at once
    assert isinstance(log.result("later"), NodeFailure)
    store.push(0, "w", 0, one, log.cb("still"))            # pushes still apply (as async)
    assert log.names()[-1] == "still"


def test_backup_workers_close_early_and_drop_stale_pushes():
    store, log = _store("sync:backup=1", 3, np.zeros(2, np.float32))
    g = [np.full(2, w + 1, np.float32) for w in range(3)]
    store.push(0, "w", 0, g[0], log.cb("a0"))
    assert log.names()[-1] == "init"
    store.push(1, "w", 0, g[1], log.cb("a1"))              # W - b = 2 pushes close round 1
    assert log.names()[-2:] == ["a0", "a1"] and store.stats["rounds"] == 1
    for w in (0, 1):
        store.pull(w, "w", 0, log.cb(f"pull{w}"))
        assert log.result(f"pull{w}").tolist() == [3, 3]
    store.push(2, "w", 0, g[2], log.cb("stale2"))          # W2 never saw round 1: dropped, acked at once
    assert log.names()[-1] == "stale2" and store.stats["dropped"] == 1
    store.pull(2, "w", 0, log.cb("pull2"))                 # after a dropped push: the current value, now
    assert log.names()[-1] == "pull2" and log.result("pull2").tolist() == [3, 3]
    store.push(2, "w", 0, g[2], log.cb("b2"))              # now fresh: joins the open round
    store.pull(2, "w", 0, log.cb("pull2b"))                # and its pull waits for that round
    assert log.names()[-1] == "pull2"
    store.push(0, "w", 0, g[0], log.cb("b0"))
    assert log.names()[-3:] == ["b2", "b0", "pull2b"]
    assert log.result("pull2b").tolist() == [4, 4]         # round 2 = W2 + W0
    store.push(1, "w", 0, g[1], log.cb("stale1"))          # W1 last saw round 1
    assert log.names()[-1] == "stale1" and store.stats["dropped"] == 2
    store.pull(1, "w", 0, log.cb("pull1b"))
    assert log.result("pull1b").tolist() == [4, 4]
    assert store.stats["rounds"] == 2 and store.stats["pushes"] == 6
    assert store.stats["staleness"] == [4]                 # the applied pushes were all fresh


def test_backup_zero_keeps_pushing_twice_queued():
    """b = 0 is plain sync: a second push before the round closes goes to the next round."""
    store, log = _store("sync", 2, np.zeros(1, np.float32))
    for name in ("a", "b"):
        store.push(0, "w", 0, np.ones(1, np.float32), log.cb(name))
    store.push(1, "w", 0, np.ones(1, np.float32), log.cb("c"))
    assert log.names()[-2:] == ["a", "c"] and store.stats["dropped"] == 0
    store.push(1, "w", 0, np.ones(1, np.float32), log.cb("d"))
    assert log.names()[-2:] == ["b", "d"]
    assert store.stats["staleness"] == [2, 2]              # the second pushes came a round late


def test_staleness_histogram_async():
    store, log = _store("async", 2, np.zeros(1, np.float32))
    one = np.ones(1, np.float32)
    store.pull(0, "w", 0, log.cb("pull"))                  # W0 sees version 0
    store.push(1, "w", 0, one, log.cb("p"))                # staleness 0
    store.push(1, "w", 0, one, log.cb("p"))                # 1: W1 has not pulled since
    store.push(0, "w", 0, one, log.cb("p"))                # 2: two updates since W0's pull
    assert store.stats["staleness"] == [1, 1, 1]
    store.pull(0, "w", 0, log.cb("pull"))
    store.push(0, "w", 0, one, log.cb("p"))
    assert store.stats["staleness"] == [2, 1, 1] and sum(store.stats["staleness"]) == store.stats["pushes"]
