"""Parity of the fused optimizer updates with the numpy reference, bit for bit.

Every backend, every update (with and without clipping, weight decay, momentum,
Nesterov), float32/float16/bfloat16 gradients, odd sizes and misaligned views, over
several steps so that state errors would compound. Also checks the formulas against
MXNet's written out by hand on a few numbers.
Run: pytest tests/kernels/test_kernels_optimizers.py
"""
import math

import numpy as np
import pytest

from kvps.kernels import reference, testing
from kvps.kernels.reference import bfloat16

GRADS = [np.float32, np.float16, bfloat16]
BACKENDS = testing.backends()
# inf, NaN and overflow are part of the test data; numpy's warnings about them are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
SIZES = (0, 1, 7, 15, 16, 17, 31, 33, 1023, 1025, 2**20 + 3)
STEPS = 3

COMMON = [
    dict(wd=0.0, rescale_grad=1.0, clip_gradient=None),
    dict(wd=1e-3, rescale_grad=0.5, clip_gradient=0.75),
]
OPTIMIZERS = {
    "sgd": (0, [dict(lr=0.1, momentum=0.0)]),
    "sgd_momentum": (1, [dict(lr=0.1, momentum=0.9)]),
    "nag": (1, [dict(lr=0.1, momentum=0.9, nesterov=True)]),
    "adam": (2, [dict(lr=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8)]),
    "adamw": (2, [dict(lr=1e-3, beta1=0.9, beta2=0.99, epsilon=1e-6, eta=0.5)]),
    "adagrad": (1, [dict(lr=0.05, epsilon=1e-7)]),
    "rmsprop": (1, [dict(lr=0.01, gamma1=0.95, epsilon=1e-8), dict(lr=0.01, gamma1=0.9, epsilon=1e-6, clip_weights=0.3)]),
}


@pytest.fixture(params=BACKENDS)
def backend(request):
    yield testing.activate(request.param)
    testing.restore()


def call(target, name, weight, grad, states, params):
    if name in ("sgd", "sgd_momentum", "nag"):
        params = dict(params)
        params.setdefault("nesterov", False)
        target.sgd_update(weight, grad, states[0] if states else None, **params)
    elif name in ("adam", "adamw"):
        getattr(target, f"{name}_update")(weight, grad, states[0], states[1], **params)
    else:
        getattr(target, f"{name}_update")(weight, grad, states[0], **params)


def full_params(name, params, common):
    p = dict(params, **common)
    if name == "rmsprop":
        p.setdefault("clip_weights", None)
    if name == "adamw":
        p.setdefault("eta", 1.0)
    return p


@pytest.mark.parametrize("grad_dtype", GRADS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_matches_reference(backend, name, grad_dtype):
    nstates, variants = OPTIMIZERS[name]
    rng = np.random.default_rng(7)
    offsets = testing.OFFSETS if backend.name == "c" else ("aligned", "element")
    for n in SIZES:
        for off in offsets if n < 2**20 else offsets[-1:]:
            for params in variants:
                for common in COMMON:
                    p = full_params(name, params, common)
                    what = f"{name} grad={np.dtype(grad_dtype).name} n={n} offset={off} {p}"
                    weight = testing.random(rng, n, np.float32, off)
                    states = [testing.random(rng, n, np.float32, off) for _ in range(nstates)]
                    if name in ("adam", "adamw", "adagrad", "rmsprop"):
                        for s in states[-1:]:
                            np.abs(s, out=s)  # second moments and histories are >= 0
                    ew, es = weight.copy(), [s.copy() for s in states]
                    for step in range(STEPS):
                        grad = testing.random(rng, n, grad_dtype, off, scale=2.0)
                        call(reference, name, ew, grad, es, p)
                        call(backend, name, weight, grad, states, p)
                    testing.assert_same(weight, ew, f"weight, {what}")
                    for i, (s, e) in enumerate(zip(states, es)):
                        testing.assert_same(s, e, f"state {i}, {what}")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_special_values_propagate_like_the_reference(backend, name):
    nstates, variants = OPTIMIZERS[name]
    rng = np.random.default_rng(8)
    p = full_params(name, variants[0], COMMON[1])
    weight = testing.random(rng, 1025, np.float32, special=True)
    states = [np.abs(testing.random(rng, 1025, np.float32)) for _ in range(nstates)]
    grad = testing.random(rng, 1025, np.float32, special=True)
    ew, es = weight.copy(), [s.copy() for s in states]
    with np.errstate(all="ignore"):
        call(reference, name, ew, grad, es, p)
        call(backend, name, weight, grad, states, p)
    testing.assert_same(weight, ew, f"{name} with inf/nan/denormals")


def f32(x):
    return float(np.float32(x))


def test_formulas_follow_mxnet():
    """One element, the formulas of MXNet's kernels evaluated step by step in float32."""
    w, g, lr, wd, rs, c = 1.5, 4.0, 0.1, 0.01, 0.5, 1.0
    F = np.float32
    # sgd_update with clipping: (1 - lr*wd)*w - lr*clip(rs*g)
    weight = np.array([w], F)
    reference.sgd_update(weight, np.array([g], F), None, lr=lr, wd=wd, rescale_grad=rs, clip_gradient=c)
    assert weight[0] == F(F(F(1) - F(lr) * F(wd)) * F(w)) - F(F(lr) * F(1.0))
    # sgd_mom_update: mom = mu*mom - lr*wd*w - lr*rs*g; w += mom
    weight, mom = np.array([w], F), np.array([0.25], F)
    reference.sgd_update(weight, np.array([g], F), mom, lr=lr, momentum=0.9, wd=wd, rescale_grad=rs)
    m = F(F(F(0.9) * F(0.25)) - F(F(F(lr) * F(wd)) * F(w))) - F(F(F(lr) * F(rs)) * F(g))
    assert mom[0] == m and weight[0] == F(F(w) + m)
    # adam_update: g = rs*g + wd*w, clipped; lr*m / (sqrt(v) + eps)
    weight, mean, var = np.array([w], F), np.array([0.1], F), np.array([0.2], F)
    reference.adam_update(weight, np.array([g], F), mean, var, lr=lr, wd=wd, rescale_grad=rs, clip_gradient=c)
    gg = min(F(F(rs) * F(g)) + F(F(wd) * F(w)), F(c))
    mm = F(F(F(0.9) * F(0.1)) + F(F(F(1) - F(0.9)) * gg))
    vv = F(F(F(0.999) * F(0.2)) + F(F(F(F(1) - F(0.999)) * gg) * gg))
    assert mean[0] == mm and var[0] == vv
    assert weight[0] == F(F(w) - F(F(F(lr) * mm) / F(F(math.sqrt(vv)) + F(1e-8))))
    # rmsprop_update: eps inside the sqrt, wd added before clipping
    weight, n = np.array([w], F), np.array([0.3], F)
    reference.rmsprop_update(weight, np.array([g], F), n, lr=lr, gamma1=0.9, wd=wd, rescale_grad=rs,
                             clip_gradient=c)
    nn = F(F(F(F(1) - F(0.9)) * F(gg * gg)) + F(F(0.9) * F(0.3)))
    assert n[0] == nn
    assert weight[0] == F(F(w) - F(F(lr) * F(gg / F(math.sqrt(F(nn + F(1e-8)))))))


def test_nag_matches_mxnet_python_nag_for_constant_lr():
    # MXNet's older Python NAG (mom without lr) and its fused nag_mom_update agree when
    # lr is constant and wd is 0; the fused form is what kvps implements. (float64
    # weights: the reference computes at the weight's dtype, as the servers use it.)
    rng = np.random.default_rng(9)
    w1 = rng.standard_normal(64).astype(np.float64)
    w2, mom_fused, mom_py = w1.copy(), np.zeros(64), np.zeros(64)
    lr, mu = 0.1, 0.9
    for _ in range(5):
        g = rng.standard_normal(64)
        reference.sgd_update(w1, g, mom_fused, lr=lr, momentum=mu, nesterov=True)
        mom_py[:] = mu * mom_py + g
        w2 -= lr * (g + mu * mom_py)
    np.testing.assert_allclose(w1, w2, rtol=1e-12, atol=1e-12)


def test_adamw_skips_update_when_rescale_is_not_finite(backend):
    weight, mean, var = np.ones(40, np.float32), np.zeros(40, np.float32), np.zeros(40, np.float32)
    for rs in (0.0, float("inf"), float("nan")):
        backend.adamw_update(weight, np.ones(40, np.float32), mean, var, lr=0.1, beta1=0.9, beta2=0.99,
                             epsilon=1e-8, wd=0.1, rescale_grad=rs, clip_gradient=None, eta=1.0)
    assert (weight == 1).all() and (mean == 0).all() and (var == 0).all()
