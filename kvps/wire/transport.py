"""The ZeroMQ transport (ps-lite's "van"): all of a node's sockets, owned by one I/O thread.

A node receives on one ROUTER socket (servers and the scheduler bind one) and
sends requests over one DEALER per peer. Other threads never touch a socket:
they queue frames with `send` / `reply` and wake the I/O thread through a pipe.
Received messages are decoded on the I/O thread and handed to the node's
handler; a message that does not decode is logged and dropped, and, when it
came in on the ROUTER, answered with an ERROR naming the problem.

Payload frames are sent without copying (pyzmq copies frames under its copy
threshold anyway) and received as zmq.Frame objects whose buffers numpy views
can wrap without copying.
"""
import collections
import logging
import os
import threading
import time

import zmq

from kvps.wire import protocol
from kvps.errors import ProtocolError, describe

log = logging.getLogger("kvps.transport")

# Replies this big are sent with a tracker so the store can tell when zmq has
# finished reading an array it is about to change in place.
TRACK_BYTES = 1 << 16
# pyzmq's constants are enums; plain ints keep the hot path free of enum arithmetic.
POLLIN, EVENTS, SNDMORE = int(zmq.POLLIN), int(zmq.EVENTS), int(zmq.SNDMORE)
# Frames smaller than this are copied on send: cheaper than zero-copy bookkeeping.
COPY_BYTES = 1 << 16


class Van:
    """One node's sockets and the thread that owns them.

    handler(source, header, payloads) runs on the I/O thread for every decoded
    message; `source` is ("peer", name) for a DEALER and ("client", routing_id)
    for the ROUTER. on_bad(source, exc) runs for a message that did not decode.
    """

    def __init__(self, name, handler, on_bad=None):
        self.name = name
        self._handler = handler
        self._on_bad = on_bad
        self._ctx = zmq.Context(io_threads=1)
        self._router = None
        self._dealers = {}              # peer name -> DEALER
        self._peer_of = {}              # DEALER -> peer name
        self._queue = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._woken = False
        self._timers = []               # [next_due, interval, fn]
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._thread = None
        self._running = False
        self.port = None

    # ---- setup (call before start, or from the I/O thread) ----
    def bind(self, host, port=0):
        """Bind the ROUTER on host:port (0 picks a free port); returns the port."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        if port:
            sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = sock.bind_to_random_port(f"tcp://{host}")
        self._router = sock
        self._poller.register(sock, zmq.POLLIN)
        return self.port

    def every(self, interval, fn):
        """Run fn() on the I/O thread every `interval` seconds."""
        self._timers.append([time.monotonic() + interval, interval, fn])

    def start(self):
        self._running = True
        self._thread = threading.Thread(target=self._loop, name=f"kvps-io-{self.name}", daemon=True)
        self._thread.start()

    # ---- thread-safe API ----
    def connect(self, peer, host, port):
        """Open a DEALER to a peer (done on the I/O thread)."""
        self._submit(("connect", peer, (host, port)))

    def send(self, peer, header, payloads=()):
        """Send a message to a connected peer over its DEALER."""
        self._submit(("send", peer, [header.encode(), *payloads]))

    def reply(self, routing_id, header, payloads=(), on_tracker=None):
        """Send a message back to a client of the ROUTER.

        on_tracker(tracker) is called (on the I/O thread) when a payload is big
        enough to be sent without copying, with a zmq MessageTracker for it.
        """
        self._submit(("reply", routing_id, [header.encode(), *payloads], on_tracker))

    def stop(self, timeout=5.0):
        """Stop the I/O thread (after it sends what is queued) and close the sockets."""
        if self._thread is None:
            return
        self._submit(("stop",))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._thread = None

    def on_io_thread(self):
        return threading.current_thread() is self._thread

    # ---- I/O thread ----
    def _submit(self, item):
        self._queue.append(item)
        if threading.current_thread() is self._thread:
            return      # the I/O thread flushes its queue before it polls again
        if not self._woken:
            self._woken = True
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # the pipe is full, so the I/O thread is already awake

    def _loop(self):
        try:
            while self._running:
                timeout = self._run_timers()
                for sock, _ in self._poller.poll(timeout):
                    if sock == self._wake_r:
                        # Read before clearing the flag: a byte written in between must not be
                        # swallowed while the flag says a wake-up is pending (that would stall sends).
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                        self._woken = False
                    else:
                        self._drain(sock)
                self._flush()
        except Exception:
            log.exception("%s: I/O thread failed", self.name)
            raise
        finally:
            self._close()

    def _run_timers(self):
        if not self._timers:
            return 1000
        now = time.monotonic()
        for timer in self._timers:
            if now >= timer[0]:
                timer[0] = now + timer[1]
                try:
                    timer[2]()
                except Exception:
                    log.exception("%s: timer %s failed", self.name, timer[2])
        return max(0, int(1000 * (min(t[0] for t in self._timers) - time.monotonic())) + 1)

    def _flush(self):
        while self._queue:
            item = self._queue.popleft()
            kind = item[0]
            if kind == "send":
                sock = self._dealers.get(item[1])
                if sock is None:
                    log.error("%s: no connection to %s; message dropped", self.name, item[1])
                    continue
                _send(sock, item[2])
            elif kind == "reply":
                self._reply_now(*item[1:])
            elif kind == "connect":
                self._connect_now(item[1], *item[2])
            elif kind == "stop":
                self._running = False

    def _reply_now(self, routing_id, frames, on_tracker):
        if self._router is None:
            return
        big = on_tracker is not None and any(
            not isinstance(f, bytes) and memoryview(f).nbytes >= TRACK_BYTES for f in frames[1:])
        try:
            if big:
                tracker = self._router.send_multipart([routing_id, *frames], copy=False, track=True)
                on_tracker(tracker)
            else:
                _send(self._router, [routing_id, *frames])
        except zmq.ZMQError as exc:
            log.warning("%s: reply to a client that went away dropped (%s)", self.name, exc)

    def _connect_now(self, peer, host, port):
        old = self._dealers.pop(peer, None)
        if old is not None:
            self._poller.unregister(old)
            self._peer_of.pop(old, None)
            old.close(0)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(f"tcp://{host}:{port}")
        self._dealers[peer] = sock
        self._peer_of[sock] = peer
        self._poller.register(sock, zmq.POLLIN)

    def _drain(self, sock):
        from_router = sock is self._router
        for _ in range(256):   # bounded so one busy peer cannot starve the rest
            if not sock.getsockopt(EVENTS) & POLLIN:
                return
            frames = sock.recv_multipart(copy=False)
            if from_router:
                source = ("client", frames[0].bytes)
                frames = frames[1:]
            else:
                source = ("peer", self._peer_of[sock])
            try:
                header, payloads = protocol.unpack(frames)
            except ProtocolError as exc:
                self._bad(source, frames, exc)
                continue
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s <- %r", self.name, header)
            try:
                self._handler(source, header, payloads)
            except Exception:
                log.exception("%s: handling %r failed", self.name, header)

    def _bad(self, source, frames, exc):
        log.warning("%s: dropped a bad message from %s: %s", self.name, _show(source), describe(exc))
        if source[0] == "client" and frames:
            # Answer a peer that can read our errors; it may be waiting for this id.
            request_id = _request_id(frames[0])
            message = f"{self.name} refused the message: {describe(exc)}"
            err = protocol.error_header(request_id, self.name, "protocol", message)
            self._reply_now(source[1], [err.encode()], None)
        if self._on_bad is not None:
            self._on_bad(source, exc)

    def _close(self):
        for sock in list(self._dealers.values()) + ([self._router] if self._router is not None else []):
            sock.close(0)
        self._dealers.clear()
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)


def _send(sock, frames):
    """Send a multipart message: small frames are copied (pyzmq's fast path), big ones are not."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        flags = SNDMORE if i < last else 0
        if isinstance(frame, bytes) or memoryview(frame).nbytes < COPY_BYTES:
            sock.send(frame, flags, copy=True)
        else:
            sock.send(frame, flags, copy=False)


def _show(source):
    kind, who = source
    return who if kind == "peer" else f"client {who.hex()}"


def _request_id(frame):
    """Best-effort request id of an undecodable header, so the sender's wait ends."""
    import msgpack
    try:
        raw = msgpack.unpackb(frame.bytes if hasattr(frame, "bytes") else frame, raw=False,
                              max_bin_len=1 << 16, max_str_len=1 << 16, max_array_len=1 << 16)
        if isinstance(raw, dict) and isinstance(raw.get("id"), int):
            return raw["id"]
    except Exception:
        pass
    return 0
