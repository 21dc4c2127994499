"""The numpy reference of every kernel: the specification the other backends match.

Each function here defines its operation's exact result, rounding included; the C,
numba and CUDA backends are tested against it bit for bit (NaN payloads aside). It is
also a backend of its own (NumpyBackend, KVPS_KERNELS=numpy), and the servers use it directly for
float64 weights. Functions work in place and do not validate their arguments (the
public functions in kvps.kernels do); they accept any array shape.

Rounding rules, shared by all backends:

* float16 / bfloat16 arithmetic happens in float32 with one round-to-nearest-even at
  the end (numpy's and ml_dtypes' own casts). Sums of several sources add left to right.
* float32 arithmetic is plain IEEE float32, each operation rounded, in the order written
  below; no fused multiply-add. Hyper-parameters are rounded to the weight's dtype first
  and derived constants (1 - beta1, lr * wd, ...) are computed in that dtype, the way
  MXNet's kernels compute them.
* Optimizer formulas are MXNet 1.x's (src/operator/optimizer_op-inl.h and
  src/operator/contrib/adamw-inl.h; AdaGrad from python/mxnet/optimizer/optimizer.py),
  with their operation order. clip_gradient None or <= 0 turns clipping off.
* Compression follows MXNet's src/kvstore/gradient_compression-inl.h: see compress_2bit
  and compress_1bit for the bit layout.
"""
import numpy as np

from kvps.dtypes import DType, numpy_dtype

from kvps.kernels.base import Backend

bfloat16 = numpy_dtype(DType.BFLOAT16).type
F32 = np.float32
LOW_PRECISION = (numpy_dtype(DType.FLOAT16), numpy_dtype(DType.BFLOAT16))

# Bit position of element j inside its uint32 word (little-endian view of MXNet's bytes).
SHIFT2 = np.array([8 * (j // 4) + 6 - 2 * (j % 4) for j in range(16)], dtype=np.uint32)
SHIFT1 = np.array([8 * (j // 8) + 7 - (j % 8) for j in range(32)], dtype=np.uint32)


def _is_low(dtype):
    return np.dtype(dtype) in LOW_PRECISION


def _wide(a):
    """float32 copy of a low-precision array; the array itself otherwise."""
    return a.astype(F32) if _is_low(a.dtype) else a


# ---- sums, scale, axpy, casts ---------------------------------------------------------

def sum_into(dst, src):
    """dst += src. Integers wrap around; float16/bfloat16 add in float32, round once."""
    if _is_low(dst.dtype):
        dst[...] = (dst.astype(F32) + src.astype(F32)).astype(dst.dtype)
    else:
        np.add(dst, src.reshape(dst.shape), out=dst)


def sum_sources(dst, srcs):
    """dst = srcs[0] + srcs[1] + ..., left to right (float16/bfloat16: in float32)."""
    acc = srcs[0].astype(F32 if _is_low(dst.dtype) else dst.dtype).reshape(dst.shape)
    for s in srcs[1:]:
        acc = acc + _wide(s).reshape(dst.shape)
    dst[...] = acc.astype(dst.dtype)


def scale(x, alpha):
    """x *= alpha; alpha is rounded to float32 (float64 arrays: kept as float64)."""
    if x.dtype == np.float64:
        x *= np.float64(alpha)
    elif x.dtype == np.float32:
        x *= F32(alpha)
    else:
        x[...] = (x.astype(F32) * F32(alpha)).astype(x.dtype)


def axpy(y, alpha, x):
    """y += alpha * x (the product rounded first, then the sum)."""
    if y.dtype == np.float64:
        y += np.float64(alpha) * x.reshape(y.shape)
    elif y.dtype == np.float32:
        y += F32(alpha) * x.reshape(y.shape)
    else:
        y[...] = (y.astype(F32) + F32(alpha) * x.astype(F32).reshape(y.shape)).astype(y.dtype)


def cast(src, dst):
    """dst = src converted, round to nearest even (float32 <-> float16 / bfloat16)."""
    dst[...] = src.astype(dst.dtype).reshape(dst.shape)


# ---- optimizers -----------------------------------------------------------------------

def _clip_on(clip_gradient):
    return clip_gradient is not None and clip_gradient > 0


def _clip(x, c):
    # MXNet's clip: x > c -> c, x < -c -> -c, NaN passes through
    return np.minimum(np.maximum(x, -c), c)


def _grad(weight, grad):
    return grad.astype(weight.dtype, copy=False).reshape(weight.shape)


def sgd_update(weight, grad, mom, *, lr, momentum=0.0, wd=0.0, rescale_grad=1.0, clip_gradient=None,
               nesterov=False):
    """SGD as MXNet's sgd_update (mom None), sgd_mom_update, or nag_mom_update (nesterov).

    mom holds MXNet's momentum state, which includes the learning rate. NAG's momentum
    update reads the weight after its update: MXNet's in-place kernel does (out is
    weight) and so does its multi-precision kernel.
    """
    T = weight.dtype.type
    g = _grad(weight, grad)
    lr, momentum, wd, rs = T(lr), T(momentum), T(wd), T(rescale_grad)
    clip = _clip_on(clip_gradient)
    c = T(clip_gradient) if clip else None
    if mom is None:
        a = T(1) - lr * wd
        if clip:
            weight[...] = a * weight - lr * _clip(rs * g, c)
        else:
            weight[...] = a * weight - (lr * rs) * g
    elif not nesterov:
        if clip:
            mom[...] = momentum * mom - (lr * wd) * weight - lr * _clip(rs * g, c)
        else:
            mom[...] = momentum * mom - (lr * wd) * weight - (lr * rs) * g
        weight += mom
    else:
        gg = _clip(rs * g, c) if clip else rs * g
        m1 = momentum * mom
        weight[...] = (weight - m1) + (momentum + T(1)) * (m1 - lr * (gg + wd * weight))
        mom[...] = m1 - lr * (gg + wd * weight)


def adam_update(weight, grad, mean, var, *, lr, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.0,
                rescale_grad=1.0, clip_gradient=None):
    """MXNet's adam_update; lr arrives bias-corrected, as MXNet's Python Adam passes it."""
    T = weight.dtype.type
    g = _grad(weight, grad)
    lr, b1, b2, eps, wd, rs = T(lr), T(beta1), T(beta2), T(epsilon), T(wd), T(rescale_grad)
    gg = rs * g + wd * weight
    if _clip_on(clip_gradient):
        gg = _clip(gg, T(clip_gradient))
    mean[...] = b1 * mean + (T(1) - b1) * gg
    var[...] = b2 * var + ((T(1) - b2) * gg) * gg
    weight -= (lr * mean) / (np.sqrt(var) + eps)


def adamw_update(weight, grad, mean, var, *, lr, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.0,
                 rescale_grad=1.0, clip_gradient=None, eta=1.0):
    """MXNet's contrib adamw_update: decoupled weight decay, eta the schedule multiplier.

    As in MXNet, a non-finite or zero rescale_grad (an overflowed loss scale) skips the
    update and leaves weight and states untouched.
    """
    T = weight.dtype.type
    if not np.isfinite(T(rescale_grad)) or T(rescale_grad) == 0:
        return
    g = _grad(weight, grad)
    lr, b1, b2, eps, wd, rs, eta = T(lr), T(beta1), T(beta2), T(epsilon), T(wd), T(rescale_grad), T(eta)
    gg = rs * g
    if _clip_on(clip_gradient):
        gg = _clip(gg, T(clip_gradient))
    mean[...] = b1 * mean + (T(1) - b1) * gg
    var[...] = b2 * var + (T(1) - b2) * (gg * gg)
    weight[...] = weight - eta * ((lr * mean) / (np.sqrt(var) + eps) + wd * weight)


def adagrad_update(weight, grad, history, *, lr, epsilon=1e-7, wd=0.0, rescale_grad=1.0, clip_gradient=None):
    """MXNet's AdaGrad (its dense Python update): weight += (g/sqrt(h+eps) + wd*weight) * -lr."""
    T = weight.dtype.type
    g = _grad(weight, grad)
    lr, eps, wd, rs = T(lr), T(epsilon), T(wd), T(rescale_grad)
    gg = rs * g
    if _clip_on(clip_gradient):
        gg = _clip(gg, T(clip_gradient))
    history += gg * gg
    div = gg / np.sqrt(history + eps)
    weight[...] = weight + (div + weight * wd) * (-lr)


def rmsprop_update(weight, grad, n, *, lr, gamma1=0.9, epsilon=1e-8, wd=0.0, rescale_grad=1.0,
                   clip_gradient=None, clip_weights=None):
    """MXNet's rmsprop_update (not centred): wd is added before clipping, eps sits inside the sqrt."""
    T = weight.dtype.type
    g = _grad(weight, grad)
    lr, g1, eps, wd, rs = T(lr), T(gamma1), T(epsilon), T(wd), T(rescale_grad)
    gg = rs * g + wd * weight
    if _clip_on(clip_gradient):
        gg = _clip(gg, T(clip_gradient))
    n[...] = (T(1) - g1) * (gg * gg) + g1 * n
    weight[...] = weight - lr * (gg / np.sqrt(n + eps))
    if _clip_on(clip_weights):
        weight[...] = _clip(weight, T(clip_weights))


# ---- gradient compression ----------------------------------------------------------------

def _pack(codes, shifts, per_word):
    n = codes.size
    padded = np.zeros(-(-n // per_word) * per_word, dtype=np.uint32)
    padded[:n] = codes
    return np.bitwise_or.reduce(padded.reshape(-1, per_word) << shifts, axis=1).astype(np.uint32)


def _unpack(packed, shifts, per_word, n, width):
    words = np.repeat(packed.astype(np.uint32), per_word)[:n]
    return (words >> np.tile(shifts, -(-n // per_word))[:n]) & np.uint32((1 << width) - 1)


def compress_2bit(grad, residual, threshold):
    """MXNet's 2-bit quantisation with error feedback; returns ceil(n/16) uint32 words.

    residual += grad; where residual >= t emit +t (code 11) and subtract t; else where
    residual <= -t emit -t (code 10) and subtract -t; else emit 0 (code 00). Element i
    is in word i // 16 at bit SHIFT2[i % 16]: MXNet fills byte (i % 16) // 4 of the
    word (memory order) from its top bits down, so element 0 is bits 7-6 of byte 0.
    """
    t = F32(threshold)
    r = residual.reshape(-1)
    r += grad.reshape(-1)
    pos = r >= t
    neg = (r <= -t) & ~pos
    np.subtract(r, t, out=r, where=pos)
    np.subtract(r, -t, out=r, where=neg)
    codes = np.where(pos, np.uint32(3), np.where(neg, np.uint32(2), np.uint32(0)))
    return _pack(codes, SHIFT2, 16)


def decompress_2bit_add(packed, threshold, dst):
    """dst += decoded 2-bit values (11 -> +t, 10 -> -t, anything else -> 0)."""
    t = F32(threshold)
    d = dst.reshape(-1)
    codes = _unpack(packed.reshape(-1), SHIFT2, 16, d.size, 2)
    d += np.where(codes == 3, t, np.where(codes == 2, -t, F32(0))).astype(F32)


def compress_1bit(grad, residual, threshold):
    """MXNet's 1-bit quantisation with error feedback; returns ceil(n/32) uint32 words.

    residual += grad; where residual > t emit +1 (bit 1) and subtract 1, elsewhere emit
    -1 (bit 0) and add 1. The threshold only picks the sign; the values are always +-1.
    Element i is bit SHIFT1[i % 32] of word i // 32 (bit 7 - i % 8 of byte (i % 32) // 8).
    """
    t = F32(threshold)
    r = residual.reshape(-1)
    r += grad.reshape(-1)
    one = r > t
    np.subtract(r, F32(1), out=r, where=one)
    np.add(r, F32(1), out=r, where=~one)
    return _pack(one.astype(np.uint32), SHIFT1, 32)


def decompress_1bit_add(packed, dst):
    """dst += decoded 1-bit values (1 -> +1, 0 -> -1)."""
    d = dst.reshape(-1)
    bits = _unpack(packed.reshape(-1), SHIFT1, 32, d.size, 1)
    d += np.where(bits == 1, F32(1), F32(-1)).astype(F32)


def topk_index_dtype(n):
    """int32 indices, or int64 for arrays of 2**31 elements or more."""
    return np.dtype(np.int32) if n <= np.iinfo(np.int32).max else np.dtype(np.int64)


def compress_topk(grad, residual, k):
    """Top-k sparsification with error feedback; returns (indices, values).

    residual += grad; the k entries of largest |residual| are emitted (values float32,
    indices ascending) and set to zero in residual. Magnitude is compared on the float32
    bit pattern without its sign, so NaN ranks above inf; ties go to the lower index.
    k is clamped to the array's size.
    """
    r = residual.reshape(-1)
    r += grad.reshape(-1)
    k = min(int(k), r.size)
    keys = (r.view(np.uint32) & np.uint32(0x7FFFFFFF)).astype(np.int64)
    idx = np.sort(np.argsort(-keys, kind="stable")[:k])
    values = r[idx].copy()
    r[idx] = 0
    return idx.astype(topk_index_dtype(r.size)), values


def decompress_topk_add(indices, values, dst):
    """dst[indices[j]] += values[j] in order; repeated indices add up."""
    np.add.at(dst.reshape(-1), indices.astype(np.int64), values.astype(F32))


class NumpyBackend(Backend):
    """The reference itself, as a backend."""

    name = "numpy"

    def details(self):
        return "numpy reference (kvps/kernels/reference.py)"

    def sum_into(self, dst, src):
        sum_into(dst, src)

    def sum_sources(self, dst, srcs):
        sum_sources(dst, srcs)

    def scale(self, x, alpha):
        scale(x, alpha)

    def axpy(self, y, alpha, x):
        axpy(y, alpha, x)

    def cast(self, src, dst):
        cast(src, dst)

    def sgd_update(self, weight, grad, mom, **kw):
        sgd_update(weight, grad, mom, **kw)

    def adam_update(self, weight, grad, mean, var, **kw):
        adam_update(weight, grad, mean, var, **kw)

    def adamw_update(self, weight, grad, mean, var, **kw):
        adamw_update(weight, grad, mean, var, **kw)

    def adagrad_update(self, weight, grad, history, **kw):
        adagrad_update(weight, grad, history, **kw)

    def rmsprop_update(self, weight, grad, n, **kw):
        rmsprop_update(weight, grad, n, **kw)

    def compress_2bit(self, grad, residual, threshold):
        return compress_2bit(grad, residual, threshold)

    def decompress_2bit_add(self, packed, threshold, dst):
        decompress_2bit_add(packed, threshold, dst)

    def compress_1bit(self, grad, residual, threshold):
        return compress_1bit(grad, residual, threshold)

    def decompress_1bit_add(self, packed, dst):
        decompress_1bit_add(packed, dst)

    def compress_topk(self, grad, residual, k):
        return compress_topk(grad, residual, k)

    def decompress_topk_add(self, indices, values, dst):
        decompress_topk_add(indices, values, dst)
