"""kvps.metrics without processes: counters lose nothing across threads, histograms bucket as Prometheus
does, the exposition parses, names follow Prometheus's conventions, docs/observability.md lists the
catalog, and the Grafana dashboard (examples/grafana/) queries only names from it."""
import json
import pathlib
import re
import threading
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvps.config import Config
from kvps.metrics import catalog
from kvps.metrics.registry import Metrics, histogram_from_counts
from kvps.metrics.telemetry import Telemetry
from kvps.wire.protocol import Op

ROOT = pathlib.Path(__file__).parents[2]
DASHBOARD = ROOT / "examples" / "grafana" / "kvps-dashboard.json"


def samples(metrics):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(generate_latest(metrics.registry).decode()) for s in f.samples}


def test_counters_from_many_threads_add_up_exactly():
    m = Metrics("worker", rank=lambda: 3)
    sent = m.counter("kvps_messages_sent_total")

    def work():
        for _ in range(20_000):
            sent.inc((Op.PUSH, "S0"))
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    got = samples(m)
    assert got[("kvps_messages_sent_total", (("op", "push"), ("peer", "S0"), ("rank", "3"), ("role", "worker")))] == 80_000


def test_histograms_bucket_like_prometheus():
    m = Metrics("server", rank=lambda: 0)
    h = m.histogram("kvps_server_request_seconds")
    for v in (0.00005, 0.0003, 0.0003, 100.0):      # 50 us falls in le=5e-05 (upper bounds are inclusive)
        h.observe(("push",), v)
    got = samples(m)
    base = (("op", "push"), ("rank", "0"), ("role", "server"))

    def bucket(le):
        return got[("kvps_server_request_seconds_bucket", tuple(sorted(base + (("le", le),))))]
    assert bucket("5e-05") == 1 and bucket("0.00025") == 1 and bucket("0.0005") == 3 and bucket("30.0") == 3
    assert bucket("+Inf") == 4
    assert got[("kvps_server_request_seconds_count", base)] == 4
    assert got[("kvps_server_request_seconds_sum", base)] == pytest.approx(100.00065)
    # the store's staleness list (index = staleness) in the catalog's buckets
    counts, total = histogram_from_counts([5, 0, 2, 0, 0, 0, 0, 1], catalog.STALENESS_BUCKETS)
    assert counts[0] == 5 and counts[2] == 2 and sum(counts) == 8 and total == 2 * 2 + 7


def test_derived_values_are_read_at_scrape_time_and_a_failing_one_is_skipped():
    m = Metrics("server", rank=lambda: None)
    box = {"n": 1}
    m.derive("kvps_server_keys", lambda: {(): box["n"]})
    m.derive("kvps_server_open_rounds", lambda: 1 / 0)
    box["n"] = 7
    got = samples(m)
    assert got[("kvps_server_keys", (("rank", ""), ("role", "server")))] == 7
    assert not any(name == "kvps_server_open_rounds" for name, _ in got)


def test_peer_labels_are_bounded():
    m = Metrics("scheduler")
    assert m.peer("W3") == "W3"
    assert m.peer("x" * 100) == "other" and m.peer("\x00evil") == "other" and m.peer(None) == "other"
    for i in range(1000):
        m.peer(f"W{i}")
    assert m.peer("W999") == "other"


def test_names_follow_prometheus_conventions():
    for metric in catalog.METRICS:
        assert re.fullmatch(r"kvps_[a-z_]+", metric.name), metric.name
        assert metric.name.endswith("_total") == (metric.type == catalog.COUNTER), metric.name
        assert not {"role", "rank"} & set(metric.labels), f"{metric.name}: role and rank are added to every series"
        if "seconds" in metric.name or "bytes" in metric.name:
            assert re.search(r"_(seconds|bytes)(_total)?$", metric.name), f"{metric.name}: the unit goes last"
    assert len(catalog.BY_NAME) == len(catalog.METRICS)


def test_docs_list_the_catalog():
    doc = (ROOT / "docs" / "observability.md").read_text()
    assert catalog.catalog_markdown() in doc, ("docs/observability.md's metric table is out of date: paste "
                                               "kvps.metrics.catalog.catalog_markdown() in")


def dashboard_names():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs
    return {n for e in exprs for n in re.findall(r"\bkvps_[a-z_]+", e)}


def test_the_dashboard_queries_only_exported_names():
    unknown = dashboard_names() - catalog.all_sample_names()
    assert not unknown, f"examples/grafana/kvps-dashboard.json queries metrics kvps does not export: {sorted(unknown)}"
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["schemaVersion"] >= 30


def test_a_node_serves_metrics_over_http_and_refuses_a_busy_port():
    cfg = Config().replace(metrics_port=0)
    telemetry = Telemetry(cfg, "worker", "127.0.0.1", rank=lambda: 0)
    try:
        telemetry.sent("S0", Op.PULL, [b"x" * 10, memoryview(bytes(90))])
        text = urllib.request.urlopen(f"http://127.0.0.1:{telemetry.port}/metrics", timeout=5).read().decode()
        assert 'kvps_sent_bytes_total{peer="S0",rank="0",role="worker"} 100.0' in text
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{telemetry.port}/nothing", timeout=5)
        from kvps.errors import ConfigError
        with pytest.raises(ConfigError, match=f"KVPS_METRICS_PORT={telemetry.port}"):
            Telemetry(Config().replace(metrics_port=telemetry.port), "worker", "127.0.0.1")
    finally:
        telemetry.close()
    assert Telemetry.for_config(Config(), "worker", "127.0.0.1") is None     # off: nothing is created


def test_a_call_is_timed_once_at_its_handles_completion_and_never_when_it_failed():
    from kvps.wire.requests import Handle
    cfg = Config().replace(metrics_port=0)
    telemetry = Telemetry(cfg, "worker", "127.0.0.1", rank=lambda: 0)
    try:
        answered, failed, done_before = Handle("push", 5), Handle("pull", 5), Handle.completed("pushpull")
        for handle in (answered, failed):
            handle._expect(1, "S0")
            handle._expect(2, "S1")
            handle._arm()
        telemetry.time_call(answered, Op.PUSH, 0.0)
        telemetry.time_call(failed, Op.PULL, 0.0)
        telemetry.time_call(done_before, Op.PUSHPULL, 0.0)     # answered before it was watched: timed at once
        answered._answered(1)
        assert ("kvps_worker_call_seconds_count", (("op", "push"), ("rank", "0"), ("role", "worker"))) \
            not in samples(telemetry.metrics)                  # one of two replies: not done yet
        answered._answered(2)
        failed._answered(1, RuntimeError("refused"))
        failed._answered(2)
        got = samples(telemetry.metrics)
        for op, count in (("push", 1), ("pushpull", 1)):
            assert got[("kvps_worker_call_seconds_count", (("op", op), ("rank", "0"), ("role", "worker")))] == count
        assert not any(name == "kvps_worker_call_seconds_count" and ("op", "pull") in labels for name, labels in got)
        with pytest.raises(RuntimeError, match="refused"):
            failed.wait(1)
    finally:
        telemetry.close()


def test_a_failing_completion_callback_never_keeps_a_waiter_waiting():
    from kvps.wire.requests import Handle
    handle = Handle("push", 5)
    handle._expect(1, "S0")
    handle._arm()

    def broken(error):
        raise ValueError("an observer's bug")
    handle.when_done(broken)
    handle._answered(1)
    assert handle.wait(1) is handle
    late = []
    handle.when_done(late.append)           # after it completed: at once, with its (absent) error
    assert late == [None]
