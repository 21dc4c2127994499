"""Parity of the CUDA kernels (kvps.kernels.cuda, torch CUDA tensors) with the numpy reference.

Skipped without a usable GPU. scripts/gpu_check.sh builds the libraries and runs this
file and the CUDA benchmark in a few minutes on one GPU. Results must match the
reference bit for bit (NaN payloads aside): the CUDA library is built with -fmad=false
and IEEE division and square root, like the CPU code.
Run: pytest tests/gpu/test_cuda_kernels.py
"""
import numpy as np
import pytest

from kvps.kernels import reference, testing
from kvps.kernels.reference import bfloat16

torch = pytest.importorskip("torch")
from kvps.kernels import cuda  # noqa: E402

USABLE, REASON = cuda.status()
pytestmark = pytest.mark.skipif(not (USABLE and torch.cuda.is_available()),
                                reason=f"no usable GPU: {REASON}")

SIZES = testing.SIZES
TORCH = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64", np.dtype(np.float16): "float16",
         np.dtype(bfloat16): "bfloat16", np.dtype(np.int32): "int32", np.dtype(np.int64): "int64"}


def to_gpu(a, offset=False):
    """A CUDA tensor with a's values; offset=True puts it one element past an allocation."""
    dt = np.dtype(a.dtype)
    host = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if dt == np.dtype(bfloat16) \
        else torch.from_numpy(np.ascontiguousarray(a))
    if not offset:
        return host.cuda()
    buf = torch.empty(a.size + 1, dtype=host.dtype, device="cuda")
    t = buf[1:]
    t.copy_(host)
    return t


def to_host(t, dtype):
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16)
    return t.numpy().astype(dtype, copy=False)


def cases():
    for n in SIZES:
        for offset in (False, True) if n < 2**20 else (True,):
            yield n, offset, f"n={n} offset={offset}"


@pytest.mark.parametrize("dtype", list(TORCH), ids=list(TORCH.values()))
def test_sum_into_and_sources(dtype):
    rng = np.random.default_rng(1)
    for n, off, what in cases():
        d, s, s2 = (testing.random(rng, n, dtype, special=n < 2000) for _ in range(3))
        expected = d.copy()
        with np.errstate(all="ignore"):
            reference.sum_into(expected, s)
        td = to_gpu(d, off)
        cuda.sum_into(td, to_gpu(s, off))
        testing.assert_same(to_host(td, dtype), expected, f"sum_into {what}")
        expected = np.empty(n, dtype)
        with np.errstate(all="ignore"):
            reference.sum_sources(expected, [d, s, s2])
        cuda.sum_sources(td, [to_gpu(d, off), to_gpu(s, off), to_gpu(s2, off)])
        testing.assert_same(to_host(td, dtype), expected, f"sum_sources {what}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, bfloat16],
                         ids=["float32", "float64", "float16", "bfloat16"])
def test_scale_axpy(dtype):
    rng = np.random.default_rng(2)
    for n, off, what in cases():
        x, y = testing.random(rng, n, dtype), testing.random(rng, n, dtype)
        ex, ey = x.copy(), y.copy()
        with np.errstate(all="ignore"):
            reference.scale(ex, 0.3)
            reference.axpy(ey, -1.7, x)
        tx, ty = to_gpu(x, off), to_gpu(y, off)
        cuda.axpy(ty, -1.7, tx)
        cuda.scale(tx, 0.3)
        testing.assert_same(to_host(tx, dtype), ex, f"scale {what}")
        testing.assert_same(to_host(ty, dtype), ey, f"axpy {what}")


@pytest.mark.parametrize("low", [np.float16, bfloat16], ids=["float16", "bfloat16"])
def test_casts(low):
    rng = np.random.default_rng(3)
    for n, off, what in cases():
        src = testing.random(rng, n, np.float32, special=True)
        expected = np.empty(n, low)
        with np.errstate(all="ignore"):
            reference.cast(src, expected)
        t = to_gpu(np.zeros(n, low), off)
        cuda.cast(to_gpu(src, off), t)
        testing.assert_same(to_host(t, low), expected, f"to {np.dtype(low).name} {what}")
        back = to_gpu(np.zeros(n, np.float32), off)
        cuda.cast(t, back)
        testing.assert_same(to_host(back, np.float32), expected.astype(np.float32), f"back {what}")


OPTS = {
    "sgd": (0, dict(lr=0.1, momentum=0.0)),
    "sgd_momentum": (1, dict(lr=0.1, momentum=0.9)),
    "nag": (1, dict(lr=0.1, momentum=0.9, nesterov=True)),
    "adam": (2, dict(lr=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8)),
    "adamw": (2, dict(lr=1e-3, beta1=0.9, beta2=0.99, epsilon=1e-6, eta=0.5)),
    "adagrad": (1, dict(lr=0.05, epsilon=1e-7)),
    "rmsprop": (1, dict(lr=0.01, gamma1=0.95, epsilon=1e-8, clip_weights=0.3)),
}


def apply(target, name, w, g, states, p):
    if name in ("sgd", "sgd_momentum", "nag"):
        target.sgd_update(w, g, states[0] if states else None, **p)
    elif name in ("adam", "adamw"):
        getattr(target, f"{name}_update")(w, g, states[0], states[1], **p)
    else:
        getattr(target, f"{name}_update")(w, g, states[0], **p)


@pytest.mark.parametrize("grad_dtype", [np.float32, np.float16, bfloat16], ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", list(OPTS))
def test_optimizers(name, grad_dtype):
    nstates, params = OPTS[name]
    rng = np.random.default_rng(4)
    for n, off, what in cases():
        for common in (dict(wd=0.0, rescale_grad=1.0, clip_gradient=None),
                       dict(wd=1e-3, rescale_grad=0.5, clip_gradient=0.75)):
            p = dict(params, **common)
            w = testing.random(rng, n, np.float32)
            states = [np.abs(testing.random(rng, n, np.float32)) for _ in range(nstates)]
            tw, ts = to_gpu(w, off), [to_gpu(s, off) for s in states]
            for _ in range(3):
                g = testing.random(rng, n, grad_dtype, scale=2.0)
                apply(reference, name, w, g, states, p)
                apply(cuda, name, tw, to_gpu(g, off), ts, p)
            testing.assert_same(to_host(tw, np.float32), w, f"{name} weight {what} {p}")
            for i, (t, s) in enumerate(zip(ts, states)):
                testing.assert_same(to_host(t, np.float32), s, f"{name} state {i} {what} {p}")


def test_compression():
    rng = np.random.default_rng(5)
    for n, off, what in cases():
        r = testing.random(rng, n, np.float32, scale=0.5)
        tr2, tr1 = to_gpu(r, off), to_gpu(r, off)
        r2, r1 = r.copy(), r.copy()
        for _ in range(3):
            g = testing.random(rng, n, np.float32)
            tg = to_gpu(g, off)
            w2 = cuda.compress_2bit(tg, tr2, 0.5)
            w1 = cuda.compress_1bit(tg, tr1, 0.0)
            e2 = reference.compress_2bit(g, r2, 0.5)
            e1 = reference.compress_1bit(g, r1, 0.0)
            testing.assert_same(to_host(w2, np.int32).view(np.uint32), e2, f"2-bit words {what}")
            testing.assert_same(to_host(w1, np.int32).view(np.uint32), e1, f"1-bit words {what}")
            testing.assert_same(to_host(tr2, np.float32), r2, f"2-bit residual {what}")
            testing.assert_same(to_host(tr1, np.float32), r1, f"1-bit residual {what}")
        d = testing.random(rng, n, np.float32)
        td2, td1 = to_gpu(d, off), to_gpu(d, off)
        cuda.decompress_2bit_add(w2, 0.5, td2)
        cuda.decompress_1bit_add(w1, td1)
        e2d, e1d = d.copy(), d.copy()
        reference.decompress_2bit_add(e2, 0.5, e2d)
        reference.decompress_1bit_add(e1, e1d)
        testing.assert_same(to_host(td2, np.float32), e2d, f"2-bit decompress {what}")
        testing.assert_same(to_host(td1, np.float32), e1d, f"1-bit decompress {what}")


def test_topk():
    rng = np.random.default_rng(6)
    for n, off, what in cases():
        k = max(n // 7, 1) if n else 0
        r, g = testing.random(rng, n, np.float32), testing.random(rng, n, np.float32)
        if n > 4:
            g[: n // 4] = 1.5
            r[: n // 4] = 0
        tr = to_gpu(r, off)
        idx, val = cuda.compress_topk(to_gpu(g, off), tr, k)
        ei, ev = reference.compress_topk(g, r, k)
        np.testing.assert_array_equal(to_host(idx, np.int32), ei, err_msg=what)
        testing.assert_same(to_host(val, np.float32), ev, f"top-k values {what}")
        testing.assert_same(to_host(tr, np.float32), r, f"top-k residual {what}")
        d = testing.random(rng, n, np.float32)
        td = to_gpu(d, off)
        cuda.decompress_topk_add(idx, val, td)
        reference.decompress_topk_add(ei, ev, d)
        testing.assert_same(to_host(td, np.float32), d, f"top-k decompress {what}")


def test_explicit_stream():
    s = torch.cuda.Stream()
    a, b = torch.ones(1 << 20, device="cuda"), torch.ones(1 << 20, device="cuda")
    s.wait_stream(torch.cuda.current_stream())  # a and b were written on the current stream
    cuda.sum_into(a, b, stream=s)
    s.synchronize()
    assert bool((a == 2).all())
