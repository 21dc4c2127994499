"""The emulated cluster (kvps.tools.emulate): the bandwidth bound as closed forms, then, where network
namespaces are permitted (root on Linux), real namespaces, links, transfers and a kvps job.

Tests that need namespaces skip with permitted()'s reason elsewhere. Every test that builds a
network checks that no namespace with this process's prefix is left behind. About 30 s in all.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvps.tools.emulate import EmulatedJob, Network, main, parse_rate, permitted, placement, run_job, theory
from kvps.tools.emulate.network import namespaces
from kvps.tools.emulate.probe import transfer
from kvps.errors import ConfigError

PY = sys.executable
M, B = 102_228_128, 1e9            # ResNet-50's gradients, a 1 Gbit/s link
T = 8 * M / B

FAST_ENV = {"KVPS_HEARTBEAT_INTERVAL": "0.2", "KVPS_HEARTBEAT_TIMEOUT": "3", "KVPS_TIMEOUT": "30",
            "KVPS_CONNECT_TIMEOUT": "30"}


# ---- the bound, pure ----
@pytest.mark.parametrize("W", [1, 2, 3, 4, 8, 16])
def test_ring_bound(W):
    assert theory(M, B, W, 1).ring == pytest.approx(2 * (W - 1) / W * T)


@pytest.mark.parametrize("W,S", [(1, 1), (2, 1), (4, 1), (4, 2), (4, 4), (4, 8), (8, 3)])
def test_dedicated_ps_bound(W, S):
    # a worker's link carries M each way; a server's W*M/S each way
    assert theory(M, B, W, S).ps == pytest.approx(max(M, W * M / S) * 8 / B)


@pytest.mark.parametrize("W,S,expected", [
    (1, 1, 0.0),            # one host: nothing crosses a link
    (2, 1, 1.0),            # host 0 sends W1 its pull (M) and receives its push (M)
    (4, 1, 3.0),            # the server's host: 3 workers' pushes in, 3 pulls out
    (4, 2, 2.0),            # (S-1)/S + (W-1)/S = 1/2 + 3/2
    (4, 4, 1.5),            # = 2(W-1)/W: the ring's bound
    (8, 8, 1.75),
])
def test_colocated_ps_bound(W, S, expected):
    assert theory(M, B, W, S, colocated=True).ps == pytest.approx(expected * T)


@pytest.mark.parametrize("W", [2, 3, 4, 8, 32])
def test_colocated_ps_with_a_server_per_host_matches_the_ring(W):
    t = theory(M, B, W, W, colocated=True)
    assert t.ps == pytest.approx(t.ring)


@pytest.mark.parametrize("W,S,R", [(2, 2, 1), (4, 4, 1), (4, 2, 1), (4, 4, 3), (2, 4, 1), (8, 3, 2)])
def test_replicated_dedicated_ps_bound(W, S, R):
    # each server host also sends along its chains, and receives as much: one round sum, M/S, with
    # one replica; every worker's push for each of R >= 2 replicas, R*W*M/S
    copies = M / S if R == 1 else R * W * M / S
    t = theory(M, B, W, S, replicas=R)
    assert t.ps == pytest.approx(max(M, W * M / S + copies) * 8 / B)
    assert t.ring == theory(M, B, W, S).ring                     # the ring has no chains
    if W * M / S + copies >= M:     # a server's link is the busiest: its pushes and pulls, W*M/S, plus the copies
        assert t.ps - W * M / S * 8 / B == pytest.approx(copies * 8 / B)


@pytest.mark.parametrize("W,S,R,expected", [
    (2, 2, 1, 1.5),         # (S-1)/S + (W-1)/S = 1, + one round sum 1/S
    (4, 4, 1, 1.75),        # 1.5 (the ring's) + 1/4
    (4, 2, 1, 2.5),         # 2 + 1/2
    (3, 2, 1, 2.0),         # (2+3-2)/2 + 1/2
    (4, 4, 2, 3.5),         # 1.5 + every push for each of 2 replicas, 2*4/4
])
def test_replicated_colocated_ps_bound(W, S, R, expected):
    assert theory(M, B, W, S, colocated=True, replicas=R).ps == pytest.approx(expected * T)


@pytest.mark.parametrize("args", [(M, B, 0, 1), (M, B, 1, 0), (M, 0, 2, 1), (-1, B, 2, 1), (M, B, 2, 3, True),
                                  (M, B, 2, 1, False, 1), (M, B, 4, 2, False, 2), (M, B, 2, 2, False, -1)])
def test_theory_refuses_impossible_jobs(args):
    with pytest.raises(ConfigError):
        theory(*args)


@pytest.mark.parametrize("text,bits", [("1gbit", 10**9), ("50mbit", 5 * 10**7), ("2.5Gbit/s", 25 * 10**8),
                                       ("800k", 800_000), ("1000000", 10**6)])
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["1gbps", "fast", "", "10bit", "-1mbit"])
def test_parse_rate_refuses(text):
    with pytest.raises(ConfigError, match="rate"):
        parse_rate(text)


def test_placement():
    assert placement(2, 1) == {"H": "h0", "S0": "h1", "W0": "h2", "W1": "h3"}
    assert placement(3, 2, colocated=True) == {"H": "h0", "S0": "h1", "S1": "h2", "W0": "h1", "W1": "h2",
                                               "W2": "h3"}
    with pytest.raises(ConfigError, match="co-located"):
        placement(1, 2, colocated=True)


def test_cli_skips_with_the_reason_where_namespaces_are_not_permitted(monkeypatch, capsys):
    import kvps.tools.emulate.cli as cli
    monkeypatch.setattr(cli, "permitted", lambda delay=False: (False, "no namespaces in this test"))
    assert main(["-n", "2", "-s", "1", "--", PY, "-c", "pass"]) == cli.SKIPPED == 77
    assert main(["check"]) == 77
    assert "skipped: no namespaces in this test" in capsys.readouterr().err


def test_cli_usage_errors_exit_2(capsys):
    assert main(["-n", "2", "--rate", "fast", "--", PY, "-c", "pass"]) == 2
    assert main(["-n", "2"]) == 2            # no command
    assert "error" in capsys.readouterr().err


def test_cli_theory_needs_no_namespaces(capsys):
    assert main(["theory", "-n", "4", "-s", "1,4", "--placement", "dedicated,colocated"]) == 0
    out = capsys.readouterr().out
    assert "| 4 | 1 | dedicated | 3271 | 1227 |" in out and "| 4 | 4 | co-located | 1227 | 1227 |" in out


# ---- real namespaces ----
@pytest.fixture(scope="module")
def allowed():
    ok, why = permitted()
    if not ok:
        pytest.skip(f"network namespaces are not permitted here: {why}")


@pytest.fixture
def no_leaks(allowed):
    """Fails the test if it leaves a namespace with this process's prefix behind."""
    mine = f"kvem{os.getpid()}x"
    before = {n for n in namespaces() if n.startswith(mine)}
    yield
    assert {n for n in namespaces() if n.startswith(mine)} == before


def _links():
    return sorted(line.split(":")[1].strip() for line in
                  subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout.splitlines())


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_up_and_down_leave_nothing_behind(no_leaks):
    links = _links()
    net = Network()
    with net.up(3, rate="100mbit"):
        made = {n for n in namespaces() if n.startswith(net.prefix)}
        assert made == {f"{net.prefix}-{h}" for h in ("sw", "h0", "h1", "h2")}
        assert [net.address(h) for h in ("h0", "h1", "h2")] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
        out = subprocess.run(net.command("h1", ["ip", "-o", "addr", "show", "eth0"]), capture_output=True,
                             text=True, check=True).stdout
        assert "198.18.0.2/15" in out
        qdisc = subprocess.run(["tc", "-n", net.namespace("h1"), "qdisc", "show", "dev", "eth0"], capture_output=True,
                               text=True, check=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        assert _links() == links               # the veths live in the namespaces, not here
    assert not [n for n in namespaces() if n.startswith(net.prefix)]
    net.down()                                 # idempotent


def test_teardown_when_the_body_raises(no_leaks):
    net = Network()
    with pytest.raises(RuntimeError, match="boom"):
        with net.up(2, rate="100mbit"):
            sleeper = net.popen("h1", ["sleep", "60"])
            raise RuntimeError("boom")
    assert sleeper.poll() is not None          # stopped by pid
    assert not [n for n in namespaces() if n.startswith(net.prefix)]


INTERRUPTED = textwrap.dedent("""
    import json, sys, time
    from kvps.tools.emulate import Network
    with Network().up(2, rate="100mbit") as net:
        sleeper = net.popen("h1", ["sleep", "60"])
        print(json.dumps({"prefix": net.prefix, "sleeper": sleeper.pid}), flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_teardown_when_interrupted(allowed, sig):
    proc = subprocess.Popen([PY, "-c", INTERRUPTED], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        info = json.loads(proc.stdout.readline() or b"null")
        assert info, proc.stderr.read().decode()
        proc.send_signal(sig)
        proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert not [n for n in namespaces() if n.startswith(info["prefix"])]
    assert _gone(info["sleeper"])


def test_tcp_transfers_run_at_the_link_rate(no_leaks):
    """One way, both ways at once (full duplex) and two senders into one host (shared link)."""
    rate, nbytes = 50e6, 4_000_000
    one = 8 * nbytes / rate                    # 0.64 s
    with Network().up(3, rate="50mbit") as net:
        single = transfer(net, [("h1", "h2")], nbytes, timeout=30)["h2"]
        duplex = transfer(net, [("h1", "h2"), ("h2", "h1")], nbytes, timeout=30)
        fanin = transfer(net, [("h0", "h2"), ("h1", "h2")], nbytes, timeout=30)["h2"]
    assert single["bytes"] == nbytes and fanin["bytes"] == 2 * nbytes
    assert single["seconds"] == pytest.approx(one, rel=0.2)
    # two flows into one shared link: twice one transfer (an unshared link would take `one`); the
    # flows' losses at the shared queue cost some more, by how much depends on the machine's load
    assert 0.8 * 2 * one < fanin["seconds"] < 1.35 * 2 * one, fanin
    # half duplex would take twice as long; slow start behind the other direction's data costs a little
    assert all(r["seconds"] < 1.35 * one for r in duplex.values()), duplex


def test_plain_tcp_moves_a_ps_steps_bytes_no_faster_than_the_bound(no_leaks):
    """kvps.tools.emulate.raw_ps: every worker to every server and back, all at once (W=2 S=2, 2 MB
    at 50 Mbit/s: a bound of 0.32 s); never under the bound, and both directions no faster than one."""
    from kvps.tools.emulate import raw_ps
    both = list(raw_ps.run(2, 2, 2_000_000, "50mbit", tries=1, timeout=30, start_in=2))
    one_way = list(raw_ps.run(2, 2, 2_000_000, "50mbit", tries=1, one_way=True, timeout=30, start_in=2))
    (_, seconds, bound), (_, pushes, _) = both[0], one_way[0]
    assert bound == pytest.approx(0.32)
    assert 0.9 * bound < pushes < 3 * bound and 0.9 * bound < seconds < 3 * bound, (pushes, seconds)


def test_delay_between_hosts(no_leaks):
    ok, why = permitted(delay=True)
    if not ok:
        pytest.skip(f"delays cannot be emulated here: {why}")
    listen = "import socket, time; s = socket.create_server(('0.0.0.0', 0)); print(s.getsockname()[1], flush=True); " \
             "time.sleep(30)"
    connect = "import socket, sys, time; t = time.perf_counter(); " \
              "socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10).close(); " \
              "print(time.perf_counter() - t)"
    with Network().up(2, rate="1gbit", delay_ms=20) as net:
        server = net.popen("h1", [PY, "-c", listen], stdout=subprocess.PIPE)
        port = server.stdout.readline().decode().strip()
        rtt = float(subprocess.run(net.command("h0", [PY, "-c", connect, net.address("h1"), port]), check=True,
                                   capture_output=True, text=True, timeout=20).stdout)
    assert 0.036 < rtt < 0.2           # the handshake's round trip: 2 x 20 ms


WORKER = textwrap.dedent("""
    import json, os, sys, time, numpy as np, kvps
    n = int(sys.argv[1])
    kv = kvps.create("dist_sync")
    kv.init("g", np.zeros(n, np.float32))
    g, out = np.full(n, kv.rank + 1, np.float32), np.zeros(n, np.float32)
    kv.barrier()
    t = time.perf_counter()
    kv.pushpull("g", g, out=out)
    print(json.dumps({"rank": kv.rank, "host": os.environ["KVPS_HOST"], "value": float(out[-1]),
                      "seconds": time.perf_counter() - t}), flush=True)
    kv.close()
""")


class _Out:
    def __init__(self):
        self.parts = []

    def write(self, text):
        self.parts.append(text)

    def flush(self):
        pass

    def lines(self):
        return "".join(self.parts).splitlines()


def test_kvps_job_across_namespaces(no_leaks, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    nbytes, rate = 4_000_000, "200mbit"
    out = _Out()
    start = time.monotonic()
    codes = run_job(2, 1, [PY, str(script), str(nbytes // 4)], rate=rate, timeout=60, env=FAST_ENV, out=out)
    assert codes == [0, 0], "\n".join(out.lines())
    results = {r["rank"]: r for r in (json.loads(line.split("] ", 1)[1]) for line in out.lines()
                                      if line.startswith("[W") and "{" in line)}
    assert sorted(results) == [0, 1]
    assert {r["host"] for r in results.values()} == {"198.18.0.3", "198.18.0.4"}
    assert all(r["value"] == 3.0 for r in results.values())
    # the links are the limit: no faster than the bound (8 MB into the server's link at 200 Mbit/s)
    bound = theory(nbytes, parse_rate(rate), 2, 1).ps
    assert min(r["seconds"] for r in results.values()) > 0.9 * bound
    assert time.monotonic() - start < 30


def test_cli_returns_the_failing_workers_code(no_leaks, capfd):
    code = main(["-n", "2", "-s", "1", "--rate", "100mbit", "--env", "KVPS_HEARTBEAT_INTERVAL=0.2",
                 "--env", "KVPS_HEARTBEAT_TIMEOUT=3", "--timeout", "60", "--",
                 PY, "-c", "import kvps, sys; kv = kvps.create('dist_sync'); sys.exit(5 if kv.rank == 1 else 0)"])
    out = capfd.readouterr().out
    assert code == 5, out
    assert "worker W1 exited with code 5" in out


def test_job_deadline_stops_everything(no_leaks):
    out = _Out()
    with Network() as net:
        job = EmulatedJob(net, 1, 1, [PY, "-c", "import time; time.sleep(60)"], env=FAST_ENV, out=out)
        net.up(job.hosts, rate="100mbit")
        with pytest.raises(TimeoutError, match="W0 still running"):
            job.run(timeout=2)
        assert all(p.poll() is not None for p in job.procs.values())


# ---- `kvps emulate sync`: choosing, ordering and tabulating the systems, pure ----
from kvps.tools.emulate import sync as emsync          # noqa: E402  (kept beside the tests that use it)
from kvps.tools.emulate.baselines import EmulatedGlooJob, EmulatedMXNetJob   # noqa: E402

MXNET_PY = os.path.expanduser("~/mxvenv/bin/python")


def test_parse_systems():
    assert emsync.parse_systems("gloo, ps") == ["gloo", "ps"]
    for bad, why in (("ps,horovod", "unknown system 'horovod'"), (",", "no system")):
        with pytest.raises(ConfigError, match=why):
            emsync.parse_systems(bad)


@pytest.mark.parametrize("asked,mxnet,gloo_why,systems", [
    (None, None, None, ["ps", "ring", "gloo"]),
    (None, "/mx/python", None, ["ps", "mxnet", "ring", "gloo"]),
    (None, None, "no gloo here", ["ps", "ring"]),
    (["gloo", "ps"], None, None, ["ps", "gloo"]),            # SYSTEMS order, whatever the order asked
    (["ring"], None, "no gloo here", ["ring"]),
])
def test_choose_systems(asked, mxnet, gloo_why, systems):
    chosen, notes = emsync.choose_systems(asked, mxnet, gloo_why)
    assert chosen == systems
    assert bool(notes) == (asked is None and bool(gloo_why))


@pytest.mark.parametrize("asked,mxnet,gloo_why,match", [
    (["mxnet"], None, None, "needs --mxnet"),
    (["gloo"], None, "no gloo here", "no gloo here"),
])
def test_choose_systems_refuses(asked, mxnet, gloo_why, match):
    with pytest.raises(ConfigError, match=match):
        emsync.choose_systems(asked, mxnet, gloo_why)


def test_setups_put_each_baseline_before_its_kvps_system():
    combos, notes = emsync.shapes([2, 4], [1, 4], ["dedicated", "colocated"])
    assert (2, 4, True) not in combos and len(notes) == 1
    S = emsync.Setup
    todo = emsync.setups(["ps", "mxnet", "ring", "gloo"], [(4, 1, False), (4, 4, False), (2, 1, False)])
    assert todo == [S("mxnet", 2, 1, False), S("ps", 2, 1, False), S("gloo", 2, 0, False), S("ring", 2, 0, False),
                    S("mxnet", 4, 1, False), S("ps", 4, 1, False), S("mxnet", 4, 4, False), S("ps", 4, 4, False),
                    S("gloo", 4, 0, False), S("ring", 4, 0, False)]
    assert emsync.setups(["ring"], [(2, 1, False), (2, 2, False)]) == [S("ring", 2, 0, False)]


def test_replicated_ps_runs_right_after_the_ps_without_replicas():
    S = emsync.Setup
    combos = [(2, 1, False), (2, 2, False), (2, 2, True)]
    todo = emsync.setups(["ps", "mxnet", "ring"], combos, replicas=1)
    assert todo == [S("mxnet", 2, 1, False), S("ps", 2, 1, False),                 # one server: no chain
                    S("mxnet", 2, 2, False), S("ps", 2, 2, False), S("ps", 2, 2, False, 1),
                    S("mxnet", 2, 2, True), S("ps", 2, 2, True), S("ps", 2, 2, True, 1), S("ring", 2, 0, False)]
    assert emsync.check_replicas(1, ["ps"], combos) == ["(left out: kvps PS R=1 with 1 server: a chain needs 2)"]
    assert emsync.check_replicas(0, ["ring"], combos) == []
    for replicas, systems, match in ((1, ["ring", "gloo"], "must include ps"), (-1, ["ps"], "must not be negative"),
                                     (2, ["ps"], "needs more than 2 servers: give -s 3")):
        with pytest.raises(ConfigError, match=match):
            emsync.check_replicas(replicas, systems, combos)


def test_geo_rows_run_after_the_ps_they_are_divided_by():
    S = emsync.Setup
    todo = emsync.setups(["ps", "geo", "gloo"], [(2, 1, False)], k_steps=(1, 4))
    assert todo == [S("ps", 2, 1, False), S("geo", 2, 1, False, 0, 1), S("geo", 2, 1, False, 0, 4),
                    S("gloo", 2, 0, False)]
    assert [emsync.kvtype(s) for s in todo] == ["dist_sync", "dist_geo:1", "dist_geo:4", "allreduce"]
    assert emsync.baseline_of(S("geo", 2, 1, False, 0, 4)) == S("ps", 2, 1, False)
    assert emsync.label(S("geo", 2, 1, False, 0, 4)) == "kvps GEO K=4"
    emsync.check_k_steps((1, 4), ["geo"])
    for k_steps, systems, match in (((0, 4), ["geo"], "at least 1"), ((2,), ["ps"], "must include geo")):
        with pytest.raises(ConfigError, match=match):
            emsync.check_k_steps(k_steps, systems)


def test_geo_rows_take_the_ps_bound_over_k_and_show_the_servers_bytes():
    S = emsync.Setup
    ps, geo = S("ps", 2, 1, False), S("geo", 2, 1, False, 0, 4)
    results = {ps: {"rows": {"push+pull": {"ms": 1800}, "pushpull": {"ms": 1700, "server_bytes": 4 * M}},
                    "error": None},
               geo: {"rows": {"pushpull": {"ms": 450, "server_bytes": M}}, "error": None}}
    body = {line.split(" | ")[0][2:]: line.strip("| ").split(" | ")[1:] for line in emsync.table(results, M, B)[2:]}
    assert body["kvps GEO K=4 pushpull"] == ["2", "1", "dedicated", "450", "409", "1.10", "0.26"]   # 1636 / 4
    traffic = emsync.traffic_table(results)
    rows = {line.split(" | ")[0][2:]: line.strip("| ").split(" | ")[1:] for line in traffic[2:]}
    assert rows == {"kvps PS pushpull": ["2", "1", "dedicated", f"{4 * M / 1e6:.1f}", "1.000"],
                    "kvps GEO K=4 pushpull": ["2", "1", "dedicated", f"{M / 1e6:.1f}", "0.250"]}
    assert emsync.traffic_table({ps: results[ps]}) == []


def test_make_plan():
    plan, what, nbytes = emsync.make_plan("resnet50", 3)
    assert (len(plan["resnet"]["shapes"]), nbytes, plan["resnet"]["steps"]) == (161, M, 3)
    plan, what, nbytes = emsync.make_plan("4MB", 1)
    assert plan["resnet"]["shapes"] == [[1 << 20]] and nbytes == 4 << 20 and what == "one 4 MB array"
    assert plan["sweep"] == []
    for workload, steps in (("fast", 1), ("3B", 1), ("4MB", 0)):
        with pytest.raises(ConfigError):
            emsync.make_plan(workload, steps)


def test_table_rows_bounds_and_baselines():
    S = emsync.Setup

    def rows(**ms):
        return {"rows": {mode: {"ms": t} for mode, t in ms.items()}, "error": None}

    results = {S("mxnet", 4, 1, False): rows(**{"push+pull": 6000}),
               S("ps", 4, 1, False): rows(**{"push+pull": 4500, "pushpull": 3000}),
               S("gloo", 4, 0, False): {"rows": {}, "error": "boom"},
               S("ring", 4, 0, False): rows(pushpull=1300, **{"push+pull": 1400})}
    lines = emsync.table(results, M, B)
    assert lines[0].startswith("| setup | W | S | servers | measured ms | bound ms | measured/bound | / baseline |")
    body = {line.split(" | ")[0][2:]: line.strip("| ").split(" | ")[1:] for line in lines[2:]}
    assert body == {                                  # bounds: PS W=4 S=1 3271 ms, ring W=4 1227 ms
        "MXNet dist_sync push+pull": ["4", "1", "dedicated", "6000", "3271", "1.83", "-"],
        "kvps PS push+pull": ["4", "1", "dedicated", "4500", "3271", "1.38", "0.75"],
        "kvps PS pushpull": ["4", "1", "dedicated", "3000", "3271", "0.92", "0.50"],
        "gloo all-reduce": ["4", "-", "-", "failed", "1227", "-", "-"],
        "kvps ring pushpull": ["4", "-", "-", "1300", "1227", "1.06", "-"],      # gloo failed: no ratio
        "kvps ring push+pull": ["4", "-", "-", "1400", "1227", "1.14", "-"],
    }


def test_replicated_rows_are_divided_by_the_same_mode_without_replicas():
    S = emsync.Setup

    def rows(**ms):
        return {"rows": {mode: {"ms": t} for mode, t in ms.items()}, "error": None}

    results = {S("ps", 2, 2, False): rows(**{"push+pull": 1000, "pushpull": 800}),
               S("ps", 2, 2, False, 1): rows(**{"push+pull": 2500, "pushpull": 2400})}
    body = {line.split(" | ")[0][2:]: line.strip("| ").split(" | ")[1:] for line in emsync.table(results, M, B)[2:]}
    assert body == {                          # bounds: W=2 S=2 818 ms; with R=1 each server's link 1.5x (the sums)
        "kvps PS push+pull": ["2", "2", "dedicated", "1000", "818", "1.22", "-"],
        "kvps PS pushpull": ["2", "2", "dedicated", "800", "818", "0.98", "-"],
        "kvps PS R=1 push+pull": ["2", "2", "dedicated", "2500", "1227", "2.04", "2.50"],
        "kvps PS R=1 pushpull": ["2", "2", "dedicated", "2400", "1227", "1.96", "3.00"],
    }


def test_baseline_jobs_are_placed_as_kvps_jobs():
    gloo = EmulatedGlooJob(None, 3, "plan.json")
    assert gloo.places == placement(3, 0) == {"H": "h0", "W0": "h1", "W1": "h2", "W2": "h3"}
    mx = EmulatedMXNetJob(None, MXNET_PY, 4, 2, ["worker.py"], colocated=True, env={"PYTHONPATH": "x"})
    assert mx.places == placement(4, 2, colocated=True) and mx.workers == 4
    assert "VIRTUAL_ENV" not in mx.env and mx.env["PYTHONPATH"] == "x"     # only what the caller gives


def test_cli_sync_usage_errors_come_before_namespaces(monkeypatch, capsys):
    import kvps.tools.emulate.cli as cli
    monkeypatch.setattr(cli, "permitted", lambda delay=False: (False, "no namespaces in this test"))
    assert main(["sync", "--systems", "ps,horovod"]) == 2
    assert main(["sync", "--systems", "mxnet"]) == 2
    assert main(["sync", "--mxnet", "/no/such/python"]) == 2
    assert main(["sync", "--workload", "3B"]) == 2
    assert main(["sync", "--systems", "ring", "--replicas", "1"]) == 2
    assert main(["sync", "-s", "1", "--replicas", "1"]) == 2
    err = capsys.readouterr().err
    assert "unknown system 'horovod'" in err and "needs --mxnet" in err and "/no/such/python does not exist" in err
    assert "--systems must include ps" in err and "needs more than 1 servers: give -s 2" in err
    assert main(["sync", "--systems", "ps"]) == 77


# ---- `kvps emulate sync` end to end (namespaces) ----
def _sync_table(out, which=0):
    """{setup label: [W, S, servers, measured, bound, measured/bound, / baseline]} from the printed table
    (which=1: the second table, GEO's bytes per step)."""
    tables, current = [], None
    for line in out.splitlines():
        if line.startswith("|"):
            if current is None:
                current = []
                tables.append(current)
            if "---" not in line:
                current.append(line.strip("| ").split(" | "))
        else:
            current = None
    return {r[0]: r[1:] for r in tables[which][1:]}


def test_sync_compares_gloo_ring_and_ps(no_leaks, capfd):
    start = time.monotonic()
    code = main(["sync", "-n", "2", "-s", "1", "--workload", "4MB", "--steps", "1", "--rate", "200mbit",
                 "--timeout", "60"])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    table = _sync_table(out)
    assert set(table) == {"kvps PS push+pull", "kvps PS pushpull", "kvps ring pushpull", "kvps ring push+pull",
                          "gloo all-reduce"}, out
    for label, (W, S, servers, measured, bound, ratio, vs) in table.items():
        assert W == "2" and float(measured) > 0 and float(bound) > 0, out
        assert float(ratio) > 0.9, out                # the links are the limit: nothing beats the bound
    assert table["gloo all-reduce"][4] == table["kvps ring pushpull"][4] == "168"    # 4 MiB at 200 Mbit/s, W=2
    assert float(table["kvps ring pushpull"][6]) > 0 and table["kvps PS pushpull"][6] == "-"   # no MXNet here
    assert time.monotonic() - start < 60


def test_sync_runs_the_ps_with_replicas_beside_the_ps_without(no_leaks, capfd):
    """--replicas 1: the PS again with KVPS_REPLICAS=1, its bound 1.5 times (each server's link also
    carries the round sums along its chain), divided by the rows without replicas."""
    code = main(["sync", "-n", "2", "-s", "2", "--systems", "ps", "--replicas", "1", "--workload", "4MB",
                 "--steps", "1", "--rate", "200mbit", "--timeout", "60"])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    table = _sync_table(out)
    assert set(table) == {"kvps PS push+pull", "kvps PS pushpull", "kvps PS R=1 push+pull", "kvps PS R=1 pushpull"}, out
    assert table["kvps PS pushpull"][4] == "168" and table["kvps PS R=1 pushpull"][4] == "252", out
    for mode in ("push+pull", "pushpull"):
        row = table[f"kvps PS R=1 {mode}"]
        assert float(row[5]) > 0.9, out                # nothing beats the bound, copies included
        assert float(row[6]) == pytest.approx(float(row[3]) / float(table[f"kvps PS {mode}"][3]), abs=0.01), out


def test_sync_runs_geo_beside_the_ps_and_measures_its_bytes(no_leaks, capfd):
    """GEO-SGD with K = 4 moves a quarter of the PS's bytes per step, measured at the servers."""
    code = main(["sync", "-n", "2", "-s", "1", "--systems", "ps,geo", "--k-steps", "4", "--workload", "4MB",
                 "--steps", "1", "--rate", "200mbit", "--timeout", "90"])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    table = _sync_table(out)
    assert table["kvps GEO K=4 pushpull"][4] == "84", out           # the PS's 336 ms bound over K
    assert float(table["kvps GEO K=4 pushpull"][3]) < float(table["kvps PS pushpull"][3]), out
    traffic = _sync_table(out, which=1)
    assert float(traffic["kvps PS pushpull"][3]) == pytest.approx(4 * 4 * 2 ** 20 / 1e6, rel=0.01), out
    assert float(traffic["kvps GEO K=4 pushpull"][4]) == pytest.approx(0.25, abs=0.01), out


@pytest.mark.skipif(not os.path.exists(MXNET_PY), reason=f"no MXNet at {MXNET_PY}")
def test_sync_runs_mxnet_beside_kvps_ps(no_leaks, capfd):
    code = main(["sync", "-n", "2", "-s", "1", "--workload", "4MB", "--steps", "1", "--rate", "200mbit",
                 "--timeout", "60", "--systems", "ps,mxnet", "--mxnet", MXNET_PY])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    table = _sync_table(out)
    assert set(table) == {"MXNet dist_sync push+pull", "kvps PS push+pull", "kvps PS pushpull"}, out
    mx = table["MXNet dist_sync push+pull"]
    assert mx[:3] == ["2", "1", "dedicated"] and float(mx[3]) > 0 and float(mx[5]) > 0.9, out
    assert float(table["kvps PS pushpull"][6]) > 0, out       # divided by MXNet's, measured in the same run


def test_sync_reports_a_job_past_its_deadline_and_removes_it(no_leaks, capfd):
    code = main(["sync", "-n", "2", "--systems", "gloo", "--workload", "4MB", "--steps", "1", "--timeout", "1"])
    out, err = capfd.readouterr()
    assert code == 124, out + err
    assert _sync_table(out)["gloo all-reduce"][3] == "failed", out
    assert "gloo all-reduce W=2 failed: workers" in err and "still running after 1 s" in err, err
