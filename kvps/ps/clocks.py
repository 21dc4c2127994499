"""Who has seen which version of each key, and the rules of each consistency mode built on that:
when a pull may return, when a sync round is complete, which pushes are too stale to apply,
and the staleness histogram.

Pure bookkeeping, no values and no sockets: the Store asks and acts. Each slot carries

    version   updates applied to it: closed rounds (sync), applied pushes (async, ssp)
    pushes    worker -> its clock: the pushes it made to the slot (sync with backups: the
              round its last accepted push went into)
    seen      worker -> the version its last pull received (0: init)

and the rules are (kvps/ps/consistency.py names the modes, docs/consistency.md explains them):

    sync      a pull waits until the round of the worker's own last push before it has closed, and
              then returns that round's value
    sync, b   a round is complete after W - b pushes; a push from a worker that has not pulled
              the latest closed round, or that is already in the open round, is stale: dropped
    async     a pull never waits
    ssp:s     a pull from a worker at clock c waits until every active worker's clock >= c - s

Joined workers (worker_joined) hold nobody back; a pull that waits for a worker that is gone
fails with NodeFailure naming why it left. In an elastic job, removed workers (vacant ranks) hold
nobody back either, and a worker added while a slot's round is open (`late`) sits that round out.
"""
from kvps.errors import NodeFailure

WAIT = "wait"               # pull_state: the pull must wait
MAX_STALENESS = 1000        # histogram buckets; the last one also counts every push staler than that


class Clocks:
    """The consistency bookkeeping of one server's store."""

    def __init__(self, num_workers, consistency):
        self.num_workers = num_workers
        self.consistency = consistency
        self.joined = set()              # workers that count as pushing zeros (see Store.worker_joined)
        self.gone = {}                   # worker -> reason it can no longer push
        self.removed = set()             # elastic: vacant ranks (dead workers the scheduler removed)
        self.late = {}                   # elastic: slot id -> workers added while its round was open
        self.staleness = []              # staleness -> number of applied pushes that stale

    def active(self):
        return [w for w in range(self.num_workers) if w not in self.joined and w not in self.removed]

    # ---- pulls ----
    def pull_state(self, slot, worker, pushed):
        """None: the pull may return now; WAIT: it must wait; an exception: it never can. `pushed`:
        the worker's clock on the slot when the pull came (sync: the round it must see)."""
        c = self.consistency
        if c.mode == "sync":
            return WAIT if pushed > slot.version else None
        if not c.bounded:
            return None
        bound = slot.pushes.get(worker, 0) - c.staleness
        behind = [w for w in self.active() if slot.pushes.get(w, 0) < bound]
        if not behind:
            return None
        for w in behind:
            if w in self.gone:
                return NodeFailure(f"W{worker}'s pull of {slot.name()} (clock {bound + c.staleness:g}, "
                                   f"staleness bound {c.staleness:g}) waits for W{w} to reach clock {bound:g}, "
                                   f"which can never happen: {self.gone[w]}")
        return WAIT

    def delivered(self, slot, worker):
        """A pull reply with the slot's current version is going to `worker`."""
        slot.seen[worker] = slot.version

    # ---- pushes ----
    def stale(self, slot, worker):
        """With backup workers: True for a push that is not based on the latest closed round."""
        return bool(self.consistency.backup) and (worker in slot.in_round or
                                                  slot.seen.get(worker, 0) < slot.version)

    def pushed(self, slot, worker):
        """Count a push the store accepted (before it is applied)."""
        if self.consistency.backup:
            # Backups skip rounds, so counting pushes would fall behind the round count:
            # remember the round this push went into (its pull waits for that one).
            slot.pushes[worker] = slot.version + 1
        else:
            slot.pushes[worker] = slot.pushes.get(worker, 0) + 1

    def round_complete(self, slot):
        """Enough workers have pushed into the open round (joined ones count as pushing zeros)."""
        done = slot.in_round | self.joined
        if self.removed or self.late:
            done = done | self.removed | self.late.get(slot.id, frozenset())
        return len(done) >= self.num_workers - self.consistency.backup

    def missing(self, slot):
        """The workers the open round of `slot` still waits for (sorted ranks)."""
        done = slot.in_round | self.joined | self.removed | self.late.get(slot.id, frozenset())
        return [w for w in range(self.num_workers) if w not in done]

    def sits_out(self, slot, worker):
        """Elastic: True for a worker added while this slot's open round was under way."""
        return bool(self.late) and worker in self.late.get(slot.id, ())

    def applied(self, slot, worker):
        """Record the staleness of `worker`'s push, applied now, before slot.version counts it:
        the updates the slot has had since that worker last pulled it."""
        staleness = min(slot.version - slot.seen.get(worker, 0), MAX_STALENESS - 1)
        if staleness >= len(self.staleness):
            self.staleness.extend([0] * (staleness + 1 - len(self.staleness)))
        self.staleness[staleness] += 1

    # ---- membership ----
    def gone_reason(self):
        return "; ".join(self.gone.values())

