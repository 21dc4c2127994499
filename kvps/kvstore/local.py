"""The single-process kvstore ('local'): the server's Store, called directly.

It has the same semantics as one worker of dist_sync: a push replaces the value
with the pushed sum, or applies the optimizer when one is set.
"""
import numpy as np

from kvps.wire.requests import Handle
from kvps.kvstore.base import KVStore
from kvps.ps.store import Store
from kvps.ps.rules import Registry


class LocalKVStore(KVStore):

    def __init__(self, name="local"):
        super().__init__(name)
        self._store = Store(num_workers=1, mode="sync")
        self._registry = Registry()

    rank = property(lambda self: 0)
    num_workers = property(lambda self: 1)

    def init(self, key, value):
        for info, array in self._inits(key, value):
            self._store.init(0, info.key, 0, info.dtype, info.shape, array, _raise)
            self._keys[info.key] = info

    def push(self, key, value, priority=0, async_op=False, row_ids=None):
        if row_ids is not None:
            sparse = self._sparse_values(key, value, row_ids, "push")
            self._straggle([(info, rows) for info, _, rows in sparse])
            for info, ids, rows in sparse:
                self._store.push(0, info.key, 0, rows, _raise, rows=ids)
            return Handle.completed("push")
        items = self._values(key, value, "push")
        self._straggle(items)
        for info, array in items:
            self._store.push(0, info.key, 0, array, _raise)
        return Handle.completed("push")

    def pull(self, key, out=None, priority=0, ignore_sparse=True, async_op=False):
        for info, outs in self._outs(key, out, "pull"):
            self._store.pull(0, info.key, 0, lambda v, outs=outs: _fill(outs, v))
        return Handle.completed("pull")

    def pushpull(self, key, value, out=None, priority=0, async_op=False):
        items = self._values(key, value, "pushpull")
        self._straggle(items)
        outs = self._outs(key, value if out is None else out, "pushpull")
        for info, array in items:
            self._store.push(0, info.key, 0, array, _raise)
        for info, targets in outs:
            self._store.pull(0, info.key, 0, lambda v, targets=targets: _fill(targets, v))
        return Handle.completed("pushpull")

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None, async_op=False):
        items = self._outs(key, out, "row_sparse_pull")
        for (info, outs), ids in zip(items, self._row_ids(items, row_ids, "row_sparse_pull")):
            def fill(rows, outs=outs, ids=ids):
                for o in outs:
                    o.array[...] = 0
                    o.array[ids] = rows
                    o.finish()
            self._store.pull(0, info.key, 0, fill, rows=ids)
        return Handle.completed("row_sparse_pull")

    def set_optimizer(self, optimizer):
        self._store.set_rule(self._registry.create(optimizer.spec()))

    def barrier(self):
        pass


def _raise(result):
    if isinstance(result, Exception):
        raise result


def _fill(outs, value):
    _raise(value)
    for o in outs:
        np.copyto(o.array, value)
        o.finish()
