"""`kvps bench checkpoint`: kv.save and kv.load throughput against a plain copy of the same bytes.

    kvps bench checkpoint                      # 2 servers, 256 MB of float32 weights with Adam (768 MB saved)
    kvps bench checkpoint --mb 16 --repeat 1   # a smoke run, seconds

Starts a kvps job (kvps.launch.Job) whose workers run checkpoint_worker.py: it saves the servers'
state (weights and optimizer moments) to a directory, copies the very files it wrote with
shutil.copyfile and an fsync per file (the baseline: the same bytes, durable, by the plain way),
and loads the checkpoint back, --repeat times. Prints a table of medians: seconds, GB/s, and
kvps's throughput as a share of the copy's. The page cache is warm for all three (the save has
just written what the copy and the load read), so the figures are the software's, not the disk's.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile

from kvps.tools.bench.pushpull import JobFailed, kvps_job, results


def parser():
    p = argparse.ArgumentParser(prog="kvps bench checkpoint",
                                description="checkpoint save and load throughput against a plain file copy")
    p.add_argument("-n", "--workers", type=int, default=1, help="workers (default 1)")
    p.add_argument("-s", "--servers", type=int, default=2, help="servers (default 2)")
    p.add_argument("--mb", type=float, default=256, help="megabytes of float32 weights (default 256)")
    p.add_argument("--keys", type=int, default=8, help="keys the weights are split into (default 8)")
    p.add_argument("--optimizer", default="adam", help="server optimizer: adam (2 moments), sgd, or none")
    p.add_argument("--repeat", type=int, default=3, help="repetitions; the table shows medians (default 3)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory here)")
    p.add_argument("--timeout", type=float, default=600, help="seconds the job may take (default 600)")
    p.add_argument("-v", "--verbose", action="store_true", help="echo the job's output")
    return p


def table(rows):
    """The markdown table of the medians of result rows."""
    nbytes = rows[0]["bytes"]
    med = {k: statistics.median(r[k] for r in rows) for k in ("save_s", "load_s", "copy_s")}
    gbs = {k: nbytes / v / 1e9 for k, v in med.items()}
    lines = [f"checkpoint of {nbytes / 1e6:.1f} MB ({rows[0]['servers']} servers, {rows[0]['workers']} workers), "
             f"median of {len(rows)}", "",
             "| operation | seconds | GB/s | plain copy s | copy GB/s | kvps / copy throughput |",
             "|---|---|---|---|---|---|"]
    for op in ("save", "load"):
        lines.append(f"| kv.{op} | {med[op + '_s']:.3f} | {gbs[op + '_s']:.2f} | {med['copy_s']:.3f} | "
                     f"{gbs['copy_s']:.2f} | {gbs[op + '_s'] / gbs['copy_s']:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    args = parser().parse_args(argv)
    if args.repeat < 1 or args.mb <= 0 or args.keys < 1:
        print("kvps bench checkpoint: --repeat, --mb and --keys must be positive", file=sys.stderr)
        return 2
    directory = tempfile.mkdtemp(prefix="kvps-bench-ckpt-", dir=args.dir or os.getcwd())
    try:
        command = [sys.executable, "-m", "kvps.tools.bench.checkpoint_worker", directory, str(args.mb),
                   str(args.keys), args.optimizer, str(args.repeat)]
        text = kvps_job(args.workers, args.servers, command, {}, args.timeout, args.verbose, "checkpoint")
    except JobFailed as exc:
        print(f"kvps bench checkpoint: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    rows = results(text)
    if len(rows) != args.repeat:
        print(f"kvps bench checkpoint: expected {args.repeat} result lines, got {len(rows)}\n{text[-4000:]}",
              file=sys.stderr)
        return 1
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
