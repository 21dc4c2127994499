"""MXNet's names and forms in process: type names and aliases, row-sparse pushes and the lazy update
of the local kvstore and the store, float row ids, and the pull-ahead bookkeeping."""
import numpy as np
import pytest

import kvps
from kvps.kvstore import ALIASES, TYPES
from kvps.kvstore.pull_ahead import PullAhead, Stash
from kvps.ps.rules import Registry
from kvps.ps.store import Store


@pytest.mark.parametrize("name", ["LOCAL", "Local", "device", "local_update_cpu", "local_allreduce_cpu", "local_allreduce_device", "nccl"])
def test_local_names_are_case_insensitive_and_aliased(name):
    kv = kvps.create(name)
    assert kv.type == name and kv.num_workers == 1


def test_every_alias_names_a_kvps_type():
    assert set(ALIASES.values()) <= set(TYPES)
    with pytest.raises(ValueError, match="dist_device_sync"):
        kvps.create("no_such_type")


def test_capabilities_and_private_barrier():
    kv = kvps.create("local")
    assert kv.is_capable("optimizer") and kv.is_capable("OPTIMIZER")
    with pytest.raises(ValueError, match="unknown capability"):
        kv.is_capable("teleport")
    kv._barrier()


def test_row_sparse_push_without_optimizer_stores_the_rows_and_zeros():
    kv = kvps.create("local")
    kv.init("e", np.full((5, 2), 7, np.float32))
    rows = np.array([[1, 1], [2, 2], [3, 3]], np.float32)
    kv.push("e", rows, row_ids=np.array([4, 1, 4]))      # row 4 given twice: summed
    rows[:] = 99                                          # already taken
    out = np.zeros((5, 2), np.float32)
    kv.pull("e", out=out)
    assert out[:, 0].tolist() == [0, 2, 0, 0, 4]


def test_row_sparse_push_with_adam_updates_only_the_touched_rows():
    kv = kvps.create("local")
    kv.set_optimizer(kvps.optimizer.Adam(learning_rate=0.1))
    kv.init("w", np.ones((4, 3), np.float32))
    for _ in range(3):
        kv.push("w", np.ones((1, 3), np.float32), row_ids=[2])
    out = np.zeros((4, 3), np.float32)
    kv.pull("w", out=out)
    # the same three steps on a one-row key, densely
    ref_store = Store(num_workers=1, mode="sync")
    ref_store.set_rule(Registry().create(kvps.optimizer.Adam(learning_rate=0.1).spec()))
    ref_store.init(0, "r", 0, np.float32, (1, 3), np.ones((1, 3), np.float32), lambda e: None)
    for _ in range(3):
        ref_store.push(0, "r", 0, np.ones((1, 3), np.float32), lambda e: None)
    np.testing.assert_array_equal(out[[0, 1, 3]], np.ones((3, 3), np.float32))
    np.testing.assert_allclose(out[2], ref_store.slots[("r", 0)].value[0], rtol=1e-6)
    assert out[2, 0] < 1


def test_store_refuses_bad_row_sparse_pushes():
    store = Store(num_workers=1, mode="sync")
    store.init(0, "e", 0, np.float32, (4, 2), np.zeros((4, 2), np.float32), lambda e: None)
    with pytest.raises(ValueError, match="sorted and unique"):
        store.push(0, "e", 0, np.zeros((2, 2), np.float32), lambda e: None, rows=np.array([2, 1]))
    with pytest.raises(ValueError, match="needs float32"):
        store.push(0, "e", 0, np.zeros((2, 3), np.float32), lambda e: None, rows=np.array([1, 2]))
    with pytest.raises(ValueError, match="out of range"):
        store.push(0, "e", 0, np.zeros((1, 2), np.float32), lambda e: None, rows=np.array([4]))


def test_row_sparse_push_arguments_are_checked_before_anything_changes():
    kv = kvps.create("local")
    kv.init("e", np.ones((3, 2), np.float32))
    with pytest.raises(ValueError, match="row-sparse push of 2 rows needs float32"):
        kv.push("e", np.ones((3, 2), np.float32), row_ids=[0, 1])
    with pytest.raises(ValueError, match="whole numbers"):
        kv.push("e", np.ones((1, 2), np.float32), row_ids=np.array([0.5]))
    with pytest.raises(ValueError, match="must lie in 0..2"):
        kv.push("e", np.ones((1, 2), np.float32), row_ids=[3])
    out = np.zeros((3, 2), np.float32)
    kv.pull("e", out=out)
    assert out.tolist() == [[1, 1]] * 3


def test_float_row_ids_in_row_sparse_pull():
    kv = kvps.create("local")
    kv.init(0, np.arange(8, dtype=np.float32).reshape(4, 2))
    out = np.full((4, 2), -1, np.float32)
    kv.row_sparse_pull(0, out=out, row_ids=np.array([3.0, 1.0], np.float32))
    assert out[:, 0].tolist() == [0, 2, 0, 6]
    with pytest.raises(ValueError, match="whole numbers; got 1.5"):
        kv.row_sparse_pull(0, out=out, row_ids=np.array([1.5], np.float32))


def test_pull_ahead_learns_from_pulls_and_unlearns_from_repeated_pushes():
    ahead = PullAhead()
    assert not ahead.wants(["a"])
    ahead.pushed(["a"], None)
    assert ahead.take(["a"]) is None             # nothing stashed yet, but the pattern is seen
    assert ahead.wants(["a"])
    stash = Stash()
    ahead.pushed(["a"], stash)
    assert ahead.take(["a"]) == [stash] and ahead.take(["a"]) is None   # taken once
    ahead.pushed(["a"], Stash())
    ahead.pushed(["a"], Stash())                 # pushed twice without a pull
    assert ahead.wants(["a"])                    # one miss is forgiven
    ahead.pushed(["a"], Stash())
    assert not ahead.wants(["a"])
    ahead.pushed(["b"], None)
    ahead.take(["b"])
    ahead.pushed(["b"], Stash())
    ahead.drop(["b"])                            # any other call on the key drops what was stashed
    assert ahead.take(["b"]) is None


@pytest.mark.parametrize("name", ["sgd", "nag", "adam", "adamw", "adagrad", "rmsprop"])
def test_get_updater_steps_as_a_kvstore_optimizer_does(name):
    """mx.optimizer.get_updater(opt): updater(index, grad, weight) in place, each index with its own
    state, with the formulas a kvstore's set_optimizer runs; on numpy arrays and torch tensors."""
    import torch
    opt = kvps.optimizer.create(name, learning_rate=0.1, wd=0.01)
    kv = kvps.create("local")
    kv.set_optimizer(opt)
    updater = kvps.optimizer.get_updater(opt)
    rng = np.random.default_rng(0)
    start = rng.standard_normal((2, 5)).astype(np.float32)
    kv.init(["a", "b"], [start[0], start[1]])
    mine_a, mine_b = start[0].copy(), torch.from_numpy(start[1].copy())
    for _ in range(3):
        ga, gb = rng.standard_normal((2, 5)).astype(np.float32)
        kv.push(["a", "b"], [ga, gb])
        updater("a", ga, mine_a)
        updater("b", torch.from_numpy(gb), mine_b)
    want = [np.zeros(5, np.float32), np.zeros(5, np.float32)]
    kv.pull(["a", "b"], out=want)
    assert mine_a.tolist() == want[0].tolist() and mine_b.tolist() == want[1].tolist()


def test_get_updater_refuses_what_it_cannot_step():
    updater = kvps.optimizer.get_updater(kvps.optimizer.SGD(learning_rate=0.1))
    with pytest.raises(ValueError, match="grad shape"):
        updater(0, np.ones(3, np.float32), np.ones(4, np.float32))
    with pytest.raises(TypeError, match="takes a kvps.optimizer.Optimizer"):
        kvps.optimizer.get_updater("sgd")
    with pytest.raises(ValueError, match="has no optimizer 'nope'"):
        kvps.optimizer.get_updater(kvps.optimizer.create("nope"))
    weight = np.ones(6, np.float32)[::2]            # not contiguous: stepped through a copy, written back
    updater(1, np.ones(3, np.float32), weight)
    assert np.allclose(weight, 0.9)


def test_pull_casts_into_an_out_of_another_float_dtype_as_mxnet_does():
    """MXNet copies a pulled value into `out` whatever its float dtype (its own dist tests pull
    float16 keys into float32 arrays); other mismatches stay errors."""
    torch = pytest.importorskip("torch")
    kv = kvps.create("local")
    kv.init(["h", "w"], [np.full((2, 3), 1.5, np.float16), np.full((2, 3), 2.25, np.float32)])
    wide = np.zeros((2, 3), np.float32)
    kv.pull("h", out=wide)
    assert wide.tolist() == [[1.5] * 3] * 2
    narrow, t64 = np.zeros((2, 3), np.float16)[:, ::1], torch.zeros(2, 3, dtype=torch.float64)
    kv.pull("w", out=[narrow, t64])
    assert narrow.tolist() == [[2.25] * 3] * 2 and t64.tolist() == [[2.25] * 3] * 2
    rows = np.full((2, 3), -1.0, np.float64)
    kv.row_sparse_pull("h", out=rows, row_ids=np.array([[1.0, 1.0]], np.float16))   # 2-D float ids, repeated
    assert rows.tolist() == [[0.0] * 3, [1.5] * 3]
    with pytest.raises(ValueError, match=r"key 'w' was initialised as float32 \(2, 3\); pull got out int32"):
        kv.pull("w", out=np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="pull got out float32 \\(3, 2\\)"):
        kv.pull("w", out=np.zeros((3, 2), np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_mxnets_test_optimizer_adds_the_scaled_gradient(dtype):
    """mx.optimizer.create('test', rescale_grad=r): weight += r * grad, which MXNet's dist kvstore
    tests check their sums with (float16 keys through a float32 master copy)."""
    kv = kvps.create("local")
    kv.set_optimizer(kvps.optimizer.create("test", rescale_grad=2))
    kv.init("k", np.ones((2, 3), dtype))
    for _ in range(3):
        kv.push("k", np.full((2, 3), 1.5, dtype))
    out = np.zeros((2, 3), dtype)
    kv.pull("k", out=out)
    assert out.tolist() == [[10.0] * 3] * 2


def test_a_pull_after_a_failed_round_gets_its_error_until_a_round_succeeds():
    """A round whose update raised leaves the value as it was before it: a pull that returned that
    value would pass it off as the round's result. The next round that succeeds clears it."""
    class Flaky:
        fail = True

        def __call__(self, slot_id, weight, grad):
            if self.fail:
                raise ValueError("the update broke")
            weight += grad
    store = Store(2, "sync")
    store.init(0, "w", 0, np.float32, (2,), np.zeros(2, np.float32), lambda r: None)
    store.rule = Flaky()
    acks = []
    for w in (0, 1):
        store.push(w, "w", 0, np.ones(2, np.float32), acks.append)
    assert [type(a) for a in acks] == [ValueError, ValueError]
    pulled = []
    store.pull(0, "w", 0, pulled.append)
    assert isinstance(pulled[0], kvps.KVPSError) and "the last sync round of key 'w' failed" in str(pulled[0]) \
        and "the update broke" in str(pulled[0]), pulled
    store.rule.fail = False
    for w in (0, 1):
        store.push(w, "w", 0, np.ones(2, np.float32), acks.append)
    store.pull(1, "w", 0, pulled.append)
    assert acks[2:] == [None, None] and pulled[1].tolist() == [2.0, 2.0]
