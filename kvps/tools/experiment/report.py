"""The experiment's report directory: report.md, results.json and PNG plots.

    write(out_dir, results)      # results: the dict cli.py builds (runs, targets, findings, ...)

Plots (matplotlib, Agg backend; skipped with a note in report.md where matplotlib is missing):
    {workload}-W{W}[-{rate}]-{none|straggler}.png   test accuracy vs time, vs gradients applied; loss vs
                                           time: each cell's median over its repeats, a band from the
                                           lowest to the highest run
    {workload}-W{W}[-{rate}]-{none|straggler}-{geo|compression}.png   the same, for GEO-SGD beside sync
                                           and async, and for compressed cells beside their plain mode
                                           (where the setting has more than those)
    {workload}-W{W}-intervals.png          time to target and updates/s of every cell, median and 95% interval
    {workload}-W{W}-staleness.png          the staleness histogram of each mode's applied pushes
"""
import json
import os

from kvps.tools.experiment.metrics import cell_id, cells, show, show_interval, summarize
from kvps.tools.experiment.presets import parse_mode

STALENESS_BINS = 16          # the last bar holds every push at least this stale


def write(out_dir, results):
    """Write results.json, the plots and report.md into out_dir; returns report.md's path."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    plots, note = _plots(out_dir, results)
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write(markdown(results, plots, note))
    return path


# ---- markdown ----
CELL_COLUMNS = ("time_to_target", "updates_to_target", "final_accuracy", "updates_per_s", "step_ms",
                "mean_staleness", "max_staleness", "dropped")
RUN_COLUMNS = ("time_to_target", "updates_to_target", "final_accuracy", "final_loss", "updates_per_s", "step_ms",
               "mean_staleness", "max_staleness", "dropped")


def _net_label(net):
    return "loopback" if net == "local" else f"emulated {net}"


def markdown(results, plots=(), plot_note=None):
    runs, targets = results["runs"], results["targets"]
    repeats = results.get("repeats", 1)
    lines = [f"# kvps experiment: consistency modes on real training ({results['preset']} preset)", "",
             f"Run {results['started']} on {results['machine']}; `{results['command']}`; "
             f"{len(runs)} runs in {results['wall_s']:.0f} s of wall time. Raw numbers: `results.json`.", "",
             "## What ran", ""]
    for name, text in results["workloads"].items():
        lines.append(f"* **{name}**: {text}; target {show('target', targets[name])} test accuracy.")
    lines += [f"* Modes: {', '.join(f'{m} (`{t}`)' for m, t in results['modes'].items())}."]
    if any(parse_mode(m).family == "geo" for m in results["modes"]):
        lines.append("* GEO-SGD (`geo:K`): every worker steps its own SGD and sends its weights' change every K "
                     "steps; the servers add the changes (no server optimizer). A gradient (updates) is one "
                     "worker's local step, counted when its change reaches the servers; rank 0 evaluates the "
                     "merged weights it brings back at a sync.")
    if any(parse_mode(m).compression is not None for m in results["modes"]):
        lines.append("* Compression (`MODE+CODEC`, `+pull`): pushes compressed (2bit, 1bit and topk with error "
                     "feedback); with `+pull` the servers' replies too, which with a server optimizer or GEO are "
                     "weights, sent as compressed changes against each worker's copy (docs/compression.md).")
    lines += [f"* Skipped: {w} {m}: {why}." for w, m, why in results.get("skipped", [])]
    lines += [f"* Workers: {', '.join(str(w) for w in results['workers'])}; parameter-server modes use "
              f"{results['servers']} server(s), the ring none.",
              f"* Repeats: every cell (workload, W, mode, straggler, network) ran {repeats} time(s), repeat r with "
              f"seed {results.get('seed', 0)} + r (data split, initial weights, batches, straggler delays); the "
              f"repeats of the whole grid run in turn, so a slow spell of the machine spreads over the cells. "
              f"Tables give the median and, in brackets, its 95% bootstrap interval "
              f"(kvps/tools/experiment/intervals.py; with 3 to 5 runs that is the range of the runs).",
              "* Straggler: the last worker sleeps an extra delay before each step's first push, set to the "
              "sync step time measured without it (a 2x straggler):"]
    for s in results["stragglers"]:
        lines.append(f"  * {s['workload']}, W={s['workers']}: W{s['rank']} +{show('delay_ms', s['delay_s'] * 1e3)} "
                     f"per step ({s['kind']}; {s['source']}).")
    emulate = results.get("emulate")
    if emulate:
        if emulate.get("skipped"):
            lines.append(f"* Emulated hosts ({', '.join(emulate['rates'])}): skipped: {emulate['skipped']}.")
        else:
            lines.append(f"* Emulated hosts: the straggler-free cells ran again under `kvps emulate` at "
                         f"{', '.join(emulate['rates'])} per host link (both ways), every scheduler, server and "
                         f"worker in a network namespace of its own (docs/emulate.md); the CPUs are still this "
                         f"machine's, shared by all. The other cells ran on loopback, every process on this machine.")
    else:
        lines.append("* Every process on this one machine, over loopback.")
    lines += ["", "## Findings", "",
              "Generated from this run's numbers (docs/experiment.md has the definitions). Where the 95% "
              "intervals of two cells overlap, the findings say \"no clear difference\" instead of ranking them.", ""]
    lines += [f"* {f['text']}" for f in results["findings"]] or ["* No run finished; nothing to report."]
    lines += ["", "## Time to target and throughput", "",
              "Time to target: rank 0's training clock (start-up and evaluation excluded) at its first "
              "evaluation at or above the target (\"not reached\" counts as slower than any time). Updates: "
              "gradients applied, over all workers. Median over the runs that finished (95% interval).", ""]
    rows = summary_cells(results)
    for (workload, workers), group in _groups(rows):
        target = targets[workload]
        lines += [f"### {workload}, W={workers} (target {show('target', target)})", "",
                  "| mode | straggler | network | runs ok | time to target | updates to target | final accuracy "
                  "| updates/s | step (rank 0) | mean staleness | max staleness | dropped |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in group:
            cells = [r["mode"], "yes" if r["straggler"] else "no", _net_label(r["net"]), f"{r['ok']}/{r['runs']}"]
            cells += [show_interval(m, r[m]) if r["ok"] else "-" for m in CELL_COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Every run", "",
              "| run | seed | status | time to target | updates to target | final accuracy | final loss | updates/s "
              "| step (rank 0) | steps of each worker | mean staleness | max staleness | dropped |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        r = summarize(run, targets[run["workload"]])
        shown = [show(m, r[m]) if r["status"] == "ok" else "-" for m in RUN_COLUMNS]
        steps = "/".join(str(r["steps"][k]) for k in sorted(r["steps"])) if r["status"] == "ok" else "-"
        lines.append("| " + " | ".join([run["id"], str(run.get("seed", "-")), r["status"], *shown[:6], steps,
                                        *shown[6:]]) + " |")
    lines += ["", "## Plots", ""]
    if plot_note:
        lines += [plot_note, ""]
    for name, caption in plots:
        lines += [f"![{caption}]({name})", ""]
    failed = [r for r in runs if r["status"] != "ok"]
    if failed:
        lines += ["## Runs that failed", ""]
        for r in failed:
            lines += [f"### {r['id']}: {r['status']}", "", f"{r['error']}; `{r['command']}`", "", "```"]
            lines += r["tail"] or ["(no output)"]
            lines += ["```", ""]
    return "\n".join(lines) + "\n"


def summary_cells(results):
    """The cell rows (metrics.cells) of the results' runs."""
    return cells(results["runs"], results["targets"])


def _groups(items):
    groups = {}
    for item in items:
        groups.setdefault((item["workload"], item["workers"]), []).append(item)
    return groups.items()


# ---- plots ----
GRID_POINTS = 60           # points of the common axis the repeats of a cell are interpolated onto


def _plots(out_dir, results):
    """[(file name, caption)] of the PNGs written, and a note if none could be."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "No plots: matplotlib is not installed (pip install 'kvps[plot]')."
    made = []
    rows = summary_cells(results)
    by_cell = {}
    for run in results["runs"]:
        if run["status"] == "ok" and run["points"]:
            by_cell.setdefault(cell_id(run), []).append(run)
    for (workload, workers), group in _groups(results["runs"]):
        target = results["targets"][workload]
        for net in dict.fromkeys(r.get("net", "local") for r in group):
            tag = "" if net == "local" else f"-{net}"
            for straggled in (False, True):
                chosen = [c for c in dict.fromkeys(cell_id(r) for r in group if r.get("net", "local") == net
                                                   and (r["straggler"] is not None) == straggled) if c in by_cell]
                if not chosen:
                    continue
                name = f"{workload}-W{workers}{tag}-{'straggler' if straggled else 'none'}.png"
                caption = (f"{workload}, W={workers}, {_net_label(net)}, "
                           f"{'with the straggler' if straggled else 'no straggler'}")
                _curves(plt, os.path.join(out_dir, name), [by_cell[c] for c in chosen], target, caption)
                made.append((name, caption))
                for focus, picked in _focus([by_cell[c] for c in chosen]):
                    name = f"{workload}-W{workers}{tag}-{'straggler' if straggled else 'none'}-{focus}.png"
                    _curves(plt, os.path.join(out_dir, name), picked, target, f"{caption}: {FOCUS[focus]}")
                    made.append((name, f"{caption}: {FOCUS[focus]}"))
        mine = [r for r in rows if r["workload"] == workload and r["workers"] == workers and r["ok"]]
        if mine:
            name = f"{workload}-W{workers}-intervals.png"
            caption = f"{workload}, W={workers}: medians and 95% intervals of every cell"
            _intervals(plt, os.path.join(out_dir, name), mine, caption)
            made.append((name, caption))
        staled = [r for r in group if (r.get("server") or {}).get("staleness")]
        if staled:
            name = f"{workload}-W{workers}-staleness.png"
            caption = f"{workload}, W={workers}: staleness of applied pushes"
            _staleness(plt, os.path.join(out_dir, name), _first_repeats(staled), caption)
            made.append((name, caption))
    return made, None


FOCUS = {"geo": "GEO-SGD beside sync and async", "compression": "compressed cells beside their plain mode"}


def _focus(cell_runs):
    """[(focus, the cells' runs to plot)] for the comparisons a setting holds, each with its
    baselines: geo:K with sync and async; each compressed mode with the mode without compression.
    A comparison that would be the whole plot again is left out."""
    modes = {runs[0]["mode"]: parse_mode(runs[0]["mode"]) for runs in cell_runs}
    geo = {m for m, p in modes.items() if p.family == "geo"}
    packed = {m for m, p in modes.items() if p.compression is not None}
    wanted = {"geo": geo | {"sync", "async"} if geo else set(),
              "compression": packed | {modes[m].base for m in packed} if packed else set()}
    out = []
    for focus, keep in wanted.items():
        picked = [runs for runs in cell_runs if runs[0]["mode"] in keep]
        if keep and len(picked) < len(cell_runs):
            out.append((focus, picked))
    return out


def _first_repeats(runs):
    """One run of each cell (its first): the staleness histograms, which differ little between repeats."""
    seen, out = set(), []
    for run in runs:
        if cell_id(run) not in seen:
            seen.add(cell_id(run))
            out.append(run)
    return out


def _spread(runs, x, y):
    """(grid, median, low, high) of y against x over a cell's repeats: each run interpolated onto a
    common grid up to the shortest run's end, the band from the lowest to the highest run."""
    import numpy as np
    end = min(r["points"][-1][x] for r in runs)
    start = max(r["points"][0][x] for r in runs)
    if len(runs) == 1 or end <= start:
        pts = runs[0]["points"]
        xs, ys = np.array([p[x] for p in pts], float), np.array([p[y] for p in pts], float)
        return xs, ys, ys, ys
    grid = np.linspace(start, end, GRID_POINTS)
    curves = np.array([np.interp(grid, [p[x] for p in r["points"]], [p[y] for p in r["points"]]) for r in runs])
    return grid, np.median(curves, axis=0), curves.min(axis=0), curves.max(axis=0)


def _curves(plt, path, cell_runs, target, title):
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("time", "accuracy", "training time (s)", "test accuracy"),
              ("updates", "accuracy", "gradients applied (all workers)", "test accuracy"),
              ("time", "loss", "training time (s)", "test loss"))
    for ax, (x, y, xlabel, ylabel) in zip(axes, panels):
        for runs in cell_runs:
            grid, mid, low, high = _spread(runs, x, y)
            label = f"{runs[0]['mode']} ({len(runs)} runs)" if len(runs) > 1 else runs[0]["mode"]
            line, = ax.plot(grid, mid, label=label, marker="." if len(grid) < 30 else None)
            if len(runs) > 1:
                ax.fill_between(grid, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        if y == "accuracy":
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
            # From the worst final accuracy (or 0.2 below the target) up: the first points' near-chance
            # accuracy would squash the part of the curves that matters.
            every = [r for runs in cell_runs for r in runs]
            low = min(min(p["accuracy"] for p in r["points"]) for r in every)
            final = min(r["points"][-1]["accuracy"] for r in every)
            ax.set_ylim(max(low, min(target - 0.2, final - 0.05)), None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title + " (lines: median of the repeats; bands: lowest to highest)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _intervals(plt, path, rows, title):
    """Time to target and updates/s of every cell: the median as a dot, the 95% interval as a bar."""
    import math
    from kvps.tools.experiment.intervals import from_dict
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 1.8))
    labels = [f"{r['mode']}{' +straggler' if r['straggler'] else ''}{'' if r['net'] == 'local' else ' @' + r['net']}"
              for r in rows]
    for ax, metric, xlabel in ((axes[0], "time_to_target", "time to target (s)"),
                               (axes[1], "updates_per_s", "gradients applied per second")):
        for i, r in enumerate(rows):
            if r[metric] is None:
                continue
            iv = from_dict(r[metric])
            if math.isinf(iv.median):
                ax.annotate("not reached", (0, i), fontsize=7, va="center")
                continue
            high = iv.high if not math.isinf(iv.high) else iv.median
            ax.errorbar([iv.median], [i], xerr=[[iv.median - iv.low], [high - iv.median]], fmt="o", capsize=3,
                        color="C3" if math.isinf(iv.high) else "C0")
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(title + " (red: some runs never reached the target)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _staleness(plt, path, runs, title):
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    width = 0.8 / max(len({r["mode"] for r in runs}), 1)
    for ax, straggled in zip(axes, (False, True)):
        chosen = [r for r in runs if (r["straggler"] is not None) == straggled]
        for i, run in enumerate(chosen):
            hist = list(run["server"]["staleness"])
            binned = hist[:STALENESS_BINS] + [0] * max(0, STALENESS_BINS - len(hist))
            binned[-1] += sum(hist[STALENESS_BINS:])
            total = sum(hist) or 1
            ax.bar([b + i * width for b in range(STALENESS_BINS)], [n / total for n in binned], width=width,
                   label=run["mode"])
        ax.set_title("with the straggler" if straggled else "no straggler")
        ax.set_xlabel(f"staleness (steps; the last bar: {STALENESS_BINS - 1} or more)")
        ax.grid(alpha=0.3, axis="y")
        if chosen:
            ax.legend(fontsize=8)
    axes[0].set_ylabel("share of applied pushes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
