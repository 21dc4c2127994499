"""Chain replication on a server (KVPS_REPLICAS; docs/replication.md).

The key ranges of home rank h are held by the chain h, h+1, ..., h+R of servers (kvps/wire/chains.py);
workers send to its head. A member that handles a request which changes state (INIT, PUSH, the push
of a PUSHPULL, ROW_SPARSE_PUSH, LOAD) forwards a copy to its successor in the order it handles
them, so every member applies the same updates in the same order, bit for bit; and it holds its
own reply until the successor has answered the copy, so a reply to a worker means every live
member has applied the update:

    chain = Chain(server)
    fwd = chain.begin(header, payloads)     # before the handler runs (its reply may come at once)
    chain.send(fwd)                         # the handler took it: the copy goes to the successor
    chain.hold(routing_id, request, ...)    # in Server.answer: True while the copy is unanswered
    chain.acked(peer, reply)                # the successor's reply: the held answer goes out

Copies keep the worker's request id and name (meta "chain" marks them; their replies name the
worker in meta "for"), so a server's window (kvps/wire/window.py) sees one stream of ids per worker
and range whether they came from the worker or along the chain.

With one replica in a sync job (`Chain.defer`) a copy of a PUSH or PUSHPULL goes without its values
("deferred"): its pushes hold their places in the replica's rounds (kvps/ps/store.py: Deferred), and
when the head closes a round it sends the round's sum once (ROUND) instead of every worker's values:
a chain link carries M bytes a round instead of W·M, and the replica takes one sum instead of
adding W arrays. The replica applies that sum as its own round's, so both hold the same bits. The
sums of the rounds that the requests of one I/O turn closed go in one ROUND, after that turn's
copies (`_send_turn`); the replica answers a ROUND once it has
applied it, and that answer stands for the deferred copies too (they went before it on the same
connection and get no answer of their own): a worker's reply waits until the replica has applied
every sum made so far (`hold`, `round_applied`). If the head dies first, the workers send their
unanswered requests to the replica, as below, and their values fill the places the copies hold
(Server._fill): the round closes with the same pushes, in the same order, as at the head. Where the
next server is on the same host the sum does not cross the socket: it lies in the head's value
segments (kvps/wire/shm.py: Values), the ROUND names where, and the next server reads it there
(mapped read-only, as a co-located worker reads its pulls): without an update rule it takes it as
its value, no copy. The head writes that memory again only once an answer names the ROUND as
released. With R >= 2 the copies keep their values (a middle server's death would need its head to
keep each round's sum until the tail had it).

    chain.round(slot, total)                # Store.on_round, as a round closes: the sum to the next server
    chain.acked(peer, reply)                # its answer to a ROUND (meta "for" names us): round_applied

When a server dies the scheduler says so (SERVERS): every chain closes up, copies waiting on the dead
one go to the next member (which answers one it has already applied without applying it again), and
the workers send what they had in flight to the new head the same way (kvps/wire/requests.py). When
a new server takes a dead one's rank it joins the tail of that rank's chains, and the old tail hands
it the state first (server/handover.py).
"""
import collections
import dataclasses
import logging
import os

import numpy as np

from kvps.wire import chains
from server import handover
from kvps.wire.membership import node_name
from kvps.errors import ProtocolError
from kvps.wire.protocol import Entry, Header, Op, dtype_code, quote
from kvps.wire.shm import LINK_META, ShmRefused, inlined

log = logging.getLogger("kvps.server")

EARLY_BYTES = 1 << 16      # a PUSHPULL reply with this many bytes of payloads sends them before its push is replicated
FORWARDED = frozenset({Op.INIT, Op.PUSH, Op.PUSHPULL, Op.ROW_SPARSE_PUSH, Op.LOAD})
DEFERRED = frozenset({Op.PUSH, Op.PUSHPULL})        # copied without values where the chain defers
LOCAL_META = (*LINK_META, "pull")       # about the worker's link to this server: not for the next one


@dataclasses.dataclass
class Forward:
    """A copy sent along the chain and the reply it holds back."""
    home: int
    peer: str                   # the successor it went to
    header: Header              # the copy
    payloads: list
    answer: tuple = None        # (routing_id, request, reply, payloads) once this server has answered
    acked: bool = False
    error: Header = None        # the successor's ERROR, which replaces this server's own reply
    deferred: bool = False      # a copy without values: no answer of its own, the successor's ROUND answers do


class Sending:
    """The tracker of a round's sum sent without a copy (Store.forwarding): done once zmq let go."""
    __slots__ = ("done",)

    def __init__(self):
        self.done = False

    def release(self):
        self.done = True


@dataclasses.dataclass
class RoundSum:
    """A round's sum on its way to the next server of its slot's chain."""
    slot: object                # kvps.ps.store.Slot
    total: object               # the array
    sending: Sending            # released once the next server no longer reads `total`
    home: int
    version: int
    at: tuple = None            # (segment, offset) of `total` in our value segments; None: it goes inline
    seq: int = 0                # its number among the sums made for that server (Chain.seq)


class Held:
    """The zmq tracker of a held reply (Store.sent): not done while the reply is held, then as
    zmq's tracker of it says (a small reply is copied when it is sent: it has none)."""

    def __init__(self):
        self.tracker = None
        self.held = True

    def bind(self, tracker):
        self.tracker = tracker

    @property
    def done(self):
        return not self.held and (self.tracker is None or self.tracker.done)


class Chain:
    """One server's part in the chains it belongs to (see the module docstring)."""

    def __init__(self, server):
        self.server = server
        self.replicas = server.cfg.replicas
        self.num_servers = len(server.membership["servers"])
        self.dead = set(server.membership.get("dead", ()))
        self.joined = list(server.membership.get("joined", ()))      # kvps/wire/chains.py
        self._successors = {}               # home rank -> successor(home), until the servers change
        self.pending = {}                   # (worker name, request id) -> Forward
        self.connected = set()
        self.forwarded = 0                  # copies sent (for server_stats)
        self.rounds = 0                     # round sums sent (for server_stats)
        self.rounds_shared = 0              # of which the next server read in shared memory
        # copies sent without values (set with the store: one replica, sync), and on a replica the
        # Deferred places each such copy holds: (worker, request id) -> [(key, part, Deferred)]
        self.defer = False
        self.places = {}
        # test only: the server so named never sends a round sum, so its replicas' rounds wait for
        # the workers' values once it is killed (tests/cluster/test_replication.py)
        self.hold_sums = os.environ.get("KVPS_TEST_HOLD_ROUNDS")
        # the round sums of the request being handled, sent after its copy (Server._replicated), in the
        # turn's ROUND to each next server: the copy of a round's last push must reach it before the sum
        self.handling = None
        self.turn = {}                      # (next server, home rank) -> [RoundSum] to send this I/O turn
        # Per next server: the round sums made for it, the highest number up to which it has applied
        # them all (its answers to ROUNDs; `gaps`: numbers it could not read in our memory, sent
        # again inline), and the replies to deferred copies held until it has: [(number, key)]
        self.seq, self.applied, self.gaps, self.waiting = {}, {}, {}, {}
        # ROUND id -> (peer, [RoundSum], the highest number in it) until answered; then, for those
        # in our segments, (peer, [RoundSum]) until the peer says it no longer reads them (released)
        self.sums, self.lent = {}, {}
        # the value segments offered to each peer; peers that cannot read them
        self.offered = {}
        self.inline = set()
        self._sum_id = 0

    def successor(self, home):
        """The server this one forwards home rank `home`'s updates to, or None (remembered until
        the servers change: it is asked once a round of each key)."""
        try:
            return self._successors[home]
        except KeyError:
            nxt = self._successors[home] = chains.successor(home, self.server.rank, self.num_servers,
                                                            self.replicas, self.dead, self.joined)
            return nxt

    def begin(self, header, payloads):
        """The Forward for a request this server is about to handle, or None (no copy needed)."""
        home = header.meta.get("home")
        if header.op not in FORWARDED or home is None:
            return None
        nxt = self.successor(home)
        if nxt is None:
            return None
        deferred = self.defer and header.op in DEFERRED
        if deferred:
            meta = {k: v for k, v in header.meta.items() if k not in LOCAL_META and k != "codec"}
            meta["deferred"] = True
            copy = Header(header.op, header.id, header.src, [Entry(*e[:4], 0) for e in header.keys], meta)
            payloads = []
        else:       # the values a co-located worker put in shared memory go inline
            copy, payloads = inlined(header, payloads, self._worker_memory(header), LOCAL_META)
        copy.meta["chain"] = True
        fwd = Forward(home, node_name("server", nxt), copy, payloads, deferred=deferred)
        self.pending[(header.src, header.id)] = fwd
        return fwd

    def _worker_memory(self, header):
        """view(segment, offset, nbytes) of the memory that the sender of `header` shares with us."""
        mapped = self.server.shared.get(header.src)

        def view(segment, offset, nbytes):
            try:
                if mapped is None:
                    raise ShmRefused("it never attached any")
                return mapped.view(segment, offset, nbytes)
            except ShmRefused as exc:
                raise ProtocolError(f"{header.op.name} from {quote(header.src)} names shared memory: {exc}") from None
        return view

    def handle(self, fwd, handler):
        """Run handler() for a request whose copy is `fwd` (or None), then send the copy; the sums of
        the rounds it closed go at the end of the I/O turn (_send_turn)."""
        self.handling = []
        try:
            handler()
        except Exception:
            if fwd is not None:
                self.cancel(fwd)
            raise
        finally:
            sums, self.handling = self.handling, None
        if fwd is not None:
            self.send(fwd)
        for peer, rsum in sums:
            if not self.turn:
                # the I/O thread runs this once it has handled all it read this turn (Van._flush),
                # so the ROUND goes after every copy queued before it
                self.server.van.call_soon(self._send_turn)
            self.turn.setdefault((peer, rsum.home), []).append(rsum)

    def _send_turn(self):
        """Send the round sums that the requests of one I/O turn made: one ROUND per next server
        and home rank (was one per request: a server that reads a batch of per-key requests closes
        a round with most of them). A sum for a server that is no longer next (it died while the
        turn was handled) is not sent: the chain has closed up (changed)."""
        turn, self.turn = self.turn, {}
        for (peer, home), batch in turn.items():
            nxt = self.successor(home)
            if nxt is None or node_name("server", nxt) != peer:
                for rsum in batch:
                    rsum.sending.release()
                continue
            self._send_sums(peer, batch)

    def round(self, slot, total):
        """A round of `slot` closed here with `total` as its sum: send it to the next server of the
        slot's chain, whose copies of the round's pushes wait for it (they go first, on the same
        connection). zmq sends it without a copy; the store keeps it until then."""
        if not self.defer:
            return
        home = self.server.homes.get(slot.id, self.server.rank)
        nxt = self.successor(home)
        if nxt is None:
            return
        peer = node_name("server", nxt)
        seq = self.seq[peer] = self.seq.get(peer, 0) + 1
        if self.hold_sums == self.server.name:      # (test only) made, never sent, so never applied
            return
        self._connect(peer)
        sending = Sending()
        self.server.store.forwarding(slot, sending)
        self.rounds += 1
        rsum = RoundSum(slot, total, sending, home, slot.version, self._shared(peer, total), seq)
        if self.handling is not None:
            self.handling.append((peer, rsum))
        else:
            self._send_sums(peer, [rsum])

    def _send_sums(self, peer, sums, through=None):
        """One ROUND to `peer` with the sums [RoundSum] of one home rank: those in our value segments
        named by place, the others as payloads. Its answer says that every sum up to number
        `through` (default: the highest in it) is applied there."""
        keys, payloads, places, inline = [], [], [], []
        for index, rsum in enumerate(sums):
            key, part = rsum.slot.id
            if rsum.at is None:
                keys.append(Entry.of(key, part, rsum.total))
                if rsum.total.nbytes:
                    payloads.append(memoryview(np.ascontiguousarray(rsum.total).reshape(-1).view(np.uint8)))
                inline.append(rsum)
            else:
                keys.append(Entry(key, part, dtype_code(rsum.total.dtype), rsum.total.shape, 0))
                places.append([index, *rsum.at])
        meta = {"home": sums[0].home, "rounds": [rsum.version for rsum in sums]}
        self._sum_id = sum_id = self._sum_id + 1
        self.sums[sum_id] = (peer, sums, max(rsum.seq for rsum in sums) if through is None else through)
        if places:
            meta["at"] = places
            values = self.server.values
            offers = values.offers(self.offered.get(peer, 0))
            if offers:
                meta["segments"] = offers
                self.offered[peer] = values.count
            self.rounds_shared += len(places)

        def sent():             # zmq let go of the payloads
            for rsum in inline:
                rsum.sending.release()
        self.server.van.send(peer, Header(Op.ROUND, sum_id, self.server.name, keys, meta), payloads,
                             on_sent=sent if inline else None, bundle=True)

    def _shared(self, peer, total):
        """(segment, offset) of a round's sum for a next server on this host that reads our value
        segments, else None (it goes inline)."""
        values = self.server.values
        if values is None or peer in self.inline:
            return None
        if self.server.membership["servers"][int(peer[1:])][0] != self.server.host:
            return None
        return values.locate(total)

    def round_applied(self, peer, reply):
        """The next server's answer to a ROUND: it applied those sums, so the replies that waited
        for them go; the sums it names as released are in memory of ours that it no longer reads.
        Or it could not read those in our memory (meta inline): they go again inline, and every
        later one, and nothing past them counts as applied until they are. Or it refused them
        (ERROR): the replies that waited for them go as that error."""
        found = self.sums.pop(reply.id, None)
        if found is None or found[0] != peer:
            return
        _, sums, through = found
        shared = [rsum for rsum in sums if rsum.at is not None]
        if shared:
            self.lent[reply.id] = (peer, shared)
        for sum_id in reply.meta.get("released", ()):
            lent = self.lent.get(sum_id)
            if lent is not None and lent[0] == peer:
                del self.lent[sum_id]
                for rsum in lent[1]:
                    rsum.sending.release()
        gaps = self.gaps.setdefault(peer, set())
        if reply.op == Op.ERROR:
            # It refused them (a bug, not a dead server): the replies waiting for them say so.
            log.error("%s: %s refused round sums: %s", self.server.name, peer, reply.meta.get("message"))
            low = min(rsum.seq for rsum in sums)
            for needs, key in self.waiting.get(peer, ()):
                fwd = self.pending.get(key)
                if needs >= low and fwd is not None:
                    fwd.error = reply
        elif reply.meta.get("inline"):
            if peer not in self.inline:
                self.inline.add(peer)
                log.warning("%s: %s cannot read round sums in shared memory; they go inline from now on",
                            self.server.name, peer)
            self.lent.pop(reply.id, None)       # it read none of them (Server._sums_shared)
            for rsum in shared:
                rsum.at = None
                gaps.add(rsum.seq)
            if shared:
                self._send_sums(peer, shared, through)
        elif gaps:
            gaps.difference_update(rsum.seq for rsum in sums)
        self.applied[peer] = max(self.applied.get(peer, 0), through)
        self._answer_waiting(peer)

    def _done_through(self, peer):
        """The number up to which `peer` has applied every round sum made for it."""
        gaps = self.gaps.get(peer)
        applied = self.applied.get(peer, 0)
        return min(applied, min(gaps) - 1) if gaps else applied

    def _answer_waiting(self, peer):
        waiting = self.waiting.get(peer)
        if not waiting:
            return
        done = self._done_through(peer)
        while waiting and waiting[0][0] <= done:
            key = waiting.popleft()[1]
            fwd = self.pending.get(key)
            if fwd is not None and fwd.answer is not None and fwd.peer == peer:
                self._release(key, fwd)

    def cancel(self, fwd):
        """The handler refused the request: no copy goes, and its ERROR is sent at once."""
        self.pending.pop((fwd.header.src, fwd.header.id), None)

    def send(self, fwd):
        self._connect(fwd.peer)
        self.forwarded += 1
        self.server.van.send(fwd.peer, fwd.header, fwd.payloads, bundle=True)

    def hold(self, routing_id, request, reply, payloads, on_tracker=None):
        """True when this reply must wait for the successor (it is kept; payloads that view slot
        values count as being sent from now on, so the store copies a value before it changes one,
        Store._own); False: send it now (possibly as the successor's ERROR, which `reply` then is)."""
        key = (request.src, request.id)
        fwd = self.pending.get(key)
        if fwd is None or fwd.answer is not None:
            return False
        if fwd.deferred and not fwd.acked:
            # Its rounds have closed here, so their sums are made (on_round comes before the
            # replies): once the successor has applied every sum made so far, it has them all
            # (and the copy, which went before them on the same connection).
            needs = self.seq.get(fwd.peer, 0)
            if needs <= self._done_through(fwd.peer) and fwd.error is None:
                del self.pending[key]
                return False
            self.waiting.setdefault(fwd.peer, collections.deque()).append((needs, key))
            if request.op == Op.PUSHPULL and reply.op == Op.VALUE and _nbytes(payloads) >= EARLY_BYTES:
                # The pull's values go now, so their bytes need not wait for the sum's way to the
                # successor; the acknowledgement of the push waits (the worker's call ends with it,
                # and a worker that must ask a new head asks for both again). Not for values in
                # shared memory or small ones: there the extra message costs more than it saves.
                early = Header(reply.op, reply.id, reply.src, reply.keys, dict(reply.meta or {}, held=True))
                self.server.van.reply(routing_id, early, payloads, on_tracker=on_tracker)
                reply, payloads, on_tracker = Header(Op.ACK, request.id, self.server.name), (), None
        elif fwd.acked:
            del self.pending[key]
            return False
        tracker = Held()
        if on_tracker is not None:
            on_tracker(tracker)
        fwd.answer = (routing_id, request, reply, list(payloads), tracker)
        return True

    def acked(self, peer, reply):
        """A successor answered a copy (a deferred one only when it refused it), or a ROUND (I/O thread)."""
        if reply.meta.get("for") == self.server.name:
            return self.round_applied(peer, reply)
        key = (reply.meta.get("for"), reply.id)
        fwd = self.pending.get(key)
        if fwd is None or fwd.peer != peer:
            return          # a copy re-sent to a later successor, or one answered twice
        fwd.acked = True
        if reply.op == Op.ERROR:
            log.error("%s: %s refused a copy of %s from %s: %s", self.server.name, peer, reply.op.name,
                      key[0], reply.meta.get("message"))
            fwd.error = reply
        if fwd.answer is not None:
            self._release(key, fwd)

    def _release(self, key, fwd):
        del self.pending[key]
        routing_id, request, reply, payloads, tracker = fwd.answer
        tracker.held = False
        if fwd.error is not None and reply.op != Op.ERROR:
            reply = Header(Op.ERROR, request.id, self.server.name,
                           meta={"kind": fwd.error.meta.get("kind", "error"),
                                 "message": f"replica {fwd.peer}: {fwd.error.meta.get('message', '')}"})
            payloads = []
        self.server.send_answer(routing_id, request, reply, payloads, tracker.bind)

    def changed(self, meta):
        """The scheduler's SERVERS (on the I/O thread). A server died: every chain closes up, and
        the copies the dead one held go on to the next member, or, where this server is now a
        chain's tail, count as applied. A server joined: where this server is the tail it joins,
        it hands it the chain's state (server/handover.py) before any copy, then forwards to it."""
        homes = chains.homes_of(self.server.rank, self.num_servers, self.replicas)
        before = {home: self.successor(home) for home in homes}
        self.dead, self.joined = set(meta["dead"]), list(meta.get("joined", ()))
        self._successors = {}
        if "servers" in meta:
            self.server.membership = dict(self.server.membership, servers=meta["servers"])
        for table in (self.sums, self.lent):
            for sum_id, (peer, sums, *_) in list(table.items()):
                if int(peer[1:]) in self.dead:   # it will never read that memory: ours again
                    del table[sum_id]
                    for rsum in sums:
                        rsum.sending.release()
        for rank in self.dead:
            for table in (self.waiting, self.gaps):
                table.pop(node_name("server", rank), None)
        for rank in self.dead:          # a DEALER would keep what is queued for it for good
            peer = node_name("server", rank)
            if peer in self.connected:
                self.server.van.disconnect(peer)
                self.connected.discard(peer)
        for home in homes:
            nxt = self.successor(home)
            if nxt is not None and nxt != before[home] and nxt in self.joined:
                self.offered.pop(node_name("server", nxt), None)       # a new process: it maps anew
                self.inline.discard(node_name("server", nxt))
                self._connect(node_name("server", nxt))
                header, payloads = handover.state(self.server, home)
                self.server.van.send(node_name("server", nxt), header, payloads)
                log.warning("%s: handed the ranges of S%d (%d slots) to S%d, which joined their chain",
                            self.server.name, home, len(header.meta["slots"]), nxt)
        for key, fwd in list(self.pending.items()):
            if int(fwd.peer[1:]) not in self.dead or fwd.acked:
                continue
            nxt = self.successor(fwd.home)
            if nxt is None:
                fwd.acked = True
                if fwd.answer is not None:
                    self._release(key, fwd)
                continue
            fwd.peer = node_name("server", nxt)
            self.send(fwd)

    def _connect(self, peer):
        if peer not in self.connected:
            host, port, _ = self.server.membership["servers"][int(peer[1:])]
            self.server.van.connect(peer, host, port)
            self.connected.add(peer)


def _nbytes(payloads):
    return sum(memoryview(p).nbytes for p in payloads)
