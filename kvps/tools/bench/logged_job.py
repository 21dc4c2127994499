"""What the benchmarks' baseline jobs (gloo_job.py, mxnet_job.py) share: child processes started
in sessions of their own, their output in one log file each, waited for with a deadline and
stopped by pid (SIGTERM, then SIGKILL) -- never a process the job did not start (kvps.supervisor)."""
import os
import subprocess
import time

from kvps.supervisor import STOP_GRACE, Supervisor, exit_code

TIMED_OUT = 124            # wait()'s result when the deadline passes (as timeout(1))
STOP_TIMEOUT = STOP_GRACE  # seconds between SIGTERM and SIGKILL


class LoggedJob:
    """Children named H, S<j>, W<i>; the job is done when every W has exited."""

    prefix = "job"         # log files are PREFIX-<name>.log in logdir
    label = "job"          # names the children in logs()
    drain = 0.0            # seconds the other children get to exit once the workers have

    def __init__(self, logdir):
        self.logdir = logdir
        self.children = Supervisor()       # output to the log files only

    @property
    def procs(self):
        """[(name, Popen)] in start order."""
        return list(self.children.procs.items())

    def _spawn(self, name, argv, env):
        self.children.spawn(name, argv, env=env, log=self._log(name), stdin=subprocess.DEVNULL)

    def _log(self, name):
        return os.path.join(self.logdir, f"{self.prefix}-{name}.log")

    def wait(self, timeout):
        """Wait until every worker has exited, then up to `drain` for the others. Returns 0 when all
        exited cleanly, the first failure's exit code (a signal as 128+signal), or TIMED_OUT. A child
        that fails ends the wait at once. Every child is stopped on return."""
        deadline = time.monotonic() + timeout
        workers = [n for n in self.children.procs if n.startswith("W")]
        try:
            while self.children.running(workers):
                exited = self.children.wait_any(deadline - time.monotonic())
                if exited is None:
                    return TIMED_OUT
                if exited[1]:
                    return exit_code(exited[1])
            self.children.wait(min(self.drain, max(0.0, deadline - time.monotonic())))
            failed = [code for code in self.children.poll().values() if code]
            return exit_code(failed[0]) if failed else 0
        finally:
            self.stop()

    def stop(self):
        """SIGTERM every child still running, then SIGKILL those still there after STOP_TIMEOUT."""
        self.children.stop(STOP_TIMEOUT)

    def output(self, name):
        with open(self._log(name), errors="replace") as f:
            return f.read()

    def logs(self, tail=3000):
        """Each child's exit status and the end of its log, for error messages."""
        parts = []
        for name, code in self.children.poll().items():
            status = "running" if code is None else f"exit {code}"
            parts.append(f"--- {self.label} {name} ({status})\n{self.output(name)[-tail:].rstrip()}")
        return "\n".join(parts)
