"""The ring's chunks through shared memory between neighbours on one host (KVPS_SHM; kvps/wire/shm.py).

Several worker processes on one machine (one per GPU) is the common case. There the ring's TCP path
copies every chunk into the kernel, out of it into a ZeroMQ message, and then sums or copies that
message into place. Here a worker's fused buffers live in memfd segments that its right neighbour
maps. A chunk then travels as its place in the segment (a RING message without payload), and the
neighbour sums or copies it straight out of the sender's memory: received in place, with no pass
in between.

    shared = Shared.of(node, cfg, rank, size)   # None: one worker, KVPS_SHM=0, an elastic job, or
                                                # a neighbour on another host
    buf = shared.buffer(count, dtype)      # a fused buffer the right neighbour can read
    at = shared.place(chunk)               # [segment, byte offset] of a chunk once the right maps it
    chunk = shared.view(at, nbytes)        # a chunk the left neighbour placed (receiver side)
    shared.close()                         # the kvstore is closing

The handshake: the first collective on a new buffer goes over TCP, while a RING message of phase
"attach" (the segment's descriptor number and nonce) asks the right neighbour to map it. The right
neighbour maps it at the start of its next collective, with kvps.wire.shm.Mapped's checks (the
descriptor is a kvps memfd of the worker registered as its left neighbour, holding its nonce).
Its answer ("attached", or why not) comes back on a DEALER to the left neighbour, and the
buffer's later chunks go by place.

Why no chunk changes while the neighbour reads it. Within a collective, a chunk sent by place
changes again only in the all-gather, with data that went round the whole ring after the right
neighbour had read it: segment j is reduced along j, j+1, ..., j-1 and only then handed round.
Across collectives the caller refills the buffer, so a worker that sent any chunk by place waits at
the end of the collective for its right neighbour's "done", which that neighbour sends after its
last read.
"""
import logging

import numpy as np

from kvps.errors import ProtocolError
from kvps.wire.protocol import Header, Op
from kvps.wire.shm import Mapped, ShmRefused, Segment

log = logging.getLogger("kvps.ring")

MAX_SEGMENTS = 256          # fused buffers shared per worker; later ones go over TCP
MAX_WAITING = 64            # attach requests held for the next collective (a hostile left gets no more)


class Shared:
    """One ring member's shared buffers (read by its right neighbour) and its left neighbour's."""

    def __init__(self, node, rank, size):
        self.node = node
        self.right, self.left = (rank + 1) % size, (rank - 1) % size
        self._mine = {}             # segment id -> [Segment, data address, state]
        self._theirs = Mapped(node.membership["workers"][self.left][2])
        self._waiting = []          # the left's attach requests, mapped at the next collective
        self.placed = 0             # chunks sent by place, and read by place (for tests and stats)
        self.read = 0

    @classmethod
    def of(cls, node, cfg, rank, size):
        if size < 2 or not cfg.shm or cfg.elastic:
            return None
        workers = node.membership["workers"]
        host = workers[rank][0]
        left, right = workers[(rank - 1) % size], workers[(rank + 1) % size]
        if left[0] != host or right[0] != host or left[2] < 0 or right[2] < 0:
            return None
        if not node.connect_worker((rank - 1) % size):     # the left hears our answers and "done"
            return None
        return cls(node, rank, size)

    # ---- sender side: buffers the right neighbour reads ----
    def buffer(self, count, dtype):
        """An array of `count` items in a new segment, or a private one past MAX_SEGMENTS."""
        dtype = np.dtype(dtype)
        if len(self._mine) >= MAX_SEGMENTS or not count:
            return np.empty(count, dtype)
        try:
            segment = Segment(len(self._mine), 64 + count * dtype.itemsize)
        except OSError as exc:
            log.info("%s: ring buffer of %d bytes not shared: %s", self.node.name, count * dtype.itemsize, exc)
            return np.empty(count, dtype)
        array = np.frombuffer(segment.map, dtype, count, 64)
        self._mine[segment.id] = [segment, array.ctypes.data, None]
        return array

    def place(self, chunk):
        """[segment id, byte offset] of `chunk`, which the caller then sends by place, if it lies in a
        segment the right neighbour has mapped; else None (and the first time, ask it to map the
        segment)."""
        address = chunk.ctypes.data
        for sid, mine in self._mine.items():
            segment, base, state = mine
            if base <= address and address + chunk.nbytes <= base + segment.size - 64:
                if state is True:
                    self.placed += 1
                    return [sid, 64 + address - base]
                if state is None:
                    mine[2] = "asked"
                    meta = {"phase": "attach", "segment": sid, "fd": segment.fd, "nonce": segment.nonce}
                    self.node.send_to_peer(f"W{self.right}", Header(Op.RING, meta=meta))
                return None
        return None

    # ---- receiver side: the left neighbour's buffers ----
    def view(self, at, nbytes):
        """The `nbytes` the left neighbour placed at `at` ([segment, offset]), as np.uint8."""
        try:
            segment, offset = (int(v) for v in at)
            chunk = self._theirs.view(segment, offset, nbytes)
        except (TypeError, ValueError, ShmRefused) as exc:
            raise ProtocolError(f"W{self.left} placed a chunk at {at!r:.60}: {exc}") from None
        self.read += 1
        return chunk

    def map_waiting(self):
        """Map the segments the left neighbour asked us to (the collective's thread) and answer."""
        while self._waiting:
            meta = self._waiting.pop(0)
            answer = {"phase": "attached", "segment": meta["segment"]}
            try:
                self._theirs.attach(meta["fd"], meta["segment"], meta["nonce"])
            except ShmRefused as exc:
                answer["refused"] = str(exc)
                log.info("%s: W%d's ring buffer %s stays on TCP: %s", self.node.name, self.left, meta["segment"], exc)
            self.node.send_to_peer(f"W{self.left}", Header(Op.RING, meta=answer))

    def close(self):
        """Let go of the segments (the kvstore is closing; any thread): their descriptors now, their
        memory once nothing maps it (the right neighbour's mapping, arrays still in use)."""
        mine, self._mine = self._mine, {}            # rebound, not cleared: a collective may be iterating it
        self._theirs = Mapped(self._theirs.pid)
        for segment, _, _ in mine.values():
            segment.close()

    # ---- control messages (the I/O thread: short, never blocking) ----
    def control(self, src, meta):
        """An "attach" from the left neighbour or an "attached" from the right one; False if it is
        neither (the caller drops it)."""
        phase = meta.get("phase")
        if phase == "attach" and src == f"W{self.left}":
            if not (isinstance(meta.get("segment"), int) and isinstance(meta.get("fd"), int)
                    and isinstance(meta.get("nonce"), bytes)) or len(self._waiting) >= MAX_WAITING:
                return False
            self._waiting.append(meta)
            return True
        if phase == "attached" and src == f"W{self.right}":
            mine = self._mine.get(meta.get("segment")) if isinstance(meta.get("segment"), int) else None
            if mine is None or mine[2] != "asked":
                return False
            refused = meta.get("refused")
            mine[2] = True if refused is None else str(refused)[:200]
            if refused is not None:
                log.info("%s: W%d does not map ring buffer %d (%.200s): it stays on TCP", self.node.name,
                         self.right, meta["segment"], refused)
            return True
        return False
