"""kvps.kernels: the compute loops of servers and workers, at memory bandwidth.

    from kvps import kernels
    kernels.sum_into(dst, src)                      # dst += src
    kernels.adam_update(w, g, mean, var, lr=1e-3)   # fused, single pass
    words = kernels.compress_2bit(g, residual, 0.5) # MXNet 2-bit, error feedback
    print(kernels.describe())                       # backend, CPU features, CUDA

Operations take numpy arrays (C-contiguous, any shape) and work in place; their exact
results are defined by the numpy reference, kvps.kernels.reference. Backends: "c"
(csrc/, SIMD chosen at run time, threads for large arrays), "numba" (when the C
library was not built), "numpy" (the reference); KVPS_KERNELS=auto|c|cuda|numba|numpy
overrides the choice. kvps.kernels.cuda has the same operations for torch CUDA tensors.
docs/kernels.md has the details and the benchmark figures (`kvps bench kernels`).
"""
from kvps.errors import KernelUnavailable

from kvps.kernels import cuda, reference
from kvps.kernels.api import *  # noqa: F401,F403
from kvps.kernels.api import __all__ as _api_all

__all__ = ["KernelUnavailable", "cuda", "reference"] + list(_api_all)
