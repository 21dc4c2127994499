"""Coalescing: small pushes, and small async pushpulls, called one key at a time travel as one request.

MXNet scripts (and Gluon's Trainer up to MXNet 1.5) push each key on its own (`for k: push(k)`,
then `for k: pull(k)`). Sent alone, each push costs a message each way, a server's handling of it and the
worker's Python around both; with hundreds of small keys those calls are most of a step (MXNet
hides them behind its engine's C++ threads). So a blocking push that follows another push, and is
small (it would go on the caller's lane, kvps/wire/lane.py), is not sent at once: its values are
copied (the caller may reuse its array as soon as push returns, as always) and it joins an open
batch. The batch goes as one request per server, on the caller's lane, when

- any other call of the kvstore comes (a pull, pushpull, barrier, wait_all, close, ...), or a push
  that cannot join (a key already in the batch, another op, a big or async_op push);
- it would pass KVPS_LANE_BYTES;
- it is KVPS_COALESCE_US old when the node's I/O thread looks, between two calls (it only tries the
  lock that a call holds): the I/O thread sends it through the I/O path, once every request its keys
  wait on is answered, which keeps each key's calls in order. So it goes at most about
  KVPS_COALESCE_US after the script stops calling.

What a push means does not change: a later pull of the key sees it, an error is raised by the next
call, and a sync round closes once every worker's push is in; a push just leaves later: while the
script goes on pushing, and at most about KVPS_COALESCE_US after it stops calling. The first push
after any other call goes at once (so a script that pulls each key right after pushing it sends as
before), and so does every push when KVPS_COALESCE_US is 0, or where lanes are off
(KVPS_LANE_BYTES=0, resends, injected faults).

Small `pushpull(key, ..., async_op=True)` calls of one key each (Horovod's per-tensor
allreduce_async_, or a Gluon-style per-key loop made asynchronous) wait in a batch of their own by the
same rules, the first of them too: nothing reads an async call's `out` before waiting for it. The
batch goes as one PUSHPULL of all their keys, through the I/O thread. (A call of a list of keys goes
as its caller fused it: kvps.torch's buckets.) Such a call returns a Joined handle: waiting on it
(or wait_all()) sends the batch if it has not gone yet, on the waiting thread's lane, whose replies
that wait reads; then it waits for the batch's replies, which fill every call's `out`. A blocking pushpull cannot wait in a batch: its
`out` is read as soon as it returns.

    coalesce = Coalescer(delay_s, limit_bytes, later)  # later(s, fn): fn on the I/O thread (Van.call_later)
    with coalesce.lock:                               # a push:
        if not coalesce.fits(op, keys, nbytes): send(coalesce.take())
        if coalesce.follows == Op.PUSH: add it to coalesce.batch (coalesce.open(Batch(...), send) first)
        else: send it now
        coalesce.follows = Op.PUSH                    # any other call sets it None

The kvstore (kvps/kvstore/ps.py) holds `lock` through every push and async pushpull, and while any
other call (or a wait on a Joined handle) sends the open batch; the I/O thread's check only tries
the lock, so it never waits on the caller, and a batch changes only between calls or inside a push
or an async pushpull.
"""
import threading
import time

from kvps.wire.protocol import Op


class Batch:
    """Calls waiting to go as one request: their (KeyInfo, array) items, the Messages that carry
    them, and for pull-ahead (PUSHPULL) the Stash that will keep their replies. `call`: the kvstore
    call they are (Op.PUSH, whose op on the wire may be PUSHPULL for pull-ahead, or Op.PUSHPULL:
    async pushpulls, whose `outs` the replies fill; `handle` is theirs once the batch is sent)."""
    __slots__ = ("op", "call", "items", "keys", "nbytes", "priority", "messages", "stash", "starts", "private",
                 "opened", "send", "outs", "handle")

    def __init__(self, op, messages, stash=None, call=Op.PUSH):
        self.op = op
        self.call = call
        self.outs = []                  # async pushpulls: their (KeyInfo, [Out]) items
        self.handle = None
        self.items = []
        self.keys = set()
        self.nbytes = 0
        self.priority = None
        self.messages = messages
        self.stash = stash
        self.starts = []                # each push's start (time.time()), for the call metrics
        self.private = []               # (key, array): the kvstore's copies of pushed values, reusable after
        self.opened = time.monotonic()
        self.send = None                # the kvstore's sender, held only while the batch is open (see Coalescer)

    def add(self, items, priority, start):
        for info, array in items:
            self.items.append((info, array))
            self.keys.add(info.key)
            self.nbytes += array.nbytes
        self.priority = priority if self.priority is None else max(self.priority, priority)
        self.starts.append(start)


class Coalescer:
    """A kvstore's open Batch and when to send it. `later(seconds, fn)` runs fn on the node's I/O
    thread after that long (Van.call_later)."""

    def __init__(self, delay, limit, later):
        self.delay = delay                  # seconds a batch may wait (KVPS_COALESCE_US)
        self.limit = limit                  # bytes a batch may carry (KVPS_LANE_BYTES)
        self._later = later
        self.lock = threading.RLock()       # held by the kvstore through each call, tried by the I/O thread
        self.batch = None
        self.follows = None                 # Op.PUSH: the last call was a push, so a small push now may wait
        # One check at a time is due on the I/O thread: arming one from the caller's thread wakes
        # that thread (a pipe write and a switch, about 0.1 ms here, as much as a small call), so a
        # batch opened while one is due waits for it, and a check that finds calls went on since the
        # last looks again a delay later, from the I/O thread, without waking it.
        self._armed = False
        self._opened = False                # a batch was opened since the last check

    def fits(self, op, keys, nbytes, call=Op.PUSH):
        """Whether a call can join the open batch (True when none is open)."""
        batch = self.batch
        return batch is None or (batch.op == op and batch.call == call and batch.keys.isdisjoint(keys)
                                 and batch.nbytes + nbytes <= self.limit)

    def open(self, batch, send):
        """Make `batch` the open one. `send(late)` sends it and says whether it did (a bound method
        of the kvstore: the batch holds the kvstore only while it is open, and the I/O thread's
        check holds the batch, so a kvstore dropped with pushes waiting still sends them)."""
        batch.send = send
        self.batch = batch
        self._opened = True
        if not self._armed:
            self._armed = True
            self._later(self.delay, self.check)

    def check(self):
        """On the I/O thread: send the open batch if it is due and the caller is in no call (which
        would send it itself); else look again later (while calls go on, though none is open)."""
        if not self.lock.acquire(blocking=False):
            self._later(self.delay, self.check)
            return
        again = None                        # seconds until the next check; None: none is due
        try:
            batch = self.batch
            opened, self._opened = self._opened, False
            if batch is None:
                again = self.delay if opened else None
            else:
                left = self.due(batch)
                if left > 0:
                    again = left
                elif not batch.send(True):      # a request its keys wait on is not answered yet
                    again = self.delay
                # sent: the next batch arms a check of its own
        finally:
            # (whatever happened: a check is due exactly when _armed says so)
            if again is None:
                self._armed = False
            else:
                self._later(again, self.check)
            self.lock.release()

    def due(self, batch):
        """Seconds until `batch` must go (<= 0: now)."""
        return batch.opened + self.delay - time.monotonic()

    def take(self):
        """The open batch, closed (None if none): the caller sends it."""
        batch, self.batch = self.batch, None
        if batch is not None:
            batch.send = None
        return batch

    def send_open(self):
        """Send the open batch now, if any (a kvstore's farewell at interpreter exit)."""
        with self.lock:
            batch = self.batch
            if batch is not None:
                batch.send(False)


class Joined:
    """The handle of an async pushpull that waits in a batch: once the batch is sent, the batch's
    Handle (kvps/wire/requests.py), which every call of the batch shares. wait() sends the batch
    first if it is still open; done() only looks (the I/O thread sends an open batch within
    KVPS_COALESCE_US)."""
    __slots__ = ("what", "_batch", "_lock")

    def __init__(self, batch, what, lock):
        self.what = what
        self._batch = batch
        self._lock = lock               # the Coalescer's

    def wait(self, timeout=None):
        batch = self._batch
        if batch.handle is None:
            with self._lock:
                if batch.handle is None and batch.send is not None:
                    batch.send(False, waited=True)
        batch.handle.wait(timeout)
        return self

    def done(self):
        handle = self._batch.handle
        return handle is not None and handle.done()

    def succeeded(self):
        handle = self._batch.handle
        return handle is not None and handle.succeeded()

    def __repr__(self):
        return f"<Joined {self.what}: {'waiting to be sent' if self._batch.handle is None else self._batch.handle}>"
