"""Pull-ahead: a worker that pulls each key right after pushing it (MXNet scripts and Gluon's
Trainer do: `for k: push(k)` then `for k: pull(k)`) gets the pull's data with the push.

Once a key's pull has followed its push, later blocking pushes of that key go as PUSHPULL, whose
reply (in dist_sync: the closed round's value, exactly what the pull would read) is kept here
until the pull takes it. The per-key pulls then cost no round trip each, and replies stream back
while the worker is still pushing, so both directions of the link are busy. A key pushed twice
without a pull in between stops being pulled ahead.

    ahead = PullAhead()
    ahead.wants(keys)            # send this push as PUSHPULL?
    ahead.pushed(keys, stash)    # after a push (stash: the PUSHPULL's replies, or None)
    ahead.take(keys)             # at a pull: [Stash] covering every key, or None (pull as usual)
    ahead.drop(keys)             # any other call on these keys
    ahead.reset()                # forget them all
"""

import threading

from kvps.wire.protocol import entries

MISSES = 2          # pushes without a pull in between after which a key is no longer pulled ahead


class Stash:
    """The replies of one PUSHPULL sent for a push of `keys`: (header, payloads) pairs, kept as
    received. Once every key has left it (pulled, or dropped: never to be pulled), release(header)
    is called once for each reply, whenever it comes: a reply may name values in a co-located
    server's memory, which stay as they are until the worker says it is done with them
    (server/reads.py)."""

    def __init__(self, keys=(), release=None):
        self.handle = None
        self.replies = []
        self._index = {}                     # id(header) -> {(key, part): (index, entry, frame)}
        self._keys = set(keys)
        self._release = release
        self._lock = threading.Lock()        # replies come on the I/O thread, keys leave on the caller's

    def keep(self, header, payloads):          # on_reply, on the I/O thread
        with self._lock:
            self.replies.append((header, payloads))
            over = not self._keys
        if over and self._release is not None:
            self._release(header)

    def picked(self, header, payloads, wanted):
        """The (index, entry, frame) of a reply's entries for the (key, part)s `wanted`, found
        through an index made once per reply (a batch's reply holds many keys, pulled one by one)."""
        index = self._index.get(id(header))
        if index is None:
            index = self._index[id(header)] = {(e[1].key, e[1].part): e for e in entries(header, payloads)}
        return [index[w] for w in wanted if w in index]

    def add(self, keys):
        """More keys whose replies this stash will keep (a batch of coalesced pushes growing)."""
        with self._lock:
            self._keys.update(keys)

    def left(self, keys):
        """These keys were pulled out of this stash (call after copying them) or dropped."""
        with self._lock:
            if not self._keys:
                return
            self._keys.difference_update(keys)
            if self._keys:
                return
            replies = list(self.replies)
        if self._release is not None:
            for header, _ in replies:
                self._release(header)


class PullAhead:

    def __init__(self):
        self._unpulled = set()      # keys pushed since their last pull
        self._on = set()            # keys whose pulls follow their pushes
        self._misses = {}
        self._stash = {}            # key -> Stash of its latest push

    def wants(self, keys):
        return all(k in self._on for k in keys)

    def pushed(self, keys, stash):
        for k in keys:
            if k in self._unpulled:                 # pushed again, never pulled
                self._misses[k] = self._misses.get(k, 0) + 1
                if self._misses[k] >= MISSES:
                    self._on.discard(k)
            self._unpulled.add(k)
            old = self._stash.pop(k, None)
            if stash is not None:
                self._stash[k] = stash
            if old is not None:
                old.left((k,))

    def take(self, keys):
        """The stashes holding every key's pushed-and-pulled value, or None when one is missing
        (then nothing is taken). Either way the pull is recorded. The caller calls left(keys) on
        each stash taken once it has copied the values."""
        stashes = [self._stash.get(k) for k in keys]
        for k in keys:
            if k in self._unpulled:
                self._on.add(k)
                self._misses.pop(k, None)
            self._unpulled.discard(k)
        if any(s is None for s in stashes):
            return None
        for k in keys:
            del self._stash[k]
        return list({id(s): s for s in stashes}.values())

    def reset(self):
        """Forget every key (its stash is dropped) and start over."""
        self.drop(list(self._stash))
        self._unpulled.clear()
        self._on.clear()
        self._misses.clear()

    def drop(self, keys):
        for k in keys:
            stash = self._stash.pop(k, None)
            if stash is not None:
                stash.left((k,))
            self._unpulled.discard(k)
