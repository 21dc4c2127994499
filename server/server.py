"""The server daemon: a registered node whose ROUTER takes data requests from workers.

Every request is checked in full before anything changes (a bad entry fails the
whole request and loses nothing), then handed to the Store. Replies go out when
the store calls back: at once for async and ssp pushes and plain pulls, when the
round closes for sync pushes, when the slowest worker catches up for ssp pulls.
Values are sent without copying; the store is told, so it does not change a value
zmq is still reading. A job whose consistency mode this server cannot run gets
every request answered with the reason (the server stays up until the job ends).

Checkpoints (docs/checkpoint.md): SAVE copies the state (or, for kv.save, holds back what would
change it) and writes a shard on a thread; LOAD reads the rows this server now holds on a thread
and applies them on the I/O thread; a timer of the I/O thread sends their replies.

Each request id from a worker is handled once (kvps/wire/window.py): a resent or duplicated push
gets its first reply again and is never applied twice. In an elastic job (KVPS_ELASTIC) the
scheduler's WORKERS messages remove and add workers: rounds close with the workers that remain,
and a worker that joins takes part from each key's next round (kvps/ps/store.py).

With KVPS_REPLICAS (server/replication.py) each request that changes a key range goes on to the
next server of the range's chain, and its reply waits until that server has applied it too; a
server that dies is replaced in every chain by the next live one (SERVERS from the scheduler). With
one replica in a sync job the copies of pushes go without their values and the head sends each
round's sum instead (ROUND); a worker's request asked again after its head died fills the places
its copy holds (_fill).

A PULL or PUSHPULL with meta["pull"] (compressed pull, docs/compression.md) gets its float32
values compressed when its reply is built, with this server's error feedback per worker, key
and part (kvps.ps.compression.PullEncoder); a refused request moves none of it.
"""
import collections
import logging
import math
import os
import queue
import threading
import time

import numpy as np

from kvps import kernels
from kvps.ps import compression
from kvps.errors import KVPSError, KVValueError, NodeFailure, ProtocolError, describe, error_kind
from kvps.wire.membership import Node, advertised_host, parse_name
from kvps.wire.protocol import (CLOSED, MAX_ROW_IDS, DType, Entry, Header, Op, as_array, dtype_code, error_header,
                                numpy_dtype, quote)
from kvps.wire.shm import MIN_BYTES, Mapped, Reader, ShmRefused, Values
from kvps.wire.throttle import escape
from kvps.wire.window import BUSY, NEW, OLD, RECOMPUTE, Window

from kvps.ps import checkpoint
from kvps.ps.pool import MergePool
from kvps.ps.store import Deferred, Store
from kvps.ps.rules import Registry
from kvps.wire.membership import SCHEDULER
from server import handover
from server.reads import Hold, Reads
from server.replication import Chain
from server.stalls import Stalls

log = logging.getLogger("kvps.server")

MAX_EARLY = 10_000      # requests held until the job forms; more means a peer misbehaves
SAVED_PLACES = 16       # checkpoint places whose last shard a server remembers (a save there may skip its write)
# what waits while a checkpoint is written from the live state (kv.save): whatever would change it
HELD_OPS = frozenset({Op.INIT, Op.PUSH, Op.PUSHPULL, Op.ROW_SPARSE_PUSH, Op.SET_OPTIMIZER, Op.JOIN, Op.LOAD,
                      Op.ROUND})
FROM_SERVERS = frozenset({Op.STATE, Op.ROUND})     # chain replication: sent by a server, not a worker


class Reply:
    """Collects the per-entry results of one request and sends one reply when all are in."""

    def __init__(self, server, routing_id, header, count, values, into=None, reads=None):
        self.server, self.routing_id, self.header = server, routing_id, header
        self.results = [None] * count
        self.left = count
        self.values = values
        self.into = into or {}          # entry index -> shared-memory view its value is copied into
        # how many of the server's value segments the worker has mapped, when it may read its
        # values straight out of them (Server._reads); None: copy them into `into`
        self.reads = reads
        self.error = None
        self.answered = set()
        self.pull = None                # (worker, codec) when the values go back compressed
        self.versions = {}              # entry index -> its slot's version when it was delivered
        self.squeezed = set()           # entry indices sent compressed (not straight from a value)
        # the big values this reply was given stay as they are until it is done with them
        # (server/reads.py); None: the server keeps no value in shared memory
        self.hold = Hold() if values and server.values is not None else None
        if count == 0:
            self._finish()

    def compress(self, worker, codec):
        """Send this reply's float32 values compressed with `codec` (a PULL's meta["pull"]), with
        the server's error feedback for `worker` (kvps.ps.compression.PullEncoder)."""
        if codec is not None:
            self.pull = (worker, codec)

    def callback(self, index):
        def done(result):
            if index in self.answered:
                return  # a pushpull entry can fail twice (push and pull); count it once
            self.answered.add(index)
            if isinstance(result, Exception):
                self.error = self.error or result
            else:
                self.results[index] = result
                if self.hold is not None and type(result) is np.ndarray and result.nbytes >= MIN_BYTES:
                    entry = self.header.keys[index]
                    self.server.store.reading(entry.key, entry.part, result, self.hold)
                if self.pull is not None:
                    entry = self.header.keys[index]
                    self.versions[index] = self.server.store.slot(entry.key, entry.part).version
            self.left -= 1
            if self.left == 0:
                self._finish()
        return done

    def _finish(self):
        server, h = self.server, self.header
        if self.error is not None:
            server.reply_error(self.routing_id, h, self.error)
        elif not self.values:
            server.answer(self.routing_id, h, Header(Op.ACK, h.id, server.name))
        elif self._send_values():
            return                          # its hold ends when the worker has read the values
        if self.hold is not None:
            self.hold.done = True           # sent (zmq's trackers cover what it sends from a value)

    def _send_values(self):
        """Send the VALUE reply; True when it names values in the server's segments."""
        server, h = self.server, self.header
        entries, payloads, shared, placed = [], [], [], []
        for index, (request_entry, array) in enumerate(zip(h.keys, self.results)):
            if self.pull is not None:
                array = self._squeeze(index, request_entry, array)
            view = self.into.get(index) if self.into else None
            if view is not None and index not in self.squeezed and view.nbytes == array.nbytes:
                at = server.values.locate(array) if self.reads is not None else None
                if at is not None and at[0] < self.reads:
                    # the worker copies it out of our segment (kvps/wire/shm.py: Values)
                    entries.append(Entry(request_entry.key, request_entry.part, dtype_code(array.dtype),
                                         array.shape, 0))
                    placed.append([index, *at])
                    continue
                np.copyto(view, np.ascontiguousarray(array).reshape(-1).view(np.uint8))
                entries.append(Entry(request_entry.key, request_entry.part, dtype_code(array.dtype),
                                     array.shape, 0))
                shared.append(index)
                continue
            entries.append(Entry.of(request_entry.key, request_entry.part, array))
            if array.nbytes:
                payloads.append(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
        meta = {"codec": self.pull[1], "delta": self._delta()} if self.pull is not None else {}
        if shared:
            meta["shm"] = shared
        if placed:
            meta["at"] = placed
            # the worker says (meta done) when it has copied them; until then they stay as they are
            meta["read"] = server.reads_of(h.src).issue(self.hold)
            server.placed_entries += len(placed)
        if self.reads is not None and server.values.count > self.reads:
            meta["segments"] = server.values.offers(self.reads)
        reply = Header(Op.VALUE, h.id, server.name, entries, meta or None)
        squeezed, results = self.squeezed, self.results

        def sent_from_values(tracker):      # only a reply big enough to be sent without a copy has one
            # the entries whose payload zmq sends straight from a value (not compressed, not in
            # shared memory): their slots must not change that value until zmq is done with it
            for i, e in enumerate(h.keys):
                if i not in squeezed and entries[i].nbytes:
                    server.store.reading(e.key, e.part, results[i], tracker)
        server.answer(self.routing_id, h, reply, payloads, on_tracker=sent_from_values)
        return bool(placed)

    def _delta(self):
        """What compressed pulls send (kvps.ps.compression): a round's merged update (dist_sync
        without an optimizer: the value itself, error-fed) or, for weights, the change since
        what the worker holds."""
        store = self.server.store
        return not (store.mode == "sync" and store.rule is None)

    def _squeeze(self, index, entry, array):
        """The array to send for entry `index`: compressed when this reply compresses float32 values
        (encoded here, once the reply is sure to go: a refused request moves no error feedback)."""
        if self.pull is None or array.dtype != np.float32 or index not in self.versions:
            return array
        worker, codec = self.pull
        sent = self.server.pulls.encode(worker, (entry.key, entry.part), array, codec, self._delta(),
                                        self.versions[index])
        if sent is not array:
            self.squeezed.add(index)
        return sent


class Server(Node):
    """One server of a job; `serve()` runs until the scheduler shuts the job down."""

    def __init__(self, cfg, registry=None):
        super().__init__(cfg, "server")
        self.registry = registry or Registry()
        self.host = advertised_host(cfg)
        self.van.bind(self.host, cfg.port)
        if cfg.shm:         # co-located workers' lanes come through a local socket (kvps/wire/local.py)
            self.van.listen_local()
        self.store = None
        self.refusal = None                     # why this job cannot be served (its mode), if it cannot
        self.early = []                         # requests that came before the membership table
        self.optimizer = (0, None)              # (generation, spec)
        self.exit_code = None
        self._done = threading.Event()
        self._checkpointing = {}               # save id -> shards of it being written (one per home range)
        self._held = None                      # while one writes the live state: the requests held back
        self._queued_saves = collections.deque()   # SAVEs that came while another save was being written
        self._saved = collections.OrderedDict()     # (path, home range) -> (generation, shard info) last written there
        self._finished = queue.SimpleQueue()   # (routing id, request, result) of those threads
        self._finishing = False                # the I/O-thread timer that takes them is set
        self.window = Window()                  # request ids answered, per worker (resends, duplicates)
        self.shared = {}                        # worker name -> its Mapped shared-memory segments
        self.shared_entries = 0                 # entries whose payload or value went through them
        # the values of big keys in shared segments that co-located workers read pulls out of
        # (Server._reads); None: private memory
        self.values = None
        self.placed_entries = 0                 # reply entries read that way
        self.reading = {}                       # worker name -> server.reads.Reads: which of those it still reads
        if self.telemetry is not None and self.telemetry.metrics is not None:
            self._export(self.telemetry.metrics)
        self.joining = []                       # requests from a worker whose join the scheduler has not told us of
        self.pulls = compression.PullEncoder()  # compressed pulls' error feedback, per worker, key and part
        self.chain = None                       # server.replication.Chain with KVPS_REPLICAS
        self.homes = {}                         # (key, part) -> the home rank of its range (KVPS_REPLICAS)
        self._redirect = {}                     # (client, id) -> (routing id, request): who asked last
        self._ranks = {}                        # worker name -> its rank (names checked once)
        self._sum_readers = {}                  # (server name, pid) -> Reader of its value segments (ROUND)
        # values adopted from those segments: (server name, key, part) -> ROUND id; per
        # ROUND, how many of its sums are values here: (name, id) -> count; and per server, the ROUNDs
        # none of whose sums is any more, for its next answer to say (meta released)
        self.borrowed = {}
        self.lent = {}
        self.released = {}

    def serve(self):
        self.start()
        self._done.wait()
        self.stop()
        if self.values is not None:
            self.values.close()
        return self.exit_code

    # ---- node hooks (I/O thread) ----
    def on_membership(self, meta):
        if meta.get("mode") == "allreduce":     # a ring job (kvps launch starts servers unless -s 0)
            self.refusal = KVPSError(f"{self.name} has nothing to serve: the workers run a ring all-reduce "
                                     f"('allreduce' kvstore)")
            log.info("%s", self.refusal)
        else:
            self._make_store(meta)
        # Workers get the table at the same moment we do and may already have sent requests.
        early, self.early = self.early, []
        for request in early:
            self.on_client(*request)

    def _make_store(self, meta):
        try:
            if self.cfg.replicas:
                if self.cfg.replicas >= len(meta["servers"]):
                    raise ValueError(f"KVPS_REPLICAS={self.cfg.replicas} needs more than "
                                     f"{self.cfg.replicas} servers; the job has {len(meta['servers'])}")
                self.chain = Chain(self)
            self.store = Store(len(meta["workers"]), meta["mode"])
            if self.cfg.server_threads > 1 and self.store.mode == "sync":
                # big sync rounds are merged beside the I/O thread (kvps/ps/pool.py)
                self.store.pool = MergePool(self.cfg.server_threads, self.van.call_soon, self.name)
            log.info("%s: consistency %s%s", self.name, self.store.consistency.wire(),
                     f", {self.cfg.server_threads} merge threads" if self.store.pool is not None else "")
            if self.telemetry is not None:
                self.store.observer = self.telemetry
            if self.cfg.stall_warning > 0 and self.store.mode == "sync":
                stalls = Stalls(self.store, self.name, self.cfg.stall_warning)
                self.van.every(stalls.interval, stalls.check)
            if self.chain is not None and self.cfg.replicas == 1 and not self.cfg.elastic and self.store.mode == "sync":
                # copies without values, one sum a round (server/replication.py)
                self.chain.defer = self.store.deferring = True
                self.store.on_round = self.chain.round
            # values in shared segments: co-located workers read pulls out of them, and, with deferred
            # copies, the next server of a chain reads round sums out of them (server/replication.py)
            if self.cfg.shm:
                # A plain sync round needs a value and a sum buffer; where a value may change while a
                # worker still reads it (server/reads.py), a third block takes the update meanwhile.
                plain = self.store.consistency.wire() == "sync" and not self.cfg.elastic
                self.values = Values(blocks=2 if plain else 3)
                self.store.alloc = lambda slot: self.values.alloc(slot.id, slot.dtype, slot.shape)
                self.store.shared = lambda array: self.values.locate(array) is not None
        except (ProtocolError, ValueError) as exc:
            # Not fatal here: every request is answered with the reason, so the workers fail with a
            # clear message, and the scheduler still ends the job when they leave.
            self.refusal = type(exc)(f"{self.name} cannot serve this job: {describe(exc)}")
            log.error("%s", self.refusal)

    def _on_message(self, source, header, payloads):
        # The replies of the next servers of our chains come on our DEALERs to them.
        if source[0] == "peer" and source[1] != SCHEDULER:
            if self.chain is not None and header.op in (Op.ACK, Op.ERROR):
                return self.chain.acked(source[1], header)
            return self.van.complaints(log, logging.WARNING, "%s: unexpected %s from %s dropped", self.name,
                                       header.op.name, source[1])
        super()._on_message(source, header, payloads)

    def on_servers(self, meta):
        if self.chain is not None:
            self.chain.changed(meta)

    def on_shutdown(self, failed=None):
        if failed:
            log.error("%s: the job failed (%s); exiting", self.name, escape(failed))
        else:
            log.info("%s: shutdown", self.name)
        self._end(1 if failed else 0)

    def on_workers(self, meta):
        """Elastic jobs: the scheduler removed a dead worker, or a new one took a vacant rank."""
        role, rank = parse_name(meta["node"])
        if self.store is None or role != "worker" or rank >= self.store.num_workers:
            return
        self.window.forget(meta["node"])
        self._read_nothing_more(meta["node"])
        self.pulls.forget(rank)
        if meta["change"] == "removed":
            self.store.worker_removed(rank)
        elif meta["change"] == "joined":
            self.store.worker_added(rank)
            joining, self.joining = self.joining, []
            for request in joining:
                self.on_client(*request)

    def on_worker_left(self, node, reason):
        self.shared.pop(node, None)         # its segments go once nothing else maps them
        self._read_nothing_more(node)
        role, rank = parse_name(node)
        if self.store is not None and role == "worker":
            self.pulls.forget(rank)
            if self.cfg.elastic and rank < self.store.num_workers:
                self.store.worker_removed(rank)     # rounds go on without it
            else:
                hint = ""
                if reason == CLOSED and self.store.mode == "sync":
                    # the usual cause: uneven data, one worker's loop ended first
                    hint = ("; workers that run different numbers of steps end with kv.join() "
                            "(docs/consistency.md), which counts them as pushing zeros")
                self.store.worker_gone(rank, f"worker {node} has left the job ({escape(reason)}){hint}")

    def on_failure(self, node, failure):
        role, rank = parse_name(node)
        if role == "scheduler":
            log.error("%s: %s; exiting", self.name, failure)
            self._end(1)
        elif self.store is not None and role == "worker":
            self._read_nothing_more(node)
            self.pulls.forget(rank)
            self.store.worker_gone(rank, str(failure))

    def _read_nothing_more(self, node):
        reads = self.reading.pop(node, None)
        if reads is not None:
            reads.release_all()

    def on_io_death(self, failure):
        log.critical("%s: %s; exiting", self.name, failure)
        self._end(1)

    def _end(self, code):
        if self.exit_code is None:
            self.exit_code = code
        self._done.set()

    # ---- requests ----
    def reply_error(self, routing_id, header, exc):
        self.answer(routing_id, header, error_header(header.id, self.name, error_kind(exc), describe(exc)))

    def answer(self, routing_id, request, reply, payloads=(), on_tracker=None):
        """Send the reply to a request (once the rest of its chain has applied it, KVPS_REPLICAS),
        and remember it (or that it carried values) in the window."""
        if self.chain is not None and self.chain.hold(routing_id, request, reply, payloads, on_tracker):
            return
        self.send_answer(routing_id, request, reply, payloads, on_tracker)

    def send_answer(self, routing_id, request, reply, payloads=(), on_tracker=None):
        client = self._client(request, routing_id)
        silent = False
        if request.op == Op.ROUND:              # its sender's chain hears of it (Chain.round_applied)
            reply.meta = dict(reply.meta or {}, **{"for": request.src})
        elif request.meta.get("chain"):
            reply.meta = dict(reply.meta or {}, **{"for": request.src})
            if request.meta.get("deferred") and self.chain is not None:
                self.chain.places.pop((request.src, request.id), None)
                # the answers to the ROUNDs that brought its sums answer it (server/replication.py)
                silent = reply.op != Op.ERROR
        # values may be big, and change; a PUSHPULL copy along a chain is answered as its push
        recompute = reply.op in (Op.VALUE, Op.STATS) or (request.op == Op.PUSHPULL and reply.op == Op.ACK)
        self.window.answered(client, request.id, RECOMPUTE if recompute else reply)
        if self._redirect:
            asked = self._redirect.pop((client, request.id), None)
            if asked is not None:       # asked again by another (its first asker died): it gets the answer
                routing_id, again = asked
                if request.op == Op.PUSHPULL and reply.op == Op.ACK and not again.meta.get("chain"):
                    return self._again(routing_id, again, (), self._worker(again.src), RECOMPUTE)
                reply, silent = self._for(again, reply), False
        if silent:
            return
        self.van.reply(routing_id, reply, payloads, on_tracker=on_tracker)
        if self.telemetry is not None:      # after the reply went: counting never delays one
            self._observe(request, reply)

    @staticmethod
    def _client(header, routing_id):
        """Whose window a request's id is in: the worker's own connection, or, with KVPS_REPLICAS,
        the worker and key range (its copies along the chain and its resends to a new head are one
        stream of ids)."""
        home = header.meta.get("home")
        return (header.src, routing_id) if home is None else (header.src, "home", home)

    @staticmethod
    def _for(request, reply):
        """`reply` as the answer to `request`: a copy along a chain gets its worker named."""
        chain = bool(request.meta.get("chain"))
        if chain == ("for" in (reply.meta or {})):
            return reply
        meta = {k: v for k, v in (reply.meta or {}).items() if k != "for"}
        if chain:
            meta["for"] = request.src
        return Header(reply.op, reply.id, reply.src, reply.keys, meta or None)

    # ---- metrics and timeline (docs/observability.md; only with KVPS_METRICS_PORT or KVPS_TIMELINE) ----
    def _export(self, metrics):
        """The store's own counters, read at scrape time (they cost the message path nothing)."""
        from kvps.metrics import catalog
        from kvps.metrics.registry import histogram_from_counts

        def stat(name):
            return lambda: {(): self.store.stats[name]}
        for metric, name in (("kvps_server_pushed_bytes_total", "bytes_in"), ("kvps_server_pulled_bytes_total",
                             "bytes_out"), ("kvps_server_rounds_total", "rounds"), ("kvps_server_updates_total",
                             "updates"), ("kvps_server_dropped_pushes_total", "dropped"),
                             ("kvps_server_ssp_waits_total", "ssp_waits")):
            metrics.derive(metric, stat(name))
        metrics.derive("kvps_server_entries_total",
                       lambda: {("push",): self.store.stats["pushes"], ("pull",): self.store.stats["pulls"]})
        metrics.derive("kvps_server_staleness", lambda: {(): histogram_from_counts(
            list(self.store.stats["staleness"]), catalog.STALENESS_BUCKETS)})
        metrics.derive("kvps_server_kernel_calls_total",
                       lambda: {(kernels.backend(), op): n for op, n in kernels.counters().items()})
        metrics.derive("kvps_server_keys", lambda: {(): len(self.store.slots)})
        metrics.derive("kvps_server_open_rounds",
                       lambda: {(): sum(1 for slot in list(self.store.slots.values()) if slot.in_round)})
        metrics.derive("kvps_server_waiting_pulls",
                       lambda: {(): sum(len(slot.pull_waiters) for slot in list(self.store.slots.values()))})
        metrics.derive("kvps_server_key_bytes_total", self.telemetry.top_keys)

    def _observe(self, request, reply):
        if request.arrived is not None:
            self.telemetry.request_done(request, request.arrived)
        if self.telemetry.metrics is not None and reply.op != Op.ERROR:    # a refused key is no key of ours
            back = reply.keys if reply.op == Op.VALUE else ()
            if len(back) == len(request.keys):      # a reply's entries answer the request's, in order
                for e, r in zip(request.keys, back):
                    self.telemetry.key_bytes(e.key, e.nbytes + r.nbytes)
                return
            for e in request.keys:
                self.telemetry.key_bytes(e.key, e.nbytes)
            for e in back:
                self.telemetry.key_bytes(e.key, e.nbytes)

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
            if self._held is not None and header.op in HELD_OPS:
                if len(self._held) >= MAX_EARLY:
                    raise KVValueError(f"{header.op.name} refused: {self.name} is writing a checkpoint and "
                                       f"already holds {MAX_EARLY} requests back")
                self._held.append((routing_id, header, payloads))
                return
            if header.op in FROM_SERVERS:
                return handler(self, routing_id, header, payloads)
            worker = self._worker(header.src)
            if worker in self.store.removed:
                # A worker joining an elastic job: its requests may overtake the scheduler's news.
                if len(self.joining) >= MAX_EARLY:
                    raise NodeFailure(f"{header.op.name} from W{worker}, which is not in the job")
                self.joining.append((routing_id, header, payloads))
                return
            done = header.meta.get("done")
            if done:                # replies whose values it has copied out of our segments
                self.reads_of(header.src).done(done)
            client = self._client(header, routing_id)
            state = self.window.admit(client, header.id)
            if state is not NEW:
                return self._again(routing_id, header, payloads, worker, state, client)
            if self.telemetry is not None:
                header.arrived = time.time()
            if self.chain is None:
                return handler(self, routing_id, header, payloads, worker)
            self._replicated(handler, routing_id, header, payloads, worker)
        except Exception as exc:
            self.van.complaints(log, logging.WARNING, "%s: %s from %s refused: %s", self.name, header.op.name,
                                quote(header.src), escape(describe(exc)))
            self.reply_error(routing_id, header, exc)

    def _replicated(self, handler, routing_id, header, payloads, worker):
        """Handle a request of a replicated job: note its slots' range, copy it to the next server of
        that range's chain once this one took it (server/replication.py)."""
        home = header.meta.get("home")
        if home is not None:
            if not 0 <= home < self.chain.num_servers:
                raise ProtocolError(f"{header.op.name} meta home {home} is not a server rank")
            if header.op == Op.INIT:
                for e in header.keys:
                    self.homes[(e.key, e.part)] = home
        fwd = self.chain.begin(header, payloads)
        self.chain.handle(fwd, lambda: handler(self, routing_id, header, payloads, worker))

    def _again(self, routing_id, header, payloads, worker, state, client=None):
        """A request id seen before: drop it (BUSY, OLD), answer it again with its reply, or
        recompute a reply with values (a PUSHPULL's push is not applied again: only its pull runs).
        With KVPS_REPLICAS a request asked again while BUSY is answered to its latest asker (the
        first may have died: a worker's old head, an upstream server), and a copy along a chain is
        answered with an ACK whatever the first asker got (it only asks whether it was applied)."""
        chain = header.meta.get("chain")
        if self.chain is not None and state is BUSY:
            self._redirect[(client, header.id)] = (routing_id, header)
            if not chain and self.chain.places:
                self._fill(header, payloads)        # may close its rounds: the answer goes to the asker
            return
        if chain and state is not BUSY:
            if state is OLD or state is RECOMPUTE or not isinstance(state, Header):
                state = Header(Op.ACK, header.id, self.name)
            return self.van.reply(routing_id, self._for(header, state))
        if state is BUSY or state is OLD:
            return
        if state is RECOMPUTE:
            handler = Server._pull if header.op == Op.PUSHPULL else self._handlers[header.op]
            if "into" in header.meta:
                # Its values travel inline: the worker may have had the first reply and be reading
                # the next one out of the same shared-memory region already (kvps/wire/shm.py).
                header = Header(header.op, header.id, header.src, header.keys,
                                {k: v for k, v in header.meta.items() if k != "into"})
            return handler(self, routing_id, header, payloads, worker)
        self.van.reply(routing_id, self._for(header, state) if self.chain is not None else state)

    def reads_of(self, name):
        """The Reads of worker `name` (server/reads.py)."""
        reads = self.reading.get(name)
        if reads is None:
            reads = self.reading[name] = Reads(name)
        return reads

    def _worker(self, src):
        num = self.store.num_workers
        rank = self._ranks.get(src)
        if rank is not None and rank < num:
            return rank
        role, rank = parse_name(src)
        if role == "worker" and rank < num:
            self._ranks[src] = rank         # a valid name only: at most num_workers entries
            return rank
        raise ProtocolError(f"request from {quote(src)}, which is not one of this job's {num} workers "
                            f"(W0 .. W{num - 1})")

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
        """[(entry, array or None)]; checks each entry's payload is there when `need`. A payload in
        shared memory is a view of the worker's segment (kvps/wire/shm.py)."""
        frames = iter(payloads)
        shared = self._shared(header, "shm")
        out = []
        for index, e in enumerate(header.keys):
            view = shared.get(index)
            if view is not None:
                out.append((e, view.view(numpy_dtype(e.dtype)).reshape(e.shape)))
                continue
            array = as_array(next(frames), e) if e.nbytes else None
            if array is None and need:
                if math.prod(e.shape):      # checked before allocating: the shape is the peer's
                    raise KVValueError(f"{header.op.name} of key {e.key!r} carries no value")
                array = np.empty(e.shape, numpy_dtype(e.dtype))
            out.append((e, array))
        return out

    def _shared(self, header, field):
        """{entry index: np.uint8 view} of the shared-memory regions a request's meta names in
        `field` ("shm": its payloads, "into": where its values go), each checked against its entry."""
        named = header.meta.get(field)
        if not named:
            return {}
        mapped = self.shared.get(header.src)
        if mapped is None:
            raise ProtocolError(f"{header.op.name} from {quote(header.src)} names shared memory it never attached")
        views = {}
        for index, segment, offset in named:
            if not 0 <= index < len(header.keys) or index in views:
                raise ProtocolError(f"{header.op.name} meta {field} names entry {index} of {len(header.keys)}")
            e = header.keys[index]
            if field == "shm" and e.nbytes:
                raise ProtocolError(f"{header.op.name} entry {index} has a payload frame and shared memory")
            nbytes = math.prod(e.shape) * numpy_dtype(e.dtype).itemsize
            try:
                views[index] = mapped.view(segment, offset, nbytes)
            except ShmRefused as exc:
                raise ProtocolError(f"{header.op.name} of key {quote(e.key)}: {exc}") from None
        self.shared_entries += len(views)
        return views

    def _attach(self, routing_id, header, payloads, worker):
        """Map a co-located worker's segment (kvps/wire/shm.py); ERROR tells it to use TCP."""
        host, _, pid = self.membership["workers"][worker][:3]
        meta = header.meta
        if meta["pid"] != pid:
            raise ShmRefused(f"ATTACH names pid {meta['pid']}; W{worker} registered as pid {pid}")
        if host != self.host or not self.cfg.shm:
            raise ShmRefused(f"W{worker} is on {host}, this server on {self.host}" if self.cfg.shm
                             else f"{self.name} has shared memory off (KVPS_SHM=0)")
        mapped = self.shared.setdefault(header.src, Mapped(pid))
        mapped.attach(meta["fd"], meta["segment"], meta["nonce"])
        self.answer(routing_id, header, Header(Op.ACK, header.id, self.name))

    def _reads(self, header, into):
        """How many of our value segments a co-located worker has mapped (its request's "mapped"),
        when its reply may name values in them instead of copying them into `into` (the request's
        reply regions); else None. No value it reads changes until it says it is done with it
        (server/reads.py)."""
        claim = header.meta.get("mapped")
        if not into or claim is None or self.values is None:
            return None
        if claim < 0:
            raise ProtocolError(f"{header.op.name} meta mapped={claim} is negative (segments mapped: 0 or more)")
        return claim

    def _check_all(self, entries):
        for e, _ in entries:
            self.store.check(e.key, e.part, numpy_dtype(e.dtype), e.shape)

    def _init(self, routing_id, header, payloads, worker):
        entries = self._arrays(header, payloads, need=False)
        # A bare INIT from rank 0 is a worker that joined a running elastic job: it waits like any other.
        held = {(e.key, e.part) for e, _ in entries
                if getattr(self.store.slots.get((e.key, e.part)), "value", None) is not None}
        for e, array in entries:
            if array is None and worker == 0 and math.prod(e.shape) > 0 and (e.key, e.part) not in held:
                raise KVValueError(f"INIT of key {e.key!r} from rank 0 carries no value")
        reply = Reply(self, routing_id, header, len(entries), values=False)
        for i, (e, array) in enumerate(entries):
            if worker == 0 and array is None and (e.key, e.part) not in held:
                array = np.empty(e.shape, numpy_dtype(e.dtype))
            self.store.init(worker, e.key, e.part, numpy_dtype(e.dtype), e.shape,
                            array if worker == 0 else None, reply.callback(i))

    def _push(self, routing_id, header, payloads, worker, then_pull=False):
        if header.meta.get("deferred"):
            return self._deferred(routing_id, header, worker)
        entries = self._arrays(header, payloads, need=True)
        codec = header.meta.get("codec")
        if codec is not None:
            entries = [self._decoded(e, array, codec) for e, array in entries]
        self._check_all(entries)
        into = self._shared(header, "into") if then_pull else None
        reply = Reply(self, routing_id, header, len(entries), values=then_pull, into=into,
                      reads=self._reads(header, into))
        if then_pull:
            reply.compress(worker, header.meta.get("pull"))
        for i, (e, array) in enumerate(entries):
            done = reply.callback(i)
            if then_pull:
                self.store.push(worker, e.key, e.part, array, lambda r, done=done: r is None or done(r))
                self.store.pull(worker, e.key, e.part, done)
            else:
                self.store.push(worker, e.key, e.part, array, done)

    def _deferred(self, routing_id, header, worker):
        """A copy of a push without its values (server/replication.py): each entry holds its place in
        its round as a Deferred, which the round's sum (ROUND) or the worker's values (_fill) complete."""
        if not (self.chain is not None and self.chain.defer and header.meta.get("chain")):
            raise ProtocolError(f"{header.op.name} from {quote(header.src)} defers its values; only a copy along "
                                f"the chain of a sync job with one replica does")
        if header.meta.get("codec") is not None or any(e.nbytes for e in header.keys):
            raise ProtocolError(f"a deferred {header.op.name} carries values")
        for e in header.keys:
            self.store.check(e.key, e.part, numpy_dtype(e.dtype), e.shape)
        reply = Reply(self, routing_id, header, len(header.keys), values=False)
        places = self.chain.places[(header.src, header.id)] = []
        for i, e in enumerate(header.keys):
            place = Deferred()
            places.append((e.key, e.part, place))
            self.store.push(worker, e.key, e.part, place, reply.callback(i))

    def _fill(self, header, payloads):
        """A worker asks again for a request whose copy holds places here without values: the head it
        first went to died, and this server is now the head of the range. Its values fill them."""
        places = self.chain.places.get((header.src, header.id))
        if not places or header.op not in (Op.PUSH, Op.PUSHPULL):
            return
        entries = self._arrays(header, payloads, need=True)
        codec = header.meta.get("codec")
        if codec is not None:
            entries = [self._decoded(e, array, codec) for e, array in entries]
        values = {(e.key, e.part): array for e, array in entries}
        filled = 0
        for key, part, place in places:
            array = values.get((key, part))
            if array is not None and place.array is None:
                self.store.fill(key, part, place, array)
                filled += 1
        log.info("%s: %s asked again for request %d, whose copy came without values: %d filled", self.name,
                 header.src, header.id, filled)

    def _round(self, routing_id, header, payloads):
        """ROUND: the sums of sync rounds that the server before this one in the chain closed, for
        the rounds that the copies of their pushes opened here (server/replication.py). Sums that
        lie in the sender's value segments are read there: without an update rule each becomes the
        key's value as it is (the store adopts it, no copy), else the rule reads it. The answer
        says they are applied, so the sender answers the workers whose pushes they hold (their
        copies get no answer of their own), and which earlier ROUNDs' memory no value here is any
        more (released), so the sender may write it again. Or it says that those in the sender's
        memory could not be read, and the sender sends them inline."""
        role, _ = parse_name(header.src)
        if self.chain is None or not self.chain.defer or role != "server":
            raise ProtocolError(f"ROUND from {quote(header.src)}: only a server of a sync job with one replica "
                                f"sends it")
        rounds, count = header.meta["rounds"], len(header.keys)
        if len(rounds) != count:
            raise ProtocolError(f"ROUND from {quote(header.src)} has {count} entries and {len(rounds)} rounds")
        places = {}
        for index, segment, offset in header.meta.get("at", ()):
            if not 0 <= index < count or index in places or header.keys[index].nbytes:
                raise ProtocolError(f"ROUND meta at names entry {index} of {count}, twice or with a payload")
            places[index] = (segment, offset)
        views, why = self._sums_shared(header, places)
        frames = iter(payloads)
        adopted = 0
        for index, e in enumerate(header.keys):
            slot = self.store.slots.get((e.key, e.part))
            before = slot.value if slot is not None else None
            if index not in places:
                total = as_array(next(frames), e) if e.nbytes else np.empty(e.shape, numpy_dtype(e.dtype))
                adopt = self.store.round_sum(e.key, e.part, rounds[index], total)
            elif why is not None:
                continue                    # the sender sends it again, inline
            else:
                adopt = self.store.round_sum(e.key, e.part, rounds[index], views[index], adopt=True)
            if slot is not None and slot.value is not before:
                # the value it replaced may have been an earlier sum of the sender's: it may have it back
                self._give_back(header.src, self.borrowed.pop((header.src, e.key, e.part), None))
            if adopt:
                self.borrowed[(header.src, e.key, e.part)] = header.id
                adopted += 1
        if adopted:
            self.lent[(header.src, header.id)] = adopted
        released = self.released.pop(header.src, [])
        if places and not adopted:
            released.append(header.id)
        meta = {"for": header.src}
        if released:
            meta["released"] = released
        if why is not None:
            meta["inline"] = True
            self.van.complaints(log, logging.WARNING, "%s: cannot read %s's round sums in shared memory (%s); "
                                "asking for them inline", self.name, header.src, escape(why))
        self.van.reply(routing_id, Header(Op.ACK, header.id, self.name, meta=meta))

    def _give_back(self, server, sum_id):
        """A value that was a sum of ROUND `sum_id` (or None) in the memory of server `server` (its
        name) is no longer one: once none of that ROUND's sums is, the next answer to it says so."""
        left = self.lent.get((server, sum_id))
        if left is None:
            return
        if left > 1:
            self.lent[(server, sum_id)] = left - 1
        else:
            del self.lent[(server, sum_id)]
            self.released.setdefault(server, []).append(sum_id)

    def _sums_shared(self, header, places):
        """({entry index: read-only view} of a ROUND's sums in its sender's value segments, None),
        or ({}, why they cannot be read there); all or none, so nothing here refers to memory that
        the sender is told to send again."""
        if not places:
            return {}, None
        reader, why = self._sum_reader(header)
        if why is not None:
            return {}, why
        views = {}
        for index, (segment, offset) in places.items():
            e = header.keys[index]
            dtype = numpy_dtype(e.dtype)
            try:
                views[index] = reader.view(segment, offset, math.prod(e.shape) * dtype.itemsize).view(dtype).reshape(e.shape)
            except ShmRefused as exc:
                # for good: a later sum read here while this one goes inline would come first
                reader.refused = str(exc)
                return {}, reader.refused
        return views, None

    def _sum_reader(self, header):
        """(Reader of the sender's value segments, after mapping those a ROUND offers; why they
        cannot be read, or None)."""
        rank = parse_name(header.src)[1]
        if rank >= len(self.membership["servers"]):
            raise ProtocolError(f"ROUND from {quote(header.src)}, which is not one of this job's servers")
        host, _, pid = self.membership["servers"][rank]
        reader = self._sum_readers.get((header.src, pid))
        if reader is None:
            reader = self._sum_readers[(header.src, pid)] = Reader(header.src, pid)
        reader.offered(header.meta.get("segments", ()))
        return reader, reader.refused if host == self.host else f"{header.src} is on {host}, this server on {self.host}"

    def _decoded(self, entry, array, codec):
        """A compressed float32 push, decoded into the float32 gradient it stands for."""
        slot = self.store.slot(entry.key, entry.part)
        if slot.dtype != np.float32:
            return entry, array      # only float32 keys are compressed
        grad = compression.decode(codec, array, math.prod(slot.shape), slot.name())
        self.store.stats["decoded"] += 1
        return Entry(entry.key, entry.part, DType.FLOAT32, slot.shape, grad.nbytes), grad.reshape(slot.shape)

    def _pushpull(self, routing_id, header, payloads, worker):
        # a copy along a chain (KVPS_REPLICAS) is applied as its push: only the head's worker pulls
        self._push(routing_id, header, payloads, worker, then_pull=not header.meta.get("chain"))

    def _pull(self, routing_id, header, payloads, worker):
        for e in header.keys:
            self.store.slot(e.key, e.part)
        into = self._shared(header, "into")
        reply = Reply(self, routing_id, header, len(header.keys), values=True, into=into,
                      reads=self._reads(header, into))
        reply.compress(worker, header.meta.get("pull"))
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
        self.answer(routing_id, header, Header(Op.ACK, header.id, self.name))

    def _join(self, routing_id, header, payloads, worker):
        log.info("%s: W%d joined (it counts as pushing zeros until every worker has joined)", self.name, worker)
        self.store.worker_joined(worker)
        self.answer(routing_id, header, Header(Op.ACK, header.id, self.name))

    def _stats(self, routing_id, header, payloads, worker):
        meta = dict(self.store.stats, kernels=kernels.counters(), backend=kernels.backend(),
                    keys=len(self.store.slots), mode=self.store.consistency.wire(),
                    duplicates=self.window.duplicates, shared=self.shared_entries, placed=self.placed_entries,
                    local_clients=self.van.local_clients(),
                    forwarded=self.chain.forwarded if self.chain is not None else 0,
                    round_sums=self.chain.rounds if self.chain is not None else 0,
                    round_sums_shared=self.chain.rounds_shared if self.chain is not None else 0)
        self.answer(routing_id, header, Header(Op.STATS, header.id, self.name, meta=meta))

    def _take_over(self, routing_id, header, payloads):
        """STATE: this server joined a chain's tail and its old tail hands it the state (server/handover.py)."""
        role, _ = parse_name(header.src)
        if self.chain is None or role != "server":
            raise ProtocolError(f"STATE from {quote(header.src)}: only a server of a replicated job sends it")
        handover.take(self, header, payloads)

    # ---- checkpoints (kvps/ps/checkpoint.py; docs/checkpoint.md) ----
    def _save(self, routing_id, header, payloads, worker):
        """Copy the state now (the only pause: training goes on while a thread writes the copy)."""
        path, save_id, home = header.meta["path"], header.meta["save"], header.meta.get("home")
        name = f"{save_id}.S{self.rank if home is None else home}.safetensors"
        if not checkpoint.SHARD.fullmatch(name):
            raise KVValueError(f"SAVE id {quote(save_id)} is not 1 to 64 letters, digits, '-' or '_'")
        if self._checkpointing and save_id not in self._checkpointing:
            # Another save is being written (every worker calling kv.save_optimizer_states, say):
            # this one starts when it is done, so two copies of the state are never held at once.
            if len(self._queued_saves) >= MAX_EARLY:
                raise KVValueError(f"{self.name} is writing a checkpoint and already has {MAX_EARLY} more waiting")
            self._queued_saves.append((routing_id, header, payloads, worker))
            return
        if header.meta.get("taken"):
            # The fence a periodic checkpoint sends after its SAVE on the same connection (the saving
            # worker's next push may take another one): that save has taken its copy, or was queued
            # before this and has now.
            self.answer(routing_id, header, Header(Op.ACK, header.id, self.name))
            return
        hold = header.meta.get("hold", False)

        def export(copy):
            records = self.store.export(copy)
            if home is None:
                return records
            # KVPS_REPLICAS: this range's shard only (replicas hold others)
            return [r for r in records if self.homes.get((r["key"], r["part"]), self.rank) == home]
        records = export(copy=False)
        place, generation = (path, home), checkpoint.generation(self.store.changes, records)
        last = self._saved.get(place)
        if last is not None and last[0] == generation and os.path.exists(os.path.join(path, last[1]["file"])):
            # Nothing changed since this server wrote its shard there: every worker of a dist_sync job
            # calling kv.save at the same step boundary costs one write, not one each.
            self.answer(routing_id, header, Header(Op.ACK, header.id, self.name, meta=last[1]))
            return
        if not hold:                # the copy a thread writes while training goes on
            records = export(copy=True)
        tensors, slots = checkpoint.pack(records)
        self._checkpointing[save_id] = self._checkpointing.get(save_id, 0) + 1
        if hold and self._held is None:
            self._held = []         # requests that would change the arrays being written wait here
        self._background(routing_id, header, lambda: self._write(place, name, tensors, slots, generation))

    def _write(self, place, name, tensors, slots, generation):
        """On a thread: write the shard, and note what it holds before the I/O thread learns it is
        written (and starts the saves queued behind it, which may find nothing changed)."""
        path = place[0]
        os.makedirs(path, exist_ok=True)
        info = checkpoint.write_shard(path, name, tensors, slots)
        log.info("%s: wrote %s (%d slots, %d bytes)", self.name, name, len(slots), info["bytes"])
        self._saved[place] = (generation, info)
        if len(self._saved) > SAVED_PLACES:
            self._saved.popitem(last=False)     # one C call each: safe beside the I/O thread's reads
        return lambda: Header(Op.ACK, meta=info)

    def _load(self, routing_id, header, payloads, worker):
        """Check the entries now, read the files on a thread, apply on this one when read."""
        path, rows, what = header.meta["path"], header.meta["rows"], header.meta["what"]
        if what not in ("all", "values", "optimizer"):
            raise ProtocolError(f"LOAD what={quote(what)} is not 'all', 'values' or 'optimizer'")
        if len(rows) != len(header.keys):
            raise ProtocolError(f"LOAD has {len(header.keys)} entries and {len(rows)} row starts")
        entries = [(e, numpy_dtype(e.dtype), start) for e, start in zip(header.keys, rows)]
        for e, dtype, _ in entries:
            self.store.check_restore(e.key, e.part, e.shape, dtype, idle=what != "optimizer")
        self._background(routing_id, header, lambda: self._read(path, entries, what))

    def _read(self, path, entries, what):
        manifest = checkpoint.read_manifest(path)
        gather = checkpoint.Gather(manifest)
        states = [checkpoint.slot_state(gather, e.key, e.shape, dtype, start, what) for e, dtype, start in entries]
        same = (manifest.get("num_workers"), manifest.get("mode")) == \
            (self.store.num_workers, self.store.consistency.wire())
        saved_rule = (manifest.get("optimizer") or {}).get("name")

        def apply():            # on the I/O thread: the store is only ever touched there
            slots = [self.store.check_restore(e.key, e.part, e.shape, dtype, idle=what != "optimizer")
                     for e, dtype, _ in entries]
            if what == "values":        # the weights only: the optimizer starts afresh on them
                self.store.restore_optimizer({slot.id: None for slot in slots}, (path, None))
            else:
                self.store.restore_optimizer({slot.id: opt for slot, (_, opt, _) in zip(slots, states)},
                                             (path, saved_rule))
            if what != "optimizer":
                for slot, (value, _, counters) in zip(slots, states):
                    self.store.restore(slot, value, counters, same)
            log.info("%s: loaded %d slots from %s", self.name, len(slots), path)
            return Header(Op.ACK)
        return apply

    def _background(self, routing_id, header, work):
        """Run work() on a thread; what it returns (a function giving the reply Header) then runs
        on the I/O thread, which sends the reply (or an ERROR naming what failed)."""
        if not self._finishing:
            self.van.every(0.02, self._finish_background)
            self._finishing = True

        def run():
            try:
                result = work()
            except Exception as exc:
                result = exc
            self._finished.put((routing_id, header, result))
        threading.Thread(target=run, name=f"{self.name}-checkpoint", daemon=True).start()

    def _finish_background(self):
        while not self._finished.empty():
            routing_id, header, result = self._finished.get()
            if header.op == Op.SAVE:
                save_id = header.meta["save"]
                self._checkpointing[save_id] -= 1
                if not self._checkpointing[save_id]:
                    del self._checkpointing[save_id]
                    held, self._held = self._held, None
                    for request in held or ():
                        self.on_client(*request)
                    self._start_queued_saves()
            try:
                if isinstance(result, Exception):
                    raise result
                reply = result()
                reply.id, reply.src = header.id, self.name
                self.answer(routing_id, header, reply)
            except Exception as exc:
                log.warning("%s: %s failed: %s", self.name, header.op.name, escape(describe(exc)))
                self.reply_error(routing_id, header, exc)

    def _start_queued_saves(self):
        """Start the saves that waited for the one just written (those of one save id together)."""
        while self._queued_saves:
            routing_id, header, payloads, worker = self._queued_saves[0]
            if self._checkpointing and header.meta["save"] not in self._checkpointing:
                return
            self._queued_saves.popleft()
            try:
                self._save(routing_id, header, payloads, worker)
            except Exception as exc:
                log.warning("%s: SAVE from %s refused: %s", self.name, quote(header.src), escape(describe(exc)))
                self.reply_error(routing_id, header, exc)

    _handlers = {Op.INIT: _init, Op.PUSH: _push, Op.PULL: _pull, Op.PUSHPULL: _pushpull,
                 Op.ROW_SPARSE_PULL: _row_sparse_pull, Op.ROW_SPARSE_PUSH: _row_sparse_push,
                 Op.SET_OPTIMIZER: _set_optimizer, Op.STATS: _stats,
                 Op.JOIN: _join, Op.SAVE: _save, Op.LOAD: _load, Op.ATTACH: _attach, Op.STATE: _take_over,
                 Op.ROUND: _round}
