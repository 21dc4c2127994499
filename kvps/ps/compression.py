"""Gradient compression on the wire: what a worker pushes and how a server reads it back, and
(with "pull": True) what a server sends back and how a worker reads it.

    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})                # pushes
    kv.set_gradient_compression({"type": "fp16", "pull": True})                    # pushes and pulls

Only float32 keys are compressed, with the kernels of kvps.kernels (MXNet's formats, error
feedback kept per key on the worker for pushes, per key, part and worker on the server for pulls):

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

Compressed pull (PullEncoder on the server, PullDecoder on the worker; docs/compression.md says
why): a PULL or PUSHPULL whose meta["pull"] names a codec is answered with each float32 entry
compressed, and the VALUE reply's meta says how ("codec", and "delta"). What is compressed
depends on what the value is:

    update  dist_sync without a server optimizer: the value is a round's merged update (the sum
            of the pushes), so the server sends C(value + residual) and keeps the residual per
            worker, as BytePS does; over rounds, what a worker received sums to the true sums
            less that residual. The init value (before the first round) travels as it is, and a
            round pulled twice comes back the same.
    delta   every other case (a server optimizer, dist_async, dist_ssp, dist_geo): the value is a
            weight, which must not be error-fed (the worker replaces its copy, it does not add it
            up), so the server sends C(value - known), where `known` is what this worker holds,
            and adds the decoded change to `known`; the worker adds it to its copy. The first
            pull of a key travels as it is; after it the worker's copy differs from the value by
            one compression's error, which the next pull sends on (error feedback on the change).

An entry sent as it is (float32) is told from a compressed one by its dtype.
"""
import math

import ml_dtypes
import numpy as np

from kvps import kernels
from kvps.errors import KVValueError, ProtocolError

TYPES = {"2bit": ("threshold",), "1bit": ("threshold",), "fp16": (), "bf16": (), "topk": ("ratio",)}
_RESIDUAL = {"2bit", "1bit", "topk"}
COMMON = ("pull",)          # options of every type: "pull": True compresses pulls too


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
    extra = sorted(set(spec) - {"type", *TYPES[kind], *COMMON})
    if extra:
        raise ValueError(f"gradient compression {kind} takes {', '.join(TYPES[kind]) or 'no parameters'}, "
                         f"not {', '.join(extra)} (and every type takes pull=True: compress pulls too)")
    pull = spec.get("pull", False)
    if not isinstance(pull, bool):
        raise ValueError(f"gradient compression pull={pull!r} must be True or False")
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
    if pull:
        out["pull"] = True
    return out


def wire(spec):
    """The codec as the wire carries it (meta["codec"], meta["pull"]): the spec without "pull";
    None for None."""
    return None if spec is None else {k: v for k, v in spec.items() if k != "pull"}


def pulls(spec):
    """The codec for pulls of a checked spec, or None when pulls travel as they are."""
    return wire(spec) if spec is not None and spec.get("pull") else None


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


class _PullState:
    """One (worker, key, part) of compressed pulls on the server."""
    __slots__ = ("codec", "delta", "residual", "known", "version", "payload")

    def __init__(self, codec, delta):
        self.codec, self.delta = codec, delta
        self.residual = None     # update: what the rounds sent so far fell short of
        self.known = None        # delta: the value as this worker holds it
        self.version = None      # update: the round last sent, and its payload
        self.payload = None


class PullEncoder:
    """The server's side of compressed pulls: the error-feedback state per worker, key and part.

        pulls = PullEncoder()
        payload = pulls.encode(worker, slot_id, value, codec, delta, version)   # value: float32
        pulls.forget(worker)                                                    # it left or died

    `delta` says what the value is (module docstring): False for a round's merged update (dist_sync
    without an optimizer), True for weights. `version` counts the updates the value has seen.
    Returns the array to send: the payload, or the float32 value itself (sent as it is)."""

    def __init__(self):
        self._states = {}        # (worker, key, part) -> _PullState

    def encode(self, worker, slot_id, value, codec, delta, version):
        slot_key = (worker,) + tuple(slot_id)
        state = self._states.get(slot_key)
        if state is None or state.codec != codec or state.delta != delta:
            # new, or the codec or the kind of value changed (an optimizer set later): start over
            state = self._states[slot_key] = _PullState(codec, delta)
        flat = np.ascontiguousarray(value).reshape(-1)
        if delta:
            if state.known is None:
                state.known = flat.copy()
                return value
            change = np.subtract(flat, state.known)
            payload = encode(codec, change, np.zeros_like(change) if needs_residual(codec) else None)
            kernels.sum_into(state.known, decode(codec, payload, flat.size, "pull"))
            return payload
        if version == 0:
            return value                      # the init value is a weight, not an update
        if state.version == version:
            return state.payload              # the same round again: the same approximation
        if state.residual is None:
            state.residual = np.zeros(flat.size, np.float32)
        if needs_residual(codec):
            payload = encode(codec, flat, state.residual)          # the kernel adds and keeps the residual
        else:
            target = flat + state.residual
            payload = encode(codec, target, None)
            np.subtract(target, decode(codec, payload, flat.size, "pull"), out=state.residual)
        state.version, state.payload = version, payload
        return payload

    def forget(self, worker):
        for slot_key in [k for k in self._states if k[0] == worker]:
            del self._states[slot_key]

    def residual(self, worker, slot_id):
        """What the server still owes `worker` for this slot (update: the residual; delta: value
        - known is not kept, so None); for tests and debugging."""
        state = self._states.get((worker,) + tuple(slot_id))
        return None if state is None else state.residual


class PullDecoder:
    """The worker's side of compressed pulls: its copy of each (key, part) in delta mode.

        values = decoder.values(key, part, payload, size, codec, delta, what)   # float32, flat
        decoder.received(key, part, values)     # delta mode: an entry that came as it is (float32)

    Raises KVValueError for a payload that does not fit, and ProtocolError for a change that
    has no copy to be added to (the server and this worker disagree about what it holds)."""

    def __init__(self):
        self._copies = {}        # (key, part) -> float32, what the server knows this worker holds

    def values(self, key, part, payload, size, codec, delta, what):
        change = decode(codec, payload, size, what)
        if not delta:
            return change
        copy = self._copies.get((key, part))
        if copy is None or copy.size != size:
            raise ProtocolError(f"{what}: the server sent a compressed change, but this worker holds no "
                                f"copy of it to add it to (the first pull of a key comes uncompressed)")
        kernels.sum_into(copy, change)
        return copy

    def received(self, key, part, values):
        self._copies[(key, part)] = np.array(values, np.float32, copy=True).reshape(-1)
