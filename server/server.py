"""The server daemon: a registered node whose ROUTER takes data requests from workers.

Every request is checked in full before anything changes (a bad entry fails the
whole request and loses nothing), then handed to the Store. Replies go out when
the store calls back: at once for async and ssp pushes and plain pulls, when the
round closes for sync pushes, when the slowest worker catches up for ssp pulls.
Values are sent without copying; the store is told, so it does not change a value
zmq is still reading. A job whose consistency mode this server cannot run gets
every request answered with the reason (the server stays up until the job ends).
"""
import logging
import math
import threading

import numpy as np

from kvps import kernels
from kvps.ps import compression
from kvps.errors import KVValueError, NodeFailure, ProtocolError, describe, error_kind
from kvps.wire.membership import Node, advertised_host, parse_name
from kvps.wire.protocol import MAX_ROW_IDS, DType, Entry, Header, Op, as_array, error_header, numpy_dtype, quote
from kvps.wire.throttle import escape

from kvps.ps.store import Store
from kvps.ps.rules import Registry

log = logging.getLogger("kvps.server")

MAX_EARLY = 10_000      # requests held until the job forms; more means a peer misbehaves


class Reply:
    """Collects the per-entry results of one request and sends one reply when all are in."""

    def __init__(self, server, routing_id, header, count, values):
        self.server, self.routing_id, self.header = server, routing_id, header
        self.results = [None] * count
        self.left = count
        self.values = values
        self.error = None
        self.answered = set()
        if count == 0:
            self._finish()

    def callback(self, index):
        def done(result):
            if index in self.answered:
                return  # a pushpull entry can fail twice (push and pull); count it once
            self.answered.add(index)
            if isinstance(result, Exception):
                self.error = self.error or result
            else:
                self.results[index] = result
            self.left -= 1
            if self.left == 0:
                self._finish()
        return done

    def _finish(self):
        server, h = self.server, self.header
        if self.error is not None:
            server.reply_error(self.routing_id, h, self.error)
        elif not self.values:
            server.van.reply(self.routing_id, Header(Op.ACK, h.id, server.name))
        else:
            entries, payloads = [], []
            for request_entry, array in zip(h.keys, self.results):
                entries.append(Entry.of(request_entry.key, request_entry.part, array))
                if array.nbytes:
                    payloads.append(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
            slots = [(e.key, e.part) for e in h.keys]
            server.van.reply(self.routing_id, Header(Op.VALUE, h.id, server.name, entries), payloads,
                             on_tracker=lambda tracker: [server.store.sent(k, p, tracker) for k, p in slots])


class Server(Node):
    """One server of a job; `serve()` runs until the scheduler shuts the job down."""

    def __init__(self, cfg, registry=None):
        super().__init__(cfg, "server")
        self.registry = registry or Registry()
        self.host = advertised_host(cfg)
        self.van.bind(self.host, cfg.port)
        self.store = None
        self.refusal = None                     # why this job cannot be served (its mode), if it cannot
        self.early = []                         # requests that came before the membership table
        self.optimizer = (0, None)              # (generation, spec)
        self.exit_code = None
        self._done = threading.Event()

    def serve(self):
        self.start()
        self._done.wait()
        self.stop()
        return self.exit_code

    # ---- node hooks (I/O thread) ----
    def on_membership(self, meta):
        try:
            self.store = Store(len(meta["workers"]), meta["mode"])
            log.info("%s: consistency %s", self.name, self.store.consistency.wire())
        except (ProtocolError, ValueError) as exc:
            # Not fatal here: every request is answered with the reason, so the workers fail with a
            # clear message, and the scheduler still ends the job when they leave.
            self.refusal = type(exc)(f"{self.name} cannot serve this job: {describe(exc)}")
            log.error("%s", self.refusal)
        # Workers get the table at the same moment we do and may already have sent requests.
        early, self.early = self.early, []
        for request in early:
            self.on_client(*request)

    def on_shutdown(self):
        log.info("%s: shutdown", self.name)
        self._end(0)

    def on_worker_left(self, node):
        role, rank = parse_name(node)
        if self.store is not None and role == "worker":
            self.store.worker_gone(rank, f"worker {node} has left the job (closed its kvstore)")

    def on_failure(self, node, failure):
        role, rank = parse_name(node)
        if role == "scheduler":
            log.error("%s: %s; exiting", self.name, failure)
            self._end(1)
        elif self.store is not None and role == "worker":
            self.store.worker_gone(rank, str(failure))

    def on_io_death(self, failure):
        log.critical("%s: %s; exiting", self.name, failure)
        self._end(1)

    def _end(self, code):
        if self.exit_code is None:
            self.exit_code = code
        self._done.set()

    # ---- requests ----
    def reply_error(self, routing_id, header, exc):
        self.van.reply(routing_id, error_header(header.id, self.name, error_kind(exc), describe(exc)))

    def on_client(self, routing_id, header, payloads):
        try:
            handler = self._handlers[header.op]
        except KeyError:
            return self.reply_error(routing_id, header, ProtocolError(f"a server does not handle {header.op.name}"))
        if self.refusal is not None:
            return self.reply_error(routing_id, header, self.refusal)
        try:
            if self.store is None:
                if len(self.early) >= MAX_EARLY:
                    raise NodeFailure(f"{header.op.name} reached a server before the job formed")
                self.early.append((routing_id, header, payloads))
                return
            worker = self._worker(header.src)
            handler(self, routing_id, header, payloads, worker)
        except Exception as exc:
            self.van.complaints(log, logging.WARNING, "%s: %s from %s refused: %s", self.name, header.op.name,
                                quote(header.src), escape(describe(exc)))
            self.reply_error(routing_id, header, exc)

    def _worker(self, src):
        num = self.store.num_workers
        role, rank = parse_name(src)
        if not (role == "worker" and rank < num):
            raise ProtocolError(f"request from {quote(src)}, which is not one of this job's {num} workers "
                                f"(W0 .. W{num - 1})")
        return rank

    @staticmethod
    def _row_request(header, pairs, once):
        """Refuse a row-sparse request that carries more than MAX_ROW_IDS row ids or (`once`: a
        pull) names a (key, part) twice: with unique ids, a reply is then never bigger than what
        the server holds (a 40 KB request of one row 5,000 times built a 400 MB reply)."""
        seen, total = set(), 0
        for e, ids in pairs:
            if once and (e.key, e.part) in seen:
                raise KVValueError(f"{header.op.name} names key {quote(e.key)} part {e.part} twice; "
                                   f"ask for each part once, with all its rows")
            seen.add((e.key, e.part))
            total += ids.size
        if total > MAX_ROW_IDS:
            raise KVValueError(f"{header.op.name} carries {total} row ids; a request carries at most "
                               f"{MAX_ROW_IDS} (MAX_ROW_IDS)")

    def _arrays(self, header, payloads, need):
        """[(entry, array or None)]; checks each entry's payload is there when `need`."""
        frames = iter(payloads)
        out = []
        for e in header.keys:
            array = as_array(next(frames), e) if e.nbytes else None
            if array is None and need:
                if math.prod(e.shape):      # checked before allocating: the shape is the peer's
                    raise KVValueError(f"{header.op.name} of key {e.key!r} carries no value")
                array = np.empty(e.shape, numpy_dtype(e.dtype))
            out.append((e, array))
        return out

    def _check_all(self, entries):
        for e, _ in entries:
            self.store.check(e.key, e.part, numpy_dtype(e.dtype), e.shape)

    def _init(self, routing_id, header, payloads, worker):
        entries = self._arrays(header, payloads, need=False)
        for e, array in entries:
            if array is None and worker == 0 and math.prod(e.shape) > 0:
                raise KVValueError(f"INIT of key {e.key!r} from rank 0 carries no value")
        reply = Reply(self, routing_id, header, len(entries), values=False)
        for i, (e, array) in enumerate(entries):
            if worker == 0 and array is None:
                array = np.empty(e.shape, numpy_dtype(e.dtype))
            self.store.init(worker, e.key, e.part, numpy_dtype(e.dtype), e.shape,
                            array if worker == 0 else None, reply.callback(i))

    def _push(self, routing_id, header, payloads, worker, then_pull=False):
        entries = self._arrays(header, payloads, need=True)
        codec = header.meta.get("codec")
        if codec is not None:
            entries = [self._decoded(e, array, codec) for e, array in entries]
        self._check_all(entries)
        reply = Reply(self, routing_id, header, len(entries), values=then_pull)
        for i, (e, array) in enumerate(entries):
            done = reply.callback(i)
            if then_pull:
                self.store.push(worker, e.key, e.part, array, lambda r, done=done: r is None or done(r))
                self.store.pull(worker, e.key, e.part, done)
            else:
                self.store.push(worker, e.key, e.part, array, done)

    def _decoded(self, entry, array, codec):
        """A compressed float32 push, decoded into the float32 gradient it stands for."""
        slot = self.store.slot(entry.key, entry.part)
        if slot.dtype != np.float32:
            return entry, array      # only float32 keys are compressed
        grad = compression.decode(codec, array, math.prod(slot.shape), slot.name())
        self.store.stats["decoded"] += 1
        return Entry(entry.key, entry.part, DType.FLOAT32, slot.shape, grad.nbytes), grad.reshape(slot.shape)

    def _pushpull(self, routing_id, header, payloads, worker):
        self._push(routing_id, header, payloads, worker, then_pull=True)

    def _pull(self, routing_id, header, payloads, worker):
        for e in header.keys:
            self.store.slot(e.key, e.part)
        reply = Reply(self, routing_id, header, len(header.keys), values=True)
        for i, e in enumerate(header.keys):
            self.store.pull(worker, e.key, e.part, reply.callback(i))

    def _row_sparse_pull(self, routing_id, header, payloads, worker):
        entries = self._arrays(header, payloads, need=True)
        self._row_request(header, entries, once=True)
        for e, ids in entries:
            self.store.check_rows(self.store.slot(e.key, e.part), ids, unique=True)
        reply = Reply(self, routing_id, header, len(entries), values=True)
        for i, (e, ids) in enumerate(entries):
            self.store.pull(worker, e.key, e.part, reply.callback(i), rows=ids)

    def _row_sparse_push(self, routing_id, header, payloads, worker):
        """Entries in pairs per (key, part): the local row ids (int64), then those rows."""
        entries = self._arrays(header, payloads, need=True)
        if len(entries) % 2:
            raise ProtocolError(f"ROW_SPARSE_PUSH carries (row ids, rows) pairs of entries; got {len(entries)}")
        pairs = list(zip(entries[0::2], entries[1::2]))
        for (ids_entry, ids), (e, rows) in pairs:
            if (ids_entry.key, ids_entry.part) != (e.key, e.part):
                raise ProtocolError(f"ROW_SPARSE_PUSH pairs row ids of key {ids_entry.key!r} with rows of {e.key!r}")
        self._row_request(header, [(ids_entry, ids) for (ids_entry, ids), _ in pairs], once=False)
        for (ids_entry, ids), (e, rows) in pairs:
            self.store.check_sparse(self.store.slot(e.key, e.part), ids, rows)
        reply = Reply(self, routing_id, header, len(pairs), values=False)
        for i, ((_, ids), (e, rows)) in enumerate(pairs):
            self.store.push(worker, e.key, e.part, rows, reply.callback(i), rows=ids)

    def _set_optimizer(self, routing_id, header, payloads, worker):
        generation, spec = header.meta.get("generation"), header.meta.get("spec")
        current, current_spec = self.optimizer
        if not isinstance(generation, int) or generation < 1:
            raise ProtocolError(f"SET_OPTIMIZER generation {generation!r} is not a positive int")
        if generation > current:
            self.store.set_rule(self.registry.create(spec))
            self.optimizer = (generation, spec)
            log.info("%s: optimizer %s", self.name, spec)
        elif generation == current and spec != current_spec:
            raise KVValueError(f"workers set different optimizers: {current_spec} and, from W{worker}, {spec}")
        self.van.reply(routing_id, Header(Op.ACK, header.id, self.name))

    def _join(self, routing_id, header, payloads, worker):
        log.info("%s: W%d joined (it counts as pushing zeros until every worker has joined)", self.name, worker)
        self.store.worker_joined(worker)
        self.van.reply(routing_id, Header(Op.ACK, header.id, self.name))

    def _stats(self, routing_id, header, payloads, worker):
        meta = dict(self.store.stats, kernels=kernels.counters(), backend=kernels.backend(),
                    keys=len(self.store.slots), mode=self.store.consistency.wire())
        self.van.reply(routing_id, Header(Op.STATS, header.id, self.name, meta=meta))

    _handlers = {Op.INIT: _init, Op.PUSH: _push, Op.PULL: _pull, Op.PUSHPULL: _pushpull,
                 Op.ROW_SPARSE_PULL: _row_sparse_pull, Op.ROW_SPARSE_PUSH: _row_sparse_push,
                 Op.SET_OPTIMIZER: _set_optimizer, Op.STATS: _stats,
                 Op.JOIN: _join}
