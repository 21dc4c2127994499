"""CurveZMQ on one node's sockets: the ZAP handler that admits only the job's keys and names each
connection by its key, the refusal log, and the check that a message's `src` is its key's name.

    curve = Curve(keys, ctx, node_name, complaints)     # binds the ZAP socket: before any CURVE socket
    curve.serve(router)                                  # before bind: CURVE server, ZAP domain enforced
    curve.dial(dealer, "S0")                             # before connect: pins S0's public key
    curve.impostor(frame, header)                        # None, or why the message is refused
    curve.handle(sock)                                   # for curve.sockets, when the poller says so

Why a ZAP socket of our own, polled by the Van's I/O thread, rather than pyzmq's
ThreadAuthenticator: one thread owns each socket (docs/design.md), the handler shares that
thread's LogThrottle without a lock, and it adds no thread that could die on its own and leave
handshakes unanswered. libzmq's I/O thread waits for the reply asynchronously, so a slow answer
delays one handshake and blocks nothing.

Who gets what:
- a peer without keys (NULL), or one that holds another job's copy of this node's public key,
  fails the CURVE handshake: libzmq drops it before any message, and the socket monitor tells us;
- a peer whose client key is not one of the job's is refused by the ZAP handler (status 400);
- a job member gets the ZAP User-Id of its key's name, which zmq puts on every frame it sends
  ("User-Id" frame property); a message whose header claims another `src` is refused with an ERROR.
Every refusal is logged once per peer (address and key, or address and reason), within the
Van's LogThrottle; the node goes on serving.
"""
import logging
import os
import socket

import zmq
from zmq.utils import z85

from kvps.wire.throttle import escape

log = logging.getLogger("kvps.auth")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"     # fixed by RFC 27; one per zmq.Context, and each Van has its own
DOMAIN = b"kvps"
MONITORED = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
             | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
REMEMBERED = 4096           # refused peers remembered (so each is logged once); forgotten all at once past this
BATCH = 64                  # ZAP requests or monitor events handled per wake-up, so a flood cannot starve the Van

_WHY = {
    int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH): "it offers no CURVE keys (an unauthenticated peer)",
    int(zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC): "its CURVE handshake does not decrypt with this node's key "
                                                "(keys of another job?)",
}


class Gate:
    """The ZAP decision, without sockets: the job's client keys (raw 32 bytes) -> node names."""

    def __init__(self, peers):
        self.names = {z85.decode(key): name for name, key in peers.items()}

    def answer(self, request):
        """(reply frames, refusal text or None) for a ZAP request's frames (RFC 27)."""
        if len(request) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""], "a malformed ZAP request"
        version, request_id, domain, address, _identity, mechanism, *credentials = request[:7]
        address = address.decode("ascii", "replace")
        if version != b"1.0":
            return [b"1.0", request_id, b"500", b"ZAP version 1.0 only", b"", b""], "a ZAP request of another version"
        if mechanism != b"CURVE" or len(credentials) != 1:
            return _no(request_id, "CURVE only"), f"{escape(mechanism)} mechanism from {escape(address)}"
        name = self.names.get(credentials[0])
        if name is None:
            key = z85.encode(credentials[0]).decode() if len(credentials[0]) == 32 else "?"
            return _no(request_id, "key not in this job"), \
                f"a connection from {escape(address)} whose CURVE key {key} is not one of this job's"
        return [b"1.0", request_id, b"200", b"OK", name.encode(), b""], None


def _no(request_id, text):
    return [b"1.0", request_id, b"400", text.encode(), b"", b""]


class Curve:
    """CURVE on the sockets of one Van (all calls on its I/O thread, or before it starts)."""

    def __init__(self, keys, ctx, node, complaints):
        self.keys = keys
        self.node = node                        # a callable: the Van's current name, for log lines
        self.complaints = complaints
        self.gate = Gate(keys.peers)
        self.zap = ctx.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)
        self.sockets = [self.zap]               # what the Van polls for us
        self._refused = set()                   # peers already logged
        self._accepted = {}                     # fd -> peer host of connections in their handshake
        self._failed = None                     # why the handshake just reported failed did

    # ---- socket options ----
    def serve(self, sock):
        """Make a ROUTER a CURVE server whose clients the ZAP handler must admit (call before bind)."""
        sock.curve_server = True
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.zap_domain = DOMAIN
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)     # no handler answering: refuse, never admit

    def server_key(self, peer):
        """The public key a DEALER to `peer` pins; ConfigError when the job's keys have none."""
        return self.keys.peer(peer)

    def dial(self, sock, peer):
        """Make a DEALER a CURVE client of `peer`'s key (call before connect)."""
        sock.curve_serverkey = self.server_key(peer)
        sock.curve_publickey = self.keys.public
        sock.curve_secretkey = self.keys.secret

    # ---- per message ----
    def impostor(self, frame, header):
        """None when `header.src` is the name bound to the key the message came with, else why not
        (logged once per key and claimed name)."""
        try:
            bound = frame.get("User-Id")
        except zmq.ZMQError:
            bound = None
        if header.src == bound:
            return None
        if bound is not None and bound[:1] == "S" and header.meta.get("chain") is True:
            return None     # a server relays a worker's request along its range's chain (KVPS_REPLICAS)
        why = (f"{header.op.name} claims to come from {escape(header.src, 40)!r}, but its sender's key is "
               f"{escape(bound or 'unknown', 40)}'s")
        self._log((bound, header.src), f"refused a message: {why} (and any more it sends as {escape(header.src, 40)!r})")
        return why

    # ---- the I/O thread ----
    def handle(self, sock):
        """Answer waiting ZAP requests (bounded)."""
        for _ in range(BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply, refusal = self.gate.answer(frames)
            self.zap.send_multipart(reply)
            if refusal:
                self._log(refusal, refusal)

    def event(self, event):
        """One event of the ROUTER's socket monitor (the Van reads them: MONITORED)."""
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_ACCEPTED:
            if len(self._accepted) < REMEMBERED:
                self._accepted[value] = _peer_address(value)
        elif kind == zmq.EVENT_DISCONNECTED:
            # libzmq's one I/O thread reports a failed handshake, then its connection's end (fd).
            host = self._accepted.pop(value, None)
            if self._failed is not None:
                why, self._failed = self._failed, None
                if host is None and any(peer[1] == why for peer in self._refused):
                    return      # most likely a peer already logged, whose address we were too late to read
                self._log((host, why), f"refused a connection from {host or 'an unknown address'}: {why}")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._failed = _WHY.get(value, f"a broken CURVE handshake (ZMTP error {value:#x})")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # a peer without keys often sees the mismatch first and hangs up: then this is all we learn
            self._failed = "its handshake failed (no CURVE keys, garbage, or it hung up during the handshake)"

    def _log(self, peer, text):
        if peer in self._refused:
            return
        if len(self._refused) >= REMEMBERED:
            self._refused.clear()
        self._refused.add(peer)
        self.complaints(log, logging.WARNING, "%s: %s", self.node(), text)

    def close(self):
        self.zap.close(0)


def _peer_address(fd):
    """The host at the far end of a connection zmq just accepted (best effort: it may be gone). Not
    its port: a refused client reconnects from a new port every 100 ms, and is still one peer."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        with socket.socket(fileno=dup) as s:
            return s.getpeername()[0]
    except OSError:
        return None
