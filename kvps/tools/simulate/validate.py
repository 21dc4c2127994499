"""`kvps simulate validate`: the model's step times beside `kvps emulate sync`'s measured ones.

    rows = validate(costs, workers=(2, 4), servers=(1, 2, 4), rates=("1gbit",), models=("resnet50",))
    print("\n".join(table(rows)))

Each setup runs as `kvps emulate sync` runs it (kvps/tools/emulate/sync.py's run_setup: the
scheduler, S dedicated server hosts and W worker hosts, each in a namespace of its own with a
link at the rate; the median of --steps timed steps of one gradient set, both call patterns), and
the model predicts the same step with the "veth" transport and every process sharing this
machine's CPUs (costs.host_cores). The ring runs W worker hosts and no servers. A setup that
fails is reported with its error; the others go on.
"""
import argparse
import json
import math
import os
import tempfile

from kvps.errors import KVTimeoutError, NodeFailure

from kvps.tools.simulate.models import tensors
from kvps.tools.simulate.step import Setup, predict

TOLERANCE = 0.15               # the bar: within 15% of the measured step


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


def validate(costs, workers=(2, 4), servers=(1, 2, 4), rates=("1gbit", "100mbit"), models=("resnet50", "wide"),
             systems=("ps", "ring"), steps=3, timeout=300.0, say=print):
    """[row] for every setup: system, mode, model, rate, W, S, measured_s (None: failed), predicted_s, error."""
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
                    try:
                        measured, error = measure(system, W, S, rate, model, steps, timeout), None
                    except (NodeFailure, KVTimeoutError) as exc:
                        measured, error = {}, str(exc).splitlines()[0][:300]
                    # the ring's model is of its one-call path; sync's ring push+pull is printed, not predicted
                    modes = ("pushpull", "push+pull") if system == "ps" else ("pushpull",)
                    for mode in modes:
                        p = predicted(system, W, S, bits, model, mode, costs, steps)
                        rows.append({"system": system, "mode": mode, "model": model, "rate": rate, "W": W, "S": S,
                                     "measured_s": measured.get(mode), "predicted_s": p, "error": error})
                    say(f"[validate] {what}: measured " + (", ".join(f"{m} {measured[m] * 1e3:.0f} ms" for m in modes
                                                                     if m in measured) or f"failed: {error}")
                        + "; predicted " + ", ".join(f"{r['mode']} {r['predicted_s'] * 1e3:.0f} ms"
                                                     for r in rows[-len(modes):]))
    return rows


def table(rows):
    lines = ["| system | call | model | rate | W | S | measured ms | predicted ms | predicted / measured | within 15% |",
             "|---|---|---|---|--:|--:|--:|--:|--:|---|"]
    for r in rows:
        m, p = r["measured_s"], r["predicted_s"]
        ratio = p / m if m else None
        ok = "-" if ratio is None else ("yes" if abs(ratio - 1) <= TOLERANCE else "no")
        lines.append(f"| {r['system']} | {r['mode']} | {r['model']} | {r['rate']} | {r['W']} | {r['S'] or '-'} | "
                     f"{'failed' if m is None else f'{m * 1e3:.0f}'} | {p * 1e3:.0f} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} | {ok} |")
    return lines


def summary(rows):
    """(rows within TOLERANCE, rows measured, the median |predicted/measured - 1|)."""
    errors = sorted(abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows if r["measured_s"])
    within = sum(1 for e in errors if e <= TOLERANCE)
    mid = errors[len(errors) // 2] if errors else math.nan
    return within, len(errors), mid
