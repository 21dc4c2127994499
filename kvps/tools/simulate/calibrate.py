"""`kvps simulate calibrate`: measure on this machine the costs the model predicts from.

    costs, lines = calibrate(quick=False)      # then costs.save("reports/simulate/costs.json")

1. The summation kernel: numpy's in-place add of two float32 arrays (what a server does with
   each push of a key, and the ring's reduce step), bytes of one operand per second; and a
   copy (kvps.arrays.copy_into, which streams big copies past the cache: the ring kvstore's
   fusion buffers), bytes per second.
2. Loopback: a kvps job of 1 worker and 1 server (`kvps launch`'s machinery,
   kvps/tools/bench/pushpull.py) times pushpull rounds of one key at several sizes; a round is
   one call and four message ends, so a line through (bytes, seconds) gives per_byte_s = (its
   slope - one summation) / 4, and its intercept (taken through the smallest round: the rounds
   bend upwards) is the round's fixed cost (step 4 takes it apart).
3. Emulated links (where namespaces are permitted): the same job with the worker and the
   server on two `kvps emulate` hosts, at a rate high enough (10 Gbit/s) that the link is not
   what the round waits for, gives the "veth" transport; and TCP transfers over links at the
   validation rate give link_efficiency (payload / configured rate, with two hosts sending to
   each other at once, as a step's hosts do), and 2 and 4 hosts sending into one host at once
   give fan_in_efficiency (a server's downlink has W senders), each scaled by the ratio of the
   two-way figure to the one-way one.
4. per_call_s, the worker's cost of a call beyond its messages, per key the call names: the
   loopback job times two steps of CALL_KEYS tiny keys (CALL_BYTES each), one pushpull naming
   them all (one call, one message) and push+pull (a call of one key each way per key, a
   message per key, with KVPS_COALESCE_US=0). A round of step 2 is a call of one key and four message ends, so
   per_call_s = (pushpull step - round) / (CALL_KEYS - 1). The round's remainder is a latency
   (wake-ups and hand-offs), not what a message costs the CPUs when messages overlap, so
   per_message_s is the value for which the model (step.py, with that per_call_s and this
   machine's cores shared) takes as long as the push+pull step (bisection, fit_calls).
   per_call_crowded_s: the push+pull loop again with 4 workers and 4 servers (8 busy processes),
   solved for its per-call cost with per_message_s as found, less per_call_s, over the
   processes beyond this machine's CPUs (0 where they fit): an assumption that the cost grows
   linearly with the crowding. The veth transport's per_message_s is loopback's plus a quarter
   of what its rounds' intercept exceeds loopback's by.
5. host_cores: this machine's CPU count (every process of a validation job shares them).

Each fit is written with its points (`measured`), so a reader can see how straight the line was.
"""
import json
import os
import sys
import tempfile
import time

import numpy as np

from kvps.arrays import copy_into
from kvps.tools.capture import Lines
from kvps.tools.simulate.costs import Costs

SIZES = (4 << 10, 256 << 10, 1 << 20, 4 << 20)
QUICK_SIZES = (4 << 10, 256 << 10, 1 << 20)
CALL_KEYS, CALL_BYTES = 64, 1024     # the per-call loop: push+pull of 64 keys of 1 KB a step
CROWDED = (4, 4)                     # W, S of the per-call loop run with more processes than CPUs
FAST_RATE = "10gbit"           # the link that does not limit a calibration round
EFFICIENCY_RATE = "1gbit"
FAN_IN = (2, 4)                      # hosts sending into one link at once, for fan_in_efficiency


def sum_bandwidth(nbytes=16 << 20, repeat=5, copy=False):
    """Bytes of one operand per second of np.add(a, b, out=a) (with copy, copy_into(a, b), the
    ring kvstore's copy), the best of `repeat`."""
    a, b = np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        if copy:
            copy_into(a, b)
        else:
            np.add(a, b, out=a)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def fit(points, sum_bps, per_call_s=0.0):
    """(per_message_s, per_byte_s) from [(bytes, seconds of a round)], a round being a call of one
    key and four message ends: the slope by least squares, and the intercept through the smallest
    round (the rounds here bend upwards, which pulls a least-squares intercept below zero), less
    one call."""
    x = np.array([p[0] for p in points], float)
    y = np.array([p[1] for p in points], float)
    slope = np.polyfit(x, y, 1)[0] if len(points) > 1 else 0.0
    small = int(np.argmin(x))
    intercept = y[small] - slope * x[small]
    return max(0.0, (intercept - per_call_s) / 4), max(0.0, (slope - 1.0 / sum_bps) / 4)


def intercept(points, sum_bps):
    """A round's seconds at zero bytes (a call of one key and four message ends), as fit() takes it."""
    o, _ = fit(points, sum_bps)
    return 4 * o


def _bisect(f, target, low, high):
    """x in [low, high] with f(x) = target, for f increasing; the nearer end where none is."""
    if f(high) <= target:
        return high
    if f(low) >= target:
        return low
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if f(mid) < target else (low, mid)
    return (low + high) / 2


def _loop_s(workers, servers, per_call_s, per_message_s, sum_bps, cores, keys=CALL_KEYS, key_bytes=CALL_BYTES):
    """The model's push+pull step of `keys` keys of `key_bytes` on loopback, all processes on `cores`."""
    from kvps.tools.simulate.step import Setup, predict
    costs = Costs(transports={"loopback": {"per_message_s": per_message_s, "per_byte_s": 0.0}},
                  sum_bytes_per_s=sum_bps, copy_bytes_per_s=float("inf"), per_call_s=per_call_s, host_cores=cores)
    return predict(Setup("ps", workers, servers, mode="push+pull", coalesce_s=0.0), [key_bytes] * keys,
                   costs)["step_s"]


def fit_calls(round_s, steps, sum_bps, cores, busy=None, crowd=CROWDED, keys=CALL_KEYS, key_bytes=CALL_BYTES):
    """(per_call_s, per_message_s, per_call_crowded_s) from the loops of `keys` tiny keys.

    round_s: a one-key round (a call of one key and four message ends); steps: {"pushpull": one
    call naming every key, one message; "push+pull": a call per key each way, a message per key}
    with 1 worker and 1 server; busy: the same with crowd = (W, S) processes, or None.
    * per_call_s, per key a call names: (pushpull step - round) / (keys - 1).
    * per_message_s: the value for which the model's push+pull loop takes as long as measured,
      given per_call_s (the round's own figure, (round - per_call_s) / 4, is a latency: the loop's
      messages overlap one another and cost less).
    * per_call_crowded_s: the per_call_s for which the model's crowded loop takes as long as
      measured (per_message_s as found), less the uncrowded one, per process beyond the cores."""
    call = max(0.0, (steps["pushpull"] - round_s) / max(1, keys - 1))
    o = _bisect(lambda o: _loop_s(1, 1, call, o, sum_bps, cores, keys, key_bytes), steps["push+pull"],
                0.0, max(0.0, (round_s - call) / 4))
    crowded = 0.0
    W, S = crowd
    if busy and W + S > cores:
        crowded_call = _bisect(lambda c: _loop_s(W, S, c, o, sum_bps, cores, keys, key_bytes), busy["push+pull"],
                               0.0, busy["push+pull"])
        crowded = max(0.0, (crowded_call - call) / (W + S - cores))
    return call, o, crowded


def _plan(sizes, quick):
    from kvps.tools.bench import workloads
    plan = workloads.make_plan(sizes=sizes, resnet_steps=0, quick=quick, modes=["pushpull"])
    return plan


def _rounds(text):
    from kvps.tools.bench.pushpull import results
    return sorted((r["bytes"], r["ms"] / 1e3) for r in results(text)
                  if r.get("workload") == "round" and r.get("mode") == "pushpull")


def call_steps(quick, workers=1, servers=1, keys=CALL_KEYS, key_bytes=CALL_BYTES, timeout=120.0):
    """{mode: seconds} of a step of `keys` tiny keys on loopback (W workers, S servers): "push+pull"
    (2 calls a key) and "pushpull" (one call)."""
    from kvps.tools.bench import workloads
    from kvps.tools.bench.pushpull import kvps_job, results
    plan = workloads.make_plan(sizes=(), resnet_steps=10 if quick else 30, quick=quick,
                               modes=["push+pull", "pushpull"])
    plan["resnet"]["shapes"] = [[key_bytes // 4]] * keys
    with tempfile.TemporaryDirectory(prefix="kvps-calibrate-") as tmp:
        path = os.path.join(tmp, "plan.json")
        with open(path, "w") as f:
            json.dump(plan, f)
        # a message per key each way: pushes not coalesced (the loop measures what a message costs)
        text = kvps_job(workers, servers, [sys.executable, "-m", "kvps.tools.bench.kvps_worker", path],
                        {"KVPS_COALESCE_US": "0"}, timeout, False, "calibration (calls)")
    return {r["mode"]: r["ms"] / 1e3 for r in results(text) if r.get("workload") == "resnet50"}


def loopback_rounds(sizes, quick, timeout=120.0):
    from kvps.tools.bench.pushpull import kvps_job
    with tempfile.TemporaryDirectory(prefix="kvps-calibrate-") as tmp:
        path = os.path.join(tmp, "plan.json")
        with open(path, "w") as f:
            json.dump(_plan(sizes, quick), f)
        text = kvps_job(1, 1, [sys.executable, "-m", "kvps.tools.bench.kvps_worker", path], {}, timeout, False,
                        "calibration")
    return _rounds(text)


def emulated_rounds(sizes, quick, rate=FAST_RATE, timeout=120.0):
    """Rounds with the worker and the server on two emulated hosts. Raises KVPSError subclasses."""
    from kvps.errors import NodeFailure
    from kvps.tools.emulate import EmulatedJob, Network
    out = Lines()
    with tempfile.TemporaryDirectory(prefix="kvps-calibrate-") as tmp:
        path = os.path.join(tmp, "plan.json")
        with open(path, "w") as f:
            json.dump(_plan(sizes, quick), f)
        with Network() as net:
            job = EmulatedJob(net, 1, 1, [sys.executable, "-m", "kvps.tools.bench.kvps_worker", path],
                              env={"KVPS_TIMEOUT": f"{timeout / 2:g}"}, out=out)
            net.up(job.hosts, rate=rate)
            codes = job.run(timeout)
    if any(codes):
        raise NodeFailure(f"the emulated calibration job failed ({codes}): {out.text()[-3000:]}")
    return _rounds(out.text())


def link_efficiency(rate=EFFICIENCY_RATE, seconds=0.5, senders=1, both_ways=False, timeout=60.0):
    """Payload bit/s into one emulated link / its configured rate: `senders` hosts each make one
    TCP transfer to one host at once, of `seconds` at the rate in all; with both_ways (one
    sender), the two hosts send to each other at once (the mean of the two directions)."""
    from kvps.tools.emulate import Network, parse_rate
    from kvps.tools.emulate.probe import transfer
    bits = parse_rate(rate)
    nbytes = int(bits / 8 * seconds / senders)
    sink = f"h{senders}"
    pairs = [(f"h{i}", sink) for i in range(senders)] + ([(sink, "h0")] if both_ways else [])
    with Network() as net:
        net.up(senders + 1, rate=rate)
        results = transfer(net, pairs, nbytes, timeout)
    return sum(8 * r["bytes"] / r["seconds"] / bits for r in results.values()) / len(results)


def calibrate(quick=False, emulate=True, say=print):
    """Measure everything; returns Costs (source: this machine). Emulated parts are skipped, with
    the reason in `measured`, where namespaces are not permitted or emulate is False."""
    sizes = QUICK_SIZES if quick else SIZES
    measured = {"sizes": list(sizes), "quick": quick}
    sum_bps = sum_bandwidth(4 << 20 if quick else 16 << 20)
    copy_bps = sum_bandwidth(4 << 20 if quick else 16 << 20, copy=True)
    say(f"summation kernel: {sum_bps / 1e9:.2f} GB/s; copy: {copy_bps / 1e9:.2f} GB/s")
    defaults = Costs()
    transports = dict(defaults.transports)
    points = loopback_rounds(sizes, quick)
    cores = os.cpu_count()
    steps = call_steps(quick)
    measured.update(loopback_rounds=points, call_steps={"keys": CALL_KEYS, "key_bytes": CALL_BYTES, **steps})
    W, S = CROWDED
    busy = None
    if W + S > cores:
        busy = call_steps(quick, W, S)
        measured["crowded_call_steps"] = {"workers": W, "servers": S, **busy}
    else:
        measured["crowded_skipped"] = f"{W + S} processes fit in {cores} CPUs"
    round_s = intercept(points, sum_bps)
    per_call, o, crowded = fit_calls(round_s, steps, sum_bps, cores, busy)
    _, c = fit(points, sum_bps)
    transports["loopback"] = {"per_message_s": o, "per_byte_s": c}
    say(f"calls ({CALL_KEYS} keys of {CALL_BYTES} B, 1 worker, 1 server): pushpull {steps['pushpull'] * 1e3:.2f} ms, "
        f"push+pull {steps['push+pull'] * 1e3:.2f} ms; a one-key round {round_s * 1e3:.3f} ms: "
        f"{per_call * 1e6:.1f} us per key a call names")
    if busy:
        say(f"  with {W} workers and {S} servers on {cores} CPUs: pushpull {busy['pushpull'] * 1e3:.2f} ms, "
            f"push+pull {busy['push+pull'] * 1e3:.2f} ms: {crowded * 1e6:.1f} us more per call for each busy "
            f"process beyond the CPUs")
    say(f"loopback: {o * 1e6:.1f} us per message end + {c * 1e9:.3f} ns per byte (rounds: "
        + ", ".join(f"{b} B {s * 1e3:.2f} ms" for b, s in points) + ")")
    efficiency, fan_in = defaults.link_efficiency, {}
    if emulate:
        from kvps.tools.emulate import permitted
        ok, why = permitted()
    else:
        ok, why = False, "not asked for (--no-emulate)"
    if ok:
        veth = emulated_rounds(sizes, quick)
        measured["veth_rounds"] = veth
        # what a message end costs more between emulated hosts than on loopback, on top of loopback's
        extra = max(0.0, intercept(veth, sum_bps) - round_s) / 4
        _, c = fit(veth, sum_bps)
        transports["veth"] = {"per_message_s": o + extra, "per_byte_s": c}
        say(f"emulated hosts ({FAST_RATE}): {(o + extra) * 1e6:.1f} us per message end (loopback's + "
            f"{extra * 1e6:.1f}) + {c * 1e9:.3f} ns per byte")
        seconds = 0.2 if quick else 1.0
        one_way = link_efficiency(seconds=seconds)
        # the hosts of a step send and receive at once (the ACKs of one direction share the other)
        efficiency = link_efficiency(seconds=seconds, both_ways=True)
        measured.update(link_efficiency_at=EFFICIENCY_RATE, link_efficiency_one_way=one_way)
        say(f"link efficiency at {EFFICIENCY_RATE}: {one_way:.3f} of the configured rate one way, "
            f"{efficiency:.3f} both ways at once")
        for k in FAN_IN:
            got = link_efficiency(seconds=seconds, senders=k)
            measured[f"fan_in_{k}_one_way"] = got
            fan_in[str(k)] = efficiency * got / one_way       # scaled as the one-way figure is to both ways
            say(f"  {k} hosts sending into one link: {got:.3f} one way ({fan_in[str(k)]:.3f} scaled to both ways)")
    else:
        measured["veth_skipped"] = why
        say(f"emulated hosts skipped: {why}; the veth transport keeps its default")
    return Costs(transports=transports, sum_bytes_per_s=sum_bps, copy_bytes_per_s=copy_bps,
                 link_efficiency=efficiency, fan_in_efficiency=fan_in, latency_s=0.0,
                 per_call_s=per_call, per_call_crowded_s=crowded, host_cores=cores, measured=measured,
                 source=f"kvps simulate calibrate{' --quick' if quick else ''} on this machine, "
                        f"{cores} CPUs, {time.strftime('%Y-%m-%d %H:%M')}")
