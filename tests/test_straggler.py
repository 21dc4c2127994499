"""Controlled stragglers: spec parsing, step detection, seeded delays, and `kvps launch --straggler`."""
import json
import os
import subprocess

import pytest

from harness import FAST_ENV, PY
from kvps.errors import ConfigError
from kvps.launcher import ssh_commands, straggler_env
from kvps.straggler import Straggler, parse, parse_assignments


def test_specs_parse_and_print_back():
    assert str(parse("fixed:0.05")) == "fixed:0.05"
    assert parse("uniform:0:0.1").mean == pytest.approx(0.05)
    assert parse("exp:0.02").mean == 0.02
    for bad, why in [("slow:1", "kind must be one of"), ("fixed", "takes 1"), ("fixed:a", "not numbers"),
                     ("uniform:0.2:0.1", "LO <= HI"), ("fixed:-1", "not negative"), ("exp:1:2", "takes 1")]:
        with pytest.raises(ConfigError, match=why):
            parse(bad)


def test_assignments_name_ranks_of_this_job():
    assert parse_assignments(["1=fixed:0.5"], 2) == {1: parse("fixed:0.5")}
    with pytest.raises(ConfigError, match="workers 0..1"):
        parse_assignments(["2=fixed:0.5"], 2)
    with pytest.raises(ConfigError, match="not RANK=SPEC"):
        parse_assignments(["fixed:0.5"], 2)
    with pytest.raises(ConfigError, match="twice"):
        parse_assignments(["1=fixed:0.5", "1=exp:1"], 2)
    assert straggler_env(["0=exp:0.1"], 2, seed=7) == {0: {"KVPS_STRAGGLER": "exp:0.1", "KVPS_STRAGGLER_SEED": "7"}}


def test_one_sleep_per_step_recognised_by_repeated_keys():
    slept = []
    s = Straggler(parse("fixed:0.25"), sleep=slept.append)
    for _ in range(3):                       # three steps, each pushing keys a, b (one call) and then c
        s.before_push(["a", "b"])
        s.before_push(["c"])
    assert slept == [0.25, 0.25, 0.25] and s.steps == 3 and s.total == pytest.approx(0.75)
    s.before_push(["a", "b", "c"])           # a whole-model call is one step
    s.before_push(["a", "b", "c"])
    assert s.steps == 5


def test_random_delays_repeat_with_the_seed_and_differ_by_rank():
    def draws(seed, rank):
        s = Straggler(parse("exp:0.1"), seed=seed, rank=rank, sleep=lambda _: None)
        return [s.delay() for _ in range(5)]
    assert draws(3, 1) == draws(3, 1)
    assert draws(3, 1) != draws(3, 2) and draws(3, 1) != draws(4, 1)
    u = Straggler(parse("uniform:0.1:0.2"), sleep=lambda _: None)
    assert all(0.1 <= u.delay() <= 0.2 for _ in range(50))


def test_ssh_commands_carry_the_straggler_to_its_worker_only():
    cmds = dict(ssh_commands(2, 1, ["python", "t.py"], ["h1"], "h0", 9000, worker_env={1: {"KVPS_STRAGGLER": "fixed:1"}}))
    assert "KVPS_STRAGGLER=fixed:1" in cmds["W1"][-1]
    assert "KVPS_STRAGGLER" not in cmds["W0"][-1] and "KVPS_STRAGGLER" not in cmds["S0"][-1]


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
