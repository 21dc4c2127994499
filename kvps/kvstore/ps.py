"""The distributed kvstore: one worker of a parameter-server job (dist_sync, dist_async, dist_ssp).

Each call is checked against what init declared, split into per-server
requests (one message per server, carrying every key and part it holds), and
sent by the node's I/O thread. Replies are written into the caller's arrays on
that thread. The worker finds the scheduler through KVPS_SCHEDULER (or MXNet's
DMLC_PS_ROOT_URI / DMLC_PS_ROOT_PORT) and leaves the job on close() or exit.
"""
import collections
import logging
import math
import numbers

import numpy as np

from kvps.ps import compression, sharding
from kvps.config import Config
from kvps.ps.consistency import Consistency
from kvps.errors import KVPSError, ProtocolError
from kvps.wire.requests import Handle, remember
from kvps.kvstore.base import KeyInfo, KVStore
from kvps.kvstore.pull_ahead import PullAhead, Stash
from kvps.wire.membership import Worker
from kvps.wire.protocol import MAX_ENTRIES, MAX_ROW_IDS, Entry, Header, Op, as_array, dtype_code, numpy_dtype

log = logging.getLogger("kvps.worker")


def _bytes(array):
    """A zero-copy byte view of a contiguous array (works for every dtype, bfloat16 too)."""
    return memoryview(array.reshape(-1).view(np.uint8))


class Messages:
    """A call's requests: per server, entries gathered into messages of about `limit` bytes, so a
    server can work on (and answer) the first ones while the rest are still on the wire, and of at
    most MAX_ENTRIES entries, which is all a server decodes."""

    def __init__(self, limit, meta=None):
        self.limit = limit
        self.meta = meta or {}       # sent in every message's header
        self._open = {}              # server -> [entries, payloads, bytes]
        self._all = []               # (server, message) in the order they were opened

    def add(self, server, entry, payload, size):
        self.add_group(server, [(entry, payload, size)])

    def add_group(self, server, items):
        """Entries [(entry, payload or None, size)] that must travel in one message."""
        total = sum(size for _, _, size in items)
        message = self._open.get(server)
        if message is None or (message[2] and message[2] + total > self.limit) or \
                len(message[0]) + len(items) > MAX_ENTRIES:
            message = self._open[server] = [[], [], 0]
            self._all.append((server, message))
        for entry, payload, _ in items:
            message[0].append(entry)
            if payload is not None:
                message[1].append(payload)
        message[2] += total

    def __iter__(self):
        return ((server, entries, payloads) for server, (entries, payloads, _) in self._all)


class DistKVStore(KVStore):
    """`consistency`: a kvps.ps.consistency.Consistency, or its wire string ("sync", "ssp:4", ...);
    kvps.create() builds it from the type name and options."""

    def __init__(self, name, consistency, config=None):
        super().__init__(name)
        self.cfg = config or Config.from_env()
        if not isinstance(consistency, Consistency):
            consistency = Consistency.from_wire(consistency)
        self.consistency = consistency
        self.mode = consistency.mode
        self._claim_process()
        # Workers register the canonical string: the scheduler refuses a job whose workers differ.
        self._node = Worker(self.cfg, meta={"mode": consistency.wire()})
        self._node.start()
        self._join_job(self._node, self._node.leave)
        self._num_servers = len(self._node.membership["servers"])
        self._optimizer_generation = 0
        self._codec = None               # gradient compression spec, or None
        self._residuals = {}             # (key, part) -> float32 error-feedback residual
        self._copies = {}                # key -> (private copy of its last push, that push's handle)
        # pull-ahead keeps dist_sync's semantics exactly: the round's value is what a pull would read
        self._ahead = PullAhead() if consistency.wire() == "sync" else None
        if self._num_servers == 0:
            self.close()
            raise KVPSError(f"kvstore {name!r} needs servers, and this job has none "
                            f"(start it with kvps launch -s S, S >= 1, or use kvps.create('allreduce'))")
        try:
            consistency.check_workers(self.num_workers)
        except ValueError as exc:
            self.close()
            raise ValueError(f"kvstore {name!r}: {exc}") from None

    rank = property(lambda self: self._node.rank)
    num_workers = property(lambda self: len(self._node.membership["workers"]))
    num_servers = property(lambda self: self._num_servers)

    # ---- plumbing ----
    def _send(self, op, what, messages, on_reply=None, keep=(), async_op=False, then=(), priority=0):
        """Send the requests of a Messages batch under one Handle; returns it. Higher priorities
        leave first among the requests waiting for the network (kvps/wire/schedule.py)."""
        if self._closed:
            raise KVPSError(f"{what}: this kvstore is closed")
        if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
            raise TypeError(f"{what}: priority must be an int (higher goes first), not {priority!r}")
        self._check_returned()
        items = [(f"S{server}", Header(op, keys=entries, meta=dict(messages.meta)), payloads, on_reply)
                 for server, entries, payloads in messages]
        handle = self._node.request_many(items, what, keep=keep, priority=int(priority))
        handle.then = then
        if async_op:
            remember(self._pending, handle)
            return handle
        if async_op is None:             # the caller keeps it (a push that returns early)
            return handle
        return _finish(handle)

    def _layout(self, key, shape, dtype):
        return sharding.layout(key, shape, self._num_servers, self.cfg.bigarray_bound, np.dtype(dtype).itemsize,
                               self.cfg.partition_bytes)

    @staticmethod
    def _what(op, infos):
        keys = [repr(i.key) for i in infos[:4]]
        more = f" and {len(infos) - 4} more" if len(infos) > 4 else ""
        return f"{op} of key{'s' if len(infos) > 1 else ''} {', '.join(keys)}{more}"

    def _with_values(self, items, codec=None):
        """Messages carrying each array's parts; with a codec, float32 parts go compressed."""
        messages = Messages(self.cfg.message_bytes, {"codec": codec} if codec else {})
        for info, array in items:
            flat = array.reshape(-1)
            code = dtype_code(info.dtype)
            squeeze = codec is not None and info.dtype == np.float32
            for part in info.parts:
                seg = flat[part.start:part.stop]
                if squeeze:
                    seg = self._compress(info.key, part.index, seg)
                    entry = Entry.of(info.key, part.index, seg)
                else:
                    entry = Entry(info.key, part.index, code, part.shape(info.shape), seg.nbytes)
                messages.add(part.server, entry, _bytes(seg) if seg.nbytes else None, seg.nbytes)
        return messages

    def _compress(self, key, part, grad):
        residual = None
        if compression.needs_residual(self._codec):
            residual = self._residuals.get((key, part))
            if residual is None:
                residual = self._residuals[(key, part)] = np.zeros(grad.size, np.float32)
        return compression.encode(self._codec, np.ascontiguousarray(grad), residual)

    def _bare(self, infos):
        """Messages asking for each key's parts (sized by what the replies will carry)."""
        messages = Messages(self.cfg.message_bytes)
        for info in infos:
            code = dtype_code(info.dtype)
            for part in info.parts:
                messages.add(part.server, Entry.bare(info.key, part.index, code, part.shape(info.shape)), None,
                             part.size * info.dtype.itemsize)
        return messages

    def _filler(self, items):
        """on_reply that copies VALUE payloads into the outs of [(KeyInfo, [Out])]."""
        dests = collections.defaultdict(list)
        for info, outs in items:
            for part in info.parts:
                for o in outs:
                    dests[(info.key, part.index)].append((info, o.array.reshape(-1)[part.start:part.stop]))

        def fill(header, payloads):
            frames = iter(payloads)
            for entry in header.keys:
                frame = next(frames) if entry.nbytes else None
                for info, dest in dests.get((entry.key, entry.part), ()):
                    if entry.dtype != dtype_code(info.dtype) or math.prod(entry.shape) != dest.size:
                        raise ProtocolError(f"reply for key {entry.key!r} part {entry.part} is "
                                            f"{numpy_dtype(entry.dtype)} "
                                            f"{entry.shape}; expected {info.dtype} with {dest.size} elements")
                    if frame is not None:
                        np.copyto(dest, as_array(frame, entry).reshape(-1))
        return fill

    # ---- the API ----
    def init(self, key, value):
        items = self._inits(key, value)
        infos = [KeyInfo(i.key, i.dtype, i.shape, self._layout(i.key, i.shape, i.dtype)) for i, _ in items]
        arrays = [a for _, a in items]
        messages = self._with_values(list(zip(infos, arrays))) if self.rank == 0 else self._bare(infos)
        self._send(Op.INIT, self._what("init", infos), messages, keep=arrays)
        for info in infos:
            self._keys[info.key] = info

    def push(self, key, value, priority=0, async_op=False, row_ids=None):
        """Returns once the values are copied (blocking form) and the round goes on in the background:
        a later pull of the same key sees it, and its error is raised by the next call."""
        if row_ids is not None:
            return self._push_rows(key, value, row_ids, async_op, priority)
        items = self._values(key, value, "push")
        self._straggle(items)
        keys = [info.key for info, _ in items]
        what = self._what("push", [i for i, _ in items])
        if async_op:
            self._forget(keys)
            messages = self._with_values(items, self._codec)
            return self._send(Op.PUSH, what, messages, keep=(items, messages), async_op=True, priority=priority)
        items = [(info, self._private(info, array)) for info, array in items]
        messages = self._with_values(items, self._codec)
        stash = Stash() if self._ahead is not None and self._ahead.wants(keys) else None
        if stash is None:
            handle = self._send(Op.PUSH, what, messages, keep=(items, messages), async_op=None, priority=priority)
        else:
            handle = stash.handle = self._send(Op.PUSHPULL, what, messages, on_reply=stash.keep,
                                               keep=(items, messages), async_op=None, priority=priority)
        if self._ahead is not None:
            self._ahead.pushed(keys, stash)
        for info, array in items:
            self._copies[info.key] = (array, handle)
        self._returned_early(handle)
        return handle

    def _push_rows(self, key, value, row_ids, async_op, priority):
        """A row-sparse push: per part of each key, its local row ids and those rows (the ids and
        the rows are fresh arrays, so the caller may reuse its own at once)."""
        sparse = self._sparse_values(key, value, row_ids, "push")
        for info, ids, _ in sparse:
            if ids.size > MAX_ROW_IDS:
                raise ValueError(f"a row-sparse push of key {info.key!r} has {ids.size} rows; a call pushes "
                                 f"at most {MAX_ROW_IDS} (push them in smaller batches)")
        self._straggle([(info, rows) for info, _, rows in sparse])
        self._forget([info.key for info, _, _ in sparse])
        # each message carries at most MAX_ROW_IDS ids: its bytes bound them (8 per id, then the rows)
        messages = Messages(min(self.cfg.message_bytes, 8 * MAX_ROW_IDS))
        for info, ids, rows in sparse:
            if rows.base is not None:
                rows = rows.copy()
            routed = {part.index: (local, positions) for part, local, positions in sharding.split_rows(info.parts, ids)}
            for part in info.parts:     # every part, rows or none: each part's sync round needs every worker
                local, positions = routed.get(part.index, (np.empty(0, np.int64), np.empty(0, np.int64)))
                part_rows = np.ascontiguousarray(rows[positions])
                messages.add_group(part.server, [
                    (Entry.of(info.key, part.index, local), _bytes(local) if local.nbytes else None, local.nbytes),
                    (Entry.of(info.key, part.index, part_rows), _bytes(part_rows) if part_rows.nbytes else None,
                     part_rows.nbytes)])
        what = self._what("row-sparse push", [info for info, _, _ in sparse])
        handle = self._send(Op.ROW_SPARSE_PUSH, what, messages, keep=(sparse, messages),
                            async_op=True if async_op else None, priority=priority)
        if not async_op:
            self._returned_early(handle)
        return handle

    def _private(self, info, array):
        """A copy of a pushed array that the caller cannot change: the key's buffer from its last
        push when that push is over, else a new one."""
        copy, handle = self._copies.get(info.key, (None, None))
        if copy is None or not handle.done() or copy.dtype != array.dtype or copy.shape != array.shape:
            copy = np.empty_like(array)
        np.copyto(copy, array)
        return copy

    def _forget(self, keys):
        if self._ahead is not None:
            self._ahead.drop(keys)

    def pull(self, key, out=None, priority=0, ignore_sparse=True, async_op=False):
        items = self._outs(key, out, "pull")
        infos = [i for i, _ in items]
        stashes = self._ahead.take([i.key for i in infos]) if self._ahead is not None else None
        if stashes is not None:
            return self._pulled_ahead(items, stashes)
        return self._send(Op.PULL, self._what("pull", infos), self._bare(infos), on_reply=self._filler(items),
                          keep=items, async_op=async_op, then=_finishers(items), priority=priority)

    def _pulled_ahead(self, items, stashes):
        """A pull served by the replies of the PUSHPULLs its keys' pushes went as."""
        self._check_returned()
        fill = self._filler(items)
        for stash in stashes:
            stash.handle.wait()
            for header, payloads in stash.replies:
                fill(header, payloads)
        for finish in _finishers(items):
            finish()
        return Handle.completed(self._what("pull", [i for i, _ in items]))

    def pushpull(self, key, value, out=None, priority=0, async_op=False):
        values = self._values(key, value, "pushpull")
        self._forget([info.key for info, _ in values])
        self._straggle(values)
        outs = self._outs(key, value if out is None else out, "pushpull")
        messages = self._with_values(values, self._codec)
        return self._send(Op.PUSHPULL, self._what("pushpull", [i for i, _ in values]), messages,
                          on_reply=self._filler(outs), keep=(values, outs, messages), async_op=async_op,
                          then=_finishers(outs), priority=priority)

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None, async_op=False):
        items = self._outs(key, out, "row_sparse_pull")
        self._forget([info.key for info, _ in items])
        ids_per_key = self._row_ids(items, row_ids, "row_sparse_pull")     # sorted, unique
        # A key named twice in one call is asked for once, with the union of its rows (a server
        # refuses a part named twice, or repeated rows), and each out gets its own rows back.
        asks = {}
        for (info, outs), ids in zip(items, ids_per_key):
            asks.setdefault(info.key, (info, []))[1].append((outs, ids))
        wanted = []
        for info, wants in asks.values():
            ids = wants[0][1] if len(wants) == 1 else np.unique(np.concatenate([i for _, i in wants]))
            if ids.size > MAX_ROW_IDS:
                raise ValueError(f"row_sparse_pull of key {info.key!r} asks for {ids.size} rows; a call asks "
                                 f"for at most {MAX_ROW_IDS} (pull them in smaller batches)")
            wanted.append((info, wants, ids))
        for outs, _ in (w for _, wants, _ in wanted for w in wants):
            for o in outs:
                o.array[...] = 0
        # each message carries at most MAX_ROW_IDS ids: its reply bytes bound them (a row is >= 1 byte)
        messages = Messages(min(self.cfg.message_bytes, MAX_ROW_IDS))
        dests = {}
        for info, wants, ids in wanted:
            for part, local, positions in sharding.split_rows(info.parts, ids):
                messages.add(part.server, Entry.of(info.key, part.index, local), _bytes(local),
                             local.size * max(1, part.row_size * info.dtype.itemsize))
                dests[(info.key, part.index)] = (info, wants, ids[positions])

        def fill(header, payloads):
            frames = iter(payloads)
            for entry in header.keys:
                frame = next(frames) if entry.nbytes else None
                info, wants, rows = dests[(entry.key, entry.part)]
                if entry.dtype != dtype_code(info.dtype) or tuple(entry.shape[1:]) != info.shape[1:] or \
                        entry.shape[0] != rows.size:
                    raise ProtocolError(f"row_sparse_pull reply for key {entry.key!r} is {entry.shape}; "
                                        f"expected {rows.size} rows of {info.shape[1:]}")
                if frame is not None:
                    values = as_array(frame, entry)
                    for outs, ids in wants:
                        mine, got = rows, values
                        if len(wants) > 1:
                            keep = np.isin(rows, ids, assume_unique=True)
                            mine, got = rows[keep], values[keep]
                        for o in outs:
                            o.array[mine] = got
        return self._send(Op.ROW_SPARSE_PULL, self._what("row_sparse_pull", [i for i, _ in items]), messages,
                          on_reply=fill, keep=(items, messages), async_op=async_op, then=_finishers(items),
                          priority=priority)

    def set_optimizer(self, optimizer):
        spec = optimizer.spec()
        self._optimizer_generation += 1
        meta = {"generation": self._optimizer_generation, "spec": spec}
        handle = self._node.request_many(
            [(f"S{s}", Header(Op.SET_OPTIMIZER, meta=meta), (), None) for s in range(self._num_servers)],
            f"set_optimizer({spec['name']})")
        handle.wait()

    def set_gradient_compression(self, compression_params):
        """Compress float32 pushes from now on (MXNet's dict form, e.g. {"type": "2bit", "threshold": 0.5});
        see kvps.ps.compression for the types. {"type": "none"} turns it off."""
        self._codec = compression.check(compression_params)
        self._residuals.clear()

    def barrier(self):
        """Wait until every worker reaches the barrier. In async and ssp modes a push is applied on
        arrival, so the pushes of this worker that returned early are waited for first: after the
        barrier every worker's earlier pushes are in (sync pulls wait for their rounds anyway, and
        waiting there for a round that needs a push made after the barrier would never end)."""
        if self.mode != "sync":
            self._wait_returned()
        self._node.barrier("workers")

    def join(self):
        """This worker has no more data (Horovod's join): from now on it counts as pushing zeros into
        every sync round, so the others finish theirs; waits until every worker has joined and
        returns the rank of the last one (the one that trained longest)."""
        self.wait_all()
        self._node.request_many([(f"S{s}", Header(Op.JOIN), (), None) for s in range(self._num_servers)],
                                f"W{self.rank} joining").wait()
        return int(self._node.barrier("workers")[1:])

    def server_stats(self):
        """Each server's counters (pushes, pulls, rounds, kernel calls, ...), by server name.
        Consistency fields: "mode" (wire string), "dropped" (stale pushes dropped, backup workers),
        "ssp_waits" (ssp pulls that waited), "staleness" (histogram: index i counts the pushes applied
        i updates after their worker last pulled the key; kvps.ps.consistency.total_staleness sums them)."""
        stats = {}

        def keep(header, payloads):
            stats[header.src] = header.meta
        self._node.request_many([(f"S{s}", Header(Op.STATS), (), keep) for s in range(self._num_servers)],
                                "server stats").wait()
        return stats

    def _healthy(self):
        return self._node.failure is None


def _finishers(items):
    return [o.finish for _, outs in items for o in outs if o.copy_back]


def _finish(handle, timeout=None):
    return handle.wait(timeout)

