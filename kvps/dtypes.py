"""The dtypes kvps carries, in one table: the code each has on the wire and in csrc/'s ABI
(KVPS_DTYPE_TABLE in csrc/kvps_kernels.h; kvps.kernels.native checks the C library's table
against this one when it loads), its numpy dtype and its torch dtype.

    dtype_code(np.float16)     # DType.FLOAT16
    numpy_dtype(3)             # dtype(bfloat16)
    torch_dtype(3)             # torch.bfloat16 (imports torch; nothing else here does)
    KERNEL_CODES               # {numpy dtype: code} of the dtypes the C and CUDA kernels take
"""
import enum
import typing

import ml_dtypes
import numpy as np

from kvps.errors import ProtocolError


class DType(enum.IntEnum):
    FLOAT32 = 0
    FLOAT64 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    INT32 = 4
    INT64 = 5
    UINT8 = 6
    UINT32 = 7          # packed words of 1-bit and 2-bit gradient compression


class Row(typing.NamedTuple):
    code: DType
    numpy: np.dtype
    torch: str          # the name of the torch dtype (torch_dtype() looks it up)
    kernels: bool       # in csrc/kvps_kernels.h's KVPS_DTYPE_TABLE: the C and CUDA kernels take it


# One row per DType, in code order. numpy's dtype names are the C table's names.
TABLE = (
    Row(DType.FLOAT32, np.dtype(np.float32), "float32", True),
    Row(DType.FLOAT64, np.dtype(np.float64), "float64", True),
    Row(DType.FLOAT16, np.dtype(np.float16), "float16", True),
    Row(DType.BFLOAT16, np.dtype(ml_dtypes.bfloat16), "bfloat16", True),
    Row(DType.INT32, np.dtype(np.int32), "int32", True),
    Row(DType.INT64, np.dtype(np.int64), "int64", True),
    Row(DType.UINT8, np.dtype(np.uint8), "uint8", False),
    Row(DType.UINT32, np.dtype(np.uint32), "uint32", False),
)
assert [row.code for row in TABLE] == list(DType), "kvps.dtypes.TABLE must list every DType in code order"

_NUMPY = {row.code: row.numpy for row in TABLE}
_FROM_NUMPY = {v: k for k, v in _NUMPY.items()}
BY_CODE = [row.numpy for row in TABLE]   # indexed by plain int: no Enum hashing
# numpy dtype -> plain int code, for the kernels' C ABI (ctypes takes ints)
KERNEL_CODES = {row.numpy: int(row.code) for row in TABLE if row.kernels}


def numpy_dtype(code):
    try:
        return BY_CODE[code]
    except (IndexError, TypeError):
        raise ProtocolError(f"unknown dtype code {code!r}") from None


def dtype_code(dtype):
    """The DType of a numpy dtype; raises ValueError listing the supported ones."""
    try:
        dtype = np.dtype(dtype)
        return _FROM_NUMPY[dtype]
    except (KeyError, TypeError):
        names = ", ".join(str(d) for d in _NUMPY.values())
        raise ValueError(f"dtype {dtype} is not supported (supported: {names})") from None


def torch_dtype(code):
    """The torch dtype of a code; imports torch (kvps.dtypes itself never does).

    Raises ProtocolError for an unknown code, ValueError where this torch lacks the dtype.
    """
    import torch
    if not (isinstance(code, int) and 0 <= code < len(TABLE)):
        raise ProtocolError(f"unknown dtype code {code!r}")
    name = TABLE[code].torch
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"torch {torch.__version__} has no dtype torch.{name} (kvps dtype code {code})")
    return found
