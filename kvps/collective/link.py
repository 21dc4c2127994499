"""The ring's chunks over one plain TCP connection to the right neighbour (KVPS_RING_LINK).

Over ZeroMQ a chunk passes four threads on its way: the caller hands it to the node's I/O thread,
which hands it to zmq's, which writes it; on the far side zmq's thread reads it into a message,
the node's I/O thread takes that message and wakes the caller, which sums or copies it into
place. Between workers that share no memory (other hosts, or KVPS_SHM=0) this module sends each
chunk from one thread of the sender's own and has the receiving caller read it straight from the
socket: into its place in the fused buffer in the all-gather, into a scratch chunk that it then sums
in the reduce-scatter. No thread hand-off on the receiving side, and no pass over the data
between the kernel and its place.

    links = Links.of(node, cfg, rank, size, on_broken, offer)   # one ring member's two ends
    links.message(src, meta)          # I/O thread: the left's offer, or the right's refusal
    out, inn = links.start(seq, deadline, n, code, epoch, check)   # at each collective's start
    out.send(head, piece, done)       # queued; done() runs once the bytes are in the kernel
    inn.read(head, into, deadline)    # a chunk's head checked, its bytes read into `into`

The handshake goes over the ring's ZeroMQ connection, which already reaches the right neighbour:
the sender's offer (its listening port, a random nonce, the first collective that uses the link)
travels before any chunk of the collective it is sent in, so the right neighbour has it by the
end of that collective. The right neighbour connects at its next collective and sends the nonce
and YES (or NO); the sender accepts at the offer's `from_seq` only a connection that presents its
nonce in time, and drops any other. The host is the one the job registered for the left
neighbour, never one from a message. Under CURVE the link is off: its bytes would not be
encrypted.

Each chunk is a 20-byte head (collective, phase, step, chunk, dtype, byte count), then its bytes. A
neighbour sends chunks in exactly the order the receiver takes them (kvps/collective/ring.py), so
a head that is not the one expected is a protocol error, not a reordering. The ring also announces
each collective on the link over ZeroMQ (phase "start"), for a worker that has joined and waits
for collectives to serve rather than reading the link.
"""
import hmac
import logging
import os
import queue
import socket
import struct
import threading
import time

import numpy as np

from kvps.errors import KVPSError, KVTimeoutError, ProtocolError
from kvps.wire.protocol import Entry, Header, Op

log = logging.getLogger("kvps.ring")

HEAD = struct.Struct("<IBHIBQ")     # collective, phase, step, chunk, dtype code, bytes
PHASES = {"rs": 0, "ag": 1}
NONCE_BYTES = 16
YES, NO = b"Y", b"N"
HELLO_TIMEOUT = 2.0                 # seconds a connecting peer has to present the nonce
MAX_STRANGERS = 32                  # connections without the nonce dropped before the listener closes


class Links:
    """One ring member's links: the Outbound it offers its right neighbour (where the two share no
    memory) and the Inbound from its left neighbour (where that one offered), both set up at the
    start of a collective, on the ring's thread."""

    def __init__(self, node, cfg, rank, size, on_broken, offer):
        self.node, self.cfg, self.size = node, cfg, size
        self.rank, self.right, self.left = rank, f"W{(rank + 1) % size}", f"W{(rank - 1) % size}"
        self._on_broken = on_broken     # on_broken(LinkBroken): the ring decides what ends it
        self._offering = offer          # not offered yet, and ours to offer
        self.out = None                 # Outbound to the right neighbour, once offered
        self.inn = None                 # Inbound from the left neighbour, once connected
        self._lock = threading.Lock()
        self._offer = None              # the left's offer, until our next collective takes it up
        self._refused = None            # why the right cannot take our link (it said so over ZeroMQ)

    @classmethod
    def of(cls, node, cfg, rank, size, on_broken, offer):
        """Links for a ring of `size` (None for one worker). `offer`: the neighbours share no memory;
        the link is offered only with KVPS_RING_LINK, not under CURVE (its bytes would not be
        encrypted) and not in elastic jobs (whose ring changes)."""
        if size < 2:
            return None
        offer = bool(offer and cfg.ring_link and not cfg.elastic and node.keys is None)
        return cls(node, cfg, rank, size, on_broken, offer)

    def message(self, src, meta):
        """A RING "link" message (I/O thread): the left's offer, or the right's refusal. False for
        one that is neither (dropped)."""
        with self._lock:
            if src == self.left and "port" in meta and self._offer is None and self.inn is None:
                self._offer = meta
            elif src == self.right and "refused" in meta and self.out is not None:
                self._refused = str(meta["refused"])[:200]
            else:
                return False
        return True

    def start(self, seq, deadline, n, code, epoch, check):
        """At collective `seq`'s start (n elements of dtype `code`): take up the left's offer; offer
        ours to the right, or accept its connection at the collective the offer named. Returns (the
        Outbound, the Inbound) this collective's chunks go on, each None where ZeroMQ carries them.
        `check()` raises what ended the ring (asked while accepting).

        A collective whose chunks go on the link (or would, once the right neighbour connects) is
        first announced over ZeroMQ (phase "start"): a worker that has joined waits in serve() for a
        collective to start, and connects only once it runs one."""
        out = self.out
        if out is not None and seq >= out.from_seq:
            self.node.send_to_peer(self.right, Header(Op.RING, keys=[Entry.bare(seq, 0, code, (n,))],
                                                      meta={"seq": seq, "n": n, "phase": "start", "epoch": epoch}))
        with self._lock:
            offer, self._offer = self._offer, None
        if offer is not None:
            self._connect(offer)
        if out is None and self._offering:
            self._offering = False          # offered once: a refusal or a failure leaves ZeroMQ in use
            try:
                out = Outbound(self.node.name, self.right, self._host(self.rank), self._on_broken)
            except OSError as exc:
                log.info("%s: no ring link to %s (%s): chunks go through ZeroMQ", self.node.name, self.right, exc)
            else:
                self.node.send_to_peer(self.right, Header(Op.RING, meta=out.offer(seq + 1)))
                self.out = out
        elif out is not None and not out.linked and seq >= out.from_seq:
            if not out.accept(deadline, lambda: check() or self._refused):
                out.close()
                self.out = None
        out = self.out if self.out is not None and self.out.linked and seq >= self.out.from_seq else None
        inn = self.inn if self.inn is not None and seq >= self.inn.from_seq else None
        return out, inn

    def _connect(self, offer):
        name, host = self.node.name, self._host(self.rank - 1)
        if not self.cfg.ring_link:
            if refuse(name, self.left, host, offer, self.cfg.connect_timeout):
                return
            reason = "KVPS_RING_LINK=0 on this worker"
        else:
            try:
                self.inn = Inbound.connect(name, self.left, host, offer, self.cfg.connect_timeout)
                return
            except (OSError, ProtocolError) as exc:
                reason = str(exc)
                log.warning("%s: cannot link to %s for the ring (%s): its chunks come through ZeroMQ",
                            name, self.left, reason)
        if self.node.connect_worker((self.rank - 1) % self.size):      # tell it over ZeroMQ instead
            self.node.send_to_peer(self.left, Header(Op.RING, meta={"phase": "link", "refused": reason[:200]}))

    def _host(self, rank):
        """The address the job registered for worker `rank` (never one a message names)."""
        return self.node.membership["workers"][rank % self.size][0]

    def wake(self):
        """The ring has ended: a read blocked on the Inbound returns."""
        if self.inn is not None:
            self.inn.wake()

    def close(self):
        for end in (self.out, self.inn):
            if end is not None:
                end.close()


class LinkBroken(KVPSError):
    """The connection to a ring neighbour closed or failed (the neighbour may have died)."""


def head(seq, phase, step, chunk, dtype, nbytes):
    return HEAD.pack(seq, PHASES[phase], step, chunk, dtype, nbytes)


class Outbound:
    """The sending end: a listener until the right neighbour connects, then one socket that a
    thread of its own writes, chunk after chunk, in the order they were queued."""

    def __init__(self, name, right, host, on_broken):
        self.name, self.right = name, right
        self._on_broken = on_broken        # on_broken(LinkBroken), on the sending thread
        self._listener = socket.create_server((host, 0))
        self._nonce = os.urandom(NONCE_BYTES)
        self.from_seq = None               # the first collective whose chunks go on the link
        self._sock = None
        self._queue = queue.SimpleQueue()  # (head bytes, memoryview, done()) or None to stop
        self._thread = None
        self.chunks = 0                    # chunks queued on the link (for tests and stats)

    @property
    def linked(self):
        return self._sock is not None

    def offer(self, from_seq):
        """The RING message's meta that offers the link to the right neighbour from collective
        `from_seq` on."""
        self.from_seq = from_seq
        return {"phase": "link", "port": self._listener.getsockname()[1], "nonce": self._nonce,
                "from": from_seq}

    def accept(self, deadline, refused):
        """Wait for the right neighbour to connect with the nonce; True once linked, False if it
        said NO or `refused()` gives its reason (it could not connect: sent over ZeroMQ). Raises
        KVTimeoutError at the deadline, and whatever `refused()` raises (the ring has ended: it is
        asked every 0.2 s). Closes the listener either way."""
        strangers = 0
        try:
            while True:
                reason = refused()
                if reason is not None:
                    log.info("%s: %s cannot take the ring's chunks on a TCP link (%s): they go through "
                             "ZeroMQ", self.name, self.right, reason)
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KVTimeoutError(f"{self.name}: {self.right} did not connect to its ring link "
                                         f"within the collective's deadline (KVPS_TIMEOUT)")
                self._listener.settimeout(min(left, 0.2))
                try:
                    sock, _ = self._listener.accept()
                except TimeoutError:
                    continue
                answer = _hello(sock, self._nonce)
                if answer is None:
                    sock.close()
                    strangers += 1
                    if strangers >= MAX_STRANGERS:
                        raise ProtocolError(f"{self.name}: {strangers} connections to its ring link "
                                            f"came without the nonce; {self.right} never linked")
                    continue
                if answer == NO:
                    sock.close()
                    return False
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._sock = sock
                self._thread = threading.Thread(target=self._sending, name=f"kvps-ring-link-{self.right}",
                                                daemon=True)
                self._thread.start()
                return True
        finally:
            self._listener.close()

    def send(self, head_bytes, piece, done):
        """Queue a chunk (a contiguous 1-D array): it must not change before done() runs."""
        self.chunks += 1
        self._queue.put((head_bytes, memoryview(piece.view(np.uint8)), done))

    def _sending(self):
        broken = None
        while True:
            item = self._queue.get()
            if item is None:
                return
            head_bytes, data, done = item
            if broken is None:
                try:
                    self._sock.sendall(head_bytes)
                    if data.nbytes:
                        self._sock.sendall(data)
                except OSError as exc:
                    broken = LinkBroken(f"{self.name}: the ring's link to {self.right} failed: {exc}")
                    self._on_broken(broken)
            done()          # sent, or never will be: either way the memory is the caller's again

    def close(self):
        """Stop sending (what is queued is dropped: the ring has ended) and close the socket."""
        if self._sock is not None:
            _shut(self._sock)
        self._queue.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
        self._listener.close()


class Inbound:
    """The receiving end: the connection to the left neighbour's listener, read by the caller."""

    def __init__(self, name, left, sock, from_seq):
        self.name, self.left, self.from_seq = name, left, from_seq
        self._sock = sock
        self.chunks = 0                    # chunks read from the link (for tests and stats)

    @classmethod
    def connect(cls, name, left, host, meta, timeout):
        """Connect to the offered link; returns an Inbound, or raises OSError (then tell the left
        neighbour through ZeroMQ) or ProtocolError for an offer that kvps would not send."""
        try:
            port, nonce, from_seq = int(meta["port"]), bytes(meta["nonce"]), int(meta["from"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"{name}: malformed ring link offer from {left}: {exc}") from None
        if not 0 < port < 65536 or len(nonce) != NONCE_BYTES or from_seq < 0:
            raise ProtocolError(f"{name}: malformed ring link offer from {left}: port {port}, "
                                f"{len(nonce)}-byte nonce, from collective {from_seq}")
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.sendall(nonce + YES)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            sock.close()
            raise
        return cls(name, left, sock, from_seq)

    def read(self, expected, into, deadline):
        """Read the next chunk: its head must equal `expected` (head()'s bytes), its bytes go into
        `into` (a writable contiguous 1-D array of exactly the head's byte count). Raises
        KVTimeoutError at the deadline, LinkBroken if the connection ends, ProtocolError for a
        head other than the one expected."""
        got = bytearray(HEAD.size)
        self._fill(memoryview(got), deadline)
        if got != expected:
            mine, theirs = HEAD.unpack(expected), HEAD.unpack(bytes(got))
            raise ProtocolError(f"{self.name}: {self.left} sent ring chunk (collective, phase, step, chunk, "
                                f"dtype, bytes) {theirs} on its link; expected {mine} (do all workers make "
                                f"the same calls in the same order?)")
        self._fill(memoryview(into.view(np.uint8)), deadline)
        self.chunks += 1

    def _fill(self, view, deadline):
        while view.nbytes:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVTimeoutError(f"{self.name}: no ring data from {self.left} on its link")
            self._sock.settimeout(left)
            try:
                n = self._sock.recv_into(view)
            except TimeoutError:
                continue
            except OSError as exc:
                raise LinkBroken(f"{self.name}: the ring's link from {self.left} failed: {exc}") from None
            if n == 0:
                raise LinkBroken(f"{self.name}: {self.left} closed the ring's link")
            view = view[n:]

    def wake(self):
        """Make a read blocked on another thread return (LinkBroken): the ring has ended."""
        _shut(self._sock)

    def close(self):
        _shut(self._sock)
        self._sock.close()


def refuse(name, left, host, meta, timeout):
    """Answer NO to an offer (this worker takes its chunks through ZeroMQ); False if that cannot
    be done either, and the left neighbour must be told through ZeroMQ."""
    try:
        nonce = bytes(meta["nonce"])
        with socket.create_connection((host, int(meta["port"])), timeout=timeout) as sock:
            sock.sendall(nonce + NO)
        return True
    except (OSError, KeyError, TypeError, ValueError) as exc:
        log.info("%s: could not refuse %s's ring link: %s", name, left, exc)
        return False


def _hello(sock, nonce):
    """YES or NO from a connection that presents `nonce` within HELLO_TIMEOUT, else None."""
    sock.settimeout(HELLO_TIMEOUT)
    got = b""
    try:
        while len(got) < NONCE_BYTES + 1:
            more = sock.recv(NONCE_BYTES + 1 - len(got))
            if not more:
                return None
            got += more
    except OSError:
        return None
    if not hmac.compare_digest(got[:NONCE_BYTES], nonce) or got[NONCE_BYTES:] not in (YES, NO):
        return None
    return got[NONCE_BYTES:]


def _shut(sock):
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
