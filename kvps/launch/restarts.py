"""Which dead servers of a replicated job (and, with --restart-workers, which dead workers of an elastic
job) `kvps launch` replaces, and when: no processes here.

    plan = Restarts(budget=3, delay=11.0)            # --restart-servers 3; KVPS_HEARTBEAT_TIMEOUT + _INTERVAL
    plan.died("S1", now)        # -> Decision(start_at=now + 11.0, number=1) or Decision(None, ...)
    plan.next_due()             # when the launcher must wake up to start one
    plan.due(now)               # -> [("S1", its Decision)]: start each now, as child plan.child("S1")

With chain replication (KVPS_REPLICAS=R) a dead server's ranges go on at their replicas, and a new
server that registers later takes the dead one's rank and gets its state (docs/replication.md).
The launcher starts that new server itself, with the same environment and key, but not at once:
the scheduler refuses a server of a rank it still believes alive, and it declares one dead only
when its heartbeats have stopped for KVPS_HEARTBEAT_TIMEOUT. So a replacement is due `delay`
seconds after the death (the timeout, plus one heartbeat interval for the scheduler's check).

The budget bounds the replacements of the whole job: one whose start fails, or that keeps dying
(a broken host, a bug that its state sets off), stops being replaced once the budget is spent,
instead of stalling the workers for a heartbeat timeout at every death. A replacement's death
counts like any other; so does one refused because the scheduler had not yet declared the old one
dead.

Each child started as a node gets a name of its own (the Supervisor's names are unique): the
original keeps the node's ("S1"), its replacements count on ("S1#2", "S1#3"). node_of() maps back.
"""
import dataclasses

from kvps.errors import ConfigError


def node_of(child):
    """The node a child runs as: "S1" for "S1" and for its replacements "S1#2", "S1#3"."""
    return child.partition("#")[0]


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the launcher does about one dead server: start_at (monotonic seconds) or None when it
    is not replaced; number: which restart of the budget it is (or how many were used); why: the
    words for a server that is not replaced."""
    start_at: float | None
    number: int
    why: str = ""


class Restarts:
    """The restart bookkeeping of one job: the budget, the replacements due, the child names."""

    def __init__(self, budget, delay, flag="--restart-servers"):
        """budget: the most replacements started over the job; delay: seconds from a death to its
        replacement; flag: the option that set the budget, for the messages. Raises ConfigError for
        a negative budget."""
        if budget < 0:
            raise ConfigError(f"{flag} {budget}: the number of replacements cannot be negative")
        self.budget, self.delay, self.flag = budget, delay, flag
        self.used = 0                        # replacements scheduled so far (started or due)
        self.pending = {}                    # node -> the Decision to replace it, in the order they died
        self._incarnations = {}              # node -> children started as it (the original counts)

    def died(self, node, now):
        """A server `node` of the job died at `now`; returns the Decision (and records it)."""
        if node in self.pending:             # (cannot happen: nothing runs as it while it is due)
            return self.pending[node]
        if self.used >= self.budget:
            return Decision(None, self.used, f"no restarts left ({self.flag} {self.budget})")
        self.used += 1
        self.pending[node] = Decision(now + self.delay, self.used)
        return self.pending[node]

    def next_due(self):
        """The monotonic time the next replacement is due, or None when none is."""
        return min((d.start_at for d in self.pending.values()), default=None)

    def due(self, now):
        """[(node, its Decision)] of the replacements due at `now`, in the order the nodes died; they
        are no longer pending (the caller starts them, or says why not)."""
        ready = [(node, d) for node, d in self.pending.items() if d.start_at <= now]
        for node, _ in ready:
            del self.pending[node]
        return ready

    def cancel(self):
        """The job is ending: forget the replacements not started; returns their nodes."""
        dropped, self.pending = list(self.pending), {}
        return dropped

    def child(self, node):
        """The child name for the next replacement of `node` (the original was `node` itself):
        "S1#2", then "S1#3"."""
        count = self._incarnations.get(node, 1) + 1
        self._incarnations[node] = count
        return f"{node}#{count}"
