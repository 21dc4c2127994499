"""A process's metrics: counters and histograms cheap enough for the message path, turned into
Prometheus families (prometheus-client) only when /metrics is scraped.

    metrics = Metrics("worker", rank=lambda: node.rank)
    sent = metrics.counter("kvps_messages_sent_total")
    sent.inc((Op.PUSH, "S0"))                       # label values as a tuple, in the catalog's order
    metrics.histogram("kvps_worker_call_seconds").observe(("push",), 0.004)
    metrics.derive("kvps_server_keys", lambda: {(): len(store.slots)})    # read at scrape time
    generate_latest(metrics.registry)

Why not prometheus-client's own Counter: its inc() takes a lock, and label lookups cost a dict of
strings per call. Here each thread counts into a shard of its own (a plain dict, so an increment is
one dict update and never lost to another thread), and a scrape adds the shards up. Label values
may be any hashable (an Op, a str); they become strings at scrape time. Counters a module already
keeps (the store's stats) are read at scrape time through derive(), so they cost nothing per message.
"""
import bisect
import threading

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from kvps.metrics import catalog
from kvps.metrics.catalog import COUNTER, GAUGE, HISTOGRAM

MAX_PEERS = 256             # distinct peer label values kept; others count as "other" (peers name themselves)
MAX_TRAFFIC_KEYS = 4096     # (op, peer) pairs one thread's traffic counts keep apart


class _Sharded:
    """Per-thread dicts, added up at read time (one writer per dict, so no update is lost)."""

    def __init__(self):
        self._local = threading.local()
        self._shards = []
        self._lock = threading.Lock()          # only when a thread writes for the first time

    def _shard(self):
        shard = {}
        with self._lock:
            self._shards.append(shard)
        self._local.shard = shard
        return shard

    def _copies(self):
        with self._lock:
            shards = list(self._shards)
        return [s.copy() for s in shards]      # dict.copy holds the GIL: a consistent snapshot


class Counter(_Sharded):
    def inc(self, labels=(), amount=1):
        try:
            shard = self._local.shard
        except AttributeError:
            shard = self._shard()
        shard[labels] = shard.get(labels, 0) + amount

    def values(self):
        total = {}
        for shard in self._copies():
            for labels, value in shard.items():
                total[labels] = total.get(labels, 0) + value
        return total


class Histogram(_Sharded):
    """Fixed buckets (upper bounds, inclusive, as Prometheus's `le`), plus +Inf and a sum."""

    def __init__(self, buckets):
        super().__init__()
        self.buckets = tuple(buckets)

    def observe(self, labels, value):
        try:
            shard = self._local.shard
        except AttributeError:
            shard = self._shard()
        counts = shard.get(labels)
        if counts is None:
            counts = shard[labels] = [0] * (len(self.buckets) + 1) + [0.0]
        counts[bisect.bisect_left(self.buckets, value)] += 1
        counts[-1] += value

    def values(self):
        """{labels: (per-bucket counts, +Inf last; sum)}."""
        total = {}
        for shard in self._copies():
            for labels, counts in shard.items():
                counts = list(counts)           # the writer may be changing it: take it once
                have = total.get(labels)
                total[labels] = counts if have is None else [a + b for a, b in zip(have, counts)]
        return {labels: (c[:-1], c[-1]) for labels, c in total.items()}


class Traffic(_Sharded):
    """Messages and bytes by (op, peer), in one dict update per message (the transport's hot path);
    exported as a messages counter by op and peer and a bytes counter by peer. Peer names are made
    label-safe at scrape time; a shard that already holds MAX_TRAFFIC_KEYS keys counts newcomers
    as "other", so peers that invent names cannot grow it."""

    def count(self, op, peer, frames):
        try:
            shard = self._local.shard
        except AttributeError:
            shard = self._shard()
        key = (op, peer)
        cell = shard.get(key)
        if cell is None:
            if len(shard) >= MAX_TRAFFIC_KEYS:
                key = (op, "other")
            cell = shard.get(key)
            if cell is None:
                cell = shard[key] = [0, 0]
        nbytes = 0
        for f in frames:            # bytes, zmq.Frame, 1-D uint8 memoryview or ndarray: len() is the size
            nbytes += f.nbytes if type(f) is memoryview else len(f)
        cell[0] += 1
        cell[1] += nbytes

    def values(self, peer_label):
        """({(op, peer label): messages}, {(peer label,): bytes})"""
        messages, nbytes = {}, {}
        for shard in self._copies():
            for (op, peer), (count, size) in shard.items():
                label = peer_label(peer)
                messages[(op, label)] = messages.get((op, label), 0) + count
                nbytes[(label,)] = nbytes.get((label,), 0) + size
        return messages, nbytes


def histogram_from_counts(counts, buckets):
    """(per-bucket counts, sum) of a histogram kept as counts[i] = observations of value i (the
    store's staleness list), in `buckets`."""
    out = [0] * (len(buckets) + 1)
    for value, n in enumerate(counts):
        if n:
            out[bisect.bisect_left(buckets, value)] += n
    return out, float(sum(value * n for value, n in enumerate(counts)))


class Metrics:
    """The metrics of one node. `rank()` gives the rank label (known once the node registered)."""

    def __init__(self, role, rank=lambda: None):
        self.role = role
        self._rank = rank
        self._counters = {}
        self._histograms = {}
        self._derived = []                    # (metric, fn) read at scrape time
        self._traffic = []                    # (messages name, bytes name, Traffic)
        self._peers = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def counter(self, name):
        self._check(name, COUNTER)
        return self._counters.setdefault(name, Counter())

    def histogram(self, name, buckets=catalog.SECONDS_BUCKETS):
        self._check(name, HISTOGRAM)
        return self._histograms.setdefault(name, Histogram(buckets))

    def traffic(self, messages_name, bytes_name):
        """A Traffic exported as `messages_name` (by op and peer) and `bytes_name` (by peer)."""
        self._check(messages_name, COUNTER)
        self._check(bytes_name, COUNTER)
        traffic = Traffic()
        self._traffic.append((messages_name, bytes_name, traffic))
        return traffic

    def derive(self, name, fn):
        """Export `name` from fn() -> {label tuple: value} (for a histogram: (per-bucket counts, sum)),
        called at each scrape; a fn that raises is skipped for that scrape."""
        self._derived.append((catalog.BY_NAME[name], fn))

    def peer(self, name):
        """A bounded label value for a peer's name (peers choose their own names)."""
        label = self._peers.get(name)
        if label is None:
            ok = type(name) is str and 0 < len(name) <= 16 and name.isascii() and name.isprintable()
            label = name if ok and len(self._peers) < MAX_PEERS else "other"
            self._peers[name] = label
        return label

    @staticmethod
    def _check(name, kind):
        metric = catalog.BY_NAME.get(name)
        if metric is None or metric.type != kind:
            raise KeyError(f"{name!r} is not a {kind} in kvps.metrics.catalog")

    # ---- prometheus-client's collector interface (called by the scraping thread) ----
    def collect(self):
        rank = self._rank()
        base = [self.role, "" if rank is None else str(rank)]
        families = {}

        def family(metric):
            fam = families.get(metric.name)
            if fam is None:
                cls = {COUNTER: CounterMetricFamily, GAUGE: GaugeMetricFamily,
                       HISTOGRAM: HistogramMetricFamily}[metric.type]
                fam = families[metric.name] = cls(metric.name, metric.meaning,
                                                  labels=["role", "rank", *metric.labels])
            return fam

        def add(metric, values, buckets=None):
            fam = family(metric)
            for labels, value in values.items():
                labels = base + [_label(v) for v in labels]
                if metric.type == HISTOGRAM:
                    counts, total = value
                    cumulative, running = [], 0
                    for bound, n in zip((*buckets, float("inf")), counts):
                        running += n
                        cumulative.append((floatToGoString(bound), running))
                    fam.add_metric(labels, cumulative, total)
                else:
                    fam.add_metric(labels, value)

        for name, counter in self._counters.items():
            add(catalog.BY_NAME[name], counter.values())
        for messages_name, bytes_name, traffic in self._traffic:
            messages, nbytes = traffic.values(self.peer)
            add(catalog.BY_NAME[messages_name], messages)
            add(catalog.BY_NAME[bytes_name], nbytes)
        for name, hist in self._histograms.items():
            add(catalog.BY_NAME[name], hist.values(), hist.buckets)
        for metric, fn in self._derived:
            try:
                values = fn()
            except Exception:           # a scrape must never break the node; the next one tries again
                continue
            buckets = catalog.STALENESS_BUCKETS if metric.name == "kvps_server_staleness" else catalog.SECONDS_BUCKETS
            add(metric, values, buckets)
        return list(families.values())


def _label(value):
    if isinstance(value, str):
        return value
    name = getattr(value, "name", None)         # an enum member (Op): its name, lower case
    return name.lower() if isinstance(name, str) else str(value)
