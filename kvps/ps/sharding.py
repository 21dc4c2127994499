"""Where each key lives: a pure module (no sockets, no state), unit-tested on its own.

A small array lives whole on one server, chosen by a stable hash of the key, so
every worker finds it in the same place whatever order keys were initialised in
(MXNet maps str keys to ints in init order, which breaks when workers differ).

An array with at least `bound` elements is split along its first axis into
contiguous row ranges, one per server, or a multiple of that when the parts would
exceed `partition_bytes` (BytePS's partitions), dealt round the servers starting
at the hashed one, so every server holds an equal share of it (fewer parts when
the array has fewer rows). Big arrays thus spread their
traffic over all servers, a server can answer one part while the next arrives,
and a row-sparse pull asks each server only for its own rows.
"""
import dataclasses
import functools
import hashlib
import math

import numpy as np


def stable_hash(key):
    """A hash of an int or str key that is the same in every process and run."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(f"key {key!r} is a {type(key).__name__}; keys are int or str")
    text = f"i:{key}" if isinstance(key, int) else f"s:{key}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


@dataclasses.dataclass(frozen=True)
class Part:
    """Rows [row_start, row_stop) of a key, held by `server`."""
    index: int
    server: int
    row_start: int
    row_stop: int
    row_size: int      # elements per row

    # element bounds, computed once (a per-key call reads them several times)
    @functools.cached_property
    def start(self):
        return self.row_start * self.row_size

    @functools.cached_property
    def stop(self):
        return self.row_stop * self.row_size

    @functools.cached_property
    def size(self):
        return self.stop - self.start

    def shape(self, full_shape):
        """The shape of this part of an array of `full_shape`."""
        if len(full_shape) == 0:
            return ()
        return (self.row_stop - self.row_start,) + tuple(full_shape[1:])


def layout(key, shape, num_servers, bound, itemsize=4, partition_bytes=None):
    """The parts of a key with this shape over `num_servers` servers."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be at least 1, got {num_servers}")
    shape = tuple(shape)
    rows = shape[0] if shape else 1
    row_size = math.prod(shape[1:]) if shape else 1
    first = stable_hash(key) % num_servers
    size = rows * row_size
    if size < bound or num_servers == 1 or rows < 2:
        return (Part(0, first, 0, rows, row_size),)
    nparts = num_servers
    if partition_bytes:
        # whole rounds of the servers: a server with one part more would carry more traffic
        rounds = -(-size * itemsize // (partition_bytes * num_servers))
        nparts = num_servers * max(1, rounds)
    nparts = min(nparts, rows)
    cuts = [rows * p // nparts for p in range(nparts + 1)]
    return tuple(Part(p, (first + p) % num_servers, cuts[p], cuts[p + 1], row_size) for p in range(nparts))


def split_rows(parts, row_ids):
    """Route global row ids to parts: [(part, local_ids, positions)] for parts with any rows.

    `positions` index into `row_ids`; `local_ids` are relative to the part's first row.
    """
    row_ids = np.asarray(row_ids, dtype=np.int64)
    out = []
    for part in parts:
        mask = (row_ids >= part.row_start) & (row_ids < part.row_stop)
        positions = np.flatnonzero(mask)
        if positions.size:
            out.append((part, row_ids[positions] - part.row_start, positions))
    return out
