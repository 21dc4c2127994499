"""Which of a server's values its replies still read, so that the store changes none of them under a
reader: the copies zmq sends without copying, and the pulls that co-located workers copy straight
out of the server's value segments (kvps/wire/shm.py: Values).

A reply with values takes a Hold on each big value it was given (Store.reading), from the moment
the value was delivered. Sent inline or copied into the worker's reply region, the hold ends once
the reply has gone; zmq's own tracker then covers a payload it sends straight from the value.
Naming values in the server's segments (`at`), it ends when the worker says it has copied them:
the reply carries a number (meta `read`), and a later request of that worker lists the numbers it
is done with (meta `done`). Until then an update of the value goes to other memory
(Store._destination), and the held block is reused only after (Store._reusable): a reader never
sees a value change, and nothing waits for a reader.

    reads = Reads("W0")
    hold = Hold()                      # taken by a reply, passed to Store.reading for each value
    seq = reads.issue(hold)            # the reply names values in segments: meta["read"] = seq
    reads.done([seq])                  # a later request's meta["done"]: hold.done is now True
"""
from kvps.errors import ProtocolError

MAX_DONE = 4096         # numbers one request may list: more means a peer misbehaves


class Hold:
    """One reply's claim on the values it delivered, until `done` (a tracker, as zmq's are)."""
    __slots__ = ("done",)

    def __init__(self):
        self.done = False


class Reads:
    """The holds of one worker's replies that named values in the server's segments, by number."""

    def __init__(self, worker):
        self.worker = worker             # its name, for errors
        self.issued = 0                  # numbers 1 .. issued were given out
        self.open = {}                   # number -> Hold, until the worker says it is done

    def issue(self, hold):
        self.issued += 1
        self.open[self.issued] = hold
        return self.issued

    def done(self, numbers):
        """Release the holds of replies the worker has copied. A number it was never given is a
        ProtocolError; one released already (a request sent again) is ignored."""
        if len(numbers) > MAX_DONE:
            raise ProtocolError(f"{self.worker} lists {len(numbers)} replies as read; at most {MAX_DONE} may go "
                                f"in one request")
        for number in numbers:
            hold = self.open.pop(number, None)
            if hold is not None:
                hold.done = True
            elif not 0 < number <= self.issued:
                raise ProtocolError(f"{self.worker} says it has read reply {number}; it was given replies "
                                    f"1 .. {self.issued}")

    def release_all(self):
        """The worker left or died: it reads nothing more."""
        for hold in self.open.values():
            hold.done = True
        self.open.clear()
