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
"""

MISSES = 2          # pushes without a pull in between after which a key is no longer pulled ahead


class Stash:
    """The replies of one PUSHPULL sent for a push: (header, payloads) pairs, kept as received."""

    def __init__(self):
        self.handle = None
        self.replies = []

    def keep(self, header, payloads):          # on_reply, on the I/O thread
        self.replies.append((header, payloads))


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
            if stash is None:
                self._stash.pop(k, None)
            else:
                self._stash[k] = stash

    def take(self, keys):
        """The stashes holding every key's pushed-and-pulled value, or None when one is missing
        (then nothing is taken). Either way the pull is recorded."""
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

    def drop(self, keys):
        for k in keys:
            self._stash.pop(k, None)
            self._unpulled.discard(k)
