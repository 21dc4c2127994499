"""`kvps simulate sweep`: predicted step time and scaling efficiency from 2 to 1,024 workers, the
parameter server at its best server count beside the ring.

    rows = sweep(costs, workers=[2, 4, ..., 1024], rates=[10e9, 25e9, 100e9], models=["resnet50", "bert-large"])

For each model, rate and W: the ring's step, and the PS's at each S of `servers` (default: 1,
W/4, W/2, W: dedicated server hosts, BytePS's setting) with the best S reported. Scaling efficiency
is compute / step: the share of a step spent computing, i.e. throughput over W x one worker's
throughput (compute_s from models.py unless --compute-ms). Every process has CPUs of its own
(costs.host_cores is ignored here) and pays the "loopback" transport's measured costs per message
and byte (what a kvps process spends on a message when no link limits it; --transport cluster
takes the file's assumed figures for a faster stack instead).
"""
import math

from kvps.tools.simulate.models import compute_s, tensors
from kvps.tools.simulate.step import Setup, predict


def parse_workers(text):
    """[2, 4, ..., 1024] from "2..1024" (doubling), or a comma list; raises ValueError naming the text."""
    text = str(text).strip()
    try:
        if ".." in text:
            lo, hi = (int(v) for v in text.split(".."))
            if lo < 1 or hi < lo:
                raise ValueError
            out = []
            while lo <= hi:
                out.append(lo)
                lo *= 2
            return out
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--workers {text!r} is not LOW..HIGH (doubling) or a comma-separated list of counts") from None
    if any(v < 1 for v in values):
        raise ValueError(f"--workers {text!r}: every count must be at least 1")
    return values


def server_choices(W, servers=None):
    if servers:
        return sorted(set(servers))
    return sorted({1, max(1, W // 4), max(1, W // 2), W})


def sweep(costs, workers, rates, models, servers=None, compute=None, say=None, transport="loopback"):
    """[row]: model, rate, W, ring_s, ps_s, best_S, ps_by_S {S: s}, compute_s, ring_eff, ps_eff."""
    costs = costs.replace(host_cores=None)
    rows = []
    for model in models:
        grads = tensors(model)
        c = compute_s(model) if compute is None else compute
        for rate in rates:
            for W in workers:
                ring = predict(Setup("ring", W, rate=rate, transport=transport, compute_s=c), grads, costs)["step_s"]
                by_S = {S: predict(Setup("ps", W, S, rate=rate, transport=transport, compute_s=c), grads,
                                   costs)["step_s"] for S in server_choices(W, servers)}
                best = min(by_S, key=lambda S: (by_S[S], S))
                row = {"model": model, "rate": rate, "W": W, "compute_s": c, "ring_s": ring, "ps_s": by_S[best],
                       "best_S": best, "ps_by_S": by_S,
                       "ring_eff": c / ring if ring and c else None, "ps_eff": c / by_S[best] if c else None}
                rows.append(row)
                if say:
                    say(f"[sweep] {model} {rate / 1e9:g} Gbit/s W={W}: ring {ring * 1e3:.0f} ms, PS {by_S[best] * 1e3:.0f} "
                        f"ms at S={best}")
    return rows


def table(rows):
    lines = ["| model | Gbit/s | W | compute ms | ring step ms | ring efficiency | PS step ms (best S) | PS efficiency "
             "| PS / ring |", "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        def eff(v):
            return "-" if v is None else f"{100 * v:.0f}%"
        lines.append(f"| {r['model']} | {r['rate'] / 1e9:g} | {r['W']} | {r['compute_s'] * 1e3:.0f} | "
                     f"{r['ring_s'] * 1e3:.0f} | {eff(r['ring_eff'])} | {r['ps_s'] * 1e3:.0f} (S={r['best_S']}) | "
                     f"{eff(r['ps_eff'])} | {r['ps_s'] / r['ring_s']:.2f} |")
    return lines


def plot(rows, path):
    """Scaling efficiency against W, one panel per model, a line per system and rate. Returns the
    path, or None where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        for i, rate in enumerate(dict.fromkeys(r["rate"] for r in mine)):
            pts = [r for r in mine if r["rate"] == rate]
            W = [r["W"] for r in pts]
            ax.plot(W, [r["ring_eff"] or 0 for r in pts], color=f"C{i}", linestyle="--", marker=".",
                    label=f"ring {rate / 1e9:g} Gbit/s")
            ax.plot(W, [r["ps_eff"] or 0 for r in pts], color=f"C{i}", marker="o",
                    label=f"PS, best S, {rate / 1e9:g} Gbit/s")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("workers")
        ax.set_ylabel("scaling efficiency (compute / step)")
        ax.set_title(f"{model} (compute {mine[0]['compute_s'] * 1e3:.0f} ms/step)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("kvps simulate sweep: predicted, not measured")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def crossover(rows):
    """{(model, rate): [the W where the best PS is faster than the ring]}."""
    out = {}
    for r in rows:
        faster = out.setdefault((r["model"], r["rate"]), [])
        if r["ps_s"] < r["ring_s"] and not math.isclose(r["ps_s"], r["ring_s"], rel_tol=1e-3):
            faster.append(r["W"])
    return out
