"""The distributed kvstore: one worker of a parameter-server job (dist_sync, dist_async, dist_ssp).

Each call is checked against what init declared, split into per-server
requests (one message per server, carrying every key and part it holds), and
sent by the node's I/O thread. Replies are written into the caller's arrays on
that thread. The worker finds the scheduler through KVPS_SCHEDULER (or MXNet's
DMLC_PS_ROOT_URI / DMLC_PS_ROOT_PORT) and leaves the job on close() or exit.
"""
import collections
import functools
import logging
import math
import numbers
import os
import time
import warnings
import weakref

import numpy as np

from kvps.arrays import copy_into
from kvps.ps import compression, sharding
from kvps.config import Config
from kvps.ps.consistency import Consistency
from kvps.errors import KVPSError, KVTimeoutError, NodeFailure, PerformanceWarning, ProtocolError, describe
from kvps.wire.requests import Handle, remember
from kvps.kvstore.base import KeyInfo, KVStore
from kvps.kvstore.checkpointer import Checkpointer
from kvps.kvstore.coalesce import Batch, Coalescer, Joined
from kvps.kvstore.order import Order
from kvps.kvstore.pull_ahead import PullAhead, Stash
from kvps.wire.lane import Lanes
from kvps.wire.membership import Worker
from kvps.wire.shm import LINK_META, MIN_BYTES, Arena, Reader, ShmRefused, inlined
from kvps.wire.protocol import MAX_ENTRIES, MAX_ROW_IDS, Entry, Header, Op, as_array, dtype_code, entries, numpy_dtype

log = logging.getLogger("kvps.worker")


def _bytes(array):
    """A zero-copy byte view of a contiguous array (works for every dtype, bfloat16 too)."""
    return memoryview(array.reshape(-1).view(np.uint8))


SHM_MESSAGES = 16     # a message to a server through shared memory carries 16x KVPS_MESSAGE_BYTES
LANE_OPS = frozenset({Op.PUSH, Op.PULL, Op.PUSHPULL, Op.ROW_SPARSE_PUSH, Op.ROW_SPARSE_PULL})
DATA_OPS = frozenset({Op.PUSH, Op.PULL, Op.PUSHPULL})     # the requests that tell a server which values were read
_AUTO = object()      # _send: choose the way (lane or I/O thread) there
COLLECTIVE_HINT_S = 10.0      # a collective waiting this long for the other workers says what it waits for


class Messages:
    """A call's requests: per server, entries gathered into messages of about `limit` bytes, so a
    server can work on (and answer) the first ones while the rest are still on the wire, and of at
    most MAX_ENTRIES entries, which is all a server decodes."""

    def __init__(self, limit, meta=None):
        self.limit = limit           # bytes, or a function of the server giving them
        self.meta = meta or {}       # sent in every message's header
        self._open = {}              # server -> [entries, payloads, bytes, shared-memory meta]
        self._all = []               # (server, message) in the order they were opened
        self.regions = []            # shared-memory regions the messages use (busy until the call is done)
        self.heads = {}              # server -> the server whose shared memory its messages name (Region.owner)

    def add(self, server, entry, payload, size, shm=None, into=None):
        """shm: the Region holding the entry's payload (then `payload` is None and the entry's
        nbytes 0); into: the Region the server is to write the entry's value into."""
        for region in (shm, into):
            if region is not None:
                self.regions.append(region)
        if shm is not None and self.heads.setdefault(server, shm.owner) != shm.owner:
            # (a server died between two parts: the regions are in two servers' memory) inline
            entry, payload, shm = Entry(*entry[:4], shm.nbytes), shm.view, None
        if into is not None and self.heads.setdefault(server, into.owner) != into.owner:
            into = None
        message = self.add_group(server, [(entry, payload, size)])
        index = len(message[0]) - 1
        for field, region in (("shm", shm), ("into", into)):
            if region is not None:
                message[3].setdefault(field, []).append([index, region.segment, region.offset])

    def add_group(self, server, items):
        """Entries [(entry, payload or None, size)] that must travel in one message; returns it."""
        total = sum(size for _, _, size in items)
        message = self._open.get(server)
        limit = self.limit(server) if callable(self.limit) else self.limit
        if message is None or (message[2] and message[2] + total > limit) or \
                len(message[0]) + len(items) > MAX_ENTRIES:
            message = self._open[server] = [[], [], 0, {}]
            self._all.append((server, message))
        for entry, payload, _ in items:
            message[0].append(entry)
            if payload is not None:
                message[1].append(payload)
        message[2] += total
        return message

    @property
    def nbytes(self):
        """The bytes the messages carry (or, for pulls, ask for)."""
        return sum(message[2] for _, message in self._all)

    def __iter__(self):
        return ((server, entries, payloads, dict(self.meta, **shared))
                for server, (entries, payloads, _, shared) in self._all)


class _What:
    """What a call is, for its errors ("push of keys 'a', 'b' and 3 more"): written out only when
    printed, so a call that succeeds (nearly all) makes one small object instead of the text.
    `infos`: KeyInfos, or (KeyInfo, value) pairs."""
    __slots__ = ("op", "infos")

    def __init__(self, op, infos):
        self.op, self.infos = op, infos

    def __str__(self):
        infos = [i[0] if type(i) is tuple else i for i in self.infos]
        keys = [repr(i.key) for i in infos[:4]]
        more = f" and {len(infos) - 4} more" if len(infos) > 4 else ""
        return f"{self.op} of key{'s' if len(infos) > 1 else ''} {', '.join(keys)}{more}"

    __repr__ = __str__


class _SoloCalls:
    """Blocking pushpulls of one key each, one after another: each waits for its round trip, where
    MXNet's engine overlaps them (Gluon's Trainer calls pushpull per parameter). After HINT of them in
    a row, of more than one key, kvps says once how to overlap them; `quiet`: not here (the workers
    but the first, which run the same script)."""
    HINT = 64
    __slots__ = ("key", "run", "said")

    def __init__(self, quiet=False):
        self.key, self.run, self.said = None, 0, quiet

    def note(self, key):
        if self.said:
            return
        if isinstance(key, (list, tuple)):
            self.run = 0
            return
        if key != self.key:
            self.key = key
            self.run += 1
            if self.run >= self.HINT:
                self.said = True
                warnings.warn(
                    f"{self.HINT} blocking pushpull calls of one key each in a row: each waits for its own round "
                    f"trip before it returns (MXNet's engine overlaps them). Pass async_op=True and call "
                    f"kv.wait_all() before reading the outs (small ones then go to the servers together), or "
                    f"pass the keys and values as lists in one call; see docs/mxnet.md",
                    PerformanceWarning, stacklevel=3)


def _after_pushes(method):
    """A kvstore call other than push and pushpull: the open batch of coalesced calls goes first
    (kvps/kvstore/coalesce.py)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        self._flush()
        return method(self, *args, **kwargs)
    return call


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
        # small calls go on the calling thread's own connections (kvps/wire/lane.py), except where a
        # request may have to be sent again after a timeout (resends, faults)
        lanes = bool(self.cfg.lane_bytes and not self._node.requests.resend_after and self._node.faults is None)
        # and small pushes called one after another go as one request (kvps/kvstore/coalesce.py)
        self._coalesce = None
        if lanes and self.cfg.coalesce_us:
            self._coalesce = Coalescer(self.cfg.coalesce_us / 1e6, self.cfg.lane_bytes, self._node.van.call_later)
        self._join_job(self._node, self._node.leave, self._coalesce and self._coalesce.send_open)
        self._num_servers = len(self._node.membership["servers"])
        self._optimizer_generation = 0
        self._codec = None               # gradient compression spec, or None
        self._residuals = {}             # (key, part) -> float32 error-feedback residual
        self._pull_codec = None          # compressed pulls: the codec sent in their meta["pull"]
        self._pulled = None              # and their kvps.ps.compression.PullDecoder
        self._copies = {}                # key -> (private copy of its last push, that push's handle)
        self._arenas = {}                # server rank -> shm.Arena shared with it, or None (TCP only)
        self._readers = {}               # server name -> shm.Reader of its value segments, or None
        self._peers = (-1, {})           # (Worker.servers_changed, {home rank: the name of its head})
        # a request sent again to a new head (KVPS_REPLICAS) carries inline what it had in shared memory
        # (through a weak reference: the node must not keep a dropped kvstore, which its arenas name)
        self._node.requests.rehome = functools.partial(_rehome_weakly, weakref.ref(self))
        # each key's calls in order across the I/O thread and the lanes (strictly, when resends may reorder)
        self._order = Order(strict=bool(self._node.requests.resend_after))
        self._solo = _SoloCalls(quiet=self._node.rank != 0)
        self._lanes = None
        if lanes:
            # (the node outlives this kvstore: what it holds, such as the lanes, must not hold the kvstore)
            self._lanes = Lanes(self._node, functools.partial(_server_address, self._node),
                                functools.partial(_server_local, self._node))
        # pull-ahead keeps dist_sync's semantics exactly: the round's value is what a pull would read
        self._ahead = PullAhead() if consistency.wire() == "sync" else None
        self._checkpoints = Checkpointer(self._node, self.cfg, self._keys, self._num_servers, consistency.wire())
        if self.rank != 0:
            self._checkpoints.every = 0      # periodic checkpoints are worker 0's
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
    num_workers = property(lambda self: self._node.num_workers)     # live workers (elastic jobs change it)
    num_servers = property(lambda self: self._num_servers)

    # ---- plumbing ----
    def _send(self, op, what, messages, on_reply=None, keep=(), async_op=False, then=(), priority=0, lane=_AUTO,
              call=None, starts=None):
        """Send the requests of a Messages batch under one Handle; returns it. Higher priorities
        leave first among the requests waiting for the network (kvps/wire/schedule.py). `lane`: the
        way chosen by the caller (_route), else chosen here. `call`: the kvstore call the metrics
        and the timeline name it by, where it is not `op` (a push that travels as a PUSHPULL).
        `starts`: the calls a batch of coalesced pushes stands for (their start times), which are
        timed apart; its pushes were checked, and earlier errors are left to the next call."""
        if self._closed:
            raise KVPSError(f"{what}: {self._why_closed()}")
        if starts is None:
            _check_priority(priority, what)
            self._check_returned()
        if self.cfg.replicas:       # to the head of each range's chain, which it names (kvps/wire/chains.py)
            items = []
            for server, entries, payloads, meta in messages:
                # to the server whose shared memory its regions are in: a death since they were
                # chosen sends it on to the new head, its values inline (_rehomed)
                peer = messages.heads.get(server) or self._peer(server)
                items.append((peer, Header(op, keys=entries, meta=self._claim(op, int(peer[1:]), dict(meta, home=server))),
                              payloads, on_reply))
        else:
            items = [(f"S{server}", Header(op, keys=entries, meta=self._claim(op, server, meta)), payloads, on_reply)
                     for server, entries, payloads, meta in messages]
        # The handle keeps `messages` (their payloads) until it is done, and a kvstore's farewell keeps
        # its unchecked handles: `messages` must then not keep the kvstore alive (its limit may be one
        # of its methods), or a kvstore that a function made and dropped would never leave the job.
        messages.limit = None
        reads = any(header.meta.get("mapped") for _, header, _, _ in items)
        if self._pull_codec is not None and op in (Op.PULL, Op.PUSHPULL):
            for _, header, _, _ in items:
                header.meta["pull"] = self._pull_codec
        keys = {e.key for _, header, _, _ in items for e in header.keys}
        if lane is _AUTO:
            lane = self._route(op, keys, messages.nbytes, async_op)
        telemetry, start = self._node.telemetry, None
        if telemetry is not None and items:                 # the call's latency and timeline events
            if telemetry.timeline is not None:
                items = telemetry.watch_call(call or op, items, self._node.name, int(priority), starts)
            else:
                start = time.time() if starts is None else starts
        if lane is not None:
            handle = lane.request_many(items, what, self.cfg.timeout, keep=keep)
        else:
            handle = self._node.request_many(items, what, keep=keep, priority=int(priority))
        if start is not None:
            telemetry.time_call(handle, call or op, start)
        self._order.sent(keys, handle, reads)
        for region in messages.regions:
            region.busy = handle
        handle.then = then
        if async_op:
            remember(self._pending, handle)
            return handle
        if async_op is None:             # the caller keeps it (a push that returns early)
            return handle
        return _finish(handle)

    def _route(self, op, keys, nbytes, async_op):
        """The Lane a call goes on (kvps/wire/lane.py), or None for the I/O thread: a small call (its
        values in the message or in shared memory) that returns complete or early (not
        async_op=True, whose handle the caller may only poll), unless one of its keys still waits on
        the I/O path. Waits for what must be answered first (kvps/kvstore/order.py)."""
        small = self._lanes is not None and op in LANE_OPS and async_op is not True and nbytes <= self.cfg.lane_bytes
        return self._order.route(keys, self._lanes.mine() if small else None)

    def _layout(self, key, shape, dtype):
        return sharding.layout(key, shape, self._num_servers, self.cfg.bigarray_bound, np.dtype(dtype).itemsize,
                               self.cfg.partition_bytes)

    @staticmethod
    def _what(op, infos):
        return _What(op, infos)

    def _with_values(self, items, codec=None, shared=None, replies=False, messages=None):
        """Messages carrying each array's parts (added to `messages` if given); with a codec, float32
        parts go compressed. The keys in `shared` ({key: push regions}, see _shareable) are copied
        into those regions instead; `replies`: ask for each part's value in its reply region where
        one is free (PUSHPULL)."""
        if messages is None:
            messages = Messages(self._message_bytes)
        if codec:
            messages.meta["codec"] = codec
        for info, array in items:
            flat = array.reshape(-1)
            code = dtype_code(info.dtype)
            squeeze = codec is not None and info.dtype == np.float32
            regions = shared.get(info.key) if shared else None
            for i, part in enumerate(info.parts):
                seg = flat[part.start:part.stop]
                into = self._region(part.server, info, part, "reply") if replies else None
                if regions is not None:
                    region = regions[i]
                    copy_into(region.array(info.dtype, seg.size), seg)
                    messages.add(part.server, Entry(info.key, part.index, code, part.shape(info.shape), 0), None,
                                 seg.nbytes, shm=region, into=into)
                    continue
                if squeeze:
                    seg = self._compress(info.key, part.index, seg)
                    entry = Entry.of(info.key, part.index, seg)
                else:
                    entry = Entry(info.key, part.index, code, part.shape(info.shape), seg.nbytes)
                messages.add(part.server, entry, _bytes(seg) if seg.nbytes else None, seg.nbytes, into=into)
        return messages

    # ---- shared memory with co-located servers (kvps/wire/shm.py) ----
    def _message_bytes(self, server):
        """How big a call's messages to `server` grow (KVPS_MESSAGE_BYTES): over the network, small
        enough that the server answers the first while the rest are on the wire; to a co-located
        server through shared memory, whose payloads do not cross the socket, SHM_MESSAGES times that."""
        return self.cfg.message_bytes * (SHM_MESSAGES if self._arena(self._head(server)) is not None else 1)

    def _head(self, server):
        """The rank that takes the requests for home rank `server`'s ranges: itself, or with
        KVPS_REPLICAS the live head of their chain."""
        return int(self._peer(server)[1:]) if self.cfg.replicas else server

    def _peer(self, server):
        """The name of the server that takes home rank `server`'s requests (Worker.server_peer,
        remembered until the servers change)."""
        changed, peers = self._peers
        if changed != self._node.servers_changed:
            changed, peers = self._peers = (self._node.servers_changed, {})
        peer = peers.get(server)
        if peer is None:
            peer = peers[server] = self._node.server_peer(server)
        return peer

    def _arena(self, server):
        """The shared memory with server rank `server`, or None: it is on another host, or KVPS_SHM=0,
        or (KVPS_REPLICAS) it is a new server that took the rank of the one this worker shared
        memory with: requests to the dead one, sent again, still read that memory (_rehomed)."""
        try:
            arena = self._arenas[server]
        except KeyError:
            arena = None
            if _co_located(self._node, server):
                arena = Arena(f"S{server}", functools.partial(self._attach, server), pid=self._pid(server))
            self._arenas[server] = arena
        if arena is not None and self.cfg.replicas and arena.pid != self._pid(server):
            return None
        return arena

    def _pid(self, server):
        return self._node.membership["servers"][server][2]

    def _attach(self, server, segment, fd, nonce):
        meta = {"pid": os.getpid(), "fd": fd, "segment": segment, "nonce": nonce}
        try:
            self._node.request(f"S{server}", Header(Op.ATTACH, meta=meta),
                               f"sharing memory with S{server}").wait(self.cfg.connect_timeout)
        except (NodeFailure, KVTimeoutError):
            raise
        except KVPSError as exc:
            raise ShmRefused(describe(exc)) from None

    def _reader(self, name, make=True):
        """The Reader of server `name`'s value segments, or None: this worker copies no pull out of
        server memory (not co-located, or a new server took the rank: see _arena); `make`: map them
        if not yet asked to."""
        try:
            reader = self._readers[name]
        except KeyError:
            if not make:
                return None
            reader = None
            server = int(name[1:])
            if self._arena(server) is not None:
                reader = Reader(name, self._pid(server))
            self._readers[name] = reader
        if reader is not None and self.cfg.replicas and reader.pid != self._pid(int(name[1:])):
            return None
        return reader

    def _claim(self, op, server, meta):
        """A request's meta, which says how many of the server's value segments this worker has
        mapped when the reply may name values there instead of writing them into `into`, and which
        replies that named values there it has copied since its last request (server/reads.py)."""
        if "into" in meta:
            reader = self._reader(f"S{server}")
            claim = reader.claim() if reader is not None else None
            if claim is not None:
                meta["mapped"] = claim
        else:
            reader = self._reader(f"S{server}", make=False)
        if reader is not None and op in DATA_OPS:
            done = reader.done()
            if done:
                meta["done"] = done
        return meta

    def _region(self, server, info, part, direction):
        """The free region of `direction` ("push", "reply") for a part, or None (it goes over TCP); in
        the memory shared with the server that takes home rank `server`'s requests now."""
        nbytes = part.size * info.dtype.itemsize
        if nbytes < MIN_BYTES or not self.cfg.shm:
            return None
        arena = self._arena(self._head(server))
        return None if arena is None else arena.region((info.key, part.index, direction), nbytes)

    def _shareable(self, items, codec):
        """{key: its parts' push regions} for the keys of [(info, array)] whose every part can go
        through shared memory now."""
        if codec is not None or not self.cfg.shm:
            return {}
        shared = {}
        for info, _ in items:
            regions = [self._region(part.server, info, part, "push") for part in info.parts]
            if all(r is not None for r in regions):
                shared[info.key] = regions
        return shared

    def _close_arenas(self):
        for arena in self._arenas.values():
            if arena is not None:
                arena.close()
        self._arenas.clear()
        self._readers.clear()            # the servers' segments go once no view maps them

    def _compress(self, key, part, grad):
        residual = None
        if compression.needs_residual(self._codec):
            residual = self._residuals.get((key, part))
            if residual is None:
                residual = self._residuals[(key, part)] = np.zeros(grad.size, np.float32)
        return compression.encode(self._codec, np.ascontiguousarray(grad), residual)

    def _bare(self, infos, replies=False):
        """Messages asking for each key's parts (sized by what the replies will carry); `replies`: in
        their reply regions of shared memory where free (PULL)."""
        messages = Messages(self._message_bytes)
        for info in infos:
            code = dtype_code(info.dtype)
            for part in info.parts:
                into = self._region(part.server, info, part, "reply") if replies else None
                messages.add(part.server, Entry.bare(info.key, part.index, code, part.shape(info.shape)), None,
                             part.size * info.dtype.itemsize, into=into)
        return messages

    def _filler(self, items, release=True):
        """on_reply that copies VALUE payloads into the outs of [(KeyInfo, [Out])]; `release`: then
        tell the server (through the next request) that values it named in its memory are read."""
        dests = collections.defaultdict(list)
        for info, outs in items:
            for part in info.parts:
                for o in outs:
                    dests[(info.key, part.index)].append((info, o.array.reshape(-1)[part.start:part.stop]))

        def fill(header, payloads, picked=None):
            """`picked`: just these (index, entry, frame) of the reply (a pull served from a reply
            with many other keys, Stash.picked), else all of it."""
            placed, reader = self._placed(header)
            try:
                copy(header, entries(header, payloads) if picked is None else picked, placed, reader)
            finally:
                if release:                     # the server may change those values now
                    _unread(self._readers, header)

        def copy(header, entries, placed, reader):
            shared = header.meta.get("shm", ())
            codec, delta = header.meta.get("codec"), header.meta.get("delta", False)   # compressed pull
            for index, entry, frame in entries:
                if codec is not None and self._squeezed(entry, frame, dests, codec, delta):
                    continue
                for info, dest in dests.get((entry.key, entry.part), ()):
                    if entry.dtype != dtype_code(info.dtype) or math.prod(entry.shape) != dest.size:
                        raise ProtocolError(f"reply for key {entry.key!r} part {entry.part} is "
                                            f"{numpy_dtype(entry.dtype)} "
                                            f"{entry.shape}; expected {info.dtype} with {dest.size} elements")
                    if frame is not None:
                        np.copyto(dest, as_array(frame, entry).reshape(-1))
                    elif index in shared:
                        copy_into(dest, self._replied(header.src, info, entry.part).array(info.dtype, dest.size))
                    elif index in placed:
                        copy_into(dest, self._server_memory(reader, entry, placed[index], dest.nbytes).view(info.dtype))
                first = dests.get((entry.key, entry.part))
                if delta and self._pulled is not None and first and first[0][0].dtype == np.float32:
                    # sent as it is (a key's first compressed pull): this worker's copy from now on
                    self._pulled.received(entry.key, entry.part, first[0][1])
        return fill

    def _placed(self, header):
        """({entry index: (segment, offset)}, Reader) of a reply's values in the server's memory,
        after mapping the segments it offers."""
        offers, placed = header.meta.get("segments"), header.meta.get("at")
        if not offers and not placed:
            return {}, None
        if placed and header.meta.get("read") is None:
            raise ProtocolError(f"a reply from {header.src} names values in its memory without a number for "
                                f"telling it when they are read (meta read)")
        reader = self._readers.get(header.src)
        if reader is None:
            raise ProtocolError(f"a reply from {header.src} names server memory this worker never asked to read")
        if offers:
            reader.offered(offers)
        return {index: (segment, offset) for index, segment, offset in placed or ()}, reader

    @staticmethod
    def _server_memory(reader, entry, at, nbytes):
        try:
            return reader.view(at[0], at[1], nbytes)
        except ShmRefused as exc:
            raise ProtocolError(f"reply for key {entry.key!r} part {entry.part}: {exc}") from None

    def _squeezed(self, entry, frame, dests, codec, delta):
        """A compressed pull's entry: decoded into its outs (True), or, sent as it is (float32), left
        to the usual copy (False)."""
        targets = dests.get((entry.key, entry.part), ())
        if not targets or targets[0][0].dtype != np.float32 or entry.dtype == dtype_code(np.float32):
            return False
        if self._pulled is None:
            raise ProtocolError(f"reply for key {entry.key!r} part {entry.part} is compressed, but this "
                                f"worker asked for no compressed pulls")
        payload = as_array(frame, entry) if frame is not None else np.empty(entry.shape, numpy_dtype(entry.dtype))
        values = self._pulled.values(entry.key, entry.part, payload, targets[0][1].size, codec, delta,
                                     f"compressed pull of key {entry.key!r} part {entry.part}")
        for _, dest in targets:
            np.copyto(dest, values)
        return True

    def _replied(self, server, info, part):
        """The reply region server `server` (its name) wrote part `part` of a key into."""
        arena = self._arenas.get(int(server[1:]))
        region = arena.existing((info.key, part, "reply")) if arena is not None else None
        if region is None:
            raise ProtocolError(f"a reply for key {info.key!r} part {part} names shared memory this "
                                f"worker never offered")
        return region

    # ---- the API ----
    @_after_pushes
    def init(self, key, value):
        items = self._inits(key, value)
        infos = [KeyInfo(i.key, i.dtype, i.shape, self._layout(i.key, i.shape, i.dtype)) for i, _ in items]
        arrays = [a for _, a in items]
        # A worker that joined a running elastic job sets nothing: it reads the current values instead.
        late = self._node.membership.get("late", False)
        messages = self._with_values(list(zip(infos, arrays))) if self.rank == 0 and not late else self._bare(infos)
        self._send(Op.INIT, self._what("init", infos), messages, keep=arrays)
        for info in infos:
            self._keys[info.key] = info
        if self.cfg.resume:
            self._resume(infos)
        if late:
            self.pull(key, out=value)

    def push(self, key, value, priority=0, async_op=False, row_ids=None):
        """Returns once the values are copied (blocking form: None) and the round goes on in the
        background: a later pull of the same key sees it, and its error is raised by the next call.
        A small push that follows a push may wait to go with the next ones (kvps/kvstore/coalesce.py)."""
        coalesce = self._coalesce
        if coalesce is None:
            return self._push(key, value, priority, async_op, row_ids)
        with coalesce.lock:
            if coalesce.batch is not None and coalesce.batch.call != Op.PUSH:
                self._send_open()           # the pushpulls called before it go first
            try:
                return self._push(key, value, priority, async_op, row_ids)
            finally:
                coalesce.follows = Op.PUSH

    def _push(self, key, value, priority, async_op, row_ids):
        if row_ids is not None:
            self._send_open()
            return self._push_rows(key, value, row_ids, async_op, priority)
        start = time.time()
        items = self._values(key, value, "push")
        self._straggle(items)
        keys = [info.key for info, _ in items]
        if self._checkpoints.every:
            self._checkpoints.before_push(keys, self.wait_all)
        what = self._what("push", items)
        if async_op:
            self._send_open()
            self._forget(keys)
            messages = self._with_values(items, self._codec, self._shareable(items, self._codec))
            return self._send(Op.PUSH, what, messages, keep=(items, messages), async_op=True, priority=priority)
        wants = self._ahead is not None and self._ahead.wants(keys)
        op = Op.PUSHPULL if wants else Op.PUSH
        nbytes = sum(a.nbytes for _, a in items)
        coalesce = self._coalesce
        if coalesce is not None:
            if coalesce.follows == Op.PUSH and nbytes <= coalesce.limit:     # it waits, with the next ones
                _check_priority(priority, what)
                if not coalesce.fits(op, keys, nbytes):
                    self._send_open()
                self._defer(op, items, keys, priority, start)
                return None
            if coalesce.batch is not None and not coalesce.batch.keys.isdisjoint(keys):
                self._send_open()           # it goes now, after the waiting push of its key
        stash = None
        if wants:
            # (a handle may outlive this kvstore: what its reply callback holds must not hold the kvstore)
            stash = Stash(keys, functools.partial(_unread, self._readers))
        shared = self._shareable(items, self._codec)
        # The caller may change its arrays once push returns: their values go into shared memory, or
        # on a lane, which sends (copies) them before push returns, or into private copies that zmq
        # sends from.
        lane = self._route(op, keys, nbytes, None)
        if lane is None:
            items = [(info, array if info.key in shared else self._private(info, array)) for info, array in items]
        messages = self._with_values(items, self._codec, shared, replies=stash is not None)
        handle = self._send(op, what, messages, on_reply=None if stash is None else stash.keep,
                            keep=(items, messages), async_op=None, priority=priority, lane=lane, call=Op.PUSH)
        if stash is not None:
            stash.handle = handle
        if self._ahead is not None:
            self._ahead.pushed(keys, stash)
        if lane is None:
            for info, array in items:
                if info.key not in shared:      # a private copy, reusable once this push is over
                    self._copies[info.key] = (array, handle)
        self._returned_early(handle)
        return None

    def _defer(self, op, items, keys, priority, start):
        """Add a small push to the open batch (opened here if none is), its values copied now."""
        coalesce = self._coalesce
        batch = coalesce.batch
        if batch is None:
            stash = Stash((), functools.partial(_unread, self._readers)) if op == Op.PUSHPULL else None
            batch = Batch(op, Messages(self._message_bytes), stash)
            coalesce.open(batch, self._send_batch)
        shared = self._shareable(items, self._codec)
        copies = []
        for info, array in items:
            if info.key in shared:
                copies.append((info, array))
            else:
                array = self._private(info, array)
                copies.append((info, array))
                batch.private.append((info.key, array))
        self._with_values(copies, self._codec, shared, replies=batch.stash is not None, messages=batch.messages)
        batch.add(copies, priority, start)
        if batch.stash is not None:
            batch.stash.add(keys)
        if self._ahead is not None:
            self._ahead.pushed(keys, batch.stash)
        if batch.nbytes >= coalesce.limit:
            self._send_open()

    def _flush(self, waited=False):
        """Before a call that cannot join the open batch: send the batch, if any (`waited`: the call
        waits for it, see _send_batch), and the next small push goes at once."""
        coalesce = self._coalesce
        if coalesce is not None:
            with coalesce.lock:
                coalesce.follows = None
                if coalesce.batch is not None:
                    self._send_batch(False, waited)

    def _send_open(self):
        """Send the open batch, if any (with the lock held: before a call that cannot join it)."""
        if self._coalesce is not None and self._coalesce.batch is not None:
            self._send_batch(False)

    def _send_batch(self, late, waited=False):
        """Send the open batch as one call; returns whether it went. `late`: on the I/O thread
        (Coalescer.check), through the I/O path, and only if no earlier request naming its keys must
        be answered first (kvps/kvstore/order.py); else on this thread's lane where it may take one
        (async pushpulls: only when `waited`, by a wait on one of their handles, which then reads
        the replies on this thread). A failure of a batch of pushes fails its handle, which the
        next call raises (and a pull of its keys); a batch of async pushpulls fails their handle,
        which their waits raise."""
        coalesce = self._coalesce
        batch = coalesce.batch
        if batch is None:
            return True
        if late and not self._order.ready(batch.keys):
            return False
        coalesce.take()
        if batch.call == Op.PUSHPULL:
            return self._send_pushpulls(batch, late, waited)
        what = self._what("push", batch.items)
        stash = batch.stash
        try:
            handle = self._send(batch.op, what, batch.messages, on_reply=None if stash is None else stash.keep,
                                keep=(batch.items, batch.messages), async_op=None, priority=batch.priority,
                                lane=None if late else _AUTO, call=Op.PUSH, starts=batch.starts)
        except Exception as exc:
            handle = Handle.failed(what, exc)
            if not late:
                if stash is not None:
                    stash.handle = handle
                raise
        if stash is not None:
            stash.handle = handle
        self._returned_early(handle)
        for key, array in batch.private:         # private copies, reusable once the batch is over
            self._copies[key] = (array, handle)
        return True

    def _send_pushpulls(self, batch, late, waited):
        """Send a batch of async pushpulls as one: through the I/O thread, as any async call, unless
        a wait on one of them sends it (`waited`): then on this thread's lane, whose replies that
        wait reads itself (a lane's replies are read only by a thread that waits or polls on it)."""
        what = self._what("pushpull", batch.items)
        lane = None if late else _AUTO
        if waited:
            lane = self._route(Op.PUSHPULL, batch.keys, batch.messages.nbytes, None)
        try:
            batch.handle = self._send(Op.PUSHPULL, what, batch.messages, on_reply=self._filler(batch.outs),
                                      keep=(batch.items, batch.outs, batch.messages), async_op=True,
                                      then=_finishers(batch.outs), priority=batch.priority,
                                      lane=lane, call=Op.PUSHPULL, starts=batch.starts)
        except Exception as exc:
            batch.handle = Handle.failed(what, exc)
            remember(self._pending, batch.handle)
            if not late:
                raise
        return True

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

    @_after_pushes
    def pull(self, key, out=None, priority=0, ignore_sparse=True, async_op=False):
        items = self._outs(key, out, "pull")
        infos = [i for i, _ in items]
        stashes = self._ahead.take([i.key for i in infos]) if self._ahead is not None else None
        if stashes is not None:
            telemetry = self._node.telemetry
            start = time.time() if telemetry is not None else None
            handle = self._pulled_ahead(items, stashes)
            if telemetry is not None:                   # a pull the user made, though it sent nothing
                telemetry.call_done(Op.PULL, start, [i.key for i in infos])
            return handle
        return self._send(Op.PULL, self._what("pull", infos), self._bare(infos, replies=True),
                          on_reply=self._filler(items),
                          keep=items, async_op=async_op, then=_finishers(items), priority=priority)

    def _pulled_ahead(self, items, stashes):
        """A pull served by the replies of the PUSHPULLs its keys' pushes went as."""
        self._check_returned()
        fill = self._filler(items, release=False)      # a reply's other keys may be pulled later
        keys = [i.key for i, _ in items]
        wanted = [(info.key, part.index) for info, _ in items for part in info.parts]
        for stash in stashes:
            stash.handle.wait()
            for header, payloads in stash.replies:
                fill(header, payloads, stash.picked(header, payloads, wanted))
            stash.left(keys)
        for finish in _finishers(items):
            finish()
        return Handle.completed(self._what("pull", items))

    def pushpull(self, key, value, out=None, priority=0, async_op=False):
        """Push `value` and fill `out` (default: `value`) with the round's result. Blocking, `out`
        is complete when it returns; with async_op=True it returns a handle at once, and a small one
        of one key may wait to go with the next ones (kvps/kvstore/coalesce.py)."""
        if not async_op:
            self._solo.note(key)
        coalesce = self._coalesce
        if coalesce is not None and async_op is True and not isinstance(key, (list, tuple)):
            # an async call of one key may wait in a batch (a list is a fusion its caller chose:
            # kvps.torch's buckets)
            with coalesce.lock:
                coalesce.follows = None
                return self._pushpull(key, value, out, priority, async_op, joins=True)
        self._flush()
        # (outside the lock: a blocking call waits for its round, which another thread's call may close)
        return self._pushpull(key, value, out, priority, async_op)

    def _pushpull(self, key, value, out, priority, async_op, joins=False):
        start = time.time() if joins else None
        values = self._values(key, value, "pushpull")
        keys = [info.key for info, _ in values]
        if self._checkpoints.every:
            self._checkpoints.before_push(keys, self.wait_all)
        self._forget(keys)
        self._straggle(values)
        outs = self._outs(key, value if out is None else out, "pushpull")
        if joins:               # an async call of one key: a small one waits in a batch
            nbytes = sum(a.nbytes for _, a in values)
            if nbytes <= self._coalesce.limit:
                return self._join(values, outs, keys, nbytes, priority, start)
            self._send_open()   # a big one goes now, after what waits
        messages = self._with_values(values, self._codec, self._shareable(values, self._codec), replies=True)
        return self._send(Op.PUSHPULL, self._what("pushpull", values), messages,
                          on_reply=self._filler(outs), keep=(values, outs, messages), async_op=async_op,
                          then=_finishers(outs), priority=priority)

    def _join(self, values, outs, keys, nbytes, priority, start):
        """Add a small async pushpull to the open batch of them (opened here if none is); its handle."""
        what = self._what("pushpull", values)
        _check_priority(priority, what)
        self._check_returned()
        coalesce = self._coalesce
        if not coalesce.fits(Op.PUSHPULL, keys, nbytes, call=Op.PUSHPULL):
            self._send_open()
        batch = coalesce.batch
        if batch is None:
            batch = Batch(Op.PUSHPULL, Messages(self._message_bytes), call=Op.PUSHPULL)
            coalesce.open(batch, self._send_batch)
        # the values go from the caller's arrays (or its copies in shared memory), as an async call's do
        self._with_values(values, self._codec, self._shareable(values, self._codec), replies=True,
                          messages=batch.messages)
        batch.add(values, priority, start)
        batch.outs.extend(outs)
        joined = Joined(batch, what, coalesce.lock)
        if batch.nbytes >= coalesce.limit:
            self._send_open()
        return joined

    @_after_pushes
    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None, async_op=False):
        items = self._per_out(self._outs(key, out, "row_sparse_pull"), row_ids)
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
        return self._send(Op.ROW_SPARSE_PULL, self._what("row_sparse_pull", items), messages,
                          on_reply=fill, keep=(items, messages), async_op=async_op, then=_finishers(items),
                          priority=priority)

    @_after_pushes
    def set_optimizer(self, optimizer):
        spec = optimizer.spec()
        self._checkpoints.optimizer = spec
        self._optimizer_generation += 1
        meta = {"generation": self._optimizer_generation, "spec": spec}
        handle = self._node.request_many(
            [(f"S{s}", Header(Op.SET_OPTIMIZER, meta=meta), (), None) for s in self._node.live_servers()],
            f"set_optimizer({spec['name']})")
        handle.wait()

    @_after_pushes
    def set_gradient_compression(self, compression_params):
        """Compress float32 pushes from now on (MXNet's dict form, e.g. {"type": "2bit", "threshold": 0.5});
        see kvps.ps.compression for the types. {"type": "none"} turns it off."""
        spec = compression.check(compression_params)
        self._codec = compression.wire(spec)
        self._residuals.clear()
        pull = compression.pulls(spec)
        if pull != self._pull_codec:         # what this worker holds of each key starts over too
            self._pulled = compression.PullDecoder() if pull else None
        self._pull_codec = pull
        # A pulled-ahead reply may be applied late or never, and a compressed change must be added
        # exactly once, in order: compressed pulls go as pulls.
        if self._ahead is not None:
            self._ahead.reset()              # releases what its replies hold in server memory
        self._ahead = PullAhead() if pull is None and self.consistency.wire() == "sync" else None

    @_after_pushes
    def barrier(self):
        """Wait until every worker reaches the barrier. In async and ssp modes a push is applied on
        arrival, so the pushes of this worker that returned early are waited for first: after the
        barrier every worker's earlier pushes are in (sync pulls wait for their rounds anyway, and
        waiting there for a round that needs a push made after the barrier would never end)."""
        if self.mode != "sync":
            self._wait_returned()
        self._node.barrier("workers")

    @_after_pushes
    def join(self):
        """This worker has no more data (Horovod's join): from now on it counts as pushing zeros into
        every sync round, so the others finish theirs; waits until every worker has joined and
        returns the rank of the last one (the one that trained longest)."""
        self.wait_all()
        if self._ahead is not None:
            # once joined, this worker pushes nothing, so what it pulls is read as usual
            self._ahead.reset()
        self._node.request_many([(f"S{s}", Header(Op.JOIN), (), None) for s in self._node.live_servers()],
                                f"W{self.rank} joining").wait()
        return int(self._node.barrier("workers")[1:])

    @_after_pushes
    def server_stats(self):
        """Each server's counters (pushes, pulls, rounds, kernel calls, ...), by server name.
        Consistency fields: "mode" (wire string), "dropped" (stale pushes dropped, backup workers),
        "ssp_waits" (ssp pulls that waited), "staleness" (histogram: index i counts the pushes applied
        i updates after their worker last pulled the key; kvps.ps.consistency.total_staleness sums them)."""
        stats = {}

        def keep(header, payloads):
            stats[header.src] = header.meta
        self._node.request_many([(f"S{s}", Header(Op.STATS), (), keep) for s in self._node.live_servers()],
                                "server stats").wait()
        return stats

    def _healthy(self):
        return self._node.failure is None

    # ---- checkpoints (kvps/kvstore/checkpointer.py; docs/checkpoint.md) ----
    @_after_pushes
    def save(self, path, dump_optimizer=False):
        """Write every key's value, the servers' optimizer state and the round/clock counters to
        the directory `path` (on a file system every node shares), then a manifest; return once
        the checkpoint is whole. A half-written checkpoint is never taken for a whole one, and an
        earlier one in `path` stays valid until the new one replaces it.

        dist_sync: every worker may call it, or only one (`if kv.rank == 0:`, as MXNet and Horovod
        scripts save): the checkpoint is the state after the caller's last step either way, and the
        servers write it once however many workers ask (docs/checkpoint.md). Other modes: a
        collective, which every worker calls (their rounds do not wait for the caller, so only a
        barrier makes the cut exact); worker 0 sends the requests and raises what went wrong."""
        self.wait_all()
        self._checkpoints.wait()
        # (hold: the servers write their live state, no copy: no round closes meanwhile, since in
        # dist_sync none closes without this worker's next push, and elsewhere every worker waits)
        def save():
            self._checkpoints.start_save(path, self._checkpoints.step or None, dump_optimizer, hold=True)()
        if self.consistency.wire() == "sync":
            save()
        else:
            self._collective("kv.save", save)

    def _collective(self, call, work):
        """A collective `call` (kv.load, kv.save outside dist_sync): every worker meets, worker 0 does
        work(), all meet again, and worker 0 raises what went wrong. One still waiting at the first
        meeting after COLLECTIVE_HINT_S (or half of KVPS_TIMEOUT) says so, once, naming the call (a
        script that makes it under `if kv.rank == 0:` would otherwise wait without a word until
        KVPS_TIMEOUT), and fails at KVPS_TIMEOUT with an error that names it too."""
        handle = self._node.barrier_async("workers")
        hint = min(COLLECTIVE_HINT_S, self.cfg.timeout / 2)
        try:
            handle.wait(hint)
        except KVTimeoutError:
            log.warning("W%d: %s has waited %g s for the other workers: in a %s job it is a collective, which "
                        "every worker calls (docs/checkpoint.md); waiting up to KVPS_TIMEOUT (%g s)", self.rank,
                        call, hint, self.consistency.wire(), self.cfg.timeout)
            try:
                handle.wait(self.cfg.timeout - hint)
            except KVTimeoutError:
                raise KVTimeoutError(f"W{self.rank}: {call} waited {self.cfg.timeout:g} s (KVPS_TIMEOUT) for the "
                                     f"other workers to call it too: in a {self.consistency.wire()} job it is "
                                     f"a collective, which every worker calls") from None
        error = None
        if self.rank == 0:
            try:
                work()
            except Exception as exc:     # the others must still leave the barrier
                error = exc
        self._node.barrier("workers")
        if error is not None:
            raise error

    @_after_pushes
    def load(self, path, optimizer_states=True):
        """Collective: restore every initialised key from checkpoint `path`, which any number of
        servers may have saved (each server reads the rows it now holds), with the optimizer
        state unless optimizer_states=False (the optimizer then starts afresh). Every worker
        checks the manifest first: a missing, corrupt or mismatched checkpoint raises
        kvps.ps.checkpoint.CheckpointError naming the file and what is wrong, before any change."""
        infos = list(self._keys.values())
        self.wait_all()
        self._checkpoints.wait()
        self._checkpoints.check(path, infos)
        self._forget([info.key for info in infos])
        self._collective("kv.load", functools.partial(self._checkpoints.load, path, infos,
                                                      "all" if optimizer_states else "values"))

    @_after_pushes
    def save_optimizer_states(self, fname, dump_optimizer=False):
        """MXNet's call, in dist mode too (MXNet refuses there, its issue #15923): one worker saves
        the servers' optimizer state, with the values and counters, as a checkpoint directory
        `fname`. Not a collective: one worker may call it (MXNet scripts test kv.rank == 0), or
        every worker (each gets a complete checkpoint; the servers write one save at a time). The
        optimizer's name and parameters are always in the manifest (JSON, never pickle);
        dump_optimizer=True also lets load_optimizer_states set it when none is set."""
        self.wait_all()
        self._checkpoints.wait()
        self._checkpoints.start_save(fname, None, dump_optimizer)()

    @_after_pushes
    def load_optimizer_states(self, fname):
        """MXNet's call: restore the servers' optimizer state (moments, step counts) from `fname`,
        leaving the values. Any worker may call it, and all may (loading the same state twice
        changes nothing); into the optimizer set now, or the next one set_optimizer sets."""
        from kvps.optimizer import from_spec
        infos = list(self._keys.values())
        manifest = self._checkpoints.check(fname, infos)
        spec = manifest.get("optimizer")
        if manifest.get("dump_optimizer") and spec and self._checkpoints.optimizer is None:
            self.set_optimizer(from_spec(spec))
        self.wait_all()
        self._checkpoints.load(fname, infos, "optimizer")

    def _resume(self, infos):
        """KVPS_RESUME: the keys just initialised take their saved state (every worker checks the
        manifest; worker 0 sends LOAD; the barrier keeps the others from pulling before it lands)."""
        self._checkpoints.resume_manifest()
        self._checkpoints.check(self.cfg.resume, infos)
        self._forget([info.key for info in infos])
        if self.rank == 0:
            self._checkpoints.load(self.cfg.resume, infos, "all")
        self._node.barrier("workers")

    def wait_all(self, timeout=None):
        """Wait for every asynchronous call and every push that returned early (the open batch goes
        first: a batch of async pushpulls on this thread's lane, whose replies this wait reads)."""
        self._flush(waited=True)
        return KVStore.wait_all(self, timeout)

    @_after_pushes
    def close(self):
        """Wait for a periodic checkpoint still being written, then leave (KVStore.close)."""
        if not self._closed and self._healthy():
            try:
                self._checkpoints.wait()
            except KVPSError as exc:
                log.error("%s", exc)
        try:
            super().close()
        finally:
            self._close_arenas()        # after leaving: no request names a segment any more


def _unread(readers, header):
    """A reply whose values in a server's memory (if any) this worker will not copy (any more):
    `readers` is the kvstore's {server name: shm.Reader or None}."""
    if header.meta.get("at") and header.meta.get("read") is not None:
        reader = readers.get(header.src)
        if reader is not None:
            reader.copied(header.meta["read"])


def _rehome_weakly(kvstore, header, payloads, old):
    kvstore = kvstore()
    return (header, payloads) if kvstore is None else _rehomed(kvstore._arenas, header, payloads, old)


def _rehomed(arenas, header, payloads, old):
    """A request that went to server `old` (its name) made fit for another one, the new head of its
    range (KVPS_REPLICAS: `old` died): the values it named in the memory this worker shares with
    `old` go inline, and what it said about that memory goes. `arenas`: the kvstore's
    {server rank: shm.Arena or None}."""
    if not any(field in header.meta for field in LINK_META):
        return header, payloads
    arena = arenas.get(int(old[1:]))
    return inlined(header, payloads, arena.view if arena is not None else _no_memory(old))


def _no_memory(server):
    def view(segment, offset, nbytes):
        raise ShmRefused(f"a request names memory shared with {server}, and this worker shares none with it")
    return view


def _server_address(node, peer):
    host, port, _ = node.membership["servers"][int(peer[1:])]
    return host, port


def _co_located(node, server):
    """Whether this worker reaches server rank `server` by the co-located paths (shared memory, the
    local socket): on this worker's host, with KVPS_SHM on."""
    membership = node.membership
    return bool(node.cfg.shm and membership["workers"][node.rank][0] == membership["servers"][server][0])


def _server_local(node, peer):
    """(port, pid) of server `peer` where a lane may reach it through its local socket
    (kvps/wire/local.py): co-located, and no CURVE; else None."""
    server = int(peer[1:])
    if node.keys is not None or not _co_located(node, server):
        return None
    _, port, pid = node.membership["servers"][server]
    return port, pid


def _check_priority(priority, what):
    if type(priority) is not int and (not isinstance(priority, numbers.Integral) or isinstance(priority, bool)):
        raise TypeError(f"{what}: priority must be an int (higher goes first), not {priority!r}")


def _finishers(items):
    return [o.finish for _, outs in items for o in outs if o.copy_back]


def _finish(handle, timeout=None):
    return handle.wait(timeout)

