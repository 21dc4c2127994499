"""The main job: train the same small model with each kvstore on a local cluster and compare.

    ./run demo                        # = python examples/compare.py
    python examples/compare.py --workers 2 --servers 1 --steps 1000

Runs examples/train_mlp.py once in one process (the 'local' kvstore: the
reference), then under `kvps launch` with dist_sync, dist_async and allreduce, and prints a
table of wall time, steps per second, final test loss and accuracy, written
also to reports/compare.md. The all-reduce run uses kvps's ring (no servers).
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train_mlp.py"


def run(kvstore, workers, servers, steps, timeout):
    args = ["--kvstore", kvstore, "--steps", str(steps)]
    if kvstore == "local":
        argv = [sys.executable, str(TRAIN), *args]
    else:
        servers = 0 if kvstore == "allreduce" else servers       # the ring needs no servers
        argv = [sys.executable, "-m", "kvps.cli", "launch", "-n", str(workers), "-s", str(servers), "--",
                sys.executable, str(TRAIN), *args]
    print(f"[compare] {kvstore}: {' '.join(os.path.basename(a) for a in argv[1:])}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"[compare] {kvstore} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    points = []
    for line in proc.stdout.splitlines():
        text = line.split("] ", 1)[1] if line.startswith("[W0] ") else line
        if text.startswith("{"):
            points.append(json.loads(text))
    for pt in points:
        print(f"[compare]   {kvstore} step {pt['step']:4d}  t={pt['time']:6.2f}s  loss={pt['loss']:.4f}  "
              f"acc={pt['accuracy']:.3f}", flush=True)
    return {"kvstore": kvstore, "workers": 1 if kvstore == "local" else workers, "wall": wall,
            "train": points[-1]["time"], "loss": points[-1]["loss"], "accuracy": points[-1]["accuracy"],
            "steps": steps, "points": points}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=str(ROOT / "reports" / "compare.md"))
    args = p.parse_args()
    kinds = ("local", "dist_sync", "dist_async", "allreduce")
    rows = [run(kv, args.workers, args.servers, args.steps, args.timeout) for kv in kinds]
    base = rows[0]["train"]
    lines = [f"## Training the same MLP with each kvstore ({args.steps} steps per worker, batch 32)", "",
             "| kvstore | workers | servers | training time (s) | steps/s per worker | vs local | test loss | test accuracy |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        servers = 0 if r["kvstore"] in ("local", "allreduce") else args.servers
        lines.append(f"| {r['kvstore']} | {r['workers']} | {servers} | {r['train']:.2f} | {r['steps'] / r['train']:.0f} "
                     f"| {r['train'] / base:.2f}x | {r['loss']:.4f} | {r['accuracy']:.3f} |")
    sync, asyn, ring = rows[1], rows[2], rows[3]
    fastest = min(rows[1:], key=lambda r: r["train"])
    lines += ["", f"Each of the {args.workers} workers trains on 1/{args.workers} of the data with the same "
                  f"per-worker batch. Test accuracy: local {rows[0]['accuracy']:.3f}, dist_sync "
                  f"{sync['accuracy']:.3f}, dist_async {asyn['accuracy']:.3f}, ring all-reduce "
                  f"{ring['accuracy']:.3f}. Fastest distributed run: {fastest['kvstore']} "
                  f"({fastest['train']:.2f} s; sync {sync['train']:.2f} s, async {asyn['train']:.2f} s, "
                  f"all-reduce {ring['train']:.2f} s).", ""]
    text = "\n".join(lines)
    print(text)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"[compare] written to {out}")


if __name__ == "__main__":
    main()
