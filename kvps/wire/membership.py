"""What every scheduler client (server or worker) does: register, heartbeat, barrier, fail loudly.

    node = Node(config, "worker", meta={"mode": "sync"})
    node.start()                    # registers; returns once every node has registered
    node.rank, node.membership      # assigned by the scheduler
    node.barrier("workers")

A node sends a heartbeat to the scheduler every KVPS_HEARTBEAT_INTERVAL and
takes the scheduler's replies as its heartbeat; silence for
KVPS_HEARTBEAT_TIMEOUT fails every pending and later call with NodeFailure.
When the scheduler reports a dead node (NODE_FAILED), the same happens, with
the dead node's name in the message. A worker that left on purpose (NODE_LEFT)
is no failure: it only goes into `left` and to the on_worker_left hook.

Elastic jobs (KVPS_ELASTIC=1): the scheduler removes a dead worker instead of failing the job,
and a worker that registers later takes a vacant rank; every node gets WORKERS with the new table
(`num_workers` counts the live ranks) and the on_workers hook. Workers resend unanswered data
requests when KVPS_RESEND_TIMEOUT or KVPS_FAULTS is set (kvps/wire/requests.py); KVPS_FAULTS makes
workers and servers lose, repeat and delay data messages (kvps/wire/faults.py, test only).

A scheduler that dies need not end the job: with KVPS_SCHEDULER_GRACE a node keeps working that
much longer, and when a scheduler started with --recover answers its heartbeats (a new
`incarnation`), it registers again with its rank and resends its unanswered barriers.
"""
import logging
import os
import socket
import threading
import time

from kvps.errors import KVPSError, NodeFailure, describe
from kvps.wire import keys as job_keys
from kvps.wire.faults import Faults
from kvps.wire.requests import Handle, Requests, node_failure
from kvps.wire import chains
from kvps.wire.protocol import Header, Op
from kvps.wire.throttle import escape
from kvps.wire.transport import Van

log = logging.getLogger("kvps.node")

SCHEDULER = "H"
MAX_EARLY_PEER = 4096       # ring messages a worker keeps until its ring subscribes (then they are dropped)
REPLY_OPS = frozenset({Op.ACK, Op.ERROR, Op.MEMBERSHIP, Op.VALUE, Op.STATS})


def advertised_host(cfg):
    """The address peers should use for this node: KVPS_HOST, else the local address
    that routes to the scheduler (found without sending anything)."""
    if cfg.host:
        return cfg.host
    host = cfg.require_scheduler()[0]
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))   # UDP connect only picks a route
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


def node_name(role, rank):
    return {"scheduler": "H", "server": "S", "worker": "W"}[role] + ("" if role == "scheduler" else str(rank))


_ROLE_OF = {"S": "server", "W": "worker"}


def parse_name(name):
    """(role, rank) of a canonical node name (the inverse of node_name): ("scheduler", None) for
    "H", ("worker", 3) for "W3"; (None, None) for anything else. Only ASCII digits without leading
    zeros count, so "W00", "W\u0660" (an Arabic-Indic zero) or "W+1" never pass as W0 or W1."""
    if name == "H":
        return "scheduler", None
    if type(name) is not str or not 2 <= len(name) <= 12 or name[0] not in _ROLE_OF:
        return None, None
    digits = name[1:]
    if not (digits.isascii() and digits.isdigit()) or (digits[0] == "0" and len(digits) > 1):
        return None, None
    return _ROLE_OF[name[0]], int(digits)


class Node:
    """A registered member of a kvps job. Subclasses handle their own data messages."""

    def __init__(self, cfg, role, meta=None):
        self.cfg = cfg
        self.role = role
        self.name = "?"
        self.rank = None
        self.membership = None
        # Only a worker's data requests are resent (the scheduler's control plane is never faulted).
        self.requests = Requests(cfg.resend_after if role == "worker" else 0.0,
                                 keep_control=cfg.scheduler_grace > 0,
                                 keep_data=role == "worker" and cfg.replicas > 0)
        # Only a worker's requests carry priorities (servers answer in arrival order).
        credit = cfg.send_credit if role == "worker" else 0
        # CURVE (docs/security.md): loaded before the Van exists, so bad keys leave nothing open.
        self.keys = job_keys.for_node(cfg, role, cfg.rank, [cfg.scheduler[0] if cfg.scheduler else None, cfg.host])
        self.van = Van(f"{role}-{os.getpid()}", self._on_message, self._on_bad, credit=credit)
        if self.keys is not None:
            self.van.secure(self.keys)
            self.name = self.keys.name      # known before registering: peers check every src against the key
        self.faults = Faults.of_config(cfg, role)
        if self.faults is not None:
            self.van.inject(self.faults)
        self.van.limit_messages(cfg.max_message_bytes, cfg.peer_queue, cfg.peer_reply_bytes)
        self.van.when_dead(self._io_died)
        # Metrics and the timeline (docs/observability.md): None unless KVPS_METRICS_PORT or
        # KVPS_TIMELINE is set, and then not even imported.
        self.telemetry = None
        if cfg.metrics_port is not None or cfg.timeline:
            from kvps.metrics.telemetry import Telemetry
            self.telemetry = self.van.telemetry = Telemetry(cfg, role, advertised_host(cfg), rank=lambda: self.rank)
            if self.telemetry.metrics is not None:
                self.telemetry.metrics.derive("kvps_send_queue_depth", lambda: {(): self.van.backlog()[0]})
                if role == "worker":
                    self.telemetry.metrics.derive("kvps_send_inflight_bytes", lambda: {(): self.van.backlog()[1]})
        self._meta = dict(meta or {})
        self._last_heard = time.monotonic()
        self.failure = None             # NodeFailure once the job is broken
        self._incarnation = None        # the scheduler's (see _reregister)
        self._register_meta = {}
        self.left = set()               # workers that closed cleanly
        self.dead_servers = set()       # chain replication (KVPS_REPLICAS): servers that died, by rank
        self.joined_servers = []        # and the ranks new servers took, in order (kvps/wire/chains.py)
        self.servers_changed = 0        # SERVERS messages taken so far (lanes follow the chains by it)
        self._ended = None              # what ended this node's waits: its failure, or its stop
        self._end_listeners = []
        self._servers_listeners = []    # fn() after each SERVERS (a server died or joined), on the I/O thread
        self._end_lock = threading.Lock()

    # ---- lifecycle ----
    def start(self):
        """Register with the scheduler and wait for the membership table."""
        host, port = self.cfg.require_scheduler()
        self.van.connect(SCHEDULER, host, port)
        self.van.every(self.cfg.heartbeat_interval, self._heartbeat)
        if self.requests.resend_after:
            self.van.every(self.requests.resend_after / 2, self._resend)
        self.van.start()
        meta = dict(self._meta, role=self.role, host=advertised_host(self.cfg),
                    port=self.van.port or 0, pid=os.getpid(),
                    rank=self.cfg.rank if self.keys is None else parse_name(self.keys.name)[1])
        if self.telemetry is not None and self.telemetry.port is not None:
            meta["metrics_port"] = self.telemetry.port
        self._register_meta = meta
        self._last_heard = time.monotonic()
        handle = self.request(SCHEDULER, Header(Op.REGISTER, meta=meta),
                              what=f"{self.role} registering with the scheduler at {host}:{port} "
                                   f"(are all {self.cfg.num_servers} servers and {self.cfg.num_workers} workers started"
                                   f"{'' if self.keys is None else ', with keys of the same job'}?)",
                              on_reply=self._on_membership, timeout=self.cfg.connect_timeout)
        handle.wait()
        log.info("%s registered: %d servers, %d workers", self.name,
                 len(self.membership["servers"]), len(self.membership["workers"]))

    @property
    def num_workers(self):
        """The live workers of the job (an elastic job's count changes; vacant ranks do not count)."""
        return sum(1 for w in self.membership["workers"] if w[2] >= 0)

    def stop(self):
        if self.faults is not None and (self.faults.counts["dropped"] or self.faults.counts["duplicated"]):
            log.info("%s: faults injected %s; requests resent %d", self.name, self.faults.counts,
                     self.requests.resent)
        self._end_waits(KVPSError(f"{self.name} has stopped (it left the job or shut down)"))
        self.van.stop()
        if self.telemetry is not None:
            self.telemetry.close()

    def add_failure_listener(self, listener):
        """Call listener(exc) once, when waits on this node must end: with the NodeFailure when the
        job breaks (on the I/O thread), or with a KVPSError when the node stops (on the stopping
        thread); at once if that already happened. It must be short and must not block."""
        with self._end_lock:
            if self._ended is None:
                self._end_listeners.append(listener)
                return
        listener(self._ended)

    def add_servers_listener(self, listener):
        """Call listener() on the I/O thread each time the servers change (a server died or joined),
        after the requests waiting on the I/O path have gone to the new heads. It must be short
        and must not block."""
        self._servers_listeners.append(listener)

    def _end_waits(self, exc):
        with self._end_lock:
            if self._ended is not None:
                return
            self._ended, listeners, self._end_listeners = exc, self._end_listeners, []
        for listener in listeners:
            try:
                listener(exc)
            except Exception:
                log.exception("%s: failure listener %r failed", self.name, listener)

    def leave(self, reason=None):
        """Tell the scheduler this worker is done (unless the job is broken), then stop. `reason`:
        why, when it is not a plain close (kvps.kvstore.process.exit_reason: its script raised); the
        other nodes' errors quote it."""
        try:
            if self.failure is None:
                header = Header(Op.FINALIZE, meta={"reason": reason} if reason else None)
                self.request(SCHEDULER, header, what="leaving the job",
                             timeout=min(self.cfg.timeout, 30)).wait()
        except KVPSError as exc:
            log.warning("%s: leaving the job: %s", self.name, exc)
        finally:
            self.stop()

    # ---- requests ----
    def request(self, peer, header, what, payloads=(), on_reply=None, timeout=None, keep=()):
        """Send one request; returns its Handle."""
        return self.request_many([(peer, header, payloads, on_reply)], what, timeout, keep)

    def request_many(self, items, what, timeout=None, keep=(), priority=None):
        """Send several requests [(peer, header, payloads, on_reply)] under one Handle; data requests
        pass their call's priority (kvps/wire/schedule.py)."""
        handle = Handle(what, self.cfg.timeout if timeout is None else timeout, keep)
        try:
            for peer, header, payloads, on_reply in items:
                header.id = self.requests.add(handle, peer, on_reply, (header, payloads), control=peer == SCHEDULER)
                header.src = self.name
                if self.dead_servers:
                    routed = self.requests.peer_of(header.id, peer)
                    if routed != peer:
                        header, payloads = self.requests.rehomed(header.id, peer, header, payloads)
                        peer = routed
                self.van.send(peer, header, payloads, priority=priority)
        finally:
            handle._arm()
        return handle

    def barrier(self, group="workers", timeout=None):
        """Wait until every node of the group ("workers", "servers", "all") reaches the barrier;
        returns the name of the node that arrived last."""
        return self.barrier_async(group, timeout).wait().meta.get("last")

    def barrier_async(self, group="workers", timeout=None):
        """Enter a barrier without waiting; when done, the handle's meta["last"] names the last to arrive."""
        return self.request(SCHEDULER, Header(Op.BARRIER, meta={"group": group}),
                            what=f"{self.name} waiting at a barrier of {group}", timeout=timeout)

    # ---- I/O thread ----
    def _on_membership(self, header, payloads):
        if header.op != Op.MEMBERSHIP:
            raise NodeFailure(f"scheduler answered REGISTER with {header.op.name}")
        self.membership = header.meta
        self._incarnation = header.meta.get("incarnation")
        self.rank = header.meta["rank"]
        self.name = node_name(self.role, self.rank)
        if self.telemetry is not None:
            self.telemetry.named(self.name)
        self.on_membership(header.meta)

    def _on_message(self, source, header, payloads):
        kind, who = source
        if kind == "client":
            self.on_client(who, header, payloads)
            return
        if who == SCHEDULER:
            self._last_heard = time.monotonic()
            incarnation = header.meta.get("incarnation") if header.op == Op.ACK and not header.id else None
            if incarnation is not None and self._incarnation is not None and incarnation != self._incarnation \
                    and self.failure is None:
                self._reregister(incarnation)
            if self.telemetry is not None and header.op == Op.ACK and not header.id and "sent" in header.meta:
                self.telemetry.clock_sample(header.meta["sent"], header.meta.get("time", 0.0), time.time())
        if header.op in REPLY_OPS:
            if header.id and not self.requests.answer(header, payloads) and header.op == Op.ERROR:
                self.van.complaints(log, logging.WARNING, "%s: unsolicited error from %s: %s", self.name, who,
                                    escape(header.meta.get("message")))
        elif header.op == Op.NODE_FAILED:
            self._node_failed(header.meta)
        elif header.op == Op.NODE_LEFT:
            self.left.add(header.meta["node"])
            self.on_worker_left(header.meta["node"], header.meta["reason"])
        elif header.op == Op.WORKERS:
            self.membership = dict(self.membership, workers=header.meta["workers"])
            log.info("%s: %s %s (%s): %d workers", self.name, header.meta["node"], header.meta["change"],
                     escape(header.meta["reason"]), self.num_workers)
            self.on_workers(header.meta)
        elif header.op == Op.SERVERS:
            meta = header.meta
            self.dead_servers, self.joined_servers = set(meta["dead"]), list(meta.get("joined", ()))
            if "servers" in meta:
                self.membership = dict(self.membership, servers=meta["servers"])
            joined = parse_name(meta["node"])[1] not in self.dead_servers
            self.servers_changed += 1
            log.warning("%s: %s %s (%s); %s", self.name, escape(meta["node"]), "joined" if joined else "died",
                        escape(meta["reason"]), "it joins the tail of its chains" if joined else
                        "its key ranges go on at their replicas")
            self.on_servers(meta)
            for listener in list(self._servers_listeners):
                try:
                    listener()
                except Exception:
                    log.exception("%s: servers listener %r failed", self.name, listener)
        elif header.op == Op.SHUTDOWN:
            self.on_shutdown(header.meta.get("failed"))
        else:
            self.van.complaints(log, logging.WARNING, "%s: unexpected %s from %s dropped", self.name,
                                header.op.name, who)

    def _on_bad(self, source, exc):
        if source[0] == "peer":
            # A peer we talk to sent something we cannot read (e.g. another protocol
            # version): what we asked of it will never be answered.
            self.requests.fail(type(exc)(f"{source[1]}: {describe(exc)}"), peer=source[1])

    def _io_died(self, exc):
        """The I/O thread died (a bug; it survives anything a peer sends): every pending and later
        call fails with a NodeFailure saying so, and on_io_death makes a daemon exit non-zero."""
        failure = NodeFailure(f"{self.name}: this node's I/O thread died ({type(exc).__name__}: "
                              f"{escape(describe(exc))}); it can no longer reach the job")
        self.failure = self.failure or failure
        self.requests.fail_all(failure)
        self._end_waits(failure)
        self.on_io_death(failure)

    def _node_failed(self, meta):
        failure = node_failure(meta)
        log.error("%s: %s", self.name, failure)
        self.failure = self.failure or failure
        self.requests.fail_all(failure)
        self.on_failure(meta.get("node"), failure)
        self._end_waits(self.failure)

    def _reregister(self, incarnation):
        """A recovered scheduler took over (`kvps scheduler --recover`): register again with our rank
        and the workers we know have left, then send it our unanswered barriers (I/O thread)."""
        self._incarnation = incarnation
        log.warning("%s: a new scheduler answers; registering again as %s", self.name, self.name)
        meta = dict(self._register_meta, rank=self.rank, recover=True, left=sorted(self.left))

        def back(header, payloads):
            if header.op != Op.MEMBERSHIP or header.meta["rank"] != self.rank:
                raise NodeFailure(f"the recovered scheduler answered {self.name}'s REGISTER with {header.op.name}")
            for peer, request, request_payloads in self.requests.control_pending():
                self.van.send(peer, request, request_payloads)
        self.request(SCHEDULER, Header(Op.REGISTER, meta=meta), what=f"{self.name} registering again",
                     on_reply=back, timeout=self.cfg.connect_timeout)

    def _resend(self):
        """Send again the data requests still unanswered after the resend timeout (I/O thread)."""
        for peer, header, payloads in self.requests.overdue():
            log.debug("%s: resending %r", self.name, header)
            self.van.send(peer, header, payloads)

    def _heartbeat(self):
        silent = time.monotonic() - self._last_heard
        grace = self.cfg.scheduler_grace if self.membership is not None else 0.0
        if silent > self.cfg.heartbeat_timeout + grace and self.failure is None:
            host, port = self.cfg.scheduler
            self._node_failed({"node": "H", "reason": f"the scheduler at {host}:{port} has not answered "
                                                      f"for {silent:.1f} s (KVPS_HEARTBEAT_TIMEOUT="
                                                      f"{self.cfg.heartbeat_timeout:g}"
                                                      + (f", KVPS_SCHEDULER_GRACE={grace:g})" if grace else ")")})
            return
        meta = None
        if self.telemetry is not None:       # the reply echoes our clock: a round trip for the offset
            self.telemetry.heartbeat()
            meta = {"sent": time.time()}
        self.van.send(SCHEDULER, Header(Op.HEARTBEAT, 0, self.name, meta=meta))

    # ---- hooks for subclasses (I/O thread) ----
    def on_membership(self, meta):
        pass

    def on_client(self, routing_id, header, payloads):
        self.van.complaints(log, logging.WARNING, "%s: unexpected request %r dropped", self.name, header)

    def on_failure(self, node, failure):
        pass

    def on_worker_left(self, node, reason):
        """Worker `node` left the job on purpose (NODE_LEFT); `reason` says how ("it closed its
        kvstore", or "its script failed: ...")."""

    def on_workers(self, meta):
        """An elastic job's workers changed (WORKERS meta: workers, node, change, reason)."""

    def on_servers(self, meta):
        """Chain replication: a server died and its replicas took over (SERVERS meta: dead, node, reason)."""

    def on_shutdown(self, failed=None):
        """The scheduler ends the job; `failed` says why when it failed."""

    def on_io_death(self, failure):
        """The I/O thread died (on that thread, as it ends); a daemon exits non-zero here."""


class Worker(Node):
    """A worker's node: talks to every server, and binds a ROUTER of its own so that other
    workers can reach it (ring all-reduce). It connects to its right neighbour, which
    `send_to_peer` reaches; RING messages from other workers go to the handlers given to
    `on_peer_message`."""

    def __init__(self, cfg, meta=None):
        super().__init__(cfg, "worker", meta)
        self.van.bind(advertised_host(cfg), 0)
        self._peer_handlers = ()        # callables(header, payloads); replaced, never changed in place
        self._peers = set()             # the workers this one holds a DEALER to
        # A neighbour that formed the job first may send its first chunks before this worker has
        # its membership table or its ring: they wait here (bounded) for the first handler.
        self._early_peer = []
        self._peer_lock = threading.Lock()

    def on_peer_message(self, handler):
        """Subscribe handler(header, payloads) to the RING messages other workers send this one.
        It runs on the I/O thread (for messages that came before it, once, on this thread): it must
        be short, must not block and must be thread-safe."""
        with self._peer_lock:
            self._peer_handlers = (*self._peer_handlers, handler)
            early, self._early_peer = self._early_peer, []
        for header, payloads in early:
            handler(header, payloads)

    def send_to_peer(self, name, header, payloads=(), on_sent=None):
        """Send a message to worker `name`, its payloads without copying. on_sent() runs once zmq no
        longer reads them (sent, or dropped because this node stopped or `name` failed), on the I/O
        thread or a zmq thread; until then they must not change. Raises the job's NodeFailure once
        it is broken, KVPSError once this node has stopped or for a worker it does not connect to."""
        if self.failure is not None:
            raise self.failure
        if name not in self._peers:
            raise KVPSError(f"{self.name} does not connect to worker {name!r} "
                            f"(it connects to {', '.join(sorted(self._peers)) or 'no worker'})")
        header.src = self.name
        self.van.send(name, header, payloads, on_sent)

    def connect_worker(self, rank):
        """Also connect to worker `rank` (the ring's left neighbour, which the ring's shared memory
        answers: kvps/collective/shared.py), so send_to_peer reaches it; False if its rank is vacant."""
        name = f"W{rank}"
        if name in self._peers:
            return True
        host, port, pid = self.membership["workers"][rank]
        if pid < 0:
            return False
        self.van.connect(name, host, port)
        self._peers.add(name)
        return True

    def on_membership(self, meta):
        self.van.name = self.name       # transport errors and logs name the worker from now on
        for rank, (host, port, pid) in enumerate(meta["servers"]):
            if pid < 0:                 # a replicated job's dead server (a worker that joined late)
                self.dead_servers.add(rank)
                continue
            self.van.connect(f"S{rank}", host, port)
        workers = meta["workers"]
        if len(workers) > 1:
            right = (meta["rank"] + 1) % len(workers)
            host, port, pid = workers[right]
            if pid < 0:         # a vacant rank of an elastic job: nobody to connect to
                return
            self.van.connect(f"W{right}", host, port)
            self._peers.add(f"W{right}")

    # ---- chain replication (KVPS_REPLICAS; kvps/wire/chains.py) ----
    def server_peer(self, home):
        """The server that takes the requests for home rank `home`'s key ranges: that server, or
        with KVPS_REPLICAS the live head of their chain."""
        if not self.cfg.replicas:
            return f"S{home}"
        head = chains.head(home, len(self.membership["servers"]), self.cfg.replicas, self.dead_servers,
                           self.joined_servers)
        if head is None:
            raise self.failure or NodeFailure(f"every server holding the key ranges of S{home} is dead")
        return f"S{head}"

    def live_servers(self):
        """The ranks of the servers still alive (all but the dead of a replicated job)."""
        return [r for r in range(len(self.membership["servers"])) if r not in self.dead_servers]

    def on_servers(self, meta):
        """A server died and its chains closed up: what this worker had in flight to it goes, same
        ids, to the new heads of their ranges (they apply nothing twice); what names no range
        (STATS, SET_OPTIMIZER, JOIN) fails."""
        dead = set(meta["dead"])
        for rank in dead:
            self.van.disconnect(f"S{rank}")
        rank = parse_name(meta["node"])[1]
        if rank not in dead:            # a new server took a dead one's rank: reach it at its address
            host, port, _ = self.membership["servers"][rank]
            self.van.connect(f"S{rank}", host, port)

        def peer_for(header):
            home = header.meta.get("home")
            return None if home is None else self.server_peer(home)
        for rank in sorted(dead):
            for peer, header, payloads in self.requests.redirect(f"S{rank}", peer_for):
                self.van.send(peer, header, payloads)
            self.requests.fail(NodeFailure(f"server S{rank} died: {meta['reason']}"), peer=f"S{rank}")

    def on_failure(self, node, failure):
        # A DEALER keeps what is queued for a dead peer until it comes back, which it never does:
        # closing it drops those messages, so zmq lets go of their buffers and waits for them end.
        if node in self._peers:
            self.van.disconnect(node)

    def on_client(self, routing_id, header, payloads):
        if header.op == Op.RING:
            with self._peer_lock:
                handlers = self._peer_handlers
                if not handlers and len(self._early_peer) < MAX_EARLY_PEER:
                    self._early_peer.append((header, payloads))
                    return
            for handler in handlers:
                handler(header, payloads)
            if handlers:
                return
        self.van.complaints(log, logging.WARNING, "%s: unexpected %r dropped", self.name, header)
