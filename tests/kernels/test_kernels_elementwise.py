"""Parity of sum_into, sum_sources, copy, scale, axpy and cast with the numpy reference.

Every available backend (each C SIMD path, numba) over every dtype, the sizes of
kvps.kernels.testing.SIZES and misaligned views; results must match bit for bit.
Run: pytest tests/kernels/test_kernels_elementwise.py
"""
import numpy as np
import pytest

from kvps.kernels import reference, testing
from kvps.kernels.reference import bfloat16

DTYPES = [np.float32, np.float64, np.float16, bfloat16, np.int32, np.int64]
FLOATS = [np.float32, np.float64, np.float16, bfloat16]
BACKENDS = testing.backends()
# inf, NaN and overflow are part of the test data; numpy's warnings about them are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(params=BACKENDS)
def backend(request):
    yield testing.activate(request.param)
    testing.restore()


def offsets(backend):
    # numba compiles again for unaligned arrays; it is checked on byte offsets separately
    return testing.OFFSETS if backend.name == "c" else ("aligned", "element")


def cases(backend, sizes=testing.SIZES):
    for n in sizes:
        # the largest size (threads, main loops) once, misaligned; the small ones every way
        for off in offsets(backend) if n < 2**20 else offsets(backend)[-1:]:
            yield n, off, f"n={n} offset={off}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_sum_into(backend, dtype):
    rng = np.random.default_rng(1)
    for n, off, what in cases(backend):
        dst = testing.random(rng, n, dtype, off, special=n < 2000)
        src = testing.random(rng, n, dtype, off, special=n < 2000)
        expected = dst.copy()
        reference.sum_into(expected, src)
        with np.errstate(all="ignore"):
            backend.sum_into(dst, src)
        testing.assert_same(dst, expected, what)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("nsrc", [1, 2, 3, 8])
def test_sum_sources(backend, dtype, nsrc):
    rng = np.random.default_rng(2)
    for n, off, what in cases(backend, (0, 1, 17, 1025, 2**20 + 3) if nsrc == 8 else testing.SIZES):
        srcs = [testing.random(rng, n, dtype, off) for _ in range(nsrc)]
        expected = testing.empty(n, dtype)
        reference.sum_sources(expected, srcs)
        dst = testing.random(rng, n, dtype, off)
        with np.errstate(all="ignore"):
            backend.sum_sources(dst, srcs)
        testing.assert_same(dst, expected, what)


@pytest.mark.parametrize("nsrc", [1, 2, 3])
def test_big_float32_sums_streamed_past_the_cache_at_every_alignment(backend, nsrc):
    # float32 sums of 1 MiB or more store whole vectors past the cache (csrc: src_f32_stream) once
    # the destination is vector-aligned: every head length before that, and dst aliasing a source
    rng = np.random.default_rng(7)
    n = (1 << 18) + 37
    base = testing.empty(n + 16, np.float32)
    for shift in range(17):
        srcs = [testing.random(rng, n, np.float32, "element") for _ in range(nsrc)]
        expected = testing.empty(n, np.float32)
        reference.sum_sources(expected, srcs)
        dst = base[shift:shift + n]
        backend.sum_sources(dst, srcs)
        testing.assert_same(dst, expected, f"dst {shift} floats past an aligned address")
        backend.sum_sources(srcs[0], srcs)
        testing.assert_same(srcs[0], expected, f"dst is the first source, shift {shift}")


@pytest.mark.parametrize("n", [0, 1, 63, 65, (1 << 20) - 1, (1 << 20) + 77])
def test_copy_byte_for_byte(backend, n):
    rng = np.random.default_rng(8)
    src = rng.integers(0, 256, n + 64, np.uint8)
    for off in (0, 1, 15, 16, 33):
        dst = np.zeros(n + 64, np.uint8)
        backend.copy(dst[off:off + n], src[64 - off:64 - off + n])
        assert np.array_equal(dst[off:off + n], src[64 - off:64 - off + n]), (n, off)
        assert not dst[:off].any() and not dst[off + n:].any(), "copy wrote outside dst"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_sum_sources_into_a_source(backend, dtype):
    # the server sums into the first received buffer; dst may also be a later source
    rng = np.random.default_rng(3)
    a, b, c = (testing.random(rng, 1025, dtype) for _ in range(3))
    for srcs, dst in (([a, b, c], a), ([b, a, c], a), ([b, c, a], a)):
        expected = testing.empty(1025, dtype)
        reference.sum_sources(expected, srcs)
        with np.errstate(all="ignore"):
            backend.sum_sources(dst, srcs)
        testing.assert_same(dst, expected, "dst aliases a source")
        a, b, c = (testing.random(rng, 1025, dtype) for _ in range(3))


def test_low_precision_sums_round_once(backend):
    # 1 + 2^-11 + 2^-11 in float16: rounding after each add would give 1, once gives 1 + 2^-10
    one, tiny = np.float16(1.0), np.float16(2.0**-11)
    dst = np.array([0.0], np.float16)
    backend.sum_sources(dst, [np.array([one], np.float16), np.array([tiny], np.float16),
                              np.array([tiny], np.float16)])
    assert dst[0] == np.float16(1.0 + 2.0**-10)
    # bfloat16: the same with 2^-8
    dst = np.array([0.0], bfloat16)
    backend.sum_sources(dst, [np.array([1.0], bfloat16), np.array([2.0**-8], bfloat16),
                              np.array([2.0**-8], bfloat16)])
    assert float(dst[0]) == 1.0 + 2.0**-7


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_scale_and_axpy(backend, dtype):
    rng = np.random.default_rng(4)
    for n, off, what in cases(backend):
        for alpha in (0.1, -3.0):
            x = testing.random(rng, n, dtype, off, special=n < 2000)
            y = testing.random(rng, n, dtype, off, special=n < 2000)
            ex, ey = x.copy(), y.copy()
            reference.scale(ex, alpha)
            reference.axpy(ey, alpha, x)
            with np.errstate(all="ignore"):
                backend.axpy(y, alpha, x)
                backend.scale(x, alpha)
            testing.assert_same(x, ex, f"scale {what} alpha={alpha}")
            testing.assert_same(y, ey, f"axpy {what} alpha={alpha}")


@pytest.mark.parametrize("low", [np.float16, bfloat16], ids=["float16", "bfloat16"])
def test_cast(backend, low):
    rng = np.random.default_rng(5)
    for n, off, what in cases(backend):
        src = testing.random(rng, n, np.float32, off, special=True)
        dst = testing.empty(n, low, off)
        expected = testing.empty(n, low)
        with np.errstate(all="ignore"):
            reference.cast(src, expected)
            backend.cast(src, dst)
        testing.assert_same(dst, expected, f"float32 -> {np.dtype(low).name} {what}")
        back, expected32 = testing.empty(n, np.float32, off), testing.empty(n, np.float32)
        reference.cast(dst, expected32)
        backend.cast(dst, back)
        testing.assert_same(back, expected32, f"{np.dtype(low).name} -> float32 {what}")


@pytest.mark.parametrize("low", [np.float16, bfloat16], ids=["float16", "bfloat16"])
def test_cast_every_rounding_case(backend, low):
    # float32 patterns that cover every float16/bfloat16 exponent, with the 13 (16) low
    # bits that decide the rounding set to below, at and above half-way, both parities
    hi = np.arange(0, 1 << 19, dtype=np.uint32) << np.uint32(13)
    low_bits = np.array([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    patterns = (hi[:, None] | low_bits[None, :]).ravel()  # both signs: hi reaches bit 31
    src = patterns.view(np.float32)
    dst, expected = np.empty(src.size, low), np.empty(src.size, low)
    with np.errstate(all="ignore"):
        reference.cast(src, expected)
        backend.cast(src, dst)
    testing.assert_same(dst, expected, f"float32 -> {np.dtype(low).name}")
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(low)
    out, expected32 = np.empty(every.size, np.float32), np.empty(every.size, np.float32)
    reference.cast(every, expected32)
    backend.cast(every, out)
    testing.assert_same(out, expected32, f"every {np.dtype(low).name} -> float32")


@pytest.mark.skipif("numba" not in BACKENDS, reason="numba is not installed")
def test_numba_unaligned_arrays():
    backend = testing.activate("numba")
    rng = np.random.default_rng(6)
    dst, src = (testing.random(rng, 1025, np.float32, "byte") for _ in range(2))
    expected = dst.copy()
    reference.sum_into(expected, src)
    backend.sum_into(dst, src)
    testing.assert_same(dst, expected, "numba, byte-misaligned float32")


def test_integer_sums_wrap(backend):
    for dtype in (np.int32, np.int64):
        info = np.iinfo(dtype)
        dst = np.array([info.max, info.min, -1], dtype)
        backend.sum_into(dst, np.array([1, -1, 1], dtype))
        assert dst.tolist() == [info.min, info.max, 0]
