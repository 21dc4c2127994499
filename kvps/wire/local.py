"""Local sockets: a lane's connection to a server on its own host, without ZeroMQ.

Most of a small call's time goes to ZeroMQ's hand-offs: a message goes from the sending thread to
ZeroMQ's I/O thread, over loopback TCP, then from the receiving I/O thread to the receiving
thread, three wake-ups a message. A round of 1 KB from 2 workers through one server takes
0.24 ms that way in plain pyzmq here, and 0.02 ms over Unix sockets. So where a worker and a server are on one host
(by the addresses they registered, as for shared memory: kvps/wire/shm.py), a lane
(kvps/wire/lane.py) connects to the server's Unix socket instead of its ROUTER. That socket is a
SOCK_SEQPACKET in the abstract namespace (no file to clean up), named after the server's port and pid
(`address`), and the thread that waits for a reply reads it itself.

A message is one datagram while it fits in CHUNK bytes:

    | flag: u8 (0) | count: u32 | count lengths: u32 each | the frames, back to back |

A bigger one is cut into datagrams of at most CHUNK bytes of the same layout (without its flag), each
flagged 1 (more follow) or 2 (the last). SOCK_SEQPACKET keeps the datagrams whole and in order.

    listener = Listener(port, limit)            # a server's, beside its ROUTER (kvps/wire/transport.py)
    conn = listener.accept()                    # a Conn, or None
    conn = connect(port, pid, limit)            # a worker's lane: a Conn, or None (then ZeroMQ, as before)
    conn.send(frames, timeout, check)           # blocking, up to timeout (the lane's thread)
    conn.post(frames)                           # never blocks: what does not fit waits (the server's I/O thread)
    frames = conn.receive()                     # a whole message, or None; EOFError once the peer is gone

Trust: the server accepts a connection only from a process of its own user (SO_PEERCRED), and says
so first (WELCOME); a worker that does not get that within WELCOME_TIMEOUT uses TCP. A worker
uses the socket only if the process that listens on it has the server's pid, so a process that
took the name first gets nothing. Jobs that run CURVE (KVPS_KEYS) do not listen: their messages
go through CURVE, which checks who sent each one.
"""
import collections
import os
import select
import socket
import struct
import time

from kvps.errors import KVTimeoutError, ProtocolError
from kvps.wire.protocol import MAX_ENTRIES

CHUNK = 64 << 10            # bytes of a message one datagram carries
SNDBUF = 4 << 20            # each socket's send buffer, as asked (the kernel caps it at net.core.wmem_max)
SLICE = 0.05                # seconds a blocked send waits before it checks whether the job broke
MAX_FRAMES = 1 + MAX_ENTRIES    # frames in one message: a header and at most one payload per entry
WELCOME = b"kvps local 1"     # what a server sends first on a connection it took (before any message)
WELCOME_TIMEOUT = 2.0       # seconds a client waits for it; then it uses TCP
_COUNT = struct.Struct("<I")
_CRED = struct.Struct("3i")     # struct ucred: pid, uid, gid


def address(port, pid):
    """The abstract socket name of the server that listens on TCP `port` as process `pid`."""
    return f"\0kvps-{port}-{pid}"


def encode(frames):
    """The datagrams of a message, each a list of buffers for sendmsg (no copy of a small message)."""
    sizes = [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]
    head = struct.pack(f"<BI{len(sizes)}I", 0, len(sizes), *sizes)
    if len(head) + sum(sizes) <= CHUNK + 1:
        return [[head, *frames]]
    body = memoryview(b"".join([head[1:], *frames]))
    return [[b"\x02" if start + CHUNK >= len(body) else b"\x01", body[start:start + CHUNK]]
            for start in range(0, len(body), CHUNK)]


def decode(body):
    """The frames of one message's body (its layout without the flag), as memoryviews of it; raises
    ProtocolError where the lengths do not add up."""
    if len(body) < 4:
        raise ProtocolError(f"a local message of {len(body)} bytes has no frame count")
    count, = _COUNT.unpack_from(body, 0)
    offset = 4 + 4 * count
    if not 0 < count <= MAX_FRAMES or offset > len(body):
        raise ProtocolError(f"a local message of {len(body)} bytes declares {count} frames")
    sizes = struct.unpack_from(f"<{count}I", body, 4)
    if offset + sum(sizes) != len(body):
        raise ProtocolError(f"a local message of {len(body)} bytes declares {offset + sum(sizes)}")
    view, frames = memoryview(body), []
    for size in sizes:
        frames.append(view[offset:offset + size])
        offset += size
    return frames


class Conn:
    """One end of a local connection. Its owner polls it (it has fileno()) and reads whole messages
    with receive(); `limit` bounds the bytes of one message (KVPS_MAX_MESSAGE_BYTES)."""

    def __init__(self, sock, limit, ident=0):
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        self._sock = sock
        self._fd = sock.fileno()
        self._limit = limit
        self._scratch = bytearray(CHUNK + 2)
        self._parts = None          # the datagrams so far of a message cut in several, and their bytes
        self._size = 0
        self._out = collections.deque()     # datagrams post() could not send yet (bytes of their own)
        self.ident = ident          # the server's routing id for this client (an int: never a ROUTER's)
        self.watched = False        # the owner polls it for room to write (post() left datagrams)
        self.closed = False

    def fileno(self):
        return self._fd

    def receive(self):
        """The frames of the next whole message, or None when none waits. Raises EOFError once the peer
        has closed, ProtocolError for a message kvps would not send (the owner then closes)."""
        scratch = self._scratch
        while True:
            try:
                n = self._sock.recv_into(scratch)
            except BlockingIOError:
                return None
            except ConnectionError:
                raise EOFError("the peer reset the connection") from None
            if n == 0:
                raise EOFError("the peer closed the connection")
            if n > CHUNK + 1:
                raise ProtocolError(f"a local datagram over {CHUNK + 1} bytes")
            flag = scratch[0]
            if flag == 0 and self._parts is None:
                return decode(scratch[1:n])
            if flag not in (1, 2) or self._size + n - 1 > self._limit:
                raise ProtocolError(f"a local datagram flagged {flag} after {self._size} bytes of a message")
            if self._parts is None:
                self._parts = []
            self._parts.append(bytes(scratch[1:n]))
            self._size += n - 1
            if flag == 2:
                parts, self._parts, self._size = self._parts, None, 0
                return decode(b"".join(parts))

    def send(self, frames, timeout, check=None):
        """Send a message, waiting up to `timeout` s for room; check() runs every SLICE while it waits
        and may raise (the job broke). The frames are copied before this returns. Raises EOFError
        once the peer has closed."""
        deadline = None
        for datagram in encode(frames):
            while True:
                try:
                    self._sock.sendmsg(datagram)
                    break
                except BlockingIOError:
                    pass
                except ConnectionError:
                    raise EOFError("the peer closed the connection") from None
                if deadline is None:
                    deadline = time.monotonic() + timeout
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KVTimeoutError(f"no room on its local socket for {timeout:g} s (KVPS_TIMEOUT)")
                if check is not None:
                    check()
                poller = select.poll()
                poller.register(self._fd, select.POLLOUT)
                poller.poll(1000 * min(left, SLICE))

    def post(self, frames):
        """Send a message without blocking: what does not fit now waits, copied, for flush(). Returns
        whether something waits (the owner then polls for room)."""
        datagrams = encode(frames)
        if not self._out:
            while datagrams:
                try:
                    self._sock.sendmsg(datagrams[0])
                except BlockingIOError:
                    break
                datagrams.pop(0)
        for datagram in datagrams:
            self._out.append(b"".join(datagram))
        return bool(self._out)

    def flush(self):
        """Send what post() left, as far as there is room; returns whether some still waits."""
        while self._out:
            try:
                self._sock.send(self._out[0])
            except BlockingIOError:
                return True
            self._out.popleft()
        return False

    def waiting(self):
        """Datagrams post() could not send yet."""
        return len(self._out)

    def close(self, linger=None):
        if not self.closed:
            self.closed = True
            self._out.clear()
            self._sock.close()


class Listener:
    """A server's local socket: accept() gives a Conn to each worker on this host that connects."""

    def __init__(self, port, limit):
        self._limit = limit
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.bind(address(port, os.getpid()))
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)
        self.accepted = 0           # connections taken so far

    def fileno(self):
        return self._sock.fileno()

    def accept(self, room=True):
        """The next waiting connection as a Conn, or None when none waits; raises PermissionError for a
        process of another user, or any when not `room` (closed unwelcomed: it uses TCP), and
        OSError where no descriptor is left."""
        try:
            sock, _ = self._sock.accept()
        except BlockingIOError:
            return None
        pid, uid = _peer(sock)
        if uid != os.getuid() or not room:
            sock.close()
            raise PermissionError(f"pid {pid} of uid {uid} connected; only uid {os.getuid()} may" if room else
                                  f"pid {pid} connected, and there is no room for another local client")
        conn = Conn(sock, self._limit, self.accepted + 1)
        try:
            sock.send(WELCOME)          # a fresh socket has room: this never blocks
        except OSError:
            conn.close()
            return None
        self.accepted += 1
        return conn

    def close(self):
        self._sock.close()


def _peer(sock):
    """(pid, uid) of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def connect(port, pid, limit):
    """A Conn to the server listening on TCP `port` as process `pid` on this host, or None where there
    is none (an older server, another pid namespace, a name someone else holds)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(SLICE)
        sock.connect(address(port, pid))
        peer, _ = _peer(sock)
        if peer != pid:
            raise ConnectionRefusedError(f"pid {peer} listens where pid {pid} should")
        sock.settimeout(WELCOME_TIMEOUT)
        if sock.recv(len(WELCOME) + 1) != WELCOME:      # refused (another user, too many clients), or busy
            raise ConnectionRefusedError(f"pid {pid} did not take the connection")
        return Conn(sock, limit)
    except OSError:
        sock.close()
        return None
