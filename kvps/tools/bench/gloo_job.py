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
import sys

from kvps.tools.bench.logged_job import LoggedJob


class GlooJob(LoggedJob):
    """The ranks of one gloo job; logs go to files gloo-W<rank>.log in `logdir`."""

    prefix = label = "gloo"

    def __init__(self, num_workers, plan_path, logdir, collective_timeout=120.0, env=None, python=None):
        super().__init__(logdir)
        self.num_workers = num_workers
        self.plan_path = plan_path
        self.collective_timeout = collective_timeout
        self.python = python or sys.executable
        self.extra_env = dict(env or {})
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
                self._spawn(f"W{rank}", [self.python, "-m", "kvps.tools.bench.gloo_worker", self.plan_path,
                                         "--rank", str(rank), "--world", str(self.num_workers),
                                         "--store", f"127.0.0.1:{self.store.port}",
                                         "--timeout", f"{self.collective_timeout:g}"], env)
        except OSError:
            self.stop()
            raise
        return self

    def stop(self):
        """Stop every rank still running (LoggedJob.stop), then close the store."""
        super().stop()
        self.store = None
