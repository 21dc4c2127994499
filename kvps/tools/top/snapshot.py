"""What `kvps top` shows, read from a job's metrics: the scheduler's /targets, then each node's
/metrics (parsed with prometheus-client's text parser), and rates from two such readings.

    reader = Reader("127.0.0.1:9100")           # the scheduler's metrics address (its METRICS line)
    view = reader.read()                        # a View: nodes, rates, slowest worker, hottest server/key

Every HTTP request has a deadline (TIMEOUT); a node that does not answer is shown as unreachable,
never waited for.
"""
import dataclasses
import json
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

TIMEOUT = 2.0           # seconds for one HTTP request


def fetch(url, timeout=TIMEOUT):
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read().decode("utf-8", errors="replace")


def parse(text):
    """{(sample name, frozenset of labels minus role/rank): value}"""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k not in ("role", "rank"))
            out[(s.name, labels)] = s.value
    return out


def total(samples, name, **match):
    want = set(match.items())
    return sum(v for (n, labels), v in samples.items() if n == name and want <= labels)


def by_label(samples, name, label):
    out = {}
    for (n, labels), v in samples.items():
        if n == name:
            key = dict(labels).get(label)
            out[key] = out.get(key, 0) + v
    return out


@dataclasses.dataclass
class Node:
    name: str
    address: str
    state: str = "?"
    reachable: bool = False
    msgs_per_s: float = 0.0
    in_bytes_per_s: float = 0.0
    out_bytes_per_s: float = 0.0
    call_ms: float = None          # workers: mean call time over the last interval
    calls_per_s: float = None      # workers: kvstore calls per second
    round_ms: float = None         # servers: mean round time over the last interval
    staleness: float = None        # servers: mean staleness of applied pushes
    top_key: str = None            # servers: the busiest key


@dataclasses.dataclass
class View:
    at: float
    nodes: list
    slowest_worker: str = None
    hottest_server: str = None
    hottest_key: str = None
    error: str = None


def _rate(now, before, dt):
    return max(0.0, (now - before) / dt) if dt > 0 else 0.0


class Reader:
    def __init__(self, address):
        self.address = address
        self._last = {}             # node -> (time, samples)

    def read(self):
        at = time.time()
        try:
            targets = json.loads(fetch(f"http://{self.address}/targets"))
        except (OSError, ValueError) as exc:
            return View(at, [], error=f"cannot read http://{self.address}/targets: {exc}")
        nodes, current = [], {}
        for group in targets:
            for address in group.get("targets", []):
                name = group.get("labels", {}).get("node", address)
                node = Node(name, address)
                try:
                    current[name] = (time.monotonic(), parse(fetch(f"http://{address}/metrics")))
                    node.reachable = True
                except (OSError, ValueError):
                    pass
                nodes.append(node)
        nodes.sort(key=lambda n: ("HSW".find(n.name[:1]) % 3, int(n.name[1:]) if n.name[1:].isdigit() else 0))
        states = {}
        sched = current.get("H")
        if sched is not None:
            for (n, labels), v in sched[1].items():
                if n == "kvps_scheduler_node_state" and v:
                    d = dict(labels)
                    states[d.get("node")] = d.get("state")
        for node in nodes:
            node.state = "alive" if node.name == "H" else states.get(node.name, "?")
            if node.name not in current:
                node.state = node.state if node.state != "alive" else "gone"      # /metrics does not answer
                continue
            t1, now = current[node.name]
            t0, before = self._last.get(node.name, (None, None))
            if before is None:
                continue
            dt = t1 - t0

            def rate(name, **match):
                return _rate(total(now, name, **match), total(before, name, **match), dt)

            def mean_ms(name, **match):
                count = rate(name + "_count", **match)
                return 1000 * rate(name + "_sum", **match) / count if count else None
            node.msgs_per_s = rate("kvps_messages_sent_total") + rate("kvps_messages_received_total")
            node.in_bytes_per_s = rate("kvps_received_bytes_total")
            node.out_bytes_per_s = rate("kvps_sent_bytes_total")
            if node.name.startswith("W"):
                node.call_ms = mean_ms("kvps_worker_call_seconds")
                node.calls_per_s = rate("kvps_worker_call_seconds_count")
            if node.name.startswith("S"):
                node.round_ms = mean_ms("kvps_server_round_seconds")
                count = total(now, "kvps_server_staleness_count")
                node.staleness = total(now, "kvps_server_staleness_sum") / count if count else None
                keys = by_label(now, "kvps_server_key_bytes_total", "key")
                old = by_label(before, "kvps_server_key_bytes_total", "key")
                rates = {k: v - old.get(k, 0) for k, v in keys.items()}
                if rates and max(rates.values()) > 0:
                    node.top_key = max(rates, key=rates.get)
        self._last = current
        view = View(at, nodes)
        workers = [n for n in nodes if n.call_ms is not None]
        servers = [n for n in nodes if n.name.startswith("S") and n.reachable]
        if len(workers) > 1:
            # The fewest calls per second; in a sync job all go at the straggler's pace, and the
            # straggler is the one that waits least for the others (the shortest calls).
            view.slowest_worker = min(workers, key=lambda n: (round(n.calls_per_s, 1), n.call_ms)).name
        if servers and any(n.in_bytes_per_s for n in servers):
            hot = max(servers, key=lambda n: n.in_bytes_per_s + n.out_bytes_per_s)
            view.hottest_server, view.hottest_key = hot.name, hot.top_key
        return view
