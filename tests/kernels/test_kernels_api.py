"""The public kvps.kernels boundary: validation messages, backend selection, counters,
describe(), threads and fork. Parity lives in the other test_kernels_* files.
Run: pytest tests/kernels/test_kernels_api.py
"""
import os
import sys
import threading

import numpy as np
import pytest

from kvps import kernels
from kvps.errors import KernelUnavailable
from kvps.kernels import api, native, select, testing
from kvps.kernels.reference import bfloat16

HAS_C = select.default_registry().status("c")[0]


@pytest.fixture
def active(request):
    """Run a test on a chosen backend, then go back to auto."""
    yield
    kernels.use_backend("auto")


# ---- validation -----------------------------------------------------------------------

def test_non_contiguous_array_is_refused_with_its_name_and_flags():
    dst = np.zeros((8, 8), np.float32)[:, ::2]
    with pytest.raises(ValueError, match=r"sum_into: dst float32 \(8, 4\) is not C-contiguous.*C_CONTIGUOUS=False"):
        kernels.sum_into(dst, np.zeros((8, 4), np.float32))


def test_mismatched_arrays_name_both():
    with pytest.raises(ValueError, match=r"dst is float32 \(4,\) but src is float16 \(4,\)"):
        kernels.sum_into(np.zeros(4, np.float32), np.zeros(4, np.float16))
    with pytest.raises(ValueError, match=r"dst is float32 \(4,\) but src is float32 \(5,\)"):
        kernels.sum_into(np.zeros(4, np.float32), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match=r"srcs\[1\]"):
        kernels.sum_sources(np.zeros(4, np.float32), [np.zeros(4, np.float32), np.zeros(3, np.float32)])


def test_other_bad_arguments():
    f = np.zeros(32, np.float32)
    with pytest.raises(TypeError, match="dst must be a numpy array"):
        kernels.sum_into([1.0], f)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(32, np.float32)
        ro.flags.writeable = False
        kernels.sum_into(ro, f)
    with pytest.raises(ValueError, match="expected float32 or float64 or float16 or bfloat16"):
        kernels.scale(np.zeros(3, np.int32), 2.0)
    with pytest.raises(ValueError, match="float16 -> bfloat16 is not supported"):
        kernels.cast(np.zeros(3, np.float16), np.zeros(3, bfloat16))
    with pytest.raises(ValueError, match="non-empty list"):
        kernels.sum_sources(f, [])
    with pytest.raises(ValueError, match="momentum=0.9 needs a momentum state"):
        kernels.sgd_update(f, f.copy(), None, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="weight is float64"):
        kernels.adam_update(np.zeros(3), np.zeros(3), np.zeros(3), np.zeros(3), lr=0.1)
    with pytest.raises(TypeError, match="lr='x' is not a number"):
        kernels.sgd_update(f, f.copy(), None, lr="x")
    with pytest.raises(ValueError, match="threshold=0.0 must be > 0"):
        kernels.compress_2bit(f, f.copy(), 0.0)
    with pytest.raises(ValueError, match=r"packed has 3 words; dst \(32,\) needs ceil\(32/16\) = 2"):
        kernels.decompress_2bit_add(np.zeros(3, np.uint32), 0.5, f)
    with pytest.raises(ValueError, match="k=-1"):
        kernels.compress_topk(f, f.copy(), -1)


def test_copy_checks_its_arrays_and_copies_any_dtypes_of_one_size():
    with pytest.raises(ValueError, match=r"copy: dst is float32 \(4,\) \(16 bytes\) but src is float32 \(5,\)"):
        kernels.copy(np.zeros(4, np.float32), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="copy: src float32 .* is not C-contiguous"):
        kernels.copy(np.zeros(4, np.float32), np.zeros(8, np.float32)[::2])
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="copy: dst .* is read-only"):
        kernels.copy(ro, np.ones(4, np.float32))
    with pytest.raises(TypeError, match="copy: src must be a numpy array"):
        kernels.copy(ro, [1.0])
    dst = np.zeros(2, np.int64)
    kernels.copy(dst, np.arange(4, dtype=np.int32))      # bytes, not values
    assert dst.view(np.int32).tolist() == [0, 1, 2, 3]


def test_out_of_range_topk_index_changes_nothing():
    dst = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match=r"indices span \[2, 10\], outside dst \(10,\)"):
        kernels.decompress_topk_add(np.array([2, 10], np.int32), np.ones(2, np.float32), dst)
    assert not dst.any()


@pytest.mark.skipif(not HAS_C, reason="the C library was not built")
def test_c_library_checks_indices_itself():
    c = testing.activate("c-scalar")
    try:
        dst = np.zeros(10, np.float32)
        with pytest.raises(ValueError, match="index out of range"):
            c.decompress_topk_add(np.array([2, -1], np.int64), np.ones(2, np.float32), dst)
        assert not dst.any()
    finally:
        testing.restore()


def test_any_shape_works():
    a, b = np.ones((3, 4, 5), np.float32), np.full((3, 4, 5), 2.0, np.float32)
    kernels.sum_into(a, b)
    assert (a == 3).all()
    w, g, m = np.ones((2, 3), np.float32), np.ones((2, 3), np.float16), np.zeros((2, 3), np.float32)
    kernels.sgd_update(w, g, m, lr=0.5, momentum=0.9)
    assert np.allclose(w, 0.5)


# ---- selection, counters, describe -------------------------------------------------------

def test_use_backend_and_counters(active):
    kernels.use_backend("numpy")
    assert kernels.backend() == "numpy"
    assert kernels.counters() == {}
    a = np.ones(5, np.float32)
    kernels.sum_into(a, a)
    kernels.sum_into(a, a)
    kernels.scale(a, 0.5)
    assert kernels.counters() == {"sum_into": 2, "scale": 1}
    kernels.reset_counters()
    assert kernels.counters() == {}


def test_unknown_or_unavailable_backend(active):
    with pytest.raises(KernelUnavailable, match="KVPS_KERNELS='fast' is not one of"):
        kernels.use_backend("fast")
    usable, _ = kernels.cuda.status()
    if not usable:
        with pytest.raises(KernelUnavailable, match="KVPS_KERNELS=cuda, but"):
            kernels.use_backend("cuda")


def test_environment_variable_picks_the_backend(monkeypatch):
    monkeypatch.setenv("KVPS_KERNELS", "numpy")
    assert api.Kernels().active.name == "numpy"
    monkeypatch.setenv("KVPS_KERNELS", "auto")
    assert api.Kernels().active.name == ("c" if HAS_C else "numba")


def test_missing_c_library_falls_back_to_numba(monkeypatch, tmp_path):
    with pytest.raises(KernelUnavailable, match="was not built"):
        native.load(str(tmp_path / "nothing.so"))
    registry = select.default_registry()

    def no_library():
        raise KernelUnavailable("the C library was not built (test)")

    registry.add("c", no_library)
    monkeypatch.setenv("KVPS_KERNELS", "auto")
    k = api.Kernels(registry)
    assert k.active.name == "numba"
    monkeypatch.setenv("KVPS_KERNELS", "c")
    with pytest.raises(KernelUnavailable, match="KVPS_KERNELS=c: kernel backend 'c' is not available: the C library"):
        api.Kernels(registry).active


def test_describe_names_backend_features_and_cuda():
    text = kernels.describe()
    assert "kernel backend:" in text
    assert "CPU features" in text
    assert "CUDA: " in text
    if HAS_C:
        assert "SIMD path:" in text


# ---- threads and processes -----------------------------------------------------------------

@pytest.mark.skipif(not HAS_C, reason="the C library was not built")
def test_concurrent_calls_from_many_threads():
    rng = np.random.default_rng(0)
    n = 2**20 + 3
    pairs = [(testing.random(rng, n, np.float32), testing.random(rng, n, np.float32)) for _ in range(6)]
    expected = [a + b for a, b in pairs]
    errors = []

    def work(i):
        try:
            kernels.sum_into(*pairs[i])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(pairs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    for (a, _), e in zip(pairs, expected):
        testing.assert_same(a, e, "concurrent sum_into")


@pytest.mark.skipif(not HAS_C or not hasattr(os, "fork"), reason="needs the C library and fork()")
def test_kernels_work_in_a_forked_child():
    a, b = np.ones(2**21, np.float32), np.ones(2**21, np.float32)
    kernels.sum_into(a, b)  # the parent's thread pool is running now
    pid = os.fork()
    if pid == 0:  # child: the pool threads did not survive fork; a new pool must start
        try:
            kernels.sum_into(a, b)
            os._exit(0 if (a == 3).all() else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@pytest.mark.skipif(not HAS_C, reason="the C library was not built")
def test_thread_count_and_simd_path_settings():
    lib = native.load()
    before = lib.num_threads()
    try:
        lib.set_num_threads(1)
        a = np.ones(2**20, np.float32)
        kernels.sum_into(a, a)
        assert (a == 2).all()
        with pytest.raises(ValueError):
            lib.set_num_threads(0)
        with pytest.raises(ValueError, match="not available here"):
            lib.set_simd_path("neon")
    finally:
        lib.set_num_threads(before)
    assert sys.byteorder == "little"  # the packed layouts above assume little-endian words


def test_python_binding_covers_the_c_header():
    # every CPU function of csrc/kvps_kernels.h is declared once in native.SIGNATURES
    import re
    header = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc", "kvps_kernels.h")
    with open(header) as f:
        declared = set(re.findall(r"KVPS_API \w[\w ]*?\**(kvps_\w+)\(", f.read()))
    cpu = {name for name in declared if not name.startswith("kvps_cuda_")}
    assert cpu == set(native.SIGNATURES)
    from kvps.kernels import cuda
    assert {n for n in declared if n.startswith("kvps_cuda_")} >= set(cuda.SIGNATURES)


# ---- the dtype table: kvps.dtypes on the Python side, KVPS_DTYPE_TABLE on the C side -------------

@pytest.mark.skipif(not HAS_C, reason="the C library was not built")
def test_library_dtype_table_is_checked_against_kvps_dtypes(monkeypatch):
    from kvps import dtypes
    lib = native.load()
    for dtype, code in native.DTYPE_CODES.items():
        assert lib.lib.kvps_dtype_name(code).decode() == dtype.name == dtypes.numpy_dtype(code).name
    assert lib.lib.kvps_dtype_name(len(native.DTYPE_CODES)) is None
    # a Python table without int64, then one that calls code 5 something else: both are refused at load
    monkeypatch.setattr(native, "DTYPE_CODES", {d: c for d, c in native.DTYPE_CODES.items() if c != 5})
    with pytest.raises(KernelUnavailable, match=r"dtype code 5: the library has int64 \(8 bytes\), kvps.dtypes "
                                                r"not a kernel dtype"):
        native.NativeLibrary(lib.path)
    monkeypatch.setattr(native, "DTYPE_CODES", {**native.DTYPE_CODES, np.dtype(np.uint64): 5})
    with pytest.raises(KernelUnavailable, match=r"has int64 \(8 bytes\), kvps.dtypes uint64 \(8 bytes\)"):
        native.NativeLibrary(lib.path)


def test_cuda_dtype_codes_come_from_kvps_dtypes():
    torch = pytest.importorskip("torch")
    from kvps import dtypes
    from kvps.kernels import cuda
    assert cuda._dtype_codes() == {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3,
                                   torch.int32: 4, torch.int64: 5}
    assert {dtypes.numpy_dtype(c) for c in cuda._dtype_codes().values()} == set(dtypes.KERNEL_CODES)
