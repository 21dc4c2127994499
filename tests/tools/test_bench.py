"""`kvps bench pushpull` end to end on a tiny workload (no MXNet), plus its pure workload helpers.

The benchmark measures speed; these tests check only that it runs, reports numbers, and fails
fast and loudly (never hangs) when a job passes its deadline.
"""
import json
import math
import sys
import time

import pytest

from harness import run_command

from kvps.tools.bench import workloads

BENCH = [sys.executable, "-m", "kvps.cli", "bench", "pushpull"]


def run_bench(args, cwd, timeout=60):
    return run_command(BENCH + args, cwd, timeout)


def table_rows(stdout):
    """{(workload, call): kvps ms} from the results table."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[1] in ("push+pull", "list", "pushpull", "pushpull-each", "pushpull-each-async"):
            rows[(cells[0], cells[1])] = float(cells[2])
    return rows


def test_resnet50_shapes():
    shapes = workloads.resnet50_shapes()
    assert len(shapes) == 161
    assert sum(math.prod(s) for s in shapes) == 25_557_032


@pytest.mark.parametrize("text, nbytes", [("1KB", 1024), ("64k", 65536), ("4MB", 4 << 20), ("16MiB", 16 << 20),
                                          ("4096", 4096)])
def test_parse_size(text, nbytes):
    assert workloads.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["1.5B", "0", "3", "lots"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match=repr(text)):
        workloads.parse_size(text)


def test_the_shared_memory_target_is_judged_only_with_shared_memory_on(monkeypatch):
    from types import SimpleNamespace
    from kvps.tools.bench import pushpull
    rows = [{"workload": "resnet50", "bytes": 1, "mode": "pushpull", "ratio": 0.3}]
    args = SimpleNamespace(workers=2, servers=1, kvtype="dist_sync", resnet_steps=5, repeat=1)
    for shm, met in (("1", False), ("0", None)):
        monkeypatch.setenv("KVPS_SHM", shm)
        judged = {t["limit"]: t for t in pushpull.judge(rows, args) if t["mode"] == "pushpull"}
        assert judged[0.5]["met"] is True and judged[0.25]["met"] is met, judged
    assert "n/a: set for shared memory (KVPS_SHM=0 here)" in pushpull.report([], list(judged.values()), args, True)


def test_quick_run_prints_a_table_with_numbers(tmp_path):
    out = tmp_path / "results.json"
    done = run_bench(["--quick", "--sizes", "1KB,4KB", "--resnet-steps", "1", "--timeout", "45",
                      "--json", str(out)], tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    rows = table_rows(done.stdout)
    assert set(rows) == {(w, c) for w in ("1 KB round", "4 KB round", "ResNet-50 step (161 tensors, 25.6M floats)")
                         for c in ("push+pull", "list", "pushpull")}, done.stdout
    assert all(ms > 0 for ms in rows.values()), done.stdout
    saved = json.loads(out.read_text())
    assert len(saved["kvps"]) == 9 and saved["mxnet"] == []
    assert all(t["met"] is None for t in saved["targets"])       # no baseline, nothing judged


def test_pattern_picks_the_call_patterns(tmp_path):
    done = run_bench(["--quick", "--sizes", "1KB", "--resnet-steps", "0", "--pattern", "mxnet,pushpull"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert set(table_rows(done.stdout)) == {("1 KB round", "push+pull"), ("1 KB round", "pushpull")}, done.stdout
    bad = run_bench(["--pattern", "mxnet,fast"], tmp_path)
    assert bad.returncode == 2 and "choose from mxnet, list, pushpull" in bad.stderr, bad.stderr


def test_small_keys_and_gluons_per_key_pushpulls(tmp_path):
    done = run_bench(["--quick", "--sizes", "1KB", "--resnet-steps", "0", "--small-keys", "20",
                      "--pattern", "gluon,gluon-async"], tmp_path)
    assert done.returncode == 0, done.stderr
    rows = table_rows(done.stdout)
    assert set(rows) == {(w, c) for w in ("1 KB round", "20 keys of 64 floats")
                         for c in ("pushpull-each", "pushpull-each-async")}, done.stdout
    assert all(ms > 0 for ms in rows.values()), done.stdout
    assert "PerformanceWarning" not in done.stderr        # timed on purpose: the worker does not warn


def test_per_key_pushpulls_are_compared_with_mxnets_per_key_pushpulls():
    from kvps.tools.bench import pushpull
    assert workloads.mxnet_modes(["push+pull", "pushpull"]) == ("push+pull",)
    assert workloads.mxnet_modes(["pushpull-each-async", "pushpull-each"]) == ("push+pull", "pushpull-each")
    row = lambda mode, ms: {"workload": "keys", "bytes": 256, "mode": mode, "ms": ms, "tensors": 1}
    mxnet = [row("push+pull", 10.0), row("pushpull-each", 20.0)]
    rows = {r["mode"]: r["ratio"] for r in pushpull.compare(
        [row("push+pull", 5.0), row("pushpull", 4.0), row("pushpull-each", 40.0), row("pushpull-each-async", 10.0)],
        mxnet)}
    assert rows == {"push+pull": 0.5, "pushpull": 0.4, "pushpull-each": 2.0, "pushpull-each-async": 0.5}


def test_a_job_past_its_deadline_fails_fast_with_its_log(tmp_path):
    start = time.monotonic()
    done = run_bench(["--quick", "--sizes", "64MB", "--resnet-steps", "3", "--timeout", "1"], tmp_path)
    assert done.returncode == 1, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "the kvps job did not" in done.stderr, done.stderr
    assert time.monotonic() - start < 30


def test_priority_bench_runs_both_settings_and_reports_ratios(tmp_path):
    done = run_command([sys.executable, "-m", "kvps.cli", "bench", "priority", "--repeat", "1", "--steps", "1",
                        "--timeout", "60"], tmp_path, 150)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    figures = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in ("first layer's weights back", "whole step"):
            figures[cells[0]] = [float(c) for c in cells[1:]]
    assert set(figures) == {"first layer's weights back", "whole step"}, done.stdout
    for on, off, ratio in figures.values():
        assert on > 0 and off > 0 and abs(ratio - on / off) < 0.01, done.stdout
    bad = run_command([sys.executable, "-m", "kvps.cli", "bench", "priority", "--steps", "0"], tmp_path, 30)
    assert bad.returncode == 2 and "at least 1" in bad.stderr, bad.stderr
