"""The values a server holds and how pushes change them: sync rounds, async and ssp updates.

Pure logic, no sockets: the server daemon (and the single-process 'local' kvstore)
call it on one thread and pass callbacks that deliver results:

    store = Store(num_workers=2, mode="sync")              # or a kvps.ps.consistency.Consistency
    store.init(0, "w", 0, dtype, shape, array, done)       # done(None | exception)
    store.push(0, "w", 0, grad, done)                      # done(None | exception)
    store.pull(1, "w", 0, done)                            # done(ndarray | exception)

Sync mode: a key's round closes when every worker has pushed it once; the value
becomes the sum of the round's pushes (or, with an optimizer, the optimizer
applied to that sum). Push callbacks fire when their round closes, and a pull
from a worker that has pushed into an open round waits for it, so push-then-pull
always sees the worker's own push. A worker that pushes a key again before the
round closes is queued for the next round.

Backup workers (sync mode, "sync:backup=b"): a round closes after the first W - b
pushes; a push from a worker that has not pulled the latest closed round is stale and
dropped (acknowledged at once, stats["dropped"]), so a slow worker skips rounds instead
of holding everyone back.

Async mode: each push is applied when it arrives: the optimizer if one is set,
otherwise the pushed value is added to the stored one (delta pushes, as BytePS).
GEO mode ("geo:k") is async without an optimizer: each push (a worker's weight change) is added
on arrival, and set_rule refuses.

SSP mode ("ssp:s", stale synchronous parallel): pushes are applied as in async mode,
but a pull from a worker that has pushed a key c times waits until every active
worker has pushed it at least c - s times (stats["ssp_waits"] counts those that waited).

Row-sparse pushes (`push(..., rows=ids)`, MXNet's row_sparse gradients) carry only some rows. A
sync round sums each row over the workers that pushed it; without an update rule the value becomes
that sum with zeros in the rows nobody pushed (as MXNet's server stores a merged row-sparse array),
and with one only the touched rows and their state change (MXNet's lazy update). Async and ssp
pushes add their rows, or update only them.

Every applied push's staleness (updates since its worker last pulled the key) goes into
stats["staleness"], a histogram. The per-mode bookkeeping lives in clocks.py.

Join (sync mode, Horovod's join): a worker that has run out of data calls
`worker_joined`; from then on it counts as pushing zeros into every round, so a
round closes once every other worker has pushed, and open rounds that this
completes close at once. When every worker has joined, all count as active again.

Values that replies still read: the server tells the store (`reading(key, part, array, tracker)`)
when a reply holds a value, until tracker.done (zmq sends straight from it; a co-located worker
copies it out of the server's segments, server/reads.py). An update of a held value goes to other
memory with the same arithmetic (`_destination`, `_replace`), and the held memory, if shared
(`alloc`), is reused once nobody reads it (`_retire`, `_fresh`). Nothing waits for a reader.

Deferred copies (KVPS_REPLICAS=1, sync mode; server/replication.py): on a replica a push may come
without its values, as a Deferred that holds its place in the round. Such a round, once complete,
waits (the slot is busy, as while the pool merges) for the sum the head of the chain computed,
`round_sum`, or, if the head died first, for the workers to send the values again (`fill`); it then
closes as any round does. `on_round(slot, sum)` hears of every round closed with dense pushes, so
the sum can go on to the next server of the chain.

Elastic jobs (KVPS_ELASTIC): `worker_removed` takes a dead worker's rank out of the job, so rounds
close with the workers that remain (a push it made before it died still counts in its round);
`worker_added` brings a rank back: a key whose round is open closes that round without it, and the
new worker's pull waits for it, so it starts from the current value and pushes into the next round.
"""
import logging
import os
import time

import numpy as np

from kvps import kernels
from kvps.ps.consistency import Consistency
from kvps.errors import KVKeyError, KVPSError, KVValueError, NodeFailure, ProtocolError

from kvps.ps.clocks import WAIT, Clocks

log = logging.getLogger("kvps.server")


# rounds of keys this big go to the pool (KVPS_TEST_POOL_BYTES, test only: the suite pools every round)
POOL_BYTES = int(os.environ.get("KVPS_TEST_POOL_BYTES", 1 << 20))
SMALL_SUM = 16384                                        # elements: below this numpy sums a round
EXACT_SUM = (np.dtype(np.float32), np.dtype(np.float64))


def _show(dtype, shape):
    return f"{np.dtype(dtype)} {tuple(shape)}"


class Slot:
    """One key (or one part of a split key) on this server."""
    __slots__ = ("id", "dtype", "shape", "value", "init_waiters", "pending", "in_round", "acks",
                 "pushes", "version", "seen", "early", "pull_waiters", "merge", "sent", "opened", "pushers", "busy",
                 "awaiting", "merge_sent", "retired", "failed")

    def __init__(self, slot_id, dtype, shape):
        self.id = slot_id                # (key, part)
        self.dtype = np.dtype(dtype)
        self.shape = tuple(shape)
        self.value = None                # set by rank 0's init
        self.init_waiters = []           # (worker, dtype, shape, done)
        self.pending = []                # this round's pushed arrays
        self.pushers = []                # the worker of each, in order (a handover replays them)
        self.in_round = set()            # workers that pushed into the open round
        self.acks = []                   # their callbacks
        self.pushes = {}                 # worker -> its clock (see clocks.py)
        self.version = 0                 # updates applied: rounds closed (sync), pushes applied (async, ssp)
        self.seen = {}                   # worker -> version its last pull received
        self.early = []                  # (worker, array, done) for a later round
        self.pull_waiters = []           # (worker, done, rows)
        self.merge = None                # scratch buffer for the round's sum
        self.sent = []                   # what replies still read value: zmq trackers, holds (server/reads.py)
        self.opened = 0.0                # time.time() of the open round's first push (with an observer)
        self.busy = False                # a closed round is being merged on a pool thread (kvps/ps/pool.py),
                                         # or waits for its sum (awaiting)
        # (pending, pushers, acks, members, merge_start) of a closed round with Deferred pushes
        self.awaiting = None
        self.merge_sent = []             # trackers of sends that still read `merge` (a round's sum sent on)
        self.retired = []                # [array, its sent] of former values in shared memory, reused once read
        self.failed = None               # the error of the last sync round, if it failed: pulls get it

    def name(self):
        key, part = self.id
        return f"key {key!r}" + (f" part {part}" if part else "")


class Rows:
    """The rows of a row-sparse push: sorted unique local row ids, and the values of those rows."""
    __slots__ = ("ids", "values")

    def __init__(self, ids, values):
        self.ids, self.values = ids, values

    nbytes = property(lambda self: self.values.nbytes + self.ids.nbytes)

    def dense(self, shape):
        out = np.zeros(shape, self.values.dtype)
        out[self.ids] = self.values
        return out


def _sum_rows(pushes, dtype):
    """The Rows of several row-sparse pushes summed: each row over the pushes that have it."""
    if len(pushes) == 1:
        return pushes[0]
    ids = np.unique(np.concatenate([p.ids for p in pushes]))
    values = np.zeros((ids.size,) + pushes[0].values.shape[1:], dtype)
    for p in pushes:
        values[np.searchsorted(ids, p.ids)] += p.values
    return Rows(ids, values)


def _answered(error):
    """The ack of a push handed over with its slot (Store.adopt): its sender answered it."""


class Deferred:
    """A push that came without its values (see "Deferred copies" above): `array` stays None until
    the worker sends them again (Store.fill)."""
    __slots__ = ("array",)
    nbytes = 0

    def __init__(self):
        self.array = None


def _resolved(pending):
    """True when no push of a round still lacks its values (the filled ones are replaced by them)."""
    for i, push in enumerate(pending):
        if type(push) is Deferred:
            if push.array is None:
                return False
            pending[i] = push.array
    return True


class Store:
    """All slots of one server, in one consistency mode, with an optional update rule (kvps.ps.rules.RuleState)."""

    def __init__(self, num_workers, mode="sync"):
        """`mode`: a Consistency or its wire string. Raises ProtocolError for a bad wire string and
        ValueError for a mode this many workers cannot run (backups >= workers)."""
        self.consistency = mode if isinstance(mode, Consistency) else Consistency.from_wire(mode)
        self.consistency.check_workers(num_workers)
        self.num_workers = num_workers
        self.mode = self.consistency.mode
        self.clocks = Clocks(num_workers, self.consistency)
        self.rule = None
        self.restored, self.restored_from = {}, None   # loaded optimizer state waiting for set_rule
        self.slots = {}
        # state changes that leave every slot's version as it was (an init, a rule set, a restore):
        # part of the generation a checkpoint records (export)
        self.changes = 0
        # KVPS_SERVER_THREADS > 1: a kvps.ps.pool.MergePool that merges big sync rounds beside the I/O
        # thread; None: every round is merged inline
        self.pool = None
        # round_closed(slot, opened, merge_start, closed) and updated(slot, start, end), with time.time()
        # stamps (kvps.metrics.telemetry.Telemetry); None: nothing is timed
        self.observer = None
        # alloc(slot) -> a new array of the slot's dtype and shape, or None for private memory: the
        # server points it at its shared value segments (kvps.wire.shm.Values); None: numpy's. And
        # shared(array): whether alloc gave it (such memory is kept and reused, see _retire)
        self.alloc = None
        self.shared = None
        # deferred copies (above): set by a replicated server; on_round(slot, sum) after each round
        # closed with dense pushes
        self.deferring = False
        self.on_round = None
        self.stats = {"pushes": 0, "pulls": 0, "rounds": 0, "pooled": 0, "updates": 0, "decoded": 0, "bytes_in": 0,
                      "bytes_out": 0, "joins": 0, "last_joined": -1, "dropped": 0, "ssp_waits": 0, "moved": 0,
                      "staleness": self.clocks.staleness}

    # workers that count as pushing zeros (see worker_joined), and those gone (worker -> why)
    joined = property(lambda self: self.clocks.joined)
    gone = property(lambda self: self.clocks.gone)
    removed = property(lambda self: self.clocks.removed)      # elastic: vacant ranks

    # ---- checks (raise before anything changes) ----
    def slot(self, key, part, initialised=True):
        slot = self.slots.get((key, part))
        if slot is None or (initialised and slot.value is None):
            raise KVKeyError(f"key {key!r}" + (f" part {part}" if part else "") +
                             " was never initialised (call kv.init on every worker first)")
        return slot

    def check(self, key, part, dtype, shape):
        """Raise KVValueError/KVKeyError unless (key, part) holds an array of this dtype and shape."""
        slot = self.slot(key, part)
        if slot.dtype != dtype or slot.shape != (shape if type(shape) is tuple else tuple(shape)):
            raise KVValueError(f"{slot.name()} was initialised as {_show(slot.dtype, slot.shape)}; "
                               f"got {_show(dtype, shape)}")
        return slot

    def check_rows(self, slot, rows, unique=False):
        """Raise KVValueError unless `rows` is a 1-D int64 array of row ids within the slot (and,
        when `unique`, sorted without repeats: what a peer asks for can then never exceed the value)."""
        if rows.dtype != np.int64 or rows.ndim != 1:
            raise KVValueError(f"row ids for {slot.name()} must be a 1-D int64 array, got {rows.dtype} {rows.shape}")
        if not slot.shape:
            raise KVValueError(f"{slot.name()} is a scalar; a row-sparse pull needs rows")
        if rows.size and (rows.min() < 0 or rows.max() >= slot.shape[0]):
            raise KVValueError(f"{slot.name()} holds {slot.shape[0]} rows; row ids "
                               f"{int(rows.min())}..{int(rows.max())} are out of range")
        if unique and rows.size > 1 and not np.all(rows[1:] > rows[:-1]):
            raise KVValueError(f"row ids for {slot.name()} must be sorted and unique (a repeated row is "
                               f"refused: it would only make the reply bigger)")

    def check_sparse(self, slot, rows, array):
        """Raise KVValueError unless a row-sparse push's ids and rows fit the slot."""
        self.check_rows(slot, rows, unique=True)
        want = (rows.size,) + slot.shape[1:]
        if array.dtype != slot.dtype or array.shape != want:
            raise KVValueError(f"a row-sparse push of {rows.size} rows to {slot.name()} needs "
                               f"{_show(slot.dtype, want)}; got {_show(array.dtype, array.shape)}")

    # ---- operations ----
    def init(self, worker, key, part, dtype, shape, array, done):
        """Rank 0 passes the value; other workers pass array=None and wait until it is stored."""
        slot = self.slots.get((key, part))
        if slot is None:
            slot = self.slots[(key, part)] = Slot((key, part), dtype, shape)
        if array is None:
            if slot.value is not None:
                done(self._same(slot, dtype, shape))
            else:
                slot.init_waiters.append((worker, dtype, shape, done))
            return
        if slot.value is not None:
            raise KVKeyError(f"{slot.name()} is already initialised; init a key once")
        slot.dtype, slot.shape = np.dtype(dtype), tuple(shape)
        given = np.asarray(array)
        if given.size != int(np.prod(slot.shape, dtype=np.int64)):
            raise KVValueError(f"{slot.name()}: an init value of {given.size} elements for shape {slot.shape}")
        slot.value = self._fresh(slot)
        np.copyto(slot.value, given.reshape(slot.shape), casting="unsafe")
        self.changes += 1
        done(None)
        waiters, slot.init_waiters = slot.init_waiters, []
        for _, w_dtype, w_shape, w_done in waiters:
            w_done(self._same(slot, w_dtype, w_shape))

    def _same(self, slot, dtype, shape):
        if slot.dtype == np.dtype(dtype) and slot.shape == tuple(shape):
            return None
        return KVValueError(f"{slot.name()} was initialised by rank 0 as {_show(slot.dtype, slot.shape)}; "
                            f"this worker's init has {_show(dtype, shape)}")

    def set_rule(self, rule):
        """Apply `rule` from now on. Optimizer state loaded from a checkpoint before any rule was set
        (kvps/ps/checkpoint.py) goes into this one; a mismatch raises KVValueError and changes nothing."""
        if self.mode == "geo":
            # GEO's pushes are weight changes that each worker's own optimizer made: a rule would
            # take them for gradients and step a second time.
            raise KVValueError(f"a {self.consistency.wire()} job runs no server optimizer (the servers add "
                               f"the workers' weight changes); each worker steps its own")
        self.quiesce()
        if self.restored:
            rule.restore_all(self.restored, self.restored_from)
            self.restored, self.restored_from = {}, None
        self.rule = rule
        self.changes += 1

    def push(self, worker, key, part, array, done, rows=None):
        """`rows`: the local row ids (sorted, unique int64) of a row-sparse push, whose `array`
        holds just those rows."""
        slot = self.slot(key, part)
        if rows is not None:
            self.check_sparse(slot, rows, array)
            array = Rows(rows, array)
        self.stats["pushes"] += 1
        self.stats["bytes_in"] += array.nbytes
        if self.mode != "sync":
            self._apply(slot, array)
            self.clocks.pushed(slot, worker)
            self.clocks.applied(slot, worker)
            slot.version += 1
            done(None)
            if self.consistency.bounded:
                self._release_pulls(slot)
            return
        if self.gone:
            raise NodeFailure(f"the sync round of {slot.name()} can never close: {self.clocks.gone_reason()}")
        if worker in self.joined:
            raise KVValueError(f"W{worker} pushed {slot.name()} after join(); a worker that has joined "
                               f"pushes nothing until every worker has joined")
        if self.clocks.stale(slot, worker):
            self.stats["dropped"] += 1
            done(None)
            return
        self.clocks.pushed(slot, worker)
        self._enter(slot, worker, array, done)

    def _enter(self, slot, worker, array, done):
        if worker in slot.in_round or self.clocks.sits_out(slot, worker):
            slot.early.append((worker, array, done))
            return
        if self.observer is not None and not slot.in_round:
            slot.opened = time.time()
        slot.in_round.add(worker)
        slot.pending.append(array)
        slot.pushers.append(worker)
        slot.acks.append(done)
        if not slot.busy and self.clocks.round_complete(slot):
            self._close_round(slot)

    def quiesce(self):
        """Finish every round being merged on the pool (call before anything that reads or replaces
        values, optimizer state or round counters wholesale)."""
        if self.pool is not None and len(self.pool):
            self.pool.drain()

    def _offloads(self, slot, pending):
        """Whether this round goes to the pool: a plain sync round of a big dense key."""
        return (not self.consistency.backup and slot.value is not None and
                slot.value.nbytes >= POOL_BYTES and all(type(p) is not Rows for p in pending))

    def _close_round(self, slot):
        pending, pushers, acks, members = slot.pending, slot.pushers, slot.acks, slot.in_round
        # A joined worker's zeros count as its push, so its pulls never wait and its count stays in step.
        for worker in self.joined - slot.in_round:
            slot.pushes[worker] = slot.pushes.get(worker, 0) + 1
        slot.pending, slot.pushers, slot.acks, slot.in_round = [], [], [], set()
        if self.clocks.late:
            self.clocks.late.pop(slot.id, None)
        merge_start = time.time() if self.observer is not None else 0.0
        summed = self.on_round is not None and any(type(p) is not Rows for p in pending)
        if self.deferring and not _resolved(pending):
            # Deferred pushes without their values: the round waits for its sum (round_sum) or for
            # them (fill). Its pulls wait, and the next round does not close, until then.
            slot.busy = True
            slot.awaiting = (pending, pushers, acks, members, merge_start)
            self._enter_early(slot)
            return
        if self.pool is not None and self._offloads(slot, pending):
            work, apply = self._merge_job(slot, pending)
            slot.busy = True
            self.pool.submit(work, lambda error: self._round_merged(slot, acks, members, merge_start, error, apply,
                                                                    summed=summed))
            # The pushes held for the next round enter it now, before any later push can (its pulls
            # wait, and it does not close, until this round is merged).
            self._enter_early(slot)
            return
        try:
            self._merge(slot, pending)
        except Exception as exc:
            self._round_merged(slot, acks, members, merge_start, exc)
        else:
            self._round_merged(slot, acks, members, merge_start, None, summed=summed)
        if slot.early:
            self._enter_early(slot)

    def _enter_early(self, slot):
        early, slot.early = slot.early, []
        for worker, array, done in early:
            self._enter(slot, worker, array, done)

    def round_sum(self, key, part, version, total, adopt=False):
        """The sum of the round of (key, part) that makes its `version`, from the server before this
        one in the chain (ROUND), for a round here whose pushes were deferred. A round this server
        already closed from the workers' values (its head died, `fill`) takes nothing; any other
        mismatch raises ProtocolError, and nothing changes. `adopt`: without an update rule the sum
        becomes the value as it is, not a copy (a read-only view of the sender's memory, which it
        leaves alone until told: server/replication.py); returns whether it did."""
        slot = self.check(key, part, total.dtype, total.shape)
        if slot.awaiting is None and slot.version >= version:
            return False
        if slot.awaiting is None:
            raise ProtocolError(f"the sum of round {version} of {slot.name()} came, but no round waits for "
                                f"one here (version {slot.version})")
        if slot.version + 1 != version:
            raise ProtocolError(f"the sum of round {version} of {slot.name()} came, but round "
                                f"{slot.version + 1} waits for one here")
        adopt = adopt and self.rule is None
        self._finish_awaiting(slot, [total], adopt)
        return adopt

    def fill(self, key, part, deferred, array):
        """The values of a Deferred push, sent again by its worker: a round that waited only for
        them closes (with the same pushes, in the same order, as at the head)."""
        slot = self.check(key, part, array.dtype, array.shape)
        deferred.array = array
        if slot.awaiting is not None and _resolved(slot.awaiting[0]):
            self._finish_awaiting(slot, slot.awaiting[0])

    def _finish_awaiting(self, slot, pending, adopt=False):
        _, _, acks, members, merge_start = slot.awaiting
        slot.awaiting = None
        try:
            if adopt:
                self._replace(slot, pending[0])
            else:
                self._merge(slot, pending)
        except Exception as exc:
            self._round_merged(slot, acks, members, merge_start, exc)
            return
        self._round_merged(slot, acks, members, merge_start, None, resumed=True,
                           summed=self.on_round is not None)

    def _round_merged(self, slot, acks, members, merge_start, error, apply=None, summed=False, resumed=False):
        """The rest of closing a round, once it is merged (inline, on the pool: then on the I/O
        thread, or with its sum from the chain: `resumed`). `summed`: it had dense pushes, so
        on_round hears of it."""
        slot.busy = False
        if error is None and apply is not None:
            apply()
            self.stats["pooled"] += 1
        if error is not None:
            # Every worker in the round hears of the failure; none waits for a reply that never comes.
            log.error("%s: applying a round failed", slot.name(), exc_info=error)
            slot.version += 1
            slot.failed = error
            for ack in acks:
                ack(error)
            waiters, slot.pull_waiters = slot.pull_waiters, []
            for _, done, _, _ in waiters:
                done(error)
            return
        for worker in members:
            self.clocks.applied(slot, worker)
        slot.version += 1
        slot.failed = None
        self.stats["rounds"] += 1
        closed = time.time() if self.observer is not None else 0.0
        if summed:                          # before the acks: the chain holds their replies for it
            self.on_round(slot, slot.merge if self.rule is not None else slot.value)
        for ack in acks:
            ack(None)
        self._release_pulls(slot)
        if self.observer is not None:       # after the replies: timing a round never delays one
            self.observer.round_closed(slot, slot.opened or merge_start, merge_start, closed)
        if (apply is not None or resumed) and slot.in_round and self.clocks.round_complete(slot):
            self._close_round(slot)         # the next round filled up while this one was merged

    def _merge_job(self, slot, pending):
        """(work, apply) for the pool: work() only computes, into buffers nothing else reads while the
        slot is busy; apply() then swaps them in on the I/O thread. The same arithmetic as _merge."""
        box = {}
        if self.rule is not None:
            self._own(slot)
            scratch = self._scratch(slot)

            def work():
                box["merge"] = self._sum(slot, pending, scratch)
                self._update(slot, box["merge"])

            def apply():
                slot.merge = box["merge"]
                self.stats["updates"] += 1
            return work, apply
        target = self._scratch_for(slot, slot.merge)
        if target is None:
            target = self._fresh(slot)      # here: only the I/O thread touches the slot's memory lists

        def work():
            box["value"] = self._sum(slot, pending, target)

        def apply():
            self._replace(slot, box["value"])
        return work, apply

    def _merge(self, slot, pending):
        if any(type(p) is Rows for p in pending):
            return self._merge_rows(slot, pending)
        if self.rule is not None:
            slot.merge = self._sum(slot, pending, self._scratch(slot))
            self._apply(slot, slot.merge)
        else:
            self._replace(slot, self._sum(slot, pending, self._scratch_for(slot, slot.merge)))

    def _merge_rows(self, slot, pending):
        """A round with row-sparse pushes: the rule on the touched rows, or the sum of the rows
        (zeros where nobody pushed) as the new value."""
        if self.rule is not None and all(type(p) is Rows for p in pending):
            self._apply(slot, _sum_rows(pending, slot.dtype))
            return
        dense = [p.dense(slot.shape) if type(p) is Rows else p for p in pending]
        if self.rule is not None:
            slot.merge = self._sum(slot, dense, self._scratch(slot))
            self._apply(slot, slot.merge)
            return
        self._replace(slot, self._sum(slot, dense, self._scratch_for(slot, slot.merge)))

    def _replace(self, slot, new):
        """A round's sum becomes the value. The old value is the next round's sum buffer, unless a
        reply may still read it (zmq sends from it, a worker copies out of it): then it is kept
        aside until they are done (_retire), and the next round sums into other memory."""
        if not slot.sent or self._settled(slot):
            # (an adopted value, read-only, is nobody's sum buffer: round_sum)
            slot.merge, slot.value, slot.sent = slot.value if slot.value.flags.writeable else None, new, []
        else:
            self.stats["moved"] += 1
            self._retire(slot)
            slot.merge, slot.value = None, new

    @staticmethod
    def _scratch(slot):
        """The slot's sum buffer for the next round, or None (a new one) while a send still reads it."""
        sent, slot.merge_sent = slot.merge_sent, []
        return slot.merge if all(t.done for t in sent) else None

    def _fresh(self, slot):
        """New memory for a slot's value or round sum: a former value that no reply reads any more,
        else shared memory (see `alloc`) where it can be had, else private memory."""
        spare = self._reusable(slot)
        if spare is not None:
            return spare
        array = self.alloc(slot) if self.alloc is not None else None
        return np.empty(slot.shape, slot.dtype) if array is None else array

    @staticmethod
    def _reusable(slot):
        """A retired value (shared memory) that no reply reads any more, taken off the list; or None."""
        for i, (array, readers) in enumerate(slot.retired):
            if all(t.done for t in readers):
                del slot.retired[i]
                return array
        return None

    def _retire(self, slot):
        """slot.value is about to be replaced while replies may still read it (slot.sent). Shared
        memory is kept aside with them and reused once they are done; private memory is dropped
        (zmq keeps alive what it still sends)."""
        if self.shared is not None and slot.value is not None and self.shared(slot.value):
            slot.retired.append([slot.value, slot.sent])
        slot.sent = []

    def _scratch_for(self, slot, buffer):
        """Where to compute a new value: `buffer` (memory no reply reads, or None for new memory),
        unless it is private and a retired shared block is free again. So a value that had to move
        to private memory, while every shared block of its key was being read, moves back."""
        if slot.retired and (buffer is None or not self.shared(buffer)):
            spare = self._reusable(slot)
            if spare is not None:
                return spare
        return buffer

    def _destination(self, slot):
        """Where the value's next in-place update should go instead: None (in place), or other
        memory (the value moves there, see _retire) while a reply reads the value, or to move a
        private value back into a freed shared block, or out of memory it may not write (an adopted
        value: round_sum)."""
        if not slot.value.flags.writeable:
            return self._fresh(slot)
        if slot.sent and not self._settled(slot):
            self.stats["moved"] += 1
            return self._fresh(slot)
        slot.sent = []
        return self._scratch_for(slot, slot.value) if slot.retired else None

    def _sum(self, slot, arrays, target):
        if target is None or target.shape != slot.shape:
            target = self._fresh(slot)
        flat = target.reshape(-1)
        if len(arrays) == 1:
            np.copyto(flat, arrays[0].reshape(-1))
        elif flat.size <= SMALL_SUM and slot.dtype in EXACT_SUM:
            # A small key: numpy's add costs a tenth of a kernel call here, and in float32 or float64,
            # left to right, it gives the kernel's bits (the kernel rounds low precision only once).
            np.add(arrays[0].reshape(-1), arrays[1].reshape(-1), out=flat)
            for a in arrays[2:]:
                np.add(flat, a.reshape(-1), out=flat)
        else:
            kernels.sum_sources(flat, [a.reshape(-1) for a in arrays])
        return target

    def _apply(self, slot, grad):
        """Apply one (summed) push to the value (in place, unless a reply reads it: _destination)."""
        if type(grad) is not Rows and self.rule is None:
            new = self._destination(slot)
            if new is None or new is slot.value:
                kernels.sum_into(slot.value.reshape(-1), grad.reshape(-1))
            else:
                # value + grad into the new memory: the bits of the sum in place, in one pass
                kernels.sum_sources(new.reshape(-1), [slot.value.reshape(-1), grad.reshape(-1)])
                self._retire(slot)
                slot.value = new
            return
        self._own(slot)
        if type(grad) is Rows:
            if self.rule is not None:
                self.rule.update_rows(slot.id, slot.value, grad.ids, grad.values)
                self.stats["updates"] += 1
            else:
                slot.value[grad.ids] += grad.values
            return
        self._update(slot, grad)
        self.stats["updates"] += 1

    def _update(self, slot, grad):
        """The rule on the value in place (any thread: see _merge_job)."""
        start = time.time() if self.observer is not None else 0.0
        self.rule(slot.id, slot.value, grad.reshape(slot.shape))
        if self.observer is not None:
            self.observer.updated(slot, start, time.time())

    def pull(self, worker, key, part, done, rows=None):
        """done(array) with the value (or the given local rows of it) once this worker's pushes
        so far are applied (in sync mode: the value of the round of its last push before this pull,
        as MXNet's engine orders a pull between two pushes, even if later pushes are in already).
        The array may be sent without copying: see `sent`."""
        slot = self.slot(key, part)
        if rows is not None:
            self.check_rows(slot, rows)
        self.stats["pulls"] += 1
        pushed = slot.pushes.get(worker, 0)
        state = WAIT if slot.busy else self.clocks.pull_state(slot, worker, pushed)
        if state is WAIT:
            if self.mode == "ssp":
                self.stats["ssp_waits"] += 1
            slot.pull_waiters.append((worker, done, rows, pushed))
        elif state is None:
            self._deliver(slot, worker, done, rows)
        else:
            done(state)

    def _deliver(self, slot, worker, done, rows):
        if slot.failed is not None:
            # The value holds none of the failed round's pushes: a pull that returned it would pass
            # off the value before that round as its result.
            done(KVPSError(f"the last sync round of {slot.name()} failed ({type(slot.failed).__name__}: "
                           f"{slot.failed}): its value holds none of that round's pushes"))
            return
        value = slot.value if rows is None else slot.value[rows]
        self.stats["bytes_out"] += value.nbytes
        self.clocks.delivered(slot, worker)
        done(value)

    def _release_pulls(self, slot):
        """Answer the waiting pulls that may return now (or never can)."""
        waiters, slot.pull_waiters = slot.pull_waiters, []
        for worker, done, rows, pushed in waiters:
            state = WAIT if slot.busy else self.clocks.pull_state(slot, worker, pushed)
            if state is WAIT:
                slot.pull_waiters.append((worker, done, rows, pushed))
            elif state is None:
                self._deliver(slot, worker, done, rows)
            else:
                done(state)

    # ---- zero-copy replies ----
    def sent(self, key, part, tracker):
        """A reply is being sent straight from this slot's value; do not change it until done."""
        slot = self.slots.get((key, part))
        if slot is not None:
            self.reading(key, part, slot.value, tracker)

    def forwarding(self, slot, tracker):
        """The sum on_round gave is being sent without a copy: keep it as it is until tracker.done."""
        (slot.merge_sent if self.rule is not None else slot.sent).append(tracker)

    def _settled(self, slot):
        return all(t.done for t in slot.sent)

    def _own(self, slot):
        """Make slot.value safe to change in place without waiting: while a reply still reads it
        (zmq sends from it, and a peer may never read; a worker copies out of it), the value moves
        to a copy and the old memory is left to the readers (_retire). The update then runs on the
        same numbers, so results are bit-identical; the I/O thread never blocks on a peer."""
        new = self._destination(slot)
        if new is not None and new is not slot.value:
            np.copyto(new, slot.value)
            self._retire(slot)
            slot.value = new

    def reading(self, key, part, array, tracker):
        """A reply reads `array`, which was this slot's value when it was delivered: it changes
        neither in place nor (as a retired block) by reuse until tracker.done."""
        slot = self.slots.get((key, part))
        if slot is None:
            return
        if array is slot.value:
            slot.sent.append(tracker)
            return
        for block in slot.retired:
            if block[0] is array:
                block[1].append(tracker)
                return

    # ---- membership ----
    def worker_joined(self, worker):
        """A worker has no more data. In sync mode, rounds it was the last one missing from close
        now; in ssp mode, pulls that waited for it return (async rounds wait for nobody). Once
        every worker has joined, all of them are active again, so a later epoch runs as before,
        and stats["last_joined"] names the last one."""
        self.quiesce()
        self.stats["joins"] += 1
        self.joined.add(worker)
        if self.mode == "sync":
            for slot in self.slots.values():
                if slot.in_round and not slot.busy and self.clocks.round_complete(slot):
                    self._close_round(slot)
        elif self.mode == "ssp":
            for slot in self.slots.values():
                self._release_pulls(slot)
        if len(self.joined | self.removed) >= self.num_workers:
            self.joined.clear()
            self.stats["last_joined"] = worker

    def worker_removed(self, worker):
        """Elastic: the scheduler removed this worker (it died, or left); rounds and ssp pulls stop
        waiting for it, and what it had queued for later rounds is dropped."""
        self.quiesce()
        self.removed.add(worker)
        self.joined.discard(worker)
        for late in self.clocks.late.values():
            late.discard(worker)
        for slot in self.slots.values():
            slot.early = [item for item in slot.early if item[0] != worker]
            slot.pull_waiters = [item for item in slot.pull_waiters if item[0] != worker]
            if self.mode == "sync" and slot.in_round and not slot.busy and self.clocks.round_complete(slot):
                self._close_round(slot)
            elif self.mode == "ssp":
                self._release_pulls(slot)

    def worker_added(self, worker):
        """Elastic: a new worker took a vacant rank. Per key it starts from the current value: a sync
        round under way closes without it (its pull waits for that round, its push goes to the
        next); in ssp its clock starts at the fastest worker's, so it holds nobody back."""
        self.quiesce()
        self.removed.discard(worker)
        self.gone.pop(worker, None)
        for slot in self.slots.values():
            slot.seen[worker] = slot.version
            if self.mode == "sync":
                slot.pushes[worker] = slot.version + (1 if slot.in_round else 0)
                if slot.in_round:
                    self.clocks.late.setdefault(slot.id, set()).add(worker)
            else:
                slot.pushes[worker] = max((slot.pushes.get(w, 0) for w in self.clocks.active() if w != worker),
                                          default=0)

    def worker_gone(self, worker, reason):
        """A worker left or died: fail every sync round, and every ssp pull, that waits for it."""
        self.quiesce()
        self.gone[worker] = reason
        if self.mode == "ssp":
            for slot in self.slots.values():
                self._release_pulls(slot)
        if self.mode != "sync":
            return
        for slot in self.slots.values():
            if slot.in_round and worker not in slot.in_round:
                error = NodeFailure(f"the sync round of {slot.name()} can never close: {reason}")
                acks, slot.acks, slot.pending, slot.pushers, slot.in_round = slot.acks, [], [], [], set()
                for w, array, done in slot.early:
                    acks.append(done)
                slot.early = []
                for ack in acks:
                    ack(error)
                for _, done, _, _ in slot.pull_waiters:
                    done(error)
                slot.pull_waiters = []

    # ---- checkpoints (the file format is kvps/ps/checkpoint.py's) ----
    def export(self, copy=True):
        """Every initialised slot's value, update-rule state and round/clock counters, as records for
        checkpoint.pack. Runs on the store's thread; with `copy` the arrays are copies, which the
        caller may write from any thread while training goes on; without, they are the live arrays
        (the caller must hold back every request that would change them until it is done)."""
        self.quiesce()
        out = []
        for slot in self.slots.values():
            if slot.value is None:
                continue
            opt = self.rule.export(slot.id, copy) if self.rule is not None else None
            key, part = slot.id
            # The clocks of the value saved: pushes waiting in an open round are not in it (a job
            # resumed from here has those workers push them again).
            pushes = dict(slot.pushes)
            awaiting = slot.awaiting[1] if slot.awaiting is not None else ()
            for worker in [*awaiting, *slot.in_round, *(w for w, _, _ in slot.early)]:
                pushes[worker] -= 1
            out.append({"key": key, "part": part, "value": slot.value.copy() if copy else slot.value, "opt": opt,
                        "version": slot.version, "pushes": sorted(pushes.items()),
                        "seen": sorted(slot.seen.items())})
        return out

    def handover(self, slot_ids):
        """The state of these slots for a server that joins their chain (server/replication.py): per
        slot (its export record, with copies; the pushes waiting in its open round, in the order they
        came: [(worker, array or Rows)])."""
        self.quiesce()
        chosen = set(slot_ids)
        records = [r for r in self.export(copy=True) if (r["key"], r["part"]) in chosen]
        out = []
        for record in records:
            slot = self.slots[(record["key"], record["part"])]
            waiting = list(zip(slot.pushers, slot.pending)) + [(w, a) for w, a, _ in slot.early]
            if slot.awaiting is not None:       # a round waiting for its sum goes first
                waiting = list(zip(slot.awaiting[1], slot.awaiting[0])) + waiting
            out.append((record, [(w, a.copy() if isinstance(a, np.ndarray) else a) for w, a in waiting]))
        return out

    def adopt(self, key, part, value, counters, waiting):
        """A slot handed over by the old tail of its chain: its value and counters (as handover gave
        them), then the pushes that wait in its open round, pushed again in their order (nobody
        waits for their acks: the sender answered them)."""
        self.quiesce()
        slot = self.slots.get((key, part))
        if slot is None:
            slot = self.slots[(key, part)] = Slot((key, part), value.dtype, value.shape)
        self.restore(slot, np.array(value), counters)
        for worker, array in waiting:
            rows = None
            if isinstance(array, Rows):
                array, rows = array.values, array.ids
            self.push(worker, key, part, array, _answered, rows)
        return slot

    def check_restore(self, key, part, shape, dtype, idle=True):
        """Raise (before anything changes) unless (key, part) may take a loaded state now; `idle`:
        no round or pull may be in progress (optimizer state alone may load during a round, which
        applies it when it closes)."""
        self.quiesce()
        slot = self.check(key, part, dtype, shape)
        if idle and (slot.pending or slot.early or slot.pull_waiters or slot.awaiting):
            raise KVValueError(f"{slot.name()} has a sync round or a pull in progress; load a checkpoint "
                               f"while no worker pushes (kv.load waits for every worker)")
        return slot

    def restore(self, slot, value=None, counters=None, same_clocks=True):
        """Replace a slot's value (the array itself is kept) and, with `counters` ({"version",
        "pushes", "seen"} as saved), its round/clock counters. With `same_clocks` False (the job
        that saved had other workers or another mode) every worker starts level at the saved version."""
        self.quiesce()
        self.changes += 1
        if value is not None:
            self._retire(slot)
            if slot.merge is not None and self.shared is not None and self.shared(slot.merge):
                slot.retired.append([slot.merge, []])
            slot.value, slot.merge = value, None
        if counters is not None:
            slot.version = int(counters["version"])
            if same_clocks:
                slot.pushes = {int(w): c for w, c in counters["pushes"]}
                slot.seen = {int(w): v for w, v in counters["seen"]}
            else:
                slot.pushes = {w: slot.version for w in range(self.num_workers)}
                slot.seen = dict(slot.pushes)

    def restore_optimizer(self, states, source):
        """Loaded update-rule state {slot id: (master, count, state arrays)}: into the current rule,
        or, when none is set yet, kept for the next set_rule. `source` (the checkpoint's path and
        the name of the optimizer that saved) goes into the errors of a rule that does not fit."""
        self.quiesce()
        self.changes += 1
        if self.rule is not None:
            self.rule.restore_all(states, source)
        else:
            self.restored.update(states)
            self.restored_from = source
