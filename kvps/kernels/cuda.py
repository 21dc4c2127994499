"""The kernels for torch CUDA tensors, backed by _kvps_cuda.so (csrc/cuda_kernels.cu).

    from kvps.kernels import cuda
    cuda.sum_into(dst, src)                          # dst += src on dst's GPU
    words = cuda.compress_2bit(grad, residual, 0.5)  # int32 tensor holding the uint32 words

Same operations, arguments and results as kvps.kernels on numpy arrays; tensors must be
contiguous and on one CUDA device. Every function takes stream= (a torch.cuda.Stream;
default: the current stream of the tensors' device) and returns without synchronising.
torch is imported on first use only (servers never import it), and the library is only
loaded where an NVIDIA driver is present: `status()` says whether CUDA is usable and why
not. Packed compression words come back as torch.int32 (torch has little uint32
support); the bits are MXNet's, as on the CPU.
"""
import contextlib
import ctypes
import ctypes.util
import functools
import os

from kvps import dtypes
from kvps.errors import KernelUnavailable

from kvps.kernels import base
from kvps.kernels.base import ABI_VERSION, clip_arg as _clip

LIBRARY = "_kvps_cuda.so"
MAX_SOURCES = 64  # KVPS_CUDA_MAX_SOURCES
STATUS_OK, STATUS_CUDA = 0, 6
_p, _i, _i64, _f, _d = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_double

# name: argtypes without the trailing (device, stream); all return int
SIGNATURES = {
    "kvps_cuda_sum_into": [_i, _p, _p, _i64],
    "kvps_cuda_sum_sources": [_i, _p, ctypes.POINTER(_p), _i, _i64],
    "kvps_cuda_scale": [_i, _p, _d, _i64],
    "kvps_cuda_axpy": [_i, _p, _d, _p, _i64],
    "kvps_cuda_cast": [_i, _p, _i, _p, _i64],
    "kvps_cuda_sgd_update": [_i, _p, _p, _p, _i64, _f, _f, _f, _f, _f, _i],
    "kvps_cuda_adam_update": [_i, _p, _p, _p, _p, _i64, _f, _f, _f, _f, _f, _f, _f],
    "kvps_cuda_adamw_update": [_i, _p, _p, _p, _p, _i64, _f, _f, _f, _f, _f, _f, _f, _f],
    "kvps_cuda_adagrad_update": [_i, _p, _p, _p, _i64, _f, _f, _f, _f, _f],
    "kvps_cuda_rmsprop_update": [_i, _p, _p, _p, _i64, _f, _f, _f, _f, _f, _f, _f],
    "kvps_cuda_compress_2bit": [_p, _p, _p, _i64, _f],
    "kvps_cuda_decompress_2bit_add": [_p, _f, _p, _i64],
    "kvps_cuda_compress_1bit": [_p, _p, _p, _i64, _f],
    "kvps_cuda_decompress_1bit_add": [_p, _p, _i64],
}


def library_path():
    return base.library_path(LIBRARY)


class CudaLibrary:
    """The loaded _kvps_cuda.so with its functions' types declared."""

    def __init__(self, path):
        lib = ctypes.CDLL(path)
        lib.kvps_cuda_abi_version.restype = _i
        version = lib.kvps_cuda_abi_version()
        if version != ABI_VERSION:
            raise KernelUnavailable(f"{path} has ABI version {version}, this package expects {ABI_VERSION}: "
                                    f"rebuild it ({base.REBUILD})")
        lib.kvps_cuda_last_error.restype = ctypes.c_char_p
        lib.kvps_cuda_device_count.argtypes = [ctypes.POINTER(_i)]
        lib.kvps_cuda_device_name.argtypes = [_i, ctypes.c_char_p, _i]
        for name, argtypes in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = _i, argtypes + [_i, _p]
        self.lib, self.path = lib, path

    def check(self, status, op):
        """The one place where this library's status codes become exceptions."""
        if status == STATUS_OK:
            return
        if status == STATUS_CUDA:
            raise RuntimeError(f"{op}: {self.lib.kvps_cuda_last_error().decode()}")
        raise ValueError(f"{op}: CUDA kernel refused its arguments (status {status})")

    def devices(self):
        count = _i(0)
        status = self.lib.kvps_cuda_device_count(ctypes.byref(count))
        if status != STATUS_OK:
            raise KernelUnavailable(self.lib.kvps_cuda_last_error().decode())
        names = []
        for d in range(count.value):
            buf = ctypes.create_string_buffer(256)
            self.lib.kvps_cuda_device_name(d, buf, len(buf))
            names.append(buf.value.decode())
        return names


def _driver_present():
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda")):
        if name:
            try:
                ctypes.CDLL(name)
                return True
            except OSError:
                continue
    return False


@functools.lru_cache(maxsize=None)
def _probe():
    """(library or None, reason): loads the library only where a driver is present."""
    path = library_path()
    if not os.path.exists(path):
        return None, (f"the CUDA library was not built ({path} is missing: nvcc was not found, or "
                      f"KVPS_BUILD_CUDA=0, at install time)")
    if not _driver_present():
        return None, "no NVIDIA driver on this machine (libcuda.so.1 cannot be loaded)"
    try:
        lib = CudaLibrary(path)
        names = lib.devices()
    except (OSError, KernelUnavailable) as exc:
        return None, f"the CUDA runtime failed: {exc}"
    if not names:
        return None, "the NVIDIA driver reports no GPU"
    return lib, f"{len(names)} device(s): {'; '.join(names)}"


def status():
    """(usable, text): whether the CUDA kernels can run here, with the devices or the reason."""
    lib, text = _probe()
    return lib is not None, text


def _lib():
    lib, reason = _probe()
    if lib is None:
        raise KernelUnavailable(f"CUDA kernels are not usable: {reason}")
    return lib


# ---- tensors ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _dtype_codes():
    """torch dtype -> code of KVPS_DTYPE_TABLE, from kvps.dtypes (imports torch)."""
    return {dtypes.torch_dtype(code): code for code in dtypes.KERNEL_CODES.values()}


def _tensor(op, name, t, dtypes, device=None):
    import torch
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise ValueError(f"{op}: {name} is on {t.device}; the CUDA kernels need CUDA tensors")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} {t.dtype} {tuple(t.shape)} is not contiguous (strides {t.stride()})")
    if t.dtype not in dtypes:
        raise ValueError(f"{op}: {name} is {t.dtype}; expected {' or '.join(str(d) for d in dtypes)}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but the other tensors are on {device}")
    return t


def _same(op, na, a, nb, b, dtype=True):
    if a.numel() != b.numel() or (dtype and a.dtype != b.dtype):
        raise ValueError(f"{op}: {na} is {a.dtype} {tuple(a.shape)} but {nb} is {b.dtype} {tuple(b.shape)}")


def _stream(stream, device):
    import torch
    s = stream if stream is not None else torch.cuda.current_stream(device)
    return s.cuda_stream


def _launch(op, fn_name, device, stream, *args):
    lib = _lib()
    lib.check(getattr(lib.lib, fn_name)(*args, device.index, _stream(stream, device)), op)


def _floats():
    import torch
    return (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _all():
    import torch
    return _floats() + (torch.int32, torch.int64)


def _grads():
    import torch
    return (torch.float32, torch.float16, torch.bfloat16)


def sum_into(dst, src, stream=None):
    """dst += src (see kvps.kernels.sum_into)."""
    _tensor("sum_into", "dst", dst, _all())
    _tensor("sum_into", "src", src, _all(), dst.device)
    _same("sum_into", "dst", dst, "src", src)
    _launch("sum_into", "kvps_cuda_sum_into", dst.device, stream, _dtype_codes()[dst.dtype], dst.data_ptr(),
            src.data_ptr(), dst.numel())


def sum_sources(dst, srcs, stream=None):
    """dst = srcs[0] + srcs[1] + ... (at most 64 sources per call)."""
    _tensor("sum_sources", "dst", dst, _all())
    if not srcs or len(srcs) > MAX_SOURCES:
        raise ValueError(f"sum_sources: {len(srcs)} sources; the CUDA kernel takes 1 to {MAX_SOURCES}")
    for i, s in enumerate(srcs):
        _tensor("sum_sources", f"srcs[{i}]", s, _all(), dst.device)
        _same("sum_sources", "dst", dst, f"srcs[{i}]", s)
    ptrs = (ctypes.c_void_p * len(srcs))(*[s.data_ptr() for s in srcs])
    _launch("sum_sources", "kvps_cuda_sum_sources", dst.device, stream, _dtype_codes()[dst.dtype], dst.data_ptr(),
            ptrs, len(srcs), dst.numel())


def scale(x, alpha, stream=None):
    _tensor("scale", "x", x, _floats())
    _launch("scale", "kvps_cuda_scale", x.device, stream, _dtype_codes()[x.dtype], x.data_ptr(), float(alpha),
            x.numel())


def axpy(y, alpha, x, stream=None):
    _tensor("axpy", "y", y, _floats())
    _tensor("axpy", "x", x, _floats(), y.device)
    _same("axpy", "y", y, "x", x)
    _launch("axpy", "kvps_cuda_axpy", y.device, stream, _dtype_codes()[y.dtype], y.data_ptr(), float(alpha),
            x.data_ptr(), y.numel())


def cast(src, dst, stream=None):
    _tensor("cast", "src", src, _floats())
    _tensor("cast", "dst", dst, _floats(), src.device)
    _same("cast", "src", src, "dst", dst, dtype=False)
    codes = _dtype_codes()
    _launch("cast", "kvps_cuda_cast", src.device, stream, codes[src.dtype], src.data_ptr(), codes[dst.dtype],
            dst.data_ptr(), src.numel())


def _opt(op, weight, grad, states):
    import torch
    _tensor(op, "weight", weight, (torch.float32,))
    _tensor(op, "grad", grad, _grads(), weight.device)
    _same(op, "weight", weight, "grad", grad, dtype=False)
    for name, s in states.items():
        if s is not None:
            _tensor(op, name, s, (torch.float32,), weight.device)
            _same(op, "weight", weight, name, s)
    return _dtype_codes()[grad.dtype]


def _ptr(t):
    return None if t is None else t.data_ptr()


def sgd_update(weight, grad, mom, *, lr, momentum=0.0, wd=0.0, rescale_grad=1.0, clip_gradient=None,
               nesterov=False, stream=None):
    g = _opt("sgd_update", weight, grad, {"mom": mom})
    if mom is None and momentum != 0:
        raise ValueError(f"sgd_update: momentum={momentum} needs a momentum state tensor, got mom=None")
    _launch("sgd_update", "kvps_cuda_sgd_update", weight.device, stream, g, weight.data_ptr(), grad.data_ptr(),
            _ptr(mom), weight.numel(), lr, momentum, wd, rescale_grad, _clip(clip_gradient), int(bool(nesterov)))


def adam_update(weight, grad, mean, var, *, lr, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.0, rescale_grad=1.0,
                clip_gradient=None, stream=None):
    g = _opt("adam_update", weight, grad, {"mean": mean, "var": var})
    _launch("adam_update", "kvps_cuda_adam_update", weight.device, stream, g, weight.data_ptr(), grad.data_ptr(),
            mean.data_ptr(), var.data_ptr(), weight.numel(), lr, beta1, beta2, epsilon, wd, rescale_grad,
            _clip(clip_gradient))


def adamw_update(weight, grad, mean, var, *, lr, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.0, rescale_grad=1.0,
                 clip_gradient=None, eta=1.0, stream=None):
    g = _opt("adamw_update", weight, grad, {"mean": mean, "var": var})
    _launch("adamw_update", "kvps_cuda_adamw_update", weight.device, stream, g, weight.data_ptr(), grad.data_ptr(),
            mean.data_ptr(), var.data_ptr(), weight.numel(), lr, beta1, beta2, epsilon, wd, rescale_grad,
            _clip(clip_gradient), eta)


def adagrad_update(weight, grad, history, *, lr, epsilon=1e-7, wd=0.0, rescale_grad=1.0, clip_gradient=None,
                   stream=None):
    g = _opt("adagrad_update", weight, grad, {"history": history})
    _launch("adagrad_update", "kvps_cuda_adagrad_update", weight.device, stream, g, weight.data_ptr(),
            grad.data_ptr(), history.data_ptr(), weight.numel(), lr, epsilon, wd, rescale_grad, _clip(clip_gradient))


def rmsprop_update(weight, grad, n, *, lr, gamma1=0.9, epsilon=1e-8, wd=0.0, rescale_grad=1.0, clip_gradient=None,
                   clip_weights=None, stream=None):
    g = _opt("rmsprop_update", weight, grad, {"n": n})
    _launch("rmsprop_update", "kvps_cuda_rmsprop_update", weight.device, stream, g, weight.data_ptr(),
            grad.data_ptr(), n.data_ptr(), weight.numel(), lr, gamma1, epsilon, wd, rescale_grad,
            _clip(clip_gradient), _clip(clip_weights))


def _residual_pair(op, grad, residual):
    import torch
    _tensor(op, "grad", grad, (torch.float32,))
    _tensor(op, "residual", residual, (torch.float32,), grad.device)
    _same(op, "grad", grad, "residual", residual)


def _words(op, packed, dst, per_word):
    import torch
    _tensor(op, "dst", dst, (torch.float32,))
    _tensor(op, "packed", packed, (torch.int32,), dst.device)
    words = -(-dst.numel() // per_word)
    if packed.numel() != words:
        raise ValueError(f"{op}: packed has {packed.numel()} words; dst needs {words}")


def compress_2bit(grad, residual, threshold, stream=None):
    """MXNet 2-bit compression; returns ceil(n/16) words as an int32 tensor."""
    import torch
    _residual_pair("compress_2bit", grad, residual)
    if not threshold > 0:
        raise ValueError(f"compress_2bit: threshold={threshold!r} must be > 0")
    out = torch.empty(-(-grad.numel() // 16), dtype=torch.int32, device=grad.device)
    _launch("compress_2bit", "kvps_cuda_compress_2bit", grad.device, stream, grad.data_ptr(), residual.data_ptr(),
            out.data_ptr(), grad.numel(), threshold)
    return out


def decompress_2bit_add(packed, threshold, dst, stream=None):
    _words("decompress_2bit_add", packed, dst, 16)
    _launch("decompress_2bit_add", "kvps_cuda_decompress_2bit_add", dst.device, stream, packed.data_ptr(),
            threshold, dst.data_ptr(), dst.numel())


def compress_1bit(grad, residual, threshold=0.0, stream=None):
    """MXNet 1-bit compression; returns ceil(n/32) words as an int32 tensor."""
    import torch
    _residual_pair("compress_1bit", grad, residual)
    out = torch.empty(-(-grad.numel() // 32), dtype=torch.int32, device=grad.device)
    _launch("compress_1bit", "kvps_cuda_compress_1bit", grad.device, stream, grad.data_ptr(), residual.data_ptr(),
            out.data_ptr(), grad.numel(), threshold)
    return out


def decompress_1bit_add(packed, dst, stream=None):
    _words("decompress_1bit_add", packed, dst, 32)
    _launch("decompress_1bit_add", "kvps_cuda_decompress_1bit_add", dst.device, stream, packed.data_ptr(),
            dst.data_ptr(), dst.numel())


def compress_topk(grad, residual, k, stream=None):
    """Top-k with error feedback, with torch's own kernels: same selection as the CPU
    (largest |residual| bit pattern, ties to the lower index), indices ascending."""
    import torch
    _residual_pair("compress_topk", grad, residual)
    _lib()
    n = residual.numel()
    k = min(int(k), n)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        r = residual.view(-1)
        r.add_(grad.view(-1))
        # key in the high 32 bits, reversed index in the low 32: larger key, then lower index, wins
        keys = (r.view(torch.int32).to(torch.int64) & 0x7FFFFFFF) << 32
        keys |= (0xFFFFFFFF - torch.arange(n, device=r.device, dtype=torch.int64))
        idx = torch.topk(keys, k, sorted=False).indices.sort().values
        values = r[idx].clone()
        r[idx] = 0
    index_dtype = torch.int32 if n <= 2**31 - 1 else torch.int64
    return idx.to(index_dtype), values


def decompress_topk_add(indices, values, dst, stream=None):
    """dst[indices] += values (atomic adds: repeated indices add up in an unspecified order)."""
    import torch
    _tensor("decompress_topk_add", "dst", dst, (torch.float32,))
    _tensor("decompress_topk_add", "values", values, (torch.float32,), dst.device)
    _tensor("decompress_topk_add", "indices", indices, (torch.int32, torch.int64), dst.device)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        dst.view(-1).index_add_(0, indices.view(-1).to(torch.int64), values.view(-1))

