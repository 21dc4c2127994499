"""The scheduler daemon: one ROUTER socket, one I/O thread, all state in one object.

Job life cycle:
1. Every node sends REGISTER (role, address, wanted rank, kvstore mode). When all
   S servers and W workers have registered, ranks are assigned (wanted ranks
   first, then arrival order) and each node gets the MEMBERSHIP table.
2. Nodes send heartbeats; a node silent for KVPS_HEARTBEAT_TIMEOUT is declared
   dead and every other node is told (NODE_FAILED), so nobody hangs on it; the
   servers get SHUTDOWN naming the failure (they exit 1) and the scheduler exits 1
   at once, so every node is gone within about one heartbeat timeout of the death.
   Elastic jobs (KVPS_ELASTIC=1): a dead worker is removed instead (WORKERS to
   every node), and a worker that registers later takes its vacant rank.
   Replicated jobs (KVPS_REPLICAS=R): a dead server's key ranges go on at their replicas (SERVERS
   to every node) as long as each range has a live server left (kvps/wire/chains.py).
   Recovery: a scheduler started with --recover on a dead one's address answers the
   running job's heartbeats with a new incarnation; every node then registers again
   with its rank (REGISTER recover), and barriers wait until the whole job is back.
3. BARRIER requests are answered when every live member of the group has arrived.
4. A worker that finishes sends FINALIZE; the others are told it left (NODE_LEFT,
   not a failure). When every worker has finished or died, the servers get
   SHUTDOWN and the scheduler exits: 0 if nothing died, 1 otherwise.

The decoder has checked every message's meta against its op's schema
(kvps.wire.protocol.SCHEMA), so handlers read fields without re-checking types.
"""
import dataclasses
import logging
import os
import threading
import time

from kvps.errors import ConfigError
from kvps.wire import chains
from kvps.wire import keys as job_keys
from kvps.wire.membership import node_name, parse_name
from kvps.wire.protocol import CLOSED, Header, Op, error_header, quote
from kvps.wire.throttle import escape
from kvps.wire.transport import Van

log = logging.getLogger("kvps.scheduler")

GROUPS = {"workers": ("worker",), "servers": ("server",), "all": ("server", "worker")}


def _bad_address(role, meta):
    """Why a REGISTER's address fields cannot be handed to the other nodes (which connect to them),
    or None. Checked here, so one bad node is refused instead of breaking every other node."""
    host, port, mode = meta["host"], meta["port"], meta.get("mode", "")
    if not (0 < len(host) <= 255 and host.isprintable() and " " not in host):
        return f"host {quote(host)} is not a host name or address"
    if not (1 if role == "server" else 0) <= port <= 65535:
        return f"port {port} is not a port number" + (" (a server needs its port)" if role == "server" else "")
    if not (len(mode) <= 64 and mode.isprintable()):
        return f"mode {quote(mode)} is not a kvstore mode"
    if meta["pid"] < 0:
        return f"pid {meta['pid']} is not a process id"
    return None


@dataclasses.dataclass
class Member:
    routing_id: bytes
    request_id: int
    role: str
    host: str
    port: int
    pid: int
    wanted_rank: int
    mode: str
    last_seen: float
    rank: int = -1
    state: str = "alive"          # alive, left, dead

    @property
    def name(self):
        return node_name(self.role, self.rank) if self.rank >= 0 else f"{self.role} pid {self.pid}"


def _keyed_name(member):
    """The name a member's key is bound to (with CURVE, its wanted rank is its key's)."""
    return node_name(member.role, member.rank if member.rank >= 0 else member.wanted_rank)


class Scheduler:
    """Runs one job. `serve()` blocks until the job ends and returns the exit code."""

    def __init__(self, cfg, host="127.0.0.1", port=0, recover=False):
        if cfg.replicas and cfg.replicas >= cfg.num_servers:
            raise ConfigError(f"KVPS_REPLICAS={cfg.replicas} needs more servers than replicas; the job has "
                              f"{cfg.num_servers} (kvps launch -s)")
        self.cfg = cfg
        # A random id in every heartbeat reply: a node that sees it change registers again (recovery).
        self.incarnation = int.from_bytes(os.urandom(6), "big")
        self.recovering = recover       # taking over a running job: its nodes register again
        # CURVE (docs/security.md): each node's name is its key's, which the Van checks every src against.
        self.keys = job_keys.for_node(cfg, "scheduler", None, [host])
        self.van = Van("H", self._on_message)
        if self.keys is not None:
            self.van.secure(self.keys)
        self.van.limit_messages(cfg.max_message_bytes, cfg.peer_queue, cfg.peer_reply_bytes)
        self.van.when_dead(self._io_died)
        self.port = self.van.bind(host, port)
        self.host = host
        self.members = []                       # in registration order
        self.by_routing = {}
        self.formed = recover                   # a recovered job formed long ago
        self.barriers = {g: [] for g in GROUPS}  # group -> [(routing_id, request_id, name)] in arrival order
        self.failures = []
        self.removed = []                       # elastic: why each removed worker was removed
        self.failed_over = []                   # KVPS_REPLICAS: why each dead server was replaced
        self.joined_servers = []                # KVPS_REPLICAS: ranks a new server took, in order (chains.py)
        self._ending = None                     # (exit code, when): stop once the last messages are out
        self.exit_code = None
        self._done = threading.Event()
        self._started = time.monotonic()
        # Metrics and the timeline (docs/observability.md): None unless KVPS_METRICS_PORT or KVPS_TIMELINE is set.
        self.telemetry = None
        self._metrics_ports = {}                # routing id -> the metrics port its REGISTER gave
        if cfg.metrics_port is not None or cfg.timeline:
            from kvps.metrics.telemetry import Telemetry
            self.telemetry = self.van.telemetry = Telemetry(cfg, "scheduler", host, targets=self.targets)
            self.telemetry.named("H")
            if self.telemetry.metrics is not None:
                self._export(self.telemetry.metrics)

    @property
    def metrics_address(self):
        """HOST:PORT of this scheduler's /metrics and /targets, or None without KVPS_METRICS_PORT."""
        endpoint = self.telemetry.endpoint if self.telemetry is not None else None
        return None if endpoint is None else endpoint.address

    def targets(self):
        """The job's metrics endpoints in Prometheus's HTTP service-discovery format (served at /targets;
        read on the HTTP thread, so it copies the member list once)."""
        out = [{"targets": [self.metrics_address], "labels": {"node": "H"}}]
        for m in list(self.members):
            port = self._metrics_ports.get(m.routing_id)
            if port and m.rank >= 0 and m.state == "alive":
                out.append({"targets": [f"{m.host}:{port}"], "labels": {"node": m.name}})
        return out

    def _show_targets(self):
        """Print every node's metrics address once the job has formed (kvps launch --metrics shows
        them with the scheduler's output)."""
        if self.metrics_address is not None:
            for t in self.targets()[1:]:
                print(f"METRICS {t['labels']['node']} {t['targets'][0]}", flush=True)

    def _export(self, metrics):
        """The scheduler's own metrics, read from its state at scrape time."""
        self._beats = metrics.counter("kvps_scheduler_heartbeats_total")

        def nodes():
            counts = {}
            for m in list(self.members):
                counts[(m.role, m.state)] = counts.get((m.role, m.state), 0) + 1
            return counts
        metrics.derive("kvps_scheduler_nodes", nodes)
        metrics.derive("kvps_scheduler_node_state", lambda: {(m.name, m.state): 1 for m in list(self.members)})
        metrics.derive("kvps_scheduler_heartbeat_age_seconds",
                       lambda: {(m.name,): time.monotonic() - m.last_seen for m in list(self.members)})

    def serve(self):
        self.van.every(self.cfg.heartbeat_interval / 2, self._check)
        self.van.start()
        try:
            self._done.wait()
        except KeyboardInterrupt:
            self.exit_code = 130
        self.van.stop()
        if self.telemetry is not None:
            self.telemetry.close()
        return self.exit_code

    def stop(self, code):
        self.exit_code = code
        self._done.set()

    def _io_died(self, exc):
        """The I/O thread died (a bug: it survives anything a peer sends): exit 1 at once rather
        than linger answering nobody; the nodes then see the scheduler's silence."""
        log.critical("H: the I/O thread died (%s); exiting", type(exc).__name__)
        self.stop(1)

    # ---- messages (I/O thread) ----
    def _on_message(self, source, header, payloads):
        routing_id = source[1]
        member = self.by_routing.get(routing_id)
        if member is not None and self.keys is not None and _keyed_name(member) != header.src:
            # another key on a connection that reused a member's routing id: it is not that member
            return self._refuse(routing_id, header, f"{header.op.name} from {quote(header.src)} on the "
                                                    f"connection of {_keyed_name(member)}")
        if member is not None:
            member.last_seen = time.monotonic()
        op = header.op
        if op == Op.HEARTBEAT:
            # the clock reading lets nodes estimate their offset from ours (the timeline's alignment)
            meta = {"time": time.time(), "incarnation": self.incarnation}
            if "sent" in header.meta:
                meta["sent"] = header.meta["sent"]
            self.van.reply(routing_id, Header(Op.ACK, 0, "H", meta=meta))
            if self.telemetry is not None and self.telemetry.metrics is not None and member is not None:
                self._beats.inc((member.name,))
        elif op == Op.REGISTER:
            port, formed = header.meta.get("metrics_port", 0), self.formed
            if self.telemetry is not None and 0 < port <= 65535 and routing_id not in self.by_routing and \
                    len(self._metrics_ports) < 4 * (self.cfg.num_servers + self.cfg.num_workers) + 64:
                # noted before _register, in which the job may form: its METRICS lines list this node too
                self._metrics_ports[routing_id] = port
            self._register(routing_id, header)
            if self.telemetry is not None and not formed and self.formed:
                self._show_targets()
        elif member is None and self.recovering:
            # queued by a node while no scheduler ran: it sends it again once it has registered again
            log.debug("H: %s from a node not back yet dropped", op.name)
        elif member is None:
            self._refuse(routing_id, header, f"{op.name} from a node that has not registered")
        elif op == Op.BARRIER:
            self._barrier(member, header)
        elif op == Op.FINALIZE:
            self._finalize(member, header)
        else:
            self._refuse(routing_id, header, f"the scheduler does not handle {op.name}")

    def _refuse(self, routing_id, header, message, kind="protocol"):
        self.van.complaints(log, logging.WARNING, "H: %s", escape(message))
        self.van.reply(routing_id, error_header(header.id, "H", kind, message))

    def _register(self, routing_id, header):
        meta = header.meta
        role = meta["role"]
        want = {"server": self.cfg.num_servers, "worker": self.cfg.num_workers}
        if role not in want:
            return self._refuse(routing_id, header, f"REGISTER with role {quote(role)} (expected server or worker)")
        bad = _bad_address(role, meta)
        if bad:
            return self._refuse(routing_id, header, f"REGISTER of a {role}: {bad}", kind="value")
        if self.keys is not None:
            refusal = self._keyed(header)
            if refusal:
                return self._refuse(routing_id, header, refusal, kind="error")
        if meta.get("recover"):
            return self._rejoin(routing_id, header)
        if self.formed and role == "worker" and self.cfg.elastic:
            return self._join_late(routing_id, header)
        if self.formed and role == "server" and self.cfg.replicas:
            return self._server_joins(routing_id, header)
        if self.formed:
            return self._refuse(routing_id, header, f"a {role} (pid {meta['pid']}) tried to join a job that "
                                                    f"already has all {want[role]} {role}s", kind="error")
        if sum(m.role == role for m in self.members) >= want[role]:
            return self._refuse(routing_id, header, f"a {role} (pid {meta['pid']}) registered, but the job "
                                                    f"was started for {want[role]} {role}s", kind="error")
        member = Member(routing_id, header.id, role, meta["host"], meta["port"], meta["pid"], meta.get("rank", -1),
                        meta.get("mode", ""), time.monotonic())
        self.members.append(member)
        self.by_routing[routing_id] = member
        log.info("H: %s registered from %s:%d", member.name, escape(member.host), member.port)
        if len(self.members) == self.cfg.num_servers + self.cfg.num_workers:
            self._form()

    def _keyed(self, header):
        """With CURVE: why this REGISTER cannot stand, or None. Its src is the name bound to the
        sender's key (the Van checked), so the key decides role and rank, and one name registers once."""
        meta, src = header.meta, header.src
        role, rank = parse_name(src)
        if role != meta["role"] or meta.get("rank", -1) not in (-1, rank):
            return (f"the key of {quote(src)} cannot register as a {meta['role']} of rank "
                    f"{meta.get('rank', -1)}")
        size = self.cfg.num_servers if role == "server" else self.cfg.num_workers
        if rank >= size:
            return f"{src} registered, but the job has {size} {role}s ({src[0]}0 .. {src[0]}{size - 1})"
        holder = next((m for m in self.members if m.state == "alive" and _keyed_name(m) == src), None)
        if holder is not None:
            return f"{src} is registered already (pid {holder.pid}); a key registers one node"
        meta["rank"] = rank             # the key's rank, whatever the job's other wishes
        return None

    def _table(self, role):
        """[host, port, pid] of every rank of `role`; a rank nobody alive holds is ["", 0, -1]."""
        size = self.cfg.num_servers if role == "server" else self.cfg.num_workers
        table = [["", 0, -1] for _ in range(size)]
        for m in self.members:
            if m.role == role and m.state == "alive" and 0 <= m.rank < size:
                table[m.rank] = [m.host, m.port, m.pid]
        return table

    def _join_late(self, routing_id, header):
        """Elastic: a worker registering with a formed job takes a vacant rank (the one it asks for if
        that one is vacant) and gets the table; every other node is told (WORKERS)."""
        meta = header.meta
        taken = {m.rank for m in self.members if m.role == "worker" and m.state == "alive"}
        vacant = [r for r in range(self.cfg.num_workers) if r not in taken]
        if not vacant:
            return self._refuse(routing_id, header, f"a worker (pid {meta['pid']}) tried to join an elastic job "
                                                    f"that has all {self.cfg.num_workers} workers", kind="error")
        mode = next(m.mode for m in self.members if m.role == "worker")
        if meta.get("mode", "") != mode:
            return self._refuse(routing_id, header, f"a worker (pid {meta['pid']}) joining with kvstore type "
                                                    f"{quote(meta.get('mode', ''))}; the job's is {quote(mode)}",
                                kind="value")
        wanted = meta.get("rank", -1)
        member = Member(routing_id, header.id, "worker", meta["host"], meta["port"], meta["pid"], wanted,
                        mode, time.monotonic(), rank=wanted if wanted in vacant else vacant[0])
        self.members.append(member)
        self.by_routing[routing_id] = member
        table = {"servers": self._table("server"), "workers": self._table("worker"), "mode": mode}
        self.van.reply(routing_id, Header(Op.MEMBERSHIP, header.id, "H", meta=dict(table, rank=member.rank,
                                                                                       late=True,
                                                                                       incarnation=self.incarnation)))
        log.warning("H: %s joined the running job (pid %d): %d workers", member.name, member.pid, len(taken) + 1)
        self._workers_changed(member, "joined", f"a new worker (pid {member.pid}) took the vacant rank",
                              skip=member)

    def _dead_servers(self):
        return sorted(m.rank for m in self.members if m.role == "server" and m.state == "dead")

    def _server_joins(self, routing_id, header):
        """KVPS_REPLICAS: a server registering with a formed job takes a dead server's rank (the one it
        asks for if that one is dead) and joins the tail of that rank's chains; every node is told
        (SERVERS), and the old tail of each chain hands it the state (server/handover.py)."""
        meta = header.meta
        dead = self._dead_servers()
        if not dead:
            return self._refuse(routing_id, header, f"a server (pid {meta['pid']}) tried to join a job whose "
                                                    f"{self.cfg.num_servers} servers are all alive", kind="error")
        wanted = meta.get("rank", -1)
        rank = wanted if wanted in dead else dead[0]
        for m in [m for m in self.members if m.role == "server" and m.rank == rank]:
            self.members.remove(m)
            self.by_routing.pop(m.routing_id, None)
        member = Member(routing_id, header.id, "server", meta["host"], meta["port"], meta["pid"], rank, "",
                        time.monotonic(), rank=rank)
        self.members.append(member)
        self.by_routing[routing_id] = member
        if rank in self.joined_servers:
            self.joined_servers.remove(rank)
        self.joined_servers.append(rank)
        dead = self._dead_servers()
        mode = next(m.mode for m in self.members if m.role == "worker")
        table = {"servers": self._table("server"), "workers": self._table("worker"), "mode": mode}
        self.van.reply(routing_id, Header(Op.MEMBERSHIP, header.id, "H", meta=dict(
            table, rank=rank, late=True, dead=dead, joined=list(self.joined_servers), incarnation=self.incarnation)))
        reason = f"a new server ({escape(member.host)}, pid {member.pid}) took the rank of the dead {member.name}"
        log.warning("H: %s; it joins the tail of its chains (dead servers: %s)", reason,
                    ", ".join(f"S{r}" for r in dead) or "none")
        news = Header(Op.SERVERS, 0, "H", meta={"dead": dead, "node": member.name, "reason": reason,
                                                "joined": list(self.joined_servers), "servers": table["servers"]})
        for m in self.members:
            if m.state == "alive" and m is not member:
                self.van.reply(m.routing_id, news)

    def _rejoin(self, routing_id, header):
        """Recovery: a node of the running job registers again with its rank; once every rank is back
        (or known to have left: the nodes say who), the job goes on as before the scheduler died."""
        meta = header.meta
        role, rank = meta["role"], meta.get("rank", -1)
        if not self.recovering:
            return self._refuse(routing_id, header, f"a {role} (pid {meta['pid']}) registered to recover a job, but "
                                                    f"this scheduler is not recovering one (start it with --recover)",
                                kind="error")
        size = self.cfg.num_servers if role == "server" else self.cfg.num_workers
        if not 0 <= rank < size:
            return self._refuse(routing_id, header, f"a {role} recovering rank {rank}; the job has {size} {role}s",
                                kind="value")
        for m in list(self.members):    # the same node again (a lost reply), or a rank already taken
            if m.role == role and m.rank == rank and m.state != "left":
                if m.pid != meta["pid"]:
                    return self._refuse(routing_id, header, f"{m.name} is already back (pid {m.pid}); pid "
                                                            f"{meta['pid']} cannot take its rank", kind="error")
                self.members.remove(m)
                self.by_routing.pop(m.routing_id, None)
        member = Member(routing_id, header.id, role, meta["host"], meta["port"], meta["pid"], rank,
                        meta.get("mode", ""), time.monotonic(), rank=rank)
        self.members.append(member)
        self.by_routing[routing_id] = member
        for name in meta.get("left", ()):
            who, left_rank = parse_name(name)
            if who == "worker" and left_rank < self.cfg.num_workers and \
                    not any(m.role == "worker" and m.rank == left_rank for m in self.members):
                self.members.append(Member(b"", 0, "worker", "", 0, 0, left_rank, "", 0.0, rank=left_rank,
                                           state="left"))
        modes = [m.mode for m in self.members if m.role == "worker" and m.mode]
        table = {"servers": self._table("server"), "workers": self._table("worker"),
                 "mode": modes[0] if modes else ""}
        self.van.reply(routing_id, Header(Op.MEMBERSHIP, header.id, "H",
                                          meta=dict(table, rank=rank, incarnation=self.incarnation)))
        log.warning("H: %s (pid %d) is back in the recovered job", member.name, member.pid)
        back = {(m.role, m.rank) for m in self.members}
        if len(back) == self.cfg.num_servers + self.cfg.num_workers:
            self.recovering = False
            log.warning("H: every node is back; the job goes on")
            for group in GROUPS:
                self._release(group)
            self._maybe_end()

    def _workers_changed(self, member, change, reason, skip=None):
        meta = {"workers": self._table("worker"), "node": member.name, "change": change, "reason": reason}
        for m in self.members:
            if m.state == "alive" and m is not skip:
                self.van.reply(m.routing_id, Header(Op.WORKERS, 0, "H", meta=meta))

    def _form(self):
        for role in ("server", "worker"):
            group = [m for m in self.members if m.role == role]
            size = len(group)
            taken = set()
            for m in group:
                if 0 <= m.wanted_rank < size and m.wanted_rank not in taken:
                    m.rank = m.wanted_rank
                    taken.add(m.rank)
            free = iter(r for r in range(size) if r not in taken)
            for m in group:
                if m.rank < 0:
                    m.rank = next(free)
        workers = sorted((m for m in self.members if m.role == "worker"), key=lambda m: m.rank)
        servers = sorted((m for m in self.members if m.role == "server"), key=lambda m: m.rank)
        modes = {m.mode for m in workers}
        if len(modes) > 1:
            message = "workers created different kvstore types: " + ", ".join(f"{m.name} {m.mode}" for m in workers)
            for m in self.members:
                self.van.reply(m.routing_id, error_header(m.request_id, "H", "value", message))
            log.error("H: %s", message)
            return self.stop(1)
        self.formed = True
        table = {"servers": [[m.host, m.port, m.pid] for m in servers],
                 "workers": [[m.host, m.port, m.pid] for m in workers],
                 "mode": modes.pop()}
        for m in self.members:
            self.van.reply(m.routing_id, Header(Op.MEMBERSHIP, m.request_id, "H",
                                                meta=dict(table, rank=m.rank, incarnation=self.incarnation)))
        log.info("H: job formed: %d servers, %d workers, mode %s", len(servers), len(workers), table["mode"])

    def _barrier(self, member, header):
        group = header.meta["group"]
        if group not in GROUPS:
            return self._refuse(member.routing_id, header,
                                f"barrier group {quote(group)} is not one of {sorted(GROUPS)}",
                                kind="value")
        entry = (member.routing_id, header.id, member.name)
        if entry not in self.barriers[group]:      # a recovering node may send its barrier twice
            self.barriers[group].append(entry)
        self._release(group)

    def _release(self, group):
        if self.recovering:         # the nodes not back yet are members too: wait for them
            return
        waiting = self.barriers[group]
        live = [m for m in self.members if m.role in GROUPS[group] and m.state == "alive"]
        if waiting and len(waiting) >= len(live):
            last = waiting[-1][2]      # who arrived last (Horovod's join() returns that rank)
            for routing_id, request_id, _ in waiting:
                self.van.reply(routing_id, Header(Op.ACK, request_id, "H", meta={"last": last}))
            self.barriers[group] = []

    def _finalize(self, member, header):
        self.van.reply(member.routing_id, Header(Op.ACK, header.id, "H"))
        if member.state == "alive":
            member.state = "left"
            reason = header.meta.get("reason")         # a script that raised (kvps.kvstore.process.exit_reason)
            if reason and self._ending is not None:
                # the job has already failed, and this worker's script raised because of it (the
                # NodeFailure it was sent): the culprit is already named
                log.info("H: %s left the failed job: %s", member.name, escape(reason))
            elif reason:
                log.warning("H: %s left the job: %s", member.name, escape(reason))
            else:
                log.info("H: %s finished", member.name)
            self._tell_all(Header(Op.NODE_LEFT, 0, "H", meta={"node": member.name,
                                                               "reason": reason or CLOSED}))
            for group in GROUPS:
                self._release(group)
        self._maybe_end()

    def _tell_all(self, header):
        for m in self.members:
            if m.state == "alive":
                self.van.reply(m.routing_id, header)

    def _maybe_end(self):
        workers = [m for m in self.members if m.role == "worker"]
        if not self.formed or self.recovering or any(m.state == "alive" for m in workers):
            return
        for m in self.members:
            if m.role == "server" and m.state == "alive":
                self.van.reply(m.routing_id, Header(Op.SHUTDOWN, 0, "H"))
        # An elastic job whose workers all died has failed too, though none of them was a failure.
        self.stop(1 if self.failures or not any(m.state == "left" for m in workers) else 0)

    def _fail(self, reason):
        """The job is broken: the servers exit non-zero (SHUTDOWN naming why), the workers already
        have NODE_FAILED; this scheduler exits 1 as soon as those messages are out, without waiting
        for the survivors to fall silent (and then blaming them for it)."""
        for m in self.members:
            if m.role == "server" and m.state == "alive":
                self.van.reply(m.routing_id, Header(Op.SHUTDOWN, 0, "H", meta={"failed": reason}))
        if self._ending is None:
            self._ending = (1, time.monotonic() + min(0.5, self.cfg.heartbeat_interval))

    def _fail_over(self, member, reason):
        """Chain replication (KVPS_REPLICAS): a dead server's ranges go on at the next live server of
        each of their chains, and every node is told (SERVERS). False when some range has no live
        server left: the job fails as without replicas."""
        dead = self._dead_servers()
        lost = chains.lost(self.cfg.num_servers, self.cfg.replicas, set(dead))
        if lost:
            log.error("H: %s; the key ranges of %s have no live replica left (KVPS_REPLICAS=%d)", reason,
                      ", ".join(f"S{h}" for h in lost), self.cfg.replicas)
            return False
        self.failed_over.append(reason)
        log.warning("H: %s; its key ranges go on at their replicas (dead servers: %s)", reason,
                    ", ".join(f"S{r}" for r in dead))
        self._tell_all(Header(Op.SERVERS, 0, "H", meta={"dead": dead, "node": member.name, "reason": reason,
                                                        "joined": list(self.joined_servers)}))
        for group in GROUPS:
            self._release(group)
        return True

    def _check(self):
        """Heartbeat watch (timer on the I/O thread)."""
        now = time.monotonic()
        if self._ending is not None:
            if now >= self._ending[1]:
                self.stop(self._ending[0])
            return
        if self.recovering and now - self._started > self.cfg.connect_timeout:
            back = ", ".join(m.name for m in self.members if m.state == "alive") or "nobody"
            reason = (f"the recovered scheduler saw only {back} register again within "
                      f"{self.cfg.connect_timeout:g} s (KVPS_CONNECT_TIMEOUT)")
            log.error("H: %s", reason)
            self.failures.append(reason)
            self._tell_all(Header(Op.NODE_FAILED, 0, "H", meta={"node": "H", "reason": reason}))
            return self._fail(reason)
        for m in self.members:
            silent = now - m.last_seen
            if m.state == "alive" and silent > self.cfg.heartbeat_timeout:
                m.state = "dead"
                reason = (f"no heartbeat from {m.name} ({m.host}, pid {m.pid}) for {silent:.1f} s "
                          f"(KVPS_HEARTBEAT_TIMEOUT={self.cfg.heartbeat_timeout:g})")
                if self.formed and m.role == "server" and self.cfg.replicas and self._fail_over(m, reason):
                    continue
                if self.formed and m.role == "worker" and self.cfg.elastic:
                    self.removed.append(reason)
                    log.warning("H: %s; removing it from the elastic job", reason)
                    self._workers_changed(m, "removed", reason)
                    for group in GROUPS:
                        self._release(group)
                    self._maybe_end()
                    continue
                self.failures.append(reason)
                log.error("H: %s", reason)
                if not self.formed:
                    message = f"the job cannot form: {reason}"
                    for other in self.members:
                        if other is not m:
                            self.van.reply(other.routing_id, error_header(other.request_id, "H", "node", message))
                    return self.stop(1)
                self._tell_all(Header(Op.NODE_FAILED, 0, "H", meta={"node": m.name, "reason": reason}))
                return self._fail(f"{m.name} died: {reason}")
        if not self.formed and now - self._started > self.cfg.connect_timeout:
            have = ", ".join(m.name for m in self.members) or "nobody"
            message = (f"only {len(self.members)} of {self.cfg.num_servers + self.cfg.num_workers} nodes registered "
                       f"within {self.cfg.connect_timeout:g} s (KVPS_CONNECT_TIMEOUT): {have}")
            log.error("H: %s", message)
            for m in self.members:
                self.van.reply(m.routing_id, error_header(m.request_id, "H", "node", message))
            self.stop(1)
