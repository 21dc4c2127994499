"""Handles for asynchronous calls, and the table of requests waiting for replies.

A call that sends messages to several peers returns one Handle that completes
when every reply has arrived. The handle keeps the caller's arrays alive until
then (zmq may still be reading them), and `wait` raises the first error a peer
reported, or KVTimeoutError naming what it still waits for.

With resends on (KVPS_RESEND_TIMEOUT, or KVPS_FAULTS), a data request unanswered after the resend
timeout is sent again with the same id, the timeout doubling each time up to MAX_RESEND_INTERVAL;
the server answers an id once (kvps/wire/window.py) and a second reply to an id already answered is
ignored here, so lost and duplicated messages change nothing but the time a call takes.

With chain replication (KVPS_REPLICAS, `keep_data`), every data request is kept until answered,
and when its server dies `redirect` hands it over, same id, to the server that now heads its
key range's chain (kvps/wire/chains.py), which answers an id it already applied without applying it
again. What a request says about the sender's shared memory with the dead server does not go with
it: `rehome(header, payloads, dead)`, set by the kvstore, gives the message to send instead.
"""
import itertools
import logging
import math
import threading
import time

from kvps.errors import KVTimeoutError, NodeFailure, remote_error
from kvps.wire.protocol import Op

log = logging.getLogger("kvps.wire")


class Handle:
    """The pending result of an asynchronous call (MXNet's Wait(ts), as an object)."""

    def __init__(self, what, timeout, keep=()):
        self.what = what
        self._timeout = timeout
        self._keep = keep               # buffers zmq may still read
        self._waiting = {}              # request id -> peer name
        self._error = None
        self._finished = False
        self._gate = threading.Lock()   # held until the handle completes (lighter than an Event)
        self._gate.acquire()
        self._lock = threading.Lock()
        self._armed = False
        self.then = ()                  # callables run once, on the waiting thread, after success
        self.meta = {}                  # the meta of the last reply (e.g. a barrier's "last")
        self._on_done = None            # when_done's fn

    @classmethod
    def completed(cls, what):
        handle = cls(what, 0)
        handle._complete()
        return handle

    @classmethod
    def failed(cls, what, error):
        """A handle whose call failed before it sent anything."""
        handle = cls(what, 0)
        handle._error = error
        handle._complete()
        return handle

    def done(self):
        return self._finished

    def succeeded(self):
        return self._finished and self._error is None

    def _complete(self):
        """Mark done and wake the waiters (call with self._lock held, or before sharing)."""
        if not self._finished:
            self._finished = True
            if self._on_done is not None:
                try:
                    self._on_done(self._error)
                except Exception:           # an observer's failure must not keep the waiters waiting
                    log.warning("%s: a completion callback failed", self.what, exc_info=True)
            self._gate.release()

    def when_done(self, fn):
        """Run fn(error or None) once, as the handle completes (on the thread that completes it),
        or now if it already has. One fn per handle; it must be short and must not wait."""
        with self._lock:
            if not self._finished:
                self._on_done = fn
                return
        fn(self._error)

    def wait(self, timeout=None):
        """Block until done; raises the call's error, or KVTimeoutError after `timeout` seconds
        (default KVPS_TIMEOUT)."""
        timeout = self._timeout if timeout is None else timeout
        if not self._finished:
            if not self._gate.acquire(timeout=timeout):
                with self._lock:
                    peers = sorted(set(self._waiting.values()))
                raise KVTimeoutError(f"{self.what}: no reply from {', '.join(peers) or 'peers'} "
                                     f"within {timeout:g} s (KVPS_TIMEOUT)")
            self._gate.release()        # let any other waiter through too
        self._keep = ()
        if self._error is not None:
            raise self._error
        then, self.then = self.then, ()
        for fn in then:
            fn()
        return self

    # ---- used by Requests (any thread) ----
    def _expect(self, request_id, peer):
        with self._lock:
            self._waiting[request_id] = peer

    def _arm(self):
        """All requests are registered: the handle may now complete."""
        with self._lock:
            self._armed = True
            if not self._waiting:
                self._complete()

    def _answered(self, request_id, error=None):
        with self._lock:
            self._waiting.pop(request_id, None)
            if error is not None and self._error is None:
                self._error = error
            if self._armed and (not self._waiting or error is not None):
                self._complete()


def remember(pending, handle):
    """Keep an asynchronous call's handle (in the deque `pending`) for wait_all(), dropping the ones
    at the front that already succeeded, so a long run does not pile them up."""
    while take_front(pending, Handle.succeeded) is not None:
        pass
    pending.append(handle)


def take_front(queue, ready):
    """Remove and return the item at the front of the deque `queue` if ready(item), else None.
    Threads that share the queue (a script's own threads calling one kvstore) may call it at once:
    each item is taken by one of them, and none takes an item that is not ready."""
    while True:
        try:
            item = queue[0]
        except IndexError:
            return None
        if not ready(item):
            return None
        try:
            queue.remove(item)          # (the front, unless another thread took it first)
            return item
        except ValueError:
            continue


MAX_RESEND_INTERVAL = 10.0     # seconds: the backoff of a request that waits long (a slow sync round)


class Requests:
    """Requests sent and not yet answered, by request id (ps-lite's Customer).

    `resend_after` > 0: requests added with a message to resend are offered again by `overdue`
    once that many seconds pass without a reply (see the module docstring)."""

    def __init__(self, resend_after=0.0, keep_control=False, keep_data=False):
        self._ids = itertools.count(1)
        self._pending = {}              # id -> (handle, peer, on_reply)
        self._lock = threading.Lock()
        self.failure = None             # once set, every new request fails at once
        self.resend_after = resend_after
        self._resend = {}               # id -> [due, interval, peer, header, payloads]
        self.resent = 0                 # requests sent again
        self.keep_control = keep_control    # keep requests to the scheduler, for a recovered one
        self._control = {}              # id -> (peer, header, payloads)
        self.keep_data = keep_data      # keep data requests for redirect (never due for a resend)
        self.moved = {}                 # dead peer -> peer_for(header) of its redirect: later requests too
        self.rehome = None              # (header, payloads, dead peer) -> (header, payloads) to send elsewhere (the same header if unchanged)

    def next_id(self):
        """A fresh request id, for a request that is not kept here (kvps/wire/lane.py)."""
        return next(self._ids)

    def add(self, handle, peer, on_reply=None, message=None, control=False):
        """Register a request to `peer`; returns its id. on_reply(header, payloads) runs on the
        I/O thread before the handle counts the reply; an exception there fails the handle.
        `message`: (header, payloads) to send again while it is unanswered, when resends are on; with
        `control` (a request to the scheduler), kept for `control_pending` instead when keep_control."""
        request_id = next(self._ids)
        with self._lock:
            if self.failure is not None:
                raise self.failure
            if peer in self.moved and message is not None:     # routed before its server's death was known
                peer = self.moved[peer](message[0]) or peer
            self._pending[request_id] = (handle, peer, on_reply)
            handle._expect(request_id, peer)
            if control:
                if message is not None and self.keep_control and message[0].op != Op.REGISTER:
                    self._control[request_id] = (peer, *message)
            elif message is not None and (self.resend_after > 0 or self.keep_data):
                after = self.resend_after or math.inf
                self._resend[request_id] = [time.monotonic() + after, after, peer, *message]
        return request_id

    def overdue(self, now=None):
        """[(peer, header, payloads)] of the requests to send again now (each one's next resend is
        then due after twice the wait)."""
        now = time.monotonic() if now is None else now
        out = []
        with self._lock:
            for entry in self._resend.values():
                if entry[0] <= now:
                    entry[1] = min(2 * entry[1], MAX_RESEND_INTERVAL)
                    entry[0] = now + entry[1]
                    out.append((entry[2], entry[3], entry[4]))
            self.resent += len(out)
        return out

    def redirect(self, dead, peer_for):
        """Hand the unanswered data requests to `dead` to peer_for(header) (a name, or None to fail
        them with the job); returns [(peer, header, payloads)] to send, oldest first (I/O thread)."""
        out = []
        with self._lock:
            self.moved[dead] = peer_for
            for request_id in sorted(self._resend):
                entry = self._resend[request_id]
                if entry[2] != dead:
                    continue
                peer = peer_for(entry[3])
                if peer is None:
                    continue
                entry[2] = peer
                if self.rehome is not None:
                    entry[3], entry[4] = self.rehome(entry[3], entry[4], dead)
                handle, _, on_reply = self._pending[request_id]
                self._pending[request_id] = (handle, peer, on_reply)
                with handle._lock:
                    handle._waiting[request_id] = peer
                out.append((peer, entry[3], entry[4]))
            self.resent += len(out)
        return out

    def peer_of(self, request_id, peer):
        """The peer an added request went to (another than asked when its server had died)."""
        with self._lock:
            entry = self._pending.get(request_id)
        return peer if entry is None else entry[1]

    def rehomed(self, request_id, dead, header, payloads):
        """(header, payloads) of an added request that goes elsewhere than to `dead`, to which it
        was sent (see `rehome`); its kept copy becomes that message too."""
        if self.rehome is None:
            return header, payloads
        header, payloads = self.rehome(header, payloads, dead)
        with self._lock:
            entry = self._resend.get(request_id)
            if entry is not None:
                entry[3], entry[4] = header, payloads
        return header, payloads

    def answer(self, header, payloads):
        """Match a reply to its request (I/O thread). Returns False for an unknown id. A reply with
        meta `held` (chain replication) brings the request's values, and its acknowledgement comes
        later, same id: the request is answered then (it is sent again to a new head meanwhile)."""
        held = header.meta.get("held")
        with self._lock:
            if held:
                entry = self._pending.get(header.id)
            else:
                entry = self._pending.pop(header.id, None)
                if self._resend:
                    self._resend.pop(header.id, None)
                if self._control:
                    self._control.pop(header.id, None)
        if entry is None:
            return False
        handle, peer, on_reply = entry
        handle.meta = header.meta
        if header.op == Op.ERROR:
            handle._answered(header.id, remote_error(header.meta.get("kind"), header.meta.get("message", "")))
            return True
        error = None
        if on_reply is not None:
            try:
                on_reply(header, payloads)
            except Exception as exc:   # a bad reply fails this call, not the I/O thread
                error = exc
        if held:
            if error is None:
                return True
            with self._lock:
                self._pending.pop(header.id, None)
                self._resend.pop(header.id, None)
        handle._answered(header.id, error)
        return True

    def control_pending(self):
        """[(peer, header, payloads)] of the unanswered requests to the scheduler (barriers, a
        FINALIZE): a recovered scheduler never received them, so they go again."""
        with self._lock:
            return list(self._control.values())

    def fail(self, exc, peer=None):
        """Fail the requests to `peer` (all requests when None) with `exc`."""
        with self._lock:
            ids = [i for i, (_, p, _) in self._pending.items() if peer is None or p == peer]
            entries = [self._pending.pop(i) for i in ids]
            for i in ids:
                self._resend.pop(i, None)
                self._control.pop(i, None)
        for request_id, (handle, _, _) in zip(ids, entries):
            handle._answered(request_id, exc)

    def fail_all(self, exc):
        """Fail everything pending and everything sent from now on."""
        with self._lock:
            if self.failure is None:
                self.failure = exc
        self.fail(exc)


def node_failure(meta):
    """The NodeFailure for a NODE_FAILED message."""
    node, reason = meta.get("node", "?"), meta.get("reason", "")
    return NodeFailure(f"node {node} failed: {reason}")
