"""The numbers the report quotes, computed from a run's raw results, and how each is shown.

    row = summarize(run, target=0.95)     # time_to_target, updates_per_s, mean_staleness, ...
    show("time_to_target", row["time_to_target"])   # "1.23 s" or "not reached"

Pure functions of the dicts in results.json, so a test can recompute every number the report
quotes. Definitions:

* time_to_target: rank 0's training clock at its first evaluation with test accuracy >= target
  (so its resolution is the evaluation interval); None if never reached.
* updates_to_target: the gradients applied by then, over all workers.
* updates_per_s: gradients applied per second of rank 0's training: its last point's updates / time.
* mean_staleness, max_staleness: over the servers' histogram of applied pushes (index = staleness).
* dropped_share: pushes dropped (backup workers) / pushes received.

A cell is one setting (workload, W, mode, straggler, network) run --repeats times with different
seeds; cell() gives its row: for each metric the median over the runs that finished and the 95%
bootstrap interval of that median (intervals.py). For time and updates to target, a run that
never reached the target counts as infinitely slow, so a median that is "not reached" means most
runs did not reach it.
"""
import math

from kvps.tools.experiment import intervals


def reach(points, target, axis="time"):
    """`axis` of the first point with accuracy >= target, or None."""
    for p in points:
        if p["accuracy"] >= target:
            return p[axis]
    return None


def mean_staleness(hist):
    total = sum(hist)
    return sum(i * n for i, n in enumerate(hist)) / total if total else None


def max_staleness(hist):
    nonzero = [i for i, n in enumerate(hist) if n]
    return nonzero[-1] if nonzero else None


def summarize(run, target):
    """One row of the report's table for a run (None where a number does not apply)."""
    points = run.get("points") or []
    last = points[-1] if points else None
    server = run.get("server") or {}
    hist = server.get("staleness") or []
    pushes = server.get("pushes") or 0
    rank0 = next((f for f in run.get("finals", []) if f.get("rank") == 0), {})
    return {
        "id": run["id"], "workload": run["workload"], "mode": run["mode"], "workers": run["workers"],
        "straggler": run.get("straggler") is not None, "status": run["status"], "target": target,
        "time_to_target": reach(points, target, "time"),
        "updates_to_target": reach(points, target, "updates"),
        "final_accuracy": last["accuracy"] if last else None,
        "best_accuracy": max(p["accuracy"] for p in points) if points else None,
        "final_loss": last["loss"] if last else None,
        "updates_per_s": last["updates"] / last["time"] if last and last["time"] > 0 else None,
        "step_ms": rank0.get("step_ms"),
        "mean_staleness": mean_staleness(hist),
        "max_staleness": max_staleness(hist),
        "dropped": server.get("dropped") if server else None,
        "dropped_share": server.get("dropped", 0) / pushes if pushes else None,
        "steps": {f["rank"]: f["steps"] for f in run.get("finals", []) if "rank" in f},
    }


CELL_METRICS = ("time_to_target", "updates_to_target", "updates_per_s", "final_accuracy", "final_loss", "step_ms",
                "mean_staleness", "max_staleness", "dropped", "dropped_share")
CENSORED = ("time_to_target", "updates_to_target")      # None there: not reached, ranked as +inf


def cell_id(run):
    """The setting a run repeats: its id without the repeat suffix."""
    return run.get("cell", run["id"])


def cell(runs, target):
    """The row of one cell from its runs (all of one setting): {"id", "workload", "mode", "workers",
    "straggler", "net", "runs", "ok", "seeds", metric: interval dict or None, ...}. Metrics of runs
    that did not finish are left out; a metric no finished run has is None."""
    first = runs[0]
    rows = [summarize(r, target) for r in runs if r["status"] == "ok"]
    out = {"id": cell_id(first), "workload": first["workload"], "mode": first["mode"], "workers": first["workers"],
           "straggler": first.get("straggler") is not None, "net": first.get("net", "local"), "target": target,
           "runs": len(runs), "ok": len(rows), "run_ids": [r["id"] for r in runs],
           "reached": sum(1 for r in rows if r["time_to_target"] is not None)}
    for metric in CELL_METRICS:
        if metric in CENSORED:
            values = [r[metric] for r in rows]
        else:
            values = [r[metric] for r in rows if r[metric] is not None]
        out[metric] = intervals.as_dict(intervals.interval(values)) if values else None
    return out


def cells(runs, targets):
    """[cell row] for every setting in the runs, in the order each first ran."""
    groups = {}
    for run in runs:
        groups.setdefault(cell_id(run), []).append(run)
    return [cell(group, targets[group[0]["workload"]]) for group in groups.values()]


def median(row, metric):
    """A cell's median of metric (inf for "not reached"), or None when no finished run has it."""
    d = row.get(metric)
    return None if d is None else intervals.from_dict(d).median


FORMATS = {
    "time_to_target": lambda v: f"{v:.2f} s",
    "updates_to_target": lambda v: f"{int(v):,}",
    "final_accuracy": lambda v: f"{v:.3f}",
    "best_accuracy": lambda v: f"{v:.3f}",
    "final_loss": lambda v: f"{v:.4f}",
    "updates_per_s": lambda v: f"{v:,.0f}",
    "step_ms": lambda v: f"{v:.2f} ms",
    "mean_staleness": lambda v: f"{v:.2f}",
    "max_staleness": lambda v: f"{int(v)}",
    "dropped": lambda v: f"{int(v):,}",
    "dropped_share": lambda v: f"{100 * v:.1f}%",
    "ratio": lambda v: f"{v:.2f}x",
    "delay_ms": lambda v: f"{v:.2f} ms",
    "target": lambda v: f"{100 * v:g}%",
}
MISSING = {"time_to_target": "not reached", "updates_to_target": "not reached"}


def show(metric, value):
    """A number as the report prints it."""
    if value is None or (isinstance(value, float) and math.isinf(value)):
        return MISSING.get(metric, "n/a")
    return FORMATS[metric](value)


def show_interval(metric, d):
    """A cell's metric as the report prints it: "1.21 s (1.05 to 1.40)", the median alone for one
    run or when every run gave the same value, "n/a" when no finished run has it."""
    if d is None:
        return "n/a"
    iv = intervals.from_dict(d)
    low, high = show(metric, iv.low), show(metric, iv.high)
    if iv.n == 1 or low == high:
        return show(metric, iv.median)
    return f"{show(metric, iv.median)} ({low} to {high})"
