"""Gradient compression on the wire: what a worker pushes and how a server reads it back.

    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})

Only float32 keys are compressed, only on push (pulls send the values as they are), with the
kernels of kvps.kernels (MXNet's formats, error feedback kept per key on the worker):

    type   parameters          payload (per key part)                       bytes per float32
    2bit   threshold (> 0)     uint32 words, 16 values each: +t, -t or 0     1/16
    1bit   threshold (>= 0)    uint32 words, 32 signs each: +1 or -1         1/32
    fp16   -                   float16 values                                1/2
    bf16   -                   bfloat16 values                               1/2
    topk   ratio (0, 1]        int32 [2, k]: row 0 indices, row 1 the        2k/n
                               float32 values' bits

A compressed message says so in meta["codec"]; the server decodes every float32 key of it
into a float32 gradient before the usual round or update. The residuals make the sum of
what was sent plus what is left equal to the sum of the true gradients.
"""
import math

import ml_dtypes
import numpy as np

from kvps import kernels
from kvps.errors import KVValueError

TYPES = {"2bit": ("threshold",), "1bit": ("threshold",), "fp16": (), "bf16": (), "topk": ("ratio",)}
_RESIDUAL = {"2bit", "1bit", "topk"}


def check(spec):
    """A validated copy of a compression spec (MXNet's dict form); raises ValueError naming the problem."""
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        raise ValueError(f"gradient compression {spec!r} must be a dict with a 'type' "
                         f"({', '.join(TYPES)} or 'none')")
    kind = spec["type"].lower()
    if kind == "none":
        return None
    if kind not in TYPES:
        raise ValueError(f"unknown gradient compression type {spec['type']!r}; types: {', '.join(TYPES)}, none")
    extra = sorted(set(spec) - {"type", *TYPES[kind]})
    if extra:
        raise ValueError(f"gradient compression {kind} takes {', '.join(TYPES[kind]) or 'no parameters'}, "
                         f"not {', '.join(extra)}")
    out = {"type": kind}
    if kind in ("2bit", "1bit"):
        t = spec.get("threshold", 0.5 if kind == "2bit" else 0.0)
        if not isinstance(t, (int, float)) or t < 0 or (kind == "2bit" and t == 0) or not math.isfinite(t):
            raise ValueError(f"gradient compression {kind} threshold={t!r} must be a finite number "
                             f"{'> 0' if kind == '2bit' else '>= 0'}")
        out["threshold"] = float(t)
    if kind == "topk":
        r = spec.get("ratio", 0.01)
        if not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError(f"gradient compression topk ratio={r!r} must lie in (0, 1]")
        out["ratio"] = float(r)
    return out


def needs_residual(spec):
    return spec["type"] in _RESIDUAL


def encode(spec, grad, residual):
    """The payload array for a flat float32 gradient (residual: float32 like grad, or None)."""
    kind = spec["type"]
    if kind == "2bit":
        return kernels.compress_2bit(grad, residual, spec["threshold"])
    if kind == "1bit":
        return kernels.compress_1bit(grad, residual, spec["threshold"])
    if kind in ("fp16", "bf16"):
        out = np.empty(grad.shape, np.float16 if kind == "fp16" else ml_dtypes.bfloat16)
        kernels.cast(grad, out)
        return out
    k = max(1, int(round(spec["ratio"] * grad.size))) if grad.size else 0
    indices, values = kernels.compress_topk(grad, residual, k)
    return np.stack([indices.astype(np.int32), values.view(np.int32)])


def decode(spec, payload, size, what):
    """A float32 gradient of `size` elements from a payload; raises KVValueError if it cannot be one."""
    kind = spec.get("type") if isinstance(spec, dict) else None
    out = np.zeros(size, np.float32)
    if kind in ("2bit", "1bit"):
        per_word = 16 if kind == "2bit" else 32
        want = -(-size // per_word)
        if payload.dtype != np.uint32 or payload.size != want:
            raise KVValueError(f"{what}: {kind} payload must be {want} uint32 words, got {payload.dtype} {payload.shape}")
        if kind == "2bit":
            kernels.decompress_2bit_add(payload.reshape(-1), _number(spec, "threshold", what), out)
        else:
            kernels.decompress_1bit_add(payload.reshape(-1), out)
    elif kind in ("fp16", "bf16"):
        dtype = np.float16 if kind == "fp16" else ml_dtypes.bfloat16
        if payload.dtype != dtype or payload.size != size:
            raise KVValueError(f"{what}: {kind} payload must be {size} {np.dtype(dtype)}, got "
                               f"{payload.dtype} {payload.shape}")
        kernels.cast(np.ascontiguousarray(payload.reshape(-1)), out)
    elif kind == "topk":
        if payload.dtype != np.int32 or payload.ndim != 2 or payload.shape[0] != 2 or payload.shape[1] > size:
            raise KVValueError(f"{what}: topk payload must be int32 [2, k<={size}], got {payload.dtype} "
                               f"{payload.shape}")
        values = np.ascontiguousarray(payload[1]).view(np.float32)
        try:
            kernels.decompress_topk_add(np.ascontiguousarray(payload[0]), values, out)
        except ValueError as exc:
            raise KVValueError(f"{what}: {exc}") from None
    else:
        raise KVValueError(f"{what}: unknown gradient compression {spec!r}")
    return out


def _number(spec, name, what):
    value = spec.get(name)
    if not isinstance(value, (int, float)):
        raise KVValueError(f"{what}: compression {name}={value!r} is not a number")
    return value
