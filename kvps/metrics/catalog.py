"""Every metric kvps exports, in one table: name, type, labels, meaning.

Names follow Prometheus's conventions: a `kvps_` prefix, base units in the name (`_seconds`,
`_bytes`), `_total` on counters. Every series also carries `role` (scheduler, server, worker) and
`rank` (empty for the scheduler); the scheduler's /targets adds `node` (H, S0, W1) as a target label.
docs/observability.md lists the same table (`catalog_markdown()`), the Grafana dashboard in
examples/grafana/ may only query these names, and tests/cluster/test_metrics.py checks that a live
job exports exactly names from here (a renamed metric fails a test, not a dashboard).
"""
import dataclasses

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str
    type: str
    labels: tuple
    meaning: str
    roles: tuple = ("scheduler", "server", "worker")


# Latency buckets (seconds): 50 us .. 30 s, roughly x2.5 apart; wide enough for a loopback pull and a
# sync round that waits for a straggler.
SECONDS_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0)
# Staleness buckets (updates between a worker's pull of a key and its push being applied).
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
TOP_KEYS = 10           # a server exports the bytes of its this many busiest keys

_NODE = ("scheduler", "server", "worker")
_DATA = ("server", "worker")

METRICS = (
    # every node: the transport
    Metric("kvps_messages_sent_total", COUNTER, ("op", "peer"), "messages handed to the network, by op and peer"),
    Metric("kvps_sent_bytes_total", COUNTER, ("peer",), "bytes handed to the network (header and payloads)"),
    Metric("kvps_messages_received_total", COUNTER, ("op", "peer"), "messages received and decoded, by op and peer"),
    Metric("kvps_received_bytes_total", COUNTER, ("peer",), "bytes received (header and payloads)"),
    Metric("kvps_send_queue_depth", GAUGE, (), "messages waiting for the I/O thread or the send credit"),
    Metric("kvps_send_inflight_bytes", GAUGE, (), "bytes of data messages zmq holds and has not written out "
                                                 "(bounded by KVPS_SEND_CREDIT)", ("worker",)),
    Metric("kvps_heartbeats_sent_total", COUNTER, (), "heartbeats sent to the scheduler", _DATA),
    Metric("kvps_clock_offset_seconds", GAUGE, (), "the scheduler's clock minus this node's (timeline alignment)",
           _DATA),
    # workers
    Metric("kvps_worker_call_seconds", HISTOGRAM, ("op",), "a kvstore call's time from its start to its last "
                                                           "reply, by the call made (push, pull, pushpull, ...; "
                                                           "a push sent as a PUSHPULL is a push)", ("worker",)),
    Metric("kvps_ring_phase_seconds", HISTOGRAM, ("phase",), "ring all-reduce: each phase's time per collective "
                                                             "(reduce_scatter, all_gather)", ("worker",)),
    # servers
    Metric("kvps_server_request_seconds", HISTOGRAM, ("op",), "a request's time from its arrival to its reply "
                                                              "(sync pushes include the wait for the round)",
           ("server",)),
    Metric("kvps_server_entries_total", COUNTER, ("op",), "entries pushed and pulled (server_stats pushes, pulls)",
           ("server",)),
    Metric("kvps_server_pushed_bytes_total", COUNTER, (), "payload bytes pushed (server_stats bytes_in)", ("server",)),
    Metric("kvps_server_pulled_bytes_total", COUNTER, (), "payload bytes sent in replies (server_stats bytes_out)",
           ("server",)),
    Metric("kvps_server_rounds_total", COUNTER, (), "sync rounds closed", ("server",)),
    Metric("kvps_server_round_seconds", HISTOGRAM, (), "a sync round's time from its first push to its close",
           ("server",)),
    Metric("kvps_server_updates_total", COUNTER, (), "optimizer updates applied", ("server",)),
    Metric("kvps_server_update_seconds", HISTOGRAM, (), "the time of one optimizer update", ("server",)),
    Metric("kvps_server_kernel_calls_total", COUNTER, ("backend", "kernel"), "compute-kernel calls by backend "
                                                                             "and operation", ("server",)),
    Metric("kvps_server_dropped_pushes_total", COUNTER, (), "stale pushes dropped (sync with backup workers)",
           ("server",)),
    Metric("kvps_server_ssp_waits_total", COUNTER, (), "ssp pulls that waited for a slower worker", ("server",)),
    Metric("kvps_server_staleness", HISTOGRAM, (), "staleness of applied pushes: updates to the key since the "
                                                   "pushing worker last pulled it", ("server",)),
    Metric("kvps_server_keys", GAUGE, (), "(key, part) slots held", ("server",)),
    Metric("kvps_server_open_rounds", GAUGE, (), "sync rounds waiting for pushes (a queue depth)", ("server",)),
    Metric("kvps_server_waiting_pulls", GAUGE, (), "pulls waiting for a round or a slower worker (a queue depth)",
           ("server",)),
    Metric("kvps_server_key_bytes_total", COUNTER, ("key",), f"payload bytes pushed and pulled, for the "
                                                             f"{TOP_KEYS} busiest keys", ("server",)),
    # the scheduler
    Metric("kvps_scheduler_nodes", GAUGE, ("node_role", "state"), "registered nodes by role and state "
                                                                  "(alive, left, dead)", ("scheduler",)),
    Metric("kvps_scheduler_node_state", GAUGE, ("node", "state"), "1 for each node's current state",
           ("scheduler",)),
    Metric("kvps_scheduler_heartbeat_age_seconds", GAUGE, ("node",), "seconds since the scheduler last heard "
                                                                     "from each node", ("scheduler",)),
    Metric("kvps_scheduler_heartbeats_total", COUNTER, ("node",), "heartbeats received from each node",
           ("scheduler",)),
)

BY_NAME = {m.name: m for m in METRICS}


def exported_names(metric):
    """The sample names Prometheus stores for a metric (a histogram's _bucket, _sum and _count)."""
    if metric.type == HISTOGRAM:
        return [metric.name + s for s in ("_bucket", "_sum", "_count")]
    return [metric.name]


def all_sample_names():
    return {n for m in METRICS for n in exported_names(m)}


def catalog_markdown():
    """The table docs/observability.md holds between its catalog markers."""
    lines = ["| metric | type | labels | nodes | meaning |", "|---|---|---|---|---|"]
    for m in METRICS:
        labels = ", ".join(f"`{label}`" for label in m.labels) or ""
        lines.append(f"| `{m.name}` | {m.type} | {labels} | {', '.join(m.roles)} | {m.meaning} |")
    return "\n".join(lines) + "\n"
