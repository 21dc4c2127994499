"""The kvstore API's semantics in process: the local kvstore, row-sparse pulls, and the
server-side optimizers' formulas."""

import ml_dtypes
import numpy as np
import pytest

import kvps
from kvps.errors import KVKeyError


def test_mxnet_kvstore_tutorial_with_an_updater():
    """MXNet's KVStore tutorial, step by step, numpy in place of NDArray (import kvps as mx)."""
    mx = kvps
    kv = mx.kv.create("local")
    shape = (2, 3)
    kv.init(3, np.ones(shape) * 2)
    a = np.zeros(shape)
    kv.pull(3, out=a)
    assert (a == 2).all()
    kv.push(3, np.ones(shape) * 8)
    kv.pull(3, out=a)
    assert (a == 8).all()
    kv.push(3, [np.ones(shape) for _ in range(4)])            # one value per device: summed
    kv.pull(3, out=a)
    assert (a == 4).all()
    seen = []

    def update(key, input, stored):
        seen.append(key)
        stored += input * 2
    kv._set_updater(update)
    kv.pull(3, out=a)
    assert (a == 4).all()
    kv.push(3, np.ones(shape))
    kv.pull(3, out=a)
    assert (a == 6).all() and seen == [3]
    b = [np.zeros(shape) for _ in range(4)]
    kv.pull(3, out=b)
    assert all((x == 6).all() for x in b)
    keys = [5, 7, 9]
    kv.init(keys, [np.ones(shape)] * len(keys))
    kv.push(keys, [np.ones(shape)] * len(keys))
    b = [np.zeros(shape)] * len(keys)
    kv.pull(keys, out=b)
    assert (b[1] == 3).all()
    kv.push(keys, [[np.ones(shape) for _ in range(4)]] * len(keys))
    c = [[np.zeros(shape) for _ in range(4)] for _ in keys]
    kv.pull(keys, out=c)
    assert (c[1][1] == 11).all() and seen == [3, 5, 7, 9, 5, 7, 9]
    kv.push(5, np.ones((1, 3)), row_ids=[1])                # row-sparse: the updater sees the dense sum
    kv.pull(5, out=a)
    assert a.tolist() == [[11] * 3, [13] * 3]
    with pytest.raises(TypeError, match="updater"):
        kv._set_updater("sgd")
    e1, e2 = np.zeros((2, 3)), np.zeros((2, 3))
    kv.row_sparse_pull(5, out=[e1, e2], row_ids=[np.array([0]), np.array([1.0])])   # one id array per out
    assert e1.tolist() == [[11] * 3, [0] * 3] and e2.tolist() == [[0] * 3, [13] * 3]
    kv.row_sparse_pull(5, out=[e1, e2], row_ids=np.array([1]))                       # one for all outs
    assert e1.tolist() == e2.tolist() == [[0] * 3, [13] * 3]


def test_local_push_sums_a_list_and_replaces():
    kv = kvps.create("local")
    kv.init(3, np.ones(4, np.float32))
    out = np.zeros(4, np.float32)
    kv.pull(3, out=out)
    assert out.tolist() == [1.0] * 4                         # pull before push: the init value
    kv.push(3, [np.full(4, 2, np.float32), np.full(4, 5, np.float32)])
    outs = [np.zeros(4, np.float32), np.zeros(4, np.float32)]
    kv.pull(3, out=outs)
    assert [o.tolist() for o in outs] == [[7.0] * 4] * 2     # replaced by the sum, not accumulated
    value = np.full(4, 3, np.float32)
    kv.pushpull(3, value)                                    # out=None: result lands in value
    assert value.tolist() == [3.0] * 4
    kv.broadcast("b", np.arange(3, dtype=np.int64), out=(o := np.zeros(3, np.int64)))
    assert o.tolist() == [0, 1, 2]
    with pytest.raises(KVKeyError, match="already initialised"):
        kv.init(3, np.ones(4, np.float32))
    for i in np.arange(3, 4):                                # numpy integer keys are their ints
        kv.push(i, np.full(4, 6, np.float32))
        kv.pull([i], out=[out])
    assert out.tolist() == [6.0] * 4
    with pytest.raises(KVKeyError, match="already initialised"):
        kv.init(np.int32(3), np.ones(4, np.float32))
    with pytest.raises(TypeError, match="keys are int or str"):
        kv.push(3.0, np.ones(4, np.float32))


def test_local_row_sparse_pull_fills_rows_and_zeroes_the_rest():
    kv = kvps.create("local")
    table = np.arange(20, dtype=np.float32).reshape(10, 2)
    kv.init("emb", table)
    out = np.full((10, 2), -1, np.float32)
    kv.row_sparse_pull("emb", out=out, row_ids=np.array([7, 1, 7, 1]))
    expect = np.zeros((10, 2), np.float32)
    expect[[1, 7]] = table[[1, 7]]
    assert (out == expect).all()


# Server-side optimizers against MXNet's formulas written out here (docs/optimizers.md).
def _mx(name, w, grads, p):
    w = w.astype(np.float64).copy()
    s1, s2 = np.zeros_like(w), np.zeros_like(w)
    for t, g in enumerate(grads, 1):
        g = g.astype(np.float64) * p.get("rescale_grad", 1.0)
        clip = p.get("clip_gradient")
        lr, wd = p["learning_rate"], p.get("wd", 0.0)
        if name == "sgd":
            g = np.clip(g, -clip, clip) if clip is not None else g
            s1 = p["momentum"] * s1 - lr * (g + wd * w)
            w = w + s1
        elif name == "nag":
            # MXNet 1.9's in-place nag_mom_update: the momentum update reads the new weight
            g = np.clip(g, -clip, clip) if clip is not None else g
            m1 = p["momentum"] * s1
            w = (w - m1) + (p["momentum"] + 1) * (m1 - lr * (g + wd * w))
            s1 = m1 - lr * (g + wd * w)
        elif name in ("adam", "adamw"):
            b1, b2, eps = p["beta1"], p["beta2"], p["epsilon"]
            if name == "adam":
                g = g + wd * w
            g = np.clip(g, -clip, clip) if clip is not None else g
            s1 = b1 * s1 + (1 - b1) * g
            s2 = b2 * s2 + (1 - b2) * g * g
            lr_t = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
            if name == "adam":
                w = w - lr_t * s1 / (np.sqrt(s2) + eps)
            else:
                w = w - (lr_t * s1 / (np.sqrt(s2) + eps) + wd * w)
        elif name == "adagrad":
            g = np.clip(g, -clip, clip) if clip is not None else g
            s1 = s1 + g * g
            w = w - lr * (g / np.sqrt(s1 + p["epsilon"]) + wd * w)
        elif name == "rmsprop":
            g = g + wd * w
            g = np.clip(g, -clip, clip) if clip is not None else g
            s1 = p["gamma1"] * s1 + (1 - p["gamma1"]) * g * g
            w = w - lr * g / np.sqrt(s1 + p["epsilon"])
    return w


OPTIMIZERS = [
    kvps.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5, clip_gradient=0.4),
    kvps.optimizer.NAG(learning_rate=0.1, momentum=0.9, wd=0.01),
    kvps.optimizer.Adam(learning_rate=0.01, wd=0.001, clip_gradient=1.0),
    kvps.optimizer.AdamW(learning_rate=0.01, wd=0.01),
    kvps.optimizer.AdaGrad(learning_rate=0.1, wd=0.001),
    kvps.optimizer.RMSProp(learning_rate=0.01, wd=0.001, rescale_grad=2.0),
]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_server_optimizers_follow_mxnet_formulas(opt):
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(257).astype(np.float32)
    grads = [rng.standard_normal(257).astype(np.float32) for _ in range(5)]
    kv = kvps.create("local")
    kv.init("w", w0)
    kv.set_optimizer(opt)
    for g in grads:
        kv.push("w", g)
    out = np.zeros_like(w0)
    kv.pull("w", out=out)
    np.testing.assert_allclose(out, _mx(opt.name, w0, grads, opt.params), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
def test_optimizer_on_low_and_high_precision_keys(dtype):
    """float16/bfloat16 keys keep a float32 master copy; float64 keys update at float64."""
    kv = kvps.create("local")
    kv.init("w", np.ones(64, dtype))
    kv.set_optimizer(kvps.optimizer.SGD(learning_rate=0.001))
    for _ in range(10):
        kv.push("w", np.ones(64, dtype))
    out = np.zeros(64, dtype)
    kv.pull("w", out=out)
    # 10 steps of 0.001: a float16 weight updated in place would stall at 1.0 (its spacing is 0.001)
    np.testing.assert_allclose(out.astype(np.float64), 0.99, rtol=1e-2 if dtype != np.float64 else 1e-12)


def test_optimizer_refuses_integer_keys():
    kv = kvps.create("local")
    kv.init("i", np.ones(4, np.int32))
    kv.set_optimizer(kvps.optimizer.SGD(learning_rate=1.0))
    with pytest.raises(ValueError, match="key 'i' is int32: an optimizer needs a floating-point key"):
        kv.push("i", np.ones(4, np.int32))
