"""`kvps experiment`: train real models under every consistency mode, with and without a straggler,
and write a report of what happened.

    kvps experiment --quick                     # digits at W=3, 7 cells x 3 repeats: 3.5 to 5 min on 2 cores
    kvps experiment                             # the full preset: W in 2,4, both workloads, 5 repeats (hours)
    kvps experiment --tiny                      # seconds per run: the test suite's end-to-end check
    kvps experiment --quick --modes sync,ssp:4 --workers 4 --straggler on --target digits=0.97 --repeats 5
    kvps experiment --quick --emulate 100mbit   # the `wide` workload on loopback and on emulated hosts
    kvps experiment --full --workloads digits --modes sync,async,geo:1,geo:4,geo:16 --straggler off
    kvps experiment --full --workloads digits --modes sync,sync+fp16,sync+fp16+pull --straggler off

Writes --out (default reports/experiment/): report.md, results.json and PNG plots. Every run has
a deadline (--timeout); a run that fails or hangs is reported with its output tail and the
others still run. Exit codes: 0 every run finished; 1 some run failed (the report is still
written); 2 a usage error; 130 interrupted (what finished is written).
"""
import argparse
import dataclasses
import datetime
import os
import platform
import shlex
import sys
import time

import kvps

from kvps.tools.experiment import findings as findings_mod
from kvps.tools.experiment import presets, report, runner
from kvps.tools.experiment.metrics import cells, show, summarize
from kvps.tools.progress import Progress

OK, FAILED, USAGE, INTERRUPTED = 0, 1, 2, 130
DEFAULT_DELAY = 0.005      # seconds: the straggler's delay when no straggler-free run gave a step time


def _csv(kind):
    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"--{kind} {text!r} lists nothing")
        if kind == "rates":
            return items
        if kind == "workers":
            try:
                values = [int(t) for t in items]
            except ValueError:
                raise argparse.ArgumentTypeError(f"--workers {text!r} is not a comma-separated list of "
                                                 f"integers") from None
            if any(v < 1 for v in values):
                raise argparse.ArgumentTypeError(f"--workers {text!r}: every count must be at least 1")
            return values
        return items
    return parse


def parse_targets(text, workloads):
    """{workload: accuracy} from "0.9" (every workload) or "digits=0.97,sparse=0.7"."""
    targets = {}
    for item in text.split(","):
        name, sep, value = item.strip().rpartition("=")
        try:
            accuracy = float(value)
        except ValueError:
            raise ValueError(f"--target {text!r}: {value!r} is not a number") from None
        if not 0 < accuracy <= 1:
            raise ValueError(f"--target {text!r}: {accuracy} is not an accuracy in (0, 1]")
        if sep and name not in workloads:
            raise ValueError(f"--target {text!r}: {name!r} is not one of {', '.join(workloads)}")
        for w in ([name] if sep else workloads):
            targets[w] = accuracy
    return targets


def parser():
    p = argparse.ArgumentParser(prog="kvps experiment",
                                description="Train real models under every consistency mode, with and without a "
                                            "straggler, and write a report of what happened.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="docs/experiment.md describes the runs and how to read the report.")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="preset", action="store_const", const="quick",
                      help="digits at W=3, 7 cells (4 modes without the straggler, 3 with) x 3 repeats: 3.5 to 5 min")
    size.add_argument("--full", dest="preset", action="store_const", const="full",
                      help="both workloads, W in 2,4, eight modes (digits also GEO-SGD and compression), "
                           "5 repeats (the default)")
    size.add_argument("--tiny", dest="preset", action="store_const", const="tiny",
                      help="a few dozen steps per run, digits at W=2: checks the whole pipeline")
    p.add_argument("--workloads", type=_csv("workloads"), help=f"of: {', '.join(presets.WORKLOADS)}")
    p.add_argument("--modes", type=_csv("modes"), help=f"of: {presets.MODE_HELP}")
    p.add_argument("--workers", type=_csv("workers"), help="worker counts, e.g. 2,4")
    p.add_argument("--servers", type=int, default=None, help="servers of parameter-server modes (default 1)")
    p.add_argument("--straggler", choices=("both", "on", "off"), default="both",
                   help="runs with the straggler, without, or both (default)")
    p.add_argument("--straggler-delay", type=float, default=None,
                   help="the straggler's extra seconds per step (default: the measured sync step time)")
    p.add_argument("--straggler-kind", choices=("fixed", "exp"), default="fixed",
                   help="fixed delay, or exponentially distributed with that mean (default fixed)")
    p.add_argument("--steps", type=int, default=None, help="training steps per worker (default: the preset's)")
    p.add_argument("--seconds", type=float, default=None, help="also stop each run after this much training")
    p.add_argument("--target", default=None,
                   help="test-accuracy targets: 0.9 for all, or digits=0.97,sparse=0.7 (default: "
                        + ", ".join(f"{w.name}={w.target}" for w in presets.WORKLOADS.values()) + ")")
    p.add_argument("--seed", type=int, default=None,
                   help="the scripts' data and model seed of the first repeat; repeat r uses seed + r (default 0)")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs of every cell, each with its own seed (default: the preset's: tiny 1, quick 3, full 5)")
    p.add_argument("--emulate", type=_csv("rates"), default=None, metavar="RATE[,RATE]",
                   help="also run the straggler-free cells on `kvps emulate` hosts at these link rates (1gbit, "
                        "100mbit); default workloads then: wide, modes: sync, async, allreduce. Skipped with the "
                        "reason where network namespaces are not permitted")
    p.add_argument("--timeout", type=float, default=None, help="deadline of each run in seconds")
    p.add_argument("--out", default=os.path.join("reports", "experiment"), help="report directory")
    p.set_defaults(preset="full")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    # Checked before any run starts: without scikit-learn every digits run used to start and then
    # fail with ModuleNotFoundError, one by one (sklearn ships the digits data set the runs train on).
    import importlib.util
    if importlib.util.find_spec("sklearn") is None:
        print("kvps experiment: error: scikit-learn is not installed; the experiments need it "
              "(pip install 'kvps[experiment]')", file=sys.stderr)
        return USAGE
    preset = presets.PRESETS[args.preset]
    stragglers = {"both": None, "on": (True,), "off": (False,)}[args.straggler]
    repeats = preset.repeats if args.repeats is None else args.repeats
    seed = args.seed or 0
    try:
        if repeats < 1:
            raise ValueError(f"--repeats {repeats} must be at least 1")
        rates, skipped = _rates(args.emulate)
        workloads, modes = args.workloads, args.modes
        if args.emulate:
            workloads = workloads or presets.EMULATED_WORKLOADS
            modes = modes or preset.emulated_modes
        specs = presets.plan(preset, workloads, modes, args.workers, stragglers, args.servers,
                             args.steps, args.seconds, seed, calibrate=args.straggler_delay is None)
        skipped_cells = presets.skipped(workloads or preset.workloads, modes) if modes else []
        if not specs:
            raise ValueError("nothing to run: " + "; ".join(f"{w} {m}: {why}" for w, m, why in skipped_cells))
        specs = presets.emulated(specs, rates)
        workloads = sorted({s.workload for s in specs}, key=list(presets.WORKLOADS).index)
        targets = {w: presets.WORKLOADS[w].target for w in workloads}
        if args.target:
            targets.update(parse_targets(args.target, workloads))
    except ValueError as exc:
        print(f"kvps experiment: error: {exc}", file=sys.stderr)
        return USAGE
    results = {
        "preset": preset.name, "command": shlex.join(["kvps", "experiment", *argv]),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python "
                   f"{platform.python_version()}, kvps {kvps.__version__}",
        "wall_s": 0.0, "targets": targets,
        "workloads": {w: f"{presets.WORKLOADS[w].title}; `python -m {presets.WORKLOADS[w].module} "
                         f"{' '.join(presets.script_args(w, preset.size, args.steps, args.seconds, args.seed))}`"
                      for w in workloads},
        "modes": {m: shlex.join([presets.kvstore_type(m), *presets.parse_mode(m).script_args])
                  for m in dict.fromkeys(s.mode for s in specs)},
        "skipped": skipped_cells,
        "workers": sorted({s.workers for s in specs}),
        "servers": preset.servers if args.servers is None else args.servers,
        "repeats": repeats, "seed": seed,
        "emulate": {"rates": args.emulate, "skipped": skipped} if args.emulate else None,
        "stragglers": [], "runs": [], "findings": [], "summary": [], "cells": [],
    }
    if skipped:
        print(f"[experiment] emulated hosts skipped: {skipped}", flush=True)
    for w, m, why in skipped_cells:
        print(f"[experiment] skipped {w} {m}: {why}", flush=True)
    code = _run_all(specs, results, args, preset, repeats, seed)
    results["findings"] = findings_mod.findings(results["runs"], targets)
    results["summary"] = [summarize(r, targets[r["workload"]]) for r in results["runs"]]
    results["cells"] = cells(results["runs"], targets)
    path = report.write(args.out, results)
    print("\n[experiment] findings:")
    for f in results["findings"]:
        print(f"  * {f['text']}")
    failed = [r["id"] for r in results["runs"] if r["status"] != "ok"]
    print(f"[experiment] {len(results['runs'])} runs in {results['wall_s']:.0f} s"
          + (f"; {len(failed)} failed: {', '.join(failed)}" if failed else "") + f"; report: {path}")
    return code if code != OK else (FAILED if failed else OK)


def _rates(asked):
    """(the rates to emulate, None) or ([], why not) where namespaces are not permitted. Raises
    ValueError naming a rate that is not one."""
    if not asked:
        return [], None
    from kvps.errors import ConfigError
    from kvps.tools.emulate import parse_rate, permitted
    for rate in asked:
        try:
            parse_rate(rate)
        except ConfigError as exc:
            raise ValueError(f"--emulate: {exc}") from None
    ok, why = permitted()
    return (list(asked), None) if ok else ([], why)


def _run_all(specs, results, args, preset, repeats=1, seed=0):
    """Every spec, `repeats` times over: the whole grid once per repeat (seed + r), in plan order."""
    start = time.monotonic()
    delays = {}
    total = len(specs) * repeats
    todo = [(r, spec) for r in range(repeats) for spec in specs]
    progress = Progress(total, "runs")     # on stderr: a bar with an ETA on a terminal, else plain lines
    try:
        for i, (repeat, spec) in enumerate(todo, 1):
            delay = 0.0
            if spec.straggler:
                group = (spec.workload, spec.workers)
                if group not in delays:
                    delays[group] = _straggler_delay(spec, results, args)
                delay = delays[group]["delay_s"]
            timeout = args.timeout or _deadline(spec, preset, delay)
            what = f"{spec.workload} W={spec.workers} {spec.mode}"
            if spec.straggler:
                what += f", straggler W{spec.workers - 1} +{show('delay_ms', delay * 1e3)}/step"
            if spec.net != "local":
                what += f", emulated hosts at {spec.net}"
            if repeats > 1:
                what += f", repeat {repeat + 1}/{repeats} (seed {seed + repeat})"
            print(f"[experiment] ({i}/{total}) {what}", flush=True)
            seeded = dataclasses.replace(spec, args=presets.with_seed(spec.args, seed + repeat))
            result = runner.run(seeded, delay=delay, timeout=timeout, kind=args.straggler_kind,
                                seed=seed + repeat, say=lambda text: print(f"[experiment] {text}", flush=True))
            result["seed"], result["repeat"] = seed + repeat, repeat
            if repeats > 1:
                result["id"] = f"{spec.id}/r{repeat}"
            results["runs"].append(result)
            _say_done(result, results["targets"][spec.workload])
            progress.advance(f"{result['id']}: {result['status']}")
    except KeyboardInterrupt:
        print("[experiment] interrupted; writing what has finished", flush=True)
        return INTERRUPTED
    finally:
        progress.close()
        results["wall_s"] = round(time.monotonic() - start, 1)
    return OK


def _deadline(spec, preset, delay):
    """The preset's deadline, stretched for long runs, for the straggler's sleeps and for emulated
    hosts (building the namespaces, and slow links)."""
    steps = presets.steps_of(spec.args)
    base = max(preset.timeout, 30.0 + steps / 1000 * presets.WORKLOADS[spec.workload].step_timeout
               + 3 * steps * delay)
    return base if spec.net == "local" else 2 * base


def _straggler_delay(spec, results, args):
    """The straggler's delay for spec's workload and W: one sync step, as measured without it."""
    entry = {"workload": spec.workload, "workers": spec.workers, "rank": spec.workers - 1,
             "kind": args.straggler_kind}
    if args.straggler_delay is not None:
        entry.update(delay_s=args.straggler_delay, source="given with --straggler-delay")
    else:
        clean = [r for r in results["runs"] if r["workload"] == spec.workload and r["workers"] == spec.workers
                 and r["straggler"] is None and r["status"] == "ok"]
        clean = [r for r in clean if r.get("net", "local") == "local"]
        sync = [r for r in clean if r["mode"] == "sync"]
        steps = [f["step_ms"] for r in (sync or clean) for f in r["finals"] if f.get("rank") == 0]
        if steps:
            step = sorted(steps)[len(steps) // 2] / 1e3
            source = ("the sync step time measured without a straggler" if sync else
                      f"the median step time of the straggler-free {', '.join(r['mode'] for r in clean)} runs "
                      f"(the sync run did not finish)")
            entry.update(delay_s=round(step, 6), source=source)
        else:
            entry.update(delay_s=DEFAULT_DELAY, source="a default: no straggler-free run finished to measure a step")
    results["stragglers"].append(entry)
    return entry


def _say_done(result, target):
    if result["status"] == "ok":
        r = summarize(result, target)
        print(f"[experiment]   done in {result['wall_s']:.1f} s: steps {r['steps']}, final accuracy "
              f"{show('final_accuracy', r['final_accuracy'])}, {show('updates_per_s', r['updates_per_s'])} "
              f"updates/s, time to {show('target', target)}: {show('time_to_target', r['time_to_target'])}",
              flush=True)
        return
    print(f"[experiment]   {result['status'].upper()}: {result['error']}\n[experiment]   command: "
          f"{result['command']}\n[experiment]   last lines of its output:", flush=True)
    for line in result["tail"][-20:]:
        print(f"[experiment]   | {line}", flush=True)
