"""Metrics seen the way operators see them: a real Prometheus (Debian's `prometheus`, started here on
a temporary directory) finds a 2-worker, 2-server job through the scheduler's /targets and scrapes
it; PromQL through its HTTP API gives each worker's push rate and each server's bytes, which agree
with server_stats(). The names the job exports are the catalog's (kvps/metrics/catalog.py), and the
Grafana dashboard's queries find them. Skipped, with the reason, where prometheus cannot be installed.
"""
import json
import os
import re
import signal
import subprocess
import urllib.parse
import urllib.request

from kvps.metrics import catalog
from tests.harness import Cluster, program_or_skip, wait_for

DASHBOARD = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "grafana", "kvps-dashboard.json")
PUSHES = 200                # per worker, 10 ms apart: about 2.5 s of pushing

WORKER = f"""
import json, os, pathlib, time
import numpy as np
import kvps
kv = kvps.create("dist_sync")
kv.set_optimizer(kvps.optimizer.SGD(learning_rate=0.01))
w = np.zeros(4000, np.float32)          # KVPS_BIGARRAY_BOUND=1000: one part on each server
kv.init("w", w)
g = np.ones(4000, np.float32)
go, done = pathlib.Path(os.environ["GO_FILE"]), pathlib.Path(os.environ["DONE_FILE"])
deadline = time.monotonic() + 90
while not go.exists() and time.monotonic() < deadline:     # until prometheus scrapes every node
    time.sleep(0.05)
start = time.time()
for _ in range({PUSHES}):
    kv.push("w", g)
    time.sleep(0.01)
end = time.time()
kv.pull("w", out=w)                     # waits for this worker's last round
kv.barrier()
out = {{"rank": kv.rank, "start": start, "end": end}}
if kv.rank == 0:
    out["stats"] = kv.server_stats()
print(json.dumps(out), flush=True)
deadline = time.monotonic() + 90
while not done.exists() and time.monotonic() < deadline:   # stay scrapeable until the test has its figures
    time.sleep(0.05)
kv.close()
"""


def prometheus_binary():
    """The prometheus binary, installing Debian's package where we may; pytest.skip with the reason."""
    return program_or_skip("prometheus", "prometheus")


class Prometheus:
    """A Prometheus on 127.0.0.1 (port 0: it logs the one it got), with its data in `tmp`."""

    def __init__(self, binary, tmp, targets_url):
        config = tmp / "prometheus.yml"
        config.write_text(f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: kvps
    http_sd_configs:
      - url: {targets_url}
        refresh_interval: 1s
""")
        self.log = tmp / "prometheus.log"
        self.proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                                      "--web.listen-address=127.0.0.1:0", "--log.level=info"],
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "w"), cwd=tmp)
        self.address = None

        def listening():
            found = re.search(r'msg="Listening on" address=(\S+)', self.log.read_text())
            self.address = found and found.group(1)
            assert self.proc.poll() is None, f"prometheus exited: {self.log.read_text()[-2000:]}"
            return self.address
        wait_for(listening, 30, "prometheus to listen")

    def query(self, promql, at=None):
        params = {"query": promql} | ({"time": f"{at:.3f}"} if at is not None else {})
        url = f"http://{self.address}/api/v1/query?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return {r["metric"].get("node", ""): float(r["value"][1]) for r in body["data"]["result"]}

    def get(self, path):
        with urllib.request.urlopen(f"http://{self.address}{path}", timeout=5) as reply:
            return json.load(reply)["data"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def metrics_address(cluster):
    """The scheduler's METRICS line (kvps.supervisor keeps READY's first word only)."""
    found = [line.split()[1] for line in (cluster.dir / "H.log").read_text().splitlines()
             if line.startswith("METRICS ")]
    assert found, f"the scheduler printed no METRICS line\n{cluster.logs()}"
    return found[0]


def test_prometheus_scrapes_a_job_through_the_schedulers_targets(tmp_path):
    binary = prometheus_binary()
    go, done = tmp_path / "go", tmp_path / "done"
    env = {"KVPS_METRICS_PORT": "0", "KVPS_BIGARRAY_BOUND": "1000", "GO_FILE": str(go), "DONE_FILE": str(done)}
    prom = None
    with Cluster(tmp_path, workers=2, servers=2, env=env) as c:
        try:
            address = metrics_address(c)
            prom = Prometheus(binary, tmp_path, f"http://{address}/targets")
            procs = c.spawn_workers(WORKER)

            def all_up():
                active = prom.get("/api/v1/targets")["activeTargets"]
                return sorted(t["labels"]["node"] for t in active if t["health"] == "up") == ["H", "S0", "S1",
                                                                                             "W0", "W1"]
            wait_for(all_up, 60, f"prometheus to scrape all 5 nodes\n{c.logs()}")
            go.write_text("go")
            wait_for(lambda: all(c.output(f"W{r}") for r in range(2)), 60, f"the workers' figures\n{c.logs()}")
            figures = {o["rank"]: o for r in range(2) for o in c.output(f"W{r}")}
            stats = figures[0]["stats"]
            last = max(f["end"] for f in figures.values()) + 0.5
            wait_for(lambda: prom.query("max(timestamp(kvps_server_pushed_bytes_total))").get("", 0) > last + 1,
                     30, "scrapes after the last push")

            # every worker's push rate over its pushing, as PromQL gives it: about PUSHES / duration
            for rank, f in figures.items():
                window = int(f["end"] - f["start"]) + 1
                rate = prom.query(f'sum by (node) (rate(kvps_worker_call_seconds_count{{op="push",'
                                  f'node="W{rank}"}}[{window}s]))', at=f["end"])[f"W{rank}"]
                expected = PUSHES / (f["end"] - f["start"])
                assert 0.4 * expected < rate < 2.5 * expected, (rank, rate, expected)

            # the totals agree with server_stats(): bytes and entries per server, pushes per worker
            pushed = prom.query("sum by (node) (kvps_server_pushed_bytes_total)")
            entries = prom.query('sum by (node) (kvps_server_entries_total{op="push"})')
            updates = prom.query("sum by (node) (kvps_server_updates_total)")
            for server in ("S0", "S1"):
                assert pushed[server] == stats[server]["bytes_in"] > 0
                assert entries[server] == stats[server]["pushes"] == 2 * PUSHES
                assert updates[server] == stats[server]["updates"]
            # calls by the name the script called them, though its pushes travel as PUSHPULLs (pull-ahead)
            # and its pull takes the last one's reply without a request
            def calls(op):
                return prom.query(f'sum by (node) (kvps_worker_call_seconds_count{{op="{op}"}})')
            assert calls("push") == {"W0": PUSHES, "W1": PUSHES}
            assert calls("pull") == {"W0": 1, "W1": 1}
            assert calls("pushpull") == {}
            sent = prom.query('sum by (node) (kvps_messages_received_total{role="server",op=~"push|pushpull"})')
            assert sent == {"S0": 2 * PUSHES, "S1": 2 * PUSHES}

            # the names: what the job exports is in the catalog, and the dashboard finds its queries' names
            names = set(prom.get("/api/v1/label/__name__/values"))
            exported = {n for n in names if n.startswith("kvps_")}
            assert exported <= catalog.all_sample_names(), sorted(exported - catalog.all_sample_names())
            dash = json.load(open(DASHBOARD))
            wanted = {n for p in dash["panels"] for t in p["targets"] for n in re.findall(r"\bkvps_[a-z_]+", t["expr"])}
            missing = {n for n in wanted - exported if not n.startswith("kvps_ring_")}   # no ring in a PS job
            assert not missing, f"the dashboard queries names this job does not export: {sorted(missing)}"
            # the scheduler's own view: every node alive, heartbeats counted
            alive = prom.query('sum(kvps_scheduler_nodes{state="alive"})')
            assert alive[""] == 4
            done.write_text("ok")
            c.wait(procs, 60)
            assert [p.returncode for p in procs] == [0, 0], c.logs()
            assert c.wait_daemons() == [0, 0, 0], c.logs()
        finally:
            done.write_text("ok")
            if prom is not None:
                prom.stop()


MXNET_STYLE = """
import json, re, urllib.request
import numpy as np
import kvps
kv = kvps.create("dist_sync")
shapes = [(300,), (20, 20), (5,)]
kv.init([0, 1, 2], [np.zeros(s, np.float32) for s in shapes])
grads, outs = [np.ones(s, np.float32) for s in shapes], [np.zeros(s, np.float32) for s in shapes]
for step in range(5):
    for k in range(3):
        kv.push(k, grads[k], priority=-k)
    for k in range(3):
        kv.pull(k, out=outs[k], priority=-k)
kv.pushpull(0, grads[0], out=outs[0])
text = urllib.request.urlopen(f"http://127.0.0.1:{kv._node.telemetry.port}/metrics", timeout=10).read().decode()
counts = {m.group(1): float(m.group(2)) for m in
          re.finditer(r'kvps_worker_call_seconds_count\\{[^}]*op="(\\w+)"[^}]*\\} (\\S+)', text)}
print(json.dumps({"counts": counts, "sums": [float(o.sum()) for o in outs]}), flush=True)
"""


def test_calls_are_counted_by_the_name_the_script_called_them(tmp_path):
    """MXNet's per-key push then pull: the pushes travel as PUSHPULLs and the pulls take their
    replies without a request (pull-ahead), yet the metrics count 15 pushes, 15 pulls and the one
    pushpull the script made."""
    with Cluster(tmp_path, workers=2, servers=1, env={"KVPS_METRICS_PORT": "0"}) as c:
        results = c.run_workers(MXNET_STYLE, timeout=60)
        for (out,) in results:
            assert out["counts"] == {"init": 1, "push": 15, "pull": 15, "pushpull": 1}, (out, c.logs())
            assert out["sums"] == [600.0, 800.0, 10.0]
        assert c.wait_daemons() == [0, 0], c.logs()
