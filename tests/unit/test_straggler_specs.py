"""Controlled stragglers: spec parsing, step detection, seeded delays, and the ssh commands."""

import pytest
from kvps.errors import ConfigError
from kvps.launch import tether
from kvps.launch.ssh import launch_ssh
from kvps.straggler import Straggler, parse


def test_specs_parse_and_print_back():
    assert str(parse("fixed:0.05")) == "fixed:0.05"
    assert parse("uniform:0:0.1").mean == pytest.approx(0.05)
    assert parse("exp:0.02").mean == 0.02
    for bad, why in [("slow:1", "kind must be one of"), ("fixed", "takes 1"), ("fixed:a", "not numbers"),
                     ("uniform:0.2:0.1", "LO <= HI"), ("fixed:-1", "not negative"), ("exp:1:2", "takes 1")]:
        with pytest.raises(ConfigError, match=why):
            parse(bad)


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


def test_ssh_commands_carry_the_straggler_to_its_worker_only(tmp_path):
    import io
    import shlex
    (tmp_path / "hosts").write_text("h1\n")
    out = io.StringIO()
    launch_ssh(2, 1, ["python", "t.py"], str(tmp_path / "hosts"), 9000, dry_run=True, out=out, host="10.0.0.1",
               worker_env={1: {"KVPS_STRAGGLER": "fixed:1"}})
    env = {line.split()[0][1:-1]: tether.decode(shlex.split(line.split(" <<< ")[1])[0].encode())[1]
           for line in out.getvalue().splitlines()[1:]}
    assert env["W1"]["KVPS_STRAGGLER"] == "fixed:1"
    assert "KVPS_STRAGGLER" not in env["W0"] and "KVPS_STRAGGLER" not in env["S0"]
