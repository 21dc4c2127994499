"""The model of one synchronous step: a parameter server (W workers, S dedicated servers) and a
ring all-reduce, as discrete-event simulations over measured costs.

    predict(Setup("ps", workers=4, servers=2, rate=1e9, transport="veth"), tensors("resnet50"), costs)
    # {"step_s": 1.63, "comm_s": 1.63, "events": 5321, "busiest": "S0.down", ...}

What each message does (parameter server; bytes b, wire time w = compression * b / (rate * link_efficiency)):

    worker CPU (o + c*b) -> worker uplink (w) -> latency -> server downlink (W*w: every worker's copy)
    -> server CPU (W*(o + c*b + b/sum)) -> [round complete] -> server CPU (W*(o + c*b)) -> server
    uplink (W*w) -> latency -> worker downlink (w) -> worker CPU (o + c*b)

with "pushpull" (one call for the whole list: a message's reply leaves as soon as its round is
complete) or "push+pull" (a push and then a pull per key, as MXNet scripts call it: messages
carry one key's pieces, a push is acknowledged, and its pull, a request of its own, is answered
once that key's round is complete).
o and c come from the transport (costs.py). Gradients are cut as kvps cuts them: a tensor of at
least split_bytes (or one bigger than partition_bytes) into whole rounds of the S servers, pieces
of at most partition_bytes, smaller tensors to the servers in turn; each worker merges the pieces
for one server that are ready together into messages of at most message_bytes. With priority,
queues serve the first layers first; without, the order the gradients became ready.

The ring (reduce-scatter, then all-gather): tensors are fused into buckets of at most
fusion_bytes in the order they become ready; each bucket's W segments travel in pieces of at
most chunk_bytes;
a piece takes 2(W-1) steps of CPU send -> uplink -> latency -> downlink -> CPU receive (plus the
sum in the reduce-scatter half).

Workers are identical, so the simulation follows one of them and puts W copies of its load on
each shared resource at once (exact for symmetric workers with FIFO queues; the step ends when the
last copy is served). Likewise the ring follows one node whose neighbour, by symmetry, sends it
each piece when it sends its own. Where every process shares host_cores CPUs (one machine), all
CPU work queues for those C cores: a server's stage takes one, the W workers' copies of a stage
spread over min(W, C).

Assumptions (docs/simulate.md says where they stop holding): links are full duplex at a fixed
rate (with burst_bytes, behind a token bucket as tc's tbf puts them) with an infinite switch buffer (no incast loss, no congestion control, no TCP slow start),
every worker is as fast as every other (no stragglers), keys spread evenly, a server applies a
round as soon as it has every push, compute is a fixed time with gradients ready linearly over
the backward pass (the last layer first).
"""
import dataclasses
import math

from kvps.errors import ConfigError

from kvps.tools.simulate.engine import Resource, Simulator, TokenBucketLink

MB = 1 << 20
BACKWARD_SHARE = 2 / 3          # of a step's compute: gradients become ready over this last part


@dataclasses.dataclass(frozen=True)
class Setup:
    system: str                   # "ps" or "ring"
    workers: int
    servers: int = 1              # dedicated server hosts (ps)
    rate: float = None            # bit/s of every host link, both ways; None: loopback (no link limit)
    transport: str = "loopback"   # which costs.transports entry the messages pay
    mode: str = "pushpull"        # ps: "pushpull" (pipelined) or "push+pull"
    priority: bool = True         # queues serve the first layers first
    compression: float = 1.0      # wire bytes / gradient bytes (0.5: fp16)
    partition_bytes: int = 4 * MB
    message_bytes: int = 4 * MB
    split_bytes: int = MB         # tensors from this size are split over the servers
    fusion_bytes: int = 64 * MB   # ring: bucket size
    chunk_bytes: int = 4 * MB     # ring: a segment travels in pieces of at most this (KVPS_RING_CHUNK_BYTES)
    compute_s: float = 0.0        # forward + backward seconds of one worker's step
    burst_bytes: int = None       # a token bucket on every link direction (tbf, as `kvps emulate` sets one)

    def check(self):
        """Raises ConfigError naming a value that describes no job."""
        if self.system not in ("ps", "ring"):
            raise ConfigError(f"system {self.system!r} is not ps or ring")
        if self.workers < 1 or (self.system == "ps" and self.servers < 1):
            raise ConfigError(f"W={self.workers}, S={self.servers}: a {self.system} job needs at least one worker"
                              + (" and one server" if self.system == "ps" else ""))
        if self.mode not in ("pushpull", "push+pull"):
            raise ConfigError(f"mode {self.mode!r} is not pushpull or push+pull")
        if self.rate is not None and self.rate <= 0:
            raise ConfigError(f"rate {self.rate!r} bit/s must be positive")
        for name in ("partition_bytes", "message_bytes", "split_bytes", "fusion_bytes", "chunk_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be at least 1")
        if not 0 < self.compression <= 1:
            raise ConfigError(f"compression {self.compression!r} is not a ratio in (0, 1]")


def ready_times(tensors, compute_s):
    """When each tensor's gradient is ready: the backward pass (the last BACKWARD_SHARE of
    compute) produces them last layer first, in proportion to their bytes."""
    total = sum(tensors) or 1
    fwd = compute_s * (1 - BACKWARD_SHARE)
    out, done = [0.0] * len(tensors), 0
    for i in range(len(tensors) - 1, -1, -1):
        done += tensors[i]
        out[i] = fwd + compute_s * BACKWARD_SHARE * done / total
    return out


def shard(tensors, servers, split_bytes, partition_bytes):
    """[(tensor index, server, bytes)]: how kvps spreads the tensors over the servers."""
    pieces, turn = [], 0
    for i, b in enumerate(tensors):
        if b > partition_bytes or (servers > 1 and b >= split_bytes):
            n = servers * math.ceil(b / (servers * partition_bytes))
            pieces += [(i, k % servers, b / n) for k in range(n)]
        else:
            pieces.append((i, turn % servers, float(b)))
            turn += 1
    return pieces


def messages(pieces, ready, message_bytes, priority, per_key=False):
    """[(priority, ready, server, bytes)]: each server's pieces merged, in send order, while they are
    ready together and fit in message_bytes (with per_key, only pieces of one tensor)."""
    order = sorted(pieces, key=lambda p: (p[0] if priority else -p[0]))
    out, open_ = [], {}
    for i, s, b in order:
        m = open_.get(s)
        if m is not None and m[1] == ready[i] and m[3] + b <= message_bytes and (not per_key or m[4] == i):
            m[3] += b
            continue
        m = [i if priority else -i, ready[i], s, b, i]
        out.append(m)
        open_[s] = m
    return [tuple(m[:4]) for m in out]


class _CPU:
    """A node's CPU: its own Resource, or the machine's shared cores (host_cores), where the W copies
    of a worker's stage spread over min(W, C) cores."""

    def __init__(self, sim, name, pool=None):
        self.resource = pool or Resource(sim, name)
        self.shared = pool is not None

    def stage(self, seconds, copies=1):
        if self.shared and copies > 1:
            n = min(copies, self.resource.capacity)
            return self.resource, seconds * copies / n, n
        return self.resource, seconds


def predict(setup, tensors, costs):
    """{"step_s", "comm_s", "events", "busiest", "busiest_s"} for one step. Raises ConfigError."""
    setup.check()
    t = costs.transport(setup.transport)
    sim = Simulator()
    pool = Resource(sim, "cpus", capacity=costs.host_cores) if costs.host_cores else None
    if setup.system == "ring":
        done, resources = _ring(sim, setup, tensors, costs, t, pool)
    else:
        done, resources = _ps(sim, setup, tensors, costs, t, pool)
    end = sim.run()
    step = max([end, setup.compute_s] + done)
    busiest = max(resources, key=lambda r: r.busy_s) if resources else None
    return {"step_s": step, "comm_s": step - setup.compute_s, "events": sim.events,
            "busiest": busiest.name if busiest else None, "busiest_s": busiest.busy_s if busiest else 0.0}


def _link(sim, name, setup, costs):
    """A link direction: with burst_bytes, behind a token bucket of that many bytes."""
    if setup.burst_bytes and setup.rate:
        return TokenBucketLink(sim, name, 8.0 * setup.burst_bytes / (setup.rate * costs.link_efficiency))
    return Resource(sim, name)


def _wire(setup, costs):
    if setup.rate is None:
        return lambda b: 0.0
    per_byte = 8.0 * setup.compression / (setup.rate * costs.link_efficiency)
    return lambda b: b * per_byte


def _ps(sim, setup, tensors, costs, t, pool):
    W, S = setup.workers, setup.servers
    wire, L = _wire(setup, costs), costs.latency_s
    summ = 0.0 if math.isinf(costs.sum_bytes_per_s) else 1.0 / costs.sum_bytes_per_s

    def cpu(b):
        return t.per_message_s + t.per_byte_s * b

    wcpu = _CPU(sim, "W.cpu", pool)
    wup, wdown = _link(sim, "W.up", setup, costs), _link(sim, "W.down", setup, costs)
    scpu = [_CPU(sim, f"S{s}.cpu", pool) for s in range(S)]
    sup = [_link(sim, f"S{s}.up", setup, costs) for s in range(S)]
    sdown = [_link(sim, f"S{s}.down", setup, costs) for s in range(S)]
    ready = ready_times(tensors, setup.compute_s)
    msgs = messages(shard(tensors, S, setup.split_bytes, setup.partition_bytes), ready, setup.message_bytes,
                    setup.priority, per_key=setup.mode == "push+pull")
    finished = []

    def reply(m, start):
        prio, _, s, b = m
        sim.chain([scpu[s].stage(W * cpu(b)), (sup[s], W * wire(b)), (None, L), (wdown, wire(b)),
                   wcpu.stage(cpu(b), W)], finished.append, start=start, priority=prio)

    def pushed(m, t0):
        if setup.mode == "pushpull":
            reply(m, t0)
            return
        prio, _, s, _ = m
        # the acknowledgement, then this key's pull request; the reply waits for the round (done here)
        sim.chain([scpu[s].stage(W * t.per_message_s), (None, L), wcpu.stage(t.per_message_s, W),
                   wcpu.stage(t.per_message_s, W), (None, L), scpu[s].stage(W * t.per_message_s)],
                  lambda t2: reply(m, t2), start=t0, priority=prio)

    for m in msgs:
        prio, r, s, b = m
        sim.chain([wcpu.stage(cpu(b), W), (wup, wire(b)), (None, L), (sdown[s], W * wire(b)),
                   scpu[s].stage(W * (cpu(b) + b * summ))], lambda t0, m=m: pushed(m, t0), start=r, priority=prio)
    cpus = list({id(c.resource): c.resource for c in [wcpu] + scpu}.values())
    return finished, [wup, wdown] + sup + sdown + cpus


def _ring(sim, setup, tensors, costs, t, pool):
    W = setup.workers
    finished = []
    if W == 1:
        return finished, []                   # one worker: nothing to send
    wire, L = _wire(setup, costs), costs.latency_s
    summ = 0.0 if math.isinf(costs.sum_bytes_per_s) else 1.0 / costs.sum_bytes_per_s
    cpu = _CPU(sim, "N.cpu", pool)
    up, down = _link(sim, "N.up", setup, costs), _link(sim, "N.down", setup, costs)
    ready = ready_times(tensors, setup.compute_s)
    buckets, size, when = [], 0, 0.0
    for i in range(len(tensors) - 1, -1, -1):    # fused in the order the backward pass makes them
        if size and size + tensors[i] > setup.fusion_bytes:
            buckets.append((size, when))
            size = 0
        size += tensors[i]
        when = ready[i]
    if size:
        buckets.append((size, when))
    steps = 2 * (W - 1)

    def hop(q, k, prio, start):
        if k == steps:
            finished.append(start)
            return
        reduce = q * summ if k < W - 1 else 0.0
        sim.chain([cpu.stage(t.per_message_s + t.per_byte_s * q, W), (up, wire(q)), (None, L), (down, wire(q)),
                   cpu.stage(t.per_message_s + t.per_byte_s * q + reduce, W)],
                  lambda t2: hop(q, k + 1, prio, t2), start=start, priority=prio)

    for j, (b, r) in enumerate(buckets):
        n = max(1, math.ceil(b / W / setup.chunk_bytes))
        q = b / W / n
        for _ in range(n):
            hop(q, 0, j if setup.priority else 0, r)
    return finished, [up, down, cpu.resource]
