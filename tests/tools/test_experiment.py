"""`kvps experiment`: pure units (presets, metrics, findings, report text) and the tiny preset end to
end on real processes, checking that every number the report quotes comes from results.json."""
import json
import math
import os
import subprocess
import time

import numpy as np
import pytest

from harness import FAST_ENV, PY, run_command
from kvps.tools.experiment import findings, intervals, logbook, metrics, presets, report, runner
from kvps.tools.experiment.cli import parse_targets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- pure units ----
def test_parse_every():
    assert logbook.parse_every("0.5s") == ("seconds", 0.5)
    assert logbook.parse_every("50") == ("steps", 50)
    for bad in ("fast", "0", "-1s", "1.5"):
        with pytest.raises(ValueError, match="eval-every"):
            logbook.parse_every(bad)


def test_server_summary_sums_servers_and_tolerates_missing_fields():
    stats = {"S0": {"pushes": 10, "updates": 4, "staleness": [3, 1], "dropped": 2, "joins": 2, "mode": "sync"},
             "S1": {"pushes": 6, "updates": 2, "staleness": [1, 0, 5], "joins": 1},
             "S2": {}}
    s = logbook.server_summary(stats)
    assert s["pushes"] == 16 and s["updates"] == 6 and s["dropped"] == 2 and s["rounds"] == 0
    assert s["staleness"] == [4, 1, 5] and s["joins"] == 0 and s["mode"] == "sync" and s["servers"] == 3


def test_kvstore_types_and_plan_order():
    assert [presets.kvstore_type(m) for m in ("sync", "async", "ssp:4", "ssp:inf", "backup:1", "allreduce")] == \
        ["dist_sync", "dist_async", "dist_ssp:4", "dist_ssp:inf", "dist_sync:backup=1", "allreduce"]
    for bad in ("ssp", "ssp:-1", "backup", "ring", "sync:2"):
        with pytest.raises(ValueError, match="is not one of"):
            presets.kvstore_type(bad)
    with pytest.raises(ValueError, match="needs more than 2 workers"):
        presets.plan(presets.PRESETS["quick"], modes=["backup:2"], workers=[2])
    specs = presets.plan(presets.PRESETS["quick"], modes=["async", "sync", "allreduce"], workloads=["digits"])
    assert [(s.mode, s.straggler) for s in specs] == [
        ("sync", False), ("async", False), ("allreduce", False), ("sync", True), ("async", True), ("allreduce", True)]
    assert [s.servers for s in specs[:3]] == [1, 1, 0]
    tiny = presets.plan(presets.PRESETS["tiny"])
    assert {s.mode for s in tiny} == set(presets.QUICK_MODES)
    assert sorted(s.mode for s in tiny if s.straggler) == ["async", "sync"]
    assert presets.plan(presets.PRESETS["tiny"], steps=7)[0].args[:2] == ("--steps", "7")
    # the straggler alone: a sync run without it comes first, to measure the step time
    only = presets.plan(presets.PRESETS["quick"], modes=["ssp:4"], workloads=["digits"], stragglers=(True,))
    assert [(s.mode, s.straggler) for s in only] == [("sync", False), ("ssp:4", True)]
    assert len(presets.plan(presets.PRESETS["quick"], modes=["ssp:4"], workloads=["digits", "sparse"], stragglers=(True,),
                            calibrate=False)) == 2


def test_parse_targets():
    assert parse_targets("0.9", ["digits", "sparse"]) == {"digits": 0.9, "sparse": 0.9}
    assert parse_targets("sparse=0.7", ["digits", "sparse"]) == {"sparse": 0.7}
    for bad in ("digits=high", "mnist=0.9", "1.5"):
        with pytest.raises(ValueError, match="--target"):
            parse_targets(bad, ["digits", "sparse"])


def test_parse_line():
    assert runner.parse_line('[W2] {"event": "final", "rank": 2}') == (2, {"event": "final", "rank": 2})
    for line in ('[S0] {"event": "x"}', "[W0] READY", '[W0] {"no": "event"}', "[W0] {broken", "plain"):
        assert runner.parse_line(line) is None


def _points(times_acc, per_s=1000):
    return [{"time": t, "updates": int(t * per_s), "step": int(t * per_s / 3), "loss": 1 - a, "accuracy": a}
            for t, a in times_acc]


def _run(mode, straggler, points, staleness=None, dropped=0, status="ok", step_ms=2.0):
    server = None if mode == "allreduce" else {"pushes": 1000, "dropped": dropped, "staleness": staleness or [1000]}
    return {"id": f"digits/W3/{mode}/{'straggler' if straggler else 'none'}", "workload": "digits", "mode": mode,
            "workers": 3, "status": status, "error": None if status == "ok" else "kvps launch exited with code 1",
            "straggler": {"rank": 2, "delay_s": 0.002, "kind": "fixed", "spec": "fixed:0.002"} if straggler else None,
            "points": points, "finals": [{"rank": 0, "steps": 300, "step_ms": step_ms}], "server": server,
            "tail": [] if status == "ok" else ["boom"], "command": "kvps launch ..."}


def synthetic_runs():
    return [
        _run("sync", False, _points([(0.5, 0.90), (1.0, 0.96), (1.5, 0.97)])),
        _run("async", False, _points([(0.5, 0.93), (0.8, 0.95), (1.5, 0.96)], per_s=2000), staleness=[500, 300, 200]),
        _run("allreduce", False, _points([(0.5, 0.80), (1.5, 0.90)])),
        _run("sync", True, _points([(1.0, 0.90), (2.0, 0.95)], per_s=500), step_ms=4.0),
        _run("async", True, _points([(0.5, 0.92), (0.9, 0.955)], per_s=1800), staleness=[100, 100, 0, 0, 100]),
        _run("backup:1", True, _points([(0.6, 0.95)]), dropped=250, staleness=[750]),
        _run("ssp:4", True, [], status="failed"),
    ]


def test_metrics_time_to_target_and_staleness():
    row = metrics.summarize(synthetic_runs()[1], 0.95)
    assert row["time_to_target"] == 0.8 and row["updates_to_target"] == 1600
    assert row["updates_per_s"] == pytest.approx(2000) and row["final_accuracy"] == 0.96
    assert row["mean_staleness"] == pytest.approx(0.7) and row["max_staleness"] == 2
    never = metrics.summarize(synthetic_runs()[2], 0.95)
    assert never["time_to_target"] is None and metrics.show("time_to_target", None) == "not reached"
    assert never["mean_staleness"] is None and metrics.show("mean_staleness", None) == "n/a"
    assert metrics.summarize(synthetic_runs()[5], 0.95)["dropped_share"] == 0.25


def test_findings_on_synthetic_results():
    texts = [f["text"] for f in findings.findings(synthetic_runs(), {"digits": 0.95})]
    joined = "\n".join(texts)
    assert ("digits, W=3, no straggler: time to 95% test accuracy (one run each, so no intervals; a repeat can "
            "order close modes differently), fastest first: async 0.80 s; then sync 1.00 s; not reached in most "
            "runs: allreduce (final accuracy 0.900).") in texts
    assert "fastest first: backup:1 0.60 s; then async 0.90 s; then sync 2.00 s." in joined
    assert "a sync step without it took 2.00 ms" in joined
    assert "async 0.90x and sync 0.50x" in joined           # throughput kept under the straggler, most first
    assert "async with the straggler 1.67 (max 4), async 0.70 (max 2)" in joined
    assert "backup:1 with the straggler 250 (25.0% of its pushes)" in joined
    assert "1 of 7 runs did not finish: digits/W3/ssp:4/straggler (failed" in joined
    # the failed run's mode is quoted nowhere else
    assert not [t for t in texts if "ssp:4" in t and "did not finish" not in t]


def test_findings_when_nothing_reaches_the_target():
    runs = [_run("sync", False, _points([(1.0, 0.80)])), _run("async", False, _points([(1.0, 0.85)]))]
    texts = [f["text"] for f in findings.findings(runs, {"digits": 0.95})]
    assert "digits, W=3, no straggler: no mode reached 95% test accuracy in most of its runs; the best final " \
           "accuracy was async's 0.850." in texts


# ---- intervals on known distributions ----
def test_interval_of_the_median_covers_the_true_median():
    rng = np.random.default_rng(1)
    for draw, true_median in ((lambda n: rng.normal(10.0, 2.0, n), 10.0),
                              (lambda n: rng.exponential(1.0, n), np.log(2.0)),
                              (lambda n: rng.lognormal(0.0, 1.0, n), 1.0)):
        hits = 0
        for trial in range(100):
            iv = intervals.interval(draw(41), resamples=400, seed=trial)
            assert iv.low <= iv.median <= iv.high and iv.n == 41
            hits += iv.low <= true_median <= iv.high
        assert 85 <= hits <= 100, (true_median, hits)        # nominal 95; a percentile bootstrap runs a bit low


def test_interval_narrows_with_more_runs_and_is_the_range_for_three():
    rng = np.random.default_rng(2)
    widths = [np.mean([(lambda iv: iv.high - iv.low)(intervals.interval(rng.normal(0, 1, n), resamples=500))
                       for _ in range(20)]) for n in (16, 64, 256)]
    assert widths[0] > 1.6 * widths[1] > 1.6 * 1.6 * widths[2] * 0.9     # about 1/sqrt(n): halves per 4x
    assert intervals.interval([3.0, 1.0, 2.0]) == intervals.Interval(2.0, 1.0, 3.0, 3)
    assert intervals.interval([5.0]) == intervals.Interval(5.0, 5.0, 5.0, 1)
    assert intervals.interval([4.0, 4.0, 4.0]).high == 4.0


def test_interval_treats_not_reached_as_slowest():
    iv = intervals.interval([1.0, None, None])
    assert math.isinf(iv.median) and iv.low == 1.0 and math.isinf(iv.high)
    iv = intervals.interval([1.0, 1.2, None])
    assert iv.median == 1.2 and math.isinf(iv.high)
    assert intervals.as_dict(iv)["high"] is None and intervals.from_dict(intervals.as_dict(iv)) == iv
    assert metrics.show("time_to_target", math.inf) == "not reached"
    with pytest.raises(ValueError, match="no values"):
        intervals.interval([])
    with pytest.raises(ValueError, match="level"):
        intervals.interval([1.0], level=1.5)


def test_overlap():
    a, b, c = (intervals.Interval(m, lo, hi, 3) for m, lo, hi in ((1, 0.8, 1.2), (1.1, 1.0, 1.5), (2, 1.6, 2.4)))
    assert intervals.overlap(a, b) and intervals.overlap(b, a) and not intervals.overlap(a, c)


def _repeated(mode, per_s_list, reach_times, straggler=False):
    runs = []
    for k, (per_s, t) in enumerate(zip(per_s_list, reach_times)):
        pts = _points([(t / 2, 0.9), (t, 0.96), (t + 0.5, 0.97)], per_s=per_s)
        run = _run(mode, straggler, pts)
        run["cell"], run["id"] = run["id"], f"{run['id']}/r{k}"
        runs.append(run)
    return runs


def test_cells_and_no_clear_difference_when_intervals_overlap():
    runs = (_repeated("sync", [1000, 1100, 900], [1.0, 1.1, 0.9]) + _repeated("async", [1050, 1150, 950], [0.95, 1.2, 1.05])
            + _repeated("allreduce", [3000, 3100, 2900], [3.0, 3.2, 3.1]))
    rows = {r["mode"]: r for r in metrics.cells(runs, {"digits": 0.95})}
    assert rows["sync"]["ok"] == 3 and rows["sync"]["time_to_target"] == {"median": 1.0, "low": 0.9, "high": 1.1, "n": 3}
    assert metrics.show_interval("time_to_target", rows["sync"]["time_to_target"]) == "1.00 s (0.90 s to 1.10 s)"
    texts = [f["text"] for f in findings.findings(runs, {"digits": 0.95})]
    race = next(t for t in texts if "time to 95%" in t)
    assert "median of 3 runs" in race
    assert ("fastest first: sync 1.00 s (0.90 s to 1.10 s) and async 1.05 s (0.95 s to 1.20 s), no clear difference "
            "between them; then allreduce 3.10 s (3.00 s to 3.20 s).") in race
    rate = next(t for t in texts if "per second" in t)
    assert rate.endswith("most first: allreduce 3,000 (2,900 to 3,100); then async 1,050 (950 to 1,150) and "
                         "sync 1,000 (900 to 1,100), no clear difference between them.")
    # all overlapping: no ranking at all
    close = _repeated("sync", [1000] * 3, [1.0, 1.1, 0.9]) + _repeated("async", [1000] * 3, [1.05, 0.95, 1.15])
    race = next(t for t in (f["text"] for f in findings.findings(close, {"digits": 0.95})) if "time to" in t)
    assert "no clear difference (the 95% intervals overlap) between" in race and "then" not in race


def test_network_effect_puts_emulated_beside_local():
    local = _repeated("sync", [1000] * 2, [1.0, 1.1])
    emul = _repeated("sync", [250] * 2, [2.0, 2.2])
    for r in emul:
        r["net"], r["cell"], r["id"] = "100mbit", r["cell"] + "/100mbit", r["id"] + "/100mbit"
    texts = [f["text"] for f in findings.findings(local + emul, {"digits": 0.95})]
    effect = next(t for t in texts if "against this machine's loopback" in t)
    assert "sync 250 / 1,000 (0.25x)" in effect
    assert any(t.startswith("digits, W=3, emulated hosts at 100mbit, no straggler:") for t in texts)


def test_report_markdown_lists_every_run_and_failure():
    runs = synthetic_runs()
    results = {"preset": "tiny", "started": "now", "machine": "m", "command": "kvps experiment", "wall_s": 1.0,
               "targets": {"digits": 0.95}, "workloads": {"digits": "d"}, "modes": {"sync": "dist_sync"},
               "workers": [3], "servers": 1, "runs": runs,
               "stragglers": [{"workload": "digits", "workers": 3, "rank": 2, "delay_s": 0.002, "kind": "fixed",
                               "source": "measured"}],
               "findings": findings.findings(runs, {"digits": 0.95})}
    text = report.markdown(results)
    assert "| async | no | loopback | 1/1 | 0.80 s | 1,600 | 0.960 |" in text
    assert "| allreduce | no | loopback | 1/1 | not reached | not reached | 0.900 |" in text
    assert "| ssp:4 | yes | loopback | 0/1 | - |" in text
    assert "| digits/W3/async/none | - | ok | 0.80 s | 1,600 | 0.960 |" in text
    assert "## Runs that failed" in text and "boom" in text
    assert "W2 +2.00 ms per step" in text


def test_emulated_plan_and_command():
    specs = presets.plan(presets.PRESETS["quick"], workloads=["wide"], modes=["sync", "allreduce"])
    specs = presets.emulated(specs, ["100mbit"])
    emulated = [s for s in specs if s.net != "local"]
    assert [(s.mode, s.straggler) for s in emulated] == [("sync", False), ("allreduce", False)]
    assert emulated[0].id == "wide/W3/sync/none/100mbit"
    argv = runner.command(emulated[1], timeout=100)
    assert argv[2:12] == ["kvps.cli", "emulate", "-n", "3", "-s", "0", "--rate", "100mbit", "--timeout", "90"]
    with pytest.raises(ValueError, match="cannot have a straggler"):
        runner.command(emulated[0], straggler={"rank": 2, "spec": "fixed:0.1"})
    assert presets.with_seed(("--steps", "5"), 3) == ("--steps", "5", "--seed", "3")
    assert presets.with_seed(("--seed", "1"), 3) == ("--seed", "3")


# ---- end to end, real processes ----
def _experiment(tmp_path, *args, timeout=240):
    env = dict(os.environ, **FAST_ENV)
    start = time.monotonic()
    proc = subprocess.run([PY, "-m", "kvps.cli", "experiment", "--tiny", "--out", str(tmp_path), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def _value(run, metric, target):
    """A metric recomputed from a run's raw numbers, independently of kvps.tools.experiment.metrics."""
    points, server = run["points"], run["server"] or {}
    hist = server.get("staleness") or []
    if metric in ("time_to_target", "updates_to_target"):
        axis = "time" if metric == "time_to_target" else "updates"
        return next((p[axis] for p in points if p["accuracy"] >= target), None)
    if metric == "final_accuracy":
        return points[-1]["accuracy"]
    if metric == "updates_per_s":
        return points[-1]["updates"] / points[-1]["time"]
    if metric == "mean_staleness":
        return sum(i * n for i, n in enumerate(hist)) / sum(hist)
    if metric == "max_staleness":
        return max(i for i, n in enumerate(hist) if n)
    if metric == "step_ms":
        return next(f["step_ms"] for f in run["finals"] if f["rank"] == 0)
    if metric == "delay_ms":
        return run["straggler"]["delay_s"] * 1e3
    if metric in ("dropped", "dropped_share"):
        return server["dropped"] if metric == "dropped" else server["dropped"] / server["pushes"]
    raise AssertionError(f"the test does not know metric {metric!r}")


def _check_facts(results, text):
    """Every number a finding quotes is recomputed from the raw runs and found in the report."""
    assert results["findings"]
    by_cell = {}
    for run in results["runs"]:
        by_cell.setdefault(run["cell"], []).append(run)
    runs = {r["id"]: r for r in results["runs"]}

    def cell_interval(cell, metric):
        ok = [r for r in by_cell[cell] if r["status"] == "ok"]
        target = results["targets"][ok[0]["workload"]]
        return intervals.interval([_value(r, metric, target) for r in ok])

    for f in results["findings"]:
        assert f"* {f['text']}" in text
        for fact in f["facts"]:
            if fact["metric"] == "ratio":
                a, b = (cell_interval(c, fact["of"]).median for c in fact["cells"])
                assert metrics.show("ratio", a / b) == fact["shown"], fact
            elif fact["metric"] == "delay_ms":
                assert metrics.show("delay_ms", _value(runs[fact["run"]], "delay_ms", None)) == fact["shown"]
            else:
                iv = cell_interval(fact["cell"], fact["metric"])
                assert metrics.show_interval(fact["metric"], intervals.as_dict(iv)) == fact["shown"], fact
                assert iv.n == fact["n"]
            assert fact["shown"] in f["text"]


def test_tiny_preset_end_to_end(tmp_path):
    proc, elapsed = _experiment(tmp_path)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    text = (tmp_path / "report.md").read_text()
    runs = {r["id"]: r for r in results["runs"]}
    assert {r["mode"] for r in runs.values()} == set(presets.QUICK_MODES)
    assert all(r["status"] == "ok" and r["points"] for r in runs.values()), [r["error"] for r in runs.values()]
    for png in ("digits-W2-none.png", "digits-W2-straggler.png", "digits-W2-staleness.png"):
        assert (tmp_path / png).stat().st_size > 1000 and f"]({png})" in text
    straggler = results["stragglers"][0]
    assert straggler["delay_s"] > 0 and "the sync step time measured" in straggler["source"]
    _check_facts(results, text)
    # and the every-run table's time to target and throughput, row by row
    for run in runs.values():
        target = results["targets"][run["workload"]]
        row = (f"| {run['id']} | {run['seed']} | ok | "
               f"{metrics.show('time_to_target', _value(run, 'time_to_target', target))} | ")
        assert row in text, row
        assert metrics.show("updates_per_s", _value(run, "updates_per_s", target)) in text
    print(f"tiny preset: {len(runs)} runs in {elapsed:.0f} s")


def test_geo_and_compressed_pull_end_to_end(tmp_path):
    """GEO-SGD and compressed pull really train, land in the report, and count honestly."""
    proc, elapsed = _experiment(tmp_path, "--modes", "sync,geo:4,sync+fp16+pull", "--straggler", "off")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    text = (tmp_path / "report.md").read_text()
    runs = {r["mode"]: r for r in results["runs"]}
    assert list(runs) == ["sync", "geo:4", "sync+fp16+pull"]
    assert all(r["status"] == "ok" for r in runs.values()), [r["error"] for r in runs.values()]
    geo, packed = runs["geo:4"], runs["sync+fp16+pull"]
    assert "--kvstore dist_geo:4 --steps" in geo["command"] and geo["server"]["mode"] == "geo:4"
    assert """--kvstore dist_sync --compression '{"type":"fp16","pull":true}' --steps""" in packed["command"]
    for run in (geo, packed):              # it trained: accuracy rose well above chance (10 classes)
        assert run["points"][-1]["accuracy"] > max(0.5, run["points"][0]["accuracy"])
    # GEO: a worker stops right after a sync, points fall on syncs, and the last point counts
    # every local step of every worker (K x the pushes per key)
    steps = [f["steps"] for f in geo["finals"]]
    assert all(n % 4 == 0 for n in steps) and all(p["step"] % 4 == 0 for p in geo["points"])
    keys = 4                               # the MLP's two weight matrices and two bias vectors
    assert geo["points"][-1]["updates"] == sum(steps) == 4 * (geo["server"]["pushes"] // keys)
    assert "| geo:4 | no | loopback | 1/1 |" in text and "| sync+fp16+pull | no | loopback | 1/1 |" in text
    assert any("gradient compression against the same mode without it" in f["text"] for f in results["findings"])
    assert any("under geo:4 a gradient is one worker's local step" in f["text"] for f in results["findings"])
    for png in ("digits-W2-none-geo.png", "digits-W2-none-compression.png"):
        assert (tmp_path / png).stat().st_size > 1000 and f"]({png})" in text
    _check_facts(results, text)
    print(f"geo and compressed pull: {len(runs)} runs in {elapsed:.0f} s")


def test_sparse_workload_repeated_end_to_end(tmp_path):
    proc, _ = _experiment(tmp_path, "--workloads", "sparse", "--modes", "ssp:2,allreduce", "--straggler", "off",
                          "--repeats", "2", "--seed", "5")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    text = (tmp_path / "report.md").read_text()
    assert [(r["mode"], r["seed"]) for r in results["runs"]] == [("ssp:2", 5), ("allreduce", 5), ("ssp:2", 6),
                                                                 ("allreduce", 6)]
    assert [r["id"] for r in results["runs"]][:2] == ["sparse/W2/ssp:2/none/r0", "sparse/W2/allreduce/none/r0"]
    assert all("--seed 6" in r["command"] for r in results["runs"][2:])
    for run in results["runs"]:
        assert run["status"] == "ok" and len(run["finals"]) == 2
        assert all(0 <= p["auc"] <= 1 and p["loss"] > 0 for p in run["points"])
    assert [(c["id"], c["ok"], c["updates_per_s"]["n"]) for c in results["cells"]] == [
        ("sparse/W2/ssp:2/none", 2, 2), ("sparse/W2/allreduce/none", 2, 2)]
    assert "median of 2 runs" in text
    _check_facts(results, text)
    for png in ("sparse-W2-none.png", "sparse-W2-intervals.png"):
        assert (tmp_path / png).stat().st_size > 1000 and f"]({png})" in text


def test_emulated_cell_end_to_end(tmp_path):
    from kvps.tools.emulate import permitted
    ok, why = permitted()
    if not ok:
        pytest.skip(f"network namespaces: {why}")
    proc, _ = _experiment(tmp_path, "--workloads", "wide", "--modes", "sync", "--straggler", "off",
                          "--emulate", "100mbit")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    text = (tmp_path / "report.md").read_text()
    assert [(r["id"], r["status"]) for r in results["runs"]] == [("wide/W2/sync/none", "ok"),
                                                                 ("wide/W2/sync/none/100mbit", "ok")]
    local, emulated = results["runs"]
    assert "kvps.cli emulate -n 2 -s 1 --rate 100mbit" in emulated["command"]
    assert "| sync | no | emulated 100mbit | 1/1 |" in text and "| sync | no | loopback | 1/1 |" in text
    assert any("against this machine's loopback" in f["text"] for f in results["findings"])
    # both workers' 104,488-byte pushes go through the server's 100 Mbit/s link: 16.7 ms a step at least
    bound_ms = 8 * 2 * 104_488 / 100e6 * 1e3
    assert emulated["finals"][0]["step_ms"] > max(0.9 * bound_ms, local["finals"][0]["step_ms"])
    _check_facts(results, text)


def test_a_failed_run_is_reported_and_the_exit_code_says_so(tmp_path):
    proc, _ = _experiment(tmp_path, "--workloads", "sparse", "--modes", "allreduce", "--straggler", "off",
                          "--steps", "0")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "FAILED: rank 0 printed no evaluation point" in proc.stdout
    text = (tmp_path / "report.md").read_text()
    assert "## Runs that failed" in text and "sparse/W2/allreduce/none: failed" in text
    assert json.loads((tmp_path / "results.json").read_text())["runs"][0]["tail"]


def test_a_run_past_its_deadline_is_stopped(tmp_path):
    spec = presets.plan(presets.PRESETS["tiny"], modes=["sync"], stragglers=(False,))[0]
    start = time.monotonic()
    result = runner.run(spec, timeout=1.0, say=lambda text: None, env=FAST_ENV)
    assert result["status"] == "timeout" and "1 s deadline" in result["error"]
    assert time.monotonic() - start < 1.0 + runner.STOP_GRACE + 5
    assert result["exit_code"] is not None          # the launcher has exited: it stopped its children


def test_usage_errors_exit_2(tmp_path):
    proc = run_command([PY, "-m", "kvps.cli", "experiment", "--modes", "ssp:x", "--out", str(tmp_path)], ROOT, 60)
    assert proc.returncode == 2 and "mode 'ssp:x' is not one of" in proc.stderr
    assert not (tmp_path / "report.md").exists()
