"""The scheduler daemon: one ROUTER socket, one I/O thread, all state in one object.

Job life cycle:
1. Every node sends REGISTER (role, address, wanted rank, kvstore mode). When all
   S servers and W workers have registered, ranks are assigned (wanted ranks
   first, then arrival order) and each node gets the MEMBERSHIP table.
2. Nodes send heartbeats; a node silent for KVPS_HEARTBEAT_TIMEOUT is declared
   dead and every other node is told (NODE_FAILED), so nobody hangs on it.
3. BARRIER requests are answered when every live member of the group has arrived.
4. A worker that finishes sends FINALIZE; the others are told it left (NODE_LEFT,
   not a failure). When every worker has finished or died, the servers get
   SHUTDOWN and the scheduler exits: 0 if nothing died, 1 otherwise.

The decoder has checked every message's meta against its op's schema
(kvps.wire.protocol.SCHEMA), so handlers read fields without re-checking types.
"""
import dataclasses
import logging
import threading
import time

from kvps.wire.membership import node_name
from kvps.wire.protocol import Header, Op, error_header, quote
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


class Scheduler:
    """Runs one job. `serve()` blocks until the job ends and returns the exit code."""

    def __init__(self, cfg, host="127.0.0.1", port=0):
        self.cfg = cfg
        self.van = Van("H", self._on_message)
        self.van.limit_messages(cfg.max_message_bytes)
        self.van.when_dead(self._io_died)
        self.port = self.van.bind(host, port)
        self.host = host
        self.members = []                       # in registration order
        self.by_routing = {}
        self.formed = False
        self.barriers = {g: [] for g in GROUPS}  # group -> [(routing_id, request_id, name)] in arrival order
        self.failures = []
        self.exit_code = None
        self._done = threading.Event()
        self._started = time.monotonic()

    def serve(self):
        self.van.every(self.cfg.heartbeat_interval / 2, self._check)
        self.van.start()
        try:
            self._done.wait()
        except KeyboardInterrupt:
            self.exit_code = 130
        self.van.stop()
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
        if member is not None:
            member.last_seen = time.monotonic()
        op = header.op
        if op == Op.HEARTBEAT:
            self.van.reply(routing_id, Header(Op.ACK, 0, "H"))
        elif op == Op.REGISTER:
            self._register(routing_id, header)
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
            self.van.reply(m.routing_id, Header(Op.MEMBERSHIP, m.request_id, "H", meta=dict(table, rank=m.rank)))
        log.info("H: job formed: %d servers, %d workers, mode %s", len(servers), len(workers), table["mode"])

    def _barrier(self, member, header):
        group = header.meta["group"]
        if group not in GROUPS:
            return self._refuse(member.routing_id, header,
                                f"barrier group {quote(group)} is not one of {sorted(GROUPS)}",
                                kind="value")
        self.barriers[group].append((member.routing_id, header.id, member.name))
        self._release(group)

    def _release(self, group):
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
            log.info("H: %s finished", member.name)
            self._tell_all(Header(Op.NODE_LEFT, 0, "H", meta={"node": member.name, "reason": "it closed its kvstore"}))
            for group in GROUPS:
                self._release(group)
        self._maybe_end()

    def _tell_all(self, header):
        for m in self.members:
            if m.state == "alive":
                self.van.reply(m.routing_id, header)

    def _maybe_end(self):
        workers = [m for m in self.members if m.role == "worker"]
        if not self.formed or any(m.state == "alive" for m in workers):
            return
        for m in self.members:
            if m.role == "server" and m.state == "alive":
                self.van.reply(m.routing_id, Header(Op.SHUTDOWN, 0, "H"))
        self.stop(1 if self.failures else 0)

    def _check(self):
        """Heartbeat watch (timer on the I/O thread)."""
        now = time.monotonic()
        for m in self.members:
            silent = now - m.last_seen
            if m.state == "alive" and silent > self.cfg.heartbeat_timeout:
                m.state = "dead"
                reason = (f"no heartbeat from {m.name} ({m.host}, pid {m.pid}) for {silent:.1f} s "
                          f"(KVPS_HEARTBEAT_TIMEOUT={self.cfg.heartbeat_timeout:g})")
                self.failures.append(reason)
                log.error("H: %s", reason)
                if not self.formed:
                    message = f"the job cannot form: {reason}"
                    for other in self.members:
                        if other is not m:
                            self.van.reply(other.routing_id, error_header(other.request_id, "H", "node", message))
                    return self.stop(1)
                self._tell_all(Header(Op.NODE_FAILED, 0, "H", meta={"node": m.name, "reason": reason}))
                for group in GROUPS:
                    self._release(group)
                self._maybe_end()
        if not self.formed and now - self._started > self.cfg.connect_timeout:
            have = ", ".join(m.name for m in self.members) or "nobody"
            message = (f"only {len(self.members)} of {self.cfg.num_servers + self.cfg.num_workers} nodes registered "
                       f"within {self.cfg.connect_timeout:g} s (KVPS_CONNECT_TIMEOUT): {have}")
            log.error("H: %s", message)
            for m in self.members:
                self.van.reply(m.routing_id, error_header(m.request_id, "H", "node", message))
            self.stop(1)
