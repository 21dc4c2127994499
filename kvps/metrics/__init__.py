"""Observability: Prometheus metrics and a Chrome-trace timeline (docs/observability.md).

    KVPS_METRICS_PORT=0 kvps launch -n 2 -s 2 -- python train.py     # or: kvps launch --metrics
    KVPS_TIMELINE=/tmp/tl kvps launch ...; kvps timeline merge /tmp/tl -o trace.json

catalog.py names every metric kvps exports; registry.py holds a process's counters and histograms
(lock-free, one shard per thread) and turns them into Prometheus families at scrape time;
exposition.py serves /metrics (and the scheduler's /targets) over HTTP; timeline.py writes trace
events. With neither variable set, nothing here is even imported by the hot path's owners.
"""
