"""Run one experiment job under `kvps launch`, with a deadline, and read back its JSON lines.

    result = run(spec, delay=0.0021, timeout=120, say=print)

The command is `python -m kvps.cli launch -n W -s S [--straggler R=fixed:D] -- python -m
kvps.tools.experiment.workloads.X --kvstore TYPE ...`; the straggler is the last worker (never rank 0, which
evaluates). Progress lines go to `say` while it runs. The result is a plain dict (it goes into
results.json as it is): the spec, status ("ok", "failed", "timeout"), exit code, wall time,
rank 0's evaluation points, every worker's final line, the servers' counters, and for a run
that did not succeed an error and the tail of its output.

A run past its deadline is stopped: SIGINT to the launcher, which stops the scheduler, servers
and workers it started (by pid); SIGKILL to the launcher if it has not exited 15 s later, and
to any child it left behind (one it was still starting), known by pid and start time.
"""
import collections
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time

from kvps.tools.experiment.presets import WORKLOADS

TAIL_LINES = 40
STOP_GRACE = 15.0          # seconds the launcher gets to stop its children after SIGINT
PROGRESS_EVERY = 1.0       # seconds of training between progress lines
# One thread per BLAS/OpenMP pool: a job's processes already outnumber the cores.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              "NUMBA_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def straggler_of(spec, delay, kind="fixed"):
    """{"rank", "delay_s", "spec"} for a run with the straggler, else None."""
    if not spec.straggler:
        return None
    text = f"{kind}:{delay:.6f}".rstrip("0").rstrip(".") if kind in ("fixed", "exp") else kind
    return {"rank": spec.workers - 1, "delay_s": delay, "kind": kind, "spec": text}


def command(spec, straggler=None, seed=0, python=None):
    """The argv that launches the run."""
    python = python or sys.executable
    argv = [python, "-m", "kvps.cli", "launch", "-n", str(spec.workers), "-s", str(spec.servers)]
    if straggler:
        argv += ["--straggler", f"{straggler['rank']}={straggler['spec']}", "--straggler-seed", str(seed)]
    return argv + ["--", python, "-m", WORKLOADS[spec.workload].module, "--kvstore", spec.kvstore, *spec.args]


def shown_command(argv):
    """The argv as a shell line, with 'python' for this interpreter."""
    return shlex.join("python" if a == sys.executable else a for a in argv)


def parse_line(line):
    """(rank, record) for a worker's JSON line as the launcher prints it ("[W2] {...}"), else None."""
    if not line.startswith("[W"):
        return None
    head, sep, text = line.partition("] ")
    if not sep or not head[2:].isdigit() or not text.startswith("{"):
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return (int(head[2:]), record) if isinstance(record, dict) and "event" in record else None


def _reader(stream, lines):
    for line in iter(stream.readline, ""):
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _stat(pid):
    """(parent pid, start time) of a process from /proc, or None (gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()      # after the command name: field 3 onwards
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _children(pid):
    """{child pid: its start time} for the processes whose parent is `pid`."""
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return {}
    stats = {e: _stat(e) for e in entries}
    return {e: st[1] for e, st in stats.items() if st and st[0] == pid}


def _stop(proc):
    """Stop the launcher: SIGINT, on which it stops the children it started; SIGKILL if it will not.
    Children it leaves behind (interrupted while it was starting them) are killed by pid, each
    checked by its start time first so that a reused pid is never hit."""
    if proc.poll() is not None:
        return
    children = _children(proc.pid)
    try:
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(STOP_GRACE)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait(STOP_GRACE)
    except ProcessLookupError:
        pass
    for pid, started in children.items():
        st = _stat(pid)
        if st and st[1] == started:
            _kill_group(pid)


def _kill_group(pid):
    """SIGKILL the session a process leads (the launcher starts each child in its own)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)       # not a session leader: the process alone
        except (ProcessLookupError, PermissionError):
            pass


def run(spec, delay=0.0, timeout=180.0, say=print, kind="fixed", seed=0, env=None):
    """Run one job; returns its result dict (never raises for a failed or hung job)."""
    straggler = straggler_of(spec, delay, kind)
    argv = command(spec, straggler, seed)
    result = {"id": spec.id, "workload": spec.workload, "mode": spec.mode, "kvstore": spec.kvstore,
              "workers": spec.workers, "servers": spec.servers, "straggler": straggler,
              "args": list(spec.args), "command": shown_command(argv),
              "status": None, "exit_code": None, "wall_s": None, "error": None,
              "points": [], "finals": [], "server": None, "tail": []}
    env = {**os.environ, **THREAD_ENV, **(env or {})}
    # A call that hangs inside the job fails by itself before the run's deadline, with a message.
    env.setdefault("KVPS_TIMEOUT", str(max(10, int(timeout / 2))))
    tail = collections.deque(maxlen=TAIL_LINES)
    lines = queue.Queue()
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    reader = threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True)
    reader.start()
    shown = -PROGRESS_EVERY
    try:
        while True:
            left = start + timeout - time.monotonic()
            if left <= 0:
                _timed_out(proc, result, timeout)
                break
            try:
                line = lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:                        # the launcher closed its output: it is exiting
                try:
                    proc.wait(max(1.0, start + timeout - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _timed_out(proc, result, timeout)
                break
            tail.append(line)
            parsed = parse_line(line)
            if parsed is None:
                continue
            rank, record = parsed
            if record["event"] == "point" and rank == 0:
                result["points"].append(record)
                if record["time"] - shown >= PROGRESS_EVERY:
                    shown = record["time"]
                    say(f"    t={record['time']:5.1f} s  updates={record['updates']:6d}  "
                        f"loss={record['loss']:.4f}  accuracy={record['accuracy']:.3f}")
            elif record["event"] == "final":
                result["finals"].append(record)
                if record.get("server") is not None:
                    result["server"] = record["server"]
    except KeyboardInterrupt:
        _stop(proc)
        raise
    finally:
        reader.join(5)
    result["wall_s"] = round(time.monotonic() - start, 3)
    result["exit_code"] = proc.returncode
    result["finals"].sort(key=lambda f: f.get("rank", 0))
    if result["status"] is None:
        result["status"], result["error"] = _judge(result, spec.workers)
    if result["status"] != "ok":
        result["tail"] = list(tail)
    return result


def _timed_out(proc, result, timeout):
    _stop(proc)
    result["status"] = "timeout"
    result["error"] = f"no result within the {timeout:g} s deadline; stopped the job"


def _judge(result, workers):
    if result["exit_code"] != 0:
        return "failed", f"kvps launch exited with code {result['exit_code']}"
    missing = sorted(set(range(workers)) - {f.get("rank") for f in result["finals"]})
    if missing:
        return "failed", "no final line from " + ", ".join(f"W{r}" for r in missing)
    if not result["points"]:
        return "failed", "rank 0 printed no evaluation point"
    return "ok", None
