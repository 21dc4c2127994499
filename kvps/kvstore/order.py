"""A key's calls in order, whichever way each one travels.

A worker's requests go two ways: through the node's I/O thread (big calls, shared memory) or on
the calling thread's own lane (small calls, kvps/wire/lane.py). A connection delivers in order, so
calls that go the same way keep their order by themselves; a call may only take the other way once
the earlier calls naming its keys are answered. Order remembers, per key, the handle of the last
request naming it, and before a call is sent says which way it goes, waiting where it must:

    order = Order(strict=False)
    lane = order.route(keys, lane)      # the Lane to use, or None for the I/O path
    handle = ...send...
    order.sent(keys, handle, reads)     # reads: its reply may name values in server memory

A small call whose key still waits on the I/O path goes there too (nothing waits); a big call whose
key waits on a lane first waits for that request (which is small). `strict` (resends on, where a
lost request is sent again after later ones): every call first waits for the earlier requests
naming its keys, whichever way they went.

A request whose reply may name values in a co-located server's memory (`reads`, kvps/wire/shm.py:
Reader) is waited for by every later call naming its keys, whichever way that goes: its reply is
copied out of that memory when it arrives, before its handle completes, so the next request naming
the key tells the server the copy is done (meta `done`, server/reads.py). The server never changes
a value a worker still copies; in dist_sync this order also means the push that closes the next
round finds the value free, so the round sums into its spare block instead of new memory.
"""
from kvps.errors import KVPSError
from kvps.wire.lane import LaneHandle


class Order:
    def __init__(self, strict=False):
        self.strict = strict
        self._last = {}             # key -> (handle, reads) of this worker's last request naming it

    def route(self, keys, lane):
        """The way a call on `keys` goes: `lane` (a Lane, or None when the call may not use one) or
        None (the I/O path). Waits first for what must be answered before."""
        earlier, reading = [], []
        for handle, reads in self._unanswered(keys, forget_answered=True):
            earlier.append(handle)
            if reads:
                reading.append(handle)
        if not earlier:
            return lane
        if self.strict:
            lane = None
            wait = earlier
        else:
            if lane is not None and any(type(h) is not LaneHandle for h in earlier):
                lane = None             # a key waits on the I/O path: follow it there
            wait = [h for h in earlier if type(h) is LaneHandle and h.lane is not lane]
            wait += [h for h in reading if h not in wait]
        for handle in wait:
            try:
                handle.wait()
            except KVPSError:
                pass                    # its own call, wait_all() or close() raises it
        return lane

    def ready(self, keys):
        """Whether a call on `keys` may go on the I/O path now without waiting (route(keys, None)
        would wait for nothing); never waits and changes nothing, so the I/O thread may ask."""
        return not any(self.strict or reads or type(handle) is LaneHandle
                       for handle, reads in self._unanswered(keys))

    def _unanswered(self, keys, forget_answered=False):
        """(handle, reads) of the last request naming each key, where it is not answered yet."""
        for key in keys:
            last = self._last.get(key)
            if last is None:
                continue
            if last[0].done():
                if forget_answered:
                    del self._last[key]
                continue
            yield last

    def sent(self, keys, handle, reads=False):
        for key in keys:
            self._last[key] = (handle, reads)

    def forget(self):
        self._last.clear()
