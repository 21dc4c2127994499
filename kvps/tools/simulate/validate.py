"""`kvps simulate validate`: the model's step times beside `kvps emulate sync`'s measured ones.

    rows = validate(costs, workers=(2, 4), servers=(1, 2, 4), rates=("1gbit",), models=("resnet50",))
    print("\n".join(table(rows)))

Each setup runs as `kvps emulate sync` runs it (kvps/tools/emulate/sync.py's run_setup: the
scheduler, S dedicated server hosts and W worker hosts, each in a namespace of its own with a
link at the rate; the median of the timed steps of one gradient set, both call patterns), and
the model predicts the same step with the "veth" transport and every process sharing this
machine's CPUs (costs.host_cores). The ring runs W worker hosts and no servers. A setup that
fails is reported with its error; the others go on.

Short steps need more of them: a setup the model gives steps of a few milliseconds (the `wide`
MLP at 1 Gbit/s) times enough steps to fill about TIMED_S (at most MAX_STEPS), where 3 steps of
1 to 5 ms left the median within a token bucket's first burst and at the mercy of one slow
wake-up; and, as such steps vary by about 20% from job to job here, it runs SHORT_REPEATS jobs
and compares the median of their medians. --steps and --repeats fix both instead.
"""
import argparse
import json
import math
import os
import statistics
import tempfile

from kvps.errors import KVTimeoutError, NodeFailure

from kvps.tools.simulate.models import tensors
from kvps.tools.simulate.step import Setup, predict

TOLERANCE = 0.15               # the bar: within 15% of the measured step
MIN_STEPS, MAX_STEPS = 3, 60   # timed steps of a setup, when not given
TIMED_S = 0.2                  # ... enough of them to take about this long, by the model
SHORT_S = 0.05                 # a setup whose steps are shorter than this (by the model) ...
SHORT_REPEATS = 3              # ... runs this many jobs, when not given


def _plan(model, steps):
    from kvps.tools.bench import workloads
    plan = workloads.make_plan(sizes=(), resnet_steps=steps, quick=True)
    if model == "resnet50":
        return plan
    if model == "wide":
        h = 128
        plan["resnet"]["shapes"] = [[64, h], [h], [h, h], [h], [h, 10], [10]]
    else:
        plan["resnet"]["shapes"] = [[sum(tensors(model)) // 4]]
    return plan


def measure(system, W, S, rate, model, steps=3, timeout=300.0):
    """{mode: seconds} of one emulated setup (sync.run_setup). Raises NodeFailure or KVTimeoutError."""
    from kvps.tools.emulate import sync
    args = argparse.Namespace(rate=rate, delay_ms=0.0, mtu=1500, timeout=timeout, verbose=False, mxnet=None)
    setup = sync.Setup(system, W, S if system == "ps" else 0, False)
    with tempfile.TemporaryDirectory(prefix="kvps-validate-") as tmp:
        path = os.path.join(tmp, "plan.json")
        with open(path, "w") as f:
            json.dump(dict(_plan(model, steps), kvtype=sync.KVTYPE[system]), f)
        rows = sync.run_setup(setup, args, path)
    return {mode: row["ms"] / 1e3 for mode, row in rows.items()}


def emulated_burst(rate_bits):
    """The token bucket `kvps emulate` gives each link direction (kvps/tools/emulate/network.py):
    4 ms at the rate, at least 128 KB. It lets a small step's messages through at once."""
    return max(128 * 1024, int(rate_bits) // 8 // 250)


def predicted(system, W, S, rate_bits, model, mode, costs, steps=3):
    """The model's step for a setup that measure() times: the same warm-up and timed steps, back to
    back behind the same token buckets, the plan's keys placed as kvps places them."""
    from kvps.tools.bench.workloads import RESNET_KEY0
    warmup = _plan(model, steps)["resnet"]["warmup"]
    setup = Setup(system, W, S if system == "ps" else 1, rate=rate_bits, transport="veth", mode=mode,
                  burst_bytes=emulated_burst(rate_bits), key0=RESNET_KEY0, warmup=warmup, timed=steps)
    return predict(setup, tensors(model), costs)["step_s"]


def plan_runs(system, W, S, rate_bits, model, costs, steps=None, repeats=None):
    """(timed steps, jobs) for a setup: given, or as many steps as fill TIMED_S at the model's step
    (MIN_STEPS to MAX_STEPS), and SHORT_REPEATS jobs where that step is under SHORT_S."""
    step_s = predicted(system, W, S, rate_bits, model, "pushpull", costs, MIN_STEPS)
    if steps is None:
        steps = min(MAX_STEPS, max(MIN_STEPS, math.ceil(TIMED_S / max(step_s, 1e-9))))
    if repeats is None:
        repeats = SHORT_REPEATS if step_s < SHORT_S else 1
    return steps, repeats


def measure_median(system, W, S, rate, model, steps, repeats, timeout):
    """{mode: seconds}: the median over `repeats` jobs of measure()'s medians."""
    runs = [measure(system, W, S, rate, model, steps, timeout) for _ in range(repeats)]
    return {mode: statistics.median(r[mode] for r in runs) for mode in runs[0]}


def validate(costs, workers=(2, 4), servers=(1, 2, 4), rates=("1gbit", "100mbit"), models=("resnet50", "wide"),
             systems=("ps", "ring"), steps=None, timeout=300.0, say=print, repeats=None):
    """[row] for every setup: system, mode, model, rate, W, S, measured_s (None: failed), predicted_s, error,
    steps and repeats (plan_runs: None picks them by the model's step)."""
    from kvps.tools.emulate import parse_rate
    costs = costs.replace(host_cores=costs.host_cores or os.cpu_count())
    rows = []
    for model in models:
        for rate in rates:
            bits = parse_rate(rate)
            for W in workers:
                shapes = [("ps", S) for S in servers if "ps" in systems] + ([("ring", 0)] if "ring" in systems else [])
                for system, S in shapes:
                    what = f"{system} {model} {rate} W={W}" + (f" S={S}" if S else "")
                    n, jobs = plan_runs(system, W, S, bits, model, costs, steps, repeats)
                    try:
                        measured, error = measure_median(system, W, S, rate, model, n, jobs, timeout), None
                    except (NodeFailure, KVTimeoutError) as exc:
                        measured, error = {}, str(exc).splitlines()[0][:300]
                    # the ring's model is of its one-call path; sync's ring push+pull is printed, not predicted
                    modes = ("pushpull", "push+pull") if system == "ps" else ("pushpull",)
                    for mode in modes:
                        p = predicted(system, W, S, bits, model, mode, costs, n)
                        rows.append({"system": system, "mode": mode, "model": model, "rate": rate, "W": W, "S": S,
                                     "measured_s": measured.get(mode), "predicted_s": p, "error": error,
                                     "steps": n, "repeats": jobs})
                    say(f"[validate] {what} ({jobs} x {n} steps): measured " + (", ".join(f"{m} {measured[m] * 1e3:.0f} ms" for m in modes
                                                                     if m in measured) or f"failed: {error}")
                        + "; predicted " + ", ".join(f"{r['mode']} {r['predicted_s'] * 1e3:.0f} ms"
                                                     for r in rows[-len(modes):]))
    return rows


def table(rows):
    lines = ["| system | call | model | rate | W | S | jobs x steps | measured ms | predicted ms | predicted / measured "
             "| within 15% |",
             "|---|---|---|---|--:|--:|--:|--:|--:|--:|---|"]
    for r in rows:
        m, p = r["measured_s"], r["predicted_s"]
        ratio = p / m if m else None
        ok = "-" if ratio is None else ("yes" if abs(ratio - 1) <= TOLERANCE else "no")
        runs = f"{r['repeats']} x {r['steps']}" if r.get("steps") else "-"
        lines.append(f"| {r['system']} | {r['mode']} | {r['model']} | {r['rate']} | {r['W']} | {r['S'] or '-'} | {runs} | "
                     f"{'failed' if m is None else _ms(m)} | {_ms(p)} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} | {ok} |")
    return lines


def _ms(seconds):
    """Milliseconds, with a decimal where a step is short enough to need it."""
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 20 else f"{ms:.1f}"


def summary(rows):
    """(rows within TOLERANCE, rows measured, the median |predicted/measured - 1|)."""
    errors = sorted(abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows if r["measured_s"])
    within = sum(1 for e in errors if e <= TOLERANCE)
    mid = errors[len(errors) // 2] if errors else math.nan
    return within, len(errors), mid
