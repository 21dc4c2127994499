"""Gradient compression: parity with the reference, MXNet's bit layout, round trips and
error-feedback bookkeeping over many steps.
Run: pytest tests/kernels/test_kernels_compression.py
"""
import numpy as np
import pytest

from kvps.kernels import reference, testing

BACKENDS = testing.backends()
# inf, NaN and overflow are part of the test data; numpy's warnings about them are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(params=BACKENDS)
def backend(request):
    yield testing.activate(request.param)
    testing.restore()


def offsets(backend, n):
    offs = testing.OFFSETS if backend.name == "c" else ("aligned", "element")
    return offs if n < 2**20 else offs[-1:]


@pytest.mark.parametrize("bits", [2, 1])
def test_compress_matches_reference(backend, bits):
    rng = np.random.default_rng(10)
    t = 0.5 if bits == 2 else 0.0
    per_word = 32 // bits
    for n in testing.SIZES:
        for off in offsets(backend, n):
            what = f"{bits}-bit n={n} offset={off}"
            residual = testing.random(rng, n, np.float32, off, scale=0.5)
            expected_r = residual.copy()
            for step in range(3):
                grad = testing.random(rng, n, np.float32, off, special=(step == 2 and n < 2000))
                compress = getattr(reference, f"compress_{bits}bit")
                with np.errstate(all="ignore"):
                    expected = compress(grad, expected_r, t)
                    words = getattr(backend, f"compress_{bits}bit")(grad, residual, t)
                assert words.dtype == np.uint32 and words.size == -(-n // per_word), what
                testing.assert_same(words, expected, f"words, {what}")
                testing.assert_same(residual, expected_r, f"residual, {what}")
            # decompress-and-add into a misaligned destination
            dst = testing.random(rng, n, np.float32, off)
            expected_dst = dst.copy()
            if bits == 2:
                reference.decompress_2bit_add(words, t, expected_dst)
                backend.decompress_2bit_add(words, t, dst)
            else:
                reference.decompress_1bit_add(words, expected_dst)
                backend.decompress_1bit_add(words, dst)
            testing.assert_same(dst, expected_dst, f"decompress, {what}")


def test_2bit_layout_is_mxnets(backend):
    # MXNet: element i -> byte (i % 16) // 4 of word i // 16, bits 7-6 for i % 4 == 0 ...
    # codes 11 = +t, 10 = -t, 00 = 0
    t = 0.5
    grad = np.zeros(20, np.float32)
    grad[0], grad[1], grad[3], grad[4], grad[15], grad[16] = 1.0, -1.0, 0.6, -0.5, 0.5, -2.0
    words = backend.compress_2bit(grad, np.zeros(20, np.float32), t)
    raw = words.view(np.uint8)
    assert raw[0] == 0b11_10_00_11      # elements 0..3: +t, -t, 0, +t
    assert raw[1] == 0b10_00_00_00      # element 4: -t
    assert raw[3] == 0b00_00_00_11      # element 15: +t (0.5 >= t)
    assert raw[4] == 0b10_00_00_00      # element 16, second word: -t
    assert words.size == 2
    assert words[0] == (0b11 << 6 | 0b10 << 4 | 0b11) | (0b10 << 14) | (0b11 << 24)


def test_1bit_layout_is_mxnets(backend):
    # MXNet: element i is bit 7 - i % 8 of byte (i % 32) // 8 of word i // 32; 1 = +1
    grad = np.full(40, -1.0, np.float32)
    grad[[0, 7, 8, 31, 32]] = 1.0
    words = backend.compress_1bit(grad, np.zeros(40, np.float32), 0.0)
    raw = words.view(np.uint8)
    assert raw.tolist() == [0b1000_0001, 0b1000_0000, 0, 0b0000_0001, 0b1000_0000, 0, 0, 0]


def test_2bit_residual_bookkeeping_over_many_steps(backend):
    # with values that are exact in float32, emitted + final residual == sum of inputs, exactly
    rng = np.random.default_rng(11)
    n, t = 1000, 0.25
    residual, total, emitted = np.zeros(n, np.float32), np.zeros(n, np.float64), np.zeros(n, np.float32)
    for _ in range(200):
        grad = (rng.integers(-40, 41, size=n) / 64).astype(np.float32)
        total += grad
        words = backend.compress_2bit(grad, residual, t)
        backend.decompress_2bit_add(words, t, emitted)
    np.testing.assert_array_equal(emitted.astype(np.float64) + residual, total)


def test_1bit_residual_bookkeeping_over_many_steps(backend):
    rng = np.random.default_rng(12)
    n = 1000
    residual, total, emitted = np.zeros(n, np.float32), np.zeros(n, np.float64), np.zeros(n, np.float32)
    for _ in range(200):
        grad = (rng.integers(-64, 65, size=n) / 32).astype(np.float32)
        total += grad
        words = backend.compress_1bit(grad, residual, 0.0)
        backend.decompress_1bit_add(words, emitted)
    np.testing.assert_array_equal(emitted.astype(np.float64) + residual, total)


def test_2bit_round_trip_of_representable_gradients(backend):
    # a gradient already made of +-t and 0 with a zero residual comes back unchanged
    rng = np.random.default_rng(13)
    t = 0.75
    for n in (1, 15, 16, 17, 1025):
        grad = (rng.integers(-1, 2, size=n) * t).astype(np.float32)
        residual = np.zeros(n, np.float32)
        out = np.zeros(n, np.float32)
        backend.decompress_2bit_add(backend.compress_2bit(grad, residual, t), t, out)
        np.testing.assert_array_equal(out, grad)
        assert not residual.any()


def test_topk_matches_reference(backend):
    rng = np.random.default_rng(14)
    for n in testing.SIZES:
        for off in offsets(backend, n):
            for k in sorted({0, 1, n // 3, n, n + 5}):
                what = f"top-k n={n} k={k} offset={off}"
                residual = testing.random(rng, n, np.float32, off)
                grad = testing.random(rng, n, np.float32, off, special=n < 2000)
                if n > 4:  # ties: equal magnitudes must go to the lower index
                    grad[: n // 4] = np.float32(1.5)
                    residual[: n // 4] = 0
                expected_r = residual.copy()
                with np.errstate(all="ignore"):
                    ei, ev = reference.compress_topk(grad, expected_r, k)
                    idx, val = backend.compress_topk(grad, residual, k)
                assert idx.dtype == np.int32, what
                np.testing.assert_array_equal(idx, ei, err_msg=what)
                testing.assert_same(val, ev, f"values, {what}")
                testing.assert_same(residual, expected_r, f"residual, {what}")
                dst = testing.random(rng, n, np.float32, off)
                expected_dst = dst.copy()
                reference.decompress_topk_add(idx, val, expected_dst)
                backend.decompress_topk_add(idx, val, dst)
                testing.assert_same(dst, expected_dst, f"decompress, {what}")


def test_topk_error_feedback_over_many_steps(backend):
    rng = np.random.default_rng(15)
    n, k = 500, 20
    residual, total, emitted = np.zeros(n, np.float32), np.zeros(n, np.float64), np.zeros(n, np.float32)
    for _ in range(100):
        grad = (rng.integers(-64, 65, size=n) / 64).astype(np.float32)
        total += grad
        idx, val = backend.compress_topk(grad, residual, k)
        assert idx.size == k and (np.diff(idx) > 0).all()
        backend.decompress_topk_add(idx, val, emitted)
    np.testing.assert_array_equal(emitted.astype(np.float64) + residual, total)


def test_decompress_topk_repeated_indices_add_up(backend):
    dst = np.zeros(4, np.float32)
    backend.decompress_topk_add(np.array([1, 1, 3], np.int64), np.array([1.0, 2.0, 4.0], np.float32), dst)
    assert dst.tolist() == [0.0, 3.0, 0.0, 4.0]
