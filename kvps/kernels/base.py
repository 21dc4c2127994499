"""The backend interface, and what the backend modules share.

A backend implements `Backend` for numpy arrays that kvps.kernels has already validated
(C-contiguous, dtypes and sizes checked); every operation works in place. The backends
are reference.NumpyBackend, native.CBackend and numba_impl.NumbaBackend; kvps.kernels.cuda
runs the same operations on torch tensors. kvps.kernels.select finds them by name.
This module imports none of them.

Also here: the ABI version both shared libraries must report, where they and the C
build's status file live, and how an optional clip value crosses the C ABI.
"""
import abc
import os

import numpy as np

# csrc/kvps_kernels.h's KVPS_ABI_VERSION, of _kvps_kernels.so and of _kvps_cuda.so.
ABI_VERSION = 2
# Written by setup.py beside the libraries on every C build: "ok", or "failed: <reason>"
# and the compiler's output (see build_status()).
BUILD_STATUS = "_build_status.txt"
REBUILD = "pip install --no-build-isolation -e . (in the source tree)"


def library_path(name):
    """Where setup.py puts a shared library of this package (beside this file)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), name)


def build_status(library):
    """(state, reason, output) recorded by setup.py for the C library at path `library`.

    state is "ok", "failed" or "unknown" (no status file: the library was never built
    here, or came from an older setup.py); reason is one line; output is the compiler's
    output (the end of it) when the build failed.
    """
    path = os.path.join(os.path.dirname(library), BUILD_STATUS)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            first, _, output = f.read().partition("\n")
    except OSError:
        return "unknown", f"no build was recorded ({path} is missing)", ""
    state, _, reason = first.partition(":")
    if state.strip() == "ok":
        return "ok", "", ""
    return "failed", reason.strip() or "no reason was recorded", output


def clip_arg(value):
    """A clip value for the C ABI: None turns clipping off, which C reads from any value <= 0."""
    return -1.0 if value is None else float(value)


class Backend(abc.ABC):
    """Kernels over validated numpy arrays; every operation works in place."""

    name = None

    def details(self):
        """One line for describe(): where the code comes from and how it runs."""
        return ""

    def copy(self, dst, src):
        """dst[:] = src, byte for byte (kvps.kernels.copy); a backend may copy big arrays faster."""
        np.copyto(dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8))

    @abc.abstractmethod
    def sum_into(self, dst, src): ...

    @abc.abstractmethod
    def sum_sources(self, dst, srcs): ...

    @abc.abstractmethod
    def scale(self, x, alpha): ...

    @abc.abstractmethod
    def axpy(self, y, alpha, x): ...

    @abc.abstractmethod
    def cast(self, src, dst): ...

    @abc.abstractmethod
    def sgd_update(self, weight, grad, mom, *, lr, momentum, wd, rescale_grad, clip_gradient, nesterov): ...

    @abc.abstractmethod
    def adam_update(self, weight, grad, mean, var, *, lr, beta1, beta2, epsilon, wd, rescale_grad,
                    clip_gradient): ...

    @abc.abstractmethod
    def adamw_update(self, weight, grad, mean, var, *, lr, beta1, beta2, epsilon, wd, rescale_grad,
                     clip_gradient, eta): ...

    @abc.abstractmethod
    def adagrad_update(self, weight, grad, history, *, lr, epsilon, wd, rescale_grad, clip_gradient): ...

    @abc.abstractmethod
    def rmsprop_update(self, weight, grad, n, *, lr, gamma1, epsilon, wd, rescale_grad, clip_gradient,
                       clip_weights): ...

    @abc.abstractmethod
    def compress_2bit(self, grad, residual, threshold): ...

    @abc.abstractmethod
    def decompress_2bit_add(self, packed, threshold, dst): ...

    @abc.abstractmethod
    def compress_1bit(self, grad, residual, threshold): ...

    @abc.abstractmethod
    def decompress_1bit_add(self, packed, dst): ...

    @abc.abstractmethod
    def compress_topk(self, grad, residual, k): ...

    @abc.abstractmethod
    def decompress_topk_add(self, indices, values, dst): ...
