"""numba implementations of the kernels, for installs without the C library.

Compiled on first use and cached on disk (cache=True), with nogil so server threads run
them in parallel. numba has no float16/bfloat16 arithmetic, so those arrays are handled
as uint16 bit patterns: widened through a 65536-entry float32 table (built once from
numpy's exact casts) and narrowed with the same integer round-to-nearest-even as the C
library (csrc/kvps_common.h). Optimizers with float16/bfloat16 gradients widen the
gradient first, so each optimizer compiles once. Results equal reference.py bit for bit.
"""
import numba as nb
import numpy as np

from kvps.kernels.base import Backend
from kvps.kernels.reference import bfloat16, topk_index_dtype

F32 = np.float32
_JIT = dict(nogil=True, cache=True, error_model="numpy")  # IEEE division: no ZeroDivisionError
_KIND = {np.dtype(np.float16): 0, np.dtype(bfloat16): 1}


def _tables():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    return (bits.view(np.float16).astype(F32), bits.view(bfloat16).astype(F32))


# ---- float32 bits -> float16 / bfloat16 bits (round to nearest even) -----------------------

@nb.njit(**_JIT)
def _to_f16(x):
    sign = (x >> 16) & 0x8000
    a = x & 0x7FFFFFFF
    if a >= 0x7F800000:
        if a == 0x7F800000:
            return sign | 0x7C00
        r = 0x7C00 | ((a & 0x7FFFFF) >> 13)
        if r == 0x7C00:
            r += 1
        return sign | r
    if a >= 0x47800000:
        return sign | 0x7C00
    if a >= 0x38800000:
        bits = (((a >> 23) - 112) << 10) | ((a >> 13) & 0x3FF)
        rem = a & 0x1FFF
        if rem > 0x1000 or (rem == 0x1000 and (bits & 1) == 1):
            bits += 1
        return sign | bits
    if a <= 0x33000000:
        return sign
    s = 126 - (a >> 23)
    man = (a & 0x7FFFFF) | 0x800000
    q = man >> s
    rem = man & ((1 << s) - 1)
    half = 1 << (s - 1)
    if rem > half or (rem == half and (q & 1) == 1):
        q += 1
    return sign | q


@nb.njit(**_JIT)
def _to_bf16(x):
    if (x & 0x7FFFFFFF) > 0x7F800000:
        return ((x >> 16) & 0x8000) | 0x7FC0
    return ((x + 0x7FFF + ((x >> 16) & 1)) >> 16) & 0xFFFF


@nb.njit(**_JIT)
def _narrow(bits, kind):
    x = np.int64(bits)
    return _to_f16(x) if kind == 0 else _to_bf16(x)


# ---- element-wise -----------------------------------------------------------------------

@nb.njit(**_JIT)
def _add(d, s):
    for i in range(d.size):
        d[i] += s[i]


@nb.njit(**_JIT)
def _add_lp(d, s, table, kind):
    scratch = np.empty(1, np.float32)
    bits = scratch.view(np.uint32)
    for i in range(d.size):
        scratch[0] = table[d[i]] + table[s[i]]
        d[i] = _narrow(bits[0], kind)


@nb.njit(**_JIT)
def _widen_add(acc, s, table):
    for i in range(acc.size):
        acc[i] += table[s[i]]


@nb.njit(**_JIT)
def _narrow_into(d, src_bits, kind):
    for i in range(d.size):
        d[i] = _narrow(src_bits[i], kind)


@nb.njit(**_JIT)
def _widen_into(d, s, table):
    for i in range(d.size):
        d[i] = table[s[i]]


@nb.njit(**_JIT)
def _scale(x, a):
    for i in range(x.size):
        x[i] *= a


@nb.njit(**_JIT)
def _axpy(y, a, x):
    for i in range(y.size):
        y[i] += a * x[i]


@nb.njit(**_JIT)
def _scale_axpy_lp(y, a, x, table, kind, is_axpy):
    scratch = np.empty(1, np.float32)
    bits = scratch.view(np.uint32)
    for i in range(y.size):
        if is_axpy:
            scratch[0] = table[y[i]] + a * table[x[i]]
        else:
            scratch[0] = table[y[i]] * a
        y[i] = _narrow(bits[0], kind)


# ---- optimizers: the operation order of reference.py ---------------------------------------

@nb.njit(**_JIT)
def _clipf(x, c):
    if x > c:
        return c
    if x < -c:
        return -c
    return x


@nb.njit(**_JIT)
def _sgd(w, g, a, lr, lr_rs, rs, c, clip_on):
    for i in range(w.size):
        if clip_on:
            w[i] = a * w[i] - lr * _clipf(rs * g[i], c)
        else:
            w[i] = a * w[i] - lr_rs * g[i]


@nb.njit(**_JIT)
def _sgd_mom(w, g, mom, mu, lr_wd, lr, lr_rs, rs, c, clip_on):
    for i in range(w.size):
        m = mu * mom[i] - lr_wd * w[i]
        if clip_on:
            m = m - lr * _clipf(rs * g[i], c)
        else:
            m = m - lr_rs * g[i]
        mom[i] = m
        w[i] = w[i] + m


@nb.njit(**_JIT)
def _nag(w, g, mom, mu, mu1, lr, wd, rs, c):
    for i in range(w.size):
        wv = w[i]
        gg = _clipf(rs * g[i], c)
        m1 = mu * mom[i]
        wn = (wv - m1) + mu1 * (m1 - lr * (gg + wd * wv))
        mom[i] = m1 - lr * (gg + wd * wn)
        w[i] = wn


@nb.njit(**_JIT)
def _adam(w, g, mean, var, b1, omb1, b2, omb2, lr, eps, wd, rs, c, eta, decoupled):
    for i in range(w.size):
        wv = w[i]
        if decoupled:
            gg = _clipf(rs * g[i], c)
            m = b1 * mean[i] + omb1 * gg
            v = b2 * var[i] + omb2 * (gg * gg)
            w[i] = wv - eta * ((lr * m) / (np.sqrt(v) + eps) + wd * wv)
        else:
            gg = _clipf(rs * g[i] + wd * wv, c)
            m = b1 * mean[i] + omb1 * gg
            v = b2 * var[i] + (omb2 * gg) * gg
            w[i] = wv - (lr * m) / (np.sqrt(v) + eps)
        mean[i] = m
        var[i] = v


@nb.njit(**_JIT)
def _adagrad(w, g, hist, neg_lr, eps, wd, rs, c):
    for i in range(w.size):
        wv = w[i]
        gg = _clipf(rs * g[i], c)
        h = hist[i] + gg * gg
        div = gg / np.sqrt(h + eps)
        hist[i] = h
        w[i] = wv + (div + wv * wd) * neg_lr


@nb.njit(**_JIT)
def _rmsprop(w, g, sn, omg, g1, lr, eps, wd, rs, c, cw):
    for i in range(w.size):
        wv = w[i]
        gg = _clipf(rs * g[i] + wd * wv, c)
        nv = omg * (gg * gg) + g1 * sn[i]
        sn[i] = nv
        w[i] = _clipf(wv - lr * (gg / np.sqrt(nv + eps)), cw)


# ---- compression ---------------------------------------------------------------------------

@nb.njit(**_JIT)
def _compress2(g, r, out, t):
    n = g.size
    nt = -t
    for w in range(out.size):
        word = 0
        base = w * 16
        for j in range(min(16, n - base)):
            v = r[base + j] + g[base + j]
            code = 0
            if v >= t:
                code = 3
                v = v - t
            elif v <= nt:
                code = 2
                v = v - nt
            r[base + j] = v
            word |= code << (8 * (j >> 2) + 6 - 2 * (j & 3))
        out[w] = word


@nb.njit(**_JIT)
def _decompress2(packed, values, d):
    # values[code]: 0 -> 0, 1 -> 0, 2 -> -t, 3 -> +t (a table: no data-dependent branch)
    for i in range(d.size):
        j = i & 15
        d[i] += values[(np.int64(packed[i >> 4]) >> (8 * (j >> 2) + 6 - 2 * (j & 3))) & 3]


@nb.njit(**_JIT)
def _compress1(g, r, out, t):
    n = g.size
    one = np.float32(1.0)
    for w in range(out.size):
        word = 0
        base = w * 32
        for j in range(min(32, n - base)):
            v = r[base + j] + g[base + j]
            if v > t:
                word |= 1 << (8 * (j >> 3) + 7 - (j & 7))
                v = v - one
            else:
                v = v + one
            r[base + j] = v
        out[w] = word


@nb.njit(**_JIT)
def _decompress1(packed, values, d):
    # values[bit]: 0 -> -1, 1 -> +1
    for i in range(d.size):
        j = i & 31
        d[i] += values[(np.int64(packed[i >> 5]) >> (8 * (j >> 3) + 7 - (j & 7))) & 1]


@nb.njit(**_JIT)
def _bucket(hist, need):
    """Bucket holding the need-th largest counted key, and the rank inside it."""
    above = 0
    b = hist.size - 1
    while b > 0 and above + hist[b] < need:
        above += hist[b]
        b -= 1
    return b, need - above


@nb.njit(**_JIT)
def _topk(r_bits, k):
    """Indices (ascending) of the k largest keys: csrc/topk.c's radix select."""
    n = r_bits.size
    if k >= n:
        return np.arange(n)
    out = np.empty(k, np.int64)
    if k == 0:
        return out
    hist = np.zeros(2048, np.int64)
    for i in range(n):
        hist[(np.int64(r_bits[i]) & 0x7FFFFFFF) >> 20] += 1
    b1, need = _bucket(hist, k)
    cand = np.empty(hist[b1], np.int64)
    m = 0
    for i in range(n):
        key = np.int64(r_bits[i]) & 0x7FFFFFFF
        if (key >> 20) == b1:
            cand[m] = key
            m += 1
    hist2 = np.zeros(1024, np.int64)
    for c in range(m):
        hist2[(cand[c] >> 10) & 1023] += 1
    b2, need = _bucket(hist2, need)
    m2 = 0
    for c in range(m):
        if ((cand[c] >> 10) & 1023) == b2:
            cand[m2] = cand[c]
            m2 += 1
    hist2[:] = 0
    for c in range(m2):
        hist2[cand[c] & 1023] += 1
    b3, ties = _bucket(hist2, need)
    kth = (b1 << 20) | (b2 << 10) | b3
    j = 0
    for i in range(n):
        if j == k:
            break
        key = np.int64(r_bits[i]) & 0x7FFFFFFF
        if key > kth or (key == kth and ties > 0):
            if key == kth:
                ties -= 1
            out[j] = i
            j += 1
    return out


@nb.njit(**_JIT)
def _scatter_add(d, idx, v):
    for j in range(idx.size):
        d[idx[j]] += v[j]


class NumbaBackend(Backend):
    """The kernels compiled by numba; arrays were validated by kvps.kernels."""

    name = "numba"

    def __init__(self):
        self.f16_table, self.bf16_table = _tables()

    def details(self):
        return f"numba {nb.__version__} (kvps/kernels/numba_impl.py, compiled on first use, cached)"

    def _table(self, dtype):
        return self.f16_table if _KIND[dtype] == 0 else self.bf16_table

    def _f32_grad(self, grad):
        if grad.dtype == np.float32:
            return grad.reshape(-1)
        return self._table(grad.dtype)[grad.reshape(-1).view(np.uint16)]

    def sum_into(self, dst, src):
        d, s = dst.reshape(-1), src.reshape(-1)
        if dst.dtype in _KIND:
            _add_lp(d.view(np.uint16), s.view(np.uint16), self._table(dst.dtype), _KIND[dst.dtype])
        else:
            _add(d, s)

    def sum_sources(self, dst, srcs):
        d = dst.reshape(-1)
        flat = [s.reshape(-1) for s in srcs]
        if dst.dtype in _KIND:
            table = self._table(dst.dtype)
            acc = table[flat[0].view(np.uint16)]
            for s in flat[1:]:
                _widen_add(acc, s.view(np.uint16), table)
            _narrow_into(d.view(np.uint16), acc.view(np.uint32), _KIND[dst.dtype])
            return
        # dst may be one of the sources: accumulate elsewhere when it is a later one
        acc = d if not any(np.may_share_memory(d, s) for s in flat[1:]) else np.empty_like(d)
        acc[...] = flat[0]
        for s in flat[1:]:
            _add(acc, s)
        if acc is not d:
            d[...] = acc

    def scale(self, x, alpha):
        v = x.reshape(-1)
        if x.dtype in _KIND:
            _scale_axpy_lp(v.view(np.uint16), F32(alpha), v.view(np.uint16), self._table(x.dtype),
                           _KIND[x.dtype], False)
        else:
            _scale(v, x.dtype.type(alpha))

    def axpy(self, y, alpha, x):
        yv, xv = y.reshape(-1), x.reshape(-1)
        if y.dtype in _KIND:
            _scale_axpy_lp(yv.view(np.uint16), F32(alpha), xv.view(np.uint16), self._table(y.dtype),
                           _KIND[y.dtype], True)
        else:
            _axpy(yv, y.dtype.type(alpha), xv)

    def cast(self, src, dst):
        s, d = src.reshape(-1), dst.reshape(-1)
        if src.dtype == np.float32:
            _narrow_into(d.view(np.uint16), s.view(np.uint32), _KIND[dst.dtype])
        else:
            _widen_into(d, s.view(np.uint16), self._table(src.dtype))

    def sgd_update(self, weight, grad, mom, *, lr, momentum, wd, rescale_grad, clip_gradient, nesterov):
        w, g = weight.reshape(-1), self._f32_grad(grad)
        lr, mu, wd, rs = F32(lr), F32(momentum), F32(wd), F32(rescale_grad)
        clip_on = clip_gradient is not None and clip_gradient > 0
        c = F32(clip_gradient) if clip_on else F32(np.inf)
        if mom is None:
            _sgd(w, g, F32(1) - lr * wd, lr, lr * rs, rs, c, clip_on)
        elif nesterov:
            _nag(w, g, mom.reshape(-1), mu, mu + F32(1), lr, wd, rs, c)
        else:
            _sgd_mom(w, g, mom.reshape(-1), mu, lr * wd, lr, lr * rs, rs, c, clip_on)

    def _adam(self, weight, grad, mean, var, lr, beta1, beta2, epsilon, wd, rescale_grad, clip_gradient, eta,
              decoupled):
        b1, b2 = F32(beta1), F32(beta2)
        c = F32(clip_gradient) if clip_gradient is not None and clip_gradient > 0 else F32(np.inf)
        _adam(weight.reshape(-1), self._f32_grad(grad), mean.reshape(-1), var.reshape(-1), b1, F32(1) - b1, b2,
              F32(1) - b2, F32(lr), F32(epsilon), F32(wd), F32(rescale_grad), c, F32(eta), decoupled)

    def adam_update(self, weight, grad, mean, var, *, lr, beta1, beta2, epsilon, wd, rescale_grad, clip_gradient):
        self._adam(weight, grad, mean, var, lr, beta1, beta2, epsilon, wd, rescale_grad, clip_gradient, 1.0, False)

    def adamw_update(self, weight, grad, mean, var, *, lr, beta1, beta2, epsilon, wd, rescale_grad, clip_gradient,
                     eta):
        if not np.isfinite(F32(rescale_grad)) or F32(rescale_grad) == 0:
            return  # an overflowed loss scale skips the update, as in MXNet
        self._adam(weight, grad, mean, var, lr, beta1, beta2, epsilon, wd, rescale_grad, clip_gradient, eta, True)

    def adagrad_update(self, weight, grad, history, *, lr, epsilon, wd, rescale_grad, clip_gradient):
        c = F32(clip_gradient) if clip_gradient is not None and clip_gradient > 0 else F32(np.inf)
        _adagrad(weight.reshape(-1), self._f32_grad(grad), history.reshape(-1), -F32(lr), F32(epsilon), F32(wd),
                 F32(rescale_grad), c)

    def rmsprop_update(self, weight, grad, n, *, lr, gamma1, epsilon, wd, rescale_grad, clip_gradient,
                       clip_weights):
        c = F32(clip_gradient) if clip_gradient is not None and clip_gradient > 0 else F32(np.inf)
        cw = F32(clip_weights) if clip_weights is not None and clip_weights > 0 else F32(np.inf)
        g1 = F32(gamma1)
        _rmsprop(weight.reshape(-1), self._f32_grad(grad), n.reshape(-1), F32(1) - g1, g1, F32(lr), F32(epsilon),
                 F32(wd), F32(rescale_grad), c, cw)

    def compress_2bit(self, grad, residual, threshold):
        out = np.empty(-(-grad.size // 16), dtype=np.uint32)
        _compress2(grad.reshape(-1), residual.reshape(-1), out, F32(threshold))
        return out

    def decompress_2bit_add(self, packed, threshold, dst):
        t = F32(threshold)
        _decompress2(packed.reshape(-1), np.array([0, 0, -t, t], np.float32), dst.reshape(-1))

    def compress_1bit(self, grad, residual, threshold):
        out = np.empty(-(-grad.size // 32), dtype=np.uint32)
        _compress1(grad.reshape(-1), residual.reshape(-1), out, F32(threshold))
        return out

    def decompress_1bit_add(self, packed, dst):
        _decompress1(packed.reshape(-1), np.array([-1, 1], np.float32), dst.reshape(-1))

    def compress_topk(self, grad, residual, k):
        r = residual.reshape(-1)
        _add(r, grad.reshape(-1))
        idx = _topk(r.view(np.uint32), min(k, r.size))
        values = r[idx]
        r[idx] = 0
        return idx.astype(topk_index_dtype(r.size)), values

    def decompress_topk_add(self, indices, values, dst):
        _scatter_add(dst.reshape(-1), indices.reshape(-1), values.reshape(-1))
