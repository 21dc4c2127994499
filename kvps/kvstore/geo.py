"""GEO-SGD (Paddle's geo mode): every worker trains its own copy; every K steps of a key it sends
the change of its weights and takes back the merged weights.

    kv = kvps.create("dist_geo:4")               # or kvps.create("dist_geo", k_steps=4)
    kv.init("w", w)                              # rank 0's value is stored ...
    kv.pull("w", out=w)                          # ... and every worker starts from it,
    kv.barrier()                                 # before anyone's first sync changes it
    for batch in shard:
        w -= lr * grad(w, batch)                 # a local step, the worker's own optimizer
        kv.pushpull("w", w, out=w)               # the GEO step: a sync on every K-th call of the key
    kv.sync(); kv.pull("w", out=w)               # at the end: every worker holds the merged weights

Per key this worker keeps `base`, the servers' value as of its last sync. On the K-th GEO step
of a key it pushes (w - base) / W, the servers add it on arrival (a `geo:K` store is async
without an optimizer: kvps/ps/store.py), and the pull in the same round trip brings back the
value with every delta that has arrived so far; that becomes both `base` and the worker's
weights. Dividing by W is Paddle's choice: W workers that each moved their copy by d from the
same point move the shared weights by the mean of their d, which is model averaging (local SGD)
and keeps the step size of one worker, where summing would multiply it by W.

Between syncs nothing travels: a step only copies the weights into `latest`, which `pull` reads
(no round trip: in GEO the worker's weights are its own until the next sync). Communication per
step falls by K. Only float keys take GEO steps; other keys (a broadcast's int32 words) can be
initialised and pulled.

It is a wrapper around the parameter-server client (kvps.kvstore.ps.DistKVStore), which does all
the sending; this module only decides when, and what.
"""
import numpy as np

from kvps.kvstore.base import KVStore
from kvps.kvstore.ps import DistKVStore
from kvps.wire.requests import Handle


class _Key:
    """One key's GEO state: the servers' value at the last sync, the worker's latest weights, and
    the GEO steps taken since that sync."""
    __slots__ = ("base", "latest", "steps")

    def __init__(self, base):
        self.base = base
        self.latest = base.copy()
        self.steps = 0


class GeoKVStore(KVStore):
    """`consistency`: a Consistency in mode "geo" (kvps.create builds it from "dist_geo:K")."""

    def __init__(self, name, consistency, config=None):
        super().__init__(name)
        if consistency.mode != "geo":
            raise ValueError(f"GeoKVStore runs consistency mode geo, not {consistency.wire()}")
        self._dist = DistKVStore(name, consistency, config)
        # A launcher-made straggler sleeps once per step: here, at every GEO step, not in the
        # client's pushes, which happen once every K steps.
        self._dist._straggler = None
        self.cfg = self._dist.cfg
        self.consistency = consistency
        self.mode = "geo"
        self.k_steps = consistency.k_steps
        self._state = {}                  # key -> _Key

    rank = property(lambda self: self._dist.rank)
    num_workers = property(lambda self: self._dist.num_workers)
    num_servers = property(lambda self: self._dist.num_servers)

    def init(self, key, value):
        """Store rank 0's values, and keep them as every worker's base (pull gives them back)."""
        items = self._inits(key, value)
        self._dist.init(key, value)
        bases = [np.empty(info.shape, info.dtype) for info, _ in items]
        for info, _ in items:
            self._keys[info.key] = info
        self._dist.pull([info.key for info, _ in items], out=bases)
        for (info, _), base in zip(items, bases):
            self._state[info.key] = _Key(base)

    def pushpull(self, key, value, out=None, priority=0, async_op=False):
        """The GEO step: `value` holds this worker's weights after its local step. On every K-th
        call of a key its change since the last sync (over W) goes to the servers and `out` gets
        the merged weights; on the other calls `out` gets `value` back and nothing is sent."""
        values = self._geo_values(key, value, "pushpull")
        outs = self._outs(key, value if out is None else out, "pushpull")
        synced = self._step(values, priority)
        for (info, array), (_, targets) in zip(values, outs):
            latest = self._state[info.key].latest
            for o in targets:
                # a local step into its own weights (out=value) has nothing to copy
                if info.key in synced or not _same_memory(o.array, array):
                    np.copyto(o.array, latest)
                o.finish()
        return self._done("pushpull", values, async_op)

    def push(self, key, value, priority=0, async_op=False, row_ids=None):
        """The GEO step without taking the weights back: pull() reads them (see pushpull)."""
        if row_ids is not None:
            raise ValueError("dist_geo pushes whole weights (their changes travel every K steps); "
                             "a row-sparse push has no meaning here")
        values = self._geo_values(key, value, "push")
        self._step(values, priority)
        return self._done("push", values, async_op)

    def pull(self, key, out=None, priority=0, ignore_sparse=True, async_op=False):
        """This worker's weights: the merged ones after a sync (or init), its own after a local step.
        Nothing travels (call sync() for the servers' value)."""
        items = self._outs(key, out, "pull")
        for info, targets in items:
            for o in targets:
                np.copyto(o.array, self._state[info.key].latest)
                o.finish()
        return self._done("pull", items, async_op)

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None, async_op=False):
        items = self._per_out(self._outs(key, out, "row_sparse_pull"), row_ids)
        for (info, targets), ids in zip(items, self._row_ids(items, row_ids, "row_sparse_pull")):
            latest = self._state[info.key].latest
            for o in targets:
                o.array[...] = 0
                o.array[ids] = latest[ids]
                o.finish()
        return self._done("row_sparse_pull", items, async_op)

    def sync(self, keys=None):
        """Collective, for the end of training (or before an evaluation every worker agrees on):
        send every key's change since its last sync, wait for every worker's, and take the merged
        weights, so every worker ends with the same weights (pull() gives them). `keys`: a key or a
        list (default: all)."""
        keys = list(self._state) if keys is None else keys if isinstance(keys, (list, tuple)) else [keys]
        for k in keys:
            self._info(k, "sync")
        due = [k for k in keys if self._state[k].steps and _geo_dtype(self._keys[k].dtype)]
        if due:
            self._send_deltas(due, 0)
        self._dist.barrier()                       # every worker's deltas are in (async barrier waits for them)
        if keys:
            bases = [self._state[k].base for k in keys]
            self._dist.pull(keys, out=bases)
            for k in keys:
                st = self._state[k]
                np.copyto(st.latest, st.base)
                st.steps = 0
        self._dist.barrier()                       # nobody's next sync reaches another's pull above

    # ---- the GEO step ----
    def _geo_values(self, key, value, op):
        items = self._values(key, value, op)
        for info, _ in items:
            if not _geo_dtype(info.dtype):
                raise ValueError(f"dist_geo {op} of key {info.key!r} ({info.dtype}): GEO steps move float "
                                 f"weights; init and pull other keys, but do not push them")
        return items

    def _step(self, values, priority):
        """Count a GEO step of each key; returns the keys that synced."""
        self._check_returned()
        self._straggle(values)
        due = []
        for info, array in values:
            st = self._state[info.key]
            np.copyto(st.latest, array)
            st.steps += 1
            if st.steps >= self.k_steps:
                due.append(info.key)
        if due:
            self._send_deltas(due, priority)
        return set(due)

    def _send_deltas(self, keys, priority):
        """Push (latest - base) / W of each key and take the merged value as base and latest."""
        w = self.num_workers
        deltas = []
        for k in keys:
            st = self._state[k]
            delta = np.subtract(st.latest, st.base)
            if w > 1:
                np.divide(delta, w, out=delta)
            deltas.append(delta)
        self._dist.pushpull(keys, deltas, out=[self._state[k].base for k in keys], priority=priority)
        for k in keys:
            st = self._state[k]
            np.copyto(st.latest, st.base)
            st.steps = 0

    @staticmethod
    def _done(op, items, async_op):
        if async_op:
            keys = [repr(info.key) for info, _ in items[:4]]
            return Handle.completed(f"{op} of {', '.join(keys)}")
        return None

    # ---- passed through ----
    def set_optimizer(self, optimizer):
        raise ValueError("dist_geo runs no server optimizer: each worker steps its own optimizer and the "
                         "servers add the weight changes (use dist_async or dist_sync for a server optimizer)")

    def is_capable(self, capability):
        """No server optimizer here (see set_optimizer)."""
        return False if str(capability).lower() == "optimizer" else super().is_capable(capability)

    def set_gradient_compression(self, compression_params):
        """Compress the deltas pushed (and, with "pull": True, the merged weights pulled)."""
        self._dist.set_gradient_compression(compression_params)

    def barrier(self):
        self._dist.barrier()

    def join(self):
        return self._dist.join()

    def wait_all(self, timeout=None):
        super().wait_all(timeout)
        self._dist.wait_all(timeout)

    def server_stats(self):
        return self._dist.server_stats()

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._dist.close()

    def _healthy(self):
        return self._dist._healthy()


def _geo_dtype(dtype):
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"


def _same_memory(a, b):
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape


__all__ = ["GeoKVStore"]
