"""`kvps simulate`: the model against closed forms in its limits (zero overhead gives the
bandwidth bound, one worker gives no communication), its parts as pure units, and calibration and
validation at a tiny size on real processes (validation where network namespaces exist)."""
import json
import math
import os
import subprocess

import pytest

from harness import FAST_ENV, PY
from kvps.errors import ConfigError
from kvps.tools.emulate.theory import theory
from kvps.tools.simulate import calibrate, costs as costs_mod, models, step, sweep, validate
from kvps.tools.simulate.engine import Resource, Simulator
from kvps.tools.simulate.step import Setup, predict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Small pieces, so the pipeline's fill and drain shrink towards zero, and every tensor split over
# all servers, as the bound assumes (keys spread evenly).
FINE = dict(partition_bytes=1 << 18, message_bytes=1 << 18, split_bytes=1, chunk_bytes=1 << 18, fusion_bytes=1 << 20)


# ---- the event core ----
def test_resource_serves_in_priority_then_arrival_order():
    sim = Simulator()
    r = Resource(sim, "r")
    done = []
    sim.chain([(r, 1.0)], lambda t: done.append(("a", t)))
    sim.chain([(r, 1.0)], lambda t: done.append(("low", t)), priority=5)
    sim.chain([(r, 1.0)], lambda t: done.append(("high", t)), priority=-1)
    sim.chain([(None, 0.5), (r, 0.0)], lambda t: done.append(("zero", t)))
    assert sim.run() == 3.0
    # "a" got the idle resource first; then the queue by priority; a zero-length request waits its turn
    assert done == [("a", 1.0), ("high", 2.0), ("zero", 2.0), ("low", 3.0)]
    assert r.busy_s == 3.0


# ---- closed-form limits ----
@pytest.mark.parametrize("W,S", [(1, 1), (2, 1), (4, 1), (4, 2), (4, 4), (16, 4), (16, 16)])
def test_zero_overhead_ps_is_the_bandwidth_bound(W, S):
    grads = models.tensors("resnet50")
    bound = theory(sum(grads), 1e9, W, S).ps
    # a round needs all W pushes of a message before its reply: the fill is about 2 W message times,
    # so the messages shrink as W grows (the bound is the limit of messages of zero size)
    fine = dict(FINE, partition_bytes=(1 << 19) // W, message_bytes=(1 << 19) // W)
    got = predict(Setup("ps", W, S, rate=1e9, **fine), grads, costs_mod.zero())["step_s"]
    assert bound <= got <= bound * 1.03, (got, bound)
    # push+pull (a pull per key after its push) pipelines the same way when messages cost nothing
    keyed = predict(Setup("ps", W, S, rate=1e9, mode="push+pull", **fine), grads, costs_mod.zero())["step_s"]
    assert bound <= keyed <= bound * 1.03


@pytest.mark.parametrize("W", [2, 3, 4, 8, 64])
def test_zero_overhead_ring_is_the_bandwidth_bound(W):
    grads = models.tensors("resnet50")
    bound = theory(sum(grads), 1e9, W, 1).ring
    # one bucket (the kvstore all-reduces buckets one after another, each with its fill and drain)
    got = predict(Setup("ring", W, rate=1e9, **dict(FINE, fusion_bytes=1 << 30)), grads, costs_mod.zero())["step_s"]
    assert bound * (1 - 1e-9) <= got <= bound * 1.03, (got, bound)


def test_one_worker_has_no_communication():
    grads, c = models.tensors("bert-large"), costs_mod.Costs()
    one = predict(Setup("ring", 1, rate=1e9, compute_s=0.25), grads, c)
    assert one["step_s"] == 0.25 and one["comm_s"] == 0.0 and one["events"] == 0
    # with compression the bytes on the wire shrink in proportion (the bound at half the bytes)
    half = predict(Setup("ps", 4, 4, rate=1e9, compression=0.5, **FINE), grads, costs_mod.zero())["step_s"]
    assert half == pytest.approx(theory(sum(grads) / 2, 1e9, 4, 4).ps, rel=0.03)


def test_overheads_add_and_compute_overlaps():
    grads = models.tensors("resnet50")
    base = costs_mod.zero()
    slow = base.replace(transports={**base.transports, "loopback": {"per_message_s": 1e-3, "per_byte_s": 0.0}})
    free = predict(Setup("ps", 2, 1), grads, base)["step_s"]
    paid = predict(Setup("ps", 2, 1), grads, slow)
    assert free == 0.0 and paid["step_s"] > 0 and paid["busiest"] == "S0.cpu"
    # per message: every one of a round's messages pays four ends; the server's two for every worker
    msgs = len(step.messages(step.shard(grads, 1, 1 << 20, 4 << 20), [0.0] * len(grads), Setup("ps", 2).message_bytes, True))
    assert paid["step_s"] == pytest.approx(1e-3 * (2 * 2 * msgs + 2), rel=0.01)
    # communication that starts during the backward pass hides behind it
    rated = dict(rate=10e9, **FINE)
    alone = predict(Setup("ps", 4, 4, **rated), grads, base)["step_s"]
    overlapped = predict(Setup("ps", 4, 4, compute_s=0.3, **rated), grads, base)["step_s"]
    assert 0.3 < overlapped < 0.3 + alone


@pytest.mark.parametrize("W,S", [(1, 1), (4, 1), (4, 2)])
def test_per_call_cost_with_free_links_is_calls_times_the_cost(W, S):
    grads = models.tensors("resnet50")
    calls = costs_mod.zero().replace(per_call_s=1e-3)         # per key a call names
    # pushpull: one call naming all 161 keys; push+pull: a call of one key each way per key
    assert predict(Setup("ps", W, S), grads, calls)["step_s"] == pytest.approx(len(grads) * 1e-3)
    keyed = predict(Setup("ps", W, S, mode="push+pull"), grads, calls)["step_s"]
    assert keyed == pytest.approx(2 * len(grads) * 1e-3)
    if W > 1:
        assert predict(Setup("ring", W), grads, calls)["step_s"] == pytest.approx(len(grads) * 1e-3)
    # W workers' calls on C = 2 shared cores take W/min(W, C) as long, and each busy process beyond
    # the cores adds per_call_crowded_s to every call
    shared = calls.replace(host_cores=2, per_call_crowded_s=1e-4)
    crowd = max(0, W + S - 2)
    keyed = predict(Setup("ps", W, S, mode="push+pull"), grads, shared)["step_s"]
    assert keyed == pytest.approx(2 * len(grads) * (1e-3 + 1e-4 * crowd) * W / min(W, 2))


def test_coalesced_pushes_pay_one_message_per_server_and_batch():
    """kvps/kvstore/coalesce.py in the model: with only a message's cost, push+pull of N small keys
    costs N messages each way one by one, and coalesced 1 (the first push) + one per server per
    batch of at most lane_bytes; keys bigger than lane_bytes go alone either way."""
    o = 1e-3
    costs = costs_mod.zero().replace(transports={"loopback": {"per_message_s": o, "per_byte_s": 0.0}})
    small = [1000.0] * 20
    alone = predict(Setup("ps", 1, 1, mode="push+pull", coalesce_s=0.0), small, costs)["step_s"]
    merged = predict(Setup("ps", 1, 1, mode="push+pull"), small, costs)["step_s"]
    # one worker, one server: a message costs o at each of its four ends, pipelined; the worker's
    # CPU, the busiest, sends each push and takes each reply, and the last reply's two server ends
    # come after its last send: (2 messages + 2) * o
    assert alone == pytest.approx((2 * 20 + 2) * o), alone
    assert merged == pytest.approx((2 * 2 + 2) * o), merged
    # a batch holds at most lane_bytes: the 19 keys after the first in batches of 5 are 4 batches
    batched = predict(Setup("ps", 1, 1, mode="push+pull", lane_bytes=5000), small, costs)["step_s"]
    assert batched == pytest.approx((2 * 5 + 2) * o), batched
    big = [1e6] * 20                                 # over lane_bytes: no change
    assert predict(Setup("ps", 1, 1, mode="push+pull"), big, costs)["step_s"] == \
        pytest.approx(predict(Setup("ps", 1, 1, mode="push+pull", coalesce_s=0.0), big, costs)["step_s"])
    with pytest.raises(ConfigError, match="coalesce_s"):
        predict(Setup("ps", 1, 1, coalesce_s=-1.0), small, costs)


def test_call_costs_fitted_from_loops_of_small_keys():
    call, o, crowd, round_s, n = 65e-6, 30e-6, 20e-6, 0.5e-3, calibrate.CALL_KEYS
    loop = calibrate._loop_s
    steps = {"pushpull": round_s + (n - 1) * call, "push+pull": loop(1, 1, call, o, 1e10, 2)}
    busy = {"pushpull": 0.0, "push+pull": loop(4, 4, call + 6 * crowd, o, 1e10, 2)}
    got = calibrate.fit_calls(round_s, steps, 1e10, 2, busy, crowd=(4, 4))
    assert got == pytest.approx((call, o, crowd), rel=1e-3)
    assert calibrate.fit_calls(round_s, steps, 1e10, 8, busy, crowd=(4, 4))[2] == 0.0     # 8 processes fit


def test_ring_copies_every_gradient_into_and_out_of_its_fusion_buffers():
    grads = models.tensors("resnet50")
    copies = costs_mod.zero().replace(copy_bytes_per_s=1e9)
    assert predict(Setup("ring", 4), grads, copies)["step_s"] == pytest.approx(2 * sum(grads) / 1e9)


def test_fan_in_efficiency_slows_a_links_many_senders():
    c = costs_mod.zero().replace(fan_in_efficiency={"2": 0.8, "4": 0.5})
    assert (c.efficiency(1), c.efficiency(3), c.efficiency(64)) == (1.0, 0.8, 0.5)
    grads = models.tensors("resnet50")
    fine = dict(FINE, partition_bytes=1 << 17, message_bytes=1 << 17)
    # 4 workers into one server: its downlink carries the pushes at half the rate, the bound's 2x
    got = predict(Setup("ps", 4, 1, rate=1e9, **fine), grads, c)["step_s"]
    assert got == pytest.approx(2 * theory(sum(grads), 1e9, 4, 1).ps, rel=0.03)


def test_a_token_bucket_empties_over_back_to_back_steps_as_the_benchmark_runs_them():
    # One worker, one server, no overhead: a 100 KB step through buckets of 400 KB on 1 Gbit/s links.
    c, grads = costs_mod.zero(), [100_000]
    at_rate = 8 * sum(grads) / 1e9

    def step_s(warmup, timed):
        return predict(Setup("ps", 1, 1, rate=1e9, burst_bytes=400_000, warmup=warmup, timed=timed),
                       grads, c)["step_s"]
    assert step_s(0, 1) == pytest.approx(0.0, abs=1e-9)     # a full bucket lets the step through at once
    steady = step_s(30, 3)                                  # every direction carries 100 KB a step
    assert at_rate * 0.99 <= steady <= 2 * at_rate * 1.01
    assert step_s(1, 3) <= steady                           # the benchmark's sequence: partly full
    with pytest.raises(ConfigError, match="timed=0"):
        predict(Setup("ps", 1, 1, rate=1e9, burst_bytes=400_000, timed=0), grads, c)


def test_sharding_spreads_bytes_evenly_like_kvps():
    grads = models.tensors("resnet50")
    pieces = step.shard(grads, 4, 1 << 20, 4 << 20)
    load = [sum(b for _, s, b in pieces if s == k) for k in range(4)]
    assert sum(load) == pytest.approx(sum(grads))
    assert max(load) / (sum(load) / 4) < 1.05
    ready = step.ready_times([10, 30, 60], 0.3)
    assert ready[2] == pytest.approx(0.1 + 0.2 * 0.6) and ready[0] == pytest.approx(0.3)    # last layer first


def test_setup_and_costs_errors_name_the_bad_value(tmp_path):
    for bad, text in ((Setup("mesh", 2), "system 'mesh'"), (Setup("ps", 2, 0), "S=0"),
                      (Setup("ps", 2, mode="pull"), "mode 'pull'"), (Setup("ps", 2, compression=2.0), "compression 2.0"),
                      (Setup("ring", 2, rate=-1.0), "rate -1.0")):
        with pytest.raises(ConfigError, match=text):
            predict(bad, [1000], costs_mod.Costs())
    with pytest.raises(ConfigError, match="transport 'ib'"):
        costs_mod.Costs().transport("ib")
    with pytest.raises(ConfigError, match="model 'vgg'"):
        models.tensors("vgg")
    path = tmp_path / "c.json"
    costs_mod.Costs(host_cores=2).save(path)
    assert costs_mod.Costs.load(path).host_cores == 2
    path.write_text(json.dumps({"nonsense": 1}))
    with pytest.raises(ConfigError, match="nonsense"):
        costs_mod.Costs.load(path)


def test_sweep_table_and_crossover():
    assert sweep.parse_workers("2..16") == [2, 4, 8, 16] and sweep.parse_workers("3,5") == [3, 5]
    for bad in ("16..2", "a..b", "0"):
        with pytest.raises(ValueError, match="--workers"):
            sweep.parse_workers(bad)
    rows = sweep.sweep(costs_mod.Costs(), [2, 8, 32], [25e9], ["resnet50"])
    assert [r["W"] for r in rows] == [2, 8, 32] and all(r["best_S"] in r["ps_by_S"] for r in rows)
    assert all(0 < r["ring_eff"] <= 1 and 0 < r["ps_eff"] <= 1 for r in rows)
    lines = sweep.table(rows)
    assert lines[0].startswith("| model | Gbit/s | W |") and len(lines) == 5
    assert set(sweep.crossover(rows)) == {("resnet50", 25e9)}


def test_fit_recovers_a_line():
    points = [(b, 30e-6 + 4 * (50e-6 + b * 1e-9) + b / 1e10) for b in (1000, 100_000, 1_000_000)]
    o, c = calibrate.fit(points, 1e10, per_call_s=30e-6)          # a round: one call, four message ends
    assert o == pytest.approx(50e-6) and c == pytest.approx(1e-9)
    # a line that bends upwards keeps its smallest round's intercept (least squares would go below 0)
    bent = points[:-1] + [(4_000_000, 10 * points[-1][1])]
    assert calibrate.fit(bent, 1e10, per_call_s=30e-6)[0] > 0.5 * 50e-6


def test_validation_table():
    rows = [{"system": "ps", "mode": "pushpull", "model": "wide", "rate": "100mbit", "W": 2, "S": 1,
             "measured_s": 0.020, "predicted_s": 0.022, "error": None, "steps": 20, "repeats": 3},
            {"system": "ring", "mode": "pushpull", "model": "wide", "rate": "100mbit", "W": 2, "S": 0,
             "measured_s": None, "predicted_s": 0.010, "error": "boom"}]
    lines = validate.table(rows)
    assert "| ps | pushpull | wide | 100mbit | 2 | 1 | 3 x 20 | 20 | 22 | 1.10 | yes |" in lines
    assert "| ring | pushpull | wide | 100mbit | 2 | - | - | failed | 10.0 | - | - |" in lines
    assert validate.summary(rows)[:2] == (1, 1)


def test_validation_times_short_steps_longer():
    c = costs_mod.Costs()
    # ResNet-50 at 1 Gbit/s: steps of most of a second, 3 of them in one job
    assert validate.plan_runs("ps", 2, 2, 1e9, "resnet50", c) == (validate.MIN_STEPS, 1)
    # the wide MLP at 1 Gbit/s: steps of milliseconds, as many as fill TIMED_S, in SHORT_REPEATS jobs
    steps, jobs = validate.plan_runs("ps", 2, 2, 1e9, "wide", c)
    step_s = validate.predicted("ps", 2, 2, 1e9, "wide", "pushpull", c, validate.MIN_STEPS)
    assert step_s < validate.SHORT_S and jobs == validate.SHORT_REPEATS
    assert steps == min(validate.MAX_STEPS, math.ceil(validate.TIMED_S / step_s)) and steps > validate.MIN_STEPS
    # given, they are kept
    assert validate.plan_runs("ps", 2, 2, 1e9, "wide", c, steps=5, repeats=2) == (5, 2)


def test_jobs_of_a_setup_give_the_median_of_their_medians(monkeypatch):
    jobs = iter([{"pushpull": 3.0, "push+pull": 9.0}, {"pushpull": 1.0, "push+pull": 7.0},
                 {"pushpull": 2.0, "push+pull": 8.5}])
    asked = []

    def measure(system, W, S, rate, model, steps, timeout):
        asked.append(steps)
        return next(jobs)
    monkeypatch.setattr(validate, "measure", measure)
    assert validate.measure_median("ps", 2, 1, "1gbit", "wide", 40, 3, 60.0) == {"pushpull": 2.0, "push+pull": 8.5}
    assert asked == [40, 40, 40]


def test_the_per_call_loop_is_timed_with_a_message_per_key(monkeypatch):
    """The fit takes push+pull to send a message per key: the calibration's job turns coalescing
    (kvps/kvstore/coalesce.py) off, which would merge them."""
    from kvps.tools.bench import pushpull
    seen = []

    def job(workers, servers, command, env, timeout, verbose, label):
        seen.append(env)
        return ""
    monkeypatch.setattr(pushpull, "kvps_job", job)
    assert calibrate.call_steps(True) == {}
    assert seen and seen[0].get("KVPS_COALESCE_US") == "0"


# ---- real processes, tiny ----
def _simulate(*args, timeout=240):
    return subprocess.run([PY, "-m", "kvps.cli", "simulate", *args], cwd=ROOT, env=dict(os.environ, **FAST_ENV),
                          capture_output=True, text=True, timeout=timeout)


def test_calibrate_and_validate_tiny(tmp_path):
    from kvps.tools.emulate import permitted
    ok, why = permitted()
    path = tmp_path / "costs.json"
    proc = _simulate("calibrate", "--quick", "--out", str(path), *([] if ok else ["--no-emulate"]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    costs = costs_mod.Costs.load(path)
    assert costs.host_cores == os.cpu_count() and costs.sum_bytes_per_s > 1e8
    loop = costs.transport("loopback")
    # 0 is a fit, not a failure: a per-key call (its message sent on the caller's lane, its pull
    # taken from the pushpull's reply) costs about what a key costs in one call naming them all
    # (per_call_s), so what is left of the loop for its messages is within the noise here
    assert 0 <= loop.per_message_s < 0.05 and loop.per_byte_s < 1e-7
    assert len(costs.measured["loopback_rounds"]) == len(calibrate.QUICK_SIZES)
    assert 0 < costs.per_call_s < 0.05 and costs.per_call_crowded_s >= 0 and "call_steps" in costs.measured
    if not ok:
        pytest.skip(f"calibrated loopback only; validation needs network namespaces: {why}")
    assert 0.8 < costs.link_efficiency < 1.05 and "veth_rounds" in costs.measured
    assert set(costs.fan_in_efficiency) == {str(k) for k in calibrate.FAN_IN}
    out = tmp_path / "v"
    proc = _simulate("validate", "--costs", str(path), "-n", "2", "-s", "1", "--rate", "100mbit", "--model", "wide",
                     "--systems", "ps", "--steps", "3", "--repeats", "1", "--timeout", "120", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "validation.json").read_text())["rows"]
    assert [(r["system"], r["mode"]) for r in rows] == [("ps", "pushpull"), ("ps", "push+pull")]
    for r in rows:
        # 2 x 104 KB through the server's 100 Mbit/s link each way: 16.7 ms at the fluid bound; tbf's
        # 128 KB burst lets part of a step through at once, in the measurement and in the model
        bound = theory(sum(models.tensors("wide")), 100e6, 2, 1).ps
        assert r["measured_s"] > 0.5 * bound and r["predicted_s"] > 0.5 * bound
        assert math.isfinite(r["predicted_s"] / r["measured_s"])
    assert "| ps | pushpull | wide | 100mbit | 2 | 1 | 1 x 3 |" in (out / "validation.md").read_text()
    assert all((r["steps"], r["repeats"]) == (3, 1) for r in rows)


def test_cli_usage_errors_exit_2():
    proc = _simulate("validate", "--steps", "0")
    assert proc.returncode == 2 and "--steps 0 must be at least 1" in proc.stderr
    proc = _simulate("predict", "-n", "2", "--model", "vgg")
    assert proc.returncode == 2 and "model 'vgg'" in proc.stderr
    proc = _simulate("sweep", "--workers", "8..2")
    assert proc.returncode == 2 and "--workers '8..2'" in proc.stderr
