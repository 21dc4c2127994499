"""Controlled stragglers on real jobs: `kvps launch --straggler` slows only that worker."""

import json
import os
import subprocess

import pytest

from harness import FAST_ENV, PY
from kvps.errors import ConfigError
from kvps.launch import straggler_env
from kvps.straggler import parse, parse_assignments


def test_assignments_name_ranks_of_this_job():
    assert parse_assignments(["1=fixed:0.5"], 2) == {1: parse("fixed:0.5")}
    with pytest.raises(ConfigError, match="workers 0..1"):
        parse_assignments(["2=fixed:0.5"], 2)
    with pytest.raises(ConfigError, match="not RANK=SPEC"):
        parse_assignments(["fixed:0.5"], 2)
    with pytest.raises(ConfigError, match="twice"):
        parse_assignments(["1=fixed:0.5", "1=exp:1"], 2)
    assert straggler_env(["0=exp:0.1"], 2, seed=7) == {0: {"KVPS_STRAGGLER": "exp:0.1", "KVPS_STRAGGLER_SEED": "7"}}


WORKER = r'''
import json, time, numpy as np, kvps
kv = kvps.create("dist_sync")
kv.init(["a", "b"], [np.zeros(4, np.float32), np.zeros(4, np.float32)])
start = time.monotonic()
for step in range(4):
    kv.pushpull("a", np.ones(4, np.float32))
    kv.pushpull("b", np.ones(4, np.float32))
print(json.dumps({"rank": kv.rank, "straggled": kv.straggled, "elapsed": time.monotonic() - start}), flush=True)
'''


def test_launch_straggler_slows_only_that_worker_and_sync_waits_for_it(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    proc = subprocess.run([PY, "-m", "kvps.cli", "launch", "-n", "2", "-s", "1", "--straggler", "1=fixed:0.2",
                           "--", PY, str(script)], env=dict(os.environ, **FAST_ENV), capture_output=True,
                          text=True, timeout=90, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["rank"]: r for r in (json.loads(line.split("] ", 1)[1]) for line in proc.stdout.splitlines()
                                   if line.startswith("[W") and "{" in line)}
    assert rows[0]["straggled"] == 0.0
    assert rows[1]["straggled"] == pytest.approx(0.8)           # 4 steps x 0.2 s
    assert rows[0]["elapsed"] >= 0.6                           # sync: the fast worker waits for the slow one


def test_launch_refuses_a_bad_straggler_before_starting_anything(tmp_path):
    proc = subprocess.run([PY, "-m", "kvps.cli", "launch", "-n", "2", "-s", "1", "--straggler", "5=fixed:1",
                           "--", PY, "-c", "pass"], env=dict(os.environ, **FAST_ENV), capture_output=True,
                          text=True, timeout=30, cwd=tmp_path)
    assert proc.returncode == 2 and "workers 0..1" in proc.stderr, proc.stderr
