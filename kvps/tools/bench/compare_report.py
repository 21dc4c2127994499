"""What `kvps bench compare` prints and draws: the markdown tables, the targets, the PNG, the JSON.

    report = Report(args, plan, setups, measured, command, load)
    print(report.markdown()); report.plot("reports/compare.png"); report.as_json()

`measured` maps each compare.Setup to {"rows": {workload: row}, "error", "why", "train_why"}, where
a row is a worker's result line (workloads.summary's fields) with each run's median as runs_ms.
Ratios divide by a baseline measured in the same run: the ring by gloo at the same W, PS sync by
MXNet dist_sync at the same W and S.
"""
import datetime
import math
import os


# name, system, baseline system, W, S (None: any), highest ratio, what the issue asks
TARGETS = (
    ("ring-W2", "ring", "gloo", 2, None, 1.0, "kvps ring at most 1.0x gloo, W=2"),     # issue 14 (was 1.2x)
    ("ring-W4", "ring", "gloo", 4, None, 1.0, "kvps ring at most 1.0x gloo, W=4"),
    ("ps-W2-S1", "sync", "mxnet", 2, 1, 0.7, "PS sync at most 0.7x MXNet dist_sync, W=2 S=1"),
)
BASELINE = {"ring": "gloo", "sync": "mxnet"}        # the rows that get ratios, and against what
COLORS = {"sync": "#1f77b4", "async": "#9ecae1", "ring": "#2ca02c", "gloo": "#ff7f0e", "mxnet": "#7f7f7f"}


def _bytes(n):
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"


def _count(n):
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:,}"


def _ms(ms):
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 1000 else f"{ms:.0f}"


class Report:
    """One run's results, with the lookups, ratios and targets the table and the plot share."""

    def __init__(self, args, plan, setups, measured, command, load=None):
        self.args, self.plan, self.setups, self.measured, self.command = args, plan, setups, measured, command
        self.load = load
        self.when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        self.by_key = {(s.system, s.workers, s.servers): s for s in setups}

    # ---- lookups ----
    def row(self, setup, workload):
        result = self.measured.get(setup)
        return result["rows"].get(workload) if result else None

    def baseline(self, setup):
        """The setup this one is divided by, or None."""
        system = BASELINE.get(setup.system)
        if system is None:
            return None
        return self.by_key.get((system, setup.workers, setup.servers if system == "mxnet" else 0))

    def ratio(self, setup, workload):
        base = self.baseline(setup)
        mine, theirs = self.row(setup, workload), base and self.row(base, workload)
        return mine["ms"] / theirs["ms"] if mine and theirs else None

    def paired(self, setup, workload):
        """Each repeat's own ratio (this run's median over the baseline's run next to it), or None when
        either side lost a run."""
        base = self.baseline(setup)
        mine, theirs = self.row(setup, workload), base and self.row(base, workload)
        if not (mine and theirs) or len(mine["runs_ms"]) != len(theirs["runs_ms"]):
            return None
        return [a / b for a, b in zip(mine["runs_ms"], theirs["runs_ms"])]

    def targets(self):
        """[{name, target, ratio, limit, met, why}]; met is True, False or None (not judged: see why)."""
        out = []
        for name, system, base, W, S, limit, text in TARGETS:
            setup = next((s for s in self.setups if s.system == system and s.workers == W
                          and (S is None or s.servers == S)), None)
            ratio = self.ratio(setup, "resnet50") if setup else None
            why = None
            if setup is None:
                why = f"W={W}" + (f" S={S}" if S else "") + f" {system} not in this run"
            elif ratio is None:
                other = self.baseline(setup)
                why = (self.measured[other]["why"] or "baseline failed") if other else f"{base} not in this run"
                if self.measured[setup]["error"] or self.measured[setup]["why"]:
                    why = f"{setup.label} failed"
            elif self.args.quick:
                why = "--quick: a tiny workload"
            met = None if why else ratio <= limit
            out.append({"name": name, "target": text, "ratio": ratio, "limit": limit, "met": met, "why": why,
                        "runs": self.paired(setup, "resnet50") if setup else None})
        return out

    # ---- markdown ----
    def markdown(self):
        a = self.args
        spec = self.plan["train"]
        params = sum(n * m + m for n, m in zip(spec["layers"], spec["layers"][1:]))
        lines = [f"kvps bench compare on 127.0.0.1, {os.cpu_count()} CPUs, {self.when}"
                 + (f", load average {self.load[0]:.1f} before / {self.load[1]:.1f} after" if self.load else ""),
                 "",
                 f"* **sync**: every worker syncs {self._resnet_label()} once per step (kvps: one pushpull of "
                 "the whole list; gloo: DDP-style 25 MB buckets; MXNet: push every key, then pull every key).",
                 f"* **train**: one training step (forward, backward, gradient sync, SGD step) of an MLP "
                 f"{'-'.join(map(str, spec['layers']))} ({_count(params)} parameters, {_bytes(4 * params)} "
                 f"of gradients), batch {spec['batch']} per worker, fixed seed and batch (kvps: "
                 "kvps.torch.DistributedOptimizer; gloo: DistributedDataParallel; MXNet: Gluon's Trainer, "
                 "update_on_kvstore=False). **no sync**: the same step with the plain optimizer, all W workers "
                 "running at once (the compute share).",
                 f"* Medians of {a.steps} timed steps after warm-up; "
                 + (f"each row is the median of {a.repeat} round-robin runs, [brackets] the lowest and highest run."
                    if a.repeat > 1 else "[brackets]: fastest and slowest step.")
                 + " Ratios divide by the baseline named in the same run (below 1: faster).",
                 f"* Threads per worker (torch, OpenMP): {self._threads()}.",
                 "",
                 "| W | setup | sync ms | sync GB/s | train step ms | no-sync step ms | sync ratio | train ratio |",
                 "|--:|---|--:|--:|--:|--:|--:|--:|"]
        notes = []
        for s in self.setups:
            lines.append(self._line(s, notes))
        lines += ["", "| target | ratio | each run's ratio | limit | met |", "|---|--:|---|--:|---|"]
        for t in self.targets():
            ratio = f"{t['ratio']:.2f}" if t["ratio"] is not None else "-"
            runs = ", ".join(f"{r:.2f}" for r in t["runs"]) if t["runs"] and t["ratio"] is not None else "-"
            met = f"not judged ({t['why']})" if t["met"] is None else "yes" if t["met"] else "**no**"
            lines.append(f"| {t['target']} | {ratio} | {runs} | {t['limit']:g} | {met} |")
        noise = self._noise()
        if noise:
            lines += ["", noise]
        if notes:
            lines += [""] + [f"* {n}" for n in dict.fromkeys(notes)]
        return "\n".join(lines)

    def _resnet_label(self, short=False):
        shapes = self.plan["resnet"]["shapes"]
        floats = sum(math.prod(s) for s in shapes)
        if short:
            return f"ResNet-50 grads ({len(shapes)} tensors, {4 * floats / 1e6:.1f} MB)"
        if len(shapes) < 161:
            return f"ResNet-50's first {len(shapes)} gradients ({floats / 1e6:.2f}M float32; a smoke-test workload)"
        return f"ResNet-50's {len(shapes)} gradients ({floats / 1e6:.1f}M float32, {4 * floats / 1e6:.0f} MB)"

    def _line(self, s, notes):
        result = self.measured[s]
        head = f"| {s.workers} | {s.label} |"
        if result["why"]:
            return head + f" {result['why']} | | | | | |"
        if result["error"] and not result["rows"]:
            return head + f" **failed**: {result['error'][:120]} | | | | | |"
        sync, train, local = (self.row(s, w) for w in ("resnet50", "train", "train_local"))
        cells = [self._cell(sync), f"{sync['GBps']:.2f}" if sync else "-"]
        if result["train_why"]:
            cells += ["n/a", "-"]
            notes.append(f"kvps training rows: {result['train_why']}")
        else:
            cells += [self._cell(train), _ms(local["ms"]) if local else "-"]
        base = self.baseline(s)
        for workload in ("resnet50", "train"):
            r = self.ratio(s, workload)
            cells.append(f"{r:.2f} ({LABELS_SHORT[base.system]})" if r is not None else "-")
        if result["error"]:
            notes.append(f"{s.label} W={s.workers}: a later run failed ({result['error'][:200]}); "
                         "the row shows the runs that finished")
        return head + " " + " | ".join(cells) + " |"

    def _threads(self):
        from kvps.tools.bench.train_step import threads
        if self.args.threads == "default":
            return "each library's default (--threads default, as the anchor scripts run)"
        shares = ", ".join(f"{threads(self.args.threads, W)} at W={W}" for W in sorted({s.workers for s in self.setups}))
        return f"{shares}, the same for every system (--threads {self.args.threads})"

    def _range(self, row):
        """(low, high): the lowest and highest run's median with --repeat, else the fastest and slowest step."""
        if self.args.repeat > 1:
            return min(row["runs_ms"]), max(row["runs_ms"])
        return row["min_ms"], row["max_ms"]

    def _cell(self, row):
        if not row:
            return "-"
        lo, hi = self._range(row)
        return f"{_ms(row['ms'])} [{_ms(lo)}-{_ms(hi)}]"

    def _noise(self):
        spreads = []
        for s in self.setups:
            for w in ("resnet50", "train"):
                r = self.row(s, w)
                if r and self.args.repeat > 1 and len(r["runs_ms"]) > 1:
                    spreads.append((max(r["runs_ms"]) - min(r["runs_ms"])) / r["ms"])
                elif r and self.args.repeat == 1:
                    spreads.append((r["max_ms"] - r["min_ms"]) / r["ms"])
        if not spreads:
            return ""
        spreads.sort()
        what = "highest minus lowest run" if self.args.repeat > 1 else "slowest minus fastest step"
        return (f"Noise: {what}, as a share of the median, is {100 * spreads[len(spreads) // 2]:.0f}% for the "
                f"median row and up to {100 * spreads[-1]:.0f}% (a 2-core machine shared with other work: "
                "read ratios, not absolute times).")

    # ---- the plot ----
    def plot(self, path):
        """Write the bar plot; returns None, or why there is none."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            return f"not drawn: matplotlib does not import ({exc})"
        workers = sorted({s.workers for s in self.setups})
        fig, axes = plt.subplots(len(workers), 2, figsize=(12, 1.0 + 0.42 * max(
            sum(1 for s in self.setups if s.workers == W) for W in workers) * len(workers) + 0.6 * len(workers)),
            squeeze=False)
        for i, W in enumerate(workers):
            mine = [s for s in self.setups if s.workers == W][::-1]       # first setup at the top
            for j, (workload, title) in enumerate((("resnet50", f"W={W}: sync {self._resnet_label(short=True)}"),
                                                    ("train", f"W={W}: one MLP training step (hatched: no sync)"))):
                ax = axes[i][j]
                labels, values, colors, locals_, spread = [], [], [], [], [[], []]
                for s in mine:
                    r = self.row(s, workload)
                    labels.append(s.label)
                    values.append(r["ms"] if r else 0.0)
                    lo, hi = self._range(r) if r else (0.0, 0.0)
                    spread[0].append(values[-1] - lo)
                    spread[1].append(hi - values[-1])
                    colors.append(COLORS[s.system])
                    local = self.row(s, "train_local") if workload == "train" else None
                    locals_.append(local["ms"] if local and r else 0.0)
                y = range(len(mine))
                ax.barh(y, values, color=colors, edgecolor="black", linewidth=0.5, xerr=spread,
                        error_kw={"elinewidth": 0.8, "capsize": 2, "ecolor": "#333333"})
                if workload == "train":
                    ax.barh(y, locals_, color="white", alpha=0.55, hatch="//", edgecolor="black", linewidth=0.3)
                top = max((v + e for v, e in zip(values, spread[1])), default=0.0) or 1.0
                for k, (v, e, s) in enumerate(zip(values, spread[1], mine)):
                    result = self.measured[s]
                    text = _ms(v) + " ms" if v else ("not run" if result["why"] else "failed" if result["error"]
                                                     else "n/a")
                    ax.text(v + e + top * 0.01, k, text, va="center", fontsize=8)
                ax.set_yticks(list(y))
                ax.set_yticklabels(labels, fontsize=9)
                ax.set_xlim(0, top * 1.25)
                ax.set_xlabel("ms per step, median; whiskers: " + ("lowest / highest run" if self.args.repeat > 1
                              else "fastest / slowest step"), fontsize=9)
                ax.set_title(title, fontsize=10)
                ax.grid(axis="x", alpha=0.3)
        fig.suptitle(f"kvps bench compare, 127.0.0.1, {os.cpu_count()} CPUs, {self.when}", fontsize=11)
        fig.tight_layout()
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return None

    # ---- JSON ----
    def as_json(self):
        a = self.args
        return {"command": self.command, "when": self.when, "cpus": os.cpu_count(), "load": self.load,
                "workers": a.workers, "servers": a.servers, "steps": a.steps, "threads": a.threads, "repeat": a.repeat, "quick": a.quick,
                "plan": {"resnet_tensors": len(self.plan["resnet"]["shapes"]), "train": self.plan["train"]},
                "setups": [{"system": s.system, "label": s.label, "workers": s.workers, "servers": s.servers,
                            "error": self.measured[s]["error"], "why": self.measured[s]["why"],
                            "train_why": self.measured[s]["train_why"], "rows": self.measured[s]["rows"],
                            "sync_ratio": self.ratio(s, "resnet50"), "train_ratio": self.ratio(s, "train")}
                           for s in self.setups],
                "targets": self.targets()}


LABELS_SHORT = {"gloo": "gloo", "mxnet": "MXNet"}
