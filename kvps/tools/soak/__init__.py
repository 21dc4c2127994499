"""`kvps soak`: run real jobs for minutes and report how each daemon's memory grows.

    kvps soak --minutes 10            # the long run: under 1 MB per minute per daemon is the target
    kvps soak --minutes 1 --json F    # a short one (the test suite runs a shorter one still)

Runs four 2-worker, 2-server jobs on 127.0.0.1, one after another, each for a quarter of the time:
dist_sync and dist_async, each clean and with lost, repeated and delayed messages
(KVPS_FAULTS=drop:0.01,dup:0.01,delay:1ms, so requests are resent and de-duplicated). Every
worker loops until its time is up over small keys (one call per key, as MXNet scripts do), a
4 MB key split over both servers (pushpull), a row-sparse pull, and server_stats(), checking the
values it gets back. The scheduler's and the servers' resident memory (VmRSS) is sampled every
--sample-every seconds; after the warm-up (the first --warmup share of each job) the growth is
the least-squares slope in MB per minute. Exit status: 0 when every job succeeded, 1 otherwise
(the growth is reported, not judged: --max-growth MB makes a slope over it fail too).
"""
import argparse
import json
import os
import sys
import tempfile
import threading
import time

from kvps.errors import KVPSError
from kvps.tools.capture import Lines, rss_mb

JOBS = (("dist_sync", False), ("dist_sync", True), ("dist_async", False), ("dist_async", True))
FAULTS = "drop:0.01,dup:0.01,delay:1ms"

WORKER = r'''
import json, os, time, numpy as np, kvps
kvtype = os.environ["SOAK_KVTYPE"]
kv = kvps.create(kvtype)
deadline = time.monotonic() + float(os.environ["SOAK_SECONDS"])
sync = kvtype == "dist_sync"
small = [f"s{i}" for i in range(16)]
kv.init(small, [np.zeros(256, np.float32) for _ in small])
kv.init(["big", "emb", "go"], [np.zeros(1 << 20, np.float32), np.zeros((1000, 16), np.float32),
                               np.zeros(1, np.float32)])
kv.barrier()
steps, bad = 0, 0
g, out = np.ones(256, np.float32), np.zeros(256, np.float32)
big_out, rows, go = np.zeros(1 << 20, np.float32), np.zeros((1000, 16), np.float32), np.zeros(1, np.float32)
while True:
    if sync:        # every worker runs the same steps (a round needs them all): stop when one is out of time
        kv.pushpull("go", np.full(1, float(time.monotonic() < deadline), np.float32), out=go)
        if go[0] < kv.num_workers:
            break
    elif time.monotonic() >= deadline:
        break
    for i, k in enumerate(small):                   # one call per key, as MXNet scripts do
        kv.push(k, g, priority=-i)
    for i, k in enumerate(small):
        kv.pull(k, out=out, priority=-i)
        bad += sync and out[0] != kv.num_workers
    kv.pushpull("big", np.full(1 << 20, 0.5, np.float32), out=big_out)
    bad += sync and big_out[0] != 0.5 * kv.num_workers
    kv.row_sparse_pull("emb", out=rows, row_ids=np.array([1, 7, 999]))
    if steps % 50 == 0:
        kv.server_stats()
    steps += 1
kv.barrier()
print(json.dumps({"soak": {"rank": kv.rank, "steps": steps, "bad": int(bad)}}), flush=True)
kv.close()
'''


def slope(points):
    """Least-squares slope of [(seconds, MB)] in MB per minute (0.0 for fewer than 2 points)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mm = sum(m for _, m in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return 60.0 * sum((t - mt) * (m - mm) for t, m in points) / var


def soak_job(kvtype, faults, seconds, sample_every, warmup, script):
    """Run one job for `seconds`; returns its row: exit code, worker results, per-daemon growth."""
    from kvps.launch import Job
    env = {"SOAK_KVTYPE": kvtype, "SOAK_SECONDS": f"{seconds:g}", "KVPS_CURVE": "0"}
    if faults:
        env.update(KVPS_FAULTS=FAULTS, KVPS_RESEND_TIMEOUT="0.3")
    out = Lines()
    job = Job(2, 2, [sys.executable, script], env=env, out=out)
    samples = {}
    result = {}
    start = time.monotonic()

    def wait():
        try:
            result["code"] = job.wait(timeout=seconds + 120)
        except (KVPSError, OSError) as exc:
            result["code"], result["error"] = 1, str(exc)
    job.start()
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    daemons = {name: proc.pid for name, proc in job.children.procs.items() if name[0] in "HS"}
    while waiter.is_alive():
        now = time.monotonic() - start
        for name, pid in daemons.items():
            mb = rss_mb(pid)
            if mb is not None:
                samples.setdefault(name, []).append((now, mb))
        waiter.join(sample_every)
    job.stop()
    workers = []
    for line in out.text().splitlines():
        if "{\"soak\"" in line:
            workers.append(json.loads(line.split("] ", 1)[1])["soak"])
    growth = {}
    for name, points in sorted(samples.items()):
        after = [(t, m) for t, m in points if t >= warmup * seconds]
        growth[name] = {"start_mb": round(after[0][1] if after else points[0][1], 1),
                        "end_mb": round(points[-1][1], 1), "mb_per_min": round(slope(after), 3),
                        "samples": len(after)}
    ok = result.get("code") == 0 and len(workers) == 2 and not any(w["bad"] for w in workers)
    return {"kvtype": kvtype, "faults": faults, "seconds": seconds, "code": result.get("code"),
            "ok": ok, "workers": workers, "growth": growth,
            "output": "" if ok else out.text()[-4000:]}


def report(rows):
    lines = ["| job | faults | daemon | RSS after warm-up MB | RSS at end MB | growth MB/min | worker steps |",
             "|---|---|---|--:|--:|--:|--:|"]
    for r in rows:
        steps = "/".join(str(w["steps"]) for w in r["workers"]) or "failed"
        for name, g in r["growth"].items():
            lines.append(f"| {r['kvtype']} | {FAULTS if r['faults'] else 'none'} | {name} | {g['start_mb']} | "
                         f"{g['end_mb']} | {g['mb_per_min']:+.3f} | {steps} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="kvps soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="total time, split over the four jobs (default 10)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between memory samples (default 5)")
    p.add_argument("--warmup", type=float, default=0.25,
                   help="share of each job left out of the slope (start-up, first allocations; default 0.25)")
    p.add_argument("--max-growth", type=float, default=None, metavar="MB",
                   help="fail when a daemon grows by more than MB per minute")
    p.add_argument("--json", metavar="FILE", help="also write the rows to FILE")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.sample_every <= 0 or not 0 <= args.warmup < 1:
        p.error("--minutes and --sample-every must be positive and --warmup in [0, 1)")
    seconds = args.minutes * 60 / len(JOBS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvps-soak-") as tmp:
        script = os.path.join(tmp, "soak_worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        for kvtype, faults in JOBS:
            print(f"[soak] {kvtype}{' with faults' if faults else ''} for {seconds:.0f} s", file=sys.stderr, flush=True)
            row = soak_job(kvtype, faults, seconds, args.sample_every, args.warmup, script)
            if not row["ok"]:
                print(f"[soak] the {kvtype} job failed (exit {row['code']}):\n{row['output']}", file=sys.stderr)
            rows.append(row)
    print(report(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "kvps soak " + " ".join(argv or sys.argv[1:]), "rows": rows}, f, indent=1)
    too_big = [r for r in rows for g in r["growth"].values()
               if args.max_growth is not None and g["mb_per_min"] > args.max_growth]
    return 0 if all(r["ok"] for r in rows) and not too_big else 1
