"""Ring all-reduce among the workers (Horovod style), and a kvstore built on it.

    kv = kvps.create("allreduce")            # same interface as dist_sync: pushpull sums over workers
    kv.pushpull(names, grads)                 # fused into buffers of up to KVPS_FUSION_BYTES
    kvps.allreduce(tensor, op="average")      # one tensor, in place

Each worker sends to its right neighbour and receives from its left one. A buffer is cut
into W segments; W-1 reduce-scatter steps leave each worker with one fully summed segment,
and W-1 all-gather steps hand every segment round. Segments travel in chunks of
KVPS_RING_CHUNK_BYTES and each chunk is forwarded as soon as it is reduced, so sending,
receiving and summing overlap along the ring. Sums run through kvps.kernels.

Every worker must make the same collective calls in the same order (as with Horovod and
torch.distributed): collectives are numbered, and a worker waits for its neighbour's chunks
of collective N, with a deadline (KVPS_TIMEOUT) and a NodeFailure when a peer dies.
"""
import collections
import itertools
import logging
import threading
import time

import numpy as np
import zmq

from . import kernels
from .arrays import Out, as_numpy
from .config import Config
from .errors import KVPSError, KVTimeoutError, ProtocolError
from .handle import Handle, remember
from .kvstore import KVStore
from .node import Worker
from .protocol import Entry, Header, Op, as_array, dtype_code, numpy_dtype

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


class Engine:
    """Runs a kvstore's collectives one after another on a thread of its own, so that
    asynchronous calls return at once and every worker runs them in call order."""

    def __init__(self, name, timeout):
        self._jobs = collections.deque()
        self._ready = threading.Condition()
        self._timeout = timeout
        self._ids = itertools.count(1)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"kvps-ring-{name}", daemon=True)
        self._thread.start()

    def submit(self, what, fn):
        handle = Handle(what, self._timeout)
        job_id = next(self._ids)
        handle._expect(job_id, "the ring")
        handle._arm()
        with self._ready:
            if self._stopped:
                raise KVPSError(f"{what}: this kvstore is closed")
            self._jobs.append((job_id, handle, fn))
            self._ready.notify()
        return handle

    def _run(self):
        while True:
            with self._ready:
                while not self._jobs and not self._stopped:
                    self._ready.wait()
                if not self._jobs:
                    return
                job_id, handle, fn = self._jobs.popleft()
            try:
                fn()
                handle._answered(job_id)
            except Exception as exc:     # the caller gets it from handle.wait()
                handle._answered(job_id, exc)

    def stop(self):
        with self._ready:
            self._stopped = True
            self._ready.notify()
        self._thread.join(5)


class RingKVStore(KVStore):
    """kvstore semantics without servers: push all-reduces the values over the workers and
    stores the sum (or applies the optimizer, on every worker alike); pull reads it back."""

    def __init__(self, name="allreduce", config=None):
        super().__init__(name)
        from .server.updaters import Registry
        self.cfg = config or Config.from_env()
        self._node = Worker(self.cfg, meta={"mode": "allreduce"})
        self._node.start()
        self._ring = Ring(self._node, self.cfg)
        self._engine = Engine(self._node.name, self.cfg.timeout)
        self._stored = {}                # key -> value (for a plain sum: a view of its fusion buffer)
        self._buffers = {}               # (keys, dtype) of a fused group -> its buffer, reused every call
        self._registry = Registry()
        self._updater = None
        self._close_at_exit()
        if _Default.kv is None:
            _Default.kv = self           # kvps.allreduce() uses the process's ring kvstore

    rank = property(lambda self: self._node.rank)
    num_workers = property(lambda self: self._ring.size)
    num_servers = property(lambda self: len(self._node.membership["servers"]))

    def _run(self, what, fn, async_op=False):
        handle = self._engine.submit(what, fn)
        if async_op:
            remember(self._pending, handle)
            return handle
        return handle.wait()

    def _allreduce_all(self, arrays, what, average=False, keys=None):
        """All-reduce private copies of `arrays`, fused; returns the results (views of the buffers).

        With `keys`, each fused group keeps its buffer for the next call with the same keys (fresh
        memory costs page faults on every call); results stay valid until then."""
        results = [None] * len(arrays)
        limit = max(self.cfg.fusion_bytes, 1)
        for group in fuse(arrays, limit):
            total = sum(arrays[i].size for i in group)
            dtype = arrays[group[0]].dtype
            if keys is None:
                buf = np.empty(total, dtype)
            else:
                name = (tuple(keys[i] for i in group), dtype.str)
                buf = self._buffers.get(name)
                if buf is None or buf.size != total:
                    buf = self._buffers[name] = np.empty(total, dtype)
            offset = 0
            for i in group:
                size = arrays[i].size
                buf[offset:offset + size] = arrays[i].reshape(-1)
                results[i] = buf[offset:offset + size].reshape(arrays[i].shape)
                offset += size
            self._ring.allreduce(buf, what, average)
        return results

    # ---- the kvstore API ----
    def init(self, key, value):
        items = self._inits(key, value)
        arrays = [a if self.rank == 0 else np.zeros_like(a) for _, a in items]

        def job():
            for (info, _), value in zip(items, self._allreduce_all(arrays, "init")):   # rank 0's values
                self._stored[info.key] = np.array(value)
                self._keys[info.key] = info
        self._run(f"init of {len(items)} keys", job)

    def _apply(self, items):
        keys = [info.key for info, _ in items]
        for (info, _), total in zip(items, self._allreduce_all([a for _, a in items], "push", keys=keys)):
            if self._updater is not None:
                self._updater((info.key, 0), self._stored[info.key], total)
            else:
                self._stored[info.key] = total      # the sum is the value: no copy (see _buffers)

    def push(self, key, value, priority=0, async_op=False):
        items = self._values(key, value, "push")
        return self._run("push", lambda: self._apply(items), async_op)

    def pull(self, key, out=None, priority=0, ignore_sparse=True, async_op=False):
        items = self._outs(key, out, "pull")
        return self._run("pull", lambda: self._fill(items), async_op)

    def pushpull(self, key, value, out=None, priority=0, async_op=False):
        values = self._values(key, value, "pushpull")
        outs = self._outs(key, value if out is None else out, "pushpull")

        def job():
            self._apply(values)
            self._fill(outs)
        return self._run("pushpull", job, async_op)

    def _fill(self, items):
        for info, outs in items:
            for o in outs:
                np.copyto(o.array, self._stored[info.key])
                o.finish()

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None, async_op=False):
        items = self._outs(key, out, "row_sparse_pull")
        ids = self._row_ids(items, row_ids, "row_sparse_pull")

        def job():
            for (info, outs), rows in zip(items, ids):
                for o in outs:
                    o.array[...] = 0
                    o.array[rows] = self._stored[info.key][rows]
                    o.finish()
        return self._run("row_sparse_pull", job, async_op)

    def allreduce(self, value, op="sum", async_op=False):
        """Sum or average `value` (numpy array or torch tensor) over all workers, in place."""
        if op not in OPS:
            raise ValueError(f"allreduce op {op!r} is not one of {', '.join(OPS)}")
        array = as_numpy(value, "allreduce value")
        target = Out(value, "allreduce value")

        def job():
            (result,) = self._allreduce_all([array], "allreduce", average=(op == "average"))
            np.copyto(target.array, result)
            target.finish()
        return self._run("allreduce", job, async_op)

    def join(self):
        """This worker has no more data: take part with zeros in every collective the others still
        run, until every worker has joined; returns the rank of the last worker to join."""
        def job():
            barrier = self._node.barrier_async("workers")
            while self._ring.serve(barrier.done, f"W{self.rank} after join()"):
                pass
            result["last"] = barrier.wait().meta.get("last")
            self._ring.epoch += 1
        result = {}
        self._run("join", job)
        return int(result["last"][1:])

    def set_gradient_compression(self, compression_params):
        raise ValueError("the ring all-reduce sends values as they are; gradient compression applies to "
                         "pushes to servers (dist_sync, dist_async)")

    def set_optimizer(self, optimizer):
        updater = self._registry.create(optimizer.spec())

        def job():
            # Values that are views of fusion buffers become private: the updater changes them in place.
            self._stored = {key: np.array(value) for key, value in self._stored.items()}
            self._updater = updater
        self._run("set_optimizer", job)

    def barrier(self):
        self.wait_all()
        self._node.barrier("workers")

    def _healthy(self):
        return self._node.failure is None

    def _leave(self):
        self._engine.stop()
        self._node.leave()
        if _Default.kv is self:
            _Default.kv = None


class _Default:
    """The process's ring kvstore for kvps.allreduce(): the first one created, or one made on first
    use (as Horovod's hvd.init()). A process is one worker of one job, so one ring serves it."""
    kv = None


def allreduce(value, op="sum"):
    """Sum or average a numpy array or torch tensor over all workers of the job, in place; returns it.

    Uses the process's 'allreduce' kvstore, created on first call (every worker must call)."""
    if _Default.kv is None:
        _Default.kv = RingKVStore()
    _Default.kv.allreduce(value, op)
    return value
