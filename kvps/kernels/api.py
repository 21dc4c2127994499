"""The public kernel functions: validate at the boundary, count, dispatch to the backend.

Every function checks its arrays (numpy arrays, C-contiguous, the right dtypes and
sizes, outputs writeable) and raises TypeError or ValueError naming the argument, then
calls the active backend. The backend is chosen on first use from KVPS_KERNELS (parsed
by kvps.config) unless `use_backend` picked one; `counters()` tells how often each
operation ran on it.
"""
import collections
import numbers
import threading

import numpy as np

from kvps.dtypes import KERNEL_CODES
from kvps.errors import KernelUnavailable

from kvps.kernels import select as _select
from kvps.kernels.reference import bfloat16, topk_index_dtype

F32, F64, F16, BF16 = (np.dtype(t) for t in (np.float32, np.float64, np.float16, bfloat16))
I32, I64, U32 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.uint32)
SUM_DTYPES = tuple(KERNEL_CODES)  # every dtype of the kernels' table (kvps/dtypes.py), in code order
FLOAT_DTYPES = (F32, F64, F16, BF16)
GRAD_DTYPES = (F32, F16, BF16)
CASTS = {(F32, F16), (F32, BF16), (F16, F32), (BF16, F32)}


def configured_backend(environ=None):
    """The KVPS_KERNELS value, read through kvps.config (the registry of every variable)."""
    from kvps.config import Config
    return Config.from_env(environ).kernels


class Kernels:
    """The active backend, chosen once, and the per-operation call counts on it."""

    def __init__(self, registry=None):
        self.registry = registry or _select.default_registry()
        self._lock = threading.Lock()
        self._active = None
        self._requested = None
        self._counts = collections.Counter()

    @property
    def active(self):
        if self._active is None:
            with self._lock:
                if self._active is None:
                    requested = configured_backend()
                    self._active = _select.choose(self.registry, requested)
                    self._requested = requested
        return self._active

    @property
    def requested(self):
        """The KVPS_KERNELS value (or use_backend argument) the active backend came from."""
        return self._requested or "auto"

    def use(self, name):
        """Switch to a backend ("auto", "c", "cuda", "numba", "numpy"); resets the counts."""
        chosen = _select.choose(self.registry, name)
        with self._lock:
            self._active, self._requested = chosen, name
            self._counts.clear()
        return chosen.name

    def count(self, op):
        with self._lock:
            self._counts[op] += 1

    def counters(self):
        with self._lock:
            return dict(self._counts)

    def reset_counters(self):
        with self._lock:
            self._counts.clear()


_kernels = Kernels()


def _call(op):
    _kernels.count(op)
    return _kernels.active


# ---- validation ------------------------------------------------------------------------

def _flags(a):
    f = a.flags
    return (f"C_CONTIGUOUS={f.c_contiguous} F_CONTIGUOUS={f.f_contiguous} WRITEABLE={f.writeable} "
            f"ALIGNED={f.aligned}")


def _array(op, name, a, dtypes, writeable=False):
    """`a`, checked: a C-contiguous numpy array of one of `dtypes` (None: any), writeable if asked."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{op}: {name} must be a numpy array, got {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{op}: {name} {a.dtype} {a.shape} is not C-contiguous (flags: {_flags(a)}); "
                         f"pass np.ascontiguousarray({name})")
    if dtypes is not None and a.dtype not in dtypes:
        raise ValueError(f"{op}: {name} is {a.dtype} {a.shape}; expected {' or '.join(d.name for d in dtypes)}")
    if writeable and not a.flags.writeable:
        raise ValueError(f"{op}: {name} {a.dtype} {a.shape} is read-only (flags: {_flags(a)})")
    return a


def _same(op, name_a, a, name_b, b, dtype=True):
    if a.size != b.size or (dtype and a.dtype != b.dtype):
        what = "dtype and size" if dtype else "size"
        raise ValueError(f"{op}: {name_a} is {a.dtype} {a.shape} but {name_b} is {b.dtype} {b.shape}; "
                         f"they must have the same {what}")


def _number(op, name, value, positive=False, optional=False):
    if type(value) is float and not positive:  # the common case, without the ABC check
        return value
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name}={value!r} is not a number")
    if positive and not value > 0:
        raise ValueError(f"{op}: {name}={value!r} must be > 0")
    return float(value)


# ---- sums, scale, axpy, casts --------------------------------------------------------------

def sum_into(dst, src):
    """dst += src (same dtype and size; float16/bfloat16 computed in float32, rounded once)."""
    _array("sum_into", "dst", dst, SUM_DTYPES, writeable=True)
    _array("sum_into", "src", src, SUM_DTYPES)
    _same("sum_into", "dst", dst, "src", src)
    _call("sum_into").sum_into(dst, src)


def copy(dst, src):
    """dst[:] = src, byte for byte (any dtypes, the same number of bytes). The C backend streams
    big copies past the cache (csrc/kvps_kernels.h: kvps_copy): shared-memory pushes and pulls
    copy whole models that nobody reads again soon."""
    _array("copy", "src", src, None)
    _array("copy", "dst", dst, None, writeable=True)
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy: dst is {dst.dtype} {dst.shape} ({dst.nbytes} bytes) but src is {src.dtype} "
                         f"{src.shape} ({src.nbytes} bytes); they must have the same size in bytes")
    _call("copy").copy(dst, src)


def sum_sources(dst, srcs):
    """dst[:] = srcs[0] + srcs[1] + ..., left to right (low precision: in float32, rounded once)."""
    _array("sum_sources", "dst", dst, SUM_DTYPES, writeable=True)
    if not isinstance(srcs, (list, tuple)) or not srcs:
        raise ValueError(f"sum_sources: srcs must be a non-empty list of arrays, got {srcs!r:.80}")
    for i, s in enumerate(srcs):
        _array("sum_sources", f"srcs[{i}]", s, SUM_DTYPES)
        _same("sum_sources", "dst", dst, f"srcs[{i}]", s)
    _call("sum_sources").sum_sources(dst, list(srcs))


def scale(x, alpha):
    """x *= alpha (float dtypes; alpha rounded to float32 except for float64 arrays)."""
    _array("scale", "x", x, FLOAT_DTYPES, writeable=True)
    alpha = _number("scale", "alpha", alpha)
    _call("scale").scale(x, alpha)


def axpy(y, alpha, x):
    """y += alpha * x (float dtypes, same dtype and size)."""
    _array("axpy", "y", y, FLOAT_DTYPES, writeable=True)
    _array("axpy", "x", x, FLOAT_DTYPES)
    _same("axpy", "y", y, "x", x)
    alpha = _number("axpy", "alpha", alpha)
    _call("axpy").axpy(y, alpha, x)


def cast(src, dst):
    """dst = src converted: float32 -> float16/bfloat16 (round to nearest even) or back."""
    _array("cast", "src", src, FLOAT_DTYPES)
    _array("cast", "dst", dst, FLOAT_DTYPES, writeable=True)
    if (src.dtype, dst.dtype) not in CASTS:
        raise ValueError(f"cast: {src.dtype} -> {dst.dtype} is not supported (float32 <-> float16 / bfloat16)")
    _same("cast", "src", src, "dst", dst, dtype=False)
    _call("cast").cast(src, dst)


# ---- optimizers ----------------------------------------------------------------------------

def _opt_arrays(op, weight, grad, **states):
    _array(op, "weight", weight, (F32,), writeable=True)
    _array(op, "grad", grad, GRAD_DTYPES)
    _same(op, "weight", weight, "grad", grad, dtype=False)
    for name, s in states.items():
        _array(op, name, s, (F32,), writeable=True)
        _same(op, "weight", weight, name, s)


def _common(op, lr, wd, rescale_grad, clip_gradient):
    return dict(lr=_number(op, "lr", lr), wd=_number(op, "wd", wd),
                rescale_grad=_number(op, "rescale_grad", rescale_grad),
                clip_gradient=_number(op, "clip_gradient", clip_gradient, optional=True))


def sgd_update(weight, grad, mom, *, lr, momentum=0.0, wd=0.0, rescale_grad=1.0, clip_gradient=None,
               nesterov=False):
    """Fused SGD: plain when mom is None, else MXNet's momentum SGD or (nesterov) NAG.

    weight and mom are float32; grad is float32, float16 or bfloat16. See
    reference.sgd_update for the formulas. Raises ValueError if momentum != 0 but mom is None.
    """
    op = "sgd_update"
    if mom is None:
        _opt_arrays(op, weight, grad)
    else:
        _opt_arrays(op, weight, grad, mom=mom)
    kw = _common(op, lr, wd, rescale_grad, clip_gradient)
    kw["momentum"] = _number(op, "momentum", momentum)
    if mom is None and kw["momentum"] != 0:
        raise ValueError(f"{op}: momentum={momentum} needs a momentum state array, got mom=None")
    _call(op).sgd_update(weight, grad, mom, nesterov=bool(nesterov), **kw)


def adam_update(weight, grad, mean, var, *, lr, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.0, rescale_grad=1.0,
                clip_gradient=None):
    """Fused Adam (MXNet's adam_update; lr already bias-corrected by the caller)."""
    op = "adam_update"
    _opt_arrays(op, weight, grad, mean=mean, var=var)
    kw = _common(op, lr, wd, rescale_grad, clip_gradient)
    _call(op).adam_update(weight, grad, mean, var, beta1=_number(op, "beta1", beta1),
                          beta2=_number(op, "beta2", beta2), epsilon=_number(op, "epsilon", epsilon), **kw)


def adamw_update(weight, grad, mean, var, *, lr, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.0, rescale_grad=1.0,
                 clip_gradient=None, eta=1.0):
    """Fused AdamW (MXNet's contrib adamw_update: decoupled weight decay, eta multiplier).

    A non-finite or zero rescale_grad skips the update, as in MXNet.
    """
    op = "adamw_update"
    _opt_arrays(op, weight, grad, mean=mean, var=var)
    kw = _common(op, lr, wd, rescale_grad, clip_gradient)
    _call(op).adamw_update(weight, grad, mean, var, beta1=_number(op, "beta1", beta1),
                           beta2=_number(op, "beta2", beta2), epsilon=_number(op, "epsilon", epsilon),
                           eta=_number(op, "eta", eta), **kw)


def adagrad_update(weight, grad, history, *, lr, epsilon=1e-7, wd=0.0, rescale_grad=1.0, clip_gradient=None):
    """Fused AdaGrad (MXNet's dense AdaGrad)."""
    op = "adagrad_update"
    _opt_arrays(op, weight, grad, history=history)
    kw = _common(op, lr, wd, rescale_grad, clip_gradient)
    _call(op).adagrad_update(weight, grad, history, epsilon=_number(op, "epsilon", epsilon), **kw)


def rmsprop_update(weight, grad, n, *, lr, gamma1=0.9, epsilon=1e-8, wd=0.0, rescale_grad=1.0, clip_gradient=None,
                   clip_weights=None):
    """Fused RMSProp (MXNet's rmsprop_update, not centred); clip_weights as MXNet's."""
    op = "rmsprop_update"
    _opt_arrays(op, weight, grad, n=n)
    kw = _common(op, lr, wd, rescale_grad, clip_gradient)
    _call(op).rmsprop_update(weight, grad, n, gamma1=_number(op, "gamma1", gamma1),
                             epsilon=_number(op, "epsilon", epsilon),
                             clip_weights=_number(op, "clip_weights", clip_weights, optional=True), **kw)


# ---- compression ---------------------------------------------------------------------------

def _residual_pair(op, grad, residual):
    _array(op, "grad", grad, (F32,))
    _array(op, "residual", residual, (F32,), writeable=True)
    _same(op, "grad", grad, "residual", residual)


def _packed(op, packed, dst, per_word):
    _array(op, "packed", packed, (U32,))
    _array(op, "dst", dst, (F32,), writeable=True)
    words = -(-dst.size // per_word)
    if packed.size != words:
        raise ValueError(f"{op}: packed has {packed.size} words; dst {dst.shape} needs ceil({dst.size}/{per_word}) "
                         f"= {words}")


def compress_2bit(grad, residual, threshold):
    """MXNet 2-bit compression with error feedback: uint32[ceil(n/16)]; residual updated in place."""
    _residual_pair("compress_2bit", grad, residual)
    threshold = _number("compress_2bit", "threshold", threshold, positive=True)
    return _call("compress_2bit").compress_2bit(grad, residual, threshold)


def decompress_2bit_add(packed, threshold, dst):
    """dst += the decoded 2-bit values (+threshold, -threshold or 0)."""
    _packed("decompress_2bit_add", packed, dst, 16)
    threshold = _number("decompress_2bit_add", "threshold", threshold, positive=True)
    _call("decompress_2bit_add").decompress_2bit_add(packed, threshold, dst)


def compress_1bit(grad, residual, threshold=0.0):
    """MXNet 1-bit compression with error feedback: uint32[ceil(n/32)] of +1/-1 signs."""
    _residual_pair("compress_1bit", grad, residual)
    threshold = _number("compress_1bit", "threshold", threshold)
    return _call("compress_1bit").compress_1bit(grad, residual, threshold)


def decompress_1bit_add(packed, dst):
    """dst += the decoded 1-bit values (+1 or -1)."""
    _packed("decompress_1bit_add", packed, dst, 32)
    _call("decompress_1bit_add").decompress_1bit_add(packed, dst)


def compress_topk(grad, residual, k):
    """Top-k sparsification with error feedback: (indices ascending, float32 values).

    Indices are int32 (int64 for arrays of 2**31 elements or more); k is clamped to n.
    """
    _residual_pair("compress_topk", grad, residual)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
        raise ValueError(f"compress_topk: k={k!r} must be a non-negative integer")
    return _call("compress_topk").compress_topk(grad, residual, int(k))


def decompress_topk_add(indices, values, dst):
    """dst[indices] += values (repeated indices add up); raises ValueError for an index outside dst."""
    op = "decompress_topk_add"
    _array(op, "indices", indices, (I32, I64))
    _array(op, "values", values, (F32,))
    _array(op, "dst", dst, (F32,), writeable=True)
    if indices.size != values.size:
        raise ValueError(f"{op}: indices has {indices.size} entries but values has {values.size}")
    if indices.size and (indices.min() < 0 or indices.max() >= dst.size):
        raise ValueError(f"{op}: indices span [{indices.min()}, {indices.max()}], outside dst {dst.shape} "
                         f"({dst.size} elements)")
    _call(op).decompress_topk_add(indices, values, dst)


# ---- introspection ---------------------------------------------------------------------------

def backend():
    """Name of the backend that runs the numpy-array kernels ("c", "numba" or "numpy")."""
    return _kernels.active.name


def use_backend(name):
    """Select a backend by KVPS_KERNELS value; raises KernelUnavailable if it cannot run here."""
    return _kernels.use(name)


def counters():
    """Calls per operation name on the active backend since it was chosen (or reset)."""
    return _kernels.counters()


def reset_counters():
    _kernels.reset_counters()


def available_backends():
    """{name: (available, reason)} for every registered CPU backend."""
    return {name: _kernels.registry.status(name) for name in _kernels.registry.names()}


def set_num_threads(n):
    """Threads the C kernels split large arrays across (default min(CPUs, 8)).

    Raises KernelUnavailable when the C library cannot be used, ValueError outside 1..64.
    """
    _kernels.registry.get("c").native.set_num_threads(n)


def proc_cpu_features(path="/proc/cpuinfo"):
    """The SIMD flags the kernels care about, from /proc/cpuinfo (when the C library is absent)."""
    wanted = ("avx2", "f16c", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in flags]
    except OSError:
        pass
    return []


def describe():
    """Several lines for `kvps info`: the C kernels (or why not), backends, CPU features, SIMD path, CUDA."""
    lines = [_select.c_kernels_line(_kernels.registry)]
    try:
        active = _kernels.active
        lines.append(f"kernel backend: {active.name} (KVPS_KERNELS={_kernels.requested})")
        if active.details():
            lines.append(f"  {active.details()}")
    except KernelUnavailable as exc:
        lines.append(f"kernel backend: none ({exc})")
    for name, (ok, reason) in available_backends().items():
        lines.append(f"  {name:6s} {'available' if ok else reason}")
    c_ok, _ = _kernels.registry.status("c")
    if c_ok:
        native = _kernels.registry.get("c").native
        lines.append(f"CPU features (seen by the C library): {native.cpu_features() or 'none'}")
        lines.append(f"SIMD path: {native.simd_path()} (usable: {', '.join(native.simd_paths())})")
    else:
        lines.append(f"CPU features (/proc/cpuinfo): {' '.join(proc_cpu_features()) or 'unknown'}")
    usable, reason = _select.cuda_status()
    lines.append(f"CUDA: {'usable: ' + reason if usable else 'not usable: ' + reason}")
    return "\n".join(lines)


__all__ = [
    "sum_into", "sum_sources", "copy", "scale", "axpy", "cast",
    "sgd_update", "adam_update", "adamw_update", "adagrad_update", "rmsprop_update",
    "compress_2bit", "decompress_2bit_add", "compress_1bit", "decompress_1bit_add",
    "compress_topk", "decompress_topk_add",
    "backend", "use_backend", "counters", "reset_counters", "available_backends", "set_num_threads", "describe",
    "topk_index_dtype",
]
