"""`kvps bench compare` end to end on its --quick workload (no MXNet), plus its pure helpers.

The benchmark measures speed; these tests check only that it runs every setup, reports numbers
in its table, its JSON and its PNG, and fails fast and loudly (never hangs) past a deadline.
"""
import json
import sys
import time

import pytest

from harness import run_command

from kvps.tools.bench import compare

BENCH = [sys.executable, "-m", "kvps.cli", "bench", "compare"]
QUICK_SETUPS = ("PS sync S=1", "PS async S=1", "kvps ring", "gloo all-reduce")


def _torch_parts():
    """(kvps.torch usable, gloo usable): the rows that need them say 'n/a' / 'not available' otherwise."""
    try:
        import kvps.torch as kt
        kvps_torch = hasattr(kt, "DistributedOptimizer")
    except ImportError:
        kvps_torch = False
    try:
        import torch.distributed as dist
        gloo = dist.is_available() and dist.is_gloo_available()
    except ImportError:
        gloo = False
    return kvps_torch, gloo


def run_bench(args, cwd, timeout=90):
    return run_command(BENCH + args, cwd, timeout)


def table_rows(stdout):
    """{setup: [cells after W and setup]} from the results table."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].isdigit():
            rows[cells[1]] = cells[2:]
    return rows


def number(cell):
    """The median from a cell such as '3.27 [2.48-4.06]'."""
    return float(cell.split()[0])


def test_quick_run_reports_every_setup_with_numbers_and_draws_the_plot(tmp_path):
    kvps_torch, gloo = _torch_parts()
    plot, saved = tmp_path / "out" / "compare.png", tmp_path / "compare.json"
    start = time.monotonic()
    done = run_bench(["--quick", "--timeout", "40", "--plot", str(plot), "--json", str(saved)], tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    rows = table_rows(done.stdout)
    assert set(rows) == set(QUICK_SETUPS) | {"MXNet dist_sync S=1"}, done.stdout
    assert rows["MXNet dist_sync S=1"][0] == "not run: no --mxnet PYTHON", done.stdout
    for setup in QUICK_SETUPS:
        sync, gbps, train, local, *_ = rows[setup]
        if setup.startswith("gloo") and not gloo:
            assert sync.startswith("not available"), done.stdout
            continue
        assert number(sync) > 0 and float(gbps) > 0, done.stdout
        if setup.startswith("gloo") or kvps_torch:
            assert number(train) > 0 and number(local) > 0, done.stdout
        else:
            assert train == "n/a" and "kvps.torch" in done.stdout, done.stdout
    if gloo:
        assert rows["kvps ring"][4].endswith("(gloo)") and float(rows["kvps ring"][4].split()[0]) > 0, done.stdout
    assert "| kvps ring at most 1.0x gloo, W=2 |" in done.stdout
    assert "not judged (--quick" in done.stdout        # a smoke run judges no target
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    result = json.loads(saved.read_text())
    assert [s["label"] for s in result["setups"]] == list(QUICK_SETUPS) + ["MXNet dist_sync S=1"]
    ring = next(s for s in result["setups"] if s["system"] == "ring")
    assert ring["rows"]["resnet50"]["ms"] > 0 and ring["servers"] == 0
    assert all(t["met"] is None for t in result["targets"])
    assert time.monotonic() - start < 75


def test_jobs_past_their_deadline_fail_fast_and_say_so(tmp_path):
    start = time.monotonic()
    done = run_bench(["--quick", "--systems", "sync,gloo", "--timeout", "1", "--plot", ""], tmp_path, timeout=60)
    assert done.returncode == 1, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "did not finish within --timeout 1 s" in done.stderr, done.stderr
    assert "**failed**" in done.stdout, done.stdout
    assert time.monotonic() - start < 45


def args(*argv):
    return compare._args(list(argv))


def test_setups_dedupe_servers_and_give_the_ring_and_gloo_none():
    todo = compare.setups(args("-n", "2,4", "-s", "1,2,W"))
    labels = [(s.workers, s.label) for s in todo]
    assert labels == [(2, "PS sync S=1"), (2, "PS sync S=2"), (2, "PS async S=1"), (2, "PS async S=2"),
                      (2, "kvps ring"), (2, "gloo all-reduce"), (2, "MXNet dist_sync S=1"), (2, "MXNet dist_sync S=2"),
                      (4, "PS sync S=1"), (4, "PS sync S=2"), (4, "PS sync S=4"),
                      (4, "PS async S=1"), (4, "PS async S=2"), (4, "PS async S=4"),
                      (4, "kvps ring"), (4, "gloo all-reduce"),
                      (4, "MXNet dist_sync S=1"), (4, "MXNet dist_sync S=2"), (4, "MXNet dist_sync S=4")]
    assert all(s.servers == 0 for s in todo if s.system in ("ring", "gloo"))


def test_quick_preset_and_plan():
    a = args("--quick")
    assert (a.workers, a.servers, a.steps) == ([2], [1], 2)
    plan = compare.make_plan(a, train=True)
    assert len(plan["resnet"]["shapes"]) == compare.QUICK_TENSORS and plan["resnet"]["steps"] == 2
    assert plan["train"]["layers"] == compare.QUICK_MODEL["layers"] and plan["sweep"] == []
    assert compare.make_plan(args(), train=False)["train"] is None
    assert plan["threads"] == "auto" and compare.make_plan(args("--threads", "default"), True)["threads"] == "default"
    assert len(compare.make_plan(args(), train=True)["resnet"]["shapes"]) == 161


@pytest.mark.parametrize("argv", [["-n", "0"], ["-s", "x"], ["--systems", "sync,nccl"], ["--repeat", "0"],
                                  ["--steps", "0"], ["--timeout", "-1"], ["--threads", "0"], ["--threads", "many"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    assert compare.main(argv) == 2
    assert "kvps bench compare" in capsys.readouterr().err


def test_run_order_puts_each_setup_next_to_its_baseline():
    order = compare.run_order(compare.setups(args("-n", "2", "-s", "1,2")), 0)
    labels = [s.label for s in order]
    assert labels[:2] == ["kvps ring", "gloo all-reduce"]
    assert labels.index("MXNet dist_sync S=1") == labels.index("PS sync S=1") + 1
    assert labels.index("MXNet dist_sync S=2") == labels.index("PS sync S=2") + 1
    assert compare.run_order(order, 1) == order[::-1]


def test_rows_that_need_a_missing_part_say_not_available(monkeypatch, capsys, tmp_path):
    # As where kvps.torch does not import: the PS row still syncs, its training cells say n/a and why.
    def availability(args):
        why = {s: None for s in compare.SYSTEMS}
        why["gloo"] = "not available: this torch has no gloo backend"
        why["mxnet"] = "not run: no --mxnet PYTHON"
        return why, "not available: kvps.torch does not import (test)"
    monkeypatch.setattr(compare, "availability", availability)
    assert compare.main(["--quick", "--systems", "sync,gloo", "--timeout", "40", "--plot", ""]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert number(rows["PS sync S=1"][0]) > 0 and rows["PS sync S=1"][2] == "n/a", out
    assert rows["gloo all-reduce"][0] == "not available: this torch has no gloo backend", out
    assert "kvps training rows: not available: kvps.torch does not import (test)" in out
