"""The ZeroMQ transport (ps-lite's "van"): all of a node's sockets, owned by one I/O thread.

A node receives on one ROUTER socket (servers and the scheduler bind one) and
sends requests over one DEALER per peer. Other threads never touch a socket:
they queue frames with `send` / `reply` and wake the I/O thread through a pipe.
Received messages are decoded on the I/O thread and handed to the node's
handler; a message that does not decode is logged and dropped, and, when it
came in on the ROUTER, answered with an ERROR naming the problem.

Payload frames are sent without copying (pyzmq copies frames under its copy
threshold anyway) and received as zmq.Frame objects whose buffers numpy views
can wrap without copying. `send(..., on_sent=fn)` reports when zmq has let go of
the payloads (the caller may then change them); a DEALER to a dead peer holds its
messages forever, so `disconnect(peer)` drops them, and that counts as let go.

Stopping is safe from any thread, a signal handler included, any number of
times: after stop(), `send` and `connect` from other threads raise KVPSError
naming the node, and `reply` is dropped (its client is being abandoned anyway).
"""
import collections
import errno
import heapq
import itertools
import logging
import os
import threading
import time
import weakref

import msgpack
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvps.wire import protocol
from kvps.wire import auth, connections, local
from kvps.wire.auth import Curve
from kvps.wire.protocol import Op
from kvps.wire.schedule import Schedule
from kvps.wire.throttle import LogThrottle, escape
from kvps.errors import ConfigError, KVPSError, ProtocolError, describe, error_kind

log = logging.getLogger("kvps.transport")

# Replies this big are sent with a tracker so the store can tell when zmq has
# finished reading an array it is about to change in place.
TRACK_BYTES = 1 << 16
# pyzmq's constants are enums; plain ints keep the hot path free of enum arithmetic.
POLLIN, POLLOUT, EVENTS = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.EVENTS)
SNDMORE, NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)
# A daemon's local clients (kvps/wire/local.py): at most this many at a time.
MAX_LOCAL = 1024
# Frames smaller than this are copied on send: cheaper than zero-copy bookkeeping.
COPY_BYTES = 1 << 16


class Van:
    """One node's sockets and the thread that owns them.

    handler(source, header, payloads) runs on the I/O thread for every decoded
    message; `source` is ("peer", name) for a DEALER and ("client", routing_id)
    for the ROUTER. on_bad(source, exc) runs for a message that did not decode.
    """
    _on_death = None                # fn(exc) if the I/O thread dies (when_dead)

    def __init__(self, name, handler, on_bad=None, credit=0):
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
        self._once = []                 # heap of (due, n, fn) to run once (call_later; under _lock)
        self._once_n = itertools.count()
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._thread = None
        self._running = False
        # Queueing and waking vs. closing the wake pipe: a write to a closed (or reused) descriptor
        # is the bug this prevents. Re-entrant, so a signal handler that interrupts a submit on the
        # main thread can still stop() (which must not wait then: see there).
        self._lock = threading.RLock()
        self._stopping = False          # stop() was called: other threads may queue no more
        self._closed = False            # sockets and wake pipe are closed
        # Data messages sent with a priority wait here while `credit` bytes are handed to zmq and
        # not yet written out (kvps/wire/schedule.py); credit 0: everything goes in arrival order.
        self._schedule = Schedule(credit) if credit else None
        self._inflight = 0              # bytes of scheduled payloads zmq still holds (under _lock)
        self.port = None
        self.complaints = LogThrottle()     # bounds the log lines bad input can cause (handlers share it)
        # kvps.metrics.telemetry.Telemetry when KVPS_METRICS_PORT or KVPS_TIMELINE is set (the node sets
        # it before start); None otherwise, and then counting costs one attribute test per message.
        self.telemetry = None
        self.faults = None                  # test only: a kvps.wire.faults.Faults (see inject)
        self._late = []                     # heap of (due, n, kind, args): messages the faults delayed
        self._late_n = itertools.count()
        self._late_until = {}               # peer or routing id -> due of its last delayed message
        self._curve = None                  # kvps.wire.auth.Curve once secure() was called
        self._monitor = None                # the ROUTER's socket monitor, and what counts its connections
        self._gate = None
        self._peer_queue = 0                # limit_messages: per-client queue bound, in messages (0: none)
        self._unread = Unread()             # and the big replies clients have not read yet
        # replies dropped at each bound, logged apart from other complaints so neither hides the other
        self._dropped = {"queue": LogThrottle(lines=5), "bytes": LogThrottle(lines=5)}
        self._adopted = weakref.WeakSet()   # what other threads own and must be closed before the context
        self._listener = None               # a server's local socket (kvps/wire/local.py), and its clients:
        self._locals = {}                   # routing id (an int) -> local.Conn
        self._fds = {}                      # and by descriptor (what the poller gives)
        self._limit = 2 << 30               # the biggest message a local client may send (limit_messages)
        self._listening = True              # the listener is polled (not while descriptors ran out)

    # ---- setup (call before start, or from the I/O thread) ----
    def secure(self, keys):
        """Authenticate and encrypt every socket with CURVE under `keys` (kvps.wire.keys.Keys): the
        ROUTER admits only the job's keys and refuses a message whose src is not its key's name
        (kvps/wire/auth.py); each DEALER pins its peer's public key. Call before bind and connect."""
        self._curve = Curve(keys, self._ctx, lambda: self.name, self.complaints)
        for sock in self._curve.sockets:
            self._poller.register(sock, zmq.POLLIN)

    def bind(self, host, port=0):
        """Bind the ROUTER on host:port (0 picks a free port); returns the port."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._curve.serve(sock)
        # connections counted (and refused past the cap, kvps/wire/connections.py); with CURVE, the
        # handshakes that fail are told too (kvps/wire/auth.py)
        self._monitor = sock.get_monitor_socket(connections.MONITORED | auth.MONITORED)
        self._gate = connections.Connections(self.complaints, lambda: self.name)
        self._poller.register(self._monitor, zmq.POLLIN)
        # Bounded per-client queues: a client that floods requests is read no faster than it is
        # served, and one that reads no replies fills its queue, after which its replies are dropped
        # (ROUTER_MANDATORY makes a full queue an error on a send that must not block: _reply_sock).
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.RCVHWM, self._peer_queue)
        sock.setsockopt(zmq.SNDHWM, self._peer_queue)
        if port:
            try:
                sock.bind(f"tcp://{host}:{port}")
            except zmq.ZMQError as exc:
                self._poller.unregister(self._monitor)
                sock.disable_monitor()
                self._monitor.close(0)
                sock.close(0)
                self._monitor = self._gate = None
                hint = (" (another job's scheduler or server, or one that has not exited yet?): choose another "
                        "port, or 0 for any free one" if exc.errno == errno.EADDRINUSE else "")
                raise ConfigError(f"{self.name}: cannot listen on {host}:{port}: {os.strerror(exc.errno)}{hint}") from None
            self.port = port
        else:
            self.port = sock.bind_to_random_port(f"tcp://{host}")
        self._router = sock
        self._poller.register(sock, zmq.POLLIN)
        return self.port

    def listen_local(self):
        """Also take clients on this host through a local socket named after the bound port and this
        pid (kvps/wire/local.py), unless the job runs CURVE; call after bind(). Returns whether it
        listens (a name in use or no Unix sockets: it does not, and clients use the ROUTER)."""
        if self._curve is not None or self.port is None:
            return False
        try:
            self._listener = local.Listener(self.port, self._limit)
        except OSError as exc:
            log.info("%s: no local socket (%s); clients on this host use TCP", self.name, exc)
            return False
        self._poller.register(self._listener, zmq.POLLIN)
        self.every(1.0, self._listen_again)
        return True

    def local_clients(self):
        """The local clients this Van has taken so far (listen_local)."""
        return self._listener.accepted if self._listener is not None else 0

    def every(self, interval, fn):
        """Run fn() on the I/O thread every `interval` seconds."""
        self._timers.append([time.monotonic() + interval, interval, fn])

    def call_later(self, delay, fn):
        """Run fn() once on the I/O thread after `delay` seconds (from any thread; fn must not block)."""
        with self._lock:
            if self._closed:
                return
            heapq.heappush(self._once, (time.monotonic() + delay, next(self._once_n), fn))
            if threading.current_thread() is not self._thread:
                self._wake()

    def limit_messages(self, nbytes, peer_queue=0, peer_reply_bytes=0):
        """Refuse (in zmq, which drops the connection) any received frame over `nbytes`
        (KVPS_MAX_MESSAGE_BYTES), on every socket opened from now on; queue at most `peer_queue`
        messages for one ROUTER client each way (KVPS_PEER_QUEUE) and hand zmq at most
        `peer_reply_bytes` of big replies that a client has not read (KVPS_PEER_REPLY_BYTES); 0: no
        bound. Call it before bind()."""
        self._ctx.setsockopt(zmq.MAXMSGSIZE, int(nbytes))
        self._limit = int(nbytes)
        self._peer_queue, self._unread.limit = int(peer_queue), int(peer_reply_bytes)

    def inject(self, faults):
        """Test only: lose, repeat and delay the data messages this node sends as `faults`
        (kvps.wire.faults.Faults) decides; call before start."""
        self.faults = faults

    def when_dead(self, fn):
        """Call fn(exc) on the I/O thread if it ever dies of an exception (a bug: it survives
        anything a peer sends), before it closes the sockets; the owner must then fail loudly,
        a daemon by exiting non-zero, never linger answering nothing."""
        self._on_death = fn

    def start(self):
        """Start the I/O thread. Raises KVPSError once stopped (a Van runs once)."""
        with self._lock:
            if self._stopping or self._thread is not None:
                raise KVPSError(f"{self.name}: the transport was already started or stopped; a Van runs once")
            self._running = True
            self._thread = threading.Thread(target=self._loop, name=f"kvps-io-{self.name}", daemon=True)
            self._thread.start()

    # ---- thread-safe API ----
    def connect(self, peer, host, port):
        """Open a DEALER to a peer (done on the I/O thread). Raises KVPSError once stopped, and
        ConfigError with CURVE on when the job's keys have no public key for `peer`."""
        if self._curve is not None:
            self._curve.server_key(peer)        # here, not on the I/O thread, which must not raise
        self._submit(("connect", peer, (host, port)), f"connecting to {peer}")

    def disconnect(self, peer):
        """Close the DEALER to a peer, dropping what is queued to it (a dead peer never takes it)."""
        self._submit(("disconnect", peer), None)

    def send(self, peer, header, payloads=(), on_sent=None, priority=None, bundle=False):
        """Send a message to a connected peer over its DEALER. Raises KVPSError once stopped.

        on_sent() is called once zmq no longer reads any of the payloads, whether they were sent,
        dropped (no connection, disconnect, stop) or copied; the caller may change them from then
        on. It runs on the I/O thread or on pyzmq's garbage-collector thread: keep it short.

        With a priority (data messages), the message may overtake waiting ones of lower priority
        (see kvps/wire/schedule.py); without one, it keeps its place after them. `bundle` (a peer
        that is a kvps daemon): it may go in one BUNDLE with the others to that peer that the I/O
        thread sends in the same turn, in their order (one zmq message instead of several)."""
        frames = [header.encode(), *payloads]
        if bundle:
            done = None if on_sent is None else _watch(frames, on_sent)
            item = ("bundle", ("send", peer), frames, done)
        elif self._schedule is not None and priority is not None:
            sizes = (memoryview(f).nbytes for f in payloads if not isinstance(f, bytes))
            big = sum(n for n in sizes if n >= COPY_BYTES)
            keys = tuple({entry.key for entry in header.keys})
            done = _watch(frames, self._credit_release(big, on_sent)) if big or on_sent else None
            item = ("data", peer, frames, done, priority, keys, big)
        else:
            done = None if on_sent is None else _watch(frames, on_sent)
            item = ("send", peer, frames, done)
        try:
            self._submit(item, f"{header.op.name} to {peer}")
        except KVPSError:
            if done is not None:
                done()
            raise
        if self.telemetry is not None:      # counted once handed on (see Telemetry's docstring)
            self.telemetry.sent(peer, header.op, frames)

    def dealer(self, peer, host, port):
        """A DEALER to a peer for the calling thread's own use (kvps/wire/lane.py), made like the I/O
        thread's (no queue bounds, CURVE, the message size limit). Its owner must close it before this
        Van ends: adopt() the owner. Raises KVPSError once stopped."""
        with self._lock:
            if self._stopping or self._closed:
                raise KVPSError(f"{self.name}: the transport is stopped (the node has left the job or shut "
                                f"down); no connection to {peer}")
            return self._dealer(peer, host, port)

    def _dealer(self, peer, host, port):
        """A DEALER connected to a peer: no queue bounds (a request waits until the peer takes it), no
        linger, CURVE to the peer's key when the job runs it."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if self._curve is not None:
            self._curve.dial(sock, peer)
        sock.connect(f"tcp://{host}:{port}")
        return sock

    def adopt(self, owner):
        """Close `owner` (anything with close(), e.g. a kvps.wire.lane.Lane holding dealer() sockets)
        as this Van ends, before its zmq context, unless it is collected first (it must then close
        its sockets itself, as a Lane's finalizer does). Raises KVPSError once stopped."""
        with self._lock:
            if self._stopping or self._closed:
                raise KVPSError(f"{self.name}: the transport is stopped (the node has left the job or shut down)")
            self._adopted.add(owner)

    def call_soon(self, fn):
        """Run fn() on the I/O thread, from any thread (kvps/ps/pool.py posts its finished merges
        so). Raises KVPSError once stopped."""
        self._submit(("call", fn), "a call on the I/O thread")

    def backlog(self):
        """(messages waiting for the I/O thread or the send credit, bytes zmq holds of scheduled data
        messages): queue depths for the metrics, read without the lock (any thread; a snapshot)."""
        waiting = len(self._queue) + (len(self._schedule) if self._schedule is not None else 0)
        return waiting, self._inflight

    def reply(self, routing_id, header, payloads=(), on_tracker=None, bundle=False):
        """Send a message back to a client of the ROUTER.

        on_tracker(tracker) is called (on the I/O thread) when a payload is big
        enough to be sent without copying, with a zmq MessageTracker for it. `bundle` (a client
        that is a kvps daemon, no on_tracker): as in send().
        """
        frames = [header.encode(), *payloads]
        if bundle:
            self._submit(("bundle", ("reply", routing_id), frames, None), None)
        elif not self._queue and not self._closed and threading.current_thread() is self._thread:
            self._reply_now(routing_id, frames, on_tracker)     # a handler's reply: nothing to wait behind
        else:
            self._submit(("reply", routing_id, frames, on_tracker), None)
        if self.telemetry is not None:      # counted once it went (see Telemetry's docstring)
            self.telemetry.replied(routing_id, header.op, frames)

    def stop(self, timeout=5.0):
        """Stop the I/O thread (after it hands zmq what is queued) and close the sockets.

        Safe from any thread and from a signal handler, before start(), twice, and while the I/O
        thread is exiting; waits up to `timeout` s for the I/O thread, except on the I/O thread
        and in a signal handler that interrupted this thread inside the lock, which the I/O thread
        needs to finish (it ends as soon as the interrupted call goes on)."""
        # RLock._is_owned is what threading.Condition relies on too: true only inside our own section.
        interrupted = self._lock._is_owned()
        with self._lock:
            first, self._stopping = not self._stopping, True
            thread = self._thread
            if thread is None:                  # never started: nothing else owns the sockets
                if first:
                    self._close()
                return
            if first and not self._closed:
                self._queue.append(("stop",))
                self._wake()
        if threading.current_thread() is not thread and not interrupted:
            thread.join(timeout)

    # ---- I/O thread ----
    def _submit(self, item, what):
        """Queue work for the I/O thread. After stop(), an item from another thread raises KVPSError
        naming `what`, or is dropped when `what` is None; the I/O thread itself queues until it ends
        (what it queues while stopping, such as replies and heartbeats, is flushed or dropped)."""
        on_io = threading.current_thread() is self._thread
        with self._lock:
            if self._closed or (self._stopping and not on_io):
                if what is None:
                    log.debug("%s: stopped; %s dropped", self.name, item[0])
                    return
                raise KVPSError(f"{self.name}: the transport is stopped (the node has left the job or "
                                f"shut down); {what} not sent")
            self._queue.append(item)
            if not on_io:       # the I/O thread flushes its queue before it polls again
                self._wake()

    def _wake(self):
        """Wake the I/O thread (call with self._lock held, before the pipe is closed)."""
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
                if self._late:
                    timeout = self._send_late(timeout)
                if self._queue:     # a timer queued work (a heartbeat, a resend): send it now
                    timeout = 0
                for sock, events in self._poller.poll(timeout):
                    if type(sock) is int and sock != self._wake_r:     # the local socket or a client of it
                        self._local_event(sock, events)
                    elif sock == self._wake_r:
                        # Read before clearing the flag: a byte written in between must not be
                        # swallowed while the flag says a wake-up is pending (that would stall sends).
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                        self._woken = False
                    elif sock is self._monitor:
                        self._monitored()
                    elif self._curve is not None and sock in self._curve.sockets:
                        self._curve.handle(sock)    # ZAP requests
                    else:
                        self._drain(sock)
                self._flush()
        except BaseException as exc:
            log.critical("%s: the I/O thread died; this node can no longer send or receive", self.name,
                         exc_info=True)
            if self._on_death is not None:
                try:
                    self._on_death(exc)
                except BaseException:
                    log.exception("%s: the I/O thread's death hook failed", self.name)
            raise
        finally:
            self._close()

    def _run_timers(self):
        if self._once:
            self._run_once()
        if not self._timers:
            return self._once_timeout(1000)
        now = time.monotonic()
        for timer in self._timers:
            if now >= timer[0]:
                timer[0] = now + timer[1]
                try:
                    timer[2]()
                except Exception:
                    log.exception("%s: timer %s failed", self.name, timer[2])
        return self._once_timeout(max(0, int(1000 * (min(t[0] for t in self._timers) - time.monotonic())) + 1))

    def _run_once(self):
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._once or self._once[0][0] > now:
                    return
                _, _, fn = heapq.heappop(self._once)
            try:
                fn()
            except Exception:
                log.exception("%s: %s failed", self.name, fn)

    def _once_timeout(self, timeout):
        """The poll timeout (ms) that wakes the loop for the next call_later too."""
        if not self._once:          # (read without the lock: a call_later from elsewhere wakes the loop)
            return timeout
        with self._lock:
            if not self._once:
                return timeout
            due = self._once[0][0]
        return min(timeout, max(0, int(1000 * (due - time.monotonic())) + 1))

    def _credit_release(self, nbytes, on_sent):
        """on_sent for a scheduled message: its bytes leave the window (any thread), then on_sent."""
        def release():
            with self._lock:
                self._inflight -= nbytes
                if self._schedule and not self._closed:
                    self._wake()            # waiting messages may fit now
            if on_sent is not None:
                on_sent()
        return release

    def _flush(self):
        bundles = {}        # ("send", peer) or ("reply", routing id) -> [(frames, done)] in order
        while self._queue:
            item = self._queue.popleft()
            kind = item[0]
            if kind == "bundle":
                bundles.setdefault(item[1], []).append(item[2:])
                continue
            if bundles and kind in ("data", "send", "reply"):
                # what waits to go to the same peer goes first
                to = ("reply" if kind == "reply" else "send", item[1])
                waiting = bundles.pop(to, None)
                if waiting:
                    self._send_bundle(to, waiting)
            if kind == "data":
                self._schedule.add(item[1], item[4], item[5], item[6], item[1:4])
            elif kind == "send":
                if self._schedule is not None and self._schedule.holds(item[1]):
                    self._schedule.add(item[1], None, (), 0, item[1:4])     # keeps its place
                else:
                    self._send_now(*item[1:])
            elif kind == "reply":
                self._reply_now(*item[1:])
            elif kind == "connect":
                self._connect_now(item[1], *item[2])
            elif kind == "disconnect":
                self._disconnect_now(item[1])
            elif kind == "call":
                try:
                    item[1]()
                except Exception:
                    log.exception("%s: a call on the I/O thread failed", self.name)
            elif kind == "stop":
                self._running = False
            del item, kind      # payloads die here, not at the next message (see _watch)
        for to, waiting in bundles.items():
            self._send_bundle(to, waiting)
        bundles = waiting = None
        if self._schedule:
            self._send_scheduled()

    def _send_bundle(self, to, messages):
        """Send [(frames, done)] to `to` (("send", peer) or ("reply", routing id)): one as it is,
        several in one BUNDLE."""
        if len(messages) == 1:
            frames, done = messages[0]
        else:
            frames = protocol.bundle(self.name, [m[0] for m in messages])
            dones = [m[1] for m in messages if m[1] is not None]

            def done():
                for fn in dones:
                    fn()
        if to[0] == "send":
            self._send_now(to[1], frames, done)
        else:
            self._reply_now(to[1], frames, None)
            if done is not None:
                done()

    def _send_scheduled(self):
        """Hand zmq the waiting data messages that fit the credit window (all of them once stopping)."""
        with self._lock:
            inflight = self._inflight
        ready = self._schedule.ready(inflight) if self._running else self._schedule.drain()
        for (peer, frames, done), nbytes in ready:
            with self._lock:
                self._inflight += nbytes
            self._send_now(peer, frames, done)
        ready = frames = done = None    # as in _flush: our hold on the payloads ends here

    def _send_now(self, peer, frames, done):
        if self.faults is not None and self._faulted("send", peer, (peer, frames, done)):
            return
        self._send_sock(peer, frames, done)

    def _send_sock(self, peer, frames, done):
        if self.telemetry is not None and self.telemetry.timeline is not None:
            self.telemetry.handed(peer, _request_id(frames[0]))
        sock = self._dealers.get(peer)
        if sock is None:
            log.error("%s: no connection to %s; message dropped", self.name, peer)
        else:
            try:
                send_message(sock, frames)
            except zmq.ZMQError as exc:
                log.error("%s: sending to %s failed (%s); message dropped", self.name, peer, exc)
        if done is not None:
            done()      # our hold on the payloads; zmq's ends as it lets go of them (see _watch)

    def _reply_now(self, routing_id, frames, on_tracker):
        if self.faults is not None and self._faulted("reply", routing_id, (routing_id, frames, on_tracker)):
            return
        self._reply_sock(routing_id, frames, on_tracker)

    def _reply_sock(self, routing_id, frames, on_tracker):
        if type(routing_id) is int:
            return self._reply_local(routing_id, frames)
        if self._router is None:
            return
        big = on_tracker is not None and any(
            not isinstance(f, bytes) and memoryview(f).nbytes >= TRACK_BYTES for f in frames[1:])
        nbytes = sum(memoryview(f).nbytes for f in frames[1:]) if big else 0
        if big and not self._unread.fits(routing_id, nbytes):
            self._dropped["bytes"](log, logging.WARNING, "%s: a %d-byte reply dropped: the client has %d bytes "
                                   "of replies it has not read (KVPS_PEER_REPLY_BYTES)", self.name, nbytes,
                                   self._unread.held(routing_id))
            return
        try:
            # Never blocks: a client whose queue is full (KVPS_PEER_QUEUE) raises zmq.Again here.
            if big:
                tracker = self._router.send_multipart([routing_id, *frames], zmq.NOBLOCK, copy=False, track=True)
                self._unread.add(routing_id, tracker, nbytes)
                on_tracker(tracker)
            else:
                self._router.send(routing_id, NOBLOCK | SNDMORE)
                send_message(self._router, frames)
        except zmq.Again:
            self._dropped["queue"](log, logging.WARNING, "%s: a reply dropped: the client reads none and has %d "
                                   "messages queued (KVPS_PEER_QUEUE)", self.name, self._peer_queue)
        except zmq.ZMQError as exc:
            self.complaints(log, logging.WARNING, "%s: reply to a client that went away dropped (%s)", self.name, exc)

    # ---- test-only faults (kvps/wire/faults.py), on the I/O thread ----
    def _faulted(self, kind, to, args):
        """Apply the faults to one outgoing message; True when it is handled here (dropped, or held
        back to be sent later by _send_late) rather than to be sent now by the caller."""
        now = time.monotonic()
        copies, delay = self.faults.decide(_op(args[1][0]))
        behind = self._late_until.get(to, 0.0) > now      # later messages to `to` queue behind it
        if copies == 1 and not delay and not behind:
            return False
        if copies == 0:
            log.debug("%s: fault: dropped a %s", self.name, kind)
            if kind == "send" and args[2] is not None:
                args[2]()
            return True
        # a repeat goes just before the original and owns its bytes (the original's may change later)
        copy = (to, [bytes(memoryview(f)) for f in args[1]], None) if copies == 2 else None
        if not delay and not behind:
            if copy is not None:
                (self._send_sock if kind == "send" else self._reply_sock)(*copy)
            return False
        due = max(now + delay, self._late_until.get(to, 0.0))
        self._late_until[to] = due
        if copy is not None:
            heapq.heappush(self._late, (due, next(self._late_n), kind, copy))
        if kind == "reply":
            # A reply's payloads are views of values the store may change once no tracker holds them
            # (kvps/ps/store.py: `sent`); a late reply has no tracker yet, so it carries a copy.
            args = (to, [bytes(memoryview(f)) for f in args[1]], None)
        heapq.heappush(self._late, (due, next(self._late_n), kind, args))
        return True

    def _send_late(self, timeout):
        """Send the delayed messages that are due; returns the poll timeout (ms) until the next."""
        now = time.monotonic()
        while self._late and self._late[0][0] <= now:
            _, _, kind, args = heapq.heappop(self._late)
            (self._send_sock if kind == "send" else self._reply_sock)(*args)
        args = None
        if not self._late:
            self._late_until.clear()
            return timeout
        return max(0, min(timeout, int(1000 * (self._late[0][0] - now)) + 1))

    def _disconnect_now(self, peer):
        old = self._dealers.pop(peer, None)
        if old is not None:
            self._poller.unregister(old)
            self._peer_of.pop(old, None)
            old.close(0)        # LINGER 0: zmq drops (and so lets go of) what was queued to the peer

    def _connect_now(self, peer, host, port):
        self._disconnect_now(peer)
        sock = self._dealer(peer, host, port)
        self._dealers[peer] = sock
        self._peer_of[sock] = peer
        self._poller.register(sock, zmq.POLLIN)

    def _drain(self, sock):
        """Receive a bounded batch of what waits on one socket and hand each message on. Nothing a
        peer sends ends this loop: a message that does not decode, or whose handling raises anything
        at all (a RecursionError, a TypeError, ...), goes to _bad and the loop goes on. Called
        when poll() said the socket is readable."""
        from_router = sock is self._router
        is_local = type(sock) is local.Conn     # a client on this host (listen_local)
        ready = True                    # poll() said it is readable
        for _ in range(256):   # bounded so one busy peer cannot starve the rest
            try:
                frames = sock.receive() if is_local else recv_message(sock, ready)
                ready = False
                if frames is None:
                    return
            except zmq.ZMQError as exc:
                self.complaints(log, logging.WARNING, "%s: receiving failed (%s)", self.name, exc)
                return
            except (EOFError, OSError, ProtocolError) as exc:
                self._drop_local(sock, exc)
                return
            source = header = None
            try:
                if is_local:
                    source = ("client", sock.ident)
                elif from_router:
                    source = ("client", frames[0].bytes)
                    frames = frames[1:]
                else:
                    source = ("peer", self._peer_of[sock])
                header, payloads = protocol.unpack(frames)
                if header.op is Op.BUNDLE:
                    messages, header = protocol.unbundle(header, payloads), None
            except Exception as exc:
                self._bad(source, frames, exc, header)
                header = payloads = frames = None
                continue
            if header is not None:
                self._take(source, frames, header, payloads, from_router)
            else:
                for frames in messages:
                    try:
                        header, payloads = protocol.unpack(frames)
                        if header.op is Op.BUNDLE:
                            raise ProtocolError("a BUNDLE inside a BUNDLE")
                    except Exception as exc:
                        self._bad(source, frames, exc, None)
                        continue
                    self._take(source, frames, header, payloads, from_router)
                messages = None
            header = payloads = frames = None      # payloads die here, not at the next message

    def _take(self, source, frames, header, payloads, from_router):
        """Hand one decoded message to the handler (on the I/O thread; see _drain)."""
        try:
            if from_router and self._curve is not None:
                why = self._curve.impostor(frames[0], header)   # (logged there, once per key and name)
                if why:         # a job member speaking as another: answered, never handled
                    err = protocol.error_header(header.id, self.name, "protocol", f"{self.name} refused it: {why}")
                    self._reply_now(source[1], [err.encode()], None)
                    return
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s <- %r", self.name, header)
            try:
                self._handler(source, header, payloads)
            finally:
                if self.telemetry is not None:      # counted once handled: its replies went first
                    self.telemetry.received(source, header, frames)
        except Exception as exc:
            self._bad(source, frames, exc, header)

    def _bad(self, source, frames, exc, header=None):
        """A message that did not decode (header None) or whose handler raised: log it (throttled,
        escaped) and answer a ROUTER client with an ERROR, which ends its wait for this id."""
        try:
            text = escape(describe(exc) or type(exc).__name__)
            if header is None:
                kind, what = "protocol", "refused the message"
                if not isinstance(exc, ProtocolError):      # the decoder itself failed: say how
                    text = f"{type(exc).__name__}: {text}"
                self.complaints(log, logging.WARNING, "%s: dropped a bad message from %s: %s",
                                self.name, _show(source), text)
            else:
                kind, what = error_kind(exc), f"could not handle {header.op.name}"
                self.complaints(log, logging.ERROR, "%s: handling %s from %s failed: %s", self.name,
                                header.op.name, _show(source), text, exc_info=exc)
            if source is not None and source[0] == "client" and frames:
                # Answer a peer that can read our errors; it may be waiting for this id.
                request_id = header.id if header is not None else _request_id(frames[0])
                err = protocol.error_header(request_id, self.name, kind, f"{self.name} {what}: {text}")
                self._reply_now(source[1], [err.encode()], None)
            if header is None and source is not None and self._on_bad is not None:
                self._on_bad(source, exc)
        except Exception:           # never let the report of a bad message end the I/O thread
            self.complaints(log, logging.ERROR, "%s: reporting a bad message failed", self.name, exc_info=True)

    # ---- local clients (kvps/wire/local.py), on the I/O thread ----
    def _local_event(self, fd, events):
        conn = self._fds.get(fd)
        if conn is None:
            if self._listener is not None and fd == self._listener.fileno():
                self._accept()
            return
        if events & POLLOUT:
            self._flush_local(conn)
        if events & POLLIN and not conn.closed:
            self._drain(conn)

    def _accept(self):
        """Take the local clients waiting to connect (bounded: a flood cannot starve the Van)."""
        for _ in range(auth.BATCH):
            try:
                conn = self._listener.accept(room=len(self._locals) < MAX_LOCAL)
            except PermissionError as exc:
                self.complaints(log, logging.WARNING, "%s: a local connection refused: %s", self.name, exc)
                continue
            except OSError as exc:          # no descriptor left: stop listening a while (_listen_again)
                self.complaints(log, logging.WARNING, "%s: accepting a local client failed (%s); "
                                "not listening for a second", self.name, exc)
                self._poller.unregister(self._listener)
                self._listening = False
                return
            if conn is None:
                return
            self._locals[conn.ident] = conn
            self._fds[conn.fileno()] = conn
            self._poller.register(conn, zmq.POLLIN)

    def _listen_again(self):
        if not self._listening and self._listener is not None:
            self._listening = True
            self._poller.register(self._listener, zmq.POLLIN)

    def _reply_local(self, ident, frames):
        conn = self._locals.get(ident)
        if conn is None:
            self.complaints(log, logging.DEBUG, "%s: a reply to a local client that went away dropped", self.name)
            return
        if self._peer_queue and conn.waiting() >= self._peer_queue:
            self._dropped["queue"](log, logging.WARNING, "%s: a reply dropped: the local client reads none and "
                                   "has %d messages queued (KVPS_PEER_QUEUE)", self.name, self._peer_queue)
            return
        try:
            if conn.post(frames) and not conn.watched:
                conn.watched = True
                self._poller.modify(conn, POLLIN | POLLOUT)
        except OSError as exc:
            self._drop_local(conn, exc)

    def _flush_local(self, conn):
        try:
            if not conn.flush() and conn.watched:
                conn.watched = False
                self._poller.modify(conn, POLLIN)
        except OSError as exc:
            self._drop_local(conn, exc)

    def _drop_local(self, conn, exc):
        """A local client that left (EOFError) or sent what kvps never sends: close it."""
        if conn.closed:
            return
        level = logging.DEBUG if isinstance(exc, EOFError) else logging.WARNING
        self.complaints(log, level, "%s: local client %d closed: %s", self.name, conn.ident,
                        escape(describe(exc) or type(exc).__name__))
        self._poller.unregister(conn)
        del self._locals[conn.ident], self._fds[conn.fileno()]
        conn.close()

    def _monitored(self):
        """Read the ROUTER's socket monitor (bounded: a flood of connections cannot starve the Van)."""
        for _ in range(auth.BATCH):
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            self._gate.event(event["event"], event["value"])
            if self._curve is not None:
                self._curve.event(event)

    def _close(self):
        """Close everything (on the I/O thread as it ends, or in stop() if it never started)."""
        with self._lock:                # no submit is between its check and its wake-up write now
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            os.close(self._wake_r)
            os.close(self._wake_w)
        if self._schedule is not None:
            dropped += [("send", *item) for item, _ in self._schedule.drain()]
        dropped += [(kind, *args) for _, _, kind, args in self._late if kind == "send"]
        self._late.clear()
        for item in dropped:
            if item[0] in ("send", "data") and item[3] is not None:
                item[3]()
        if dropped:
            log.debug("%s: %d queued items dropped at close", self.name, len(dropped))
        dropped = item = None       # dropped payloads die here: their on_sent runs
        adopted, self._adopted = list(self._adopted), weakref.WeakSet()
        for owner in adopted:           # after _closed is set: no new ones (dealer, adopt refuse)
            try:
                owner.close()
            except Exception:
                log.exception("%s: closing %r failed", self.name, owner)
        for conn in self._locals.values():
            conn.close()
        self._locals.clear()
        self._fds.clear()
        if self._listener is not None:
            self._listener.close()
        if self._monitor is not None:
            self._router.disable_monitor()
            self._monitor.close(0)
        for sock in list(self._dealers.values()) + ([self._router] if self._router is not None else []):
            sock.close(0)
        if self._curve is not None:
            self._curve.close()
        self._dealers.clear()
        self._peer_of.clear()
        self._ctx.term()


def _watch(frames, on_sent):
    """Arrange for on_sent() once zmq lets go of every payload in `frames` (in place); returns the
    sender's own hold, which the I/O thread releases once it has handed the message to zmq.

    Each big payload is replaced by a memoryview of it that only zmq's zero-copy machinery ever
    references (pyzmq's garbage collector drops it when libzmq frees the message), so the view dies
    exactly when zmq is done with the memory, sent or dropped; small ones are copied at send."""
    holds, lock = [1], threading.Lock()

    def release():
        with lock:
            holds[0] -= 1
            last = holds[0] == 0
        if last:
            on_sent()
    for i in range(1, len(frames)):
        if not isinstance(frames[i], bytes) and memoryview(frames[i]).nbytes >= COPY_BYTES:
            frames[i] = view = memoryview(frames[i])
            holds[0] += 1
            weakref.finalize(view, release).atexit = False
    return release


class Unread:
    """The big replies (zmq MessageTrackers) each ROUTER client has been handed and not yet read,
    so that one client cannot make a daemon hold more than `limit` bytes for it (0: no limit)."""

    def __init__(self, limit=0):
        self.limit = limit
        self._by_client = {}           # routing id -> deque of [tracker, nbytes], oldest first
        self._bytes = {}

    def held(self, client):
        """Bytes still held for `client`, after dropping the replies zmq has sent."""
        queue = self._by_client.get(client)
        while queue and queue[0][0].done:
            self._bytes[client] -= queue.popleft()[1]
        if queue is not None and not queue:
            del self._by_client[client], self._bytes[client]
            return 0
        return self._bytes.get(client, 0)

    def fits(self, client, nbytes):
        """Whether a reply of nbytes may go to `client` (always, when nothing else is held for it)."""
        if not self.limit:
            return True
        held = self.held(client)
        return not held or held + nbytes <= self.limit

    def add(self, client, tracker, nbytes):
        if not self.limit:
            return
        if client not in self._by_client and len(self._by_client) >= 1024:
            for other in list(self._by_client):        # clients long gone: their replies are done
                self.held(other)
        self._by_client.setdefault(client, collections.deque()).append((tracker, nbytes))
        self._bytes[client] = self._bytes.get(client, 0) + nbytes


def recv_message(sock, ready=False):
    """The next multipart message waiting on `sock`, as zmq.Frames, or None when none is. `ready`:
    poll() just said the socket is readable, so the first receive is tried without asking EVENTS
    (pyzmq turns that option into an enum each time: about 1 us and two Python calls); otherwise
    EVENTS is asked first (it costs a third of the zmq.Again a failed receive raises). pyzmq's
    recv_multipart asks the socket for RCVMORE after every frame, an option lookup that costs more
    than a small frame: a Frame knows whether more follow."""
    if not ready and not sock.getsockopt(EVENTS) & POLLIN:
        return None
    try:
        frame = sock.recv(NOBLOCK, copy=False)
    except zmq.Again:               # poll()'s answer was stale
        return None
    frames = [frame]
    while frame.more:
        frame = sock.recv(0, copy=False)
        frames.append(frame)
    return frames


def send_message(sock, frames, copy=False):
    """Send a multipart message: small frames are copied (pyzmq's fast path), big ones are not,
    unless `copy` (every frame copied: the caller may change them once this returns)."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        flags = SNDMORE if i < last else 0
        if copy or isinstance(frame, bytes) or memoryview(frame).nbytes < COPY_BYTES:
            sock.send(frame, flags, copy=True)
        else:
            sock.send(frame, flags, copy=False)


def _show(source):
    if source is None:
        return "an unknown sender"
    kind, who = source
    if kind == "peer":
        return escape(who)
    return f"local client {who}" if type(who) is int else f"client {who.hex()}"


def _op(frame):
    """The op code of an encoded header (kvps writes v, op and id first), for the fault injector;
    -1 when it cannot be read."""
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=1 << 16)
        unpacker.feed(memoryview(frame)[:256])
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "op":
                return unpacker.unpack()
            unpacker.skip()
    except Exception:
        pass
    return -1


def _request_id(frame):
    """Best-effort request id of a header that did not decode, so the sender's wait ends. Reads the
    top-level map one field at a time (kvps writes v, op and id first), and only its first 4 KiB:
    a huge or deeply nested header costs nothing more here."""
    try:
        head = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)[:4096]
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=8192)
        unpacker.feed(head)
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "id":
                value = unpacker.unpack()
                return value if type(value) is int else 0
            unpacker.skip()
    except Exception:
        pass
    return 0
