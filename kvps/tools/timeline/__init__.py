"""`kvps timeline merge DIR -o trace.json`: one Chrome trace from the files a job's nodes wrote
under KVPS_TIMELINE=DIR (kvps/metrics/timeline.py), for chrome://tracing and ui.perfetto.dev.

Each file becomes one process, named after its node (H, S0, W1) and sorted scheduler, servers,
workers; its thread names become numbered threads. Every timestamp is moved onto the scheduler's
clock by the node's offset estimate (its best heartbeat round trip), then the whole trace is
shifted so that it starts at 0. Lines that do not parse (a node killed mid-write) are skipped and
counted. Exit codes: 0 written; 2 nothing to merge or a bad argument.
"""
import argparse
import json
import os
import sys

ROLE_ORDER = {"scheduler": 0, "server": 1, "worker": 2}


def read(path):
    """(node info, events, bad line count) of one node's file."""
    info = {"role": "?", "pid": 0, "name": os.path.basename(path), "offset": 0.0, "rtt": float("inf")}
    events, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if not isinstance(record, dict):
                bad += 1
            elif record.get("kind") == "process":
                info.update(role=record.get("role", "?"), pid=record.get("pid", 0))
            elif record.get("kind") == "name":
                info["name"] = record.get("name", info["name"])
            elif record.get("kind") == "offset":
                if record.get("rtt", float("inf")) <= info["rtt"]:
                    info.update(offset=float(record["offset"]), rtt=record["rtt"])
            elif "ph" in record and "ts" in record:
                events.append(record)
            else:
                bad += 1
    return info, events, bad


def _rank(name):
    digits = name[1:]
    return int(digits) if digits.isdigit() else 1 << 30


def merge(directory):
    """The merged trace (a dict with traceEvents) and the number of lines skipped."""
    paths = sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".jsonl"))
    nodes = [read(p) for p in paths]
    nodes.sort(key=lambda n: (ROLE_ORDER.get(n[0]["role"], 3), _rank(n[0]["name"]), n[0]["pid"]))
    out, skipped = [], 0
    start = None
    for pid, (info, events, bad) in enumerate(nodes, start=1):
        skipped += bad
        shift = int(info["offset"] * 1e6)
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": f"{info['name']} ({info['role']}, pid {info['pid']})"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        threads = {}
        for e in events:
            thread = str(e.get("tid", "main"))
            if thread not in threads:
                threads[thread] = len(threads) + 1
                out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": threads[thread],
                            "args": {"name": thread}})
            e = dict(e, pid=pid, tid=threads[thread], ts=int(e["ts"]) + shift)
            start = e["ts"] if start is None else min(start, e["ts"])
            out.append(e)
    for e in out:
        if e["ph"] != "M":
            e["ts"] -= start
    out.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0)))
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"nodes": [n[0]["name"] for n in nodes], "skipped_lines": skipped}}, skipped


def parser():
    p = argparse.ArgumentParser(prog="kvps timeline", description="work with KVPS_TIMELINE=DIR traces")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge a job's per-node files into one Chrome trace")
    m.add_argument("directory", help="the KVPS_TIMELINE directory")
    m.add_argument("-o", "--output", default="trace.json", help="the trace to write (default trace.json)")
    return p


def main(argv=None):
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not os.path.isdir(args.directory):
        print(f"kvps timeline: error: {args.directory!r} is not a directory", file=sys.stderr)
        return 2
    trace, skipped = merge(args.directory)
    nodes = trace["otherData"]["nodes"]
    if not nodes:
        print(f"kvps timeline: error: {args.directory!r} holds no .jsonl timeline files "
              f"(run the job with KVPS_TIMELINE={args.directory})", file=sys.stderr)
        return 2
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(trace, f, separators=(",", ":"))
    events = sum(1 for e in trace["traceEvents"] if e["ph"] != "M")
    print(f"wrote {args.output}: {events} events from {len(nodes)} nodes ({', '.join(nodes)})"
          + (f"; skipped {skipped} unreadable lines" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
