"""The model of one synchronous step: a parameter server (W workers, S dedicated servers) and a
ring all-reduce, as discrete-event simulations over measured costs.

    predict(Setup("ps", workers=4, servers=2, rate=1e9, transport="veth"), tensors("resnet50"), costs)
    # {"step_s": 1.63, "comm_s": 1.63, "events": 5321, "busiest": "S0.down", ...}

What each message does (parameter server; bytes b, wire time w = compression * b / (rate * efficiency),
the efficiency of a link that k hosts send into at once being costs.efficiency(k): W for a
server's downlink, S for a worker's):

    worker CPU (o + c*b) -> worker uplink (w) -> latency -> server downlink (W*w: every worker's copy)
    -> server CPU (W*(o + c*b + b/sum)) -> [round complete] -> server CPU (W*(o + c*b)) -> server
    uplink (W*w) -> latency -> worker downlink (w) -> worker CPU (o + c*b)

with "pushpull" (one call for the whole list: a message's reply leaves as soon as its round is
complete) or "push+pull" (a push call per key, then a pull call per key, as MXNet scripts call
it: messages carry one key's pieces; kvps's pull-ahead sends each push as a PUSHPULL, so a pull
takes the reply its push brought and adds no message). o and c come from the transport
(costs.py). Every kvstore call also costs the worker per_call_s for each key it names, on its
calling thread, one call after another: one call naming every key per step with pushpull, a
call of one key each way per key with push+pull (a push's messages leave when its call returns, or
small pushes together, as kvps coalesces them: _per_key_calls; a pull returns per_call_s after the
previous pull and its key's replies).
Gradients are cut as kvps cuts them: a tensor of at least split_bytes (or one bigger than
partition_bytes) into whole rounds of the S servers, pieces of at most partition_bytes, smaller
tensors to the servers in turn; each worker merges the pieces for one server that are ready
together into messages of at most message_bytes. With priority, queues serve the first layers
first; without, the order the gradients became ready.

The ring (reduce-scatter, then all-gather): tensors are fused into buckets of at most
fusion_bytes in the order they become ready and all-reduced one after another, as the ring
kvstore does (a copy into the bucket's buffer first, and at the end a copy of every result out
of them, at copy_bytes_per_s); each bucket's W segments travel in pieces of at most chunk_bytes;
a piece takes 2(W-1) steps of CPU send -> uplink -> latency -> CPU receive (plus the sum in the
reduce-scatter half): the downlink, by symmetry, carries the neighbour's piece at the same time.

Workers are identical, so the simulation follows one of them and puts W copies of its load on
each shared resource at once (exact for symmetric workers with FIFO queues; the step ends when the
last copy is served). Likewise the ring follows one node whose neighbour, by symmetry, sends it
each piece when it sends its own. Where every process shares host_cores CPUs (one machine), all
CPU work queues for those C cores: a server's stage takes one, the W workers' copies of a stage
spread over min(W, C).

Assumptions (docs/simulate.md says where they stop holding): links are full duplex at a fixed
rate (with burst_bytes, behind a token bucket as tc's tbf puts them) with an infinite switch
buffer (incast costs only the measured fan-in efficiency: no loss bursts, no congestion control,
no TCP slow start), every worker is as fast as every other (no stragglers), keys spread evenly,
a server applies a round as soon as it has every push, compute is a fixed time with gradients
ready linearly over the backward pass (the last layer first), a kvstore call's cost grows
linearly with the processes beyond the shared cores (per_call_crowded_s).
"""
import dataclasses
import math
import statistics

from kvps.errors import ConfigError
from kvps.ps.sharding import stable_hash

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
    message_bytes: int = MB         # KVPS_MESSAGE_BYTES: kvps's messages to another host
    split_bytes: int = MB         # tensors from this size are split over the servers
    fusion_bytes: int = 64 * MB   # ring: bucket size
    chunk_bytes: int = 4 * MB     # ring: a segment travels in pieces of at most this (KVPS_RING_CHUNK_BYTES)
    compute_s: float = 0.0        # forward + backward seconds of one worker's step
    burst_bytes: int = None       # a token bucket on every link direction (tbf, as `kvps emulate` sets one)
    warmup: int = 1               # with burst_bytes: untimed steps before the timed ones, back to back
    timed: int = 1                # ... and timed steps, whose median is the step (as the benchmarks time)
    key0: int = None              # tensor i is key key0 + i, placed by its hash as kvps does (None: in turn)
    coalesce_s: float = 0.001     # push+pull: small pushes after the first wait to go as one (KVPS_COALESCE_US; 0: off)
    lane_bytes: int = 256 << 10   # ... pushes of at most this many bytes, and that many in all (KVPS_LANE_BYTES)

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
        if self.coalesce_s < 0:
            raise ConfigError(f"coalesce_s={self.coalesce_s!r} must not be negative (0: no coalescing)")
        if self.warmup < 0 or self.timed < 1:
            raise ConfigError(f"warmup={self.warmup!r} and timed={self.timed!r} steps: need warmup >= 0, timed >= 1")
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


def shard(tensors, servers, split_bytes, partition_bytes, key0=None):
    """[(tensor index, server, bytes)]: how kvps spreads the tensors over the servers. With key0,
    tensor i is key key0 + i and its first part goes where kvps puts it (kvps/ps/sharding.py:
    stable_hash(key) % servers); without, small tensors go to the servers in turn."""
    pieces, turn = [], 0
    for i, b in enumerate(tensors):
        first = turn if key0 is None else stable_hash(key0 + i)
        if b > partition_bytes or (servers > 1 and b >= split_bytes):
            n = servers * math.ceil(b / (servers * partition_bytes))
            pieces += [(i, (first + k) % servers if key0 is not None else k % servers, b / n) for k in range(n)]
        else:
            pieces.append((i, first % servers, float(b)))
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
    build = _ring if setup.system == "ring" else _ps
    links, t0 = {}, 0.0
    if not (setup.burst_bytes and setup.rate):
        done, resources = build(sim, setup, tensors, costs, t, pool, links, t0)
        step = max([sim.run(), setup.compute_s] + done)
    else:
        # Steps run back to back, so a token bucket starts a step with what it refilled since the
        # last one, not full: simulate the benchmark's sequence on the same links, its warm-up steps
        # and then its timed ones (a bucket of a few ms empties over a few steps of a small model),
        # and take the median of the timed ones as the benchmarks do.
        steps = []
        for i in range(setup.warmup + setup.timed):
            for r in list(links.values()) + ([pool] if pool else []):
                r.busy_s = 0.0
            done, resources = build(sim, setup, tensors, costs, t, pool, links, t0)
            end = max([sim.run(), t0 + setup.compute_s] + done)
            if i >= setup.warmup:
                steps.append(end - t0)
            t0 = end
        step = statistics.median(steps)
    busiest = max(resources, key=lambda r: r.busy_s) if resources else None
    return {"step_s": step, "comm_s": step - setup.compute_s, "events": sim.events,
            "busiest": busiest.name if busiest else None, "busiest_s": busiest.busy_s if busiest else 0.0}


def call_s(setup, costs):
    """A kvstore call's cost per key it names: per_call_s, plus per_call_crowded_s for each busy
    process (the workers, and the servers) beyond host_cores where all of them share those cores."""
    busy = setup.workers + (setup.servers if setup.system == "ps" else 0)
    crowd = max(0, busy - costs.host_cores) if costs.host_cores else 0
    return costs.per_call_s + costs.per_call_crowded_s * crowd


def _link(sim, name, setup, costs, links):
    """A link direction: with burst_bytes, behind a token bucket of that many bytes. One per name
    in `links`, kept across steps."""
    if name not in links:
        links[name] = (TokenBucketLink(sim, name, 8.0 * setup.burst_bytes / (setup.rate * costs.link_efficiency))
                       if setup.burst_bytes and setup.rate else Resource(sim, name))
    return links[name]


def _wire(setup, costs, senders=1):
    """Seconds on a link that `senders` hosts send into at once, for b gradient bytes."""
    if setup.rate is None:
        return lambda b: 0.0
    per_byte = 8.0 * setup.compression / (setup.rate * costs.efficiency(senders))
    return lambda b: b * per_byte


def _ps(sim, setup, tensors, costs, t, pool, links, t0):
    W, S = setup.workers, setup.servers
    wire, L = _wire(setup, costs), costs.latency_s
    wire_in_s, wire_in_w = _wire(setup, costs, W), _wire(setup, costs, S)    # a server's and a worker's downlink
    summ = 0.0 if math.isinf(costs.sum_bytes_per_s) else 1.0 / costs.sum_bytes_per_s

    def cpu(b):
        return t.per_message_s + t.per_byte_s * b

    wcpu = _CPU(sim, "W.cpu", pool)
    wup, wdown = _link(sim, "W.up", setup, costs, links), _link(sim, "W.down", setup, costs, links)
    scpu = [_CPU(sim, f"S{s}.cpu", pool) for s in range(S)]
    sup = [_link(sim, f"S{s}.up", setup, costs, links) for s in range(S)]
    sdown = [_link(sim, f"S{s}.down", setup, costs, links) for s in range(S)]
    ready = [t0 + r for r in ready_times(tensors, setup.compute_s)]
    msgs = messages(shard(tensors, S, setup.split_bytes, setup.partition_bytes, setup.key0), ready, setup.message_bytes,
                    setup.priority, per_key=setup.mode == "push+pull")
    finished = []
    call = call_s(setup, costs)                   # per key a call names
    calls = [wcpu.stage(call, W)] if call > 0 else []
    whole = [wcpu.stage(call * len(tensors), W)] if call > 0 else []

    def reply(m, start, then=finished.append):
        prio, _, s, b = m
        sim.chain([scpu[s].stage(W * cpu(b)), (sup[s], W * wire(b)), (None, L), (wdown, wire_in_w(b)),
                   wcpu.stage(cpu(b), W)], then, start=start, priority=prio)

    def push(m, start, then=finished.append):
        prio, _, s, b = m
        sim.chain([wcpu.stage(cpu(b), W), (wup, wire(b)), (None, L), (sdown[s], W * wire_in_s(b)),
                   scpu[s].stage(W * (cpu(b) + b * summ))], lambda t0: reply(m, t0, then), start=start,
                  priority=prio)

    if setup.mode == "pushpull":
        # one call naming every key: its cost is paid before the first message leaves
        first = min((r for _, r, _, _ in msgs), default=t0)
        sim.chain(whole, lambda t: [push(m, max(m[1], t)) for m in msgs], start=first)
    else:
        _per_key_calls(sim, setup, msgs, len(tensors), ready, calls, push, finished, t0)
    cpus = list({id(c.resource): c.resource for c in [wcpu] + scpu}.values())
    return finished, [wup, wdown] + sup + sdown + cpus


def _per_key_calls(sim, setup, msgs, n, ready, calls, push, finished, t0):
    """push+pull as kvps runs it in dist_sync: a push call per key, one after another, each as its
    gradient is ready (earliest first), its messages leaving when the call returns; then a pull
    call per key in key order, each once the previous pull is done and its key's replies are in.
    Pull-ahead (kvps/kvstore/pull_ahead.py) sends each push as a PUSHPULL whose replies the pull
    takes, so the wire carries per-key pushpull messages: no acknowledgement, no pull request.
    Coalescing (kvps/kvstore/coalesce.py, coalesce_s > 0): a push of at most lane_bytes after the
    first waits in a batch, one message per server, that leaves when a push would take it past
    lane_bytes, when the pulls begin, or at the first gap between calls once it is coalesce_s old."""
    key = (lambda prio: prio) if setup.priority else (lambda prio: -prio)
    by_key = [[] for _ in range(n)]
    for m in msgs:
        by_key[key(m[0])].append(m)
    left = [len(ms) for ms in by_key]
    replied = [None] * n
    pulls = {"next": 0, "free": None, "busy": False}      # free: when the pulls may go on (after the pushes)
    batch = {"opened": None, "bytes": 0.0, "parts": {}}    # parts: server -> [prio, bytes, [key indexes]]

    def arrived(i, t):
        left[i] -= 1
        if not left[i]:
            replied[i] = t
            pull()

    def pull():
        j = pulls["next"]
        if pulls["busy"] or pulls["free"] is None or j == n or replied[j] is None:
            return
        pulls["busy"] = True

        def done(t):
            finished.append(t)
            pulls.update(next=j + 1, free=t, busy=False)
            pull()
        sim.chain(calls, done, start=max(pulls["free"], replied[j]), priority=j if setup.priority else 0)

    def send_batch(t):
        for s, (prio, b, keys) in batch["parts"].items():
            push((prio, t, s, b), t, lambda t3, keys=keys: [arrived(i, t3) for i in keys])
        batch.update(opened=None, bytes=0.0, parts={})

    def wait(i, t):
        """Key i's pieces join the batch (opened at t if none is)."""
        if batch["opened"] is None:
            batch["opened"] = t
        for prio, _, s, b in by_key[i]:
            part = batch["parts"].setdefault(s, [prio, 0.0, []])
            part[0] = min(part[0], prio)
            part[1] += b
            part[2].append(i)
        batch["bytes"] += sum(m[3] for m in by_key[i])

    order = sorted(range(n), key=lambda i: (ready[i], i))
    sizes = [sum(m[3] for m in ms) for ms in by_key]

    def push_call(k, t):
        if k == n:
            if batch["opened"] is not None:
                send_batch(t)               # the first pull sends what waits
            pulls["free"] = t
            pull()
            return
        i = order[k]
        start = max(t, ready[i])
        if batch["opened"] is not None and start > t and start > batch["opened"] + setup.coalesce_s:
            send_batch(max(t, batch["opened"] + setup.coalesce_s))     # the I/O thread, in the gap
        small = setup.coalesce_s > 0 and k > 0 and sizes[i] <= setup.lane_bytes

        def called(t2):
            if small:
                if batch["bytes"] + sizes[i] > setup.lane_bytes:
                    send_batch(t2)
                wait(i, t2)
            else:
                for m in by_key[i]:
                    push(m, t2, lambda t3, i=i: arrived(i, t3))
            push_call(k + 1, t2)
        sim.chain(calls, called, start=start, priority=i if setup.priority else 0)

    push_call(0, t0)


def _ring(sim, setup, tensors, costs, t, pool, links, t0):
    W = setup.workers
    finished = []
    if W == 1:
        return finished, []                   # one worker: nothing to send
    wire, L = _wire(setup, costs), costs.latency_s
    summ = 0.0 if math.isinf(costs.sum_bytes_per_s) else 1.0 / costs.sum_bytes_per_s
    cpu = _CPU(sim, "N.cpu", pool)
    up = _link(sim, "N.up", setup, costs, links)
    ready = [t0 + r for r in ready_times(tensors, setup.compute_s)]
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
    copy = 0.0 if math.isinf(costs.copy_bytes_per_s) else 1.0 / costs.copy_bytes_per_s
    plan = [(j, b, r, max(1, math.ceil(b / W / setup.chunk_bytes))) for j, (b, r) in enumerate(buckets)]

    def hop(q, k, prio, start, done):
        if k == steps:
            done(start)
            return
        reduce = q * summ if k < W - 1 else 0.0
        # The downlink carries the left neighbour's pieces at the moments the uplink carries this
        # node's (symmetry), and a piece's packets cut through the switch: a hop is one link stage.
        sim.chain([cpu.stage(t.per_message_s + t.per_byte_s * q, W), (up, wire(q)), (None, L),
                   cpu.stage(t.per_message_s + t.per_byte_s * q + reduce, W)],
                  lambda t2: hop(q, k + 1, prio, t2, done), start=start, priority=prio)

    def bucket(i, t0):
        """The kvstore all-reduces its buckets one after another: bucket i is copied into its fusion
        buffer once bucket i-1 is done (and its gradients are ready); after the last, every result
        is copied out of the buffers."""
        if i == len(plan):
            sim.chain([cpu.stage(sum(tensors) * copy, W)] if copy else [], finished.append, start=t0)
            return
        j, b, r, n = plan[i]
        prio = j if setup.priority else 0
        left = [n]

        def chunk_done(t2):
            left[0] -= 1
            if not left[0]:
                bucket(i + 1, t2)
        sim.chain([cpu.stage(b * copy, W)] if copy else [],
                  lambda t1: [hop(b / W / n, 0, prio, t1, chunk_done) for _ in range(n)],
                  start=max(r, t0), priority=prio)

    # one pushpull call naming every key: its cost is paid before the first bucket leaves
    call = call_s(setup, costs) * len(tensors)
    sim.chain([cpu.stage(call, W)] if call > 0 else [], lambda t0: bucket(0, t0),
              start=min((r for _, r in buckets), default=t0))
    return finished, [up, cpu.resource]
