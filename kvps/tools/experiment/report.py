"""The experiment's report directory: report.md, results.json and PNG plots.

    write(out_dir, results)      # results: the dict cli.py builds (runs, targets, findings, ...)

Plots (matplotlib, Agg backend; skipped with a note in report.md where matplotlib is missing):
    {workload}-W{W}-{none|straggler}.png   test accuracy vs time, vs gradients applied; loss vs time
    {workload}-W{W}-staleness.png          the staleness histogram of each mode's applied pushes
"""
import json
import os

from kvps.tools.experiment.metrics import show, summarize

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
def markdown(results, plots=(), plot_note=None):
    runs, targets = results["runs"], results["targets"]
    lines = [f"# kvps experiment: consistency modes on real training ({results['preset']} preset)", "",
             f"Run {results['started']} on {results['machine']}; `{results['command']}`; "
             f"{len(runs)} runs in {results['wall_s']:.0f} s of wall time. Raw numbers: `results.json`.", "",
             "## What ran", ""]
    for name, text in results["workloads"].items():
        lines.append(f"* **{name}**: {text}; target {show('target', targets[name])} test accuracy.")
    lines += [f"* Modes: {', '.join(f'{m} (`{t}`)' for m, t in results['modes'].items())}.",
              f"* Workers: {', '.join(str(w) for w in results['workers'])}; parameter-server modes use "
              f"{results['servers']} server(s), the ring none. Every process is on this one machine.",
              "* Straggler: the last worker sleeps an extra delay before each step's first push, set to the "
              "sync step time measured without it (a 2x straggler):"]
    for s in results["stragglers"]:
        lines.append(f"  * {s['workload']}, W={s['workers']}: W{s['rank']} +{show('delay_ms', s['delay_s'] * 1e3)} "
                     f"per step ({s['kind']}; {s['source']}).")
    lines += ["", "## Findings", "",
              "Generated from this run's numbers (docs/experiment.md has the definitions):", ""]
    lines += [f"* {f['text']}" for f in results["findings"]] or ["* No run finished; nothing to report."]
    lines += ["", "## Time to target and throughput", "",
              "Time to target: rank 0's training clock (start-up and evaluation excluded) at its first "
              "evaluation at or above the target. Updates: gradients applied, over all workers.", ""]
    for (workload, workers), group in _groups(runs):
        target = targets[workload]
        lines += [f"### {workload}, W={workers} (target {show('target', target)})", "",
                  "| mode | straggler | status | time to target | updates to target | final accuracy | final loss "
                  "| updates/s | step (rank 0) | steps of each worker | mean staleness | max staleness | dropped |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for run in group:
            r = summarize(run, target)
            cells = [r["mode"], "yes" if r["straggler"] else "no", r["status"]]
            shown = [show(m, r[m]) if r["status"] == "ok" else "-" for m in
                     ("time_to_target", "updates_to_target", "final_accuracy", "final_loss", "updates_per_s",
                      "step_ms", "mean_staleness", "max_staleness", "dropped")]
            steps = "/".join(str(r["steps"][k]) for k in sorted(r["steps"])) if r["status"] == "ok" else "-"
            cells += shown[:6] + [steps] + shown[6:]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Plots", ""]
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


def _groups(runs):
    groups = {}
    for run in runs:
        groups.setdefault((run["workload"], run["workers"]), []).append(run)
    return groups.items()


# ---- plots ----
def _plots(out_dir, results):
    """[(file name, caption)] of the PNGs written, and a note if none could be."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "No plots: matplotlib is not installed (pip install 'kvps[plot]')."
    made = []
    for (workload, workers), group in _groups(results["runs"]):
        target = results["targets"][workload]
        for straggled in (False, True):
            runs = [r for r in group if (r["straggler"] is not None) == straggled and r["points"]]
            if not runs:
                continue
            name = f"{workload}-W{workers}-{'straggler' if straggled else 'none'}.png"
            caption = f"{workload}, W={workers}, {'with the straggler' if straggled else 'no straggler'}"
            _curves(plt, os.path.join(out_dir, name), runs, target, caption)
            made.append((name, caption))
        runs = [r for r in group if (r.get("server") or {}).get("staleness")]
        if runs:
            name = f"{workload}-W{workers}-staleness.png"
            caption = f"{workload}, W={workers}: staleness of applied pushes"
            _staleness(plt, os.path.join(out_dir, name), runs, caption)
            made.append((name, caption))
    return made, None


def _curves(plt, path, runs, target, title):
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("time", "accuracy", "training time (s)", "test accuracy"),
              ("updates", "accuracy", "gradients applied (all workers)", "test accuracy"),
              ("time", "loss", "training time (s)", "test loss"))
    for ax, (x, y, xlabel, ylabel) in zip(axes, panels):
        for run in runs:
            ax.plot([p[x] for p in run["points"]], [p[y] for p in run["points"]], label=run["mode"],
                    marker="." if len(run["points"]) < 30 else None)
        if y == "accuracy":
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
            # From the worst final accuracy (or 0.2 below the target) up: the first points' near-chance
            # accuracy would squash the part of the curves that matters.
            low = min(min(p["accuracy"] for p in r["points"]) for r in runs)
            final = min(r["points"][-1]["accuracy"] for r in runs)
            ax.set_ylim(max(low, min(target - 0.2, final - 0.05)), None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
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
