"""The 'allreduce' kvstore: kvstore semantics on the ring all-reduce, with no servers, and kvps.allreduce().

    kv = kvps.create("allreduce")            # same interface as dist_sync: pushpull sums over workers
    kv.pushpull(names, grads)                 # fused into buffers of up to KVPS_FUSION_BYTES
    kvps.allreduce(tensor, op="average")      # one tensor, in place
"""
import numpy as np

from kvps.arrays import Out, as_numpy, copy_into
from kvps.collective.ring import OPS, Ring, fuse
from kvps.config import Config
from kvps.kvstore.base import KVStore
from kvps.kvstore.engine import Engine
from kvps.wire.membership import SCHEDULER, Worker
from kvps.wire.protocol import Header, Op
from kvps.wire.requests import remember


class RingKVStore(KVStore):
    """kvstore semantics without servers: push all-reduces the values over the workers and
    stores the sum (or applies the optimizer, on every worker alike); pull reads it back."""

    def __init__(self, name="allreduce", config=None):
        super().__init__(name)
        from kvps.ps.rules import Registry
        self.cfg = config or Config.from_env()
        self._claim_process()
        self._node = Worker(self.cfg, meta={"mode": "allreduce"})
        self._node.start()
        self._ring = Ring(self._node, self.cfg)
        self._engine = Engine(self._node.name, self.cfg.timeout)
        self._stored = {}                # key -> value (for a plain sum: a view of its fusion buffer)
        self._buffers = {}               # (keys, dtype) of a fused group -> its buffer, reused every call
        self._registry = Registry()
        self._updater = None
        engine, node, ring = self._engine, self._node, self._ring

        def leave(reason=None):
            ring.close()                 # a collective still waiting (the job is broken) ends now
            engine.stop()
            node.leave(reason)
        self._join_job(node, leave)
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
                    buf = self._buffers[name] = self._ring.buffer(total, dtype)     # shared memory if it can
            offset = 0
            for i in group:
                size = arrays[i].size
                copy_into(buf[offset:offset + size], arrays[i].reshape(-1))
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

    def push(self, key, value, priority=0, async_op=False, row_ids=None):
        if row_ids is None:
            items = self._values(key, value, "push")
        else:       # the ring moves whole arrays: a row-sparse push goes as its dense form
            items = [(info, self._dense(info, ids, rows))
                     for info, ids, rows in self._sparse_values(key, value, row_ids, "push")]
        self._straggle(items)
        return self._run("push", lambda: self._apply(items), async_op)

    def pull(self, key, out=None, priority=0, ignore_sparse=True, async_op=False):
        items = self._outs(key, out, "pull")
        return self._run("pull", lambda: self._fill(items), async_op)

    def pushpull(self, key, value, out=None, priority=0, async_op=False):
        values = self._values(key, value, "pushpull")
        self._straggle(values)
        outs = self._outs(key, value if out is None else out, "pushpull")

        def job():
            self._apply(values)
            self._fill(outs)
        return self._run("pushpull", job, async_op)

    def _fill(self, items):
        for info, outs in items:
            for o in outs:
                copy_into(o.array, self._stored[info.key])
                o.finish()

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None, async_op=False):
        items = self._per_out(self._outs(key, out, "row_sparse_pull"), row_ids)
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
            ended = []                   # set, then the ring woken, when the barrier's reply comes

            def on_reply(header, payloads):          # I/O thread, before the handle completes
                ended.append(True)
                self._ring.wake()
            barrier = self._node.request(SCHEDULER, Header(Op.BARRIER, meta={"group": "workers"}),
                                         what=f"W{self.rank} waiting at the join barrier", on_reply=on_reply)
            while self._ring.serve(lambda: bool(ended) or barrier.done(), f"W{self.rank} after join()"):
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

    def close(self):
        super().close()
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
