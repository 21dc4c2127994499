"""The discrete-event core of `kvps simulate`: a clock, an event heap, and queued resources.

    sim = Simulator()
    link = Resource(sim, "W0.up")
    sim.chain([(link, 0.004), (None, 0.0001), (cpu, 0.0002)], done=lambda t: ...)
    sim.run()                         # returns the time of the last event

A Resource serves `capacity` requests at a time (1: a host link direction, or a process's CPU;
C: the C cores of a machine every process shares), each for its duration, in order of (priority,
the order of arrival). A chain is a job that passes through resources one after the other; a
stage with no resource is a pure delay (link latency), and a stage (resource, seconds, n) runs n
requests of `seconds` at once and goes on when all are done (work spread over several cores).
A TokenBucketLink is a link direction behind tc's tbf: a burst passes at once, then the rate.
Nothing here knows about parameter servers; step.py builds the model from these parts.
"""
import heapq
import itertools


class Simulator:
    """The event loop: at(t, fn) runs fn(t) at time t; run() empties the heap."""

    def __init__(self):
        self.now = 0.0
        self._heap = []
        self._seq = itertools.count()
        self.events = 0

    def at(self, t, fn):
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def run(self):
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            self.now = t
            self.events += 1
            fn(t)
        return self.now

    def chain(self, stages, done, start=None, priority=0):
        """Run `stages` [(Resource or None, seconds[, n])] one after another from `start` (default now),
        then done(t)."""
        stages = list(stages)

        def step(i, t):
            if i == len(stages):
                done(t)
                return
            resource, seconds, *rest = stages[i]
            n = rest[0] if rest else 1
            if resource is None:
                self.at(t + seconds, lambda t2: step(i + 1, t2))
            elif n == 1:
                resource.request(t, seconds, lambda t2: step(i + 1, t2), priority)
            else:
                left = [n]

                def one(t2):
                    left[0] -= 1
                    if not left[0]:
                        step(i + 1, t2)
                for _ in range(n):
                    resource.request(t, seconds, one, priority)

        self.at(self.now if start is None else start, lambda t: step(0, t))


class Resource:
    """`capacity` servers with one queue: lowest (priority, arrival) first."""

    def __init__(self, sim, name, capacity=1):
        self.sim, self.name, self.capacity = sim, name, capacity
        self.in_use = 0
        self.busy_s = 0.0             # seconds it served (summed over its servers): its load over a step
        self._queue = []
        self._seq = itertools.count()

    @property
    def busy(self):
        return self.in_use >= self.capacity

    def request(self, t, seconds, done, priority=0):
        if seconds <= 0 and not self.busy and not self._queue:
            done(t)
            return
        heapq.heappush(self._queue, (priority, next(self._seq), seconds, done))
        if not self.busy:
            self._next(t)

    def _next(self, t):
        if not self._queue or self.busy:
            return
        _, _, seconds, done = heapq.heappop(self._queue)
        seconds = self._serve(t, seconds)
        self.in_use += 1
        self.busy_s += seconds

        def finish(t2):
            self.in_use -= 1
            done(t2)
            self._next(t2)
        self.sim.at(t + seconds, finish)

    def _serve(self, t, seconds):
        """How long a request of `seconds` takes when it starts at t (a plain resource: `seconds`)."""
        return seconds


class TokenBucketLink(Resource):
    """A link direction behind a token bucket (tc's tbf): up to burst_s seconds' worth of bytes at
    the rate pass at once when the bucket is full; the bucket refills at the rate while the link
    is idle. Requests are in seconds at the rate; a request of s seconds with k seconds of tokens
    takes max(0, s - k)."""

    def __init__(self, sim, name, burst_s):
        super().__init__(sim, name)
        self.burst_s = burst_s
        self._tokens, self._since = burst_s, 0.0

    def _serve(self, t, seconds):
        tokens = min(self.burst_s, self._tokens + (t - self._since))
        took = max(0.0, seconds - tokens)
        self._tokens = max(0.0, tokens - seconds)
        self._since = t + took
        return took
