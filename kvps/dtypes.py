"""The dtypes kvps carries, in one table: the code each has on the wire and in csrc/'s ABI
(KVPS_DTYPE_TABLE in csrc/kvps_kernels.h, checked against this table when the library loads).

    dtype_code(np.float16)     # DType.FLOAT16
    numpy_dtype(3)             # dtype(bfloat16)
"""
import enum

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


_NUMPY = {
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT64: np.dtype(np.float64),
    DType.FLOAT16: np.dtype(np.float16),
    DType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    DType.INT32: np.dtype(np.int32),
    DType.INT64: np.dtype(np.int64),
    DType.UINT8: np.dtype(np.uint8),
    DType.UINT32: np.dtype(np.uint32),
}
_FROM_NUMPY = {v: k for k, v in _NUMPY.items()}
BY_CODE = [_NUMPY[DType(i)] for i in range(len(DType))]   # indexed by plain int: no Enum hashing


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
