"""What an experiment found, in plain words, generated from its numbers and from nothing else.

    for f in findings(runs, targets):
        print(f["text"])   # "digits, W=3, no straggler: median time to 95% test accuracy over 3 runs ..."
        f["facts"]         # every number in the text: which cell, which metric, median, interval, how shown

A cell is one setting run --repeats times (metrics.cell). Each sentence is assembled from the
cells' medians and 95% bootstrap intervals (intervals.py). Orderings ("fastest first") sort the
medians, but cells whose intervals overlap the interval of the first cell of their group are
put in one group and the text says "no clear difference" between them rather than ranking
them: with 3 to 5 repeats on a shared machine, an order the intervals do not support is noise.
With one run per cell there are no intervals, and the sentence says so.

Each quoted number is recorded as a fact, {"cell": id, "metric": m, "median", "low", "high", "n",
"shown"} (a ratio of medians: "cells": [a, b], "of": m, "value"), so a test can recompute it from
the runs in results.json and find the same text in report.md.
"""
import math

from kvps.tools.experiment import intervals
from kvps.tools.experiment.metrics import cells, median, show, show_interval
from kvps.tools.experiment.presets import parse_mode


class _Sentence:
    """Text with the facts it quotes."""

    def __init__(self):
        self.parts, self.facts = [], []

    def add(self, text):
        self.parts.append(text)
        return self

    def num(self, row, metric):
        d = row[metric]
        shown = show_interval(metric, d)
        fact = {"cell": row["id"], "metric": metric, "shown": shown}
        fact.update(d or {"median": None, "low": None, "high": None, "n": 0})
        self.facts.append(fact)
        return shown

    def ratio(self, row, base, metric):
        value = median(row, metric) / median(base, metric)
        shown = show("ratio", value)
        self.facts.append({"cells": [row["id"], base["id"]], "metric": "ratio", "of": metric, "value": value,
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


def _iv(row, metric):
    return intervals.from_dict(row[metric])


def groups(rows, metric, most_first=False):
    """rows ordered by their median of metric (best first), cut into groups: a row joins the group
    before it when its interval overlaps that group's first row's interval."""
    sign = -1 if most_first else 1
    ordered = sorted(rows, key=lambda r: (sign * _iv(r, metric).median, r["id"]))
    out = []
    for row in ordered:
        if out and intervals.overlap(_iv(out[-1][0], metric), _iv(row, metric)):
            out[-1].append(row)
        else:
            out.append([row])
    return out


def _ordering(s, rows, metric, most_first=False):
    """"a x; then b y and c z, no clear difference between them" (the groups, best first), or, when
    all rows are one group, "no clear difference: a x, b y and c z"."""
    found = groups(rows, metric, most_first)
    if len(found) == 1 and len(rows) > 1:
        return "no clear difference (the 95% intervals overlap) between " + _listing(
            [f"{r['mode']} {s.num(r, metric)}" for r in found[0]])
    parts = []
    for g in found:
        text = _listing([f"{r['mode']} {s.num(r, metric)}" for r in g])
        parts.append(text + (", no clear difference between them" if len(g) > 1 else ""))
    return "; then ".join(parts)


def _over(rows):
    n = sorted({r["ok"] for r in rows})
    if n == [1]:
        return "one run each, so no intervals; a repeat can order close modes differently"
    return f"median of {_listing([str(k) for k in n])} runs, 95% bootstrap interval in brackets"


def findings(runs, targets):
    """[{"text", "facts"}] for a list of run results and {workload: target accuracy}."""
    out = []
    by_run = {r["id"]: r for r in runs}
    table = {}
    for row in cells(runs, targets):
        table.setdefault((row["workload"], row["workers"]), []).append(row)
    for (workload, workers), group in table.items():
        target = targets[workload]
        nets = list(dict.fromkeys(r["net"] for r in group))
        for net in nets:
            where = f"{workload}, W={workers}" + ("" if net == "local" else f", emulated hosts at {net}")
            here = [r for r in group if r["net"] == net and r["ok"]]
            for straggled in (False, True):
                setting = [r for r in here if r["straggler"] == straggled]
                if not setting:
                    continue
                run = by_run[setting[0]["run_ids"][0]]
                label = _straggler_label(run) if straggled else (lambda s: "no straggler")
                out.append(_race(where, label, setting, target))
                out += [f for f in (_throughput(where, label, setting), _efficiency(where, label, setting, target),
                                    _compression_effect(where, label, setting)) if f]
            out += [f for f in (_straggler_effect(where, here, by_run), _staleness(where, here), _dropped(where, here))
                    if f]
        local = [r for r in group if r["net"] == "local" and r["ok"] and not r["straggler"]]
        for net in nets[1:]:
            f = _network_effect(f"{workload}, W={workers}", net, local,
                                [r for r in group if r["net"] == net and r["ok"]])
            if f:
                out.append(f)
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
    goal = show("target", target)
    s.add(f"{where}, {label(s)}: ")
    reached = [r for r in rows if median(r, "time_to_target") is not None
               and not math.isinf(median(r, "time_to_target"))]
    missed = [r for r in rows if r not in reached]
    if not reached:
        best = max(rows, key=lambda r: median(r, "final_accuracy") or 0)
        s.add(f"no mode reached {goal} test accuracy in most of its runs; the best final accuracy was "
              f"{best['mode']}'s {s.num(best, 'final_accuracy')}.")
        return s.done()
    s.add(f"time to {goal} test accuracy ({_over(rows)}), fastest first: ")
    s.add(_ordering(s, reached, "time_to_target"))
    if missed:
        s.add("; not reached in most runs: " + _listing(
            [f"{r['mode']} (final accuracy {s.num(r, 'final_accuracy')})" for r in missed]))
    return s.add(".").done()


def _throughput(where, label, rows):
    rated = [r for r in rows if r["updates_per_s"]]
    if len(rated) < 2:
        return None
    s = _Sentence()
    s.add(f"{where}, {label(s)}: gradients applied per second, most first: ")
    s.add(_ordering(s, rated, "updates_per_s", most_first=True) + _geo_note(rated) + ".")
    return s.done()


def _efficiency(where, label, rows, target):
    counted = [r for r in rows if r["updates_to_target"] and not math.isinf(median(r, "updates_to_target"))]
    if len(counted) < 2:
        return None
    s = _Sentence()
    s.add(f"{where}, {label(s)}: gradients applied until {show('target', target)} test accuracy, fewest first: ")
    s.add(_ordering(s, counted, "updates_to_target") + _geo_note(counted) + ".")
    return s.done()


def _geo_note(rows):
    """What a gradient is under GEO-SGD, where one of the rows is a geo mode."""
    geo = sorted({r["mode"] for r in rows if parse_mode(r["mode"]).family == "geo"})
    if not geo:
        return ""
    return (f" (under {_listing(geo)} a gradient is one worker's local step, counted when its change "
            f"reaches the servers, K steps in one push)")


def _compression_effect(where, label, rows):
    """Each compressed cell beside the same mode without compression, in one setting."""
    plain = {r["mode"]: r for r in rows if parse_mode(r["mode"]).compression is None}
    pairs = [(r, plain[parse_mode(r["mode"]).base]) for r in rows
             if parse_mode(r["mode"]).compression is not None and parse_mode(r["mode"]).base in plain]
    if not pairs:
        return None
    s = _Sentence()
    s.add(f"{where}, {label(s)}: gradient compression against the same mode without it "
          f"({_over([r for pair in pairs for r in pair])}), compressed / plain: ")
    items = []
    for c, b in pairs:
        text = (f"{c['mode']} time to target {s.num(c, 'time_to_target')} / {s.num(b, 'time_to_target')}, "
                f"final accuracy {s.num(c, 'final_accuracy')} / {s.num(b, 'final_accuracy')}")
        if c["step_ms"] and b["step_ms"]:
            text += f", step {s.num(c, 'step_ms')} / {s.num(b, 'step_ms')}"
        verdicts = [v for v in (_versus(c, b, "time_to_target", "time", ("faster", "slower")),
                                _versus(c, b, "final_accuracy", "accuracy", ("lower", "higher")),
                                _versus(c, b, "step_ms", "step", ("shorter", "longer"))) if v]
        items.append(text + (f" ({'; '.join(verdicts)})" if verdicts else ""))
    return s.add("; ".join(items) + ".").done()


def _versus(a, b, metric, name, words):
    """"no clear difference in time", or a's side of the comparison ("slower"), when both cells
    have intervals (more than one run); None otherwise."""
    if a[metric] is None or b[metric] is None or a["ok"] < 2 or b["ok"] < 2:
        return None
    ia, ib = _iv(a, metric), _iv(b, metric)
    if intervals.overlap(ia, ib):
        return f"no clear difference in {name}"
    return f"{name}: {words[0] if ia.median < ib.median else words[1]}"


def _straggler_effect(where, rows, by_run):
    keyed = {(r["mode"], r["straggler"]): r for r in rows}
    pairs = [(keyed[(m, True)], keyed[(m, False)]) for (m, straggled) in keyed if straggled
             and (m, False) in keyed and median(keyed[(m, True)], "updates_per_s")
             and median(keyed[(m, False)], "updates_per_s")]
    if not pairs:
        return None
    pairs.sort(key=lambda p: -median(p[0], "updates_per_s") / median(p[1], "updates_per_s"))
    s = _Sentence()
    run = by_run[pairs[0][0]["run_ids"][0]]
    s.add(f"{where}: with the straggler (W{run['straggler']['rank']} +{s.delay(run)} per step")
    base = keyed.get(("sync", False))
    if base and base["step_ms"]:
        s.add(f"; a sync step without it took {s.num(base, 'step_ms')}")
    s.add("), each mode kept this share of its straggler-free throughput (a ratio of medians), most kept first: ")
    items = []
    for a, b in pairs:
        same = intervals.overlap(_iv(a, "updates_per_s"), _iv(b, "updates_per_s")) and a["ok"] > 1
        items.append(f"{a['mode']} {s.ratio(a, b, 'updates_per_s')}"
                     + (" (no clear difference from without it)" if same else ""))
    s.add(_listing(items))
    slow = [(a, b) for a, b in pairs if not math.isinf(median(a, "time_to_target") or math.inf)
            and not math.isinf(median(b, "time_to_target") or math.inf)]
    if slow:
        s.add("; time to target with / without it: " + _listing(
            [f"{a['mode']} {s.num(a, 'time_to_target')} / {s.num(b, 'time_to_target')}" for a, b in slow]))
    return s.add(".").done()


def _network_effect(where, net, local, emulated):
    """Each mode's emulated cell beside its loopback twin."""
    twins = {r["mode"]: r for r in local}
    pairs = [(e, twins[e["mode"]]) for e in emulated if e["mode"] in twins and median(e, "updates_per_s")
             and median(twins[e["mode"]], "updates_per_s")]
    if not pairs:
        return None
    s = _Sentence()
    s.add(f"{where}: on emulated hosts with {net} links (each node on a host of its own) against this machine's "
          f"loopback, gradients applied per second, emulated / local: ")
    s.add(_listing([f"{e['mode']} {s.num(e, 'updates_per_s')} / {s.num(b, 'updates_per_s')} "
                    f"({s.ratio(e, b, 'updates_per_s')})" for e, b in pairs]))
    order = groups([e for e, _ in pairs], "updates_per_s", most_first=True)
    if len(pairs) == 1:
        pass
    elif len(order) > 1:
        s.add(f"; on the emulated links {_listing([r['mode'] for r in order[0]])} applied the most")
    else:
        s.add("; on the emulated links there is no clear difference between the modes' throughput")
    return s.add(".").done()


def _staleness(where, rows):
    measured = [r for r in rows if r["mean_staleness"] is not None]
    if not measured:
        return None
    s = _Sentence()
    s.add(f"{where}: mean staleness of applied pushes (updates to the key between the pushing worker's pull and "
          f"its push), highest first: ")
    ordered = sorted(measured, key=lambda r: (-median(r, "mean_staleness"), r["id"]))
    s.add(_listing([f"{r['mode']}{' with the straggler' if r['straggler'] else ''} "
                    f"{s.num(r, 'mean_staleness')} (max {s.num(r, 'max_staleness')})" for r in ordered]))
    missing = sorted({r["mode"] for r in rows if r["mean_staleness"] is None and r["mode"] != "allreduce"})
    if missing:
        s.add("; the servers reported no staleness histogram for " + _listing(missing))
    return s.add(".").done()


def _dropped(where, rows):
    dropping = sorted((r for r in rows if r["dropped"] and median(r, "dropped")), key=lambda r: r["id"])
    if not dropping:
        return None
    s = _Sentence()
    s.add(f"{where}: pushes dropped as late by backup workers: ")
    s.add(_listing([f"{r['mode']}{' with the straggler' if r['straggler'] else ''} {s.num(r, 'dropped')} "
                    f"({s.num(r, 'dropped_share')} of its pushes)" for r in dropping]) + ".")
    return s.done()
