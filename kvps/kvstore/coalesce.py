"""Coalescing: small pushes called one key at a time travel as one request.

MXNet scripts and Gluon's Trainer push each key on its own (`for k: push(k)`, then `for k:
pull(k)`). Sent alone, each push costs a message each way, a server's handling of it and the
worker's Python around both; with hundreds of small keys those calls are most of a step (MXNet
hides them behind its engine's C++ threads). So a blocking push that follows another push, and is
small (it would go on the caller's lane, kvps/wire/lane.py), is not sent at once: its values are
copied (the caller may reuse its array as soon as push returns, as always) and it joins an open
batch. The batch goes as one request per server, on the caller's lane, when

- any other call of the kvstore comes (a pull, pushpull, barrier, wait_all, close, ...), or a push
  that cannot join (a key already in the batch, another op, a big or async_op push);
- it would pass KVPS_LANE_BYTES;
- a push finds it KVPS_COALESCE_US old;
- nothing at all is called for KVPS_COALESCE_US: then the node's I/O thread sends it through the
  I/O path (once every request its keys wait on is answered, which keeps each key's calls in order).

What a push means does not change: a later pull of the key sees it, an error is raised by the next
call, and a sync round closes once every worker's push is in; a push just leaves later: while the
script goes on pushing, and at most about KVPS_COALESCE_US after it stops calling. The first push after any other call goes at once (so a script that pulls
each key right after pushing it sends as before), and so does every push when KVPS_COALESCE_US
is 0, or where lanes are off (KVPS_LANE_BYTES=0, resends, injected faults).

    coalesce = Coalescer(delay_s, limit_bytes, later)  # later(s, fn): fn on the I/O thread (Van.call_later)
    with coalesce.lock:                               # a push:
        if not coalesce.fits(op, keys, nbytes): send(coalesce.take())
        if coalesce.follows_push: add it to coalesce.batch (coalesce.open(Batch(...), send) first)
        else: send it now
        coalesce.follows_push = True                  # any other call sets it False

The kvstore (kvps/kvstore/ps.py) holds `lock` through every push and while any other call sends the
open batch; the I/O thread's check only tries the lock, so it never waits on the caller, and a
batch exists only between calls or inside a push.
"""
import threading
import time


class Batch:
    """Pushes waiting to go as one request: their (KeyInfo, copied array) items, the Messages that
    carry them, and for pull-ahead (PUSHPULL) the Stash that will keep their replies."""
    __slots__ = ("op", "items", "keys", "nbytes", "priority", "messages", "stash", "starts", "private", "opened",
                 "send")

    def __init__(self, op, messages, stash=None):
        self.op = op
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
        self.follows_push = False           # the last call was a push: a small push now may wait

    def fits(self, op, keys, nbytes):
        """Whether a push can join the open batch (True when none is open)."""
        batch = self.batch
        return batch is None or (batch.op == op and batch.keys.isdisjoint(keys)
                                 and batch.nbytes + nbytes <= self.limit)

    def open(self, batch, send):
        """Make `batch` the open one. `send(late)` sends it and says whether it did (a bound method
        of the kvstore: the batch holds the kvstore only while it is open, and the I/O thread's
        check holds the batch, so a kvstore dropped with pushes waiting still sends them)."""
        batch.send = send
        self.batch = batch
        self._later(self.delay, self.check)

    def check(self):
        """On the I/O thread: send the open batch if it is due and the caller is in no call (which
        would send it itself); else look again later."""
        if self.batch is None:
            return
        if not self.lock.acquire(blocking=False):
            self._later(self.delay, self.check)
            return
        try:
            batch = self.batch
            if batch is None:
                return
            left = self.due(batch)
            if left > 0:
                self._later(left, self.check)
            elif not batch.send(True):      # a request its keys wait on is not answered yet
                self._later(self.delay, self.check)
        finally:
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
