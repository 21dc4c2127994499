"""The timeline (KVPS_TIMELINE=DIR): each process appends Chrome trace events to a file of its own.

    tl = Timeline("/tmp/tl", "worker")              # writes /tmp/tl/worker-<pid>.jsonl
    tl.name("W0"); tl.offset(0.0012, rtt=0.0003)    # its node name; the scheduler's clock minus ours
    tl.complete("push", "call", start, end, {"key": "w", "bytes": 4096})    # start, end: time.time()
    tl.close()

One JSON object a line: trace events (Chrome's "X" complete and "i" instant events, "s"/"f" flow
events) with `ts`/`dur` in microseconds of this process's wall clock, and records of kind "name"
and "offset" that `kvps timeline merge` (kvps/tools/timeline) uses to give every node one process
in the merged trace and to shift its clock onto the scheduler's. Lines are buffered and flushed
at least every FLUSH_SECONDS and at exit, so a node that is killed loses at most that much.
Events come from several threads (the I/O thread, the caller's): one lock orders the writes.
"""
import json
import os
import threading
import time
import weakref
import zlib

FLUSH_SECONDS = 1.0


def flow_id(node, request_id):
    """The id that ties a request's events on its sender and its receiver together (a flow)."""
    return (zlib.crc32(node.encode()) << 24) ^ int(request_id)


class Timeline:
    def __init__(self, directory, role):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"{role}-{os.getpid()}.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self._flushed = time.monotonic()
        self._record({"kind": "process", "role": role, "pid": os.getpid()})
        # at exit (or when dropped), what is buffered reaches the file; the finalizer holds the file, not us
        self._closer = weakref.finalize(self, _close, self._file, self._lock)

    # ---- records ----
    def name(self, node):
        self._record({"kind": "name", "name": node})

    def offset(self, seconds, rtt):
        self._record({"kind": "offset", "offset": seconds, "rtt": rtt})

    # ---- trace events (times are time.time() seconds) ----
    def complete(self, name, cat, start, end, args=None, tid=None):
        self._event({"ph": "X", "name": name, "cat": cat, "ts": _us(start), "dur": max(0, _us(end) - _us(start)),
                     "tid": tid or threading.current_thread().name, "args": args or {}})

    def instant(self, name, cat, at, args=None, tid=None):
        self._event({"ph": "i", "s": "t", "name": name, "cat": cat, "ts": _us(at),
                     "tid": tid or threading.current_thread().name, "args": args or {}})

    def flow(self, phase, ident, cat, at, tid=None):
        """A flow's start ("s") or end ("f"): chrome://tracing draws an arrow between them."""
        event = {"ph": phase, "name": "request", "cat": cat, "id": ident, "ts": _us(at),
                 "tid": tid or threading.current_thread().name}
        if phase == "f":
            event["bp"] = "e"
        self._event(event)

    def _event(self, event):
        self._record(event)

    def _record(self, record):
        line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            if self._file.closed:
                return
            self._file.write(line)
            now = time.monotonic()
            if now - self._flushed > FLUSH_SECONDS:
                self._file.flush()
                self._flushed = now

    def close(self):
        self._closer()


def _close(file, lock):
    with lock:
        if not file.closed:
            file.close()


def _us(seconds):
    return int(seconds * 1e6)
