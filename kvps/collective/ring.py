"""Ring all-reduce among the workers (Horovod style): the algorithm and tensor fusion.

Each worker sends to its right neighbour and receives from its left one. A buffer is cut
into W segments; W-1 reduce-scatter steps leave each worker with one fully summed segment,
and W-1 all-gather steps hand every segment round. Segments travel in chunks of
KVPS_RING_CHUNK_BYTES and each chunk is forwarded as soon as it is reduced, so sending,
receiving and summing overlap along the ring. Sums run through kvps.kernels. Between neighbours
on one host a chunk of a buffer made by Ring.buffer() goes through shared memory instead: the
neighbour sums or copies it straight out of the sender's buffer (kvps/collective/shared.py).
Between neighbours that share no memory, chunks go on a TCP connection of their own from the second
collective on, and the receiver reads them straight into place (kvps/collective/link.py); the
first collective, and every one with KVPS_RING_LINK=0, goes through ZeroMQ.

Every worker must make the same collective calls in the same order (as with Horovod and
torch.distributed): collectives are numbered, and a worker waits for its neighbour's chunks
of collective N. Each wait is one wait, with the collective's deadline (KVPS_TIMEOUT), on a
condition that every event able to end it notifies: a chunk from the left neighbour, zmq
letting go of a chunk sent to the right one, the job breaking (the node's NodeFailure) and
the ring closing. The ring reaches other workers only through its Worker node
(kvps.wire.membership): send_to_peer, on_peer_message, add_failure_listener.
The kvstore built on it is kvps.kvstore.allreduce.
"""
import logging
import threading
import time

import numpy as np

from kvps import kernels
from kvps.collective import link
from kvps.collective.shared import Shared
from kvps.errors import KVPSError, KVTimeoutError, ProtocolError
from kvps.wire.protocol import Entry, Header, Op, as_array, dtype_code, numpy_dtype

log = logging.getLogger("kvps.ring")

OPS = ("sum", "average")
PHASES = {"rs": "reduce-scatter", "ag": "all-gather"}
MAX_INBOX = 1 << 16         # announced collectives kept (a left neighbour can run only so far ahead)


class _Sent:
    """A chunk on its way to the right neighbour; `done` once zmq no longer reads its memory."""
    __slots__ = ("phase", "step", "chunk", "done")

    def __init__(self, phase, step, chunk):
        self.phase, self.step, self.chunk, self.done = phase, step, chunk, False


class Ring:
    """The ring collectives of one worker node (a kvps.wire.membership.Worker)."""

    def __init__(self, node, cfg):
        self.node = node
        self.cfg = cfg
        self.rank = node.rank
        self.size = len(node.membership["workers"])
        self.right = f"W{(self.rank + 1) % self.size}"
        self.left = f"W{(self.rank - 1) % self.size}"
        self._inbox = {}                     # (seq, phase, step, chunk) -> (entry, frame, n, epoch, at)
        self._read = set()                   # collectives whose placed chunks the right neighbour has read
        self._cond = threading.Condition()   # notified by every event a wait can end on
        self._ended = None                   # what ends every wait: the job's NodeFailure, or close()
        self._next = 0                       # number of the next collective
        self.epoch = 0                       # joins this worker has completed (see serve)
        self.shared = Shared.of(node, cfg, self.rank, self.size)     # None: every chunk over TCP
        # TCP links to the neighbours where they share no memory (None: every chunk through ZeroMQ)
        self.links = link.Links.of(node, cfg, self.rank, self.size, self._link_broken, offer=self.shared is None)
        self._scratch = np.empty(0, np.uint8)   # a reduce-scatter chunk read from the link
        node.on_peer_message(self._on_message)
        node.add_failure_listener(self._end)

    # ---- events (I/O thread, zmq's threads, or a closing thread) ----
    def _on_message(self, header, payloads):
        meta = header.meta
        phase = meta.get("phase")
        if phase == "link":
            if self.links is None or not self.links.message(header.src, meta):
                log.warning("%s: unexpected ring link message from %s dropped", self.node.name, header.src)
            return
        if phase in ("attach", "attached"):
            if self.shared is None:     # KVPS_SHM=0 here, or a neighbour elsewhere: the sender stays on TCP
                log.info("%s: %s offers its ring buffer in shared memory; this worker does not share",
                         self.node.name, header.src)
            elif not self.shared.control(header.src, meta):
                log.warning("%s: unexpected ring message %r dropped", self.node.name, header)
            return
        try:
            if phase == "start":        # a collective whose chunks come on the link (see _run)
                with self._cond:
                    if int(meta["seq"]) >= self._next and len(self._inbox) < MAX_INBOX:
                        self._inbox[(meta["seq"], "start", 0, 0)] = (header.keys[0], None, int(meta["n"]),
                                                                    int(meta.get("epoch", 0)), None)
                        self._cond.notify_all()
                return
            if phase == "done":         # the right neighbour has read what we placed for collective seq
                seq = int(meta["seq"])
                with self._cond:
                    if len(self._read) < 1024:
                        self._read.add(seq)
                    self._cond.notify_all()
                return
            slot = (meta["seq"], meta["phase"], meta["step"], meta["chunk"])
            at = meta.get("at")
            value = (header.keys[0], payloads[0] if at is None else None, int(meta["n"]),
                     int(meta.get("epoch", 0)), at)
        except (KeyError, IndexError, TypeError, ValueError):
            log.warning("%s: malformed ring message %r dropped", self.node.name, header)
            return
        with self._cond:
            self._inbox[slot] = value
            self._cond.notify_all()

    def _sent(self, sent):
        with self._cond:
            sent.done = True
            self._cond.notify_all()

    def _end(self, exc):
        with self._cond:
            if self._ended is None:
                self._ended = exc
            self._cond.notify_all()
        if self.links is not None:      # a read blocked on the link returns, and finds _ended
            self.links.wake()

    def _link_broken(self, exc):
        """A link failed (on the sending thread, or the caller's read). A neighbour that died makes
        the job fail with its NodeFailure within the heartbeat timeout: wait that long for it, so
        the error names the dead node, then end the ring with `exc`."""
        with self._cond:
            self._cond.wait_for(lambda: self._ended is not None, self.cfg.heartbeat_timeout + 1)
        self._end(exc)

    def close(self):
        """End the waits of a running collective with KVPSError; later collectives fail at once."""
        self._end(KVPSError(f"{self.node.name}: the ring is closed (its kvstore was closed)"))
        if self.shared is not None:
            self.shared.close()
        if self.links is not None:
            self.links.close()

    def wake(self):
        """Have a waiting serve() look at its `done()` again (call once what it reads has changed)."""
        with self._cond:
            self._cond.notify_all()

    # ---- waits (the collective's thread) ----
    def _wait(self, ready, deadline, waiting_for):
        """With self._cond held, wait until ready(). Raises what ended the ring (NodeFailure, or
        KVPSError once closed), or at the deadline KVTimeoutError naming waiting_for()."""
        self._cond.wait_for(lambda: self._ended is not None or ready(), deadline - time.monotonic())
        if ready():
            return
        if self._ended is not None:
            raise self._ended
        raise KVTimeoutError(f"{waiting_for()} within {self.cfg.timeout:g} s (KVPS_TIMEOUT)")

    def _receive(self, seq, phase, step, chunk, what, deadline):
        slot = (seq, phase, step, chunk)
        with self._cond:
            self._wait(lambda: slot in self._inbox, deadline, lambda: self._no_data(seq, phase, step, chunk, what))
            entry, frame, _, _, at = self._inbox.pop(slot)
            return entry, frame, at

    def _no_data(self, seq, phase, step, chunk, what):
        return f"{what}: collective {seq}: no data from {self.left} for {PHASES[phase]} step {step} chunk {chunk}"

    def _settle(self, sent, seq, what, deadline):
        """Wait until zmq no longer reads a chunk sent earlier (before it changes, or the call ends)."""
        if sent.done:
            return
        with self._cond:
            self._wait(lambda: sent.done, deadline,
                       lambda: f"{what}: collective {seq}: {self.node.name} had not finished sending "
                               f"{PHASES[sent.phase]} step {sent.step} chunk {sent.chunk} to {self.right}")

    def _send(self, seq, n, phase, step, chunk, piece, at=None):
        """Send a chunk of the buffer without copying it; returns its _Sent, done once zmq has let go
        of the memory (the chunk must not change before that). `at`: its place in shared memory,
        which goes instead of the bytes (done at once: see kvps/collective/shared.py)."""
        meta = {"seq": seq, "n": n, "phase": phase, "step": step, "chunk": chunk, "epoch": self.epoch}
        sent = _Sent(phase, step, chunk)
        if at is not None:
            meta["at"] = at
            sent.done = True
            entry = Entry.bare(seq, chunk, dtype_code(piece.dtype), piece.shape)
            self.node.send_to_peer(self.right, Header(Op.RING, keys=[entry], meta=meta))
            return sent
        header = Header(Op.RING, keys=[Entry.of(seq, chunk, piece)], meta=meta)
        self.node.send_to_peer(self.right, header, [piece.view(np.uint8)] if piece.nbytes else [],
                               on_sent=lambda: self._sent(sent))
        return sent

    def _done(self, seq, what, deadline):
        """Wait for the right neighbour's word that it has read what we placed for collective seq."""
        with self._cond:
            self._wait(lambda: seq in self._read, deadline,
                       lambda: f"{what}: collective {seq}: {self.right} did not say it had read the "
                               f"chunks placed in shared memory")
            self._read.discard(seq)

    # ---- the TCP link (kvps/collective/link.py) ----
    def _raise_if_ended(self):
        """Raises what ended the ring, if it has ended (asked while a link is being accepted)."""
        if self._ended is not None:
            raise self._ended

    def _read_link(self, inn, seq, phase, step, c, code, into, what, deadline):
        """Read a chunk from the left's link into `into`; a broken link ends the ring (with the
        job's NodeFailure if one comes within the heartbeat timeout)."""
        try:
            inn.read(link.head(seq, phase, step, c, code, into.nbytes), into, deadline)
        except link.LinkBroken as exc:
            self._link_broken(exc)
            raise self._ended from None
        except KVTimeoutError:
            raise KVTimeoutError(f"{self._no_data(seq, phase, step, c, what)} within {self.cfg.timeout:g} s "
                                 f"(KVPS_TIMEOUT)") from None

    def _scratch_for(self, count, dtype):
        nbytes = count * dtype.itemsize
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch[:nbytes].view(dtype)

    def buffer(self, count, dtype):
        """A 1-D array for collectives that is kept from call to call: in shared memory when the ring
        can use it (its chunks then go by place), else private."""
        if self.shared is not None:
            return self.shared.buffer(count, dtype)
        return np.empty(count, dtype)

    # ---- collectives ----
    def allreduce(self, flat, what, average=False):
        """Sum (or average) a 1-D contiguous array over all workers, in place. Raises NodeFailure
        when the job breaks, KVTimeoutError past KVPS_TIMEOUT, KVPSError once the ring is closed."""
        size, rank = self.size, self.rank
        if average and flat.dtype.kind in "iu":
            raise ValueError(f"{what}: cannot average {flat.dtype} values; use op='sum'")
        if size > 1 and flat.size:       # an empty collective sends nothing, and is not numbered
            self._ring(flat, what, size, rank)
        if average and size > 1:
            kernels.scale(flat, 1.0 / size)

    def serve(self, done, what):
        """Take part, with zeros, in the next collective the other workers start; returns False
        (having served nothing) once `done()` is true. For a worker that has joined; whatever
        makes `done()` true must call wake() after.

        A collective started by a worker whose join has already ended (the last to join may be
        quicker to see the barrier end than we are) carries the next epoch: it is not ours to
        serve, so wait for the end of the join and leave it for the caller's next collective."""
        seq = self._next
        deadline = time.monotonic() + self.cfg.timeout

        def started():
            return next((v for k, v in self._inbox.items() if k[0] == seq and v[3] <= self.epoch), None)
        with self._cond:
            self._wait(lambda: started() is not None or done(), deadline,
                       lambda: f"{what}: neither collective {seq} from {self.left} nor the end of the join")
            found = started()
        if found is None:
            return False
        entry, _, n, _, _ = found
        self._ring(np.zeros(n, numpy_dtype(entry.dtype)), what, self.size, self.rank)
        return True

    def _ring(self, flat, what, size, rank):
        if self._ended is not None:
            raise self._ended
        seq = self._next
        self._next += 1
        try:
            self._run(flat, what, size, rank, seq)
        except (KVTimeoutError, ProtocolError) as exc:
            # This worker's collectives are now out of step with the others': fail later ones at
            # once with this error rather than have each wait out its deadline for nothing.
            self._end(exc)
            raise

    def _run(self, flat, what, size, rank, seq):
        n = flat.size
        bounds = [n * i // size for i in range(size + 1)]
        step_elems = max(1, self.cfg.ring_chunk_bytes // flat.itemsize)
        deadline = time.monotonic() + self.cfg.timeout
        code = dtype_code(flat.dtype)
        sending = {}                     # chunk start -> _Sent of the send that may still read it
        shared = self.shared
        if shared is not None:
            shared.map_waiting()
            placed, read = shared.placed, shared.read        # this collective's: what they grow by
        out, inn = self.links.start(seq, deadline, n, code, self.epoch, self._raise_if_ended) if self.links is not None \
            else (None, None)
        telemetry = self.node.telemetry         # None unless KVPS_METRICS_PORT or KVPS_TIMELINE is set

        def send(phase, step, c, a, b):
            piece = flat[a:b]
            if out is not None:
                sent = sending[a] = _Sent(phase, step, c)
                out.send(link.head(seq, phase, step, c, code, piece.nbytes), piece, lambda: self._sent(sent))
                if telemetry is not None:
                    telemetry.sent(self.right, Op.RING, [piece.view(np.uint8)])
                return
            at = shared.place(piece) if shared is not None else None
            sending[a] = self._send(seq, n, phase, step, c, piece, at)

        def settle(a):
            sent = sending.pop(a, None)
            if sent is not None:
                self._settle(sent, seq, what, deadline)

        def chunks(segment):
            lo, hi = bounds[segment], bounds[segment + 1]
            return [(c, a, min(a + step_elems, hi)) for c, a in enumerate(range(lo, hi, step_elems))]

        chunk_events = telemetry is not None and telemetry.timeline is not None

        def take(phase, step, c, a, b, into=None):
            """The chunk from the left: read into `into` (link only), or a view of where it is."""
            if chunk_events:
                started = time.time()
            if inn is not None:
                into = self._scratch_for(b - a, flat.dtype) if into is None else into
                self._read_link(inn, seq, phase, step, c, code, into, what, deadline)
                if chunk_events:
                    telemetry.ring_chunk(seq, phase, step, c, started, time.time())
                if telemetry is not None:
                    telemetry.received(("peer", self.left), Header(Op.RING), [into.view(np.uint8)])
                return into
            entry, frame, at = self._receive(seq, phase, step, c, what, deadline)
            if chunk_events:
                telemetry.ring_chunk(seq, phase, step, c, started, time.time())
            if entry.dtype != code or entry.shape != (b - a,):
                raise ProtocolError(f"{what}: {self.left} sent {entry.shape} of dtype {entry.dtype} for "
                                    f"{phase} step {step} chunk {c}; expected ({b - a},) of {flat.dtype} "
                                    f"(do all workers make the same calls in the same order?)")
            if at is not None:
                if shared is None:
                    raise ProtocolError(f"{what}: {self.left} placed a chunk in shared memory, which this "
                                        f"worker does not share")
                return shared.view(at, (b - a) * flat.itemsize).view(flat.dtype)
            return as_array(frame, entry)

        # Each chunk is written at most once in each phase and sent after it is written; a write
        # first waits until zmq has finished sending the chunk's earlier contents.
        if telemetry is not None:
            phase_start = time.time()
        for c, a, b in chunks(rank):                       # reduce-scatter, step 0: my own segment
            send("rs", 0, c, a, b)
        for step in range(size - 1):
            for c, a, b in chunks((rank - step - 1) % size):
                kernels.sum_into(flat[a:b], take("rs", step, c, a, b))
                # forward at once: the next step (or the all-gather) sends exactly this chunk
                send(*(("rs", step + 1) if step < size - 2 else ("ag", 0)), c, a, b)
        if telemetry is not None:
            gather_start = time.time()
            telemetry.ring_phase(seq, "reduce_scatter", phase_start, gather_start, flat.nbytes)
        for step in range(size - 1):                       # all-gather
            for c, a, b in chunks((rank - step) % size):
                if inn is not None:                        # read straight into place
                    settle(a)
                    take("ag", step, c, a, b, into=flat[a:b])
                else:
                    received = take("ag", step, c, a, b)
                    settle(a)
                    flat[a:b] = received
                if step < size - 2:
                    send("ag", step + 1, c, a, b)
        for a in list(sending):                            # the caller may change the buffer next
            settle(a)
        with self._cond:                # an announcement of this collective (see _link), if any
            self._inbox.pop((seq, "start", 0, 0), None)
        if shared is not None:
            if shared.read != read:     # the left neighbour may change its buffer once we say so
                self.node.send_to_peer(self.left, Header(Op.RING, meta={"phase": "done", "seq": seq}))
            if shared.placed != placed:
                self._done(seq, what, deadline)
        if telemetry is not None:
            telemetry.ring_phase(seq, "all_gather", gather_start, time.time(), flat.nbytes)


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


