"""An MXNet dist KVStore job on 127.0.0.1, started and stopped by the benchmark itself.

    job = MXNetJob("~/mxvenv/bin/python", 2, 1, ["kvps/tools/bench/mxnet_worker.py", "plan.json"], logdir)
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

from kvps.supervisor import DRAIN_TIMEOUT     # seconds for scheduler and servers to exit after the workers

from kvps.tools.bench.logged_job import LoggedJob

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


class MXNetJob(LoggedJob):
    """Scheduler, servers and workers of one MXNet job; logs go to files mxnet-<name>.log in `logdir`.
    wait() gives the scheduler and servers DRAIN_TIMEOUT to exit after the workers."""

    prefix, label, drain = "mxnet", "MXNet", DRAIN_TIMEOUT

    def __init__(self, python, num_workers, num_servers, worker_args, logdir, env=None):
        super().__init__(logdir)
        self.python = python
        self.num_workers, self.num_servers = num_workers, num_servers
        self.worker_args = list(worker_args)
        self.env = environ(env)
        self.port = None

    def start(self):
        self.port = free_port()
        base = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(self.port),
                "DMLC_NODE_HOST": "127.0.0.1", "DMLC_NUM_SERVER": str(self.num_servers),
                "DMLC_NUM_WORKER": str(self.num_workers), "PYTHONUNBUFFERED": "1"}
        try:
            self._node("H", [self.python, "-c", "import mxnet"], dict(base, DMLC_ROLE="scheduler"))
            for rank in range(self.num_servers):
                self._node(f"S{rank}", [self.python, "-c", "import mxnet"], dict(base, DMLC_ROLE="server"))
            for rank in range(self.num_workers):
                # ps-lite assigns worker ranks itself; the log names are only the start order.
                self._node(f"W{rank}", [self.python, *self.worker_args], dict(base, DMLC_ROLE="worker"))
        except OSError:
            self.stop()
            raise
        return self

    def _node(self, name, argv, extra):
        self._spawn(name, argv, dict(self.env, **extra))
