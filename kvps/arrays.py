"""Values as users pass them (numpy arrays, torch tensors) and as kvps moves them (numpy).

torch is imported only when a torch tensor is seen, so servers never load it.
bfloat16 tensors become numpy arrays of ml_dtypes.bfloat16 sharing their memory.
CUDA tensors are copied through host memory (for now).
"""
import ml_dtypes
import numpy as np

from kvps import kernels
from kvps.dtypes import dtype_code


def copy_into(dest, src):
    """dest[...] = src for a model-sized copy that its destination's reader takes next, not this
    thread (shared memory, the ring's fusion buffers, the caller's arrays): where both are
    contiguous of one dtype and size (their bytes in the same order), kernels.copy streams big copies
    past the cache."""
    if dest.dtype == src.dtype and dest.size == src.size and dest.flags.c_contiguous and src.flags.c_contiguous:
        kernels.copy(dest, src)
    else:
        np.copyto(dest, src)


def is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


def _torch_to_numpy(t):
    import torch
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def as_numpy(value, what):
    """A C-contiguous numpy array with the value's data (a view where possible).
    Raises TypeError/ValueError naming `what` for values kvps cannot carry."""
    if is_torch(value):
        array = _torch_to_numpy(value)
    elif isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
    else:
        raise TypeError(f"{what} is a {type(value).__name__}; kvps takes numpy arrays and torch tensors")
    try:
        dtype_code(array.dtype)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    return array


class Out:
    """A destination array: `array` is a numpy array to write into; `finish()` copies it
    back where the caller's array could not be written directly (CUDA, non-contiguous, or of
    another float dtype than `dtype`, the key's: the value is cast into it, as MXNet's pull does)."""
    __slots__ = ("target", "array", "copy_back")

    def __init__(self, target, what, dtype=None):
        self.target = target
        self.copy_back = False
        if is_torch(target):
            if target.device.type == "cpu" and target.is_contiguous():
                self.array = _torch_to_numpy(target)
            else:
                self.array = _torch_to_numpy(target).copy()
                self.copy_back = True
        elif isinstance(target, np.ndarray):
            if not target.flags.writeable:
                raise ValueError(f"{what} is read-only")
            if target.flags.c_contiguous:
                self.array = target
            else:
                self.array = np.empty(target.shape, target.dtype)
                self.copy_back = True
        else:
            raise TypeError(f"{what} is a {type(target).__name__}; kvps takes numpy arrays and torch tensors")
        try:
            dtype_code(self.array.dtype)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
        if dtype is not None and self.array.dtype != dtype and is_float(dtype) and is_float(self.array.dtype):
            self.array = np.empty(self.array.shape, dtype)
            self.copy_back = True

    def finish(self):
        if not self.copy_back:
            return
        if is_torch(self.target):
            import torch
            if self.array.dtype == ml_dtypes.bfloat16:
                src = torch.from_numpy(self.array.view(np.int16)).view(torch.bfloat16)
            else:
                src = torch.from_numpy(self.array)
            self.target.copy_(src)
        else:
            np.copyto(self.target, self.array, casting="unsafe")


def is_float(dtype):
    """float16, bfloat16, float32 or float64: the dtypes a pull casts between."""
    return np.dtype(dtype).kind == "f" or np.dtype(dtype) == ml_dtypes.bfloat16


def describe(dtype, shape):
    return f"{np.dtype(dtype)} {tuple(shape)}"
