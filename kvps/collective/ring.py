"""Ring all-reduce among the workers (Horovod style): the algorithm and tensor fusion.

Each worker sends to its right neighbour and receives from its left one. A buffer is cut
into W segments; W-1 reduce-scatter steps leave each worker with one fully summed segment,
and W-1 all-gather steps hand every segment round. Segments travel in chunks of
KVPS_RING_CHUNK_BYTES and each chunk is forwarded as soon as it is reduced, so sending,
receiving and summing overlap along the ring. Sums run through kvps.kernels.

Every worker must make the same collective calls in the same order (as with Horovod and
torch.distributed): collectives are numbered, and a worker waits for its neighbour's chunks
of collective N, with a deadline (KVPS_TIMEOUT) and a NodeFailure when a peer dies.
The kvstore built on it is kvps.kvstore.allreduce.
"""
import logging
import threading
import time

import numpy as np
import zmq

from kvps import kernels
from kvps.config import Config
from kvps.errors import KVPSError, KVTimeoutError, ProtocolError
from kvps.wire.protocol import Entry, Header, Op, as_array, dtype_code, numpy_dtype

log = logging.getLogger("kvps.ring")

OPS = ("sum", "average")


class Ring:
    """The ring collectives of one worker node."""

    def __init__(self, node, cfg):
        self.node = node
        self.cfg = cfg
        self.rank = node.rank
        self.size = len(node.membership["workers"])
        self.right = f"W{(self.rank + 1) % self.size}"
        self.left = f"W{(self.rank - 1) % self.size}"
        self._inbox = {}                     # (seq, phase, step, chunk) -> (entry, frame, n)
        self._cond = threading.Condition()
        self._next = 0                       # number of the next collective
        self.epoch = 0                       # joins this worker has completed (see serve)
        node.peer_handler = self._on_message

    def _on_message(self, header, payloads):          # I/O thread
        meta = header.meta
        try:
            slot = (meta["seq"], meta["phase"], meta["step"], meta["chunk"])
            entry, frame, n, epoch = header.keys[0], payloads[0], int(meta["n"]), int(meta.get("epoch", 0))
        except (KeyError, IndexError, TypeError, ValueError):
            log.warning("%s: malformed ring message %r dropped", self.node.name, header)
            return
        with self._cond:
            self._inbox[slot] = (entry, frame, n, epoch)
            self._cond.notify_all()

    def _send(self, seq, n, phase, step, chunk, piece):
        """Send a chunk of the buffer without copying it; returns a tracker that is done once zmq has
        let go of the memory (the chunk must not change before that), or None for an empty chunk."""
        header = Header(Op.RING, keys=[Entry.of(seq, chunk, piece)],
                        meta={"seq": seq, "n": n, "phase": phase, "step": step, "chunk": chunk,
                              "epoch": self.epoch})
        header.src = self.node.name
        if not piece.nbytes:
            self.node.van.send(self.right, header, [])
            return None
        frame = zmq.Frame(memoryview(piece.view(np.uint8)), copy=False, track=True)
        self.node.van.send(self.right, header, [frame])
        return frame.tracker

    def _receive(self, slot, what, deadline):
        with self._cond:
            while slot not in self._inbox:
                if self.node.failure is not None:
                    raise self.node.failure
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KVTimeoutError(f"{what}: no data from {self.left} ({slot[1]} step {slot[2]}, chunk "
                                         f"{slot[3]}) within {self.cfg.timeout:g} s (KVPS_TIMEOUT)")
                self._cond.wait(min(left, 0.25))
            entry, frame, _, _ = self._inbox.pop(slot)
            return entry, frame

    def allreduce(self, flat, what, average=False):
        """Sum (or average) a 1-D contiguous array over all workers, in place."""
        size, rank = self.size, self.rank
        if average and flat.dtype.kind in "iu":
            raise ValueError(f"{what}: cannot average {flat.dtype} values; use op='sum'")
        if size > 1 and flat.size:       # an empty collective sends nothing, and is not numbered
            self._ring(flat, what, size, rank)
        if average and size > 1:
            kernels.scale(flat, 1.0 / size)

    def serve(self, done, what):
        """Take part, with zeros, in the next collective the other workers start; returns False
        (having served nothing) once `done()` is true. For a worker that has joined.

        A collective started by a worker whose join has already ended (the last to join may be
        quicker to see the barrier end than we are) carries the next epoch: it is not ours to
        serve, so wait for the end of the join and leave it for the caller's next collective."""
        seq = self._next
        deadline = time.monotonic() + self.cfg.timeout
        with self._cond:
            while True:
                found = next((v for k, v in self._inbox.items() if k[0] == seq), None)
                if found is not None and found[3] <= self.epoch:
                    break
                if done():
                    return False
                if self.node.failure is not None:
                    raise self.node.failure
                if time.monotonic() > deadline:
                    raise KVTimeoutError(f"{what}: neither a collective nor the end of the join "
                                         f"within {self.cfg.timeout:g} s (KVPS_TIMEOUT)")
                self._cond.wait(0.05)
        entry, _, n, _ = found
        self._ring(np.zeros(n, numpy_dtype(entry.dtype)), what, self.size, self.rank)
        return True

    def _ring(self, flat, what, size, rank):
        seq = self._next
        self._next += 1
        n = flat.size
        bounds = [n * i // size for i in range(size + 1)]
        step_elems = max(1, self.cfg.ring_chunk_bytes // flat.itemsize)
        deadline = time.monotonic() + self.cfg.timeout
        code = dtype_code(flat.dtype)
        sending = {}                     # chunk start -> tracker of the send still reading it

        def send(phase, step, c, a, b):
            sending[a] = self._send(seq, n, phase, step, c, flat[a:b])

        def settle(a):
            tracker = sending.pop(a, None)
            while tracker is not None and not tracker.done:
                # a send to a dead neighbour never completes: watch for the failure meanwhile
                if self.node.failure is not None:
                    raise self.node.failure
                if time.monotonic() > deadline:
                    raise KVTimeoutError(f"{what}: a chunk sent to {self.right} was still unsent after "
                                         f"{self.cfg.timeout:g} s (KVPS_TIMEOUT)")
                try:
                    tracker.wait(0.1)
                except zmq.NotDone:
                    pass

        def chunks(segment):
            lo, hi = bounds[segment], bounds[segment + 1]
            return [(c, a, min(a + step_elems, hi)) for c, a in enumerate(range(lo, hi, step_elems))]

        def take(phase, step, c, a, b):
            entry, frame = self._receive((seq, phase, step, c), what, deadline)
            if entry.dtype != code or entry.shape != (b - a,):
                raise ProtocolError(f"{what}: {self.left} sent {entry.shape} of dtype {entry.dtype} for "
                                    f"{phase} step {step} chunk {c}; expected ({b - a},) of {flat.dtype} "
                                    f"(do all workers make the same calls in the same order?)")
            return as_array(frame, entry)

        # Each chunk is written at most once in each phase and sent after it is written; a write
        # first waits until zmq has finished sending the chunk's earlier contents.
        for c, a, b in chunks(rank):                       # reduce-scatter, step 0: my own segment
            send("rs", 0, c, a, b)
        for step in range(size - 1):
            for c, a, b in chunks((rank - step - 1) % size):
                kernels.sum_into(flat[a:b], take("rs", step, c, a, b))
                # forward at once: the next step (or the all-gather) sends exactly this chunk
                send(*(("rs", step + 1) if step < size - 2 else ("ag", 0)), c, a, b)
        for step in range(size - 1):                       # all-gather
            for c, a, b in chunks((rank - step) % size):
                received = take("ag", step, c, a, b)
                settle(a)
                flat[a:b] = received
                if step < size - 2:
                    send("ag", step + 1, c, a, b)
        for a in list(sending):                            # the caller may change the buffer next
            settle(a)


def fuse(arrays, limit):
    """Group arrays (same dtype, in order) into buffers of at most `limit` bytes: [[indices]]."""
    groups, current, current_bytes, dtype = [], [], 0, None
    for i, a in enumerate(arrays):
        if current and (a.dtype != dtype or current_bytes + a.nbytes > limit):
            groups.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += a.nbytes
        dtype = a.dtype
    if current:
        groups.append(current)
    return groups


