"""What an experiment found, in plain words, generated from its numbers and from nothing else.

    for f in findings(runs, targets):
        print(f["text"])        # "digits, W=3, no straggler: ssp:4 reached 95% test accuracy first, in 1.21 s; ..."
        f["facts"]              # every number in the text: which run, which metric, its value, how shown

Each sentence is assembled from the runs' metrics (kvps.tools.experiment.metrics); comparisons
("first", "most") come from sorting those numbers. Each quoted number is recorded as a fact,
{"run": id, "metric": m, "value": v, "shown": s} (a ratio: "runs": [a, b] and "of": m), so a test
can recompute it from results.json and find the same text in report.md.
"""
from kvps.tools.experiment.metrics import show, summarize


class _Sentence:
    """Text with the facts it quotes."""

    def __init__(self):
        self.parts, self.facts = [], []

    def add(self, text):
        self.parts.append(text)
        return self

    def num(self, row, metric, value=None):
        value = row[metric] if value is None else value
        shown = show(metric, value)
        self.facts.append({"run": row["id"], "metric": metric, "value": value, "shown": shown})
        return shown

    def ratio(self, row, base, metric):
        value = row[metric] / base[metric]
        shown = show("ratio", value)
        self.facts.append({"runs": [row["id"], base["id"]], "metric": "ratio", "of": metric, "value": value,
                           "shown": shown})
        return shown

    def delay(self, run):
        value = run["straggler"]["delay_s"] * 1e3
        shown = show("delay_ms", value)
        self.facts.append({"run": run["id"], "metric": "delay_ms", "value": value, "shown": shown})
        return shown

    def done(self):
        return {"text": "".join(self.parts), "facts": self.facts}


def _listing(items):
    return ", ".join(items[:-1]) + (" and " if len(items) > 1 else "") + items[-1] if items else ""


def findings(runs, targets):
    """[{"text", "facts"}] for a list of run results and {workload: target accuracy}."""
    out = []
    groups = {}
    for run in runs:
        groups.setdefault((run["workload"], run["workers"]), []).append(run)
    for (workload, workers), group in groups.items():
        target = targets[workload]
        rows = {(r["mode"], r["straggler"] is not None): summarize(r, target) for r in group if r["status"] == "ok"}
        by_id = {r["id"]: r for r in group}
        where = f"{workload}, W={workers}"
        for straggled in (False, True):
            setting = [row for (mode, s), row in rows.items() if s == straggled]
            if not setting:
                continue
            label = _straggler_label(by_id[setting[0]["id"]]) if straggled else (lambda s: "no straggler")
            out.append(_race(where, label, setting, target))
            out += [f for f in (_throughput(where, label, setting), _efficiency(where, label, setting, target)) if f]
        out += [f for f in (_straggler_effect(where, rows, by_id), _staleness(where, rows), _dropped(where, rows))
                if f]
    failed = [r for r in runs if r["status"] != "ok"]
    if failed:
        out.append({"text": f"{len(failed)} of {len(runs)} runs did not finish: " +
                    _listing([f"{r['id']} ({r['status']}: {r['error']})" for r in failed]) +
                    "; their output is under 'Runs that failed'.", "facts": []})
    return out


def _straggler_label(run):
    """The words for a straggler setting, as a function that records the delay it quotes."""
    return lambda s: f"straggler W{run['straggler']['rank']} +{s.delay(run)} per step"


def _race(where, label, rows, target):
    s = _Sentence()
    s.add(f"{where}, {label(s)}: ")
    reached = sorted((r for r in rows if r["time_to_target"] is not None), key=lambda r: r["time_to_target"])
    missed = [r for r in rows if r["time_to_target"] is None]
    goal = show("target", target)
    if not reached:
        best = max(rows, key=lambda r: r["final_accuracy"])
        s.add(f"no mode reached {goal} test accuracy; the best final accuracy was {best['mode']}'s "
              f"{s.num(best, 'final_accuracy')}.")
        return s.done()
    first = reached[0]
    s.add(f"{first['mode']} reached {goal} test accuracy first, in {s.num(first, 'time_to_target')}")
    if len(reached) > 1:
        s.add("; then " + _listing([f"{r['mode']} {s.num(r, 'time_to_target')}" for r in reached[1:]]))
    if missed:
        s.add("; not reached within the run: " + _listing(
            [f"{r['mode']} (final {s.num(r, 'final_accuracy')})" for r in missed]))
    return s.add(".").done()


def _throughput(where, label, rows):
    rated = sorted((r for r in rows if r["updates_per_s"]), key=lambda r: -r["updates_per_s"])
    if len(rated) < 2:
        return None
    s = _Sentence()
    s.add(f"{where}, {label(s)}: gradients applied per second, most first: ")
    s.add(_listing([f"{r['mode']} {s.num(r, 'updates_per_s')}" for r in rated]) + ".")
    return s.done()


def _efficiency(where, label, rows, target):
    counted = sorted((r for r in rows if r["updates_to_target"] is not None), key=lambda r: r["updates_to_target"])
    if len(counted) < 2:
        return None
    s = _Sentence()
    s.add(f"{where}, {label(s)}: gradients applied until {show('target', target)} test accuracy, "
          f"fewest first: ")
    s.add(_listing([f"{r['mode']} {s.num(r, 'updates_to_target')}" for r in counted]) + ".")
    return s.done()


def _straggler_effect(where, rows, by_id):
    pairs = [(rows[(m, True)], rows[(m, False)]) for (m, s) in rows if s and (m, False) in rows
             and rows[(m, True)]["updates_per_s"] and rows[(m, False)]["updates_per_s"]]
    if not pairs:
        return None
    pairs.sort(key=lambda p: -p[0]["updates_per_s"] / p[1]["updates_per_s"])
    s = _Sentence()
    run = by_id[pairs[0][0]["id"]]
    s.add(f"{where}: with the straggler (W{run['straggler']['rank']} +{s.delay(run)} per step")
    base = rows.get(("sync", False))
    if base and base["step_ms"]:
        s.add(f"; a sync step without it took {s.num(base, 'step_ms')}")
    s.add("), each mode kept this share of its straggler-free throughput, most kept first: ")
    s.add(_listing([f"{a['mode']} {s.ratio(a, b, 'updates_per_s')}" for a, b in pairs]))
    slow = [(a, b) for a, b in pairs if a["time_to_target"] is not None and b["time_to_target"] is not None]
    if slow:
        s.add("; time to target with / without it: " + _listing(
            [f"{a['mode']} {s.num(a, 'time_to_target')} / {s.num(b, 'time_to_target')}" for a, b in slow]))
    return s.add(".").done()


def _staleness(where, rows):
    measured = [r for r in rows.values() if r["mean_staleness"] is not None]
    if not measured:
        return None
    s = _Sentence()
    s.add(f"{where}: mean staleness of applied pushes (updates to the key between the pushing worker's pull and its push), highest first: ")
    ordered = sorted(measured, key=lambda r: (-r["mean_staleness"], r["id"]))
    s.add(_listing([f"{r['mode']}{' with the straggler' if r['straggler'] else ''} "
                    f"{s.num(r, 'mean_staleness')} (max {s.num(r, 'max_staleness')})" for r in ordered]))
    missing = sorted({r["mode"] for r in rows.values() if r["mean_staleness"] is None and r["mode"] != "allreduce"})
    if missing:
        s.add("; the servers reported no staleness histogram for " + _listing(missing))
    return s.add(".").done()


def _dropped(where, rows):
    dropping = sorted((r for r in rows.values() if r["dropped"]), key=lambda r: r["id"])
    if not dropping:
        return None
    s = _Sentence()
    s.add(f"{where}: pushes dropped as late by backup workers: ")
    s.add(_listing([f"{r['mode']}{' with the straggler' if r['straggler'] else ''} {s.num(r, 'dropped')} "
                    f"({s.num(r, 'dropped_share')} of its pushes)" for r in dropping]) + ".")
    return s.done()
