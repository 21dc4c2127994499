"""What a worker of an experiment measures and prints: the JSON lines `kvps experiment` reads back.

    book = Logbook(kv, nkeys=len(keys), eval_every="0.1s")
    book.start()                          # after init and a barrier: start-up is not timed
    while book.training(steps=args.steps, seconds=args.seconds):
        ...                               # one step: gradients, push, pull
        book.stepped()
        if book.due():
            evaluate()                    # with book.evaluating(): ...; book.point(loss=.., accuracy=..)
    book.finish(evaluate)                 # rank 0: the final weights too; kv.join(), then the final lines

Lines, one JSON object each on stdout (the launcher prefixes them with "[Wr] "):

    {"event": "point", "rank": 0, "time": 1.25, "step": 400, "updates": 1198, "loss": .., "accuracy": ..}
    {"event": "final", "rank": r, "steps": .., "time": .., "eval_s": .., "step_ms": .., "median_step_ms": ..,
     "stopped": "steps" | "budget" | "others" | "seconds",
     "server": {...}}     # rank 0 of a parameter-server job: the servers' counters, see server_summary

"time" is this worker's training clock in seconds, evaluation excluded ("eval_s": the time left
out: evaluation and the looks at the servers' counters); "updates" is the number
of gradients applied so far over all workers (from the servers' push counters: pushes less
dropped pushes, divided by the number of keys; W x this worker's steps for the ring, which runs
in lockstep).

GEO-SGD (dist_geo:K) steps locally and pushes a key's change once every K steps, so there a
gradient is one worker's local step, counted when its change reaches the servers: K x the pushes
per key. A GEO worker's weights are the merged ones only right after a sync, so rank 0 evaluates
only then (the first sync at or after each --eval-every), a worker stops only right after a sync
(every local step's change reaches the servers, and the count is exact), and finish(merge=...)
merges every worker's last change (kv.sync()) before the final evaluation.

A run is a budget of W x --steps gradients. In lockstep modes (sync, the ring) every worker takes
--steps steps. Where workers drift apart (async, SSP, backup workers) each one goes on until the
servers have applied the whole budget (it looks every 0.1 s of training), or every other worker
has finished: fast workers take more steps than a slow one, and every run applies about the same
number of gradients. --seconds stops a run after that much training in any mode. finish() joins
(Horovod's join), so workers that stop at different steps never leave a round waiting.
"""
import contextlib
import json
import sys
import time

# kvstore types whose workers take the same steps in lockstep (for a kvstore without .consistency)
LOCKSTEP = ("dist_sync", "dist", "dist_sync_device", "allreduce", "local", "device")
WATCH_SECONDS = 0.1       # training seconds between looks at the servers' counters (drifting modes)


def parse_every(text):
    """("seconds", 0.1) for "0.1s", ("steps", 50) for "50"; raises ValueError naming the text."""
    text = str(text).strip()
    try:
        if text.endswith("s"):
            value, unit = float(text[:-1]), "seconds"
        else:
            value, unit = int(text), "steps"
    except ValueError:
        raise ValueError(f"--eval-every {text!r} is neither seconds ('0.5s') nor a step count ('50')") from None
    if value <= 0:
        raise ValueError(f"--eval-every {text!r} must be positive")
    return unit, value


def server_summary(stats):
    """The servers' counters (kv.server_stats(): {server: dict}) summed over servers: pushes,
    updates, rounds, dropped, joins (the fewest of any server) and the staleness histogram
    (index i: applied pushes that were i steps stale), plus the mode. Fields a server does not
    report count as 0 (or an empty histogram)."""
    total = {"pushes": 0, "updates": 0, "rounds": 0, "dropped": 0, "staleness": [], "mode": None, "servers": 0}
    joins = []
    for _, s in sorted(stats.items()):
        total["servers"] += 1
        for field in ("pushes", "updates", "rounds", "dropped"):
            total[field] += int(s.get(field, 0) or 0)
        hist = list(s.get("staleness", []) or [])
        if len(hist) > len(total["staleness"]):
            total["staleness"] += [0] * (len(hist) - len(total["staleness"]))
        for i, n in enumerate(hist):
            total["staleness"][i] += int(n)
        joins.append(int(s.get("joins", 0) or 0))
        total["mode"] = total["mode"] or s.get("mode")
    while total["staleness"] and not total["staleness"][-1]:     # servers send 1000 buckets, mostly empty
        total["staleness"].pop()
    total["joins"] = min(joins) if joins else 0
    return total


def gradient_scale(kv):
    """The optimizer's rescale_grad that averages one round's gradients: 1/W, or 1/(W - B) with B
    backup workers, whose rounds sum only the first W - B pushes."""
    consistency = getattr(kv, "consistency", None)
    return 1.0 / (kv.num_workers - getattr(consistency, "backup", 0))


def sync_every(kv):
    """Local steps between two syncs of a worker's weights: K for GEO-SGD (dist_geo:K), else 1."""
    consistency = getattr(kv, "consistency", None)
    return consistency.k_steps if getattr(consistency, "mode", None) == "geo" else 1


def _lockstep(kv):
    """Whether every worker takes the same steps in lockstep: sync without backup workers, the ring."""
    consistency = getattr(kv, "consistency", None)
    if consistency is not None:
        return consistency.mode == "sync" and not consistency.backup
    return kv.type in LOCKSTEP


class Logbook:
    """One worker's clock, step count and JSON lines, for one training run."""

    def __init__(self, kv, nkeys, eval_every="0.1s", out=None):
        self.kv = kv
        self.nkeys = nkeys
        self.every_unit, self.every = parse_every(eval_every)
        self.out = out or sys.stdout
        self.rank, self.workers = kv.rank, kv.num_workers
        self.ring = kv.type == "allreduce"
        self.lockstep = _lockstep(kv)
        self.sync_every = sync_every(kv)      # GEO: gradients per push, and steps between merged weights
        self.steps = 0
        self.stopped = None
        self._start = None
        self._eval_time = 0.0
        self._next = 0.0
        self._step_times = []
        self._last = self._watched = None
        self._pointed = None              # the step of the last evaluation point
        self._owed = False                # a point fell due between two GEO syncs

    # ---- the clock ----
    def start(self):
        self._start = self._last = self._watched = time.perf_counter()
        self._next = self.every

    def clock(self):
        """Training seconds since start(), evaluation excluded."""
        return time.perf_counter() - self._start - self._eval_time

    @contextlib.contextmanager
    def evaluating(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._eval_time += time.perf_counter() - t0

    # ---- steps ----
    def training(self, steps, seconds=None):
        """True while this worker should take another step. A run is a budget of W x `steps`
        gradients: in lockstep modes each worker takes `steps` steps; where workers drift apart,
        each goes on until the servers have applied the whole budget (see the module docstring)."""
        budget = steps * self.workers
        if self.steps % self.sync_every:      # GEO: stop only right after a sync
            return True
        if seconds and self.clock() >= seconds:
            self.stopped = "seconds"
        elif self.lockstep or self.workers == 1:
            if self.steps >= steps:
                self.stopped = "steps"
        elif self.steps >= budget:
            self.stopped = "steps"
        elif self.steps and time.perf_counter() - self._watched >= WATCH_SECONDS:
            self._watched = time.perf_counter()
            with self.evaluating():          # bookkeeping, not training
                s = server_summary(self.kv.server_stats())
            if self._applied(s) >= budget:
                self.stopped = "budget"
            elif s["joins"] >= self.workers - 1:
                self.stopped = "others"
        return self.stopped is None

    def stepped(self):
        self.steps += 1
        now = time.perf_counter()
        self._step_times.append(now - self._last)
        self._last = now

    def after_step(self, evaluate):
        """Count the step just taken, and call evaluate() (rank 0) when a point is due."""
        self.stepped()
        if self.due():
            evaluate()

    def due(self):
        """Rank 0 only: whether an evaluation point is due now. Once training() has said stop,
        whether the final weights still need one (they do unless this step was just evaluated)."""
        if self.rank != 0:
            return False
        if self.stopped is not None:
            return self.steps > 0 and self._pointed != self.steps
        if self.every_unit == "steps":
            self._owed |= self.steps % self.every == 0
        elif self.clock() >= self._next:
            self._owed = True
        if not self._owed or self.steps % self.sync_every:     # GEO: only the merged weights count
            return False
        self._owed = False
        self._next = self.clock() + self.every
        return True

    # ---- what is printed ----
    def updates(self):
        """Gradients applied so far, over all workers (see the module docstring)."""
        if self.ring or not hasattr(self.kv, "server_stats"):
            return self.steps * self.workers
        return self._applied(server_summary(self.kv.server_stats()))

    def _applied(self, summary):
        """Gradients applied, from the servers' counters: pushes less dropped, per key; under GEO
        each push carries K local steps."""
        return (summary["pushes"] - summary["dropped"]) * self.sync_every // max(self.nkeys, 1)

    def point(self, loss, accuracy, **extra):
        with self.evaluating():          # asking the servers is not training time either
            updates = self.updates()
        self._pointed = self.steps
        self._say(dict({"event": "point", "rank": self.rank, "time": round(self.clock(), 4), "step": self.steps,
                        "updates": updates, "loss": round(float(loss), 5), "accuracy": round(float(accuracy), 5)},
                       **{k: round(float(v), 5) for k, v in extra.items()}))

    def finish(self, evaluate=None, merge=None, **extra):
        """Evaluate the final weights (rank 0, unless the last step just was), join (so rounds never
        wait for a worker that stopped early), then print the final line. Rank 0's line carries
        the servers' counters, read once every worker has joined. `merge`: a collective call that
        every worker makes first, which changes the weights (GEO: kv.sync(), then a pull); its
        time counts as training, and rank 0 evaluates what it gives."""
        if merge is not None:
            merge()
            self._pointed = None
        if evaluate is not None and self.due():
            evaluate()
        elapsed = self.clock()
        self.kv.join()
        line = {"event": "final", "rank": self.rank, "workers": self.workers, "steps": self.steps,
                "time": round(elapsed, 4), "eval_s": round(self._eval_time, 4), "stopped": self.stopped,
                "step_ms": round(1e3 * elapsed / max(self.steps, 1), 4),
                "median_step_ms": round(1e3 * _median(self._step_times), 4)}
        if self.rank == 0 and not self.ring and hasattr(self.kv, "server_stats"):
            line["server"] = server_summary(self.kv.server_stats())
        line.update(extra)
        self._say(line)

    def _say(self, obj):
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()


def _median(values):
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
