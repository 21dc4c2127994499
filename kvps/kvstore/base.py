"""The kvstore API (MXNet's names and semantics), shared by every kvstore.

    kv.init(3, np.zeros(10, np.float32))
    kv.push(3, grad); kv.pull(3, out=weight)
    kv.pushpull(3, grad)                  # out=None: the result goes into grad

Calls follow MXNet's engine contract. A push returns as soon as the caller may reuse the pushed
array (a dist kvstore copies it and sends in the background); a pull returns with `out` complete,
and sees every earlier push of this worker. With async_op=True a call returns a Handle at once; the
caller must not change a pushed value or read an `out` until handle.wait() (or kv.wait_all())
returns. Calls on the same key keep their order. An error of a call that already returned is
raised by the next call, by wait_all() and by close(), naming the call.

A kvstore leaves its job however the process ends: close(), the kvstore going out of scope,
interpreter exit, sys.exit or an uncaught exception (kvps/kvstore/process.py).

This module holds what every kvstore shares: argument normalisation and the
checks of keys, shapes and dtypes against what init declared, so every kvstore
reports bad input the same way before anything is sent.
"""
import abc
import collections
import dataclasses
import logging
import os

import numpy as np

from kvps import kernels
from kvps.arrays import Out, as_numpy, describe
from kvps.errors import KVKeyError, KVPSError
from kvps.kvstore import process
from kvps.wire.requests import take_front

log = logging.getLogger("kvps")

_UNSET = object()


def _check_key(key):
    """The key as kvps keeps it: an int or a str (a numpy integer, as a loop over np.arange gives
    keys, becomes its int)."""
    if isinstance(key, np.integer):
        return int(key)
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(f"key {key!r} is a {type(key).__name__}; keys are int or str")
    return key


@dataclasses.dataclass(frozen=True)
class KeyInfo:
    key: object
    dtype: np.dtype
    shape: tuple
    parts: tuple = ()          # sharding.Part, for dist kvstores

    @property
    def size(self):
        return int(np.prod(self.shape)) if self.shape else 1


def pairs(keys, values, op, what="value"):
    """[(key, [values])] from MXNet's call forms: one key with one value or a list of
    values, or a list of keys with a list of values (each one value or a list)."""
    if isinstance(keys, (list, tuple)):
        if not isinstance(values, (list, tuple)) or len(keys) != len(values):
            n = len(values) if isinstance(values, (list, tuple)) else 1
            raise ValueError(f"{op} got {len(keys)} keys and {n} {what}s; give one {what} (or list) per key")
        return [(_check_key(k), list(v) if isinstance(v, (list, tuple)) else [v]) for k, v in zip(keys, values)]
    return [(_check_key(keys), list(values) if isinstance(values, (list, tuple)) else [values])]


class KVStore(abc.ABC):
    """The interface every kvstore implements (parameter server now, ring all-reduce later)."""

    def __init__(self, name):
        self.type = name
        self._keys = {}            # key -> KeyInfo
        self._pending = collections.deque()   # handles of asynchronous calls (handle.remember)
        self._returned = collections.deque()  # handles of calls that returned before completing
        self._closed = False
        self._owner = os.getpid()        # the process that made it (a child it forks cannot use it)
        self._finalizer = None
        self._straggler = _UNSET   # built from the config on the first push

    # ---- identity ----
    @property
    @abc.abstractmethod
    def rank(self): ...

    @property
    @abc.abstractmethod
    def num_workers(self): ...

    @property
    def num_servers(self):
        return 0

    # ---- collective and data calls ----
    @abc.abstractmethod
    def init(self, key, value):
        """Declare keys and store rank 0's values; every worker waits until they are stored."""

    @abc.abstractmethod
    def push(self, key, value, priority=0, async_op=False, row_ids=None):
        """Push values (a list of values for one key is summed first). With row_ids, `value` holds
        just those rows of the key (MXNet's row_sparse gradient): only they are sent, a sync round
        sums each row over the workers that pushed it (zeros where none did), and a server
        optimizer updates only the touched rows (MXNet's lazy update)."""

    @abc.abstractmethod
    def pull(self, key, out=None, priority=0, ignore_sparse=True, async_op=False):
        """Pull the stored values into `out` (a list of outs for one key all get the value)."""

    @abc.abstractmethod
    def pushpull(self, key, value, out=None, priority=0, async_op=False):
        """push then pull in one round trip; out=None writes the result into `value`."""

    @abc.abstractmethod
    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None, async_op=False):
        """Pull only rows `row_ids` (any order, repeats allowed) of each key into `out`, which has
        the key's full shape: the requested rows are filled, all others set to zero."""

    @abc.abstractmethod
    def set_optimizer(self, optimizer):
        """Run `optimizer` (a kvps.optimizer.Optimizer) on the stored values at every push."""

    def _set_updater(self, updater):
        """MXNet's updater function runs only in a 'local' kvstore (kvps/kvstore/local.py). A dist
        kvstore's servers run no code sent to them, only the optimizers their operator installed."""
        name = getattr(updater, "__name__", updater)
        raise KVPSError(f"a {self.type} kvstore cannot run the updater function {name!r}: "
                        f"its servers run only installed optimizers (use kv.set_optimizer(kvps.optimizer."
                        f"create('sgd', ...)), or install a rule plugin: docs/optimizers.md); an updater runs "
                        f"in kvps.create('local')")

    set_updater = _set_updater

    @abc.abstractmethod
    def barrier(self):
        """Wait until every worker reaches the barrier."""

    def wait_all(self, timeout=None):
        """Wait for every asynchronous call of this kvstore, and every push that returned early;
        raises the first one's error."""
        for queue in (self._returned, self._pending):
            _wait_front(queue, timeout)

    def _wait_returned(self):
        """Wait for every push that returned early; raises the first one's error."""
        _wait_front(self._returned)

    def _check_returned(self):
        """Raise the error of a call that already returned (the first one seen), and forget the
        ones that succeeded. Every call starts here, so no error is lost."""
        while (handle := take_front(self._returned, _done)) is not None:
            if not handle.succeeded():
                try:
                    handle.wait(0)
                except Exception as exc:
                    raise KVPSError(f"an earlier {handle.what} failed: {exc}") from exc

    def _returned_early(self, handle):
        """Keep the handle of a call that returns before it completes (see _check_returned)."""
        self._returned.append(handle)

    def join(self):
        """This worker has run out of data: let the others finish their rounds, wait until every
        worker has joined, and return the rank of the last one to join."""
        if self.num_workers > 1:
            raise NotImplementedError(f"a {self.type} kvstore cannot join()")
        return self.rank

    def set_gradient_compression(self, compression_params):
        """Compress pushes on the wire (dist kvstores only; see kvps.ps.compression)."""
        raise ValueError(f"gradient compression needs a dist kvstore; a {self.type!r} kvstore sends nothing")

    def close(self):
        """Finish: wait for pending calls (unless the job is broken) and leave the job."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._healthy():
                self.wait_all()
        finally:
            if self._finalizer is not None:
                self._finalizer()        # leaves once, now
            process.LIVE.discard(self)

    def _healthy(self):
        return True

    def _why_closed(self):
        if os.getpid() != self._owner:
            return (f"this kvstore belongs to process {self._owner}, which forked this one: a forked child "
                    f"cannot use it (its connections and threads are the parent's); make kvstore calls in "
                    f"the parent only")
        return "this kvstore is closed"

    def _claim_process(self):
        """Refuse a second member of a job in one process, and a return to a job this process has
        left (call before starting a node, with self.cfg set): kvps/kvstore/process.py."""
        process.claim(self)

    def _join_job(self, node, leave, send=None):
        """Register this kvstore as the process's member of the job (its node has started).
        `leave()` runs once: on close(), when the kvstore is collected, or at interpreter exit
        (after `send()`, which sends what waits to be sent, and after the pending calls finish).
        Neither `node` nor `leave` may refer to the kvstore, or it could never be collected."""
        self._finalizer = process.join(self, node, leave, send)

    # ---- checkpoints (docs/checkpoint.md): the parameter-server kvstores hold state to save ----
    def save(self, path, dump_optimizer=False):
        """Collective: checkpoint the servers' state to the directory `path` (dist kvstores)."""
        raise NotImplementedError(self._no_checkpoints("save"))

    def load(self, path, optimizer_states=True):
        """Collective: restore the state saved in `path` (dist kvstores)."""
        raise NotImplementedError(self._no_checkpoints("load"))

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """MXNet's call: save the servers' optimizer state (dist kvstores)."""
        raise NotImplementedError(self._no_checkpoints("save_optimizer_states"))

    def load_optimizer_states(self, fname):
        """MXNet's call: restore the servers' optimizer state (dist kvstores)."""
        raise NotImplementedError(self._no_checkpoints("load_optimizer_states"))

    def _no_checkpoints(self, call):
        return (f"kv.{call}: a {self.type!r} kvstore keeps no server state; checkpoints are for the "
                f"parameter-server kvstores (dist_sync, dist_async, dist_ssp); save your own arrays here")

    def _barrier(self):
        """MXNet's private name for barrier()."""
        return self.barrier()

    def is_capable(self, capability):
        """MXNet's capability query: "optimizer" (a server-side optimizer can be set)."""
        capability = str(capability).lower()
        if capability == "optimizer":
            return True
        raise ValueError(f"unknown capability {capability!r} (MXNet's capabilities: 'optimizer')")

    def broadcast(self, key, value, out, priority=0):
        """init(key, value) then pull(key, out): every worker ends with rank 0's value."""
        self.init(key, value)
        return self.pull(key, out=out, priority=priority)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<{type(self).__name__} type={self.type} rank={self.rank}/{self.num_workers}>"

    # ---- shared checks ----
    def _declare(self, key, array):
        info = self._keys.get(key)
        if info is not None:
            raise KVKeyError(f"key {key!r} is already initialised (as {describe(info.dtype, info.shape)}); "
                             f"init a key once")
        return KeyInfo(key, array.dtype, array.shape)

    def _inits(self, keys, values):
        """[(KeyInfo, array)] for an init call, all checked before anything is stored."""
        items, seen = [], set()
        for key, vals in pairs(keys, values, "init"):
            if len(vals) != 1:
                raise ValueError(f"init of key {key!r} got {len(vals)} values; give one")
            if key in seen:
                raise ValueError(f"init got key {key!r} twice")
            seen.add(key)
            array = as_numpy(vals[0], f"init value for key {key!r}")
            items.append((self._declare(key, array), array))
        return items

    def _info(self, key, op):
        info = self._keys.get(key)
        if info is None:
            raise KVKeyError(f"{op} of key {key!r}, which was never initialised (call kv.init first)")
        return info

    def _check(self, info, array, op, what):
        if array.dtype != info.dtype or array.shape != info.shape:
            raise ValueError(f"key {info.key!r} was initialised as {describe(info.dtype, info.shape)}; "
                             f"{op} got {what} {describe(array.dtype, array.shape)}")

    def _values(self, keys, values, op):
        """[(KeyInfo, array)], one merged array per key, every one checked before any is sent."""
        if self._closed:        # (here too: a push that would wait in a batch sends nothing yet)
            raise KVPSError(f"{op} of {keys!r}: {self._why_closed()}")
        items = []
        for key, vals in pairs(keys, values, op):
            info = self._info(key, op)
            arrays = [as_numpy(v, f"{op} value for key {key!r}") for v in vals]
            for a in arrays:
                self._check(info, a, op, "a value of")
            if len(arrays) == 1:
                merged = arrays[0]
            else:
                merged = np.empty(info.shape, info.dtype)
                kernels.sum_sources(merged.reshape(-1), [a.reshape(-1) for a in arrays])
            items.append((info, merged))
        return items

    def _straggle(self, items):
        """Every kvstore's push and pushpull call this with their checked values, before sending: a
        worker that the launcher made a straggler sleeps here, once per step (kvps/straggler.py)."""
        keys = [info.key for info, _ in items]
        if self._straggler is _UNSET:
            from kvps.config import Config
            from kvps.straggler import Straggler
            cfg = getattr(self, "cfg", None) or Config.from_env()
            self._straggler = Straggler.from_config(cfg, self.rank)
        if self._straggler is not None:
            self._straggler.before_push(keys)

    @property
    def straggled(self):
        """Seconds this worker has slept as a launcher-made straggler (0.0 when it is none)."""
        return 0.0 if self._straggler in (None, _UNSET) else self._straggler.total

    def _outs(self, keys, outs, op):
        """[(KeyInfo, [Out])], every out checked before anything is sent."""
        if outs is None:
            raise ValueError(f"{op} needs out= (the arrays to write the values into)")
        items = []
        for key, targets in pairs(keys, outs, op, what="out"):
            info = self._info(key, op)
            wrapped = [Out(t, f"{op} out for key {key!r}", dtype=info.dtype) for t in targets]
            for o in wrapped:
                self._check(info, o.array, op, "out")
            items.append((info, wrapped))
        return items

    @staticmethod
    def _per_out(items, row_ids):
        """MXNet's form with one row-id array per out (row_sparse_pull(k, out=[a, b], row_ids=[ia, ib])):
        `items` with one (KeyInfo, [out]) per out, so each gets its own rows; `items` otherwise."""
        outs = [(info, [o]) for info, targets in items for o in targets]
        if isinstance(row_ids, (list, tuple)) and len(row_ids) == len(outs) != len(items) and \
                all(hasattr(ids, "__len__") for ids in row_ids):
            return outs
        return items

    def _row_ids(self, items, row_ids, op, unique=True):
        """One int64 row-id array per key of `items` ([(KeyInfo, ...)]), checked against its rows;
        sorted and de-duplicated when `unique`."""
        if row_ids is None:
            raise ValueError(f"{op} needs row_ids=")
        if len(items) == 1 and not isinstance(row_ids, (list, tuple)) or \
                (len(items) == 1 and isinstance(row_ids, (list, tuple)) and
                 (len(row_ids) == 0 or not hasattr(row_ids[0], "__len__"))):
            row_ids = [row_ids]
        if len(row_ids) != len(items):
            raise ValueError(f"{op} got {len(items)} keys and {len(row_ids)} row_ids arrays")
        result = []
        for (info, _), ids in zip(items, row_ids):
            ids = as_numpy(ids, f"row_ids for key {info.key!r}") if not isinstance(ids, (list, tuple)) \
                else np.asarray(ids)
            if ids.dtype.kind == "f":           # MXNet's own tests pass float32 ids
                whole = np.isfinite(ids) & (ids == np.round(ids))
                if not np.all(whole):
                    raise ValueError(f"row_ids for key {info.key!r} must be whole numbers; "
                                     f"got {float(ids[~whole].reshape(-1)[0]):g}")
            elif ids.dtype.kind not in "iu" and ids.size:
                raise ValueError(f"row_ids for key {info.key!r} are {ids.dtype}; they must be integers")
            if not info.shape:
                raise ValueError(f"key {info.key!r} is a scalar; {op} needs an array with rows")
            ids = ids.astype(np.int64).reshape(-1)
            if unique:
                ids = np.unique(ids)
            if ids.size and (ids.min() < 0 or ids.max() >= info.shape[0]):
                raise ValueError(f"row_ids for key {info.key!r} must lie in 0..{info.shape[0] - 1}; "
                                 f"got {ids.min()}..{ids.max()}")
            result.append(ids)
        return result

    def _sparse_values(self, keys, values, row_ids, op):
        """[(KeyInfo, ids, rows)] of a row-sparse push: per key, sorted unique row ids and the
        rows for them (rows given twice are summed), every one checked before any is sent."""
        items = []
        for key, vals in pairs(keys, values, op):
            info = self._info(key, op)
            if len(vals) != 1:
                raise ValueError(f"a row-sparse {op} of key {key!r} takes one array of rows; got {len(vals)}")
            items.append((info, as_numpy(vals[0], f"{op} rows for key {key!r}")))
        out = []
        for (info, rows), ids in zip(items, self._row_ids(items, row_ids, op, unique=False)):
            want = (ids.size,) + tuple(info.shape[1:])
            if rows.dtype != info.dtype or rows.shape != want:
                raise ValueError(f"key {info.key!r} was initialised as {describe(info.dtype, info.shape)}; a "
                                 f"row-sparse {op} of {ids.size} rows needs {describe(info.dtype, want)}, got "
                                 f"{describe(rows.dtype, rows.shape)}")
            order = np.argsort(ids, kind="stable")
            ids, rows = ids[order], rows[order]
            uniq, first = np.unique(ids, return_index=True)
            if uniq.size < ids.size:
                rows = np.add.reduceat(rows, first, axis=0).astype(info.dtype, copy=False)
            out.append((info, uniq, np.ascontiguousarray(rows)))
        return out

    @staticmethod
    def _dense(info, ids, rows):
        """A row-sparse push as the dense array it stands for (zeros in the other rows)."""
        out = np.zeros(info.shape, info.dtype)
        out[ids] = rows
        return out


def _done(handle):
    return handle.done()


def _wait_front(queue, timeout=None):
    """Wait for each handle in `queue` in turn, forgetting it once it has completed; raises the
    first error (that handle stays, as it did before: the next call raises it again)."""
    while True:
        try:
            handle = queue[0]
        except IndexError:
            return
        handle.wait(timeout)
        take_front(queue, lambda h: h is handle)
