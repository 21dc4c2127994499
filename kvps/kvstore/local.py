"""The single-process kvstore ('local'): the server's Store, called directly.

It has the same semantics as one worker of dist_sync: a push replaces the value
with the pushed sum, or applies the optimizer when one is set. MXNet's
`kv._set_updater(fn)` runs fn(key, pushed, stored) instead, changing `stored` in place.
"""
import numpy as np

from kvps.wire.requests import Handle
from kvps.errors import KVValueError
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
        items = self._per_out(self._outs(key, out, "row_sparse_pull"), row_ids)
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

    def _set_updater(self, updater):
        """MXNet's updater: every push runs updater(key, pushed, stored) (numpy arrays; `pushed` is
        the sum of the push's values) and `stored` is changed in place, as in MXNet's local kvstore."""
        if not callable(updater):
            raise TypeError(f"_set_updater needs a function updater(key, pushed, stored), got {updater!r}")
        self._store.set_rule(_Updater(updater))

    set_updater = _set_updater

    def barrier(self):
        pass


class _Updater:
    """A user's updater function in the place of a server optimizer rule (kvps/ps/rules.RuleState)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, slot_id, weight, grad):
        self.fn(slot_id[0], grad, weight)

    def update_rows(self, slot_id, weight, rows, grad):
        dense = np.zeros(weight.shape, grad.dtype)
        dense[rows] = grad
        self.fn(slot_id[0], dense, weight)

    def export(self, slot_id, copy=True):
        return None         # an updater's state, if any, lives in the user's function

    def restore_all(self, states, source):
        raise KVValueError(f"checkpoint {source[0]} holds optimizer state, which a kvstore with an "
                           f"updater function cannot take: set the optimizer that saved it instead")


def _raise(result):
    if isinstance(result, Exception):
        raise result


def _fill(outs, value):
    _raise(value)
    for o in outs:
        np.copyto(o.array, value)
        o.finish()
