"""What one node records when KVPS_METRICS_PORT or KVPS_TIMELINE is set: the hooks that the
transport, the kvstore, the ring, the server and the store call, feeding both the Prometheus
metrics (kvps.metrics.registry, served by kvps.metrics.exposition) and the timeline.

    telemetry = Telemetry.for_config(cfg, "worker", host, rank=lambda: node.rank)   # None when both are off
    telemetry.port                                  # the metrics port (reported at REGISTER), or None

Owners keep `telemetry` as an attribute that is None when both are off, and call a hook only after
`if telemetry is not None`: with metrics off the message path does no other work. With metrics on,
a message costs one dict update (its count and bytes, kvps.metrics.registry.Traffic), counted once
it was sent or handled, so that the count never delays it; a kvstore call costs one callback on its
handle and one histogram observation (time_call; with a timeline, watch_call wraps every reply).
Times are time.time() seconds, so that timeline events from several nodes can be lined up.
"""
import functools
import math
import threading
import time

from kvps.metrics.catalog import TOP_KEYS
from kvps.metrics.registry import MAX_PEERS, Counter, Metrics
from kvps.metrics.timeline import flow_id


def _nbytes(frames):
    n = 0
    for f in frames:            # bytes, zmq.Frame, 1-D uint8 memoryview or ndarray: len() is the size
        n += f.nbytes if type(f) is memoryview else len(f)
    return n


class _Call:
    """One watched kvstore call: counts its replies down to the last (all on the I/O thread)."""
    __slots__ = ("telemetry", "op", "items", "name", "priority", "start", "starts", "left", "tid")

    def __init__(self, telemetry, op, items, name, priority, starts=None):
        self.telemetry, self.op, self.name, self.priority = telemetry, op, name, priority
        self.items = items if telemetry.timeline is not None else None     # only the timeline reads them
        self.left = len(items)
        self.start = time.time() if starts is None else starts[0]
        self.starts = starts            # the calls it stands for (coalesced pushes), else just this one
        self.tid = threading.current_thread().name if telemetry.timeline is not None else None

    def reply(self, on_reply, header, payloads):
        if on_reply is not None:
            on_reply(header, payloads)
        self.left -= 1
        if self.left == 0:
            self.telemetry._finished(self)


class Telemetry:
    def __init__(self, cfg, role, host, rank=lambda: None, targets=None):
        from kvps.metrics.exposition import Endpoint
        from kvps.metrics.timeline import Timeline
        self.role = role
        self.metrics = self.endpoint = self.timeline = None
        self.clock_offset, self._best_rtt = 0.0, math.inf
        self._labels = {}                           # Op -> its label ("push"): enum names are slow to read
        if cfg.metrics_port is not None:
            m = self.metrics = Metrics(role, rank)
            self._sent = m.traffic("kvps_messages_sent_total", "kvps_sent_bytes_total")
            self._received = m.traffic("kvps_messages_received_total", "kvps_received_bytes_total")
            self._beats = m.counter("kvps_heartbeats_sent_total")
            self._calls = m.histogram("kvps_worker_call_seconds")
            self._requests = m.histogram("kvps_server_request_seconds")
            self._rounds = m.histogram("kvps_server_round_seconds")
            self._updates = m.histogram("kvps_server_update_seconds")
            self._ring = m.histogram("kvps_ring_phase_seconds")
            self._key_bytes = Counter()             # exported as the top TOP_KEYS only (see key_bytes)
            self._clients = {}                      # ROUTER routing id -> its peer label
            if role != "scheduler":
                m.derive("kvps_clock_offset_seconds", lambda: {(): self.clock_offset})
            self.endpoint = Endpoint(m.registry, host, cfg.metrics_port, targets)
        if cfg.timeline:
            self.timeline = Timeline(cfg.timeline, role)

    @classmethod
    def for_config(cls, cfg, role, host, **kwargs):
        """A Telemetry, or None when neither KVPS_METRICS_PORT nor KVPS_TIMELINE is set."""
        if cfg.metrics_port is None and not cfg.timeline:
            return None
        return cls(cfg, role, host, **kwargs)

    port = property(lambda self: None if self.endpoint is None else self.endpoint.port)

    def named(self, name):
        """The node registered as `name` (H, S0, W1)."""
        if self.timeline is not None:
            self.timeline.name(name)

    def close(self):
        if self.endpoint is not None:
            self.endpoint.stop()
        if self.timeline is not None:
            self.timeline.close()

    # ---- the transport (kvps.wire.transport.Van) ----
    def sent(self, peer, op, frames):
        if self.metrics is not None:
            self._sent.count(op, peer, frames)

    def replied(self, routing_id, op, frames):
        """A reply to a ROUTER client, counted under the name that client gives in its requests."""
        if self.metrics is not None:
            self._sent.count(op, self._clients.get(routing_id, "client"), frames)

    def received(self, source, header, frames):
        """A decoded message: from ("peer", name) over a DEALER or ("client", routing id) on the ROUTER,
        counted under the name the client gives (header.src), as its replies will be."""
        if self.metrics is not None:
            kind, who = source
            if kind == "client":
                peer = self._clients.get(who)
                if peer is None:
                    peer = header.src
                    if len(self._clients) < MAX_PEERS and peer not in ("", "?"):   # "?": not yet registered
                        self._clients[who] = peer
            else:
                peer = who
            self._received.count(header.op, peer, frames)

    def handed(self, peer, request_id):
        """A request went to zmq (the I/O thread, after the send queue and the credit window)."""
        if self.timeline is not None and request_id:
            self.timeline.instant("sent", "wire", time.time(), {"peer": peer, "req": request_id})

    # ---- membership: heartbeats and the clock offset ----
    def heartbeat(self):
        if self.metrics is not None:
            self._beats.inc()

    def clock_sample(self, sent, scheduler_time, received):
        """A heartbeat's round trip: the scheduler's clock read between `sent` and `received` (ours).
        The sample with the shortest round trip gives the offset (NTP's rule), within rtt/2."""
        rtt = received - sent
        if 0 <= rtt < min(self._best_rtt, 60.0):        # NaN and absurd round trips never count
            self._best_rtt = rtt
            self.clock_offset = scheduler_time - (sent + received) / 2
            if self.timeline is not None:
                self.timeline.offset(self.clock_offset, rtt)

    # ---- workers: a kvstore call's life ----
    def time_call(self, handle, op, start):
        """Time a kvstore call from `start` to the completion of its handle (metrics without a
        timeline: one callback a call, where watch_call wraps every reply); a list of starts: the
        calls one handle stands for (pushes that went as one request), each timed."""
        handle.when_done(functools.partial(self._timed, self._label(op), start))

    def call_done(self, op, start, keys):
        """A kvstore call answered without a request of its own (a pull that took the reply its
        keys' pushes brought, kvps/kvstore/pull_ahead.py): from `start` to now."""
        end, label = time.time(), self._label(op)
        if self.metrics is not None:
            self._calls.observe((label,), end - start)
        if self.timeline is not None:
            names = sorted(str(k) for k in keys)
            self.timeline.complete(label, "call", start, end, {"keys": names[:16], "nkeys": len(names),
                                                               "pulled_ahead": True},
                                   threading.current_thread().name)

    def _timed(self, label, start, error):
        if error is None:                   # as watch_call: a call that failed is not timed
            end = time.time()
            for s in start if type(start) is list else (start,):
                self._calls.observe((label,), end - s)

    def watch_call(self, op, items, name, priority=0, starts=None):
        """The request items [(peer, header, payloads, on_reply)] of one call, with on_reply wrapped
        to time the call from now to its last reply (on the I/O thread; an ERROR reply is not timed).
        `name`: this worker's node name, which ties its requests to the servers' events. `starts`:
        the calls the requests stand for (coalesced pushes), timed each from its own start."""
        call = _Call(self, op, items, name, priority, starts)
        return [(peer, header, payloads, functools.partial(call.reply, on_reply))
                for peer, header, payloads, on_reply in items]

    def _label(self, op):
        label = self._labels.get(op)
        if label is None:
            label = self._labels[op] = op.name.lower()
        return label

    def _finished(self, call):
        end = time.time()
        label = self._label(call.op)
        if self.metrics is not None:
            for start in call.starts or (call.start,):
                self._calls.observe((label,), end - start)
        tl = self.timeline
        if tl is not None:
            items = call.items
            keys = sorted({str(e.key) for _, h, _, _ in items for e in h.keys})
            nbytes = sum(_nbytes(p) for _, _, p, _ in items)
            requests = [f"{peer}/{h.id}" for peer, h, _, _ in items]
            tl.complete(label, "call", call.start, end, {"keys": keys[:16], "nkeys": len(keys), "bytes": nbytes,
                                                         "priority": call.priority, "requests": requests}, call.tid)
            for _, h, _, _ in items:
                tl.flow("s", flow_id(call.name, h.id), "request", call.start, call.tid)

    # ---- servers ----
    def request_done(self, header, start):
        """A request that arrived at `start` is answered now."""
        end = time.time()
        op = self._label(header.op)
        if self.metrics is not None:
            self._requests.observe((op,), end - start)
        if self.timeline is not None:
            self.timeline.complete(op, "request", start, end, {"src": header.src, "req": header.id,
                                                               "nkeys": len(header.keys)})
            if header.src:
                self.timeline.flow("f", flow_id(header.src, header.id), "request", start)

    def key_bytes(self, key, nbytes):
        self._key_bytes.inc(key, nbytes)

    def top_keys(self):
        values = self._key_bytes.values()
        top = sorted(values.items(), key=lambda kv: kv[1], reverse=True)[:TOP_KEYS]
        return {(str(key)[:64],): value for key, value in top}

    # the store's observer (kvps.ps.store.Store.observer)
    def round_closed(self, slot, opened, merge_start, closed):
        if self.metrics is not None:
            self._rounds.observe((), closed - opened)
        if self.timeline is not None:
            args = {"key": str(slot.id[0]), "part": slot.id[1]}
            self.timeline.complete("round", "store", opened, closed, args)
            self.timeline.complete("sum", "store", merge_start, closed, args)

    def updated(self, slot, start, end):
        if self.metrics is not None:
            self._updates.observe((), end - start)
        if self.timeline is not None:
            self.timeline.complete("update", "store", start, end, {"key": str(slot.id[0]), "part": slot.id[1]})

    # ---- kvps.torch: gradient buckets ----
    def bucket(self, index, ready, handed, synced, args):
        """Gradient bucket `index` of a DistributedOptimizer: its last gradient ready (the hook) at
        `ready`, handed to the kvstore at `handed`, its sync seen complete at `synced`."""
        if self.timeline is not None:
            self.timeline.complete(f"bucket {index}", "torch", ready, synced,
                                   dict(args, bucket=index, handed_us=max(0, int((handed - ready) * 1e6))))

    # ---- the ring ----
    def ring_phase(self, seq, phase, start, end, nbytes):
        if self.metrics is not None:
            self._ring.observe((phase,), end - start)
        if self.timeline is not None:
            self.timeline.complete(phase, "ring", start, end, {"collective": seq, "bytes": nbytes})

    def ring_chunk(self, seq, phase, step, chunk, start, end):
        if self.timeline is not None:
            self.timeline.complete(f"{phase} step {step}", "ring", start, end,
                                   {"collective": seq, "step": step, "chunk": chunk})
