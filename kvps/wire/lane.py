"""Lanes: a calling thread's own connections to the servers, for small calls (the fast path).

A small call (at most KVPS_LANE_BYTES of payload in all, 256 KB by default, whether its values
travel in the message or through shared memory with a co-located server) need not go through the
node's I/O thread. Its thread sends the requests itself, on a DEALER of its own to
each server (to a server on its host, on a Unix socket: kvps/wire/local.py), and reads the replies
itself when it waits. That saves the two hand-offs of the I/O
path (wake the I/O thread to send; wake the caller when the reply is in), which are most of what
a 1 KB round costs in Python, and leaves the I/O thread alone with heartbeats and big transfers.

    lanes = Lanes(node)                         # a worker's; None-equivalent when KVPS_LANE_BYTES=0
    lane = lanes.mine()                         # this thread's Lane (made on first use)
    handle = lane.request_many(items, what, timeout, keep)   # sent before it returns
    handle.wait()                               # reads this lane's replies until its own are in

One thread owns each socket, as on the I/O thread: a lane is used by the thread that made it, and
by any other thread only under the lane's lock (a handle waited for elsewhere, the node stopping).
Waits read the sockets in slices of at most SLICE seconds and then check whether the job broke or
the node stopped (the I/O thread learns of that; see Node.add_failure_listener), so a dead server
ends a lane's wait as it ends every other wait: with the NodeFailure, within one slice.

Request ids come from the node's own counter, so a server sees one stream of ids per connection
(kvps/wire/window.py), as for the I/O thread's requests. Requests on one lane reach a server in
the order they were sent; the kvstore keeps a key's calls in order across the two paths
(kvps/kvstore/ps.py: Order). Lanes are off where a request may have to be sent again after a timeout
(KVPS_FAULTS, KVPS_RESEND_TIMEOUT): those need the I/O thread's resends. With KVPS_REPLICAS a lane
keeps each request's bytes until its reply, and when a server dies (the node's SERVERS) it sends
what waited on it, same ids, to the new head of its range, as the I/O thread does (kvps/wire/requests.py:
redirect); the server applies nothing twice.
"""
import threading
import time
import weakref

import zmq

from kvps.errors import KVPSError, KVTimeoutError, NodeFailure, ProtocolError, describe, remote_error
from kvps.wire import local, protocol
from kvps.wire.protocol import Op
from kvps.wire.requests import Handle
from kvps.wire.transport import recv_message, send_message

SLICE = 0.05            # seconds a lane waits on its sockets before it checks for a failure or a stop
BATCH = 256             # replies read from one socket at a time


class LaneHandle(Handle):
    """A Handle whose replies come on a lane: waiting for it reads them (on the waiting thread)."""

    def __init__(self, what, timeout, keep, lane):
        super().__init__(what, timeout, keep)
        self.lane = lane

    def wait(self, timeout=None):
        timeout = self._timeout if timeout is None else timeout
        if not self._finished and not self.lane.pump(self, timeout):
            with self._lock:
                peers = sorted(set(self._waiting.values()))
            raise KVTimeoutError(f"{self.what}: no reply from {', '.join(peers) or 'peers'} "
                                 f"within {timeout:g} s (KVPS_TIMEOUT)")
        return super().wait(0)

    def done(self):
        if not self._finished:
            self.lane.poll()        # nobody else reads its replies while the caller only asks
        return self._finished


class Lanes:
    """A worker node's lanes, one per thread that makes small calls; all closed when the node stops.

    `address(peer)` gives a server's (host, port); the node's Van makes the sockets (its context,
    its CURVE keys and limits) and closes every lane before it ends."""

    def __init__(self, node, address, local_address=None):
        self._node = node
        self._address = address
        self._local = local_address     # peer -> (port, pid) of a server on this host (local.connect), or None
        self._mine = threading.local()
        self._all = weakref.WeakSet()   # every live lane (a lane dies with its thread and its handles)
        self.ended = None               # the NodeFailure or stop that ends every wait
        node.add_failure_listener(self._end)
        node.add_servers_listener(self._servers_changed)

    def _servers_changed(self):
        """A server died or joined (I/O thread): every lane sends what waited on a dead server to the
        new heads now, not when its thread next waits on it, which it may never do (it waits on a
        call that went through the I/O thread, whose round needs those requests). A lane its thread
        is using is tried again a slice later."""
        if any(not lane.follow() for lane in list(self._all)):
            self._node.van.call_later(SLICE, self._servers_changed)

    def _end(self, exc):
        self.ended = exc

    def mine(self):
        """This thread's lane (made on first use). Raises KVPSError once the node has stopped."""
        lane = getattr(self._mine, "lane", None)
        if lane is None or lane.closed:
            lane = Lane(self)
            self._node.van.adopt(lane)
            self._mine.lane = lane
            self._all.add(lane)
        return lane

    def failure(self):
        return self.ended or self._node.requests.failure

    def sent(self):
        """Requests sent on the lanes so far (of the lanes still alive)."""
        return sum(lane.sent for lane in list(self._all))


class Lane:
    """One thread's DEALERs to the servers and the requests it has sent on them."""

    def __init__(self, lanes):
        self._lanes = lanes
        self._node = lanes._node
        self._socks = {}                # peer -> DEALER
        self._peer_of = {}              # DEALER -> peer
        self._at = {}                   # peer -> the address its DEALER connects to
        self._by_fd = {}                # descriptor -> local.Conn (kvps/wire/local.py)
        self._gone = []                 # [(deadline, peer, request ids)] of local connections closed (_drop)
        self._poller = zmq.Poller()
        self._pending = {}              # request id -> (handle, peer, on_reply, frames, home)
        # KVPS_REPLICAS: requests keep their bytes (frames) to go to a new head; the node's SERVERS seen
        self._keep = bool(self._node.cfg.replicas)
        self._servers_seen = self._node.servers_changed
        self._lock = threading.Lock()   # held while a socket is used: by its thread, or a waiter elsewhere
        self.closed = False
        self.sent = 0
        # A lane whose thread has ended and whose handles are gone closes its sockets as it is collected
        # (nobody can use them then); the node's stop closes the others (Van.adopt).
        self._finalizer = weakref.finalize(self, _close_sockets, self._socks)
        # Not at interpreter exit: a kvstore never closed (MXNet scripts) finishes its calls then, in
        # its own finalizer, which runs after this younger one; it still reads replies on this lane.
        # The node's stop closes the sockets after it (Van.adopt).
        self._finalizer.atexit = False

    def busy(self):
        """Whether requests on this lane still wait for replies."""
        return bool(self._pending)

    def request_many(self, items, what, timeout, keep=()):
        """Send requests [(peer, header, payloads, on_reply)] now, on this thread; returns a LaneHandle.
        The payloads are copied as they are sent (at most KVPS_LANE_BYTES), so the caller may change
        them at once. on_reply(header, payloads) runs on the thread that reads the reply."""
        node = self._node
        handle = LaneHandle(what, timeout, keep, self)
        telemetry = node.telemetry
        try:
            with self._lock:
                if self.closed:
                    raise KVPSError(f"{node.name}: the transport is stopped (the node has left the job or shut "
                                    f"down); {what} not sent")
                failure = self._lanes.failure()
                if failure is not None:
                    raise failure
                if self._keep:
                    self._follow()
                for peer, header, payloads, on_reply in items:
                    header.id = node.requests.next_id()
                    header.src = node.name
                    if self._keep:          # its own copy of the values, to send again to a new head
                        routed = node.server_peer(header.meta["home"])   # a death seen since the call routed it
                        if routed != peer:
                            header, payloads = node.requests.rehomed(header.id, peer, header, payloads)
                            peer = routed
                        frames = [header.encode(), *(bytes(p) for p in payloads)]
                    else:
                        frames = [header.encode(), *payloads]
                    sock = self._socks.get(peer) or self._connect(peer)
                    self._pending[header.id] = (handle, peer, on_reply, frames if self._keep else None,
                                                header.meta.get("home"))
                    handle._expect(header.id, peer)
                    self._send(sock, frames, what, timeout, copy=not self._keep)
                    self.sent += 1
                    if telemetry is not None:       # counted once sent: counting never delays a message
                        telemetry.sent(peer, header.op, frames)
                    if telemetry is not None and telemetry.timeline is not None:
                        telemetry.handed(peer, header.id)
        finally:
            handle._arm()
        return handle

    def _send(self, sock, frames, what, timeout, copy=False):
        """Send one message on a DEALER or a local connection (which copies what it sends, and waits
        up to `timeout` s for room, failing as every wait does when the job breaks)."""
        if type(sock) is local.Conn:
            try:
                sock.send(frames, timeout, self._check)
            except KVTimeoutError as exc:
                raise KVTimeoutError(f"{what}: {self._peer_of[sock]} took nothing: {exc}") from None
            except EOFError as exc:         # the server is gone: the request waits, as on a DEALER
                self._drop(self._peer_of[sock], exc)
        else:
            send_message(sock, frames, copy=copy)

    def _check(self):
        """Raise the NodeFailure or stop that ends every wait (a send waiting for room calls it)."""
        failure = self._lanes.failure()
        if failure is not None:
            raise failure

    def _connect(self, peer):
        address = self._lanes._address(peer)
        where = self._lanes._local and self._lanes._local(peer)
        sock = where and local.connect(*where, self._node.cfg.max_message_bytes)
        if sock:
            self._by_fd[sock.fileno()] = sock
        else:                   # not on this host, or it does not listen: through its ROUTER
            sock = self._node.van.dealer(peer, *address)
        self._socks[peer] = sock
        self._peer_of[sock] = peer
        self._at[peer] = address
        self._poller.register(sock, zmq.POLLIN)
        return sock

    def _follow(self):
        """After a server died (KVPS_REPLICAS, `_keep`; with the lock held): the requests that waited on it go,
        same ids and bytes, to the new head of their range, and a DEALER to a dead server, or to a
        rank a new server took at another address, is closed. A range with no live server left
        fails its requests with the NodeFailure."""
        node = self._node
        if node.servers_changed == self._servers_seen:
            return
        self._servers_seen = node.servers_changed
        for peer in list(self._socks):
            if int(peer[1:]) in node.dead_servers or self._lanes._address(peer) != self._at[peer]:
                self._forget(peer)
        for request_id in sorted(self._pending):
            handle, peer, on_reply, frames, home = self._pending[request_id]
            try:
                head = node.server_peer(home)
            except NodeFailure as exc:
                del self._pending[request_id]
                handle._answered(request_id, exc)
                continue
            if head == peer and peer in self._socks:
                continue
            if head != peer:
                frames = _rehomed(node.requests, frames, peer)
            self._pending[request_id] = (handle, head, on_reply, frames, home)
            with handle._lock:
                handle._waiting[request_id] = head
            self._send(self._socks.get(head) or self._connect(head), frames, f"request {request_id}",
                       self._node.cfg.timeout)

    def pump(self, handle, timeout):
        """Read this lane's replies until `handle` is done (True) or `timeout` seconds pass (False).
        Fails every waiting request at once when the job breaks or the node stops."""
        deadline = time.monotonic() + timeout
        while not handle._finished:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._lock:
                if handle._finished:
                    break
                failure = self._lanes.failure()
                if failure is not None or self.closed:
                    self._fail(failure or self._stopped())
                    break
                if self._keep:
                    self._follow()
                if self._gone:
                    self._give_up()
                for sock, _ in self._poller.poll(int(1000 * min(left, SLICE)) + 1):
                    if type(sock) is int:           # a local connection, which the poller gives by descriptor
                        sock = self._by_fd.get(sock)
                        if sock is None:
                            continue
                    self._drain(sock, ready=True)
        return True

    def follow(self):
        """With KVPS_REPLICAS: send the requests that waited on a dead server to the new heads of
        their ranges now (_follow); False if the lane's thread holds it (it follows them itself
        while it waits, or later)."""
        if not self._keep or not self._pending:
            return True
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if not self.closed:
                self._follow()
        finally:
            self._lock.release()
        return True

    def poll(self):
        """Read the replies already here, without waiting (completes returned calls early)."""
        if not self._pending or not self._lock.acquire(blocking=False):
            return
        try:
            if not self.closed:
                if self._keep:
                    self._follow()
                for sock in list(self._socks.values()):
                    self._drain(sock)
        finally:
            self._lock.release()

    def _drain(self, sock, ready=False):
        """Hand on the replies waiting on one socket (with the lock held; `ready`: poll() said it is
        readable). A reply that does not decode fails the request it names, if it can be read, else
        every request to that peer."""
        peer = self._peer_of[sock]
        telemetry = self._node.telemetry
        is_local = type(sock) is local.Conn
        for _ in range(BATCH):
            try:
                frames = sock.receive() if is_local else recv_message(sock, ready)
            except (EOFError, OSError, ProtocolError) as exc:
                self._drop(peer, exc)
                return
            ready = False
            if frames is None:
                return
            try:
                header, payloads = protocol.unpack(frames)
            except ProtocolError as exc:
                self._fail(type(exc)(f"{peer}: {exc}"), peer)
                continue
            if telemetry is not None:
                telemetry.received(("peer", peer), header, frames)
            held = header.meta.get("held")      # its values; the acknowledgement follows
            entry = self._pending.get(header.id) if held else self._pending.pop(header.id, None)
            if entry is None:
                continue            # the reply to a request whose wait timed out
            handle, _, on_reply, _, _ = entry
            handle.meta = header.meta
            error = None
            if header.op == Op.ERROR:
                error = remote_error(header.meta.get("kind"), header.meta.get("message", ""))
            elif on_reply is not None:
                try:
                    on_reply(header, payloads)
                except Exception as exc:    # a bad reply fails this call, not the lane
                    error = exc
            if held:
                if error is None:
                    continue
                del self._pending[header.id]
            handle._answered(header.id, error)

    def _drop(self, peer, exc):
        """A local connection the server closed or that carried garbage (its requests fail now); the
        next request connects again. A server that closed it is most likely dying: its requests
        wait for the job to say so (a NodeFailure), for the heartbeat timeout and a second at most."""
        self._forget(peer)
        if not isinstance(exc, EOFError):
            self._fail(ProtocolError(f"{peer}: {describe(exc)}"), peer)
            return
        waiting = {request_id for request_id, entry in self._pending.items() if entry[1] == peer}
        if waiting:
            self._gone.append((time.monotonic() + self._node.cfg.heartbeat_timeout + 1, peer, waiting))

    def _give_up(self):
        """Fail the requests to a server that closed its local connection and was not reported dead in
        time (it closed it for a reason of its own)."""
        now = time.monotonic()
        while self._gone and self._gone[0][0] <= now:
            _, peer, waiting = self._gone.pop(0)
            exc = KVPSError(f"{peer} closed its local connection to {self._node.name}, and the job did not "
                            f"report it dead within the heartbeat timeout (KVPS_HEARTBEAT_TIMEOUT)")
            for request_id in waiting:
                entry = self._pending.get(request_id)
                if entry is not None and entry[1] == peer:     # (not sent on to a new head since)
                    del self._pending[request_id]
                    entry[0]._answered(request_id, exc)

    def _forget(self, peer):
        """Close the connection to `peer` (with the lock held)."""
        sock = self._socks.pop(peer)
        del self._peer_of[sock], self._at[peer]
        if type(sock) is local.Conn:
            del self._by_fd[sock.fileno()]
        self._poller.unregister(sock)
        sock.close(0)

    def _fail(self, exc, peer=None):
        """Fail the waiting requests (to `peer`, or all) with `exc` (with the lock held)."""
        for request_id, (handle, to, _, _, _) in list(self._pending.items()):
            if peer is None or to == peer:
                del self._pending[request_id]
                handle._answered(request_id, exc)

    def close(self):
        """Close the sockets (the node is stopping; from any thread): waits up to a slice for the
        owner to let go of them, and fails what still waits."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._finalizer()
            self._peer_of.clear()
            self._fail(self._stopped())

    def _stopped(self):
        return KVPSError(f"{self._node.name} has stopped (it left the job or shut down)")


def _close_sockets(socks):
    for sock in socks.values():
        sock.close(0)
    socks.clear()


def _rehomed(requests, frames, dead):
    """The frames of a kept request to `dead` as they go to another server (Requests.rehome): the
    same bytes unless it names memory shared with `dead`."""
    if requests.rehome is None:
        return frames
    header = protocol.decode(frames[0])
    moved, payloads = requests.rehome(header, frames[1:], dead)
    return frames if moved is header else [moved.encode(), *(bytes(p) for p in payloads)]
