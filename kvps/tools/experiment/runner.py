"""Run one experiment job under `kvps launch`, with a deadline, and read back its JSON lines.

    result = run(spec, delay=0.0021, timeout=120, say=print)

The command is `python -m kvps.cli launch -n W -s S [--straggler R=fixed:D] -- python -m
kvps.tools.experiment.workloads.X --kvstore TYPE [--compression JSON] ...` (the mode gives TYPE and
the compression); the straggler is the last worker (never rank 0, which evaluates). An emulated
cell (spec.net a rate) runs under `python -m kvps.cli emulate -n W -s S --rate RATE --timeout T --
...` instead: every node on a host of its own with its own link (kvps/tools/emulate), the
workers' output prefixed as `kvps launch` prefixes it.

Progress lines go to `say` while it runs. The result is a plain dict (it goes into results.json
as it is): the spec, status ("ok", "failed", "timeout"), exit code, wall time, rank 0's evaluation points, every worker's final line, the servers' counters, and for a run
that did not succeed an error and the tail of its output.

The launcher runs in a session of its own (kvps.supervisor), and keeps its children in its process
group (kvps.launch.job). A run past its deadline is stopped: SIGINT to the launcher, which stops the
scheduler, servers and workers it started (by pid); SIGKILL to its process group if it has not
exited 15 s later. Either way, whatever is left in that group once the launcher has exited (a child
it was still starting) is killed with it, so no process of a run outlives it.
"""
import json
import os
import shlex
import signal
import sys
import time

from kvps.supervisor import Supervisor

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


EMULATE_MARGIN = 10.0      # seconds `kvps emulate` stops its job before the run's own deadline (its cleanup)


def command(spec, straggler=None, seed=0, python=None, timeout=180.0):
    """The argv that launches the run."""
    python = python or sys.executable
    script = [python, "-m", WORKLOADS[spec.workload].module, "--kvstore", spec.kvstore, *spec.mode_args, *spec.args]
    if spec.net != "local":
        if straggler:
            raise ValueError(f"{spec.id}: an emulated run cannot have a straggler (every worker gets one environment)")
        return [python, "-m", "kvps.cli", "emulate", "-n", str(spec.workers), "-s", str(spec.servers), "--rate",
                spec.net, "--timeout", f"{max(5.0, timeout - EMULATE_MARGIN):g}", "--", *script]
    argv = [python, "-m", "kvps.cli", "launch", "-n", str(spec.workers), "-s", str(spec.servers)]
    if straggler:
        argv += ["--straggler", f"{straggler['rank']}={straggler['spec']}", "--straggler-seed", str(seed)]
    return argv + ["--", *script]


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


def run(spec, delay=0.0, timeout=180.0, say=print, kind="fixed", seed=0, env=None):
    """Run one job; returns its result dict (never raises for a failed or hung job)."""
    straggler = straggler_of(spec, delay, kind)
    argv = command(spec, straggler, seed, timeout=timeout)
    result = {"id": spec.id, "cell": spec.id, "workload": spec.workload, "mode": spec.mode, "kvstore": spec.kvstore,
              "workers": spec.workers, "servers": spec.servers, "straggler": straggler, "net": spec.net,
              "args": [*spec.mode_args, *spec.args], "command": shown_command(argv),
              "status": None, "exit_code": None, "wall_s": None, "error": None,
              "points": [], "finals": [], "server": None, "tail": []}
    env = {**os.environ, **THREAD_ENV, **(env or {})}
    # A call that hangs inside the job fails by itself before the run's deadline, with a message.
    env.setdefault("KVPS_TIMEOUT", str(max(10, int(timeout / 2))))
    shown = -PROGRESS_EVERY

    def on_line(name, line):             # in the supervisor's output thread, one line at a time
        nonlocal shown
        parsed = parse_line(line)
        if parsed is None:
            return
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

    launcher = Supervisor(on_line, tail_lines=TAIL_LINES)
    start = time.monotonic()
    finished = False
    try:
        launcher.spawn("launch", argv, env=env)
        finished = launcher.wait_any(timeout) is not None
    finally:        # Ctrl-C included; SIGINT alone: the launcher stops its children by itself
        launcher.stop(STOP_GRACE, signal.SIGINT, group=False)
    result["wall_s"] = round(time.monotonic() - start, 3)
    result["exit_code"] = launcher.poll()["launch"]
    result["finals"].sort(key=lambda f: f.get("rank", 0))
    if not finished:
        result["status"] = "timeout"
        result["error"] = f"no result within the {timeout:g} s deadline; stopped the job"
    else:
        result["status"], result["error"] = _judge(result, spec.workers)
    if result["status"] != "ok":
        result["tail"] = launcher.tail("launch")
    return result


def _judge(result, workers):
    if result["exit_code"] != 0:
        tool = "kvps emulate" if result.get("net", "local") != "local" else "kvps launch"
        return "failed", f"{tool} exited with code {result['exit_code']}"
    missing = sorted(set(range(workers)) - {f.get("rank") for f in result["finals"]})
    if missing:
        return "failed", "no final line from " + ", ".join(f"W{r}" for r in missing)
    if not result["points"]:
        return "failed", "rank 0 printed no evaluation point"
    return "ok", None
