"""The kvps wire protocol: version, op codes, dtypes and the message header.

A message is a ZeroMQ multipart message:

    frame 0      header: a msgpack map (below), small
    frame 1..n   raw array payloads, one per entry whose nbytes > 0, in entry order

A ROUTER socket prepends the sender's routing id; the transport strips it.

Header fields (all required; unknown fields are refused):

    v      int    protocol version (VERSION); another version is refused
    op     int    an Op value
    id     int    request id chosen by the sender; a reply carries its request's id
    src    str    sender's node name: "H" (scheduler), "S<rank>", "W<rank>", or "?" before registration
    keys   list   entries [key, part, dtype, shape, nbytes]: key is int or str, part is the
                  part index of a split array (0 for whole arrays), dtype a DType value,
                  shape a list of ints, nbytes the size of this entry's payload frame (0: none)
    meta   map    small op-specific fields (str keys; msgpack scalars, lists and maps)

Payloads never go inside msgpack, and nothing received is ever unpickled.
"""
import enum

import msgpack
import numpy as np

from kvps.dtypes import BY_CODE, DType, dtype_code, numpy_dtype  # noqa: F401 (the wire's dtypes)
from kvps.errors import ProtocolError, VersionMismatch

VERSION = 1


class Op(enum.IntEnum):
    # control: nodes <-> scheduler
    REGISTER = 1        # node -> H   meta: role, host, port, pid, rank (wanted), mode (workers)
    MEMBERSHIP = 2      # H -> node   reply to REGISTER once all have registered: meta: rank, nodes, mode
    BARRIER = 3         # node -> H   meta: group ("workers", "servers", "all")
    HEARTBEAT = 4       # node -> H
    FINALIZE = 5        # worker -> H: this worker is done
    SHUTDOWN = 6        # H -> server: exit now
    NODE_FAILED = 7     # H -> all    meta: node, reason, left (True: closed cleanly)
    ACK = 8             # reply: done
    ERROR = 9           # reply: meta: kind, message
    # data: worker -> server
    INIT = 20           # rank 0 sends payloads; other ranks send shapes only
    PUSH = 21
    PULL = 22
    PUSHPULL = 23
    ROW_SPARSE_PULL = 24  # payload per entry: int64 row ids local to the part
    SET_OPTIMIZER = 25  # meta: name, params, generation
    VALUE = 26          # reply carrying payloads
    STATS = 27          # reply meta: server counters
    JOIN = 28           # worker -> server: this worker has no more data; count it as pushing zeros
    # data: worker -> worker
    RING = 40           # one chunk of a ring all-reduce step; meta: collective id, step, phase


CONTROL_OPS = frozenset({Op.REGISTER, Op.MEMBERSHIP, Op.BARRIER, Op.HEARTBEAT, Op.FINALIZE,
                         Op.SHUTDOWN, Op.NODE_FAILED, Op.ACK, Op.ERROR})
DATA_OPS = frozenset(set(Op) - CONTROL_OPS)


class Entry(tuple):
    """One key (or part of a split key) in a message: (key, part, dtype, shape, nbytes)."""
    __slots__ = ()

    def __new__(cls, key, part, dtype, shape, nbytes):
        return tuple.__new__(cls, (key, part, dtype, tuple(shape), nbytes))

    key = property(lambda self: self[0])
    part = property(lambda self: self[1])
    dtype = property(lambda self: self[2])
    shape = property(lambda self: self[3])
    nbytes = property(lambda self: self[4])

    @classmethod
    def of(cls, key, part, array):
        """An entry describing a payload array."""
        return cls(key, part, dtype_code(array.dtype), array.shape, array.nbytes)

    @classmethod
    def bare(cls, key, part, dtype, shape):
        """An entry without payload (a pull request, or a non-root init)."""
        return cls(key, part, dtype, shape, 0)


_FIELDS = ("v", "op", "id", "src", "keys", "meta")


_OPS = Op._value2member_map_
_DTYPES = DType._value2member_map_


class Header:
    """A decoded message header; see the module docstring for the fields."""
    __slots__ = ("op", "id", "src", "keys", "meta")

    def __init__(self, op, id=0, src="?", keys=(), meta=None):
        self.op = op if type(op) is Op else Op(op)
        self.id = id
        self.src = src
        self.keys = list(keys)
        self.meta = {} if meta is None else meta

    def encode(self):
        return msgpack.packb({"v": VERSION, "op": int(self.op), "id": self.id, "src": self.src,
                              "keys": [[e[0], e[1], int(e[2]), list(e[3]), e[4]] for e in self.keys],
                              "meta": self.meta}, use_bin_type=True)

    def payload_count(self):
        return sum(1 for e in self.keys if e.nbytes > 0)

    def __repr__(self):
        nbytes = sum(e.nbytes for e in self.keys)
        return f"{self.src} {self.op.name} id={self.id} keys={len(self.keys)} {_size(nbytes)}"


def _size(n):
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n}{unit}"
        n //= 1024
    return f"{n}GB"


def decode(frame):
    """Decode and validate a header frame; raises ProtocolError naming the bad field."""
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=False, max_bin_len=1 << 20,
                              max_str_len=1 << 20, max_array_len=1 << 24, max_map_len=1 << 16)
    except Exception as exc:  # msgpack raises several types for garbage
        raise ProtocolError(f"header is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not (type(raw) is dict):
        raise ProtocolError(f"header is a {type(raw).__name__}, not a map")
    version = raw.get("v")
    if version != VERSION:
        raise VersionMismatch(f"peer speaks kvps protocol version {version!r}, this node speaks {VERSION}")
    try:
        op, request_id, src, keys, meta = raw["op"], raw["id"], raw["src"], raw["keys"], raw["meta"]
    except KeyError:
        op = None
    if not (op is not None and len(raw) == len(_FIELDS)):
        raise ProtocolError(f"header fields {sorted(map(str, raw))} are not {list(_FIELDS)}")
    if not (type(op) is int and op in _OPS):
        raise ProtocolError(f"unknown op {op!r}")
    if not (type(request_id) is int):
        raise ProtocolError(f"id {request_id!r} is not an int")
    if not (type(src) is str):
        raise ProtocolError(f"src {src!r} is not a str")
    if not (type(meta) is dict):
        raise ProtocolError(f"meta is a {type(meta).__name__}, not a map")
    if not (type(keys) is list):
        raise ProtocolError("keys is not a list")
    return Header(_OPS[op], request_id, src, [_entry(e) for e in keys], meta)


def _entry(e):
    if not (type(e) is list and len(e) == 5):
        raise ProtocolError(f"entry {e!r} is not [key, part, dtype, shape, nbytes]")
    key, part, dtype, shape, nbytes = e
    if not (type(key) is int or type(key) is str):
        raise ProtocolError(f"key {key!r} is not an int or str")
    if not (type(part) is int and part >= 0):
        raise ProtocolError(f"part {part!r} of key {key!r} is not a part index")
    if not (type(dtype) is int and 0 <= dtype < len(BY_CODE)):
        raise ProtocolError(f"dtype {dtype!r} of key {key!r} is unknown")
    if not (type(shape) is list and all(type(d) is int and d >= 0 for d in shape)):
        raise ProtocolError(f"shape {shape!r} of key {key!r} is not a list of sizes")
    if not (type(nbytes) is int and nbytes >= 0):
        raise ProtocolError(f"nbytes {nbytes!r} of key {key!r} is not a size")
    return tuple.__new__(Entry, (key, part, dtype, tuple(shape), nbytes))


def unpack(frames):
    """Split a received multipart message into (Header, payload frames) and check the payload sizes."""
    if not (len(frames) >= 1):
        raise ProtocolError("empty message")
    first = frames[0]
    header = decode(first.buffer if hasattr(first, "buffer") else first)
    payloads = frames[1:]
    carrying = [e for e in header.keys if e[4] > 0]
    want = len(carrying)
    if not (len(payloads) == want):
        raise ProtocolError(f"{header.op.name} declares {want} payload frames, carries {len(payloads)}")
    for entry, frame in zip(carrying, payloads):
        got = len(frame)
        if not (got == entry.nbytes):
            raise ProtocolError(f"payload of key {entry.key!r} part {entry.part} has {got} bytes, "
                                          f"header says {entry.nbytes}")
        count = 1
        for d in entry.shape:
            count *= d
        if not (count * BY_CODE[entry.dtype].itemsize == entry.nbytes):
            raise ProtocolError(f"payload of key {entry.key!r} part {entry.part} has {entry.nbytes} bytes, "
                     f"but {BY_CODE[entry.dtype]} {entry.shape} needs {count * BY_CODE[entry.dtype].itemsize}")
    return header, payloads


def as_array(frame, entry):
    """A read-only numpy view of a payload frame (no copy)."""
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    return np.frombuffer(buf, dtype=BY_CODE[entry.dtype]).reshape(entry.shape)


def error_header(request_id, src, kind, message):
    return Header(Op.ERROR, request_id, src, meta={"kind": kind, "message": message})
