"""A torch.distributed (gloo) job on 127.0.0.1 for `kvps bench compare`: W ranks of gloo_worker.py.

    job = GlooJob(2, "plan.json", logdir).start()
    code = job.wait(timeout=300)          # 0, the first failing rank's exit code, or TIMED_OUT
    job.output("W0"); job.logs()

The rendezvous is a TCPStore held by this (parent) process, bound to port 0: the ranks are told
its port, so no free port is guessed and raced for. Each rank runs in a session of its own;
only those children are ever signalled (by process group, SIGTERM then SIGKILL). Every wait has
a deadline, and a rank that fails stops the job at once.
"""
import datetime
import os
import subprocess
import sys

from kvps.launcher import stop_processes, wait_children

TIMED_OUT = 124            # wait()'s result when the deadline passes (as timeout(1))
STOP_TIMEOUT = 5.0         # seconds between SIGTERM and SIGKILL
POLL = 0.05                # seconds between checks of the children


class GlooJob:
    """The ranks of one gloo job; logs go to files gloo-W<rank>.log in `logdir`."""

    def __init__(self, num_workers, plan_path, logdir, collective_timeout=120.0, env=None, python=None):
        self.num_workers = num_workers
        self.plan_path = plan_path
        self.logdir = logdir
        self.collective_timeout = collective_timeout
        self.python = python or sys.executable
        self.extra_env = dict(env or {})
        self.procs = []            # (name, Popen)
        self.store = None

    def start(self):
        """Open the TCPStore and start every rank; raises OSError (after stopping what started)."""
        import torch.distributed as dist
        self.store = dist.TCPStore("127.0.0.1", 0, None, True,
                                   timeout=datetime.timedelta(seconds=self.collective_timeout),
                                   wait_for_workers=False)
        env = dict(os.environ, **self.extra_env, PYTHONUNBUFFERED="1")
        try:
            for rank in range(self.num_workers):
                argv = [self.python, "-m", "kvps.bench.gloo_worker", self.plan_path, "--rank", str(rank),
                        "--world", str(self.num_workers), "--store", f"127.0.0.1:{self.store.port}",
                        "--timeout", f"{self.collective_timeout:g}"]
                with open(self._log(f"W{rank}"), "wb") as log:
                    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
                self.procs.append((f"W{rank}", proc))
        except OSError:
            self.stop()
            raise
        return self

    def _log(self, name):
        return os.path.join(self.logdir, f"gloo-{name}.log")

    def wait(self, timeout):
        """0 when every rank exited cleanly, the first failure's exit code (a signal as 128+signal),
        or TIMED_OUT. Every rank is stopped on return."""
        try:
            code = wait_children(self.procs, timeout, poll=POLL)
            return TIMED_OUT if code is None else code
        finally:
            self.stop()


    def stop(self):
        """SIGTERM every rank still running, then SIGKILL those still there after STOP_TIMEOUT;
        then close the store."""
        stop_processes([p for _, p in self.procs], STOP_TIMEOUT)
        self.store = None

    def output(self, name):
        with open(self._log(name), errors="replace") as f:
            return f.read()

    def logs(self, tail=3000):
        """Each rank's exit status and the end of its log, for error messages."""
        parts = []
        for name, proc in self.procs:
            status = "running" if proc.poll() is None else f"exit {proc.returncode}"
            parts.append(f"--- gloo {name} ({status})\n{self.output(name)[-tail:].rstrip()}")
        return "\n".join(parts)
