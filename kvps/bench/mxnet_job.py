"""An MXNet dist KVStore job on 127.0.0.1, started and stopped by the benchmark itself.

    job = MXNetJob("~/mxvenv/bin/python", 2, 1, ["kvps/bench/mxnet_worker.py", "plan.json"], logdir)
    code = job.start().wait(timeout=300)      # 0, a worker's exit code, or TIMED_OUT
    job.output("W0"); job.logs()

MXNet (ps-lite) bootstraps from DMLC_* variables: a scheduler on a port we
pick, S servers and W workers; scheduler and servers are plain `import mxnet`
processes whose import runs the server loop. Each child gets its own session,
and only those children (by pid, with their process groups) are ever signalled.
Every wait has a deadline; a child that fails stops the job at once.
"""
import os
import socket
import subprocess

from kvps.launcher import stop_processes, wait_children

TIMED_OUT = 124            # wait()'s result when the deadline passes (as timeout(1))
DRAIN_TIMEOUT = 30.0       # seconds for scheduler and servers to exit after the workers
STOP_TIMEOUT = 5.0         # seconds between SIGTERM and SIGKILL
POLL = 0.05                # seconds between checks of the children

# Variables of the kvps environment that must not leak into MXNet's interpreter.
_DROP = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "__PYVENV_LAUNCHER__")


def free_port(host="127.0.0.1"):
    """A port that is free now. ps-lite's scheduler cannot report the port it bound, so the
    parent has to choose one; another process may take it first (the job then fails, loudly)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def environ(extra=None):
    """The environment for MXNet's processes: this one without kvps's interpreter settings and
    DMLC_* leftovers, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in _DROP and not k.startswith("DMLC_")}
    env.update(extra or {})
    return env


def check_python(python, timeout=60.0):
    """None when `python -c 'import mxnet'` works, else what it said (or that it hung)."""
    env = environ()
    try:
        done = subprocess.run([python, "-c", "import mxnet; print(mxnet.__version__)"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    except FileNotFoundError:
        return f"{python} does not exist"
    except PermissionError:
        return f"{python} is not executable"
    except subprocess.TimeoutExpired:
        return f"'{python} -c \"import mxnet\"' did not finish within {timeout:g} s"
    if done.returncode:
        return done.stdout.decode(errors="replace")[-2000:]
    return None


class MXNetJob:
    """Scheduler, servers and workers of one MXNet job; logs go to files in `logdir`."""

    def __init__(self, python, num_workers, num_servers, worker_args, logdir, env=None):
        self.python = python
        self.num_workers, self.num_servers = num_workers, num_servers
        self.worker_args = list(worker_args)
        self.logdir = logdir
        self.env = environ(env)
        self.procs = []            # (name, Popen)
        self.port = None

    def start(self):
        self.port = free_port()
        base = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(self.port),
                "DMLC_NODE_HOST": "127.0.0.1", "DMLC_NUM_SERVER": str(self.num_servers),
                "DMLC_NUM_WORKER": str(self.num_workers), "PYTHONUNBUFFERED": "1"}
        try:
            self._spawn("H", [self.python, "-c", "import mxnet"], dict(base, DMLC_ROLE="scheduler"))
            for rank in range(self.num_servers):
                self._spawn(f"S{rank}", [self.python, "-c", "import mxnet"], dict(base, DMLC_ROLE="server"))
            for rank in range(self.num_workers):
                # ps-lite assigns worker ranks itself; the log names are only the start order.
                self._spawn(f"W{rank}", [self.python, *self.worker_args], dict(base, DMLC_ROLE="worker"))
        except OSError:
            self.stop()
            raise
        return self

    def _spawn(self, name, argv, extra):
        with open(self._log(name), "wb") as log:
            proc = subprocess.Popen(argv, env=dict(self.env, **extra), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append((name, proc))

    def _log(self, name):
        return os.path.join(self.logdir, f"mxnet-{name}.log")

    def wait(self, timeout):
        """Wait until every worker has exited, then for the daemons (DRAIN_TIMEOUT).

        Returns 0 when all exited cleanly, the first failure's exit code (a signal as
        128+signal) when a child failed, or TIMED_OUT. Every child is stopped on return.
        """
        try:
            code = wait_children(self.procs, timeout, DRAIN_TIMEOUT, poll=POLL)
            return TIMED_OUT if code is None else code
        finally:
            self.stop()


    def stop(self):
        """SIGTERM every child still running, then SIGKILL those still there after STOP_TIMEOUT."""
        stop_processes([p for _, p in self.procs], STOP_TIMEOUT)

    def output(self, name):
        with open(self._log(name), errors="replace") as f:
            return f.read()

    def logs(self, tail=3000):
        """Each child's exit status and the end of its log, for error messages."""
        parts = []
        for name, proc in self.procs:
            text = self.output(name)[-tail:]
            status = "running" if proc.poll() is None else f"exit {proc.returncode}"
            parts.append(f"--- MXNet {name} ({status})\n{text.rstrip()}")
        return "\n".join(parts)
