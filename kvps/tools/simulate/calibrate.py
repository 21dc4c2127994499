"""`kvps simulate calibrate`: measure on this machine the costs the model predicts from.

    costs, lines = calibrate(quick=False)      # then costs.save("reports/simulate/costs.json")

1. The summation kernel: numpy's in-place add of two float32 arrays (what a server does with
   each push of a key, and the ring's reduce step), bytes of one operand per second.
2. Loopback: a kvps job of 1 worker and 1 server (`kvps launch`'s machinery,
   kvps/tools/bench/pushpull.py) times pushpull rounds of one key at several sizes; a round is
   four message ends, so a straight line through (bytes, seconds) gives per_message_s = its
   intercept / 4 and per_byte_s = (its slope - one summation) / 4.
3. Emulated links (where namespaces are permitted): the same job with the worker and the
   server on two `kvps emulate` hosts, at a rate high enough (10 Gbit/s) that the link is not
   what the round waits for, gives the "veth" transport; and one TCP transfer over a link at
   the validation rate gives link_efficiency (payload / configured rate).
4. host_cores: this machine's CPU count (every process of a validation job shares them).

Each fit is written with its points (`measured`), so a reader can see how straight the line was.
"""
import json
import os
import sys
import tempfile
import time

import numpy as np

from kvps.tools.simulate.costs import Costs

SIZES = (4 << 10, 256 << 10, 1 << 20, 4 << 20)
QUICK_SIZES = (4 << 10, 256 << 10, 1 << 20)
FAST_RATE = "10gbit"           # the link that does not limit a calibration round
EFFICIENCY_RATE = "1gbit"


def sum_bandwidth(nbytes=16 << 20, repeat=5):
    """Bytes of one operand per second of np.add(a, b, out=a), the best of `repeat`."""
    a, b = np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        np.add(a, b, out=a)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def fit(points, sum_bps):
    """(per_message_s, per_byte_s) from [(bytes, seconds of a round)]: least squares, four ends a round."""
    x = np.array([p[0] for p in points], float)
    y = np.array([p[1] for p in points], float)
    slope, intercept = np.polyfit(x, y, 1)
    return max(0.0, intercept / 4), max(0.0, (slope - 1.0 / sum_bps) / 4)


def _plan(sizes, quick):
    from kvps.tools.bench import workloads
    plan = workloads.make_plan(sizes=sizes, resnet_steps=0, quick=quick, modes=["pushpull"])
    return plan


def _rounds(text):
    from kvps.tools.bench.pushpull import results
    return sorted((r["bytes"], r["ms"] / 1e3) for r in results(text) if r.get("workload") == "round")


def loopback_rounds(sizes, quick, timeout=120.0):
    from kvps.tools.bench.pushpull import kvps_job
    with tempfile.TemporaryDirectory(prefix="kvps-calibrate-") as tmp:
        path = os.path.join(tmp, "plan.json")
        with open(path, "w") as f:
            json.dump(_plan(sizes, quick), f)
        text = kvps_job(1, 1, [sys.executable, "-m", "kvps.tools.bench.kvps_worker", path], {}, timeout, False,
                        "calibration")
    return _rounds(text)


class _Text:
    def __init__(self):
        self.parts = []

    def write(self, text):
        self.parts.append(text)

    def flush(self):
        pass


def emulated_rounds(sizes, quick, rate=FAST_RATE, timeout=120.0):
    """Rounds with the worker and the server on two emulated hosts. Raises KVPSError subclasses."""
    from kvps.errors import NodeFailure
    from kvps.tools.emulate import EmulatedJob, Network
    out = _Text()
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
        raise NodeFailure(f"the emulated calibration job failed ({codes}): {''.join(out.parts)[-3000:]}")
    return _rounds("".join(out.parts))


def link_efficiency(rate=EFFICIENCY_RATE, seconds=0.5, timeout=60.0):
    """Payload bit/s over one emulated link / its configured rate (one TCP transfer of `seconds`)."""
    from kvps.tools.emulate import Network, parse_rate
    from kvps.tools.emulate.probe import transfer
    bits = parse_rate(rate)
    nbytes = int(bits / 8 * seconds)
    with Network() as net:
        net.up(3, rate=rate)
        result = transfer(net, [("h1", "h2")], nbytes, timeout)["h2"]
    return 8 * result["bytes"] / result["seconds"] / bits


def calibrate(quick=False, emulate=True, say=print):
    """Measure everything; returns Costs (source: this machine). Emulated parts are skipped, with
    the reason in `measured`, where namespaces are not permitted or emulate is False."""
    sizes = QUICK_SIZES if quick else SIZES
    measured = {"sizes": list(sizes), "quick": quick}
    sum_bps = sum_bandwidth(4 << 20 if quick else 16 << 20)
    say(f"summation kernel: {sum_bps / 1e9:.2f} GB/s")
    defaults = Costs()
    transports = dict(defaults.transports)
    points = loopback_rounds(sizes, quick)
    o, c = fit(points, sum_bps)
    measured["loopback_rounds"] = points
    transports["loopback"] = {"per_message_s": o, "per_byte_s": c}
    say(f"loopback: {o * 1e6:.1f} us per message end + {c * 1e9:.3f} ns per byte (rounds: "
        + ", ".join(f"{b} B {s * 1e3:.2f} ms" for b, s in points) + ")")
    efficiency = defaults.link_efficiency
    if emulate:
        from kvps.tools.emulate import permitted
        ok, why = permitted()
    else:
        ok, why = False, "not asked for (--no-emulate)"
    if ok:
        points = emulated_rounds(sizes, quick)
        o, c = fit(points, sum_bps)
        measured["veth_rounds"] = points
        transports["veth"] = {"per_message_s": o, "per_byte_s": c}
        say(f"emulated hosts ({FAST_RATE}): {o * 1e6:.1f} us per message end + {c * 1e9:.3f} ns per byte")
        efficiency = link_efficiency(seconds=0.2 if quick else 1.0)
        measured["link_efficiency_at"] = EFFICIENCY_RATE
        say(f"link efficiency at {EFFICIENCY_RATE}: {efficiency:.3f} of the configured rate")
    else:
        measured["veth_skipped"] = why
        say(f"emulated hosts skipped: {why}; the veth transport keeps its default")
    return Costs(transports=transports, sum_bytes_per_s=sum_bps, link_efficiency=efficiency, latency_s=0.0,
                 host_cores=os.cpu_count(), measured=measured,
                 source=f"kvps simulate calibrate{' --quick' if quick else ''} on this machine, "
                        f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}")
