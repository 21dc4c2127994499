"""kvps soak, short: four real jobs (sync and async, clean and with lost and repeated messages) run to
the end with exact values, and the report gives every daemon's memory growth."""
import json
import sys

from harness import run_command


def test_a_short_soak_runs_every_job_and_reports_growth(tmp_path):
    out = tmp_path / "soak.json"
    proc = run_command([sys.executable, "-m", "kvps.cli", "soak", "--minutes", "0.3", "--sample-every", "0.5",
                        "--json", str(out)], cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kvtype"], r["faults"]) for r in rows] == [("dist_sync", False), ("dist_sync", True),
                                                           ("dist_async", False), ("dist_async", True)]
    for r in rows:
        assert r["ok"] and len(r["workers"]) == 2 and all(w["steps"] > 0 and w["bad"] == 0 for w in r["workers"])
        assert sorted(r["growth"]) == ["H", "S0", "S1"]
        assert all(g["samples"] >= 2 for g in r["growth"].values()), r["growth"]
    assert "| dist_async | drop:0.01,dup:0.01,delay:1ms | S1 |" in proc.stdout
