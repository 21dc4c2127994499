"""Helpers for the kernel parity tests (tests/kernels/test_kernels_*.py, tests/gpu/).

`backends()` lists every backend that can run here, the C library once per SIMD path
usable on this CPU ("c-avx512", "c-avx2", "c-scalar"), so each path is tested where it
exists; `activate(name)` returns that backend with the path selected. `arrays()` makes
test data, optionally at a misaligned address, and `assert_same` compares bit for bit.
"""
import numpy as np

from kvps.kernels.select import default_registry
from kvps.kernels.reference import bfloat16

SIZES = (0, 1, 7, 15, 16, 17, 31, 33, 1023, 1025, 2**20 + 3)
# byte offsets of the first element: 0 = as allocated, 1 = not even element-aligned,
# one element = element-aligned but off every SIMD boundary
OFFSETS = ("aligned", "element", "byte")

_registry = default_registry()


def backends(include_numpy=False):
    """Names of the backends available here (pytest ids), C SIMD paths separately."""
    names = []
    ok, _ = _registry.status("c")
    if ok:
        names += [f"c-{path}" for path in _registry.get("c").native.simd_paths()]
    if _registry.status("numba")[0]:
        names.append("numba")
    if include_numpy:
        names.append("numpy")
    return names


def activate(name):
    """The backend for a name from backends(), with its SIMD path selected."""
    if name.startswith("c-"):
        backend = _registry.get("c")
        backend.native.set_simd_path(name[2:])
        return backend
    return _registry.get(name)


def restore():
    """Put the C library back on its best SIMD path."""
    if _registry.status("c")[0]:
        native = _registry.get("c").native
        native.set_simd_path(native.simd_paths()[0])


def empty(n, dtype, offset="aligned"):
    """An uninitialised C-contiguous 1-D array of n elements at the given misalignment."""
    dtype = np.dtype(dtype)
    extra = {"aligned": 0, "element": dtype.itemsize, "byte": 1}[offset]
    buf = np.empty(n * dtype.itemsize + extra + 64, dtype=np.uint8)
    start = (-buf.ctypes.data) % 64 + extra  # 64-byte aligned, then shifted
    return buf[start:start + n * dtype.itemsize].view(dtype)


_POOL = {}
_POOL_SIZE = 2**21


def _pool(dtype, special):
    """2**21 random values of a dtype, made once and sliced by random()."""
    key = (np.dtype(dtype), special)
    if key not in _POOL:
        rng = np.random.default_rng(12345)
        dtype = np.dtype(dtype)
        n = _POOL_SIZE
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            _POOL[key] = rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
            return _POOL[key]
        values = rng.standard_normal(n) * np.exp2(rng.integers(-8, 8, size=n))
        if special:
            finfo = np.finfo(np.float32 if dtype == np.dtype(bfloat16) else dtype)
            specials = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0, float(finfo.max), -float(finfo.max),
                                 float(finfo.smallest_subnormal), float(finfo.smallest_normal) / 3, 65504.0,
                                 65520.0, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-8])
            pick = rng.random(n) < 0.2
            values[pick] = rng.choice(specials, size=int(pick.sum()))
        with np.errstate(over="ignore", invalid="ignore"):
            _POOL[key] = values.astype(dtype)
    return _POOL[key]


def random(rng, n, dtype, offset="aligned", scale=1.0, special=False):
    """n random values of a dtype at the given misalignment (a random slice of a cached
    pool); special=True mixes in inf, nan, -0, denormals and float16 extremes."""
    a = empty(n, dtype, offset)
    pool = _pool(dtype, special)
    start = int(rng.integers(0, pool.size - n + 1))
    a[...] = pool[start:start + n]
    if scale != 1.0:
        a *= np.dtype(dtype).type(scale)
    return a


def bits(a):
    """The raw bit patterns of an array (for exact comparison)."""
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_same(actual, expected, what=""):
    """Bit-for-bit equality, except that any NaN matches any NaN (payloads are unspecified)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if actual.dtype.kind == "f" or actual.dtype == np.dtype(bfloat16):
        a32, e32 = actual.astype(np.float64), expected.astype(np.float64)
        nan_a, nan_e = np.isnan(a32), np.isnan(e32)
        same = (bits(actual) == bits(expected)) | (nan_a & nan_e)
    else:
        same = actual == expected
    if not same.all():
        bad = np.flatnonzero(~same)
        i = bad[0]
        raise AssertionError(f"{what}: {bad.size} of {actual.size} elements differ; first at [{i}]: "
                             f"got {actual[i]!r} (bits {bits(actual)[i]:#x}), expected {expected[i]!r} "
                             f"(bits {bits(expected)[i]:#x})")
