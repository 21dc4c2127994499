"""The ctypes binding of the C kernels (csrc/, built into _kvps_kernels.so by setup.py).

This is the one module that talks to the shared library: it declares every argument
type once, checks the ABI version and the library's dtype table against kvps.dtypes at
load, and turns status codes into exceptions (`_check`). `load()` returns a
`NativeLibrary` or raises KernelUnavailable saying why (with the reason setup.py
recorded when the build failed); `CBackend` adapts it to the backend interface.
ctypes releases the GIL for the duration of every call.
"""
import ctypes
import functools
import os

import numpy as np

from kvps import dtypes
from kvps.errors import KernelUnavailable

from kvps.kernels import base
from kvps.kernels.base import ABI_VERSION, Backend, clip_arg as _clip
from kvps.kernels.reference import topk_index_dtype

LIBRARY = "_kvps_kernels.so"
# numpy dtype -> the code of csrc/kvps_kernels.h's KVPS_DTYPE_TABLE; the library's table is
# checked against kvps.dtypes when it loads (NativeLibrary._check_dtypes).
DTYPE_CODES = dtypes.KERNEL_CODES
_MAX_DTYPE_CODE = 255  # where the check stops asking the library for more codes

STATUS_OK, STATUS_ARG, STATUS_DTYPE, STATUS_NOMEM, STATUS_INDEX, STATUS_UNSUPPORTED = range(6)

_p, _i, _i64, _f, _d, _s = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_double, \
    ctypes.c_char_p

# name: (restype, argtypes); the signatures of csrc/kvps_kernels.h
SIGNATURES = {
    "kvps_abi_version": (_i, []),
    "kvps_dtype_name": (_s, [_i]),
    "kvps_dtype_size": (_i, [_i]),
    "kvps_status_name": (_s, [_i]),
    "kvps_cpu_features": (_s, []),
    "kvps_simd_paths": (_s, []),
    "kvps_simd_path": (_s, []),
    "kvps_set_simd_path": (_i, [_s]),
    "kvps_num_threads": (_i, []),
    "kvps_set_num_threads": (_i, [_i]),
    "kvps_sum_into": (_i, [_i, _p, _p, _i64]),
    "kvps_sum_sources": (_i, [_i, _p, ctypes.POINTER(_p), _i, _i64]),
    "kvps_scale": (_i, [_i, _p, _d, _i64]),
    "kvps_axpy": (_i, [_i, _p, _d, _p, _i64]),
    "kvps_cast": (_i, [_i, _p, _i, _p, _i64]),
    "kvps_copy": (_i, [_p, _p, _i64]),
    "kvps_sgd_update": (_i, [_i, _p, _p, _p, _i64, _f, _f, _f, _f, _f, _i]),
    "kvps_adam_update": (_i, [_i, _p, _p, _p, _p, _i64, _f, _f, _f, _f, _f, _f, _f]),
    "kvps_adamw_update": (_i, [_i, _p, _p, _p, _p, _i64, _f, _f, _f, _f, _f, _f, _f, _f]),
    "kvps_adagrad_update": (_i, [_i, _p, _p, _p, _i64, _f, _f, _f, _f, _f]),
    "kvps_rmsprop_update": (_i, [_i, _p, _p, _p, _i64, _f, _f, _f, _f, _f, _f, _f]),
    "kvps_compress_2bit": (_i, [_p, _p, _p, _i64, _f]),
    "kvps_decompress_2bit_add": (_i, [_p, _f, _p, _i64]),
    "kvps_compress_1bit": (_i, [_p, _p, _p, _i64, _f]),
    "kvps_decompress_1bit_add": (_i, [_p, _p, _i64]),
    "kvps_compress_topk": (_i, [_p, _p, _i64, _i64, _i, _p, _p]),
    "kvps_decompress_topk_add": (_i, [_i, _p, _p, _i64, _p, _i64]),
}


def library_path():
    return base.library_path(LIBRARY)


def _addr(a):
    return a.ctypes.data


class NativeLibrary:
    """The loaded _kvps_kernels.so, with its functions' types declared."""

    def __init__(self, path):
        self.path = path
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            raise KernelUnavailable(f"the C library {path} cannot be loaded: {exc}") from None
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(lib, name, None)
            if fn is None:
                raise KernelUnavailable(f"the C library {path} has no {name}: rebuild it ({base.REBUILD})")
            fn.restype, fn.argtypes = restype, argtypes
        self.lib = lib
        version = lib.kvps_abi_version()
        if version != ABI_VERSION:
            raise KernelUnavailable(f"the C library {path} has ABI version {version}, this package expects "
                                    f"{ABI_VERSION}: rebuild it ({base.REBUILD})")
        self._check_dtypes()

    def _check_dtypes(self):
        """Every code the library knows must be the kernel dtype kvps.dtypes gives it, and back."""
        lib, known = self.lib, {}
        for code in range(_MAX_DTYPE_CODE + 1):
            name = lib.kvps_dtype_name(code)
            if name is None:
                break
            known[code] = (name.decode(errors="replace"), lib.kvps_dtype_size(code))
        ours = {code: (dtype.name, dtype.itemsize) for dtype, code in DTYPE_CODES.items()}
        for code in sorted(set(known) | set(ours)):
            if known.get(code) != ours.get(code):
                theirs = "unknown" if code not in known else f"{known[code][0]} ({known[code][1]} bytes)"
                mine = "not a kernel dtype" if code not in ours else f"{ours[code][0]} ({ours[code][1]} bytes)"
                raise KernelUnavailable(
                    f"the C library {self.path} disagrees with kvps.dtypes on dtype code {code}: the library "
                    f"has {theirs}, kvps.dtypes {mine} (csrc/kvps_kernels.h's KVPS_DTYPE_TABLE and "
                    f"kvps/dtypes.py must list the same dtypes): rebuild it ({base.REBUILD})")

    def _check(self, status, op):
        """The one place where C status codes become Python exceptions."""
        if status == STATUS_OK:
            return
        text = self.lib.kvps_status_name(status).decode()
        if status == STATUS_NOMEM:
            raise MemoryError(f"{op}: {text}")
        if status in (STATUS_ARG, STATUS_DTYPE, STATUS_INDEX):
            raise ValueError(f"{op}: {text}")
        raise RuntimeError(f"{op}: C kernel returned status {status} ({text})")

    # ---- introspection -----------------------------------------------------------------
    def cpu_features(self):
        return self.lib.kvps_cpu_features().decode()

    def simd_paths(self):
        return self.lib.kvps_simd_paths().decode().split()

    def simd_path(self):
        return self.lib.kvps_simd_path().decode()

    def set_simd_path(self, name):
        """Use another SIMD path ("avx512", "avx2", "scalar"); ValueError if this CPU lacks it."""
        status = self.lib.kvps_set_simd_path(name.encode())
        if status == STATUS_UNSUPPORTED:
            raise ValueError(f"SIMD path {name!r} is not available here (available: {' '.join(self.simd_paths())})")
        self._check(status, "set_simd_path")

    def num_threads(self):
        return self.lib.kvps_num_threads()

    def set_num_threads(self, n):
        self._check(self.lib.kvps_set_num_threads(int(n)), f"set_num_threads({n})")


class CBackend(Backend):
    """Kernels of the C library; arrays were validated by kvps.kernels."""

    name = "c"

    def __init__(self, native=None):
        self.native = native if native is not None else load()
        self.lib = self.native.lib
        self._check = self.native._check

    def details(self):
        n = self.native
        return (f"C library {n.path}: ABI {ABI_VERSION}, SIMD path {n.simd_path()} "
                f"(usable here: {', '.join(n.simd_paths())}), {n.num_threads()} threads")

    def sum_into(self, dst, src):
        self._check(self.lib.kvps_sum_into(DTYPE_CODES[dst.dtype], _addr(dst), _addr(src), dst.size), "sum_into")

    def copy(self, dst, src):
        self._check(self.lib.kvps_copy(_addr(dst), _addr(src), dst.nbytes), "copy")

    def sum_sources(self, dst, srcs):
        ptrs = (ctypes.c_void_p * len(srcs))(*[_addr(s) for s in srcs])
        self._check(self.lib.kvps_sum_sources(DTYPE_CODES[dst.dtype], _addr(dst), ptrs, len(srcs), dst.size),
                    "sum_sources")

    def scale(self, x, alpha):
        self._check(self.lib.kvps_scale(DTYPE_CODES[x.dtype], _addr(x), float(alpha), x.size), "scale")

    def axpy(self, y, alpha, x):
        self._check(self.lib.kvps_axpy(DTYPE_CODES[y.dtype], _addr(y), float(alpha), _addr(x), y.size), "axpy")

    def cast(self, src, dst):
        self._check(self.lib.kvps_cast(DTYPE_CODES[src.dtype], _addr(src), DTYPE_CODES[dst.dtype], _addr(dst),
                                       src.size), "cast")

    def sgd_update(self, weight, grad, mom, *, lr, momentum, wd, rescale_grad, clip_gradient, nesterov):
        self._check(self.lib.kvps_sgd_update(
            DTYPE_CODES[grad.dtype], _addr(weight), _addr(grad), None if mom is None else _addr(mom), weight.size,
            lr, momentum, wd, rescale_grad, _clip(clip_gradient), int(bool(nesterov))), "sgd_update")

    def adam_update(self, weight, grad, mean, var, *, lr, beta1, beta2, epsilon, wd, rescale_grad, clip_gradient):
        self._check(self.lib.kvps_adam_update(
            DTYPE_CODES[grad.dtype], _addr(weight), _addr(grad), _addr(mean), _addr(var), weight.size,
            lr, beta1, beta2, epsilon, wd, rescale_grad, _clip(clip_gradient)), "adam_update")

    def adamw_update(self, weight, grad, mean, var, *, lr, beta1, beta2, epsilon, wd, rescale_grad, clip_gradient,
                     eta):
        self._check(self.lib.kvps_adamw_update(
            DTYPE_CODES[grad.dtype], _addr(weight), _addr(grad), _addr(mean), _addr(var), weight.size,
            lr, beta1, beta2, epsilon, wd, rescale_grad, _clip(clip_gradient), eta), "adamw_update")

    def adagrad_update(self, weight, grad, history, *, lr, epsilon, wd, rescale_grad, clip_gradient):
        self._check(self.lib.kvps_adagrad_update(
            DTYPE_CODES[grad.dtype], _addr(weight), _addr(grad), _addr(history), weight.size,
            lr, epsilon, wd, rescale_grad, _clip(clip_gradient)), "adagrad_update")

    def rmsprop_update(self, weight, grad, n, *, lr, gamma1, epsilon, wd, rescale_grad, clip_gradient,
                       clip_weights):
        self._check(self.lib.kvps_rmsprop_update(
            DTYPE_CODES[grad.dtype], _addr(weight), _addr(grad), _addr(n), weight.size,
            lr, gamma1, epsilon, wd, rescale_grad, _clip(clip_gradient), _clip(clip_weights)), "rmsprop_update")

    def compress_2bit(self, grad, residual, threshold):
        out = np.empty(-(-grad.size // 16), dtype=np.uint32)
        self._check(self.lib.kvps_compress_2bit(_addr(grad), _addr(residual), _addr(out), grad.size, threshold),
                    "compress_2bit")
        return out

    def decompress_2bit_add(self, packed, threshold, dst):
        self._check(self.lib.kvps_decompress_2bit_add(_addr(packed), threshold, _addr(dst), dst.size),
                    "decompress_2bit_add")

    def compress_1bit(self, grad, residual, threshold):
        out = np.empty(-(-grad.size // 32), dtype=np.uint32)
        self._check(self.lib.kvps_compress_1bit(_addr(grad), _addr(residual), _addr(out), grad.size, threshold),
                    "compress_1bit")
        return out

    def decompress_1bit_add(self, packed, dst):
        self._check(self.lib.kvps_decompress_1bit_add(_addr(packed), _addr(dst), dst.size), "decompress_1bit_add")

    def compress_topk(self, grad, residual, k):
        n = grad.size
        k = min(k, n)
        index_dtype = topk_index_dtype(n)
        indices = np.empty(k, dtype=index_dtype)
        values = np.empty(k, dtype=np.float32)
        self._check(self.lib.kvps_compress_topk(_addr(grad), _addr(residual), n, k, DTYPE_CODES[index_dtype],
                                                _addr(indices), _addr(values)), "compress_topk")
        return indices, values

    def decompress_topk_add(self, indices, values, dst):
        self._check(self.lib.kvps_decompress_topk_add(DTYPE_CODES[indices.dtype], _addr(indices), _addr(values),
                                                      indices.size, _addr(dst), dst.size), "decompress_topk_add")


def load(path=None):
    """The C library, loaded and checked; KernelUnavailable says why it cannot be used."""
    return _load(path or library_path())


@functools.lru_cache(maxsize=None)
def _load(path):
    if not os.path.exists(path):
        state, reason, _ = base.build_status(path)
        why = reason if state == "failed" else "the C compiler failed or was absent at install time"
        raise KernelUnavailable(f"the C library was not built ({path} is missing: {why}); "
                                f"rebuild it with {base.REBUILD}")
    return NativeLibrary(path)
